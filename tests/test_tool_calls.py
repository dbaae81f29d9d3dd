"""Tools through real workers: how they reach the model, the calls read back (streamed as each
completes), calls forced by tool_choice, and the errors a host gets for tools it misuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import TORCH_ENV, SpawnWorker
from worker.host import Host, WorkerError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


async def tiny(spawn_worker: SpawnWorker, model_dir: Path) -> Host:
    host = await spawn_worker(env=TORCH_ENV)
    await host.call("load", {"model": str(model_dir)}, timeout=300)
    return host


async def test_a_call_in_the_output_is_parsed_streamed_once_and_kept_out_of_content(echo_worker: Host):
    said = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    msg_id, done = echo_worker.start("generate", {"prompt": said, "tools": [WEATHER], "add_special_tokens": False})
    result = (await done)["result"]
    assert result["text"] == said and result["content"] == "Checking. "
    assert result["finish_reason"] == "tool_calls"
    [call] = result["tool_calls"]
    assert (call["name"], call["arguments"], call["error"]) == ("get_weather", {"city": "Paris"}, None)
    chunks = echo_worker.chunks[msg_id]
    assert [c["tool_calls"] for c in chunks if c["tool_calls"]] == [[call]]
    assert "".join(c["content"] for c in chunks) == result["content"]
    # The call arrives with the chunk of its closing tag, before the stream ends.
    assert chunks[-1]["tool_calls"] == [] or chunks[-1]["text"].endswith(">")


async def test_a_malformed_call_is_reported_with_its_raw_text_and_the_request_stops(echo_worker: Host):
    said = '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>'
    result = await echo_worker.call("generate", {"prompt": said, "tools": [WEATHER], "add_special_tokens": False})
    [call] = result["tool_calls"]
    assert call["arguments"] is None and "not a JSON object" in call["error"]
    assert call["raw"] == '{"name": "get_weather", "arguments": {"city": Paris}}'
    assert result["finish_reason"] == "stop"


async def test_tool_choice_none_leaves_calls_as_text(echo_worker: Host):
    said = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    result = await echo_worker.call(
        "generate", {"prompt": said, "tools": [WEATHER], "tool_choice": "none", "add_special_tokens": False}
    )
    assert result["tool_calls"] == [] and result["content"] == said and result["finish_reason"] == "stop"


async def test_tool_choice_none_keeps_the_prompt_of_auto_so_a_tool_loop_keeps_its_cache(
    spawn_worker: SpawnWorker, tiny_model_dir: Path
):
    host = await tiny(spawn_worker, tiny_model_dir)
    prompts = [
        (await host.call("generate", {"messages": ASK, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 1}))
        for choice in ("auto", "none")
    ]
    assert prompts[0]["usage"]["prompt_tokens"] == prompts[1]["usage"]["prompt_tokens"]
    rendered = await host.call("render", {"messages": ASK, "tools": [WEATHER]})
    assert prompts[1]["usage"]["prompt_tokens"] == rendered["count"]


async def test_tool_choice_required_makes_even_a_random_model_call_a_tool(spawn_worker: SpawnWorker, tiny_model_dir: Path):
    host = await tiny(spawn_worker, tiny_model_dir)
    result = await host.call(
        "generate",
        {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200},
    )
    assert result["finish_reason"] == "tool_calls" and len(result["tool_calls"]) == 1
    for call in result["tool_calls"]:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]
        jsonschema.validate(call["arguments"], tool["function"]["parameters"])
    named = await host.call(
        "generate",
        {
            "messages": ASK,
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "parallel_tool_calls": False,
        },
    )
    assert {call["name"] for call in named["tool_calls"]} == {"get_time"}


async def test_a_tool_turn_and_its_result_continue_from_the_auto_cache(spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path):
    host = await spawn_worker("--cache-dir", str(tmp_path), env=TORCH_ENV)
    await host.call("load", {"model": str(tiny_model_dir)}, timeout=300)
    first = await host.call(
        "generate",
        {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "cache": "auto", "max_tokens": 200},
    )
    [call] = first["tool_calls"]
    turn = {
        "role": "assistant",
        "content": first["content"],
        "tool_calls": [{"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}],
    }
    answer = {"role": "tool", "tool_call_id": call["id"], "name": call["name"], "content": '{"sky": "clear"}'}
    second = await host.call(
        "generate", {"messages": [*ASK, turn, answer], "tools": [WEATHER], "cache": "auto", "max_tokens": 4}
    )
    rendered = await host.call("render", {"messages": [*ASK, turn, answer], "tools": [WEATHER]})
    # The call is written back into the conversation as the grammar made the model write it:
    # the whole first turn is reused.
    assert second["usage"]["cache_read_tokens"] == first["cache"]["stored_tokens"]
    assert second["usage"]["prompt_tokens"] == rendered["count"]


async def test_a_template_without_tools_gets_them_as_a_system_message(spawn_worker: SpawnWorker, tiny_model_dir: Path):
    host = await tiny(spawn_worker, tiny_model_dir)
    info = (await host.call("capabilities"))["model"]["tool_calls"]
    assert info == {"template_takes_tools": False, "format": "hermes", "forced": True}
    turn = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    messages = [{"role": "system", "content": "Be brief."}, *ASK, turn, {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    text = (await host.call("render", {"messages": messages, "tools": [WEATHER]}))["text"]
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(WEATHER) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>" in text


TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') | join(', ') }}"
    "\nCall them as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{%- endfor %}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


async def test_a_template_that_takes_tools_renders_them_itself(spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path):
    model_dir = tmp_path / "with-tools"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    host = await tiny(spawn_worker, model_dir)
    info = (await host.call("capabilities"))["model"]["tool_calls"]
    assert info == {"template_takes_tools": True, "format": "hermes", "forced": True}
    turn = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}
    text = (await host.call("render", {"messages": [*ASK, turn], "tools": [WEATHER, TIME]}))["text"]
    assert text.startswith("<|im_start|>system\nTools: get_weather, get_time\n")
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>' in text
    result = await host.call(
        "generate", {"messages": ASK, "tools": [TIME], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 100}
    )
    assert result["finish_reason"] == "tool_calls" and result["tool_calls"][0]["arguments"]["zone"] in ("UTC", "CET")


@pytest.mark.parametrize(
    ("params", "field", "says"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "launch"}}}, "params.tool_choice.function.name", "launch"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "params.response_format", "give one"),
        ({"tools": None, "tool_choice": "required"}, "params.tool_choice", "no tools are given"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "params.tools[0].function.name", ""),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "params.tools[0].type", ""),
    ],
)
async def test_misused_tools_are_invalid_params_naming_the_field(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, params: dict, field: str, says: str
):
    host = await tiny(spawn_worker, tiny_model_dir)
    with pytest.raises(WorkerError) as refused:
        await host.call("generate", {"messages": ASK, "tools": [WEATHER], **params})
    assert refused.value.code == -32602 and refused.value.data["field"] == field and says in refused.value.message


async def test_the_echo_backend_cannot_force_a_call(echo_worker: Host):
    with pytest.raises(WorkerError) as refused:
        await echo_worker.call("generate", {"messages": ASK, "tools": [WEATHER], "tool_choice": "required"})
    assert refused.value.kind == "unsupported"


@pytest.mark.slow
async def test_smollm2_asked_for_the_weather_calls_the_weather_tool(spawn_worker: SpawnWorker):
    host = await spawn_worker(env=TORCH_ENV)
    await host.call("load", {"model": "default"}, timeout=600)
    result = await host.call(
        "generate",
        {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60},
        timeout=300,
    )
    assert result["finish_reason"] == "tool_calls"
    call = result["tool_calls"][0]
    assert call["name"] == "get_weather" and call["arguments"]["city"] == "Paris"
    jsonschema.validate(call["arguments"], WEATHER["function"]["parameters"])


ADDRESS = {  # as Pydantic writes a model with a nested one: local $refs into $defs
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {"to": {"$ref": "#/$defs/Address"}},
    "required": ["to"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("parameters", "valid_against"),
    [
        (ADDRESS, ADDRESS),
        # No "type": an arguments object all the same.
        ({"properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}, None),
    ],
)
async def test_a_forced_call_matches_a_schema_with_local_refs_or_without_a_type(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, parameters: dict, valid_against: dict | None
):
    host = await tiny(spawn_worker, tiny_model_dir)
    tool = {"type": "function", "function": {"name": "ship", "parameters": parameters}}
    result = await host.call(
        "generate",
        {"messages": ASK, "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200},
    )
    [call] = result["tool_calls"]
    assert call["error"] is None and result["finish_reason"] == "tool_calls"
    jsonschema.validate(call["arguments"], valid_against or {**parameters, "type": "object"})


@pytest.mark.parametrize(
    ("tools", "field", "says"),
    [
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "integer"}}}], "params.tools[0].function.parameters", "JSON object"),
        (
            [
                {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "b", "parameters": {"not": {"type": "object"}}}},
            ],
            "params.tools[1].function.parameters",
            '"not"',
        ),
        (
            [{"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object"}}} for i in range(2001)],
            "params.tool_choice",
            "2001 items",
        ),
        (
            [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}],
            "params.tools[1].function.name",
            "both named 'a'",
        ),
    ],
)
async def test_tools_that_cannot_be_forced_are_invalid_params_naming_the_tool_briefly(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tools: list, field: str, says: str
):
    host = await tiny(spawn_worker, tiny_model_dir)
    with pytest.raises(WorkerError) as refused:
        await host.call("generate", {"prompt": "x", "tools": tools, "tool_choice": "required"})
    assert refused.value.code == -32602 and refused.value.data["field"] == field
    assert says in refused.value.message and len(refused.value.message) < 500
    assert (await host.call("generate", {"prompt": "x", "max_tokens": 1}))["usage"]["completion_tokens"] == 1
