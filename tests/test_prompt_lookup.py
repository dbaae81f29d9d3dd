"""Prompt-lookup drafting: the draft itself, and generations with ``draft`` through real
workers, whose output must equal the same request without it token for token (greedy, seeded
sampling, constrained, from caches, batched, stopped in the middle of a checked draft)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import TORCH_ENV, SpawnWorker
from worker.host import Host, WorkerError
from worker.prompt_lookup import draft

DRAFT = {"method": "prompt_lookup", "draft_tokens": 6, "ngram_max": 3, "ngram_min": 1}
# Output that repeats its prompt: a function written again with one name changed.
CODE = (
    "def total(items):\n    result = 0\n    for item in items:\n        result += item.price * item.count\n"
    "    return result\n\nRename total to subtotal:\n\ndef subtotal(items):\n    result = 0\n"
)


def test_the_draft_is_what_followed_the_latest_earlier_occurrence_of_the_tail():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert draft(tokens, draft_tokens=2, ngram_max=3, ngram_min=1) == [7, 8]


def test_the_longest_tail_that_occurred_before_wins_over_a_later_shorter_one():
    tokens = [4, 2, 3, 5, 6, 9, 3, 7, 4, 2, 3]  # "3" alone was last followed by 7; "2 3" by 5
    assert draft(tokens, draft_tokens=2, ngram_max=2, ngram_min=1) == [5, 6]
    assert draft(tokens, draft_tokens=2, ngram_max=1, ngram_min=1) == [7, 4]


def test_no_draft_without_an_earlier_occurrence_or_room():
    assert draft([1, 2, 3, 4], draft_tokens=4, ngram_max=3, ngram_min=1) == []
    assert draft([5, 6, 5, 6], draft_tokens=4, ngram_max=3, ngram_min=3) == []
    assert draft([5, 6, 5, 6], draft_tokens=0, ngram_max=2, ngram_min=1) == []


def test_a_draft_stops_at_the_end_of_the_sequence():
    assert draft([7, 1, 7], draft_tokens=8, ngram_max=1, ngram_min=1) == [1, 7]


async def loaded(spawn_worker: SpawnWorker, model: str, *flags: str, **load) -> Host:
    host = await spawn_worker(*flags, env=TORCH_ENV)
    await host.call("load", {"model": model, **load}, timeout=600)
    return host


async def with_and_without(host: Host, params: dict) -> tuple[dict, dict]:
    plain = await host.call("generate", params, timeout=300)
    drafted = await host.call("generate", {**params, "draft": DRAFT}, timeout=300)
    return plain, drafted


@pytest.mark.parametrize("family", ["llama", "gemma3"])
async def test_greedy_output_with_a_draft_equals_it_without_and_drafts_are_taken(
    spawn_worker: SpawnWorker, tiny_models, family: str
):
    """On the tiny models (random weights repeat themselves: prompt lookup drafts well); the
    tiny Gemma 3's output runs past its sliding window of 16 positions."""
    host = await loaded(spawn_worker, str(tiny_models(family)))
    plain, drafted = await with_and_without(host, {"prompt": CODE, "max_tokens": 60})
    assert drafted["tokens"] == plain["tokens"] and drafted["text"] == plain["text"]
    timings = drafted["timings"]
    assert 0 < timings["draft_accepted_tokens"] <= timings["draft_tokens"]
    assert plain["timings"]["draft_tokens"] == 0 and drafted["usage"] == plain["usage"]


