"""This machine's memory read speed (a STREAM-like probe), and what it lets a decode step do.

    .venv/bin/python bench/read_bandwidth.py [--model FILE.gguf ...] [--size-mb 1024] [--rounds 7] [--json FILE]

A decode step of a model this size is bound by memory: it reads every weight once (the
embedding only its rows, unless the output head is the embedding itself). The probe sums a
buffer several times the size of the caches, once per round, on 1 thread and on every core
this process may run on (read_probe.c, built as the worker's kernels are), and prints the
median GB/s. For each gguf given it prints the bytes a step reads and the tokens per second
the machine's read speed allows (the floor of a step's time), so that a measured decode figure
can be read as a fraction of what memory allows (llama_cpp_bench.mjs does, beside its decode
row). bench/README.md says how to read it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from worker import c_build  # noqa: E402
from worker.data_dir import default_data_dir  # noqa: E402
from worker.gguf.reader import read  # noqa: E402


def processor() -> str:
    """The processor's name as /proc/cpuinfo gives it (the tables name the machine they ran on)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def read_speeds(size_mb: int, rounds: int) -> dict[int, float]:
    """Median GB/s of a whole read of a size_mb buffer, for 1 thread and for every core."""
    probe = c_build.built_function(default_data_dir() / "kernels", Path(__file__).with_name("read_probe.c"), "lmw_read_probe")
    probe.restype = ctypes.c_uint64
    probe.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    words = np.ones(size_mb * (1 << 20) // 8, np.uint64)  # written once: every page is there
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    speeds: dict[int, float] = {}
    for threads in sorted({1, cores}):
        probe(words.ctypes.data, words.size, threads)  # the threads started, the pages mapped
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            total = probe(words.ctypes.data, words.size, threads)
            times.append(time.perf_counter() - start)
            assert total == words.size, "the probe read every word"
        speeds[threads] = words.nbytes / statistics.median(times) / 1e9
    return speeds


def step_bytes(path: Path) -> int:
    """The bytes of a gguf's tensors a decode step reads: all of them, but of the token embedding
    only a row, unless the model's output head is the embedding (no output.weight)."""
    file = read(path)
    try:
        tensors = file.tensors
        total = sum(tensor.size for tensor in tensors.values())
        embedding = tensors.get("token_embd.weight")
        if embedding is not None and "output.weight" in tensors:
            total -= embedding.size - embedding.size // embedding.shape[-1]
        return total
    finally:
        file.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=[], metavar="FILE", help="a .gguf file (repeatable)")
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    speeds = read_speeds(args.size_mb, args.rounds)
    cores = max(speeds)
    report = {"processor": processor(), "read_gb_per_s": {str(t): s for t, s in speeds.items()}, "models": {}}
    print(f"{report['processor']}: reading {args.size_mb} MB, median of {args.rounds}: "
          + ", ".join(f"{s:.1f} GB/s on {t} thread{'s' * (t > 1)}" for t, s in speeds.items()))
    for model in args.model:
        size = step_bytes(Path(model))
        floor = speeds[cores] * 1e9 / size
        report["models"][model] = {"bytes_per_token": size, "tokens_per_s_at_read_speed": floor}
        print(f"{model}: a decode step reads {size / 1e6:.1f} MB; at {speeds[cores]:.1f} GB/s that is at most "
              f"{floor:.1f} tokens/s ({1e3 / floor:.2f} ms a token)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
