"""KV prompt cache benchmark: restoring a cached prefix against recomputing it, time to
first token from a cache through the worker, and the memory a restore takes.

Run from anywhere (the workers are spawned from this checkout's root):

    python bench/cache_bench.py            # normal: 5 rounds, 7 first-token samples (~3 min on 2 cores)
    python bench/cache_bench.py --quick    # 2 rounds, 2 samples (~1.6 min)
    python bench/cache_bench.py --json out.json

Model: SmolLM2-135M-Instruct (the worker's default model; full attention), or with
``--model gemma3-270m`` Gemma 3 270M (15 of 18 layers attend to a sliding window of 512
positions), float32, on the CPU. The
prompt is a list of token ids (the first 2048 tokens of a generated English text), so
every length is exact.

1. **Restore against recompute, in this process.** Recompute: the KV of the 2048-token
   prompt with the worker's own chunked prefill (``extend_cache``: forward with a
   DynamicCache, 256 tokens a chunk). Restore: ``container.load`` (read the file into
   memory with the room the worker leaves for the positions a request adds, check the
   header's SHA-256, the identity, every padding byte and every tensor's CRC: CRC-32C in a
   KVC3 file, the format written where its kernel builds, CRC-32 in KVC2) then
   ``TorchCache.from_file`` (the DynamicCache, its tensors views of that memory, no copy).
   The restore is timed with the file in the page cache (warm: into new memory, and
   into memory filled beforehand, as a worker restores a file it found at load,
   ``container.reserve``) and after ``posix_fadvise(DONTNEED)`` dropped it (cold-ish:
   read from the disk again; the share of the file still resident is checked with mincore). Rounds alternate the
   order; medians.
2. **Time to first token through the worker.** Worker A prefills the first 2016
   tokens into a disk cache (``prefill``), and answers ``generate`` for the 2048
   tokens without a cache (``max_tokens: 1``). Worker B, a fresh process started
   after the prefill (as after a restart), answers the same ``generate`` with
   ``"cache": ref``: it reads the file from the disk cache directory, verifies it and
   computes the last 32 tokens. Host-side time = request written -> first
   ``generate/chunk`` received. Runs interleave, the order rotating; medians. The
   first token must be the same with and without the cache.
3. **Memory.** A fresh process loads the model, then restores the cache: the peak
   resident set (VmHWM, reset through /proc/self/clear_refs) above the resident set
   before, against the file's size; then one decode step (which replaces the mapped
   tensors by copies), its peak and what stays resident after it; the target is checked
   against the higher of the two peaks. The same peak is also read for worker B around
   each cached generate.

Torch threads are the same everywhere (``--threads``, default 2). The machine is small
and noisy: read the ratios, measured side by side in one run, before the absolute
figures.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import gc
import json
import mmap
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Self

from bench_common import cpu_pressure_us, median, verdict, write_report

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
os.environ.setdefault("TQDM_DISABLE", "1")

PROMPT_TOKENS = 2048
CACHED_TOKENS = 2016
# Issue 45's targets (issue 4's were 100x and 20x).
TARGET_RESTORE_RATIO = 300.0
TARGET_TTFT_RATIO = 50.0
TARGET_MEMORY_RATIO = 1.2
CROWDED_PRESSURE = 0.10
CACHE_REF = "bench-prefix"


# --- the prompt -----------------------------------------------------------------


def english_text(sentences: int = 900, seed: int = 20240601) -> str:
    """Plain English prose from templates and a fixed seed: the same text on every run."""
    rng = random.Random(seed)
    people = [
        "the baker",
        "my neighbour",
        "a young engineer",
        "the old captain",
        "our teacher",
        "the gardener",
        "a tired traveller",
        "the mayor",
        "her brother",
        "the children",
        "a quiet student",
        "the doctor",
    ]
    verbs = [
        "carried",
        "painted",
        "repaired",
        "discovered",
        "described",
        "forgot",
        "measured",
        "borrowed",
        "cleaned",
        "delivered",
        "explained",
        "planted",
        "noticed",
        "wrapped",
        "sold",
        "studied",
    ]
    things = [
        "a wooden boat",
        "the broken clock",
        "three letters",
        "an old map",
        "the kitchen table",
        "a basket of apples",
        "the garden fence",
        "a long report",
        "the red bicycle",
        "a small lamp",
        "the village bridge",
        "a box of tools",
        "the winter coats",
        "a new recipe",
    ]
    places = [
        "near the river",
        "at the market",
        "behind the station",
        "in the library",
        "on the hill",
        "across the square",
        "inside the museum",
        "by the harbour",
        "under the bridge",
        "in the kitchen",
    ]
    times = [
        "early in the morning",
        "after lunch",
        "before the storm",
        "late on Sunday",
        "during the festival",
        "when the rain stopped",
        "last winter",
        "every Tuesday",
        "at sunset",
        "while everyone slept",
    ]
    links = ["because", "although", "so", "and then", "but", "while", "after which", "since"]
    reasons = [
        "the weather was cold",
        "nobody else could do it",
        "the shop was closing",
        "it seemed important",
        "the town needed it",
        "they had promised",
        "the road was flooded",
        "it was a gift",
    ]
    out = []
    for i in range(sentences):
        s = f"{rng.choice(people)} {rng.choice(verbs)} {rng.choice(things)} {rng.choice(places)} {rng.choice(times)}"
        if rng.random() < 0.6:
            s += f", {rng.choice(links)} {rng.choice(reasons)}"
        out.append(s[0].upper() + s[1:] + ".")
        if i % 7 == 6:
            out.append("\n\n")
    return " ".join(out)


# --- measuring ------------------------------------------------------------------




class Timed:
    """Wall time and CPU pressure of a block."""

    def __enter__(self) -> Self:
        self._psi = cpu_pressure_us()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        after = cpu_pressure_us()
        known = self._psi is not None and after is not None
        self.pressure = (after - self._psi) / (self.seconds * 1e6) if known else None


def processor() -> str:
    """The processor's model name (/proc/cpuinfo), for the report."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return "an unknown processor"


