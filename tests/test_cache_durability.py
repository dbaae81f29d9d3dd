"""Disk caches survive writers killed mid-write and workers sharing one cache directory.

Real worker subprocesses on the tiny model, real files. Random choices come from
fixed seeds, so a failure names the seed and can be replayed; the kill moments
still depend on how fast the machine runs, and no assertion depends on timing.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from unittest.mock import ANY
from pathlib import Path

import pytest

from protocol.errors import ErrorKind, RpcError
from tests.cache_samples import IDENTITY, TOKENS, write_small_cache
from tests.conftest import TORCH_ENV, SpawnWorker
from worker.host import REPO_ROOT, Host, WorkerError
from worker.kvcache import container, memory
from worker.kvcache.store import CacheStore

SEED = int(os.environ.get("LM_WORKER_DURABILITY_SEED", "20240611"))  # set it to replay or vary a run
GREEDY = {"max_tokens": 8, "temperature": 0}


def prompt_tokens(rng: random.Random, count: int) -> list[int]:
    """Token ids of the tiny model's vocabulary (512), past its special tokens (0..3). With
    ``tokens`` every cache of ``ids[:n]`` is exactly a prefix of a prompt of ``ids``."""
    return [rng.randrange(4, 512) for _ in range(count)]


async def loaded_worker(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, cache_dir: Path, *args: str, process: bool = False
) -> Host:
    host = await spawn_worker("--cache-dir", str(cache_dir), *args, env=TORCH_ENV, process=process)
    await host.call("load", {"model": str(tiny_model_dir)}, timeout=180)
    return host


def assert_every_cache_is_whole(cache_dir: Path, identity: container.Identity, context: str) -> list[str]:
    """Every ``*.kvc`` maps and verifies completely (header, identity, every tensor's CRC, size)."""
    refs = []
    for path in sorted(cache_dir.glob("*.kvc")):
        try:
            loaded = container.load(path, identity)
        except FileNotFoundError:  # removed meanwhile by a worker that evicts: not a partial file
            continue
        except (container.CacheFormatError, container.IdentityMismatch) as exc:
            pytest.fail(f"{context}: {path.name} is not a whole cache: {exc}")
        assert loaded.header.sequence_length == len(loaded.header.tokens) > 0
        refs.append(path.stem)
    return refs


def temporaries(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.glob(".*.tmp"))


async def until_a_temporary_appears(cache_dir: Path, *, limit: float) -> None:
    """Poll the directory, at most ``limit`` seconds (a writer may finish its queue first)."""
    deadline = asyncio.get_running_loop().time() + limit
    while asyncio.get_running_loop().time() < deadline:
        with os.scandir(cache_dir) as entries:
            if any(entry.name.endswith(".tmp") for entry in entries):
                return
        await asyncio.sleep(0.0002)


# --- writers killed mid-write ----------------------------------------------------------

# Each round loads a worker, which costs most of this test's time; raise it for a longer soak.
KILL_ROUNDS = int(os.environ.get("LM_WORKER_KILL_ROUNDS", "4"))
KILL_REFS = ["a", "b", "c", "d"]
KILL_PROMPT = 1200  # tokens; a cache of all of them is about 600 KB


async def test_a_worker_killed_while_writing_caches_leaves_only_whole_caches_and_no_usable_temporaries(
    spawn_worker, tiny_model_dir, tmp_path
):
    rng = random.Random(SEED)
    cache_dir = tmp_path / "caches"
    tokens = prompt_tokens(rng, KILL_PROMPT)
    # The workers load at once (loading dominates the cost); each is then killed in its own round.
    writers = await asyncio.gather(
        *(loaded_worker(spawn_worker, tiny_model_dir, cache_dir, process=True) for _ in range(KILL_ROUNDS))
    )
    await writers[0].call("prefill", {"tokens": tokens[:16], "cache": "seed"})
    identity = container.read_header(cache_dir / "seed.kvc").identity
    for round_number, host in enumerate(writers):
        futures = []
        for _ in range(30):  # several refs, overwrites of the same ref, prompts of different lengths
            params = {"tokens": tokens[: rng.randrange(8, len(tokens) + 1)], "cache": rng.choice(KILL_REFS)}
            if rng.random() < 0.5:  # from a base that covers the prompt: little to compute, mostly writing
                params["base"] = rng.choice(KILL_REFS)
            futures.append(host.start("prefill", params)[1])
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        if round_number % 2:  # then at the first sight of a temporary: most likely inside a write
            await until_a_temporary_appears(cache_dir, limit=2.0)
        host.process.send_signal(signal.SIGKILL)
        await host.wait()
        await asyncio.gather(*futures, return_exceptions=True)  # answered, or lost with the worker
        assert host.process.returncode == -signal.SIGKILL
        assert_every_cache_is_whole(cache_dir, identity, f"seed {SEED}, after round {round_number}")

    on_disk = assert_every_cache_is_whole(cache_dir, identity, f"seed {SEED}, at the end")
    left_behind = temporaries(cache_dir)  # a kill that fell inside a write left one
    reader = await spawn_worker("--cache-dir", str(cache_dir))  # listing needs no model
    listed = await reader.call("cache/list")  # its first cache request: the store opens the directory
    assert sorted(c["cache"] for c in listed["caches"]) == on_disk, f"seed {SEED}; temporaries: {left_behind}"
    assert temporaries(cache_dir) == [], f"seed {SEED}: the temporaries of killed writers were not removed"
    for info in listed["caches"]:
        assert info["bytes"] == (cache_dir / f"{info['cache']}.kvc").stat().st_size


# A writer process that stops inside container.write, just before it flushes its temporary
# to disk: "die" kills itself there (SIGKILL), "wait" waits for a line on stdin, then finishes.
WRITER = """
import os, signal, sys
from tests.cache_samples import write_small_cache

path, mode = sys.argv[1], sys.argv[2]
real_fsync = os.fsync

def fsync(fd):
    if mode == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    print("writing", flush=True)
    sys.stdin.readline()
    real_fsync(fd)

os.fsync = fsync
write_small_cache(path)
print("written", flush=True)
"""


def start_writer(path: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )


async def test_opening_a_cache_directory_removes_the_temporaries_of_dead_writers_and_keeps_live_ones(
    spawn_worker: SpawnWorker, tmp_path
):
    cache_dir = tmp_path / "caches"
    cache_dir.mkdir()
    dead = start_writer(cache_dir / "dead.kvc", "die")
    assert dead.wait(timeout=60) == -signal.SIGKILL
    live = start_writer(cache_dir / "live.kvc", "wait")
    try:
        assert live.stdout.readline() == "writing\n"
        assert len(temporaries(cache_dir)) == 2 and not list(cache_dir.glob("*.kvc"))
        host = await spawn_worker("--cache-dir", str(cache_dir))  # no model is needed to list caches
        assert (await host.call("cache/list"))["caches"] == []
        left = temporaries(cache_dir)
        assert len(left) == 1 and left[0].startswith(".live.kvc."), left  # the live writer's is kept
        live.stdin.write("go\n")
        live.stdin.flush()
        assert live.stdout.readline() == "written\n" and live.wait(timeout=60) == 0
    finally:
        live.kill()
        live.wait()
    assert [c["cache"] for c in (await host.call("cache/list"))["caches"]] == ["live"]
    assert temporaries(cache_dir) == []


# --- workers sharing one cache directory ---------------------------------------------------

SHARED_REFS = ["a", "b", "c", "d", "e"]
SHARED_PROMPT = 600  # tokens; a cache of all of them is about 300 KB
SHARED_MAX_BYTES = 350_000  # about two average caches: the evicting worker evicts after most prefills
SHARED_OPS = 60  # per worker that has a model


async def test_workers_sharing_a_cache_directory_see_whole_caches_or_none_while_one_evicts(
    spawn_worker, tiny_model_dir, tmp_path
):
    cache_dir = tmp_path / "caches"
    tokens = prompt_tokens(random.Random(SEED), SHARED_PROMPT)
    plain, evicting = await asyncio.gather(
        loaded_worker(spawn_worker, tiny_model_dir, cache_dir),
        loaded_worker(spawn_worker, tiny_model_dir, cache_dir, "--cache-max-bytes", str(SHARED_MAX_BYTES)),
    )
    lister = await spawn_worker("--cache-dir", str(cache_dir))  # no model: lists, describes, deletes
    uncached = await plain.call("generate", {"tokens": tokens, **GREEDY})
    outcomes: Counter[str] = Counter()

    async def attempt(host: Host, method: str, params: dict) -> dict | None:
        """The request succeeds, or the cache it names is gone: nothing else is acceptable."""
        try:
            result = await host.call(method, params, timeout=120)
        except WorkerError as exc:
            assert (exc.kind, exc.code) == ("cache_not_found", -32007), f"seed {SEED}, {method} {params}: {exc}"
            outcomes[f"{method}: not found"] += 1
            return None
        if method == "generate":
            assert result["tokens"] == uncached["tokens"], f"seed {SEED}: wrong output from {params['cache']}"
        outcomes[method] += 1
        return result

    async def use_caches(host: Host, rng: random.Random) -> None:
        for _ in range(SHARED_OPS):
            roll, ref = rng.random(), rng.choice(SHARED_REFS)
            if roll < 0.4:  # prefill, new or overwriting, sometimes from a base another worker wrote
                params = {"tokens": tokens[: rng.randrange(8, len(tokens) + 1)], "cache": ref}
                if rng.random() < 0.4:
                    params["base"] = rng.choice(SHARED_REFS)
                await attempt(host, "prefill", params)
            elif roll < 0.7:
                await attempt(host, "generate", {"tokens": tokens, "cache": ref, **GREEDY})
            else:  # a ref that was listed a moment ago, perhaps evicted since
                listed = (await host.call("cache/list"))["caches"]
                if listed:
                    await attempt(host, "generate", {"tokens": tokens, "cache": rng.choice(listed)["cache"], **GREEDY})

    async def list_describe_delete(done: asyncio.Event, rng: random.Random) -> None:
        while not done.is_set():
            listed = (await lister.call("cache/list"))["caches"]
            assert all(c["cache"] in SHARED_REFS for c in listed), listed
            for info in listed:
                await attempt(lister, "cache/info", {"cache": info["cache"]})
            if listed and rng.random() < 0.1:
                await lister.call("cache/delete", {"cache": rng.choice(listed)["cache"]})
            await asyncio.sleep(0.01)

    done = asyncio.Event()
    background = asyncio.ensure_future(list_describe_delete(done, random.Random(SEED + 3)))
    try:
        await asyncio.gather(use_caches(plain, random.Random(SEED + 1)), use_caches(evicting, random.Random(SEED + 2)))
    finally:
        done.set()
        await background

    # Quiet now: a cache just written is used whole, and every file on disk is whole.
    made = await plain.call("prefill", {"tokens": tokens[:100], "cache": "final"})
    assert (await attempt(plain, "generate", {"tokens": tokens, "cache": "final", **GREEDY}))["usage"][
        "cache_read_tokens"
    ] == made["token_count"] == 100
    assert_every_cache_is_whole(cache_dir, container.read_header(cache_dir / "final.kvc").identity, f"seed {SEED}")
    assert temporaries(cache_dir) == []
    for host in (plain, evicting, lister):
        assert await host.close() == 0, host.stderr_tail()
    assert outcomes["generate"] > 0 and outcomes["prefill"] > 0, outcomes


# --- a cache deleted between listing and use ----------------------------------------------

class AsRead:
    """A store.load reader that takes a verified file as it is read: no room, no checks of its own."""

    def cache_room(self, entry: container.TensorEntry, max_positions: int, /) -> int:
        return 0

    def cache_problem(self, header: container.Header) -> str | None:
        return None

    def load_cache(self, loaded: container.LoadedCache) -> container.LoadedCache:
        return loaded


@pytest.mark.parametrize("moment", ["before it is opened", "after its header is read"])
def test_a_cache_another_worker_deletes_between_listing_and_use_is_not_found_never_corrupt(
    tmp_path, monkeypatch, moment
):
    """Another worker evicting or deleting the file at the worst moment; store level, because the
    window is too narrow to hit on purpose through a worker."""
    store = CacheStore(tmp_path)
    path = tmp_path / "gone.kvc"

    def vanishing(real):
        def call(file, *args, **kwargs):
            if moment == "before it is opened":
                path.unlink()
                return real(file, *args, **kwargs)
            result = real(file, *args, **kwargs)
            path.unlink()
            return result

        return call

    monkeypatch.setattr(container, "load", vanishing(container.load))
    monkeypatch.setattr(container, "read_header", vanishing(container.read_header))
    write_small_cache(path)
    if moment == "before it is opened":
        with pytest.raises(RpcError) as caught:
            store.load("gone", IDENTITY, AsRead(), max_positions=len(TOKENS))
        assert caught.value.kind == ErrorKind.CACHE_NOT_FOUND, caught.value.message
    else:  # read and verified before it went: still whole, and used
        assert store.load("gone", IDENTITY, AsRead(), max_positions=len(TOKENS))[0] == TOKENS
    write_small_cache(path)
    with pytest.raises(RpcError) as caught:
        store.info("gone")
    assert caught.value.kind == ErrorKind.CACHE_NOT_FOUND, caught.value.message
    write_small_cache(path)
    assert store.list() == []


def test_memory_is_reserved_for_the_largest_stored_cache_of_the_model_and_no_other(tmp_path: Path):
    other = container.Identity(**{**{f: getattr(IDENTITY, f) for f in IDENTITY.__struct_fields__}, "model_id": "x"})
    write_small_cache(tmp_path / "short.kvc", tokens=TOKENS[:2])
    write_small_cache(tmp_path / "long.kvc")
    write_small_cache(tmp_path / "foreign.kvc", tokens=TOKENS * 40, identity=other)
    (tmp_path / "damaged.kvc").write_bytes(b"not a cache")
    truncated = tmp_path / "truncated.kvc"  # its header claims 40 times the tensors; the file holds a few bytes
    write_small_cache(truncated, tokens=TOKENS * 40)
    data = truncated.read_bytes()
    truncated.write_bytes(data[: 48 + int.from_bytes(data[8:16], "little")])  # the prefix and header alone
    store = CacheStore(tmp_path)
    tensor_bytes = sum(entry.nbytes for entry in container.read_header(tmp_path / "long.kvc").tensors)
    try:
        assert store.reserve_for(IDENTITY, 1 << 30) == tensor_bytes * 5 // 4
        assert len(memory._reserve.buffer) == tensor_bytes * 5 // 4
        assert CacheStore(tmp_path / "none").reserve_for(IDENTITY, 1 << 30) == 0
        assert memory._reserve.buffer is None
        assert store.reserve_for(IDENTITY, 100) == 100
        assert store.reserve_for(IDENTITY, 0) == 0 and memory._reserve.buffer is None  # --restore-reserve-max-bytes 0
        store.release_memory()  # at unload
        assert memory._reserve.buffer is None
    finally:
        container.reserve(0)


async def test_a_worker_started_beside_stored_caches_fills_memory_for_them_at_load_unless_told_not_to(
    spawn_worker, tiny_model_dir, tmp_path
):
    cache_dir = tmp_path / "caches"
    writer = await loaded_worker(spawn_worker, tiny_model_dir, cache_dir, process=True)  # its log is read
    tokens = prompt_tokens(random.Random(SEED), SHARED_PROMPT)
    await writer.call("prefill", {"tokens": tokens, "cache": "kept"})
    tensor_bytes = sum(entry.nbytes for entry in container.read_header(cache_dir / "kept.kvc").tensors)
    await writer.close()  # a worker's log reaches stderr on its own thread: whole once it has exited
    assert "reserved" not in writer.stderr_tail(100_000)  # no stored cache when it loaded
    restarted = await loaded_worker(spawn_worker, tiny_model_dir, cache_dir, process=True)
    answer = await restarted.call("generate", {"tokens": tokens + tokens[:3], "max_tokens": 4, "cache": "kept"})
    assert answer["usage"]["cache_read_tokens"] == len(tokens)
    await restarted.close()
    assert f"reserved {tensor_bytes * 5 // 4} bytes for restoring stored caches" in restarted.stderr_tail(100_000)
    declined = await loaded_worker(
        spawn_worker, tiny_model_dir, cache_dir, "--restore-reserve-max-bytes", "0", process=True
    )
    assert await declined.call("generate", {"tokens": tokens + tokens[:3], "max_tokens": 4, "cache": "kept"}) == {
        **answer, "timings": ANY
    }
    await declined.close()
    assert "reserved" not in declined.stderr_tail(100_000)
