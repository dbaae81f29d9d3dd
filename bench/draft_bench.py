"""Prompt-lookup drafting (``generate.draft``): acceptance and speed-up, side by side with
plain decoding in one run.

    .venv/bin/python bench/draft_bench.py [--model default] [--tokens 160] [--rounds 3] [--json FILE]

One worker (SmolLM2-135M on the CPU with the default int8 weights), driven over real
pipes. For each kind of prompt, greedy, ``--tokens`` new tokens at most, the same request
without ``draft`` and with each draft setting, interleaved over ``--rounds`` rounds (the
order rotating each round):

- **code edit**: a function to give back whole with one name changed (output that
  repeats the prompt, as an editor's rewrite does);
- **quote**: a paragraph to repeat with its spelling fixed;
- **chat**: questions answered in free prose (little to look up).

Printed per prompt and setting: decode tokens/s (completion tokens after the first, per
second from the first token to the last, the worker's own ``timings``), the ratio to
plain decoding in the same round, the share of drafted tokens taken, the tokens each
step gave, and whether every drafted output equals the plain one token for token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_common import cpu_pressure_since, cpu_pressure_us, verdict, write_report  # noqa: E402
from worker.host import Host  # noqa: E402

CODE = '''def load_orders(path):
    orders = []
    with open(path) as handle:
        for line in handle:
            fields = line.strip().split(",")
            if len(fields) != 3:
                continue
            customer, item, amount = fields
            orders.append({"customer": customer, "item": item, "amount": float(amount)})
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        totals[order["customer"]] = totals.get(order["customer"], 0.0) + order["amount"]
    return totals
'''

QUOTE = (
    "The river rises in the hills above the town and runs for fourty miles to the sea. In spring the "
    "snow melts and the water is high and fast; in summer it is slow and clear, and children swim "
    "in the pools below the old mill. The mill was built in 1820 and ground corn for a hundred years "
    "before it was turned into a museum, which is open every day exept Monday."
)

PROMPTS = {
    "code edit": [{"role": "user", "content": "Rename the variable `orders` to `records` everywhere in this code. "
                   "Reply with the whole code and nothing else.\n\n" + CODE}],
    "quote": [{"role": "user", "content": "Repeat this paragraph exactly, only fixing its spelling mistakes:\n\n" + QUOTE}],
    "chat": [{"role": "user", "content": "What are three good habits for staying healthy? Explain each one."}],
}

SETTINGS = {
    "plain": None,
    "draft 8, n 3..2": {"method": "prompt_lookup"},
    "draft 16, n 4..2": {"method": "prompt_lookup", "draft_tokens": 16, "ngram_max": 4},
    "draft 4, n 3..1": {"method": "prompt_lookup", "draft_tokens": 4, "ngram_min": 1},
}


def rate(result: dict) -> float:
    timings = result["timings"]
    return (len(result["tokens"]) - 1) / (timings["decode_ms"] / 1000.0)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))}
    host = await Host.spawn(env=env)
    report: dict = {"model": args.model, "tokens": args.tokens, "cpus": os.cpu_count(), "prompts": {}}
    try:
        info = await host.call("load", {"model": args.model}, timeout=900)
        report["weights"] = f"{info['dtype']}, quantization {info['quantization']}"
        await host.call("generate", {"prompt": "Hello", "max_tokens": 8})  # warm-up
        pressure = cpu_pressure_us()
        names = list(SETTINGS)
        for kind, messages in PROMPTS.items():
            runs: dict[str, list[dict]] = {name: [] for name in names}
            for round_index in range(args.rounds):
                order = names[round_index % len(names):] + names[: round_index % len(names)]
                for name in order:
                    params = {"messages": messages, "max_tokens": args.tokens}
                    if SETTINGS[name] is not None:
                        params["draft"] = SETTINGS[name]
                    runs[name].append(await host.call("generate", params, timeout=900))
            plain = runs["plain"]
            print(f"\n{kind}: {len(plain[0]['tokens'])} tokens, {args.model} ({report['weights']})")
            print("| setting | tokens/s (rounds) | × plain | drafted tokens taken | tokens per step | equal to plain |")
            print("| --- | --- | --- | --- | --- | --- |")
            rows = {}
            for name in names:
                results = runs[name]
                rates = [rate(r) for r in results]
                ratio = statistics.mean(rate(r) / rate(p) for r, p in zip(results, plain))
                drafted = sum(r["timings"]["draft_tokens"] for r in results)
                taken = sum(r["timings"]["draft_accepted_tokens"] for r in results)
                tokens = sum(len(r["tokens"]) for r in results)
                steps = tokens - taken  # each step (and the prompt's last chunk) gives one token past its draft
                equal = all(r["tokens"] == p["tokens"] for r, p in zip(results, plain))
                share = f"{taken / drafted:.0%} of {drafted // len(results)}" if drafted else "–"
                print(f"| {name} | {' / '.join(f'{x:.1f}' for x in rates)} | {ratio:.2f}× | {share} | "
                      f"{tokens / steps:.2f} | {verdict(equal)} |")
                rows[name] = {"tokens_per_s": rates, "ratio": ratio, "drafted": drafted, "taken": taken,
                              "tokens_per_step": tokens / steps, "equal": equal}
            report["prompts"][kind] = rows
        report["cpu_pressure_s"] = cpu_pressure_since(pressure)
    finally:
        await host.close()
    if args.json:
        write_report(args.json, report)


if __name__ == "__main__":
    asyncio.run(main())
