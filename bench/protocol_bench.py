"""Protocol benchmark: how fast the worker streams, and how fast it starts.

Run from anywhere (the worker is spawned from this checkout's root):

    python bench/protocol_bench.py            # normal: 3 alternating rounds, 10 spawns
    python bench/protocol_bench.py --quick    # 1 round, 3 spawns
    python bench/protocol_bench.py --json out.json

It measures, over real pipes, with a plain buffered binary reader on the host side:

1. **Echo streaming.** ``python -m worker`` loads the echo backend and answers one
   ``generate`` whose ASCII prompt makes ~200,000 tokens, one ``generate/chunk``
   line each. chunks/s = chunk lines seen / (request written -> final response read).
2. **Pipe ceiling.** A child ``python -c`` writes the exact bytes that run 1
   received (chunk lines and final response) to its stdout in large writes, after
   the same kind of "go" line on stdin; the host reads and counts them with the
   same loop. The worker's chunks/s divided by this ceiling says how much of the
   pipe the worker uses. Worker and ceiling runs alternate; medians are reported.
3. **Start-up.** Spawn -> first ``capabilities`` answer (a request written right
   after spawning), against ``python -c`` that answers one stdin line the same
   way (the interpreter floor). One extra spawn with ``-X importtime`` checks
   that torch/transformers are not imported on that path.

Figures are compared with the targets of the issue (>= 100,000 chunks/s,
spawn -> capabilities <= 150 ms). The machine is small and noisy: read the
ratios, which are measured side by side in one run, before the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import verdict, write_report

REPO_ROOT = Path(__file__).resolve().parent.parent

TARGET_CHUNKS_PER_S = 100_000
TARGET_SPAWN_MS = 150.0

CHUNK_MARK = b'"method":"generate/chunk"'
GO = b"go\n"

# The ceiling child: load the captured bytes, say it is ready, wait for the host's
# "go" line, then write them to the stdout pipe in 1 MiB writes.
CEILING_CHILD = r"""
import os, sys
data = open(sys.argv[1], "rb").read()
os.write(1, b"ready\n")
sys.stdin.buffer.readline()
view = memoryview(data)
step = 1 << 20
while view:
    n = os.write(1, view[:step])
    view = view[n:]
"""

# The interpreter floor for start-up: answer one line from stdin on stdout.
FLOOR_CHILD = "import sys; sys.stdout.write(sys.stdin.readline()); sys.stdout.flush()"


def request(msg_id: int, method: str, params: dict | None = None) -> bytes:
    message: dict = {"jsonrpc": "2.0", "id": msg_id, "method": method}
    if params is not None:
        message["params"] = params
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def read_stream(stdout, final_prefix: bytes) -> tuple[int, list[bytes], bytes]:
    """The host's read loop, the same for the worker and the ceiling: a buffered
    binary reader, one line at a time; count chunk lines; stop at the final
    response (a line that starts with ``final_prefix``). Keeps every line so that
    the bytes can be checked (and replayed) after timing."""
    count = 0
    lines: list[bytes] = []
    keep = lines.append
    readline = stdout.readline
    while True:
        line = readline()
        if not line:
            raise EOFError(f"stream ended after {count} chunk lines, before the final response")
        keep(line)
        if CHUNK_MARK in line:
            count += 1
        elif line.startswith(final_prefix):
            return count, lines, line


def spawn_worker(*extra: str, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *extra, "-m", "worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        cwd=REPO_ROOT,
    )


def finish(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Close stdin (the worker exits at end of input) and reap the process."""
    try:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    except BrokenPipeError:
        pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout:
        proc.stdout.close()


# --- 1. the worker's echo stream -------------------------------------------------