async def test_streamed_chunks_with_a_draft_add_up_to_the_result_with_counts_one_by_one(
    spawn_worker: SpawnWorker, tiny_model_dir: Path
):
    host = await loaded(spawn_worker, str(tiny_model_dir))
    msg_id, done = host.start("generate", {"prompt": CODE, "max_tokens": 40, "draft": DRAFT})
    result = (await asyncio.wait_for(done, 300))["result"]
    chunks = host.chunks[msg_id]
    assert [t for chunk in chunks for t in chunk["tokens"]] == result["tokens"]
    # one chunk a token, and at the end possibly one with no token that flushes held-back text
    flushed = chunks[-1] if not chunks[-1]["tokens"] else None
    counted = chunks[:-1] if flushed else chunks
    assert [chunk["generated_tokens"] for chunk in counted] == list(range(1, len(result["tokens"]) + 1))
    assert all(len(chunk["tokens"]) == 1 for chunk in counted)
    assert flushed is None or flushed["generated_tokens"] == len(result["tokens"])
    assert result["timings"]["draft_accepted_tokens"] > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 23])
async def test_max_tokens_and_stop_strings_end_a_drafted_generation_where_they_end_a_plain_one(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, max_tokens: int
):
    host = await loaded(spawn_worker, str(tiny_model_dir))
    plain, drafted = await with_and_without(host, {"prompt": CODE, "max_tokens": max_tokens})
    assert drafted["tokens"] == plain["tokens"] and len(drafted["tokens"]) == max_tokens
    text = plain["text"]
    if len(text) > 4:  # a stop string in the middle of the output
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        plain, drafted = await with_and_without(host, {"prompt": CODE, "max_tokens": max_tokens, "stop": [stop]})
        assert (drafted["text"], drafted["stop_reason"]) == (plain["text"], plain["stop_reason"])


async def test_seeded_sampling_with_a_draft_equals_it_without(spawn_worker: SpawnWorker, tiny_model_dir: Path):
    host = await loaded(spawn_worker, str(tiny_model_dir))
    params = {"prompt": CODE, "max_tokens": 40, "temperature": 0.7, "top_k": 5, "seed": 11, "repetition_penalty": 1.1}
    plain, drafted = await with_and_without(host, params)
    assert drafted["tokens"] == plain["tokens"]


async def test_constrained_output_with_a_draft_equals_it_without(spawn_worker: SpawnWorker, tiny_model_dir: Path):
    host = await loaded(spawn_worker, str(tiny_model_dir))
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}}
    params = {
        "prompt": 'JSON: {"items": ["a", "b", "a", "b"]} again:', "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "list", "schema": schema}},
    }
    plain, drafted = await with_and_without(host, params)
    assert drafted["tokens"] == plain["tokens"]


async def test_an_auto_turn_with_a_draft_stores_what_it_output_and_the_next_turn_equals_uncached(
    cache_model: str, tmp_path: Path, spawn_worker: SpawnWorker
):
    """A generation that stops with checked draft positions in its cache stores only its output's."""
    if "qwen3_5" in cache_model:
        pytest.skip("drafting needs a model of the Llama or Gemma 3 architecture")
    host = await loaded(spawn_worker, cache_model, "--cache-dir", str(tmp_path / "caches"))
    first = await host.call("generate", {"prompt": CODE, "max_tokens": 9, "cache": "auto", "draft": DRAFT}, timeout=300)
    assert first["cache"]["stored_tokens"] == first["usage"]["prompt_tokens"] + len(first["tokens"]) - 1
    follow = CODE + first["text"] + "\n    for item in items:"
    cached = await host.call("generate", {"prompt": follow, "max_tokens": 30, "cache": "auto", "draft": DRAFT}, timeout=300)
    uncached = await host.call("generate", {"prompt": follow, "max_tokens": 30}, timeout=300)
    assert cached["cache"]["reused_tokens"] > 0
    assert cached["tokens"] == uncached["tokens"]


