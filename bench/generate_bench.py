"""Generation benchmark: decode rate and first-token latency through the worker,
beside transformers' own ``generate()`` in this process, on the default model.

Run from anywhere (the worker is spawned from this checkout's root):

    python bench/generate_bench.py            # normal: 5 rounds, 20 first-token samples (~4 min on 2 cores)
    python bench/generate_bench.py --quick    # 2 rounds, 5 samples (~2 min)
    python bench/generate_bench.py --json out.json

Model: SmolLM2-135M-Instruct (the worker's default model, its converted safetensors
directory), on the CPU, greedy, one fixed chat prompt.

1. **Worker vs in-process, float32, 128 new tokens.** One worker (``python -m worker``,
   real pipes, a plain buffered binary reader on the host side) loads the default
   model; the host writes a ``generate`` request with the chat ``messages`` and reads
   ``generate/chunk`` lines, timestamping each as it is read. TTFT = request written
   -> first chunk read; decode tokens/s = (n - 1) / (last chunk - first chunk). In
   this process the same directory is loaded with transformers and
   ``model.generate(do_sample=False, max_new_tokens=128)`` runs on the same prompt
   ids, with a streamer that only timestamps each new token: TTFT = generate()
   called -> first new token; decode tokens/s as above. (``min_new_tokens=128`` is
   left out by default: the prompt does not reach EOS anyway, and the logits
   processors it adds cost generate() ~1% a step, which would flatter the worker;
   ``--min-new-tokens`` puts it back.)
2. **First token.** A prefill is short and noisy, so TTFT gets its own, more
   numerous interleaved samples with ``max_tokens=1``: the worker with ``messages``
   (what a host sees), the worker with the same ids as ``tokens`` (no rendering), and
   in-process ``generate(max_new_tokens=1)``.
3. **bfloat16 vs float32 through the worker.** A second worker loads with
   ``{"dtype": "bfloat16"}`` and takes part in both kinds of rounds; the bench reports
   the ratios, whether its greedy tokens equal the float32 ones, and the whole
   request time of each.
4. **Exactness.** The worker's float32 greedy tokens must equal the in-process
   ``generate()`` tokens in every round; the chunks must carry every token once and
   concatenate to the final text; usage must count exactly; the worker must render
   the same prompt ids as the tokenizer here.

The worker has no option to ignore end-of-sequence, so the prompt is one whose greedy
continuation runs past 128 tokens; the bench checks that the worker stopped for
length, not EOS. Runs are interleaved (the order rotating each round) and never
overlap: each worker idles, blocked on stdin, while the others run. Torch threads are
the same everywhere (``--threads``, default 2: ``torch.set_num_threads`` here,
``OMP_NUM_THREADS`` for the workers). Each run prints the CPU pressure (Linux PSI,
share of its wall time that some task waited for a CPU) so that crowded runs show.

The machine is small and noisy: read the ratios, measured side by side in one run,
before the absolute figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import cpu_pressure_us, median, verdict, write_report

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
os.environ.setdefault("TQDM_DISABLE", "1")

TARGET_THROUGHPUT_RATIO = 0.98
TARGET_OVERHEAD_MS = 10.0
NEW_TOKENS = 128
CROWDED_PRESSURE = 0.10  # CPU pressure above which a run is reported as crowded
WARMUP_TOKENS = 16

# ~25 user tokens; with SmolLM2's default system prompt the rendered prompt is ~50.
# Its greedy continuation (float32) runs well past 128 tokens without end-of-sequence.
MESSAGES = [
    {
        "role": "user",
        "content": "Write a detailed step-by-step guide to baking sourdough bread at home, "
        "and explain the reason for each step.",
    }
]

CHUNK_MARK = b'"method":"generate/chunk"'


# --- the worker, over real pipes ------------------------------------------------


class Worker:
    """``python -m worker`` on pipes; one request at a time, like protocol_bench's host."""

    def __init__(self, name: str, threads: int, stderr_dir: str) -> None:
        self.name = name
        self._stderr = open(os.path.join(stderr_dir, f"{name}.stderr"), "w+b")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=REPO_ROOT,
            env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        )
        self._next_id = 0

    def _write(self, method: str, params: dict) -> tuple[int, float]:
        self._next_id += 1
        body = json.dumps(
            {"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params}, separators=(",", ":")
        ).encode()
        assert self.proc.stdin is not None
        started = time.perf_counter()
        self.proc.stdin.write(body + b"\n")
        self.proc.stdin.flush()
        return self._next_id, started

    def _read_until(self, msg_id: int) -> tuple[list[tuple[float, bytes]], dict]:
        """Lines up to the response to ``msg_id``; each chunk line with the time it was read."""
        assert self.proc.stdout is not None
        readline = self.proc.stdout.readline
        clock = time.perf_counter
        final_prefix = b'{"jsonrpc":"2.0","id":%d,' % msg_id
        chunks: list[tuple[float, bytes]] = []
        keep = chunks.append
        while True:
            line = readline()
            now = clock()
            if not line:
                raise RuntimeError(f"worker {self.name} exited; stderr: {self.stderr_tail()}")
            if CHUNK_MARK in line:
                keep((now, line))
            elif line.startswith(final_prefix):
                return chunks, json.loads(line)

    def call(self, method: str, params: dict) -> dict:
        msg_id, _ = self._write(method, params)
        _, response = self._read_until(msg_id)
        if "error" in response:
            raise RuntimeError(f"worker {self.name}: {method} failed: {response['error']}")
        return response["result"]

    def generate(self, params: dict) -> dict:
        msg_id, started = self._write("generate", params)
        lines, response = self._read_until(msg_id)
        if "error" in response:
            raise RuntimeError(f"worker {self.name}: generate failed: {response['error']}")
        chunks = [(t, json.loads(line)["params"]) for t, line in lines]
        token_times = [t for t, chunk in chunks for _ in chunk["tokens"]]
        return {
            "started": started,
            "token_times": token_times,
            "chunk_tokens": [tok for _, chunk in chunks for tok in chunk["tokens"]],
            "chunk_text": "".join(chunk["text"] for _, chunk in chunks),
            "result": response["result"],
        }

    def stderr_tail(self, size: int = 2000) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()[-size:].decode("utf-8", "replace")

    def close(self) -> None:
        try:
            if self.proc.stdin and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._stderr.close()


# --- transformers in this process -------------------------------------------------


class InProcess:
    def __init__(self, path: Path, threads: int) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.generation.streamers import BaseStreamer

        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(threads)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

        class TimestampStreamer(BaseStreamer):
            """generate() calls put() with the prompt, then with each new token."""

            def __init__(self) -> None:
                self.times: list[float] = []

            def put(self, value) -> None:
                self.times.append(time.perf_counter())

            def end(self) -> None:
                pass

        self._streamer_class = TimestampStreamer

    def render(self, messages: list[dict]) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        return list(encoded["input_ids"])

    def generate(self, ids: list[int], new_tokens: int, *, force_length: bool = False) -> dict:
        torch = self.torch
        input_ids = torch.tensor([ids], dtype=torch.long)
        attention_mask = torch.ones_like(input_ids)
        streamer = self._streamer_class()
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                **({"min_new_tokens": new_tokens} if force_length else {}),
                streamer=streamer,
            )
        tokens = out[0, len(ids) :].tolist()
        return {"started": started, "token_times": streamer.times[1:], "tokens": tokens}


