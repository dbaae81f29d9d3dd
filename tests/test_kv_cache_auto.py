"""cache: "auto" through the worker: the longest stored prefix is reused exactly, each turn is
stored for the next, across a restart; damaged caches are skipped with the reason said."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.host import Host, WorkerError
from tests.test_kv_cache import QUESTION, SYSTEM, cache_dir, greedy, worker  # noqa: F401 (fixture)


async def chat(host: Host, messages: list[dict], **extra) -> dict:
    return await host.call("generate", {"messages": messages, "max_tokens": 12, **extra}, timeout=300)


async def test_auto_reuses_each_earlier_turn_exactly_across_three_turns_and_a_restart(cache_model, cache_dir, device):
    turns = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]]
    results, uncached, prompts = [], [], []
    host = await worker(cache_model, cache_dir, device)
    try:
        for turn in range(3):
            if turn == 2:  # the third turn comes after a restart: the caches are read from disk
                await host.close()
                host = await worker(cache_model, cache_dir, device)
            messages = turns[-1]
            uncached.append(await chat(host, messages))
            prompts.append((await host.call("render", {"messages": messages}))["count"])
            results.append(await chat(host, messages, cache="auto"))
            answer = {"role": "assistant", "content": results[-1]["text"]}
            turns.append(messages + [answer, {"role": "user", "content": f"and then {turn}?"}])
    finally:
        await host.close()
    for result, plain in zip(results, uncached):
        assert result["tokens"] == plain["tokens"]
    first, second, third = (r["cache"] for r in results)
    assert first["mode"] == "auto" and first["ref"] is None and first["reused_tokens"] == 0
    assert first["reason"] == "no cache of this model is stored yet"
    for use, result, prompt in zip((first, second, third), results, prompts):
        assert use["stored"].startswith("auto-") and use["store_reason"] is None
        assert use["stored_tokens"] == prompt + len(result["tokens"]) - 1  # the last token was never fed
        assert result["usage"]["cache_write_tokens"] == use["stored_tokens"] - use["reused_tokens"]
        assert result["usage"]["cache_read_tokens"] == use["reused_tokens"]
    # Each turn starts where the one before it stored, at least its whole prompt.
    assert second["ref"] == first["stored"] and second["reused_tokens"] >= prompts[0]
    assert third["ref"] == second["stored"] and third["reused_tokens"] >= prompts[1]
    assert (cache_dir / f"{third['stored']}.kvc").is_file()


async def test_auto_says_why_nothing_was_reused_and_stores_a_sequence_only_once(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        first = await greedy(host, SYSTEM, cache="auto")
        again = await greedy(host, SYSTEM, cache="auto")
        other = await greedy(host, "a prompt that starts some other way", cache="auto")
        listed = await host.call("cache/list")
    finally:
        await host.close()
    assert again["tokens"] == first["tokens"]
    assert again["cache"]["ref"] == first["cache"]["stored"]
    assert again["cache"]["stored"] is None
    assert again["cache"]["store_reason"].startswith(f"nothing new to store: {first['cache']['stored']!r}")
    assert other["cache"]["ref"] is None and "too few to be worth loading" in other["cache"]["reason"]
    assert sorted(c["cache"] for c in listed["caches"]) == sorted([first["cache"]["stored"], other["cache"]["stored"]])


async def test_auto_skips_a_damaged_cache_says_why_and_replaces_it(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        plain = await greedy(host, SYSTEM + QUESTION)
        stored = (await greedy(host, SYSTEM + QUESTION, cache="auto"))["cache"]["stored"]
        path = cache_dir / f"{stored}.kvc"
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF  # inside the last tensor: the header still lists the cache
        path.write_bytes(bytes(data))
        (cache_dir / "foreign.kvc").write_bytes(b"not a cache at all " * 10)
        damaged = await greedy(host, SYSTEM + QUESTION, cache="auto")
        healed = await greedy(host, SYSTEM + QUESTION, cache="auto")
    finally:
        await host.close()
    assert damaged["tokens"] == healed["tokens"] == plain["tokens"]
    use = damaged["cache"]
    assert use["ref"] is None and use["reused_tokens"] == 0
    reasons = {s["ref"]: s["reason"] for s in use["skipped"]}
    assert "checksum mismatch" in reasons[stored] and "not a KVC3 cache file" in reasons["foreign"]
    assert use["reason"] == "the caches sharing a prefix with this prompt could not be used (see skipped)"
    assert use["stored"] == stored  # the damaged file was rewritten whole
    assert healed["cache"]["ref"] == stored, healed["cache"]
    assert healed["cache"]["reused_tokens"] > 0


async def test_cache_trim_tokens_limits_what_a_named_cache_gives_and_needs_a_ref(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        plain = await greedy(host, SYSTEM + QUESTION)
        await host.call("prefill", {"prompt": SYSTEM + "a different ending", "cache": "other"})
        with pytest.raises(WorkerError) as caught:
            await greedy(host, SYSTEM + QUESTION, cache="other")
        assert caught.value.kind == "cache_prefix_mismatch"
        shared = len((await host.call("tokenize", {"text": SYSTEM}))["tokens"]) - 1
        trimmed = await greedy(host, SYSTEM + QUESTION, cache="other", cache_trim_tokens=shared)
        for params in ({"cache_trim_tokens": 3}, {"cache": "auto", "cache_trim_tokens": 3}):
            with pytest.raises(WorkerError) as caught:
                await greedy(host, SYSTEM, **params)
            assert caught.value.kind == "invalid_params"
            assert caught.value.data["field"] == "params.cache_trim_tokens"
    finally:
        await host.close()
    assert trimmed["tokens"] == plain["tokens"] and trimmed["cache"]["reused_tokens"] == shared


async def test_a_long_prefill_reports_its_progress_after_each_chunk(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        tokens = [(i * 7) % 500 + 3 for i in range(600)]
        request_id, answer = host.start("prefill", {"tokens": tokens, "cache": "long"})
        result = (await answer)["result"]
        short_id, short = host.start("prefill", {"tokens": tokens[:40], "cache": "short"})
        await short
    finally:
        await host.close()
    progress = [m["params"] for m in host.messages if m.get("method") == "prefill/progress"]
    assert [p["processed_tokens"] for p in progress if p["id"] == request_id] == [256, 512, 600]
    assert all(p["total_tokens"] == result["token_count"] == 600 for p in progress)
    assert not [p for p in progress if p["id"] == short_id]  # one chunk: nothing to report


async def test_auto_on_a_backend_without_a_cache_generates_and_says_why(spawn_worker):
    host = await spawn_worker()
    await host.call("load", {"backend": "echo"})
    result = await host.call("generate", {"prompt": "hello", "cache": "auto", "max_tokens": 3})
    assert result["text"] and result["cache"]["reused_tokens"] == 0
    assert result["cache"]["reason"] == result["cache"]["store_reason"] == "the echo backend keeps no KV cache"


async def test_an_auto_cache_a_later_turn_extends_is_replaced_by_the_longer_one(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        prompt = (await host.call("tokenize", {"text": SYSTEM}))["tokens"]
        first = await host.call("generate", {"tokens": prompt, "max_tokens": 4, "cache": "auto"})
        longer = prompt + first["tokens"] + prompt[1:6]
        second = await host.call("generate", {"tokens": longer, "max_tokens": 4, "cache": "auto"})
        plain = await host.call("generate", {"tokens": longer, "max_tokens": 4})
    finally:
        await host.close()
    assert second["tokens"] == plain["tokens"]
    assert second["cache"]["ref"] == first["cache"]["stored"]
    assert second["cache"]["reused_tokens"] == len(prompt) + len(first["tokens"]) - 1
    assert [p.stem for p in cache_dir.glob("*.kvc")] == [second["cache"]["stored"]]


def test_auto_stores_nothing_for_a_generate_cancelled_before_its_first_chunk(tmp_path: Path):
    from worker.caching import AUTO, RequestCache
    from worker.kvcache.store import CacheStore

    class NothingComputed:  # a model whose cache is still empty
        def cached_tokens(self, cache) -> int:
            return 0

    cache = RequestCache(CacheStore(tmp_path), NothingComputed(), [1, 2, 3], object(), mode=AUTO)
    report = cache.finish([])
    assert report.use.stored is None and report.use.store_reason.startswith("nothing was computed")
    assert report.written_tokens == 0
    assert list(tmp_path.iterdir()) == []


async def test_an_auto_prefill_is_where_auto_generates_start_and_builds_on_what_is_stored(cache_model, cache_dir, device):
    system = [{"role": "system", "content": SYSTEM}]
    conversation = system + [{"role": "user", "content": QUESTION}]
    host = await worker(cache_model, cache_dir, device)
    try:
        plain = await chat(host, conversation)
        warm = await host.call("prefill", {"messages": system, "add_generation_prompt": False, "cache": "auto"})
        longer = await host.call("prefill", {"messages": conversation, "cache": "auto"}, timeout=300)
        cached = await chat(host, conversation, cache="auto")
    finally:
        await host.close()
    assert warm["cache"].startswith("auto-") and warm["cache_read_tokens"] == 0
    assert longer["cache"].startswith("auto-") and longer["cache"] != warm["cache"]
    assert 0 < longer["cache_read_tokens"] <= warm["token_count"], "the second prefill starts from the first"
    assert cached["tokens"] == plain["tokens"]
    assert cached["cache"]["ref"] == longer["cache"] and cached["cache"]["reused_tokens"] == longer["token_count"] - 1


async def test_a_prefill_under_a_ref_that_auto_would_delete_is_refused_naming_the_field(tiny_model_dir, cache_dir):
    """auto deletes an auto- cache once a longer one extends it: a host's own cache there would go."""
    host = await worker(tiny_model_dir, cache_dir)
    try:
        with pytest.raises(WorkerError) as refused:
            await host.call("prefill", {"prompt": SYSTEM, "cache": "auto-0123456789abcdef01234567"})
        stored = await host.call("prefill", {"prompt": SYSTEM, "cache": "auto"})
        listed = await host.call("cache/list")
    finally:
        await host.close()
    assert (refused.value.code, refused.value.data["field"]) == (-32602, "params.cache")
    assert [c["cache"] for c in listed["caches"]] == [stored["cache"]], "only the one auto made"
