"""The real Gemma 3 270M (slow tier): 15 of its 18 layers attend to a sliding window of 512
positions. Every kind of cache, and an auto conversation whose prompt passes the window, gives
the greedy tokens of no cache. It is a base model without a chat template: prompts are text."""

from __future__ import annotations


import pytest

from tests.test_kv_cache import cache_dir, worker  # noqa: F401 (fixture)
from worker.host import Host

pytestmark = pytest.mark.slow

WINDOW = 512
SENTENCES = [
    "The river runs past the old mill, where the miller's daughter counts the sacks of grain.",
    "In the evening the fishermen bring their boats back to the harbour and mend their nets.",
    "A traveller arrives at the inn and asks for bread, cheese and a room with a view of the hills.",
    "The children of the village learn to read from a teacher who came from the city years ago.",
    "Every spring the shepherds lead their flocks up the mountain paths to the high meadows.",
]
STORY = " ".join(SENTENCES[i % len(SENTENCES)] + f" That was day {i}." for i in range(32))


async def generate(host: Host, prompt: str, **extra) -> dict:
    return await host.call("generate", {"prompt": prompt, "max_tokens": 12, **extra}, timeout=600)


async def test_every_kind_of_cache_on_gemma3_gives_the_greedy_output_of_no_cache(cache_dir):
    question = " Question: what does the traveller ask for? Answer:"
    first = await worker("gemma3-270m", cache_dir)
    try:
        count = (await first.call("tokenize", {"text": STORY}))["count"]
        assert count > WINDOW + 100, count
        plain = await generate(first, STORY + question)
        made = await first.call("prefill", {"prompt": STORY, "cache": "story"})
        await first.call("prefill", {"prompt": STORY, "cache": "memory://story"})
        whole = await first.call("prefill", {"prompt": STORY + question, "cache": "whole"})
        extended = await first.call(
            "prefill", {"prompt": STORY + question, "cache": "turn", "base": "whole", "trim_to_tokens": 40}
        )
        outputs = {
            "memory": await generate(first, STORY + question, cache="memory://story"),
            "whole prompt": await generate(first, STORY + question, cache="whole"),
            "trimmed base extended": await generate(first, STORY + question, cache="turn"),
        }
    finally:
        await first.close()
    second = await worker("gemma3-270m", cache_dir)
    try:
        outputs["disk, other process"] = await generate(second, STORY + question, cache="story")
    finally:
        await second.close()
    assert made["token_count"] > WINDOW and extended["cache_read_tokens"] == 40
    assert outputs["whole prompt"]["usage"]["cache_read_tokens"] == whole["token_count"] - 1
    assert len(set(plain["tokens"])) >= 4, plain["text"]
    for kind, result in outputs.items():
        assert result["tokens"] == plain["tokens"], kind
        assert result["usage"]["cache_read_tokens"] >= made["token_count"] - 1 or kind == "trimmed base extended"


async def test_an_auto_conversation_on_gemma3_past_its_window_reuses_each_turn_exactly(cache_dir):
    prompt, results, uncached = STORY, [], []
    host = await worker("gemma3-270m", cache_dir)
    try:
        for turn in range(3):
            if turn == 2:  # after a restart: the caches are read from disk
                await host.close()
                host = await worker("gemma3-270m", cache_dir)
            prompt += f"\nQuestion {turn}: what happened on day {turn}? Answer:"
            uncached.append(await generate(host, prompt))
            results.append(await generate(host, prompt, cache="auto"))
            prompt += results[-1]["text"]
    finally:
        await host.close()
    for result, plain in zip(results, uncached):
        assert result["tokens"] == plain["tokens"]
    assert results[0]["cache"]["reused_tokens"] == 0
    for before, after in zip(results, results[1:]):
        assert after["cache"]["ref"] == before["cache"]["stored"]
        assert after["cache"]["reused_tokens"] >= before["usage"]["prompt_tokens"] > WINDOW