# --- figures ----------------------------------------------------------------------




def rates(run: dict) -> tuple[float, float]:
    """(TTFT ms, decode tokens/s) from a run's start and per-token times."""
    times = run["token_times"]
    ttft_ms = (times[0] - run["started"]) * 1000.0
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
    return ttft_ms, decode


def step_rate(run: dict) -> float:
    """tokens/s from the median gap between consecutive tokens: less swayed by a burst of
    load from elsewhere on the machine than the span from first to last token."""
    times = run["token_times"]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return 1.0 / statistics.median(gaps) if gaps and statistics.median(gaps) > 0 else 0.0


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_worker_run(run: dict, prompt_len: int, name: str) -> list[str]:
    problems = []
    result = run["result"]
    tokens = result["tokens"]
    if result["finish_reason"] != "length" or len(tokens) != NEW_TOKENS:
        problems.append(
            f"{name}: stopped after {len(tokens)} tokens ({result['finish_reason']}, "
            f"{result['stop_reason']['kind']}), not {NEW_TOKENS} for length: pick a prompt whose greedy "
            "continuation is longer"
        )
    if run["chunk_tokens"] != tokens:
        problems.append(f"{name}: the chunks' tokens differ from the final tokens")
    if len(run["token_times"]) != len(tokens):
        problems.append(f"{name}: {len(run['token_times'])} token chunks for {len(tokens)} tokens")
    if run["chunk_text"] != result["text"]:
        problems.append(f"{name}: the concatenated chunk texts differ from the final text")
    usage = result["usage"]
    if usage["completion_tokens"] != len(tokens) or usage["prompt_tokens"] != prompt_len:
        problems.append(f"{name}: usage {usage} does not count {prompt_len} prompt and {len(tokens)} new tokens")
    return problems