def psi_text(pressure: float | None) -> str:
    return f" psi {pressure:3.0%}" if pressure is not None else ""


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def resident_fraction(path: Path) -> float | None:
    """Share of the file's pages in the page cache (mincore on a fresh mapping; None where it fails)."""
    size = path.stat().st_size
    if size == 0:
        return None
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = _libc
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    try:
        if libc.mincore(addr, size, vec) != 0:
            return None
    finally:
        libc.munmap(addr, size)
    return sum(v & 1 for v in vec) / pages


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """Resident-set figures from /proc/PID/status, in bytes."""
    text = Path(f"/proc/{pid}/status").read_text()
    out = {}
    for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
        match = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
        if match:
            out[key] = int(match.group(1)) * 1024
    return out


def reset_peak(pid: int | str = "self") -> bool:
    """Reset VmHWM to the current resident set (Linux >= 4.0); False where not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False






def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def load_model(threads: int, name: str):
    """A shipped model as the worker loads it with ``{"model": name}``."""
    import msgspec
    import torch

    from protocol.methods import LoadParams
    from worker.backends.transformers.backend import TransformersBackend
    from worker.data_dir import default_data_dir

    torch.set_num_threads(threads)
    return TransformersBackend().load(msgspec.convert({"model": name}, LoadParams), data_dir=default_data_dir())


# --- 1. restore against recompute, in this process ---------------------------------


def restore(model, path: Path, held: int):
    """(read + verify seconds, build seconds, cache), read as the worker reads it for a request
    whose cache will hold ``held`` positions. The cache alone keeps the memory read into alive."""
    from worker.kvcache import container

    t0 = time.perf_counter()
    loaded = container.load(path, model.cache_identity(), room=lambda entry: model.cache_room(entry, held))
    t1 = time.perf_counter()
    cache = model.load_cache(loaded)  # TorchCache.from_file(loaded, config, device)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, cache


def bench_restore(model, ids: list[int], path: Path, rounds: int, warm_repeats: int, problems: list[str]) -> dict:
    from worker.kvcache import container

    try:  # KVC3's CRC-32C (absent from lm-worker before it, which this bench also runs on)
        from worker.kvcache import checksum
    except ImportError:
        checksum = None

    identity = model.cache_identity()
    # A first, uncounted recompute: warms the model up and gives the cache to write.
    with Timed() as first:
        reference = model.new_cache()
        model.extend_cache(ids, reference)
    print(
        f"  first recompute (warm-up, not counted) {first.seconds * 1000:7.0f} ms{psi_text(first.pressure)}", flush=True
    )

    def write() -> tuple[float, int]:
        t0 = time.perf_counter()
        layers, states, tensors = reference.to_file()
        contents = container.Contents(identity=identity, tokens=ids, layers=layers, states=states)
        size = container.write(path, contents, tensors)
        return time.perf_counter() - t0, size

    write_s, size = write()
    tensor_bytes = reference.nbytes

    # Exactness: the restored tensors are the computed ones, bit for bit.
    _, _, restored = restore(model, path, len(ids) + 32)
    if restored.length != len(ids):
        problems.append(f"restored cache covers {restored.length} tokens, not {len(ids)}")
    # (each tensor's bytes as the file holds them: the torch path's caches and the native path's alike)
    for (spec, a), (_, b) in zip(reference.to_file()[2], restored.to_file()[2], strict=True):
        if bytes(a) != bytes(b):
            problems.append(f"restored {spec.name} differs from the computed one")
    del restored

    # The file's checksum alone, over its bytes in memory (the format's, and zlib's CRC-32 beside it).
    file_format = container.read_header(path).format
    file_crc = container.CHECKSUMS[file_format] if hasattr(container, "CHECKSUMS") else container.crc32
    data = memoryview(path.read_bytes())
    crc_s, zlib_s = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        file_crc(data, 0)
        t1 = time.perf_counter()
        zlib.crc32(data)
        crc_s.append(t1 - t0)
        zlib_s.append(time.perf_counter() - t1)
    del data

    samples: dict[str, list] = {"recompute": [], "warm": [], "reserved": [], "cold": [], "write": [write_s]}
    resident_before_cold = []
    for round_no in range(rounds):

        def do_recompute(round_no: int = round_no) -> str:
            with Timed() as t:
                cache = model.new_cache()
                model.extend_cache(ids, cache)
            if cache.length != len(ids):
                problems.append(f"recompute round {round_no + 1}: {cache.length} tokens")
            del cache
            samples["recompute"].append((t.seconds, t.pressure))
            return f"recompute {t.seconds * 1000:6.0f} ms{psi_text(t.pressure)}"

        def do_restores() -> str:
            # Rewriting the file (atomic replace) leaves it in the page cache: warm.
            seconds, _ = write()
            samples["write"].append(seconds)
            warm = []
            for _ in range(warm_repeats):
                verify, build, cache = restore(model, path, len(ids) + 32)
                del cache
                samples["warm"].append((verify, build))
                warm.append((verify + build) * 1000)
            # As a worker restores a file it found at load: into memory filled then (store.reserve_for).
            container.reserve(size * 5 // 4)
            reserved = []
            for _ in range(warm_repeats):
                verify, build, cache = restore(model, path, len(ids) + 32)
                del cache
                samples["reserved"].append((verify, build))
                reserved.append((verify + build) * 1000)
            container.reserve(0)
            drop_from_page_cache(path)
            resident_before_cold.append(resident_fraction(path))
            verify, build, cache = restore(model, path, len(ids) + 32)
            del cache
            samples["cold"].append((verify, build))
            return (
                f"restore warm {' '.join(f'{w:5.1f}' for w in warm)} ms, into reserved memory "
                f"{' '.join(f'{w:5.1f}' for w in reserved)} ms, cold {(verify + build) * 1000:6.1f} ms"
            )

        parts = [do_recompute, do_restores] if round_no % 2 == 0 else [do_restores, do_recompute]
        print(f"  round {round_no + 1}: " + "   ".join(fn() for fn in parts), flush=True)
    gc.collect()

    recompute = [s for s, _ in samples["recompute"]]
    warm = [v + b for v, b in samples["warm"]]
    cold = [v + b for v, b in samples["cold"]]
    result = {
        "prompt_tokens": len(ids),
        "file_bytes": size,
        "tensor_bytes": tensor_bytes,
        "recompute_ms": [s * 1000 for s in recompute],
        "recompute_cpu_pressure": [p for _, p in samples["recompute"]],
        "restore_warm_ms": [s * 1000 for s in warm],
        "restore_warm_verify_ms": [v * 1000 for v, _ in samples["warm"]],
        "restore_warm_build_ms": [b * 1000 for _, b in samples["warm"]],
        "restore_reserved_ms": [(v + b) * 1000 for v, b in samples["reserved"]],
        "restore_cold_ms": [s * 1000 for s in cold],
        "restore_cold_verify_ms": [v * 1000 for v, _ in samples["cold"]],
        "resident_fraction_before_cold": resident_before_cold,
        "write_ms": [s * 1000 for s in samples["write"]],
        "file_format": file_format,
        "checksum": "CRC-32C, " + checksum.path() if file_format == "KVC3" and checksum else "CRC-32",
        "crc_in_memory_ms_median": median(crc_s) * 1000,
        "zlib_crc32_in_memory_ms_median": median(zlib_s) * 1000,
    }
    for key in (
        "recompute_ms",
        "restore_warm_ms",
        "restore_warm_verify_ms",
        "restore_warm_build_ms",
        "restore_reserved_ms",
        "restore_cold_ms",
        "restore_cold_verify_ms",
        "write_ms",
    ):
        result[f"{key}_median"] = median(result[key])
    result["ratio_warm"] = result["recompute_ms_median"] / result["restore_warm_ms_median"]
    result["ratio_cold"] = result["recompute_ms_median"] / result["restore_cold_ms_median"]
    result["ratio_reserved"] = result["recompute_ms_median"] / result["restore_reserved_ms_median"]
    result["target_min"] = TARGET_RESTORE_RATIO
    result["pass"] = result["ratio_warm"] >= TARGET_RESTORE_RATIO
    return result


# --- 2. time to first token through the worker -------------------------------------


async def bench_worker_ttft(
    name: str, ids: list[int], cache_dir: Path, samples: int, threads: int, problems: list[str]
) -> dict:
    from worker.host import Host

    env = {"OMP_NUM_THREADS": str(threads)}
    cache_file = cache_dir / f"{CACHE_REF}.kvc"
    warmup = {"tokens": ids[:16], "max_tokens": 1}
    a = await Host.spawn("--cache-dir", str(cache_dir), env=env)
    b = None
    try:
        await a.call("load", {"model": name}, timeout=300)
        await a.call("generate", warmup, timeout=120)
        with Timed() as t:
            prefill = await a.call("prefill", {"tokens": ids[:CACHED_TOKENS], "cache": CACHE_REF}, timeout=300)
        print(
            f"  worker A prefill of {CACHED_TOKENS} tokens: {t.seconds * 1000:.0f} ms "
            f"(worker says {prefill['time_ms']:.0f} ms, {mib(prefill['bytes'])}){psi_text(t.pressure)}",
            flush=True,
        )
        if prefill["token_count"] != CACHED_TOKENS or prefill["cache_write_tokens"] != CACHED_TOKENS:
            problems.append(f"prefill result {prefill}")

        # Worker B starts after the cache exists: it reads it from disk, as after a restart.
        b = await Host.spawn("--cache-dir", str(cache_dir), env=env)
        await b.call("load", {"model": name}, timeout=300)
        await b.call("generate", warmup, timeout=120)
        peak_tracking = reset_peak(b.process.pid)

        async def first_chunk(host: Host, params: dict, *, cold: bool = False) -> dict:
            if cold:
                drop_from_page_cache(cache_file)
            rss_before = proc_status(host.process.pid)["VmRSS"] if peak_tracking else None
            if peak_tracking:
                reset_peak(host.process.pid)
            psi = cpu_pressure_us()
            started = time.perf_counter()
            msg_id, future = host.start("generate", params)
            chunk = await host.wait_for(
                lambda m: m.get("method") == "generate/chunk" and m["params"]["id"] == msg_id, timeout=300
            )
            first = time.perf_counter()
            response = await asyncio.wait_for(future, 300)
            done = time.perf_counter()
            after = cpu_pressure_us()
            if "error" in response:
                raise RuntimeError(f"generate failed: {response['error']}")
            result = response["result"]
            peak = proc_status(host.process.pid)["VmHWM"] - rss_before if peak_tracking else None
            return {
                "ttft_ms": (first - started) * 1000,
                "response_ms": (done - started) * 1000,
                "prompt_ms": result["timings"]["prompt_ms"],
                "token": chunk["params"]["tokens"][0] if chunk["params"]["tokens"] else None,
                "result": result,
                "cpu_pressure": (after - psi) / ((done - started) * 1e6)
                if psi is not None and after is not None
                else None,
                "peak_rss_above_before": peak,
            }

        uncached_params = {"tokens": ids, "max_tokens": 1}
        cached_params = {"tokens": ids, "max_tokens": 1, "cache": CACHE_REF}
        first_in_b = await first_chunk(b, cached_params)
        print(
            f"  worker B, first cached generate in the fresh process: {first_in_b['ttft_ms']:.1f} ms"
            f"{psi_text(first_in_b['cpu_pressure'])}",
            flush=True,
        )
        schedule = [
            ("uncached", "uncached (A)", lambda: first_chunk(a, uncached_params)),
            ("cached_warm", "cached (B)", lambda: first_chunk(b, cached_params)),
            ("cached_cold", "cached, file dropped (B)", lambda: first_chunk(b, cached_params, cold=True)),
        ]
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in schedule}
        for sample in range(samples):
            shift = sample % len(schedule)
            parts = []
            for name, label, fn in schedule[shift:] + schedule[:shift]:
                run = await fn()
                runs[name].append(run)
                parts.append(f"{label} {run['ttft_ms']:7.1f} ms{psi_text(run['cpu_pressure'])}")
            print(f"  first token {sample + 1}: " + "   ".join(parts), flush=True)
        info = await b.call("cache/info", {"cache": CACHE_REF})
    finally:
        for host in (a, b):
            if host is not None:
                await host.close(timeout=30)

    # --- checks ---
    runs_all = {"first_in_b": [first_in_b], **runs}
    reference = runs["uncached"][0]["result"]["tokens"]
    for name, group in runs_all.items():
        for i, run in enumerate(group):
            result = run["result"]
            if result["tokens"] != reference or run["token"] != reference[0]:
                problems.append(f"{name} {i + 1}: first token {result['tokens']} differs from uncached {reference}")
            expected_read = 0 if name == "uncached" else CACHED_TOKENS
            usage = result["usage"]
            if usage["prompt_tokens"] != PROMPT_TOKENS or usage["cache_read_tokens"] != expected_read:
                problems.append(f"{name} {i + 1}: usage {usage}, expected {expected_read} tokens read from the cache")
            if expected_read and (result["cache"] or {}).get("reused_tokens") != CACHED_TOKENS:
                problems.append(f"{name} {i + 1}: cache use {result['cache']}")
    if info["token_count"] != CACHED_TOKENS:
        problems.append(f"cache/info says {info['token_count']} tokens")

    out: dict = {"prefill": prefill, "cache_file_bytes": info["bytes"], "first_token": reference[0]}
    for name, group in runs_all.items():
        ttft = [r["ttft_ms"] for r in group]
        # Host TTFT beyond the worker's own prompt_ms: pipes, dispatch and whatever the
        # worker does before its generate clock starts (for a cached run: the restore).
        outside = [r["ttft_ms"] - r["prompt_ms"] for r in group]
        out[name] = {
            "ttft_ms": ttft,
            "ttft_ms_median": median(ttft),
            "ttft_ms_min": min(ttft),
            "worker_prompt_ms_median": median([r["prompt_ms"] for r in group]),
            "outside_prompt_ms_median": median(outside),
            "cpu_pressure": [r["cpu_pressure"] for r in group],
            "peak_rss_above_before": [r["peak_rss_above_before"] for r in group],
        }
    out["ratio_warm"] = out["uncached"]["ttft_ms_median"] / out["cached_warm"]["ttft_ms_median"]
    out["ratio_cold"] = out["uncached"]["ttft_ms_median"] / out["cached_cold"]["ttft_ms_median"]
    out["ratio_first_in_fresh_worker"] = out["uncached"]["ttft_ms_median"] / first_in_b["ttft_ms"]
    out["target_min"] = TARGET_TTFT_RATIO
    out["pass"] = out["ratio_warm"] >= TARGET_TTFT_RATIO
    out["peak_tracking"] = peak_tracking
    return out


# --- 3. memory, in a fresh process ------------------------------------------------


def memory_probe(path: Path, threads: int, name: str) -> dict:
    """Run in a child process: RSS around a restore and the first decode step after it."""
    model = load_model(threads, name)
    tokens = json.loads(os.environ["CACHE_BENCH_TOKENS"])
    # A loaded model has run forwards: warm up on a short prompt (one-time allocations),
    # then give freed heap back so that the baseline is what is really held.
    warm = model.new_cache()
    model.extend_cache(tokens[:16], warm)
    del warm
    gc.collect()
    try:
        _libc.malloc_trim(0)
    except AttributeError:
        pass
    resident = resident_fraction(path)
    out: dict = {"file_bytes": path.stat().st_size, "file_resident_fraction": resident}
    sampler = _Sampler()
    out["hwm_reset"] = reset_peak()
    before = proc_status()
    sampler.start()
    _, _, cache = restore(model, path, len(tokens) + 1)
    peak_sampled = sampler.stop()
    after_restore = proc_status()
    out["before"], out["after_restore"] = before, after_restore
    out["restore_peak_above"] = (after_restore["VmHWM"] if out["hwm_reset"] else peak_sampled) - before["VmRSS"]
    out["restore_peak_sampled_above"] = peak_sampled - before["VmRSS"]

    # One decode step: the token after the 2048 (any id will do for memory).
    reset_peak()
    sampler = _Sampler()
    sampler.start()
    model.extend_cache(tokens + [tokens[0]], cache)
    peak_sampled = sampler.stop()
    after_step = proc_status()
    mapped = str(path) in Path("/proc/self/maps").read_text()
    out["after_step"] = after_step
    out["step_peak_above"] = (after_step["VmHWM"] if out["hwm_reset"] else peak_sampled) - before["VmRSS"]
    out["after_step_above"] = after_step["VmRSS"] - before["VmRSS"]
    out["after_step_anon_above"] = after_step["RssAnon"] - before["RssAnon"]
    out["file_still_mapped_after_step"] = mapped
    out["cache_tokens_after_step"] = cache.length
    del cache
    gc.collect()
    out["after_free"] = proc_status()
    return out


class _Sampler:
    """Samples VmRSS every millisecond (a fallback where VmHWM cannot be reset)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm") as f:
            while not self._stop.is_set():
                f.seek(0)
                self.peak = max(self.peak, int(f.read().split()[1]) * page)
                time.sleep(0.001)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, proc_status()["VmRSS"])


