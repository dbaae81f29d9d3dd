"""Two checkouts of the worker side by side in one run: the same requests through
``python -m worker`` spawned from this checkout and from another revision (a git worktree
made for the run, removed after), interleaved round by round. For a speed change: its
figures before and after, measured in the same minutes on the same machine.

    .venv/bin/python bench/checkout_bench.py --base REV [--rounds 3] [--model default]

Each round, each worker (which goes first alternates) answers, greedy:

1. decode: 128 new tokens after a short prompt; tokens/s from its first chunk to its last;
2. a 2,048-token prompt (ids, another one each round, no cache): the time to its first token,
   then its next 63 tokens' decode tokens/s (a long context's step);
3. 4 streams of 64 new tokens at once: aggregate tokens/s.

Prints each figure's median for both, this checkout's ratio (speed ratios: this ÷ base;
the prompt's: this time ÷ base time, lower is better), the 1-minute load average after each
round, and whether the two gave the same greedy tokens for every request (they must, for a
change that keeps the numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_common import median  # noqa: E402
from worker.host import REPO_ROOT, Host  # noqa: E402

PROMPT = "The history of the city of Rome begins"
STREAMS = ["the history of Rome", "how rain forms", "the rules of chess", "the life of bees"]
LONG_PROMPT_TOKENS = 2048


async def timed(host: Host, params: dict) -> tuple[dict, float, float, float]:
    """The result of a generate, and when it was sent, its first chunk came and it ended."""
    sent = time.perf_counter()
    msg_id, done = host.start("generate", params)
    response = await asyncio.wait_for(done, 1800)
    ended = time.perf_counter()
    if "error" in response:
        raise RuntimeError(f"generate failed: {response['error']}")
    firsts = [t for m, t in zip(host.messages, host.arrival_times)
              if m.get("method") == "generate/chunk" and m["params"]["id"] == msg_id]
    return response["result"], sent, firsts[0] if firsts else ended, ended


async def round_of(host: Host, long_prompt: list[int]) -> tuple[dict[str, float], list[list[int]]]:
    figures, tokens = {}, []
    result, _, first, ended = await timed(host, {"prompt": PROMPT, "max_tokens": 128})
    figures["decode tokens/s (128 new)"] = (result["usage"]["completion_tokens"] - 1) / (ended - first)
    tokens.append(result["tokens"])
    result, sent, first, ended = await timed(host, {"tokens": long_prompt, "max_tokens": 64})
    figures[f"first token, {LONG_PROMPT_TOKENS}-token prompt (ms)"] = (first - sent) * 1000
    figures["decode tokens/s after it (64 new)"] = (result["usage"]["completion_tokens"] - 1) / (ended - first)
    tokens.append(result["tokens"])
    started = time.perf_counter()
    # prompt text, not messages: a base model (Gemma 3 270M) has no chat template
    streams = await asyncio.gather(*(timed(host, {"prompt": f"A long essay about {topic}.\n\n", "max_tokens": 64})
                                     for topic in STREAMS))
    count = sum(result["usage"]["completion_tokens"] for result, *_ in streams)
    figures["4 streams at once, aggregate tokens/s"] = count / (time.perf_counter() - started)
    tokens.extend(result["tokens"] for result, *_ in streams)
    return figures, tokens


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the revision to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="default")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lm-worker-base-") as scratch:
        base_root = Path(scratch) / "base"
        subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(base_root), args.base],
                       check=True, capture_output=True)
        try:
            await compare(args, base_root)
        finally:
            subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(base_root)], check=False)


async def compare(args: argparse.Namespace, base_root: Path) -> None:
    checkouts = {"base": base_root, "this": REPO_ROOT}
    hosts = {name: await Host.spawn("--max-batch", "4", checkout=root) for name, root in checkouts.items()}
    try:
        for host in hosts.values():
            await host.call("load", {"model": args.model}, timeout=900)
        words = (await hosts["this"].call("tokenize", {"text": " ".join(["history of the city"] * 800)}))["tokens"]
        figures: dict[str, dict[str, list[float]]] = {name: {} for name in hosts}
        same, loads = True, []
        for round_ in range(args.rounds):
            long_prompt = [words[0] + round_, *words[1:LONG_PROMPT_TOKENS]]  # another prompt each round
            order = list(hosts) if round_ % 2 == 0 else list(reversed(hosts))
            tokens = {}
            for name in order:
                got, tokens[name] = await round_of(hosts[name], long_prompt)
                for label, value in got.items():
                    figures[name].setdefault(label, []).append(value)
            same = same and tokens["base"] == tokens["this"]
            loads.append(os.getloadavg()[0])
            print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr)
    finally:
        for host in hosts.values():
            await host.close(timeout=120)
    print(f"\n{args.model}: this checkout against {args.base}, medians of {args.rounds} interleaved round(s)\n")
    print("| figure | base | this checkout | ratio |")
    print("| --- | --- | --- | --- |")
    for label in figures["this"]:
        base, this = median(figures["base"][label]), median(figures["this"][label])
        print(f"| {label} | {base:.1f} | {this:.1f} | {this / base:.2f}× |")
    print(f"\ngreedy tokens of the two: {'the same for every request' if same else 'DIFFERENT'}")
    print(f"1-minute load average after each round ({os.cpu_count()} CPUs): {', '.join(f'{x:.1f}' for x in loads)}")
    for label in figures["this"]:
        rounds = ", ".join(f"{t / b:.2f}×" for b, t in zip(figures["base"][label], figures["this"][label]))
        print(f"{label}, ratio per round: {rounds}")


if __name__ == "__main__":
    asyncio.run(main())
