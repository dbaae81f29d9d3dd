"""KV prompt caches through the worker: exact reuse across processes, refusal of anything unsound."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.host import Host, WorkerError
from tests.conftest import TORCH_ENV

SYSTEM = "the cat sat on the mat and the dog runs quickly to the river. " * 3
QUESTION = "hello world, the sun and the moon"


async def worker(model: Path | str, cache_dir: Path, device: str = "cpu", **load) -> Host:
    """A worker on ``model`` (a directory, or "default") using ``cache_dir``, loaded on ``device``."""
    host = await Host.start_in_process("--cache-dir", str(cache_dir))
    await host.call("load", {"model": str(model), "device": device, **load}, timeout=300)
    return host


async def greedy(host: Host, prompt: str, **extra) -> dict:
    return await host.call("generate", {"prompt": prompt, "max_tokens": 24, **extra}, timeout=120)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "caches"


async def test_every_kind_of_cache_gives_the_greedy_output_of_no_cache(cache_model, cache_dir, device):
    """On every family of cache layers. The system prompt is longer than the sliding window of the
    tiny gemma3 model; "other" extends "system", so that it can be cut back to the system prompt
    also on a model with linear-attention state (where a cache is cut back only to positions it
    kept that state at)."""
    system = [{"role": "system", "content": "You are a helpful assistant. Answer in one short sentence. " * 2}]
    chat = system + [{"role": "user", "content": "Which river flows through Paris?"}]
    other = system + [{"role": "user", "content": "Which river flows through Rome?"}]
    first = await worker(cache_model, cache_dir, device)
    try:
        plain = await chat_tokens(first, chat)
        made = await first.call("prefill", {"messages": system, "add_generation_prompt": False, "cache": "system"})
        await first.call("prefill", {"messages": system, "add_generation_prompt": False, "cache": "memory://s"})
        await first.call("prefill", {"messages": chat, "cache": "whole"})
        await first.call("prefill", {"messages": other, "cache": "other", "base": "system"})
        extended = await first.call(
            "prefill", {"messages": chat, "cache": "turn", "base": "other", "trim_to_tokens": made["token_count"]}
        )
        outputs = {
            "memory": await chat_tokens(first, chat, cache="memory://s"),
            "whole prompt": await chat_tokens(first, chat, cache="whole"),
            "trimmed base extended": await chat_tokens(first, chat, cache="turn"),
        }
    finally:
        await first.close()
    second = await worker(cache_model, cache_dir, device)  # another process reads the files
    try:
        outputs["disk, other process"] = await chat_tokens(second, chat, cache="system")
        outputs["trimmed named cache"] = await chat_tokens(
            second, chat, cache="other", cache_trim_tokens=made["token_count"]
        )
    finally:
        await second.close()
    assert extended["cache_read_tokens"] == made["token_count"] > 16  # past the tiny sliding window
    assert len(set(plain)) >= 4, f"the model repeats itself, so equality proves little: {plain}"
    for kind, tokens in outputs.items():
        assert tokens == plain, kind


async def chat_tokens(host: Host, messages: list[dict], **extra) -> list[int]:
    result = await host.call("generate", {"messages": messages, "max_tokens": 16, **extra}, timeout=300)
    assert result["usage"]["cache_read_tokens"] > 0 or "cache" not in extra
    return result["tokens"]


async def test_a_disk_cache_made_by_one_worker_gives_identical_greedy_output_in_another(tiny_model_dir, cache_dir):
    first = await worker(tiny_model_dir, cache_dir)
    try:
        uncached = await greedy(first, SYSTEM + QUESTION)
        made = await first.call("prefill", {"prompt": SYSTEM, "cache": "system"})
    finally:
        await first.close()
    prefix_tokens = made["token_count"]
    assert made["cache_read_tokens"] == 0 and made["cache_write_tokens"] == prefix_tokens
    assert (cache_dir / "system.kvc").is_file() and made["bytes"] == (cache_dir / "system.kvc").stat().st_size
    second = await worker(tiny_model_dir, cache_dir)
    try:
        msg_id, done = second.start("generate", {"prompt": SYSTEM + QUESTION, "max_tokens": 24, "cache": "system"})
        cached = (await done)["result"]
        chunks = second.chunks[msg_id]
        again = await greedy(second, SYSTEM + QUESTION, cache="system")
    finally:
        await second.close()
    assert cached["tokens"] == uncached["tokens"] and cached["text"] == uncached["text"]
    assert cached["usage"]["cache_read_tokens"] == prefix_tokens
    assert all(c["cache_read_tokens"] == prefix_tokens for c in chunks)
    assert cached["cache"]["mode"] == "ref" and cached["cache"]["ref"] == "system"
    assert cached["cache"]["reused_tokens"] == prefix_tokens and cached["cache"]["stored"] is None
    # the prefill ran in another process, so only its own generate reports writes
    assert cached["usage"]["cache_write_tokens"] == 0 and again["usage"]["cache_write_tokens"] == 0


async def test_memory_cache_reuse_is_exact_and_reports_the_prefill_writes_once(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        uncached = await greedy(host, SYSTEM + QUESTION)
        made = await host.call("prefill", {"prompt": SYSTEM, "cache": "memory://system"})
        first = await greedy(host, SYSTEM + QUESTION, cache="memory://system")
        second = await greedy(host, SYSTEM + QUESTION, cache="memory://system")
    finally:
        await host.close()
    assert first["tokens"] == second["tokens"] == uncached["tokens"]
    assert first["usage"]["cache_write_tokens"] == made["cache_write_tokens"] > 0
    assert second["usage"]["cache_write_tokens"] == 0
    assert not cache_dir.exists() or not list(cache_dir.iterdir())


async def test_a_cache_covering_the_whole_prompt_still_refeeds_the_last_token(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        uncached = await greedy(host, SYSTEM)
        made = await host.call("prefill", {"prompt": SYSTEM, "cache": "whole"})
        cached = await greedy(host, SYSTEM, cache="whole")
    finally:
        await host.close()
    assert cached["tokens"] == uncached["tokens"]
    assert cached["usage"]["cache_read_tokens"] == made["token_count"] - 1


async def test_a_trimmed_base_cache_is_extended_into_a_new_one_exactly(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        uncached = await greedy(host, SYSTEM + QUESTION)
        base = await host.call("prefill", {"prompt": SYSTEM + "a different ending", "cache": "base"})
        extended = await host.call(
            "prefill", {"prompt": SYSTEM + QUESTION, "cache": "turn", "base": "base", "trim_to_tokens": 10}
        )
        cached = await greedy(host, SYSTEM + QUESTION, cache="turn")
    finally:
        await host.close()
    assert extended["cache_read_tokens"] == 10 < base["token_count"]
    assert extended["cache_write_tokens"] == extended["token_count"] - 10
    assert cached["tokens"] == uncached["tokens"]


async def test_a_cache_of_another_prompt_is_refused_naming_where_it_differs(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        await host.call("prefill", {"prompt": SYSTEM, "cache": "system"})
        with pytest.raises(WorkerError) as caught:
            await greedy(host, "a completely different prompt", cache="system")
        assert caught.value.kind == "cache_prefix_mismatch" and caught.value.data["field"] == "params.cache"
        assert (await greedy(host, QUESTION))["finish_reason"] in ("stop", "length")
    finally:
        await host.close()


async def test_a_model_changed_in_its_configuration_or_anywhere_in_its_weights_refuses_the_old_caches(
    tiny_model_dir, cache_dir, tmp_path
):
    """Copies of the model under the same name: one with only RoPE's base frequency changed in
    config.json, one with weight bytes changed where no sampled fingerprint would have looked."""
    import json
    import shutil

    roped, rewritten = tmp_path / "a" / tiny_model_dir.name, tmp_path / "b" / tiny_model_dir.name
    for copy in (roped, rewritten):
        shutil.copytree(tiny_model_dir, copy)
    config = json.loads((roped / "config.json").read_text())
    config.setdefault("rope_parameters", {})["rope_theta"] = 20000.0
    (roped / "config.json").write_text(json.dumps(config))
    weights = rewritten / "model.safetensors"
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2 + 12345  # inside a tensor, away from any evenly spaced sample
    data[middle : middle + 4] = bytes(4) if data[middle : middle + 4] != bytes(4) else b"\x00\x00\x80\x3f"
    weights.write_bytes(data)
    host = await worker(tiny_model_dir, cache_dir)
    try:
        await host.call("prefill", {"prompt": SYSTEM, "cache": "system"})
        await host.call("prefill", {"prompt": SYSTEM, "cache": "memory://system"})
        await greedy(host, SYSTEM, cache="auto")
        for model, field in ((roped, "rope_theta"), (rewritten, "weights_sha256")):
            await host.call("load", {"model": str(model)}, timeout=120)
            with pytest.raises(WorkerError) as caught:
                await greedy(host, SYSTEM + QUESTION, cache="system")
            assert caught.value.kind == "cache_identity_mismatch" and f"{field} is " in caught.value.message
            with pytest.raises(WorkerError) as caught:  # memory caches went with the model they belong to
                await greedy(host, SYSTEM + QUESTION, cache="memory://system")
            assert caught.value.kind == "cache_not_found"
            auto = await greedy(host, SYSTEM + QUESTION, cache="auto")
            assert auto["cache"]["ref"] is None and auto["cache"]["reused_tokens"] == 0
    finally:
        await host.close()


async def test_the_weights_digest_is_computed_once_and_remembered_across_workers(tiny_model_dir, cache_dir, tmp_path):
    data_dir = tmp_path / "data"
    # Processes: their logs say whether the weights were hashed.
    first = await Host.spawn("--cache-dir", str(cache_dir), "--data-dir", str(data_dir), env=TORCH_ENV)
    try:
        await first.call("load", {"model": str(tiny_model_dir)}, timeout=120)
        await first.call("load", {"model": str(tiny_model_dir)}, timeout=120)
        await first.call("prefill", {"prompt": SYSTEM, "cache": "system"})
    finally:
        await first.close()
    hashed = first.stderr.decode().count("hashed model.safetensors")
    memos = {memo.read_text().strip(): memo for memo in (data_dir / "digests").iterdir()}
    assert hashed == 1, first.stderr.decode()
    # The remembered digest is what the next worker uses: a forged one makes the caches foreign.
    import hashlib

    real = hashlib.sha256((tiny_model_dir / "model.safetensors").read_bytes()).hexdigest()
    memos[real].write_text("0" * 64 + "\n")
    second = await Host.spawn("--cache-dir", str(cache_dir), "--data-dir", str(data_dir), env=TORCH_ENV)
    try:
        await second.call("load", {"model": str(tiny_model_dir)}, timeout=120)
        with pytest.raises(WorkerError) as caught:
            await greedy(second, SYSTEM + QUESTION, cache="system")
        assert caught.value.kind == "cache_identity_mismatch" and "weights_sha256" in caught.value.message
    finally:
        await second.close()
    assert "hashed model.safetensors" not in second.stderr.decode()


async def test_damaged_foreign_missing_and_other_model_caches_are_refused(tiny_model_dir, cache_dir, tmp_path):
    from worker.backends.transformers.tiny_model import build

    other_model = build(tmp_path / "other", seed=1)
    host = await worker(tiny_model_dir, cache_dir)
    try:
        await host.call("prefill", {"prompt": SYSTEM, "cache": "good"})
        data = bytearray((cache_dir / "good.kvc").read_bytes())
        data[len(data) // 2] ^= 0x10
        (cache_dir / "flipped.kvc").write_bytes(data)
        (cache_dir / "foreign.kvc").write_bytes(b"PK\x03\x04 not a cache at all")
        expected = {"flipped": "cache_corrupt", "foreign": "cache_corrupt", "missing": "cache_not_found"}
        for ref, kind in expected.items():
            with pytest.raises(WorkerError) as caught:
                await greedy(host, SYSTEM + QUESTION, cache=ref)
            assert caught.value.kind == kind, ref
        await host.call("load", {"model": str(other_model)}, timeout=120)
        with pytest.raises(WorkerError) as caught:
            await greedy(host, SYSTEM + QUESTION, cache="good")
        assert caught.value.kind == "cache_identity_mismatch"
        assert "model_id is " in caught.value.message
    finally:
        await host.close()


async def test_a_ref_that_could_leave_the_cache_directory_is_refused(tiny_model_dir, cache_dir, tmp_path):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        for ref in ["../outside", "/tmp/abs", "a" * 200, ".hidden", "sub/dir", "memory://../x", ""]:
            for method, params in (("prefill", {"prompt": SYSTEM, "cache": ref}), ("cache/info", {"cache": ref})):
                with pytest.raises(WorkerError) as caught:
                    await host.call(method, params)
                assert caught.value.kind == "invalid_params" and caught.value.data["field"] == "params.cache", ref
    finally:
        await host.close()
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written == [] and not cache_dir.exists()


async def test_caches_are_listed_described_and_deleted(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        await host.call("prefill", {"prompt": SYSTEM, "cache": "disk", "prefix_offsets": [3], "prefix_hashes": ["h"]})
        await host.call("prefill", {"prompt": QUESTION, "cache": "memory://mem"})
        listed = await host.call("cache/list")
        info = await host.call("cache/info", {"cache": "disk"})
        assert {c["cache"] for c in listed["caches"]} == {"disk", "memory://mem"}
        assert (info["prefix_offsets"], info["prefix_hashes"]) == ([3], ["h"])
        assert info["bytes"] == (cache_dir / "disk.kvc").stat().st_size
        assert await host.call("cache/delete", {"cache": "disk"}) == {"deleted": True}
        assert await host.call("cache/delete", {"cache": "disk"}) == {"deleted": False}
        assert not (cache_dir / "disk.kvc").exists()
        with pytest.raises(WorkerError) as caught:
            await host.call("cache/info", {"cache": "disk"})
        assert caught.value.kind == "cache_not_found"
    finally:
        await host.close()


async def test_the_echo_backend_says_it_keeps_no_cache(spawn_worker):
    host = await spawn_worker()
    await host.call("load", {"backend": "echo"})
    with pytest.raises(WorkerError) as caught:
        await host.call("prefill", {"prompt": "a", "cache": "x"})
    assert caught.value.kind == "unsupported"


async def test_a_prefilled_system_message_is_reused_by_the_chat_that_starts_with_it(tiny_model_dir, cache_dir):
    system = [{"role": "system", "content": SYSTEM}]
    chat = system + [{"role": "user", "content": QUESTION}]
    host = await worker(tiny_model_dir, cache_dir)
    try:
        made = await host.call("prefill", {"messages": system, "add_generation_prompt": False, "cache": "chat"})
        rendered = await host.call("render", {"messages": system, "add_generation_prompt": False})
        uncached = await host.call("generate", {"messages": chat, "max_tokens": 16})
        cached = await host.call("generate", {"messages": chat, "max_tokens": 16, "cache": "chat"})
    finally:
        await host.close()
    assert made["token_count"] == rendered["count"]
    assert cached["usage"]["cache_read_tokens"] == made["token_count"]
    assert cached["tokens"] == uncached["tokens"]


async def test_cache_requests_wait_for_the_prefill_sent_before_them(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        _, made = host.start("prefill", {"prompt": SYSTEM, "cache": "early"})
        info = await host.call("cache/info", {"cache": "early"})  # sent before the prefill answered
        assert info["token_count"] == (await made)["result"]["token_count"]
    finally:
        await host.close()


async def test_prefill_refuses_an_empty_prompt_a_trim_without_base_and_names_a_bad_base(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        cases = [
            ({"tokens": [], "cache": "x"}, "invalid_params", "params.prompt"),
            ({"prompt": SYSTEM, "cache": "x", "trim_to_tokens": 3}, "invalid_params", "params.base"),
            ({"prompt": SYSTEM, "cache": "x", "base": "missing"}, "cache_not_found", "params.base"),
            ({"prompt": SYSTEM, "cache": "x", "base": "auto"}, "invalid_params", "params.base"),
        ]
        for params, kind, field in cases:
            with pytest.raises(WorkerError) as caught:
                await host.call("prefill", params)
            assert (caught.value.kind, caught.value.data["field"]) == (kind, field), params
        made = await host.call("prefill", {"prompt": SYSTEM, "cache": "kept"})
        with pytest.raises(WorkerError):  # refused before the cache is touched
            await host.call("generate", {"prompt": SYSTEM, "cache": "kept", "max_tokens": 10**6})
        after = await greedy(host, SYSTEM + QUESTION, cache="kept")
        assert after["usage"]["cache_write_tokens"] == made["cache_write_tokens"]
    finally:
        await host.close()


async def prefilled_bytes(model, cache_dir: Path, ref: str, device: str = "cpu") -> int:
    """The size of the cache of SYSTEM, measured in a worker of its own."""
    probe = await worker(model, cache_dir, device)
    try:
        return (await probe.call("prefill", {"prompt": SYSTEM, "cache": ref}))["bytes"]
    finally:
        await probe.close()


async def test_the_cache_directory_is_bounded_by_evicting_the_least_recently_used(tiny_model_dir, cache_dir):
    size = await prefilled_bytes(tiny_model_dir, cache_dir, "probe")
    (cache_dir / "probe.kvc").unlink()
    host = await Host.start_in_process("--cache-dir", str(cache_dir), "--cache-max-bytes", str(2 * size + size // 2))
    try:
        await host.call("load", {"model": str(tiny_model_dir)}, timeout=120)
        for name in ("one", "two"):
            await host.call("prefill", {"prompt": SYSTEM, "cache": name})
        await greedy(host, SYSTEM + QUESTION, cache="one")  # "one" is now the most recently used
        await host.call("prefill", {"prompt": SYSTEM, "cache": "three"})
        listed = await host.call("cache/list")
    finally:
        await host.close()
    assert sorted(p.stem for p in cache_dir.glob("*.kvc")) == ["one", "three"]
    assert listed["max_bytes"] == 2 * size + size // 2 and listed["total_bytes"] <= listed["max_bytes"]


async def test_memory_caches_keep_within_their_budget_dropping_the_least_recently_used(cache_model, cache_dir, device):
    size = await prefilled_bytes(cache_model, cache_dir, "memory://probe", device)
    host = await Host.start_in_process("--cache-dir", str(cache_dir), "--memory-cache-max-bytes", str(2 * size))
    try:
        await host.call("load", {"model": str(cache_model), "device": device}, timeout=300)
        for ref in ("memory://a", "memory://b"):
            await host.call("prefill", {"prompt": SYSTEM, "cache": ref})
        await greedy(host, SYSTEM, cache="memory://a")  # a is now used more recently than b
        await host.call("prefill", {"prompt": SYSTEM, "cache": "memory://c"})
        listed = {c["cache"] for c in (await host.call("cache/list"))["caches"]}
        with pytest.raises(WorkerError) as too_large:
            await host.call("prefill", {"prompt": SYSTEM * 4, "cache": "memory://big"})
        assert (await greedy(host, SYSTEM, cache="memory://c"))["usage"]["cache_read_tokens"] > 0
        await host.call("unload")
        await host.call("load", {"model": str(cache_model), "device": device}, timeout=300)
        after_unload = (await host.call("cache/list"))["caches"]
    finally:
        await host.close()
    assert listed == {"memory://a", "memory://c"}
    assert too_large.value.kind == "cache_too_large" and too_large.value.data["limit"] == 2 * size
    assert "--memory-cache-max-bytes" in too_large.value.message
    assert after_unload == []


async def test_a_cache_of_the_previous_file_format_is_listed_refused_by_name_and_passed_over_by_auto(
    tiny_model_dir, cache_dir
):
    from tests.cache_samples import write_kvc1_file

    host = await worker(tiny_model_dir, cache_dir)
    try:
        prompt = (await host.call("tokenize", {"text": SYSTEM + QUESTION}))["tokens"]
        cache_dir.mkdir(parents=True, exist_ok=True)
        write_kvc1_file(cache_dir / "old.kvc", prompt[:-4], model_id=tiny_model_dir.name)
        listed = (await host.call("cache/list"))["caches"]
        with pytest.raises(WorkerError) as caught:
            await greedy(host, SYSTEM + QUESTION, cache="old")
        auto = await greedy(host, SYSTEM + QUESTION, cache="auto")
        plain = await greedy(host, SYSTEM + QUESTION)
    finally:
        await host.close()
    assert [(c["cache"], c["token_count"]) for c in listed] == [("old", len(prompt) - 4)]
    assert caught.value.kind == "cache_identity_mismatch" and "format is 'KVC1'" in caught.value.message
    assert auto["cache"]["ref"] is None and auto["cache"]["skipped"] == [] and auto["tokens"] == plain["tokens"]