def bench_memory(name: str, path: Path, ids: list[int], threads: int, problems: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--memory-probe", str(path), "--threads", str(threads),
         "--model", name],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads), "CACHE_BENCH_TOKENS": json.dumps(ids)},
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        problems.append(f"memory probe failed ({proc.returncode}): {proc.stderr[-1500:]}")
        return {}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    size = out["file_bytes"]
    out["restore_peak_over_file"] = out["restore_peak_above"] / size
    out["step_peak_over_file"] = out["step_peak_above"] / size
    out["after_step_over_file"] = out["after_step_above"] / size
    out["target_max"] = TARGET_MEMORY_RATIO
    # The target holds at every moment: through the restore and through the first decode step.
    out["pass"] = max(out["restore_peak_over_file"], out["step_peak_over_file"]) <= TARGET_MEMORY_RATIO
    if out["cache_tokens_after_step"] != len(ids) + 1:
        problems.append(f"memory probe: the decode step left {out['cache_tokens_after_step']} tokens")
    return out


# --- main ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (2 rounds, 2 first-token samples)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--rounds", type=int, help="recompute / restore rounds (default 5, quick 2)")
    parser.add_argument("--ttft-samples", type=int, help="interleaved first-token samples (default 7, quick 2)")
    parser.add_argument("--warm-restores", type=int, default=3, help="warm restores per round (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, here and in the workers (default 2)")
    parser.add_argument(
        "--model", default="default", choices=["default", "gemma3-270m"],
        help="the shipped model: default (SmolLM2, full attention) or gemma3-270m (sliding window)",
    )
    parser.add_argument("--memory-probe", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_probe:
        print(json.dumps(memory_probe(Path(args.memory_probe), args.threads, args.model)))
        return 0
    rounds = args.rounds or (2 if args.quick else 5)
    samples = args.ttft_samples or (2 if args.quick else 7)
    bench_started = time.perf_counter()
    problems: list[str] = []

    import torch
    import transformers

    with Timed() as t:
        model = load_model(args.threads, args.model)
    ids = model.tokenize(english_text(), add_special_tokens=False)[:PROMPT_TOKENS]
    if len(ids) != PROMPT_TOKENS:
        raise SystemExit(f"the text gives only {len(ids)} tokens; make it longer")
    print(
        f"lm-worker cache bench: python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, zlib {zlib.ZLIB_RUNTIME_VERSION}, {os.cpu_count()} cpus "
        f"({processor()}), "
        f"{args.threads} torch threads; {model.info.path} ({model.info.dtype}, loaded in {t.seconds:.1f} s); "
        f"{rounds} restore round(s), {samples} first-token sample(s); prompt {PROMPT_TOKENS} tokens, "
        f"{CACHED_TOKENS} cached",
        flush=True,
    )

    tmp = tempfile.TemporaryDirectory(prefix="cache-bench-")
    try:
        work = Path(tmp.name)
        path = work / "restore.kvc"
        print(f"1. restore a cached {PROMPT_TOKENS}-token prefix (checksums verified) vs recompute it, in-process")
        restore_figures = bench_restore(model, ids, path, rounds, args.warm_restores, problems)
        model.close()
        del model
        gc.collect()

        print(f"2. time to first token through the worker, {PROMPT_TOKENS} tokens, first {CACHED_TOKENS} cached")
        cache_dir = work / "caches"
        cache_dir.mkdir()
        ttft = asyncio.run(bench_worker_ttft(args.model, ids, cache_dir, samples, args.threads, problems))

        print("3. memory of a restore, in a fresh process that loaded the model")
        memory = bench_memory(args.model, path, ids, args.threads, problems)
    finally:
        tmp.cleanup()
    total_s = time.perf_counter() - bench_started

    # --- report ---------------------------------------------------------------------
    r = restore_figures
    print()
    per_token = r["file_bytes"] / PROMPT_TOKENS / 1024
    print(
        f"cache file: {mib(r['file_bytes'])} for {PROMPT_TOKENS} tokens ({per_token:.1f} KiB a token; "
        f"tensors {mib(r['tensor_bytes'])}); write (to_file + container.write, fsync) "
        f"{r['write_ms_median']:.0f} ms median"
    )
    print(f"recompute {PROMPT_TOKENS} tokens (chunks of 256): {r['recompute_ms_median']:.0f} ms median of {rounds}")
    print(
        f"restore, file in page cache: {r['restore_warm_ms_median']:.1f} ms median of {len(r['restore_warm_ms'])} "
        f"(map + verify {r['restore_warm_verify_ms_median']:.1f} ms, build DynamicCache "
        f"{r['restore_warm_build_ms_median']:.2f} ms; the file's checksum alone over the same bytes in memory: "
        f"{r['file_format']}'s {r['checksum']} {r['crc_in_memory_ms_median']:.1f} ms, zlib's CRC-32 "
        f"{r['zlib_crc32_in_memory_ms_median']:.1f} ms)"
    )
    print(
        f"restore, file in page cache, into memory filled beforehand (as a worker that found the file at load "
        f"reserves it): {r['restore_reserved_ms_median']:.1f} ms median of {len(r['restore_reserved_ms'])}, "
        f"{r['ratio_reserved']:.0f}x recompute"
    )
    fractions = [f for f in r["resident_fraction_before_cold"] if f is not None]
    resident = f"{max(fractions):.0%} of it resident before" if fractions else "residency unknown"
    print(
        f"restore, file dropped from page cache (posix_fadvise DONTNEED; {resident}): "
        f"{r['restore_cold_ms_median']:.1f} ms median of {len(r['restore_cold_ms'])}"
    )
    print(
        f"restore vs recompute: {r['ratio_warm']:.0f}x warm   target >= {TARGET_RESTORE_RATIO:.0f}x  "
        f"{verdict(r['pass'])}   ({r['ratio_cold']:.0f}x cold-ish)"
    )
    if ttft:
        u, w, c, f = ttft["uncached"], ttft["cached_warm"], ttft["cached_cold"], ttft["first_in_b"]
        print(f"time to first token through the worker (host: request -> first chunk), median of {samples}:")
        print(f"  uncached, {PROMPT_TOKENS} tokens computed:            {u['ttft_ms_median']:8.1f} ms")
        print(f"  cached {CACHED_TOKENS}, fresh worker, file warm:       {w['ttft_ms_median']:8.1f} ms")
        print(f"  cached {CACHED_TOKENS}, file dropped from page cache:   {c['ttft_ms_median']:8.1f} ms")
        print(f"  cached {CACHED_TOKENS}, first request of the fresh worker: {f['ttft_ms_median']:6.1f} ms")
        print(
            f"uncached / cached: {ttft['ratio_warm']:.1f}x   target >= {TARGET_TTFT_RATIO:.0f}x  "
            f"{verdict(ttft['pass'])}   ({ttft['ratio_cold']:.1f}x with the file dropped, "
            f"{ttft['ratio_first_in_fresh_worker']:.1f}x for the first request of the fresh worker)"
        )
        print(
            f"  first token with and without the cache: {ttft['first_token']} "
            f"({'equal' if not any('first token' in p for p in problems) else 'DIFFERENT'})"
        )
        print(
            f"  host TTFT beyond the worker's timings.prompt_ms: uncached {u['outside_prompt_ms_median']:.1f} ms, "
            f"cached {w['outside_prompt_ms_median']:.1f} ms (pipes, JSON, dispatch)"
        )
        print(
            f"  of the cached TTFT, the worker's prompt_ms (the restore, then the forward of the last "
            f"{PROMPT_TOKENS - CACHED_TOKENS} tokens over 2048 positions) is {w['worker_prompt_ms_median']:.1f} ms"
        )
        first_peak = f["peak_rss_above_before"][0]
        later = [p for p in w["peak_rss_above_before"] + c["peak_rss_above_before"] if p is not None]
        if first_peak is not None:
            size = ttft["cache_file_bytes"]
            print(
                f"  worker B peak RSS during a cached generate above its RSS before: first {mib(first_peak)} "
                f"({first_peak / size:.2f}x the {mib(size)} file), later {mib(median(later))} median "
                f"({median(later) / size:.2f}x; freed heap from the earlier ones is reused)"
            )
    if memory:
        m = memory
        print(
            f"memory, fresh process with the model loaded ({mib(m['before']['VmRSS'])} resident), "
            f"file {mib(m['file_bytes'])}{'' if m['hwm_reset'] else ' (VmHWM not resettable: sampled)'}:"
        )
        print(
            f"  restore peak above before: {mib(m['restore_peak_above'])} = {m['restore_peak_over_file']:.2f}x the "
            f"file   (after: anon "
            f"{mib(m['after_restore']['RssAnon'] - m['before']['RssAnon'])}, file-backed "
            f"{mib(m['after_restore']['RssFile'] - m['before']['RssFile'])})"
        )
        print(
            f"  first decode step: peak {mib(m['step_peak_above'])} = {m['step_peak_over_file']:.2f}x the file; "
            f"after it {mib(m['after_step_above'])} = {m['after_step_over_file']:.2f}x "
            f"(anon {mib(m['after_step_anon_above'])}; file still mapped: "
            f"{'yes' if m['file_still_mapped_after_step'] else 'no'})"
        )
        print(
            f"  peak through restore and first step: "
            f"{max(m['restore_peak_over_file'], m['step_peak_over_file']):.2f}x the file   "
            f"target <= {TARGET_MEMORY_RATIO}x  {verdict(m['pass'])}"
        )
    crowded = [f"recompute {i + 1}" for i, p in enumerate(r["recompute_cpu_pressure"]) if (p or 0) > CROWDED_PRESSURE]
    if ttft:
        crowded += [
            f"{name} {i + 1}"
            for name in ("uncached", "cached_warm", "cached_cold")
            for i, p in enumerate(ttft[name]["cpu_pressure"])
            if (p or 0) > CROWDED_PRESSURE
        ]
    if crowded:
        print(
            f"note: {len(crowded)} run(s) waited for a CPU more than {CROWDED_PRESSURE:.0%} of the time: "
            f"{', '.join(crowded[:8])}{' ...' if len(crowded) > 8 else ''}"
        )
    for problem in problems:
        print(f"problem: {problem}")
    print(f"total bench time: {total_s:.1f} s")

    if args.json:
        report = {
            "model": f"{args.model}, float32, cpu",
            "prompt_tokens": PROMPT_TOKENS,
            "cached_tokens": CACHED_TOKENS,
            "rounds": rounds,
            "ttft_samples": samples,
            "threads": args.threads,
            "cpus": os.cpu_count(),
            "processor": processor(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "zlib": zlib.ZLIB_RUNTIME_VERSION,
            "restore_vs_recompute": restore_figures,
            "time_to_first_token": ttft,
            "memory": memory,
            "crowded_runs": crowded,
            "problems": problems,
            "total_seconds": total_s,
        }
        write_report(args.json, report)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