def make_prompt(n_bytes: int) -> str:
    words = b"the quick brown fox jumps over the lazy dog; 0123456789 "
    text = (words * (n_bytes // len(words) + 1))[:n_bytes]
    return text.decode("ascii")


def worker_run(prompt: str) -> dict:
    proc = spawn_worker()
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(request(1, "load", {"backend": "echo"}))
        proc.stdin.flush()
        loaded = json.loads(proc.stdout.readline())
        if "error" in loaded:
            raise RuntimeError(f"load failed: {loaded['error']}")
        context = loaded["result"]["context_length"]
        max_tokens = len(prompt.encode()) + 1  # every byte, then EOS
        prompt_tokens = len(prompt.encode()) + 1  # BOS, then every byte
        if prompt_tokens + max_tokens > context:
            raise RuntimeError(f"echo context_length {context} is too small for {prompt_tokens} + {max_tokens}")
        body = request(2, "generate", {"prompt": prompt, "max_tokens": max_tokens})
        started = time.perf_counter()
        proc.stdin.write(body)
        proc.stdin.flush()
        count, lines, final = read_stream(proc.stdout, b'{"jsonrpc":"2.0","id":2,')
        elapsed = time.perf_counter() - started
    finally:
        finish(proc)
    return {"chunks": count, "seconds": elapsed, "lines": lines, "final": final, "prompt": prompt}


def check_worker_run(run: dict) -> list[str]:
    """Light correctness checks, after timing. Returns problems (empty: all good)."""
    problems = []
    response = json.loads(run["final"])
    if "error" in response:
        return [f"generate failed: {response['error']}"]
    result = response["result"]
    completion = result["usage"]["completion_tokens"]
    if run["chunks"] not in (completion, completion + 1):
        problems.append(f"saw {run['chunks']} chunks but usage.completion_tokens is {completion}")
    texts = [json.loads(line)["params"]["text"] for line in run["lines"] if CHUNK_MARK in line]
    if "".join(texts) != result["text"]:
        problems.append("the concatenated chunk texts differ from the final text")
    if result["text"] != run["prompt"]:
        problems.append("the echo text differs from the prompt")
    if result["finish_reason"] != "stop":
        problems.append(f"finish_reason is {result['finish_reason']!r}, expected 'stop' (EOS)")
    return problems


# --- 2. the pipe ceiling ---------------------------------------------------------


def ceiling_run(data_path: str, final_prefix: bytes) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-c", CEILING_CHILD, data_path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if proc.stdout.readline() != b"ready\n":  # the child has started and loaded its bytes
            raise RuntimeError("the ceiling child did not start")
        started = time.perf_counter()
        proc.stdin.write(GO)
        proc.stdin.flush()
        count, _lines, _final = read_stream(proc.stdout, final_prefix)
        elapsed = time.perf_counter() - started
    finally:
        finish(proc)
    return {"chunks": count, "seconds": elapsed}


# --- 3. start-up ----------------------------------------------------------------


def spawn_to_answer_ms(argv: list[str], line: bytes) -> float:
    """Spawn, write ``line`` at once, time until the first line comes back."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO_ROOT
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(line)
        proc.stdin.flush()
        answer = proc.stdout.readline()
        elapsed_ms = (time.perf_counter() - started) * 1000.0
    finally:
        finish(proc)
    if not answer:
        raise RuntimeError(f"{argv[:3]} answered nothing")
    return elapsed_ms


def import_check() -> dict:
    """One spawn with -X importtime: which heavy modules does the capabilities path import?"""
    proc = spawn_worker("-X", "importtime", stderr=subprocess.PIPE)
    out, err = proc.communicate(request(1, "capabilities"), timeout=60)
    answered = b'"id":1,"result"' in out
    modules: list[tuple[int, int, str]] = []  # (self us, cumulative us, name)
    for raw in err.decode("utf-8", "replace").splitlines():
        if not raw.startswith("import time:") or "self [us]" in raw:
            continue
        fields = raw[len("import time:") :].split("|")
        if len(fields) != 3:
            continue
        try:
            modules.append((int(fields[0]), int(fields[1]), fields[2].rstrip()))
        except ValueError:
            continue
    names = {name.strip() for _s, _c, name in modules}
    heavy = sorted(n for n in names if n.split(".")[0] in ("torch", "transformers", "numpy", "safetensors"))
    top_level = [(c, name.strip()) for _s, c, name in modules if not name.startswith("  ")]
    top_level.sort(reverse=True)
    return {
        "answered": answered,
        "heavy_modules": heavy,
        "modules_imported": len(names),
        "import_ms_total": sum(s for s, _c, _n in modules) / 1000.0,
        "top_imports_ms": [(name, c / 1000.0) for c, name in top_level[:6]],
    }


# --- the report -----------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (1 round, 3 spawns)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--tokens", type=int, default=200_000, help="echo tokens per generate (default 200000)")
    parser.add_argument("--rounds", type=int, help="alternating worker/ceiling rounds (default 3, quick 1)")
    parser.add_argument("--spawns", type=int, help="start-up samples of each kind (default 10, quick 3)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    spawns = args.spawns or (3 if args.quick else 10)
    bench_started = time.perf_counter()
    problems: list[str] = []

    print(
        f"lm-worker protocol bench: python {sys.version.split()[0]}, {os.cpu_count()} cpus, "
        f"{args.tokens} tokens, {rounds} round(s), {spawns} spawns",
        flush=True,
    )

    # 1 + 2, alternating. The first worker run captures the bytes the ceiling replays.
    prompt = make_prompt(args.tokens - 1)  # + EOS = args.tokens chunks
    worker_rates: list[float] = []
    ceiling_rates: list[float] = []
    stream_bytes = 0
    with tempfile.TemporaryDirectory(prefix="lm-worker-bench-") as tmp:
        data_path = os.path.join(tmp, "stream.ndjson")
        final_prefix = b'{"jsonrpc":"2.0","id":2,'
        for round_no in range(rounds):
            run = worker_run(prompt)
            worker_rates.append(run["chunks"] / run["seconds"])
            if round_no == 0:
                problems += check_worker_run(run)
                data = b"".join(run["lines"])
                stream_bytes = len(data)
                with open(data_path, "wb") as f:
                    f.write(data)
            del run
            ceiling = ceiling_run(data_path, final_prefix)
            ceiling_rates.append(ceiling["chunks"] / ceiling["seconds"])
            print(
                f"  round {round_no + 1}: worker {worker_rates[-1]:>10,.0f} chunks/s   "
                f"ceiling {ceiling_rates[-1]:>10,.0f} lines/s",
                flush=True,
            )

    # 3. start-up, alternating worker and floor.
    worker_ms: list[float] = []
    floor_ms: list[float] = []
    cap = request(1, "capabilities")
    for _ in range(spawns):
        worker_ms.append(spawn_to_answer_ms([sys.executable, "-m", "worker"], cap))
        floor_ms.append(spawn_to_answer_ms([sys.executable, "-c", FLOOR_CHILD], cap))
    imports = import_check()
    if not imports["answered"]:
        problems.append("the -X importtime worker did not answer capabilities")
    if imports["heavy_modules"]:
        problems.append(f"WARNING: capabilities path imported {', '.join(imports['heavy_modules'][:8])}")

    chunks_med = statistics.median(worker_rates)
    ceiling_med = statistics.median(ceiling_rates)
    spawn_med, spawn_min = statistics.median(worker_ms), min(worker_ms)
    floor_med, floor_min = statistics.median(floor_ms), min(floor_ms)
    total_s = time.perf_counter() - bench_started

    print()
    print(f"{'figure':<34}{'median':>14}{'target':>14}  verdict")
    print(
        f"{'echo chunks/s (host sees)':<34}{chunks_med:>14,.0f}{'>= ' + format(TARGET_CHUNKS_PER_S, ','):>14}  "
        f"{verdict(chunks_med >= TARGET_CHUNKS_PER_S)}"
    )
    print(f"{'pipe ceiling lines/s':<34}{ceiling_med:>14,.0f}{'':>14}")
    print(
        f"{'spawn -> capabilities ms':<34}{spawn_med:>14.1f}{'<= ' + format(TARGET_SPAWN_MS, '.0f'):>14}  "
        f"{verdict(spawn_med <= TARGET_SPAWN_MS)}   (min {spawn_min:.1f})"
    )
    print(f"{'spawn -> answer ms, python -c':<34}{floor_med:>14.1f}{'':>14}         (min {floor_min:.1f})")
    print()
    print(
        f"ratio worker / ceiling (chunks/s):      {chunks_med / ceiling_med:.3f}"
        f"   (per round: {', '.join(f'{w / c:.3f}' for w, c in zip(worker_rates, ceiling_rates, strict=True))})"
    )
    print(
        f"ratio worker / floor (start-up ms):      {spawn_med / floor_med:.2f}"
        f"   (worker adds {spawn_med - floor_med:.1f} ms over the interpreter)"
    )
    print(
        f"stream: {stream_bytes / 1e6:.1f} MB, "
        f"{stream_bytes / max(1, args.tokens):.0f} bytes per chunk line (the final response included)"
    )
    print(
        f"imports on the capabilities path: {imports['modules_imported']} modules, "
        f"{imports['import_ms_total']:.0f} ms under -X importtime; heaviest top-level: "
        + ", ".join(f"{name} {ms:.0f} ms" for name, ms in imports["top_imports_ms"])
    )
    print(f"torch/transformers imported before capabilities: {'YES' if imports['heavy_modules'] else 'no'}")
    for problem in problems:
        print(f"problem: {problem}")
    print(f"total bench time: {total_s:.1f} s")

    if args.json:
        figures = {
            "tokens": args.tokens,
            "rounds": rounds,
            "spawns": spawns,
            "cpus": os.cpu_count(),
            "echo_chunks_per_s": {
                "median": chunks_med,
                "runs": worker_rates,
                "target_min": TARGET_CHUNKS_PER_S,
                "pass": chunks_med >= TARGET_CHUNKS_PER_S,
            },
            "pipe_ceiling_lines_per_s": {"median": ceiling_med, "runs": ceiling_rates},
            "worker_over_ceiling": chunks_med / ceiling_med,
            "spawn_to_capabilities_ms": {
                "median": spawn_med,
                "min": spawn_min,
                "runs": worker_ms,
                "target_max": TARGET_SPAWN_MS,
                "pass": spawn_med <= TARGET_SPAWN_MS,
            },
            "python_floor_ms": {"median": floor_med, "min": floor_min, "runs": floor_ms},
            "worker_over_floor": spawn_med / floor_med,
            "stream_bytes": stream_bytes,
            "imports": imports,
            "problems": problems,
            "total_seconds": total_s,
        }
        write_report(args.json, figures)
    return 1 if any(not p.startswith("WARNING") for p in problems) else 0


if __name__ == "__main__":
    raise SystemExit(main())
