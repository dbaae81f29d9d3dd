"""Concurrent conversations on one model: aggregate decode speed with 1, 2, 4 and 8 streams,
and what a request arriving mid-batch costs the streams already running.

    .venv/bin/python bench/batch_bench.py [--model default] [--quantization auto] [--tokens 128] [--sweeps 3]
                                          [--streams 1,2,4,8] [--join-prompt 8,48,512] [--json FILE]

One worker (SmolLM2-135M on the CPU with the default weights, int8, unless told), driven
over real pipes:

1. Throughput. For N in 1, 2, 4, 8: N greedy ``generate`` requests sent at once, each
   for ``--tokens`` new tokens (prompts that ask for long answers; each stream's own
   count is used). Aggregate tokens/s = all generated tokens / wall time from the first
   request sent to the last result; printed as a ratio to one stream, measured in the
   same run: ``--sweeps`` times over (3 unless told) in the order 1, 2, 4, 8, 8, 4, 2, 1
   (the machine drifts), a ratio for each sweep from its own runs, and their median (the
   machine's bursts move one sweep's ratio by a tenth or more).
2. Exactness. Each stream's tokens against the same request run alone: how many of the
   streams differ (batching changes the shapes of the matrix products, which may change
   the last bits of a float32 result; greedy decoding then differs only on a near-tie).
3. A request joining 3 decoding streams with a prompt of ``--join-prompt`` tokens: its
   first-token time against the same request alone, and the running streams' gaps
   between tokens while it is fed, against one stream's time per token alone (from 1)
   and their gaps before it arrived (the streams are promised 2×, or 10 ms more where that
   is more: docs/PROTOCOL.md 5.1). A prompt that fits one chunk fed beside the
   streams (the first length) must get its first token within the step in progress
   when it arrived plus the round that carries its chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_common import cpu_pressure_since, cpu_pressure_us, median, verdict, write_report  # noqa: E402
from worker.host import Host  # noqa: E402
from worker.scheduler import PROMISED_ROUND_OVER_SOLO, ROUND_ALLOWANCE_S, round_limit  # noqa: E402

TOPICS = ["the history of Rome", "how rain forms", "the rules of chess", "a trip to the mountains",
          "how computers store numbers", "the life of bees", "a recipe for bread", "the planets of the sun"]


def params(topic: str, tokens: int) -> dict:
    question = f"Write a long, detailed essay about {topic}."
    return {"messages": [{"role": "user", "content": question}], "max_tokens": tokens}


async def run_batch(host: Host, requests: list[dict]) -> tuple[float, list[dict]]:
    started = time.perf_counter()
    pending = [host.start("generate", p) for p in requests]
    results = [(await asyncio.wait_for(done, 1800))["result"] for _, done in pending]
    return time.perf_counter() - started, results


def gaps(host: Host, msg_id, since: float, until: float) -> list[float]:
    """Seconds between this stream's chunks that arrived within [since, until]."""
    times = [t for m, t in zip(host.messages, host.arrival_times)
             if m.get("method") == "generate/chunk" and m["params"]["id"] == msg_id and since <= t <= until]
    return [b - a for a, b in zip(times, times[1:])]