async def test_drafting_and_plain_requests_batched_together_each_equal_alone(
    spawn_worker: SpawnWorker, tiny_model_dir: Path
):
    host = await loaded(spawn_worker, str(tiny_model_dir))
    requests = [
        {"prompt": CODE, "max_tokens": 50, "draft": DRAFT},
        {"prompt": "the cat sat on the mat", "max_tokens": 50},
        {"prompt": CODE + "    for", "max_tokens": 50, "draft": {"method": "prompt_lookup"}},
    ]
    alone = [await host.call("generate", params, timeout=300) for params in requests]
    started = [host.start("generate", params) for params in requests]
    together = [(await asyncio.wait_for(done, 300))["result"] for _, done in started]
    assert [r["tokens"] for r in together] == [r["tokens"] for r in alone]


async def test_a_cancel_ends_a_drafted_generation(spawn_worker: SpawnWorker, tiny_model_dir: Path):
    host = await loaded(spawn_worker, str(tiny_model_dir))
    msg_id, done = host.start("generate", {"prompt": CODE, "max_tokens": 1800, "draft": DRAFT})
    await host.wait_until(lambda: len(host.chunks[msg_id]) >= 3, timeout=300)
    await host.call("cancel", {"id": msg_id})
    result = (await asyncio.wait_for(done, 60))["result"]
    assert result["finish_reason"] == "cancelled" and len(result["tokens"]) < 1800


async def test_dense_weights_refuse_a_draft_saying_why(spawn_worker: SpawnWorker, tiny_model_dir: Path):
    host = await loaded(spawn_worker, str(tiny_model_dir), quantization="none")
    with pytest.raises(WorkerError) as refused:
        await host.call("generate", {"prompt": CODE, "draft": DRAFT})
    assert refused.value.data["field"] == "params.draft" and "quantized weights" in refused.value.message
    assert (await host.call("generate", {"prompt": CODE, "max_tokens": 2}))["usage"]["completion_tokens"] == 2


async def test_a_model_of_another_architecture_refuses_a_draft(spawn_worker: SpawnWorker, tiny_models):
    host = await loaded(spawn_worker, str(tiny_models("qwen3_5")))
    with pytest.raises(WorkerError) as refused:
        await host.call("generate", {"prompt": CODE, "draft": DRAFT})
    assert refused.value.data["field"] == "params.draft" and "Llama or Gemma 3 architecture" in refused.value.message


@pytest.mark.parametrize(
    ("draft_params", "field"),
    [
        ({"method": "prompt_lookup", "ngram_min": 3, "ngram_max": 2}, "params.draft.ngram_min"),
        ({"method": "prompt_lookup", "draft_tokens": 0}, "params.draft.draft_tokens"),
        ({"method": "prompt_lookup", "draft_tokens": 65}, "params.draft.draft_tokens"),
        ({"method": "medusa"}, "params.draft"),
        ({"method": "prompt_lookup", "ngram": 2}, "params.draft"),
    ],
)
async def test_malformed_draft_params_are_invalid_params_naming_the_field(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, draft_params: dict, field: str
):
    host = await loaded(spawn_worker, str(tiny_model_dir))
    with pytest.raises(WorkerError) as refused:
        await host.call("generate", {"prompt": "hi", "draft": draft_params})
    assert refused.value.code == -32602 and refused.value.data["field"].startswith(field), refused.value.data


async def test_the_echo_backend_says_it_does_not_draft(echo_worker: Host):
    with pytest.raises(WorkerError) as refused:
        await echo_worker.call("generate", {"prompt": "hi", "draft": DRAFT})
    assert refused.value.data["field"] == "params.draft"


@pytest.mark.slow
async def test_smollm2_rewriting_code_takes_most_drafts_and_equals_plain_greedy(spawn_worker: SpawnWorker):
    host = await loaded(spawn_worker, "default")
    messages = [{"role": "user", "content": "Rename the function total to subtotal and change nothing else:\n\n" + CODE[:110]}]
    plain, drafted = await with_and_without(host, {"messages": messages, "max_tokens": 80})
    assert drafted["tokens"] == plain["tokens"]
    timings = drafted["timings"]
    assert timings["draft_accepted_tokens"] >= timings["draft_tokens"] / 2, timings
