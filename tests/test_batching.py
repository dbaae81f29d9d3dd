"""Concurrent generate requests on one model, through real workers: they run side by side,
each stream as if alone, and one request's cancel, error or slow reader leaves the others be."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import TORCH_ENV, SpawnWorker
from worker.host import Host


def interleaved(host: Host, ids: list) -> bool:
    """Whether every request sent a chunk before any of them answered."""
    first_answer = next(i for i, m in enumerate(host.messages) if m.get("id") in ids and "method" not in m)
    chunked = {m["params"]["id"] for m in host.messages[:first_answer] if m.get("method") == "generate/chunk"}
    return chunked == set(ids)


def overlapped(host: Host, first, second) -> bool:
    """Whether two requests streamed at the same time: chunks of each between chunks of the other."""
    order = [m["params"]["id"] for m in host.messages if m.get("method") == "generate/chunk"]
    spans = [[i for i, msg_id in enumerate(order) if msg_id == which] for which in (first, second)]
    return spans[0][0] < spans[1][-1] and spans[1][0] < spans[0][-1]


async def echo(spawn_worker: SpawnWorker, *flags: str, delay_ms: float = 20) -> Host:
    host = await spawn_worker(*flags)
    await host.call("load", {"backend": "echo", "token_delay_ms": delay_ms})
    return host


async def test_concurrent_generates_stream_side_by_side_each_as_if_alone(spawn_worker: SpawnWorker):
    host = await echo(spawn_worker)
    prompts = ["first stream", "second one", "third, longer stream of text", "4th"]
    started = [host.start("generate", {"prompt": p, "add_special_tokens": False}) for p in prompts]
    results = [(await done)["result"] for _, done in started]
    assert [r["text"] for r in results] == prompts
    assert interleaved(host, [i for i, _ in started])
    for (msg_id, _), result in zip(started, results):
        assert "".join(c["text"] for c in host.chunks[msg_id]) == result["text"]
        assert [c["index"] for c in host.chunks[msg_id]] == list(range(len(host.chunks[msg_id])))


async def test_eight_requests_sent_together_with_more_than_a_chunk_of_prompts_decode_together(spawn_worker: SpawnWorker):
    """Eight 45-token prompts (315 tokens besides the first's, past one chunk): every stream's
    first token comes before any stream's third, so none joined beside the others' steps."""
    host = await echo(spawn_worker)
    started = [host.start("generate", {"prompt": letter * 45, "add_special_tokens": False}) for letter in "abcdefgh"]
    for (_, done), letter in zip(started, "abcdefgh"):
        assert (await done)["result"]["text"] == letter * 45
    order = [m["params"]["id"] for m in host.messages if m.get("method") == "generate/chunk"]
    third = next(i for i, msg_id in enumerate(order) if order[: i + 1].count(msg_id) == 3)  # any stream's third chunk
    assert set(order[:third]) == {msg_id for msg_id, _ in started}


async def test_a_request_joins_running_streams_mid_stream_and_they_keep_flowing(spawn_worker: SpawnWorker):
    host = await echo(spawn_worker)
    first_id, first = host.start("generate", {"prompt": "a" * 40, "add_special_tokens": False})
    await host.wait_until(lambda: len(host.chunks[first_id]) >= 5)
    second_id, second = host.start("generate", {"prompt": "b" * 10, "add_special_tokens": False})
    assert (await second)["result"]["text"] == "b" * 10
    assert not first.done(), "the running stream ended before the one that joined it"
    assert (await first)["result"]["text"] == "a" * 40


async def test_requests_past_max_batch_wait_and_start_as_others_leave(spawn_worker: SpawnWorker):
    host = await echo(spawn_worker, "--max-batch", "2")
    started = [host.start("generate", {"prompt": p * 8, "add_special_tokens": False}) for p in "abc"]
    results = [(await done)["result"] for _, done in started]
    assert [r["text"] for r in results] == [p * 8 for p in "abc"]
    third_id = started[2][0]
    first_of_third = next(i for i, m in enumerate(host.messages) if m.get("params", {}).get("id") == third_id)
    answers = [i for i, m in enumerate(host.messages) if m.get("id") in (started[0][0], started[1][0])]
    assert min(answers) < first_of_third, "the third request started before one of the first two ended"
    assert results[2]["timings"]["queued_ms"] > results[0]["timings"]["queued_ms"]


async def test_cancel_of_one_of_four_streams_ends_it_and_the_others_finish_whole(spawn_worker: SpawnWorker):
    host = await echo(spawn_worker)
    started = [host.start("generate", {"prompt": str(i) * 30, "add_special_tokens": False}) for i in range(4)]
    victim = started[1][0]
    await host.wait_until(lambda: len(host.chunks[victim]) >= 3)
    assert await host.call("cancel", {"id": victim}) == {"cancelled": True, "state": "running"}
    results = [(await done)["result"] for _, done in started]
    assert results[1]["finish_reason"] == "cancelled" and len(results[1]["text"]) < 30
    assert [r["text"] for i, r in enumerate(results) if i != 1] == [str(i) * 30 for i in (0, 2, 3)]
    assert all(r["finish_reason"] == "stop" for i, r in enumerate(results) if i != 1)


async def test_a_bad_request_among_running_streams_gets_its_error_and_the_others_finish(spawn_worker: SpawnWorker):
    host = await echo(spawn_worker)
    running = [host.start("generate", {"prompt": p * 20, "add_special_tokens": False}) for p in "xy"]
    await host.wait_until(lambda: all(host.chunks[i] for i, _ in running))
    overflow = await host.start("generate", {"prompt": "z", "max_tokens": 1 << 21})[1]
    outside = await host.start("generate", {"tokens": [1, 99999]})[1]
    assert overflow["error"]["data"]["kind"] == "context_overflow"
    assert outside["error"]["data"]["field"] == "params.tokens[1]"
    assert [(await done)["result"]["text"] for _, done in running] == ["x" * 20, "y" * 20]


async def test_shutdown_during_a_batch_cancels_the_streams_and_answers_after_them(spawn_worker: SpawnWorker):
    host = await echo(spawn_worker)
    started = [host.start("generate", {"prompt": p * 50, "add_special_tokens": False}) for p in "ab"]
    await host.wait_until(lambda: all(host.chunks[i] for i, _ in started))
    shutdown_id, shutdown = host.start("shutdown")
    assert (await shutdown)["result"] is None
    order = [m.get("id") for m in host.messages if "method" not in m]
    assert order.index(shutdown_id) > max(order.index(i) for i, _ in started)
    assert [(await done)["result"]["finish_reason"] for _, done in started] == ["cancelled", "cancelled"]
    await host.notify("exit")
    assert await host.wait(10) == 0


async def test_a_stream_whose_reader_falls_behind_is_held_and_the_others_keep_streaming(spawn_worker: SpawnWorker):
    """stream_window: the worker sends at most that many chunks past the last acknowledged one;
    the rest of a slow reader's text waits, merged, and comes whole before the result."""
    host = await echo(spawn_worker, delay_ms=5)
    slow_id, slow = host.start("generate", {"prompt": "s" * 40, "add_special_tokens": False, "stream_window": 2})
    fast_id, fast = host.start("generate", {"prompt": "f" * 40, "add_special_tokens": False, "stream_window": 2})
    acked = -1
    while not fast.done():  # the host takes the fast stream's chunks as they come, and not the slow one's
        await asyncio.sleep(0.005)
        if host.chunks[fast_id] and host.chunks[fast_id][-1]["index"] > acked:
            acked = host.chunks[fast_id][-1]["index"]
            await host.notify("generate/ack", {"id": fast_id, "index": acked})
    slow_result, fast_result = (await slow)["result"], (await fast)["result"]
    assert fast_result["text"] == "f" * 40 and slow_result["text"] == "s" * 40
    assert len(host.chunks[fast_id]) > 10
    slow_chunks = host.chunks[slow_id]
    assert len(slow_chunks) == 3, "two chunks, then the rest merged into one at the end"
    assert "".join(c["text"] for c in slow_chunks) == "s" * 40
    assert slow_chunks[-1]["generated_tokens"] == slow_result["usage"]["completion_tokens"]


async def test_an_ack_lets_a_held_stream_flow_again(spawn_worker: SpawnWorker):
    host = await echo(spawn_worker, delay_ms=10)
    msg_id, done = host.start("generate", {"prompt": "w" * 60, "add_special_tokens": False, "stream_window": 1})
    await host.wait_until(lambda: len(host.chunks[msg_id]) == 1)
    await asyncio.sleep(0.1)
    assert len(host.chunks[msg_id]) == 1, "a chunk went out past the window"
    await host.notify("generate/ack", {"id": msg_id, "index": 0})
    await host.wait_until(lambda: len(host.chunks[msg_id]) == 2)
    assert len(host.chunks[msg_id][1]["text"]) > 1, "the held text came merged into one chunk"
    assert (await done)["result"]["text"] == "w" * 60


# --- on real models: greedy tokens side by side equal those alone ---


async def test_streams_in_a_batch_equal_each_request_alone_with_caches_in_it(cache_model, tmp_path: Path, device: str):
    """On every family of cache layers (the Llama and Gemma 3 families step them in one pass,
    Qwen3.5 in turn). In the batch: a greedy request, one from a named cache, a seeded sampled one with
    auto, and one that joins while the others decode."""
    host = await Host.start_in_process("--cache-dir", str(tmp_path / "caches"))
    try:
        await host.call("load", {"model": cache_model, "device": device}, timeout=300)
        system = "the cat sat on the mat and the dog runs quickly to the river. " * 3
        # Prompts every model here continues for at least 16 tokens; the first runs to its 300
        # (SmolLM2 ended "The river is" after 29), so that the others join it while it decodes
        # even on a crowded machine (their prompts may come a token a round beside it). Which
        # prompt a model runs that long from depends on its numbers, so on the device's (a tiny
        # model of 512 tokens ends a 300-token run about half the time, at its end token).
        openings = ["The river is long and the river is", "Once upon a time", "In the morning", "The dog", "Why"]
        long = await first_to_run_its_length(host, [{"prompt": system + o, "max_tokens": 300} for o in openings])
        requests = [
            long["params"],
            {"prompt": system + "And the sea?", "max_tokens": 16},
            {"prompt": "hello world, the sun", "temperature": 0.9, "seed": 7, "max_tokens": 16},
            {"prompt": system + "Then the dog", "max_tokens": 16},
        ]
        alone = [long["tokens"]] + [(await host.call("generate", r))["tokens"] for r in requests[1:]]
        ids = (await host.call("tokenize", {"text": requests[1]["prompt"]}))["tokens"]
        await host.call("prefill", {"tokens": ids[:30], "cache": "system"})  # a prefix of that prompt's tokens
        caches = [{}, {"cache": "system"}, {"cache": "auto"}, {"cache": "auto"}]
        started = [host.start("generate", {**r, **c}) for r, c in zip(requests[:3], caches)]
        await host.wait_until(lambda: len(host.chunks[started[0][0]]) >= 2, timeout=120)
        started.append(host.start("generate", {**requests[3], **caches[3]}))
        results = [(await done)["result"] for _, done in started]
        assert [r["tokens"] for r in results] == alone
        assert results[0]["finish_reason"] == "length", "the first request must outlast the others to be joined"
        assert results[1]["usage"]["cache_read_tokens"] > 0
        assert overlapped(host, started[0][0], started[1][0]) and overlapped(host, started[0][0], started[3][0])
    finally:
        await host.close()



@pytest.mark.parametrize("family", ["llama", "gemma3"])
async def test_prompts_that_start_together_are_fed_in_one_pass_and_each_stream_equals_it_alone(
    tiny_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
):
    """Four requests that start together (sent behind a load, which runs alone, so that all four
    are waiting when it ends: sent at once to an idle worker, the first may be fed before the
    others are read) go through one pass of the model together (its weights read once for all),
    and each stream's greedy tokens are those it gets alone."""
    from worker.backends.transformers.local_model import LocalModel  # the second load's: without torch

    passes: list[int] = []
    step = LocalModel.step

    def counted(self, decodings, chunks=()):
        passes.append(len(chunks))
        return step(self, decodings, chunks)

    host = await Host.start_in_process("--cache-dir", str(tmp_path / "caches"))
    try:
        await host.call("load", {"model": str(tiny_models(family))}, timeout=300)
        requests = [{"prompt": f"{opening} the river runs to the sea and", "max_tokens": 12}
                    for opening in ("Once", "In the morning", "The dog saw that", "Why")]
        alone = [(await host.call("generate", r))["tokens"] for r in requests]
        monkeypatch.setattr(LocalModel, "step", counted)
        _, loaded = host.start("load", {"model": str(tiny_models(family))})
        started = [host.start("generate", r) for r in requests]
        assert "result" in await loaded
        together = [(await done)["result"]["tokens"] for _, done in started]
    finally:
        await host.close()
    assert together == alone
    assert passes[0] == 4, f"the four prompts were not fed in one pass: chunks per pass {passes}"

async def first_to_run_its_length(host: Host, candidates: list[dict]) -> dict:
    """The first of ``candidates`` that the loaded model continues to its max_tokens alone, with
    its tokens: a stream that others can join while it decodes."""
    for params in candidates:
        result = await host.call("generate", params, timeout=300)
        if result["finish_reason"] == "length":
            return {"params": params, "tokens": result["tokens"]}
    raise AssertionError("the model ends every candidate prompt early here, so no stream outlasts the others")


@pytest.mark.slow
async def test_four_smollm2_streams_in_one_batch_equal_each_alone(spawn_worker: SpawnWorker):
    host = await spawn_worker(env=TORCH_ENV)
    await host.call("load", {"model": "default"}, timeout=600)
    # Answers that run past max_tokens: the last prompt is fed (in small chunks beside the
    # streams already decoding) while the first still decodes.
    topics = ["the history of Rome", "how rain forms", "the rules of chess", "the life of bees"]
    questions = [f"Write a long, detailed essay about {topic}." for topic in topics]
    params = [{"messages": [{"role": "user", "content": q}], "max_tokens": 48} for q in questions]
    alone = [(await host.call("generate", p, timeout=300))["tokens"] for p in params]
    started = [host.start("generate", p) for p in params]
    together = [(await asyncio.wait_for(done, 600))["result"]["tokens"] for _, done in started]
    assert together == alone
    ids = [msg_id for msg_id, _ in started]
    assert all(any(overlapped(host, one, other) for other in ids if other != one) for one in ids)