def measure(fn, label: str) -> tuple[dict, str]:
    """Run ``fn`` (one generate); note how crowded the CPUs were meanwhile."""
    before, started = cpu_pressure_us(), time.perf_counter()
    run = fn()
    after, elapsed = cpu_pressure_us(), time.perf_counter() - started
    run["cpu_pressure"] = (after - before) / (elapsed * 1e6) if before is not None and after is not None else None
    ttft, decode = rates(run)
    crowded = f" psi {run['cpu_pressure']:3.0%}" if run["cpu_pressure"] is not None else ""
    text = f"{label} {ttft:6.1f} ms" if len(run["token_times"]) < 2 else f"{label} {decode:5.2f} tok/s"
    return run, text + crowded


def paired(a: list[float], b: list[float]) -> list[float]:
    return [x - y for x, y in zip(a, b, strict=True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (2 rounds, 5 first-token samples)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--rounds", type=int, help="interleaved 128-token rounds (default 5, quick 2)")
    parser.add_argument("--ttft-samples", type=int, help="interleaved first-token samples (default 20, quick 5)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, here and in the workers (default 2)")
    parser.add_argument(
        "--min-new-tokens",
        action="store_true",
        help="also pass min_new_tokens=128 to in-process generate() (adds logits processors to its steps)",
    )
    parser.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 worker")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    samples = args.ttft_samples or (5 if args.quick else 20)
    bench_started = time.perf_counter()
    problems: list[str] = []

    import torch
    import transformers

    from worker.backends.transformers.shipped import converted_path
    from worker.data_dir import default_data_dir

    model_dir = converted_path(default_data_dir())
    print(
        f"lm-worker generate bench: python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {os.cpu_count()} cpus "
        f"({torch.backends.cpu.get_cpu_capability()}), {args.threads} torch threads, "
        f"{rounds} round(s) of {NEW_TOKENS} tokens, {samples} first-token samples"
        + (", in-process min_new_tokens" if args.min_new_tokens else ""),
        flush=True,
    )
    print(f"model: {model_dir}", flush=True)

    dtypes = ["float32"] if args.no_bf16 else ["float32", "bfloat16"]
    decode_runs: dict[str, list[dict]] = {"worker_float32": [], "inprocess": []}
    if "bfloat16" in dtypes:
        decode_runs["worker_bfloat16"] = []
    ttft_runs: dict[str, list[dict]] = {"worker_float32": [], "worker_float32_tokens": [], "inprocess": []}
    if "bfloat16" in dtypes:
        ttft_runs["worker_bfloat16"] = []
    tmp = tempfile.TemporaryDirectory(prefix="lm-worker-genbench-")
    workers: dict[str, Worker] = {}
    try:
        # Load everything first, one at a time.
        started = time.perf_counter()
        inproc = InProcess(model_dir, args.threads)
        load_ms = {"inprocess": (time.perf_counter() - started) * 1000.0}
        for dtype in dtypes:
            worker = workers[dtype] = Worker(dtype, args.threads, tmp.name)
            started = time.perf_counter()
            info = worker.call("load", {} if dtype == "float32" else {"dtype": dtype})
            load_ms[f"worker_{dtype}"] = (time.perf_counter() - started) * 1000.0
            if info["dtype"] != dtype:
                problems.append(f"worker {dtype}: loaded as {info['dtype']}")
        print("loaded: " + ", ".join(f"{name} {ms / 1000:.1f} s" for name, ms in load_ms.items()), flush=True)

        # The prompt: the worker renders the messages; this process renders them too.
        ids = inproc.render(MESSAGES)
        render_times = []
        for _ in range(5):  # the first render compiles the template; time the later ones
            started = time.perf_counter()
            inproc.render(MESSAGES)
            render_times.append((time.perf_counter() - started) * 1000.0)
        render_ms = median(render_times)
        worker_ids = workers["float32"].call("render", {"messages": MESSAGES})["tokens"]
        if worker_ids != ids:
            problems.append(
                f"the worker renders the prompt as {len(worker_ids)} ids, this process as {len(ids)} "
                f"(first difference at {first_difference(worker_ids, ids)}); in-process runs use the worker's ids"
            )
            ids = worker_ids
        print(f"prompt: {len(ids)} tokens (chat messages, rendered with the model's template)", flush=True)
        by_messages = {"messages": MESSAGES, "temperature": 0}
        by_tokens = {"tokens": ids, "temperature": 0}

        # Warm-up: not counted.
        for worker in workers.values():
            worker.generate({**by_messages, "max_tokens": WARMUP_TOKENS})
        inproc.generate(ids, WARMUP_TOKENS)

        # 1 + 2: decode, 128 tokens, interleaved; the order rotates each round.
        schedule = [
            (f"worker_{d}", f"worker {d}", lambda d=d: workers[d].generate({**by_messages, "max_tokens": NEW_TOKENS}))
            for d in dtypes
        ]
        schedule.insert(
            1, ("inprocess", "in-process", lambda: inproc.generate(ids, NEW_TOKENS, force_length=args.min_new_tokens))
        )
        for round_no in range(rounds):
            shift = round_no % len(schedule)
            parts = []
            for name, label, fn in schedule[shift:] + schedule[:shift]:
                run, text = measure(fn, label)
                decode_runs[name].append(run)
                parts.append(text)
            print(f"  decode round {round_no + 1}: " + "   ".join(parts), flush=True)

        # First token: max_tokens=1, interleaved, more samples (a prefill is short and noisy).
        schedule = [
            ("worker_float32", "worker fp32", lambda: workers["float32"].generate({**by_messages, "max_tokens": 1})),
            (
                "worker_float32_tokens",
                "worker fp32 ids",
                lambda: workers["float32"].generate({**by_tokens, "max_tokens": 1}),
            ),
            ("inprocess", "in-process", lambda: inproc.generate(ids, 1)),
        ]
        if "bfloat16" in workers:
            schedule.append(
                (
                    "worker_bfloat16",
                    "worker bf16",
                    lambda: workers["bfloat16"].generate({**by_messages, "max_tokens": 1}),
                )
            )
        for sample in range(samples):
            shift = sample % len(schedule)
            parts = []
            for name, label, fn in schedule[shift:] + schedule[:shift]:
                run, text = measure(fn, label)
                ttft_runs[name].append(run)
                parts.append(text)
            print(f"  first token {sample + 1:>2}: " + "   ".join(parts), flush=True)
    finally:
        for worker in workers.values():
            worker.close()
        tmp.cleanup()

    # --- checks, after timing -------------------------------------------------------
    reference = decode_runs["inprocess"][0]["tokens"]
    for i, run in enumerate(decode_runs["inprocess"]):
        if run["tokens"] != reference:
            problems.append(f"in-process round {i + 1}: greedy tokens differ from round 1")
        if len(run["token_times"]) != NEW_TOKENS:
            problems.append(f"in-process round {i + 1}: the streamer saw {len(run['token_times'])} tokens")
    if len(reference) != NEW_TOKENS:
        problems.append(
            f"in-process generate() stopped after {len(reference)} tokens (end of sequence): pick a prompt "
            f"whose greedy continuation is longer than {NEW_TOKENS} tokens"
        )
    exact_rounds = 0
    for i, run in enumerate(decode_runs["worker_float32"]):
        problems += check_worker_run(run, len(ids), f"worker float32 round {i + 1}")
        diff = first_difference(run["result"]["tokens"], reference)
        if diff is None:
            exact_rounds += 1
        else:
            problems.append(f"worker float32 round {i + 1}: greedy tokens differ from in-process generate() at {diff}")
    exact = exact_rounds == len(decode_runs["worker_float32"])
    for name, group in ttft_runs.items():
        first = {tuple(run["result"]["tokens"] if "result" in run else run["tokens"]) for run in group}
        expected = (reference[0],) if name != "worker_bfloat16" else None
        if len(first) != 1 or (expected is not None and first != {expected}):
            problems.append(f"first-token runs {name}: first tokens {sorted(first)}, expected {expected}")

    bf16_vs_fp32: int | None | str = "skipped"
    if "worker_bfloat16" in decode_runs:
        bf16_tokens = decode_runs["worker_bfloat16"][0]["result"]["tokens"]
        for i, run in enumerate(decode_runs["worker_bfloat16"]):
            problems += check_worker_run(run, len(ids), f"worker bfloat16 round {i + 1}")
            if run["result"]["tokens"] != bf16_tokens:
                problems.append(f"worker bfloat16 round {i + 1}: greedy tokens differ from its round 1")
        bf16_vs_fp32 = first_difference(bf16_tokens, decode_runs["worker_float32"][0]["result"]["tokens"])

    # --- figures --------------------------------------------------------------------
    decode: dict[str, dict] = {}
    for name, group in decode_runs.items():
        entry: dict = {
            "decode_tokens_per_s": [rates(run)[1] for run in group],
            "step_tokens_per_s": [step_rate(run) for run in group],
            "ttft_ms": [rates(run)[0] for run in group],
            "cpu_pressure": [run["cpu_pressure"] for run in group],
        }
        for key in ("decode_tokens_per_s", "step_tokens_per_s", "ttft_ms"):
            entry[f"{key}_median"] = median(entry[key])
        if name.startswith("worker"):
            timings = [run["result"]["timings"] for run in group]
            entry["worker_reported_tokens_per_s_median"] = median([t["tokens_per_second"] for t in timings])
        decode[name] = entry
    first_token: dict[str, dict] = {}
    for name, group in ttft_runs.items():
        values = [rates(run)[0] for run in group]
        first_token[name] = {
            "ttft_ms": values,
            "ttft_ms_median": median(values),
            "ttft_ms_min": min(values),
            "cpu_pressure": [run["cpu_pressure"] for run in group],
        }
        if name.startswith("worker"):
            # What the host waits for beyond the worker's own request-handled -> first-token
            # time: pipes, parsing, dispatch, chunk encoding. Same sample, so prefill noise cancels.
            transport = [v - run["result"]["timings"]["prompt_ms"] for v, run in zip(values, group, strict=True)]
            first_token[name].update(
                worker_reported_prompt_ms_median=median([run["result"]["timings"]["prompt_ms"] for run in group]),
                transport_ms=transport,
                transport_ms_median=median(transport),
            )

    w, p = decode["worker_float32"], decode["inprocess"]
    throughput_ratio = w["decode_tokens_per_s_median"] / p["decode_tokens_per_s_median"]
    per_round_ratio = [a / b for a, b in zip(w["decode_tokens_per_s"], p["decode_tokens_per_s"], strict=True)]
    step_ratio = w["step_tokens_per_s_median"] / p["step_tokens_per_s_median"]
    tw, tt, tp = first_token["worker_float32"], first_token["worker_float32_tokens"], first_token["inprocess"]
    overhead_ms = tw["ttft_ms_median"] - tp["ttft_ms_median"]
    overhead_paired_ms = median(paired(tw["ttft_ms"], tp["ttft_ms"]))
    overhead_tokens_ms = tt["ttft_ms_median"] - tp["ttft_ms_median"]
    overhead_tokens_paired_ms = median(paired(tt["ttft_ms"], tp["ttft_ms"]))
    differences = paired(tw["ttft_ms"], tp["ttft_ms"])
    # Standard error of a median, ~1.25 sigma / sqrt(n): how finely these samples resolve the overhead.
    overhead_se_ms = 1.2533 * statistics.stdev(differences) / len(differences) ** 0.5 if len(differences) > 1 else 0.0
    total_s = time.perf_counter() - bench_started

    labels = {
        "worker_float32": "worker float32, messages (host sees)",
        "worker_float32_tokens": "worker float32, same ids as 'tokens'",
        "inprocess": "in-process generate() float32, ids",
        "worker_bfloat16": "worker bfloat16, messages (host sees)",
    }
    print()
    print(
        f"{f'decode, {NEW_TOKENS} tokens: median of {rounds}':<44}{'tok/s':>9}{'median-step tok/s':>19}{'TTFT ms':>10}"
    )
    for name, entry in decode.items():
        print(
            f"{labels[name]:<44}{entry['decode_tokens_per_s_median']:>9.2f}{entry['step_tokens_per_s_median']:>19.2f}"
            f"{entry['ttft_ms_median']:>10.1f}"
        )
    print(f"{f'first token, max_tokens=1: median of {samples}':<44}{'TTFT ms':>9}{'min ms':>19}")
    for name, entry in first_token.items():
        print(f"{labels[name]:<44}{entry['ttft_ms_median']:>9.1f}{entry['ttft_ms_min']:>19.1f}")
    print()
    print(
        f"worker / in-process throughput: {throughput_ratio:.3f}   target >= {TARGET_THROUGHPUT_RATIO}  "
        f"{verdict(throughput_ratio >= TARGET_THROUGHPUT_RATIO)}"
        f"   (per round: {', '.join(f'{r:.3f}' for r in per_round_ratio)}, their median {median(per_round_ratio):.3f}; "
        "from the median gap between tokens: "
        f"{step_ratio:.3f})"
    )
    print(
        f"first-token overhead, worker - in-process: {overhead_ms:+.1f} ms   target <= {TARGET_OVERHEAD_MS:.0f} ms  "
        f"{verdict(overhead_ms <= TARGET_OVERHEAD_MS)}   (median of paired differences {overhead_paired_ms:+.1f} "
        f"+- {overhead_se_ms:.1f} ms standard error)"
    )
    print(
        f"  host TTFT - worker's own request-handled -> first-token time, same samples: "
        f"{tw['transport_ms_median']:.2f} ms (pipes, JSON, dispatch, chunk; the rest of the difference is prefill)"
    )
    print(
        f"  sending the same ids as 'tokens' instead: {overhead_tokens_ms:+.1f} ms "
        f"(paired {overhead_tokens_paired_ms:+.1f} ms); rendering + tokenizing the messages takes "
        f"{render_ms:.2f} ms in-process"
    )
    print(
        f"worker's own timings (float32): decode {w['worker_reported_tokens_per_s_median']:.2f} tok/s; "
        f"request handled -> first token {tw['worker_reported_prompt_ms_median']:.1f} ms"
    )
    print(
        f"exactness: worker float32 greedy tokens == in-process generate() tokens: "
        f"{'yes' if exact else 'NO'} ({exact_rounds}/{len(decode_runs['worker_float32'])} rounds x "
        f"{len(reference)} tokens)"
    )
    bf16: dict | None = None
    if "worker_bfloat16" in decode:
        b, tb = decode["worker_bfloat16"], first_token["worker_bfloat16"]
        same = bf16_vs_fp32 is None
        bf16 = {
            "throughput": b["decode_tokens_per_s_median"] / w["decode_tokens_per_s_median"],
            "per_round": [x / y for x, y in zip(b["decode_tokens_per_s"], w["decode_tokens_per_s"], strict=True)],
            "step_throughput": b["step_tokens_per_s_median"] / w["step_tokens_per_s_median"],
            "ttft": tb["ttft_ms_median"] / tw["ttft_ms_median"],
            "greedy_identical": same,
            "first_difference": bf16_vs_fp32,
        }
        print(
            f"bfloat16 / float32 (worker): decode {bf16['throughput']:.2f}x"
            f" (per round: {', '.join(f'{r:.2f}' for r in bf16['per_round'])}), time to first token {bf16['ttft']:.2f}x"
        )
        print(
            "bfloat16 greedy tokens == float32: "
            + ("yes" if same else f"no, they diverge at token {bf16_vs_fp32} of {NEW_TOKENS}")
        )
        # A whole request as a host waits for it: first token, then the rest at the decode rate.
        whole = {
            name: first_token[name]["ttft_ms_median"] / 1000.0
            + (NEW_TOKENS - 1) / decode[name]["decode_tokens_per_s_median"]
            for name in ("worker_float32", "worker_bfloat16")
        }
        # Rough break-even: prompt tokens per generated token at which bfloat16's slower
        # prefill eats its faster decode (prefill taken as linear in the prompt length).
        saved_per_token = (
            1.0 / decode["worker_float32"]["decode_tokens_per_s_median"] - 1.0 / b["decode_tokens_per_s_median"]
        )
        lost_per_prompt_token = (tb["ttft_ms_median"] - tw["ttft_ms_median"]) / 1000.0 / len(ids)
        if saved_per_token > 0 and lost_per_prompt_token > 0:
            break_even: float | None = saved_per_token / lost_per_prompt_token
            advice = (
                f"bfloat16 comes out ahead while the prompt is shorter than ~{break_even:.1f}x the tokens generated"
            )
        else:
            break_even = None
            advice = f"{'bfloat16' if saved_per_token > 0 else 'float32'} is faster at decoding, " + (
                "and at the prompt"
                if (lost_per_prompt_token <= 0) == (saved_per_token > 0)
                else "but not at the prompt"
            )
        bf16.update(whole_request_s=whole, break_even_prompt_per_new_token=break_even)
        print(
            f"this request ({len(ids)} prompt + {NEW_TOKENS} new tokens) takes {whole['worker_bfloat16']:.1f} s in "
            f"bfloat16, {whole['worker_float32']:.1f} s in float32; {advice}"
        )
    crowded = [
        f"{name} {kind} {i + 1}"
        for kind, table in (("round", decode_runs), ("sample", ttft_runs))
        for name, group in table.items()
        for i, run in enumerate(group)
        if (run["cpu_pressure"] or 0.0) > CROWDED_PRESSURE
    ]
    if crowded:
        print(
            f"note: {len(crowded)} run(s) waited for a CPU more than {CROWDED_PRESSURE:.0%} of the time "
            f"(something else was running): {', '.join(crowded[:6])}{' ...' if len(crowded) > 6 else ''}"
        )
    for problem in problems:
        print(f"problem: {problem}")
    print(f"total bench time: {total_s:.1f} s")

    if args.json:
        report = {
            "model": str(model_dir),
            "new_tokens": NEW_TOKENS,
            "prompt_tokens": len(ids),
            "rounds": rounds,
            "ttft_samples": samples,
            "threads": args.threads,
            "inprocess_min_new_tokens": args.min_new_tokens,
            "cpus": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "load_ms": load_ms,
            "decode": decode,
            "first_token": first_token,
            "worker_over_inprocess_throughput": {
                "median_ratio": throughput_ratio,
                "per_round": per_round_ratio,
                "median_step_ratio": step_ratio,
                "target_min": TARGET_THROUGHPUT_RATIO,
                "pass": throughput_ratio >= TARGET_THROUGHPUT_RATIO,
            },
            "first_token_overhead_ms": {
                "difference_of_medians": overhead_ms,
                "median_paired_difference": overhead_paired_ms,
                "tokens_difference_of_medians": overhead_tokens_ms,
                "tokens_median_paired_difference": overhead_tokens_paired_ms,
                "median_paired_difference_standard_error": overhead_se_ms,
                "transport_ms_median": tw["transport_ms_median"],
                "render_ms_inprocess": render_ms,
                "target_max": TARGET_OVERHEAD_MS,
                "pass": overhead_ms <= TARGET_OVERHEAD_MS,
            },
            "exact": exact,
            "crowded_runs": crowded,
            "bfloat16_over_float32": bf16,
            "problems": problems,
            "total_seconds": total_s,
        }
        write_report(args.json, report)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
