"""What constrained output costs per token: decode speed with response_format against without.

    .venv/bin/python bench/constraint_bench.py [--model default] [--rounds 3] [--json FILE]

One worker on its default CPU path (SmolLM2-135M by default), over real pipes. Each round runs,
one after the other (the machine drifts, so they alternate): a free greedy generate of 128
tokens, a JSON Schema one (an array of 24 bounded strings: a long constrained output), and a
json_object one. Decode speed is the worker's own ``timings.tokens_per_second`` (tokens after
the first, per second), so the outputs' different lengths do not matter. Printed: the median
of each and the ratios constrained / free (target: at least 0.9).

Then, in this process: the grammar's own time per token (computing the mask of allowed
tokens, setting the disallowed logits to minus infinity, taking the token), replayed over the
constrained output's tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_common import cpu_pressure_us, median, verdict, write_report  # noqa: E402
from worker.host import Host  # noqa: E402

LIST = {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 24, "maxItems": 24}
QUESTION = [{"role": "user", "content": "List twenty-four fruits and vegetables, with a short note on each."}]
REQUESTS = {
    "free": {"messages": QUESTION, "max_tokens": 128},
    "json_schema": {
        "messages": QUESTION,
        "max_tokens": 400,
        "response_format": {"type": "json_schema", "json_schema": {"name": "list", "schema": LIST}},
    },
    "json_object": {"messages": QUESTION, "max_tokens": 128, "response_format": {"type": "json_object"}},
}


async def measure(model: str, rounds: int) -> tuple[dict[str, list[float]], dict[str, int], list[int]]:
    speeds: dict[str, list[float]] = {name: [] for name in REQUESTS}
    lengths: dict[str, int] = {}
    constrained_tokens: list[int] = []
    host = await Host.spawn()
    try:
        await host.call("load", {"model": model}, timeout=900)
        for name, params in REQUESTS.items():  # warm-up: the grammar's vocabulary is made on first use
            await host.call("generate", {**params, "max_tokens": 4}, timeout=900)
        for _ in range(rounds):
            for name, params in REQUESTS.items():
                result = await host.call("generate", params, timeout=1800)
                speeds[name].append(result["timings"]["tokens_per_second"])
                lengths[name] = result["usage"]["completion_tokens"]
                if name == "json_schema":
                    constrained_tokens = result["tokens"]
    finally:
        await host.close()
    return speeds, lengths, constrained_tokens


def grammar_time_per_token(model: str, tokens: list[int]) -> float:
    """Seconds per token the grammar adds (mask, masked logits, taking the token)."""
    import torch

    from protocol.methods import GenerateParams, JsonSchemaFormat, JsonSchemaSpec, LoadParams
    from worker.backends.transformers.backend import TransformersBackend
    from worker.constraints import output_constraint
    from worker.data_dir import default_data_dir

    loaded = TransformersBackend().load(LoadParams(model=model), data_dir=default_data_dir())
    params = GenerateParams(
        prompt="x", response_format=JsonSchemaFormat(json_schema=JsonSchemaSpec(name="list", schema=LIST))
    )
    output_constraint(loaded, params)  # the vocabulary, made once per model
    logits = torch.randn(1, loaded.info.vocab_size)
    best = float("inf")
    for _ in range(3):
        constraint = output_constraint(loaded, params)
        started = time.perf_counter()
        for token in tokens[:-1]:  # the last is the end of sequence the grammar allowed
            allowed = torch.from_numpy(constraint.allowed(logits.shape[-1]))
            logits.masked_fill(~allowed, float("-inf"))
            constraint.accept(token)
        best = min(best, (time.perf_counter() - started) / max(1, len(tokens) - 1))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    pressure = cpu_pressure_us()
    speeds, lengths, tokens = asyncio.run(measure(args.model, args.rounds))
    waited = cpu_pressure_us()
    free = median(speeds["free"])
    print(f"decode tokens/s, median of {args.rounds} rounds alternating ({args.model}):")
    report: dict = {"model": args.model, "rounds": args.rounds}
    for name in REQUESTS:
        ratio = median(speeds[name]) / free
        mark = "" if name == "free" else f"  {ratio:.2f}x free  {verdict(ratio >= 0.9)} (target >= 0.9)"
        print(f"  {name:12s} {median(speeds[name]):6.1f} tok/s over {lengths[name]:3d} tokens{mark}")
        report[name] = {"tokens_per_second": speeds[name], "tokens": lengths[name], "ratio": ratio}
    per_token = grammar_time_per_token(args.model, tokens)
    print(f"grammar time per token (mask + masked logits + take), json_schema: {per_token * 1e3:.3f} ms")
    report["grammar_ms_per_token"] = per_token * 1e3
    if pressure is not None and waited is not None:
        print(f"CPU pressure during the run: {(waited - pressure) / 1e6:.1f} s of runnable tasks waiting")
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
