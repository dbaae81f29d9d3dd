"""The main job: a demo session, as a host would run it, printed for a person.

Spawns the worker over real pipes, loads a model, streams a generation and
prints the counts the worker reports.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from worker.host import Host

PROMPT = "lm-worker streams text back one token at a time: ¿sí? 你好 🙂"


async def run(backend: str, prompt: str, max_tokens: int) -> int:
    async with await Host.spawn("--log-level", "warning") as host:
        caps = await host.call("capabilities")
        print(f"lm-worker {caps['worker_version']} (protocol {caps['protocol_version']}, pid {caps['pid']})")
        info = await host.call("load", {"backend": backend})
        print(f"loaded {info['model']!r} with backend {info['backend']}: vocabulary {info['vocab_size']}, "
              f"context {info['context_length']}")
        msg_id, done = host.start("generate", {"prompt": prompt, "max_tokens": max_tokens})
        print("generating: ", end="", flush=True)
        shown = 0
        while not done.done():
            await asyncio.sleep(0.01)
            for chunk in host.chunks[msg_id][shown:]:
                print(chunk["text"], end="", flush=True)
            shown = len(host.chunks[msg_id])
        response = await done
        for chunk in host.chunks[msg_id][shown:]:
            print(chunk["text"], end="", flush=True)
        print()
        if "error" in response:
            print(f"error: {response['error']['message']}", file=sys.stderr)
            return 1
        result = response["result"]
        usage, timings = result["usage"], result["timings"]
        print(f"finish_reason={result['finish_reason']} chunks={len(host.chunks[msg_id])} "
              f"prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']} "
              f"cache_read_tokens={usage['cache_read_tokens']} cache_write_tokens={usage['cache_write_tokens']}")
        print(f"time to first token {timings['prompt_ms']:.2f} ms, decode {timings['tokens_per_second']:.0f} tokens/s")
        await host.call("shutdown")
        await host.notify("exit")
        return await host.wait()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.demo", description=__doc__)
    parser.add_argument("--backend", default="echo")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    return asyncio.run(run(args.backend, args.prompt, args.max_tokens))


if __name__ == "__main__":
    raise SystemExit(main())
