"""The main job: a demo session, as a host would run it, printed for a person.

Spawns the worker over real pipes, loads the default model (SmolLM2-135M-Instruct;
the first run converts it once, which takes about a minute), prefills a system
prompt into a KV cache, then streams answers to two questions from that cache
and prints the counts the worker reports: the system prompt is computed once.
Then a two-turn conversation with ``cache: "auto"``: each turn is stored on
disk, and the next turn (or the next run of the demo) starts from it. Last, three
questions at once: the worker decodes them in one batch.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from worker.host import Host, WorkerError

SYSTEM = "You are a concise assistant. Answer every question in one short sentence."
QUESTIONS = ["What is the capital of France?", "What is the capital of Italy?"]
CONVERSATION = ["Name one famous French painter.", "Tell me one of his paintings."]
AT_ONCE = ["What is the capital of Spain?", "What is the largest ocean?", "What color is the sky?"]
CACHE = "memory://demo-system"


async def ask(host: Host, messages: list[dict], question: str, max_tokens: int, cache: str) -> dict | None:
    """Stream one answer starting from ``cache``; print it and its counts."""
    print(f"\n> {question}\n", flush=True)
    msg_id, done = host.start("generate", {"messages": messages, "max_tokens": max_tokens, "cache": cache})
    shown = 0
    while True:
        finished = done.done()
        for chunk in host.chunks[msg_id][shown:]:
            print(chunk["text"], end="", flush=True)
            shown += 1
        if finished:
            break
        await asyncio.wait([done], timeout=0.02)
    response = await done
    print("\n")
    if "error" in response:
        print(f"error: {response['error']['message']}", file=sys.stderr)
        return None
    result = response["result"]
    usage, timings = result["usage"], result["timings"]
    print(
        f"finish_reason={result['finish_reason']} chunks={shown} prompt_tokens={usage['prompt_tokens']} "
        f"completion_tokens={usage['completion_tokens']} cache_read_tokens={usage['cache_read_tokens']} "
        f"cache_write_tokens={usage['cache_write_tokens']}"
    )
    print(f"time to first token {timings['prompt_ms']:.0f} ms, decode {timings['tokens_per_second']:.1f} tokens/s")
    use = result["cache"]
    if use["mode"] == "auto":
        reused = f"reused {use['reused_tokens']} tokens of {use['ref']!r}" if use["ref"] else f"reused nothing: {use['reason']}"
        stored = f"stored {use['stored_tokens']} tokens as {use['stored']!r}" if use["stored"] else use["store_reason"]
        print(f"auto cache: {reused}; {stored}")
    return result


async def at_once(host: Host, system: list[dict], max_tokens: int) -> None:
    print("\nThree questions at once, decoded together in one batch:")
    started = time.perf_counter()
    pending = [
        host.start("generate", {"messages": system + [{"role": "user", "content": q}], "max_tokens": max_tokens,
                                "cache": CACHE})
        for q in AT_ONCE
    ]
    results = [(await done)["result"] for _, done in pending]
    wall = time.perf_counter() - started
    for question, result in zip(AT_ONCE, results):
        print(f"\n> {question}\n{result['text'].strip()}  ({result['usage']['completion_tokens']} tokens)")
    tokens = sum(result["usage"]["completion_tokens"] for result in results)
    print(f"\n{tokens} tokens in {wall:.1f} s together: {tokens / wall:.1f} tokens/s over the three streams")


async def run(load: dict, questions: list[str], max_tokens: int) -> int:
    async with await Host.spawn("--log-level", "warning") as host:
        caps = await host.call("capabilities")
        print(f"lm-worker {caps['worker_version']} (protocol {caps['protocol_version']}, pid {caps['pid']})")
        print(f"loading {load.get('model', 'default')} ...", flush=True)
        info = await host.call("load", load, timeout=600)
        weights = "dense" if info["quantization"] == "none" else info["quantization"]
        print(
            f"loaded {info['model']} ({info['backend']}, {info['dtype']}, {weights} weights, on {info['device']}) in "
            f"{info['load_time_ms'] / 1000:.1f} s: vocabulary {info['vocab_size']}, context {info['context_length']}"
        )
        if not info["has_chat_template"]:
            print("this demo needs a model with a chat template", file=sys.stderr)
            return 1
        system = [{"role": "system", "content": SYSTEM}]
        made = await host.call("prefill", {"messages": system, "add_generation_prompt": False, "cache": CACHE})
        print(
            f"prefilled the system prompt into cache {CACHE!r}: {made['token_count']} tokens "
            f"({made['cache_write_tokens']} computed, {made['cache_read_tokens']} reused), "
            f"{made['bytes'] / 1e6:.1f} MB in {made['time_ms']:.0f} ms"
        )
        for question in questions:
            messages = system + [{"role": "user", "content": question}]
            if not await ask(host, messages, question, max_tokens, CACHE):
                return 1
        print('\nA conversation with cache "auto": each turn is stored for the next one.')
        messages = system
        for question in CONVERSATION:
            messages = messages + [{"role": "user", "content": question}]
            answer = await ask(host, messages, question, max_tokens, "auto")
            if answer is None:
                return 1
            messages = messages + [{"role": "assistant", "content": answer["text"]}]
        await at_once(host, system, max_tokens)
        await host.call("shutdown")
        await host.notify("exit")
        return await host.wait()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.demo", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", default="transformers", help="backend to load (default: transformers)")
    parser.add_argument("--model", default="default", help="model directory or .gguf file (default: SmolLM2)")
    parser.add_argument("--question", action="append", help="ask this (repeatable); default: two questions")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", help="where the model runs: cpu (the load's default), cuda, cuda:N or mps")
    args = parser.parse_args()
    load = {"backend": args.backend, "model": args.model}
    if args.device is not None:
        load["device"] = args.device
    try:
        return asyncio.run(run(load, args.question or QUESTIONS, args.max_tokens))
    except WorkerError as exc:  # the worker's answer says what was wrong and what to do
        print(f"the worker answered an error: {exc.message} ({exc.kind})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
