"""The protocol's behaviour, written once and run against every backend that can take it: the
transformers backend (the tiny model, in this process) and the openai backend on a real vLLM
server (slow tier). Where a backend legitimately differs, the test says so by name."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest

from tests.json_schemas import SCHEMAS
from tests.test_openai_backend import engine_load
from worker.host import Host

BACKENDS = ["transformers", pytest.param("openai", marks=pytest.mark.slow)]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False},
    },
}


@pytest.fixture(params=BACKENDS)
async def loaded(request: pytest.FixtureRequest, spawn_worker, tmp_path: Path) -> Host:
    host = await spawn_worker("--cache-dir", str(tmp_path / "caches"))
    if request.param == "openai":
        await host.call("load", engine_load(request.getfixturevalue("vllm_url")))
    else:
        await host.call("load", {"model": str(request.getfixturevalue("tiny_model_dir"))}, timeout=300)
    return host


def shelves(items: int) -> str:
    return " ".join(f"Item {i} is on shelf {i % 7}." for i in range(items))


async def generate(host: Host, params: dict) -> tuple[dict, list[dict]]:
    msg_id, done = host.start("generate", params)
    answer = await asyncio.wait_for(done, 600)
    assert "result" in answer, answer
    return answer["result"], host.chunks[msg_id]


async def test_streamed_chunks_concatenate_to_the_result_and_their_counts_add_up(loaded: Host):
    result, chunks = await generate(loaded, {"prompt": "The history of the city of Rome begins", "max_tokens": 20})
    counted = await loaded.call("tokenize", {"text": "The history of the city of Rome begins"})
    assert "".join(c["text"] for c in chunks) == result["text"]
    assert [t for c in chunks for t in c["tokens"]] == result["tokens"]
    assert [c["generated_tokens"] for c in chunks] == sorted(c["generated_tokens"] for c in chunks)
    assert chunks[-1]["generated_tokens"] == result["usage"]["completion_tokens"] == len(result["tokens"])
    assert chunks[-1]["prompt_tokens"] == result["usage"]["prompt_tokens"] == counted["count"]


async def test_a_stop_string_ends_the_text_just_before_it(loaded: Host):
    params = {"prompt": "Count: 1, 2, 3, 4,", "max_tokens": 24}
    free, _ = await generate(loaded, params)
    stop = free["text"][len(free["text"]) // 2 :][:3]  # three characters from the middle of the free text
    assert stop.strip(), free["text"]
    stopped, chunks = await generate(loaded, {**params, "stop": [stop]})
    assert stopped["text"] == free["text"][: free["text"].index(stop)]
    assert "".join(c["text"] for c in chunks) == stopped["text"], "a stop string is never streamed and taken back"
    assert (stopped["finish_reason"], stopped["stop_reason"]["stop"]) == ("stop", stop)


async def test_a_cancelled_generate_answers_with_its_partial_text(loaded: Host):
    msg_id, done = loaded.start("generate", {"prompt": "Once upon a time", "max_tokens": 1500})
    await loaded.wait_until(lambda: len(loaded.chunks[msg_id]) >= 3, timeout=300)
    await loaded.call("cancel", {"id": msg_id})
    result = (await asyncio.wait_for(done, 60))["result"]
    assert result["finish_reason"] == "cancelled" and 3 <= result["usage"]["completion_tokens"] < 1500
    assert "".join(c["text"] for c in loaded.chunks[msg_id]) == result["text"]


async def test_output_validates_against_each_of_ten_schemas(loaded: Host):
    for name, schema in SCHEMAS.items():
        params = {
            "messages": [{"role": "user", "content": f"Reply with a {name.replace('_', ' ')} in JSON."}],
            "max_tokens": 200,
            "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
        }
        result, chunks = await generate(loaded, params)
        assert result["finish_reason"] == "stop", (name, result["text"])
        jsonschema.validate(json.loads(result["text"]), schema)
        assert "".join(c["text"] for c in chunks) == result["text"]


async def test_a_required_tool_call_is_streamed_once_whole_and_parsed(loaded: Host):
    params = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER],
              "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200}
    result, chunks = await generate(loaded, params)
    streamed = [call for chunk in chunks for call in chunk["tool_calls"]]
    assert result["finish_reason"] == "tool_calls", result
    assert streamed == result["tool_calls"] and len(streamed) == 1
    call = streamed[0]
    assert call["name"] == "get_weather" and call["error"] is None and isinstance(call["arguments"]["city"], str)
    assert call["id"].startswith("call_")


async def test_a_repeated_long_prefix_is_read_from_a_cache_on_the_second_request(loaded: Host):
    items = 40
    while (await loaded.call("tokenize", {"text": shelves(items)}))["count"] < 1050:  # each model's tokens
        items += 10
    questions = [shelves(items) + " Where is item 3?", shelves(items) + " Where is item 9?"]
    counts = [(await loaded.call("tokenize", {"text": q}))["count"] for q in questions]
    first, _ = await generate(loaded, {"prompt": questions[0], "max_tokens": 4, "cache": "auto"})
    second, chunks = await generate(loaded, {"prompt": questions[1], "max_tokens": 4, "cache": "auto"})
    assert second["usage"]["cache_read_tokens"] > 1000
    assert second["cache"]["reused_tokens"] == second["usage"]["cache_read_tokens"] == chunks[-1]["cache_read_tokens"]
    assert first["usage"]["prompt_tokens"] == counts[0] and second["usage"]["prompt_tokens"] == counts[1]


async def test_a_slow_readers_stream_is_held_to_its_window_and_comes_whole_at_the_end(loaded: Host):
    msg_id, done = loaded.start("generate", {"prompt": "Count: 1, 2, 3, 4,", "max_tokens": 40, "stream_window": 2})
    result = (await asyncio.wait_for(done, 600))["result"]
    chunks = loaded.chunks[msg_id]
    assert len(chunks) == 3, "two chunks, then the rest merged into one at the end"
    assert "".join(c["text"] for c in chunks) == result["text"]
    assert chunks[-1]["generated_tokens"] == result["usage"]["completion_tokens"] == 40


async def test_render_and_detokenize_agree_with_tokenize(loaded: Host):
    rendered = await loaded.call("render", {"messages": [{"role": "user", "content": "Hello there"}]})
    assert rendered["count"] == len(rendered["tokens"]) and "Hello there" in rendered["text"]
    tokens = (await loaded.call("tokenize", {"text": "Hello there", "add_special_tokens": False}))["tokens"]
    assert (await loaded.call("detokenize", {"tokens": tokens}))["text"] == "Hello there"


async def test_the_same_seed_samples_the_same_tokens(loaded: Host):
    params = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": 1234}
    first, _ = await generate(loaded, params)
    again, _ = await generate(loaded, params)
    other, _ = await generate(loaded, {**params, "seed": 99})
    assert first["tokens"] == again["tokens"] and first["tokens"] != other["tokens"]
