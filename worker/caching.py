"""prefill, and generate from a cache: which tokens are reused, which are computed.

Greedy output from a cache equals greedy output without one because a cache is
used only when its tokens are exactly a prefix of the prompt, and at least the
last prompt token is always fed again (a cache covering the whole prompt would
leave no logits to pick the first token from).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from protocol.errors import ErrorKind, RpcError
from protocol.methods import PrefillParams, PrefillResult
from worker.backends.base import CachingModel, Model
from worker.generation import CacheStart, PromptSource, check_context, resolve_prompt
from worker.kvcache.store import CacheStore


def caching(model: Model) -> CachingModel:
    if not getattr(model, "supports_cache", False):
        raise RpcError(
            ErrorKind.UNSUPPORTED,
            f"The {model.info.backend} backend keeps no KV cache, so 'cache' and prefill are not available; "
            "load a model with the transformers backend.",
            field="params.cache",
        )
    return model  # type: ignore[return-value]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefill(store: CacheStore, model: Model, params: PrefillParams, is_cancelled: Callable[[], bool]) -> PrefillResult:
    started = time.perf_counter()
    model = caching(model)
    source = PromptSource(params.prompt, params.tokens, params.messages)
    tokens = resolve_prompt(
        model,
        source,
        add_special_tokens=params.add_special_tokens,
        tools=params.tools,
        add_generation_prompt=params.add_generation_prompt,
    )
    check_context(model, len(tokens), 0)
    if params.trim_to_tokens is not None and params.base is None:
        raise RpcError(
            ErrorKind.INVALID_PARAMS, "trim_to_tokens trims the 'base' cache; give 'base' too.", field="params.base"
        )
    identity = model.cache_identity()
    reused, cache = 0, None
    if params.base is not None:
        base_tokens, cache = store.load(params.base, identity, model.load_cache, field="params.base")
        limit = len(base_tokens) if params.trim_to_tokens is None else min(params.trim_to_tokens, len(base_tokens))
        reused = common_prefix(base_tokens[:limit], tokens)
        model.crop_cache(cache, reused)
    if cache is None:
        cache = model.new_cache()
    if not model.extend_cache(tokens, cache, is_cancelled):
        raise RpcError(ErrorKind.REQUEST_CANCELLED, "prefill was cancelled; nothing was stored.")
    written = len(tokens) - reused
    size = store.save(
        params.cache, identity, tokens, cache,
        offsets=params.prefix_offsets, hashes=params.prefix_hashes, written_tokens=written,
    )
    return PrefillResult(
        cache=params.cache, token_count=len(tokens), cache_read_tokens=reused, cache_write_tokens=written,
        bytes=size, time_ms=(time.perf_counter() - started) * 1000.0,
    )


def start_from_cache(store: CacheStore, model: Model, ref: str, prompt: Sequence[int]) -> CacheStart:
    model = caching(model)
    cached, cache = store.load(ref, model.cache_identity(), model.load_cache)
    matched = common_prefix(cached, prompt)
    if matched < len(cached) and matched < len(prompt):
        raise RpcError(
            ErrorKind.CACHE_PREFIX_MISMATCH,
            f"Cache {ref!r} covers {len(cached)} tokens, but the prompt differs from them at token {matched}; "
            "prefill a cache of this prompt's prefix, or generate without 'cache'.",
            field="params.cache",
        )
    reused = min(matched, len(prompt) - 1)  # always feed at least the last prompt token again
    model.crop_cache(cache, reused)
    return CacheStart(ref=ref, reused=reused, cache=cache, written=store.take_pending_writes(ref))