async def join(host: Host, tokens: int, join_prompt: int) -> dict:
    filler = "The quick brown fox jumps over the lazy dog. " * (join_prompt // 8 + 1)
    ids = (await host.call("tokenize", {"text": filler}))["tokens"][:join_prompt]
    alone = await host.call("generate", {"tokens": ids, "max_tokens": 1})
    running = [host.start("generate", params(topic, tokens * 4)) for topic in TOPICS[:3]]
    await host.wait_until(lambda: all(len(host.chunks[i]) >= 12 for i, _ in running), timeout=600)
    arrived = time.perf_counter()
    _, joined = host.start("generate", {"tokens": ids, "max_tokens": 1})
    await asyncio.wait_for(joined, 600)
    first_token = time.perf_counter()
    for msg_id, _ in running:
        await host.call("cancel", {"id": msg_id})
    for _, done in running:
        await done
    before = [g for i, _ in running for g in gaps(host, i, 0.0, arrived)[4:]]
    during = [g for i, _ in running for g in gaps(host, i, arrived, first_token)]
    step = median(before)
    return {
        "join_prompt_tokens": len(ids),
        "first_token_alone_ms": alone["timings"]["total_ms"],
        "first_token_joined_ms": (first_token - arrived) * 1000.0,
        "gap_before_ms": step * 1000.0,
        "gap_before_max_ms": max(before, default=float("nan")) * 1000.0,
        "gap_during_median_ms": median(during) * 1000.0,
        "gap_during_max_ms": max(during, default=float("nan")) * 1000.0,
        "gaps_during": len(during),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantization", default="auto", help="the load param: auto (int8 on the CPU), none, int8, int4")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--join-prompt", default="8,48,512",
                        help="prompt lengths of the joining request (the first should fit one shared chunk)")
    parser.add_argument("--sweeps", type=int, default=3, help="sweeps over the stream counts, up and back down")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))}
    host = await Host.spawn("--max-batch", str(max(counts)), env=env)
    report: dict = {"model": args.model, "tokens": args.tokens, "cpus": os.cpu_count()}
    try:
        info = await host.call("load", {"model": args.model, "quantization": args.quantization}, timeout=900)
        weights = f"{info['dtype']}, quantization {info['quantization']}"
        report["weights"] = weights
        await host.call("generate", params(TOPICS[0], 8))  # warm-up
        pressure = cpu_pressure_us()
        alone = {}
        for topic in TOPICS[: max(counts)]:
            alone[topic] = (await host.call("generate", params(topic, args.tokens), timeout=900))["tokens"]
        rates: dict[int, list[float]] = {n: [] for n in counts}
        differ: dict[int, int] = {n: 0 for n in counts}
        sweeps: list[dict[int, float]] = []  # each sweep's mean tokens/s for each count
        for _ in range(args.sweeps):
            sweep: dict[int, list[float]] = {n: [] for n in counts}
            for n in counts + counts[::-1]:
                wall, results = await run_batch(host, [params(t, args.tokens) for t in TOPICS[:n]])
                sweep[n].append(sum(r["usage"]["completion_tokens"] for r in results) / wall)
                differ[n] += sum(r["tokens"] != alone[t] for r, t in zip(results, TOPICS[:n]))
            sweeps.append({n: statistics.mean(v) for n, v in sweep.items()})
            for n, v in sweep.items():
                rates[n] += v
        runs = 2 * args.sweeps
        print(f"\naggregate decode, {args.model} ({weights}), {args.tokens} tokens per stream, {os.cpu_count()} CPUs")
        print(f"| streams | tokens/s ({runs} runs) | × one stream: median (each sweep) | streams differing from alone |")
        print("| --- | --- | --- | --- |")
        for n in counts:
            each = [sweep[n] / sweep[counts[0]] for sweep in sweeps]
            ratio = statistics.median(each)
            print(f"| {n} | {' / '.join(f'{r:.1f}' for r in rates[n])} | {ratio:.2f}× "
                  f"({', '.join(f'{r:.2f}' for r in each)}) | {differ[n]} of {runs * n} |")
            report[f"streams_{n}"] = {"tokens_per_s": rates[n], "ratio": ratio, "ratios": each, "differ": differ[n],
                                      "of": runs * n}
        if 4 in counts:
            ratio4 = report["streams_4"]["ratio"]
            print(f"4 streams ≥ 2.5× one: {verdict(ratio4 >= 2.5)} ({ratio4:.2f}×, the median of {args.sweeps} sweeps)")
        for position, length in enumerate(int(n) for n in args.join_prompt.split(",")):
            joined = await join(host, args.tokens, length)
            joined["gap_solo_ms"] = 1000.0 / statistics.median(rates[counts[0]])  # one stream alone: its time per token
            report[f"join_{length}"] = joined
            print(f"\na {joined['join_prompt_tokens']}-token prompt joining 3 decoding streams:")
            print(f"  its first token: {joined['first_token_joined_ms']:.0f} ms (alone: "
                  f"{joined['first_token_alone_ms']:.0f} ms; a batched step of the 3: {joined['gap_before_ms']:.0f} ms)")
            print(f"  running streams' gap between tokens: one stream alone {joined['gap_solo_ms']:.0f} ms, the 3 "
                  f"before it joined {joined['gap_before_ms']:.0f} ms, while it was fed median "
                  f"{joined['gap_during_median_ms']:.0f} ms, max {joined['gap_during_max_ms']:.0f} ms "
                  f"({joined['gaps_during']} gaps)")
            # the streams' promise (docs/PROTOCOL.md 5.1)
            promise = 1000.0 * round_limit(joined["gap_solo_ms"] / 1000.0)
            within = joined["gap_during_median_ms"] <= promise
            print(f"  gaps while fed within {PROMISED_ROUND_OVER_SOLO:g}× of a stream alone, or "
                  f"{1000.0 * ROUND_ALLOWANCE_S:.0f} ms more where that is more ({promise:.0f} ms): {verdict(within)}")
            print(f"  fed in about {joined['gaps_during'] / 3:.0f} rounds")
            if position == 0:  # a prompt one chunk holds: the step in progress when it arrived, then one round
                bound = joined["gap_before_max_ms"] + joined["gap_during_max_ms"]
                print(f"  first token within the step in progress plus one round ({bound:.0f} ms): "
                      f"{verdict(joined['first_token_joined_ms'] <= bound)}")
        report["cpu_pressure_s"] = cpu_pressure_since(pressure)
    finally:
        await host.close()
    if args.json:
        write_report(args.json, report)


if __name__ == "__main__":
    asyncio.run(main())
