"""A cache directory shared with other workers, other users, read-only mounts and hostile
entries: nothing in it crashes a worker, hangs the model lane or becomes an internal error.
Every test ends with the worker answering the next request."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.cache_samples import forge, header_edit
from tests.conftest import TORCH_ENV
from tests.test_kv_cache import QUESTION, SYSTEM, cache_dir, greedy, worker  # noqa: F401 (fixture)
from worker.host import Host, WorkerError

CLEAN_CACHE_ERRORS = {"cache_corrupt", "cache_not_found"}


async def assert_serves(host: Host, expected: list[int]) -> None:
    assert (await greedy(host, SYSTEM + QUESTION))["tokens"] == expected
    assert host.process.returncode is None


def read_only_python(tmp_path: Path, directory: Path) -> str:
    """A python that runs the worker with ``directory`` mounted read-only (in a mount namespace
    of its own, so nothing outside changes), as a worker on a read-only mount sees it."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a read-only view")
    wrapper = tmp_path / "python-read-only"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"exec unshare -m --propagation private sh -c 'mount --bind -o ro \"$0\" \"$0\" && exec \"$@\"' "
        f"'{directory}' '{sys.executable}' \"$@\"\n"
    )
    wrapper.chmod(0o755)
    return str(wrapper)


async def test_a_cache_rewritten_in_place_while_it_is_read_never_kills_the_worker(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        plain = (await greedy(host, SYSTEM + QUESTION))["tokens"]
        await host.call("prefill", {"prompt": SYSTEM, "cache": "sys"})
        target = cache_dir / "sys.kvc"
        backup = target.read_bytes()
        stop = threading.Event()
        rewrites = 0

        def rewrite_in_place() -> None:  # as cp does: truncate the same file, then write it again
            nonlocal rewrites
            rng = random.Random(7)
            while not stop.is_set():
                with open(target, "r+b") as file:
                    file.truncate(rng.randrange(len(backup)))
                    file.seek(0)
                    file.write(backup)
                rewrites += 1

        writer = threading.Thread(target=rewrite_in_place)
        writer.start()
        outcomes = []
        try:
            for _ in range(20):
                try:
                    outcomes.append((await greedy(host, SYSTEM + QUESTION, cache="sys"))["tokens"] == plain)
                except WorkerError as exc:
                    outcomes.append(exc.kind)
                outcomes.append((await greedy(host, SYSTEM + QUESTION, cache="auto"))["tokens"] == plain)
        finally:
            stop.set()
            writer.join()
        await assert_serves(host, plain)
    finally:
        await host.close()
    assert set(outcomes) <= {True} | CLEAN_CACHE_ERRORS, outcomes
    assert rewrites > len(outcomes), rewrites  # the file kept changing under every read


async def test_a_fifo_a_symlink_loop_and_a_directory_named_like_caches_are_skipped_without_blocking(
    tiny_model_dir, cache_dir
):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        plain = (await greedy(host, SYSTEM + QUESTION))["tokens"]
        await greedy(host, SYSTEM + QUESTION, cache="auto")
        os.mkfifo(cache_dir / "fifo.kvc")
        (cache_dir / "loop.kvc").symlink_to(cache_dir / "loop.kvc")
        (cache_dir / "dir.kvc").mkdir()
        auto = await greedy(host, SYSTEM + QUESTION, cache="auto")
        errors = {}
        for ref in ("fifo", "loop", "dir"):
            with pytest.raises(WorkerError) as caught:
                await greedy(host, SYSTEM + QUESTION, cache=ref)
            errors[ref] = (caught.value.kind, caught.value.message)
        listed = {c["cache"] for c in (await host.call("cache/list"))["caches"]}
        await assert_serves(host, plain)
    finally:
        await host.close()
    assert auto["tokens"] == plain and auto["cache"]["reused_tokens"] > 0
    reasons = {s["ref"]: s["reason"] for s in auto["cache"]["skipped"]}
    assert set(reasons) == {"fifo", "loop", "dir"}
    assert "not a regular file" in reasons["fifo"] and "symbolic links" in reasons["loop"]
    assert errors["fifo"][0] == errors["loop"][0] == errors["dir"][0] == "cache_corrupt"
    assert "not a regular file" in errors["fifo"][1]
    assert not listed & {"fifo", "loop", "dir"}


FORGERIES = {
    "shape x dtype is not nbytes": header_edit("tensors", 0, "shape", [1, 2, 3, 3]),
    "dtype int8": header_edit("tensors", 0, "dtype", "int8"),
    "layer 99": header_edit("tensors", 0, "layer", 99),
    "missing value": lambda h: h["tensors"].pop(1),
    "duplicate layer": header_edit("tensors", 2, "layer", 0),
    "1 TB shape": header_edit("tensors", 0, "shape", [1, 2, 1 << 36, 16]),
    "layer kinds of another model": lambda h: h["layers"][0].update(kind="sliding", sliding_window=4),
    "a key of no heads": lambda h: no_heads(h["tensors"][0]),
}


def no_heads(tensor: dict) -> None:
    """A key tensor of zero heads, consistent in itself (the reader lays it out with room to grow)."""
    _, _, positions, dim = tensor["shape"]
    tensor.update(shape=[1, 0, positions, dim], strides=[0, positions * dim * 4, dim * 4, 4], nbytes=0, crc32=0)


async def test_headers_with_a_sound_checksum_but_inconsistent_fields_are_corrupt_and_skipped_by_auto(
    tiny_model_dir, cache_dir
):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        plain = (await greedy(host, SYSTEM + QUESTION))["tokens"]
        await host.call("prefill", {"prompt": SYSTEM, "cache": "good"})
        for name, edit in FORGERIES.items():
            ref = name.replace(" ", "-")
            shutil.copyfile(cache_dir / "good.kvc", cache_dir / f"{ref}.kvc")
            forge(cache_dir / f"{ref}.kvc", edit)
        (cache_dir / "good.kvc").unlink()
        named = {}
        for name in FORGERIES:
            with pytest.raises(WorkerError) as caught:
                await greedy(host, SYSTEM + QUESTION, cache=name.replace(" ", "-"))
            named[name] = caught.value.kind
        auto = await greedy(host, SYSTEM + QUESTION, cache="auto")
        await assert_serves(host, plain)
    finally:
        await host.close()
    assert set(named.values()) == {"cache_corrupt"}, named
    assert auto["tokens"] == plain and auto["cache"]["reused_tokens"] == 0
    assert {s["ref"] for s in auto["cache"]["skipped"]} == {n.replace(" ", "-") for n in FORGERIES}


async def test_a_ref_with_a_trailing_newline_is_refused(tiny_model_dir, cache_dir):
    host = await worker(tiny_model_dir, cache_dir)
    try:
        for method, params in (("prefill", {"prompt": SYSTEM, "cache": "evil\n"}),
                               ("generate", {"prompt": SYSTEM, "cache": "evil\n"}),
                               ("cache/delete", {"cache": "evil\n"})):
            with pytest.raises(WorkerError) as caught:
                await host.call(method, params)
            assert caught.value.kind == "invalid_params" and caught.value.data["field"] == "params.cache"
    finally:
        await host.close()
    assert not cache_dir.exists() or list(cache_dir.iterdir()) == []


async def test_caches_on_a_read_only_mount_are_used_and_stores_there_fail_with_the_path_and_reason(
    tiny_model_dir, cache_dir, tmp_path
):
    writer = await worker(tiny_model_dir, cache_dir)
    try:
        plain = (await greedy(writer, SYSTEM + QUESTION))["tokens"]
        await writer.call("prefill", {"prompt": SYSTEM, "cache": "sys"})
        await greedy(writer, SYSTEM + "the sun", cache="auto")
    finally:
        await writer.close()
    before = {p.name: p.stat().st_mtime_ns for p in cache_dir.iterdir()}
    python = read_only_python(tmp_path, cache_dir)
    host = await Host.spawn("--cache-dir", str(cache_dir), python=python, env=TORCH_ENV)
    try:
        await host.call("load", {"model": str(tiny_model_dir)}, timeout=300)
        named = await greedy(host, SYSTEM + QUESTION, cache="sys")
        auto = await greedy(host, SYSTEM + QUESTION, cache="auto")
        failures = {}
        for method, params in (("prefill", {"prompt": SYSTEM, "cache": "new"}), ("cache/delete", {"cache": "sys"})):
            with pytest.raises(WorkerError) as caught:
                await host.call(method, params)
            failures[method] = caught.value
        await assert_serves(host, plain)
    finally:
        await host.close()
    assert named["tokens"] == auto["tokens"] == plain and named["usage"]["cache_read_tokens"] > 0
    assert auto["cache"]["reused_tokens"] > 0 and auto["cache"]["stored"] is None
    assert "Read-only file system" in auto["cache"]["store_reason"]
    for failure in failures.values():
        assert (failure.code, failure.kind) == (-32012, "cache_storage_failed")
        assert str(cache_dir) in failure.message and "Read-only file system" in failure.message
    assert {p.name: p.stat().st_mtime_ns for p in cache_dir.iterdir()} == before


async def test_a_prefill_on_a_full_disk_fails_with_the_reason_and_a_generate_keeps_its_answer(
    tiny_model_dir, cache_dir
):
    """A file size limit stands in for a full disk: writing past it fails the same way."""
    python = Path(cache_dir.parent / "python-limited")
    python.write_text(f"#!/bin/sh\nulimit -f 8\nexec '{sys.executable}' \"$@\"\n")  # 8 blocks of 512 bytes
    python.chmod(0o755)
    host = await Host.spawn("--cache-dir", str(cache_dir), python=str(python), env=TORCH_ENV)
    try:
        await host.call("load", {"model": str(tiny_model_dir)}, timeout=300)
        plain = (await greedy(host, SYSTEM + QUESTION))["tokens"]
        with pytest.raises(WorkerError) as caught:
            await host.call("prefill", {"prompt": SYSTEM, "cache": "big"})
        auto = await greedy(host, SYSTEM + QUESTION, cache="auto")
        await assert_serves(host, plain)
    finally:
        await host.close()
    assert caught.value.kind == "cache_storage_failed" and "File too large" in caught.value.message
    assert auto["tokens"] == plain and auto["cache"]["stored"] is None
    assert "File too large" in auto["cache"]["store_reason"]
    assert [p.name for p in cache_dir.iterdir()] == []  # no temporary left behind


HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
sys.stdin.readline()
"""


async def test_a_temporary_is_removed_only_when_no_writer_holds_it_whatever_pid_its_name_carries(
    spawn_worker, cache_dir
):
    """A writer in another PID namespace or on another host has a pid that means nothing here:
    the name says pid 1 (running) or 999999999 (not), the lock says who is alive."""
    cache_dir.mkdir()
    held = cache_dir / ".x.kvc.999999999.abcd1234.tmp"  # a "dead" pid, but a live writer holds it
    orphan = cache_dir / ".y.kvc.1.efgh_678.tmp"  # a "live" pid, but nobody holds it
    orphan.write_bytes(b"half a cache")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(held)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        host = await spawn_worker("--cache-dir", str(cache_dir))
        await host.call("cache/list")  # the store opens the directory
        left = sorted(p.name for p in cache_dir.iterdir())
    finally:
        holder.communicate("done\n", timeout=10)
    later = await spawn_worker("--cache-dir", str(cache_dir))
    await later.call("cache/list")
    assert left == [held.name]
    assert list(cache_dir.iterdir()) == []


# --- stress ----------------------------------------------------------------------------------------

STRESS_SECONDS = float(os.environ.get("LM_WORKER_STRESS_SECONDS", "20"))


def vandal(directory: Path, stop: threading.Event, seed: int) -> None:
    """Overwrite, truncate and replace cache files in place, plant FIFOs and symbolic link loops."""
    rng = random.Random(seed)
    while not stop.is_set():
        files = [p for p in directory.glob("*.kvc") if p.is_file() and not p.is_symlink()]
        action = rng.choice(["truncate", "flip", "replace", "fifo", "loop", "restore"])
        try:
            if action == "fifo":
                os.mkfifo(directory / f"fifo-{rng.randrange(1000)}.kvc")
            elif action == "loop":
                loop = directory / f"loop-{rng.randrange(1000)}.kvc"
                loop.symlink_to(loop)
            elif files:
                target = rng.choice(files)
                data = target.read_bytes()
                if action == "truncate":
                    with open(target, "r+b") as file:
                        file.truncate(rng.randrange(len(data) + 1))
                elif action == "flip" and data:  # a file truncated to nothing has no byte to flip
                    with open(target, "r+b") as file:
                        file.seek(rng.randrange(len(data)))
                        file.write(bytes([rng.randrange(256)]))
                elif action == "replace":
                    other = rng.choice(files)
                    shutil.copyfile(other, target)  # in place: same inode, other bytes
                else:  # restore: write it back whole, in place
                    with open(target, "r+b") as file:
                        file.truncate(0)
                        file.write(data)
        except OSError:
            pass
        time.sleep(rng.uniform(0, 0.02))


async def test_three_workers_and_a_vandal_share_a_directory_without_a_crash_or_an_internal_error(
    tiny_model_dir, cache_dir, tmp_path
):
    """Two workers that write and one on a read-only view of the directory run generate,
    prefill and cache/list while a fourth process damages the files, for a bounded time."""
    cache_dir.mkdir()
    read_only = read_only_python(tmp_path, cache_dir)
    hosts = [await worker(tiny_model_dir, cache_dir), await worker(tiny_model_dir, cache_dir)]
    hosts.append(await Host.spawn("--cache-dir", str(cache_dir), python=read_only, env=TORCH_ENV))
    await hosts[2].call("load", {"model": str(tiny_model_dir)}, timeout=300)
    prompts = [SYSTEM + QUESTION, SYSTEM + "the moon", QUESTION + SYSTEM]
    expected = {prompt: (await greedy(hosts[0], prompt))["tokens"] for prompt in prompts}
    await hosts[0].call("prefill", {"prompt": SYSTEM, "cache": "sys"})
    stop = threading.Event()
    damage = threading.Thread(target=vandal, args=(cache_dir, stop, 11))
    outcomes: dict[str, int] = {}

    def count(outcome: str) -> None:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async def client(host: Host, seed: int) -> None:
        rng = random.Random(seed)
        deadline = time.monotonic() + STRESS_SECONDS
        while time.monotonic() < deadline:
            prompt = rng.choice(prompts)
            call = rng.choice(["auto", "named", "prefill", "list"])
            try:
                if call == "list":
                    await host.call("cache/list")
                elif call == "prefill":
                    await host.call("prefill", {"prompt": SYSTEM, "cache": "sys"})
                else:
                    result = await greedy(host, prompt, cache="auto" if call == "auto" else "sys")
                    assert result["tokens"] == expected[prompt], (call, prompt)
                count(f"{call} ok")
            except WorkerError as exc:
                assert exc.code != -32603, exc.message
                assert exc.kind in CLEAN_CACHE_ERRORS | {"cache_prefix_mismatch", "cache_storage_failed"}, exc
                count(f"{call} {exc.kind}")

    damage.start()
    try:
        await asyncio.gather(*(client(host, seed) for seed, host in enumerate(hosts)))
    finally:
        stop.set()
        damage.join()
    try:
        for host in hosts:
            await assert_serves(host, expected[SYSTEM + QUESTION])
    finally:
        for host in hosts:
            assert await host.close() == 0, host.stderr_tail()
    assert outcomes.get("auto ok", 0) > 0 and outcomes.get("named ok", 0) + outcomes.get("auto ok", 0) > 10, outcomes


async def test_eviction_passes_over_entries_that_are_not_cache_files(tiny_model_dir, cache_dir):
    cache_dir.mkdir()
    (cache_dir / "loop.kvc").symlink_to(cache_dir / "loop.kvc")
    os.mkfifo(cache_dir / "fifo.kvc")
    host = await Host.start_in_process("--cache-dir", str(cache_dir), "--cache-max-bytes", "1")
    try:
        await host.call("load", {"model": str(tiny_model_dir)}, timeout=300)
        for ref in ("one", "two"):
            await host.call("prefill", {"prompt": SYSTEM, "cache": ref})
    finally:
        await host.close()
    assert sorted(p.name for p in cache_dir.iterdir()) == ["fifo.kvc", "loop.kvc", "two.kvc"]
