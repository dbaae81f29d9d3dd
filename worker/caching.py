"""prefill, and generate from a cache: which tokens are reused, which are computed.

Greedy output from a cache equals greedy output without one because a cache is
used only when its tokens are exactly a prefix of the prompt, and at least the
last prompt token is always fed again (a cache covering the whole prompt would
leave no logits to pick the first token from).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

import msgspec

from protocol.errors import ErrorKind, RpcError
from protocol.methods import (
    CacheUse,
    GenerateParams,
    GenerateResult,
    PrefillParams,
    PrefillProgress,
    PrefillResult,
    SkippedCache,
)
from worker.backends.base import CachingModel, Model
from worker.generation import CacheStart, PromptSource, check_context, resolve_prompt
from worker.kvcache.container import Identity, TensorEntry, cut_point
from worker.kvcache.store import MEMORY, Candidate, CacheStore

AUTO = "auto"
AUTO_PREFIX = "auto-"  # the refs auto stores under; an auto cache another one extends is deleted
# Restoring a token costs about a hundredth of computing it, so a stored cache is worth
# loading when it saves a few tokens and at least 1/64 of what it holds.
AUTO_MIN_TOKENS = 4
AUTO_MIN_SHARE = 64


def as_caching_model(model: Model) -> CachingModel:
    if not getattr(model, "supports_cache", False):
        raise RpcError(
            ErrorKind.UNSUPPORTED,
            f"The {model.info.backend} backend keeps no KV cache, so 'cache' and prefill are not available; "
            "load a model with the transformers backend.",
            field="params.cache",
        )
    return model  # type: ignore[return-value]


def at_most_all_but_last(shared: int, prompt: Sequence[int]) -> int:
    """Of ``shared`` tokens a cache has in common with a generate's prompt, those it may give: never
    the prompt's last token, which is always fed again (its logits choose the first new token)."""
    return min(shared, len(prompt) - 1)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Prefill:
    """One prefill request on its way: its tokens fed in chunks, then stored under its ref."""

    def __init__(
        self,
        store: CacheStore,
        model: Model,
        params: PrefillParams,
        *,
        request_id: int | str,
        is_cancelled: Callable[[], bool],
        send_progress: Callable[[PrefillProgress], None],
    ) -> None:
        self._started = time.perf_counter()
        model = as_caching_model(model)
        source = PromptSource(params.prompt, params.tokens, params.messages)
        tokens = resolve_prompt(
            model,
            source,
            add_special_tokens=params.add_special_tokens,
            tools=params.tools or [],
            add_generation_prompt=params.add_generation_prompt,
        )
        check_context(model, len(tokens), 0)
        if params.trim_to_tokens is not None and params.base is None:
            raise RpcError(
                ErrorKind.INVALID_PARAMS, "trim_to_tokens trims the 'base' cache; give 'base' too.", field="params.base"
            )
        self._identity = model.cache_identity()
        reused, cache = 0, None
        if params.cache == AUTO and params.base is None:  # from the stored cache an auto generate would use
            start = _start_auto(store, model, tokens, len(tokens))
            reused, cache = start.reused, start.cache
        elif params.base is not None:
            base_tokens, cache = store.load(
                params.base, self._identity, model.load_cache, field="params.base", room=_room(model, len(tokens)),
                check=model.cache_problem,
            )
            limit = len(base_tokens) if params.trim_to_tokens is None else min(params.trim_to_tokens, len(base_tokens))
            reused = model.reusable_tokens(cache, common_prefix(base_tokens[:limit], tokens))
            model.crop_cache(cache, reused)
        self.model = model
        self.decoding = model.start(tokens, None, cache)
        self._store, self._params, self._tokens, self._reused = store, params, tokens, reused
        self._is_cancelled = is_cancelled
        self._progress = _progress(send_progress, request_id, len(tokens), reused)

    def feed(self, max_tokens: int) -> None:
        self.decoding.feed(max_tokens)
        self.fed()

    def fed(self) -> None:
        self._progress(len(self._tokens) - self.decoding.prompt_left)

    def advance(self) -> None:
        raise AssertionError("a prefill chooses no tokens")

    @property
    def done(self) -> bool:
        return not self.decoding.prompt_left or self._is_cancelled()

    def finish(self) -> PrefillResult:
        if self.decoding.prompt_left:
            raise RpcError(ErrorKind.REQUEST_CANCELLED, "prefill was cancelled; nothing was stored.")
        params, tokens = self._params, self._tokens
        written = len(tokens) - self._reused
        ref = _auto_ref(self._identity, tokens) if params.cache == AUTO else params.cache
        size = self._store.save(
            ref, self._identity, tokens, self.decoding.cache,
            offsets=params.prefix_offsets, hashes=params.prefix_hashes, written_tokens=written,
        )
        return PrefillResult(
            cache=ref, token_count=len(tokens), cache_read_tokens=self._reused, cache_write_tokens=written,
            bytes=size, time_ms=(time.perf_counter() - self._started) * 1000.0,
        )


def _progress(
    send: Callable[[PrefillProgress], None], request_id: int | str, total: int, reused: int
) -> Callable[[int], None]:
    """Report each chunk of a prefill that takes more than one; a one-chunk prefill sends none."""
    sent = False

    def report(covered: int) -> None:
        nonlocal sent
        if covered < total or sent:
            sent = True
            send(PrefillProgress(id=request_id, processed_tokens=covered, total_tokens=total, cache_read_tokens=reused))

    return report


def start_generate(store: CacheStore, model: Model, params: GenerateParams, prompt: Sequence[int]) -> CacheStart | None:
    """The cache a generate starts from, per its ``cache`` and ``cache_trim_tokens``."""
    if params.cache_trim_tokens is not None and params.cache in (None, AUTO):
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            "cache_trim_tokens limits the tokens used from a named 'cache'; give 'cache' a ref (not auto), "
            "or leave cache_trim_tokens out.",
            field="params.cache_trim_tokens",
        )
    if params.cache is None:
        return None
    held = len(prompt) + params.max_tokens  # the most positions the cache will hold
    if params.cache == AUTO:
        return _start_auto(store, model, prompt, held)
    return _start_from_ref(store, model, params.cache, prompt, params.cache_trim_tokens, held)


def finish_generate(store: CacheStore, model: Model, start: CacheStart | None, prompt: Sequence[int],
                    result: GenerateResult) -> None:
    """After an auto generate: store the sequence computed (prompt and generated tokens) for the next turn."""
    if start is None or start.use.mode != AUTO or start.cache is None:
        return
    use = start.use
    cached = model.cached_tokens(start.cache)
    covered = min(cached, len(prompt) + max(0, len(result.tokens) - 1))  # the last token was never fed
    if covered < cached:  # drafted positions past the output
        model.crop_cache(start.cache, covered)
    sequence = (list(prompt) + result.tokens)[:covered]
    if not sequence:
        use.store_reason = "nothing was computed: the generate was cancelled before its first chunk"
        return
    identity = model.cache_identity()
    candidates, _ = store.candidates(identity)  # again: other workers may have stored some meanwhile
    # Only a sound file counts as holding the sequence: a memory:// cache does not survive a restart,
    # and a damaged file of this very sequence is overwritten.
    unusable = {s.ref for s in use.skipped}
    holder = next(
        (
            c.ref for c in candidates
            if not c.ref.startswith(MEMORY) and c.ref not in unusable and c.tokens[: len(sequence)] == sequence
            and _can_resume(c.resume_points, [len(sequence)])
        ),
        None,
    )
    if holder is not None:
        use.store_reason = f"nothing new to store: {holder!r} already covers these {len(sequence)} tokens"
        return
    ref = _auto_ref(identity, sequence)
    try:
        store.save(ref, identity, sequence, start.cache, offsets=[], hashes=[], written_tokens=None)
    except (RpcError, OSError) as exc:
        use.store_reason = f"not stored: {exc}"
        return
    points = start.cache.resume_points()
    for old in candidates:  # an auto cache this one extends, and can be cut back like, is no longer needed
        if (
            old.ref.startswith(AUTO_PREFIX) and old.ref != ref and sequence[: len(old.tokens)] == old.tokens
            and _can_resume(points, old.resume_points or [len(old.tokens)])
        ):
            try:
                store.delete(old.ref)
            except RpcError as exc:  # another user's, in a shared directory: it stays theirs, the result stands
                reason = exc.__cause__.strerror if isinstance(exc.__cause__, OSError) else exc.message
                use.store_reason = f"stored; {old.ref!r}, which it extends, could not be deleted: {reason}"
    use.stored, use.stored_tokens = ref, len(sequence)
    result.usage.cache_write_tokens = len(sequence) - start.reused


def _start_from_ref(
    store: CacheStore, model: Model, ref: str, prompt: Sequence[int], trim: int | None, held: int
) -> CacheStart:
    model = as_caching_model(model)
    cached, cache = store.load(
        ref, model.cache_identity(), model.load_cache, room=_room(model, held), check=model.cache_problem
    )
    usable = cached if trim is None else cached[:trim]
    matched = common_prefix(usable, prompt)
    if matched < len(usable) and matched < len(prompt):
        trimmed = "" if trim is None else f" (the first {len(usable)} after cache_trim_tokens)"
        raise RpcError(
            ErrorKind.CACHE_PREFIX_MISMATCH,
            f"Cache {ref!r} covers {len(cached)} tokens{trimmed}, but the prompt differs from them at token "
            f"{matched}; prefill a cache of this prompt's prefix, lower cache_trim_tokens to {matched}, "
            "or use cache: \"auto\".",
            field="params.cache",
        )
    # The cache says how far it can be cut back.
    reused = model.reusable_tokens(cache, at_most_all_but_last(matched, prompt))
    model.crop_cache(cache, reused)
    use = _use("ref", ref=ref, reused=reused)
    return CacheStart(cache=cache, reused=reused, use=use, written=store.take_pending_writes(ref))


def _start_auto(store: CacheStore, model: Model, prompt: Sequence[int], held: int) -> CacheStart:
    if not getattr(model, "supports_cache", False):
        reason = f"the {model.info.backend} backend keeps no KV cache"
        return CacheStart(cache=None, reused=0, use=_use(AUTO, reason=reason, store_reason=reason))
    model = as_caching_model(model)
    identity = model.cache_identity()
    candidates, skipped = store.candidates(identity)
    ranked = sorted(candidates, key=lambda c: (-_reusable(c, prompt), len(c.tokens)))
    for candidate in ranked:
        if not _worth_loading(_reusable(candidate, prompt), len(candidate.tokens)):
            continue
        try:
            cached, cache = store.load(
                candidate.ref, identity, model.load_cache, room=_room(model, held), check=model.cache_problem
            )
        except RpcError as exc:  # damaged, or deleted by another worker since it was listed
            skipped.append(SkippedCache(ref=candidate.ref, reason=exc.message))
            continue
        # From the file itself, not the listing:
        reused = model.reusable_tokens(cache, at_most_all_but_last(common_prefix(cached, prompt), prompt))
        if not _worth_loading(reused, len(cached)):
            continue
        model.crop_cache(cache, reused)
        return CacheStart(cache=cache, reused=reused, use=_use(AUTO, ref=candidate.ref, reused=reused, skipped=skipped))
    use = _use(AUTO, reason=_why_nothing_reused(candidates, skipped, prompt), skipped=skipped)
    return CacheStart(cache=model.new_cache(), reused=0, use=use)


def _room(model: CachingModel, held: int) -> Callable[[TensorEntry], int]:
    """The room to read a stored cache with, for a request whose cache will hold at most ``held`` positions."""
    return lambda entry: model.cache_room(entry, held)


def _reusable(candidate: Candidate, prompt: Sequence[int]) -> int:
    """How much of ``prompt`` a stored cache can give: the prefix they share, but never the
    last prompt token (always fed), and only as far as the cache can be cut back."""
    return cut_point(candidate.resume_points, at_most_all_but_last(common_prefix(candidate.tokens, prompt), prompt))


def _can_resume(points: list[int] | None, lengths: Sequence[int]) -> bool:
    """Whether a cache with these resume points can be cut back to each of ``lengths``."""
    return points is None or set(lengths) <= set(points)


def _worth_loading(reused: int, cached: int) -> bool:
    return reused >= AUTO_MIN_TOKENS and reused * AUTO_MIN_SHARE >= cached


def _why_nothing_reused(candidates: list[Candidate], skipped: list[SkippedCache], prompt: Sequence[int]) -> str:
    if not candidates:
        return "no cache of this model is stored yet" + (" that could be read" if skipped else "")
    best = max(candidates, key=lambda c: _reusable(c, prompt))
    shared = _reusable(best, prompt)
    if shared == 0:
        return f"no stored cache of this model starts like this prompt ({len(candidates)} looked at)"
    if _worth_loading(shared, len(best.tokens)):
        return "the caches sharing a prefix with this prompt could not be used (see skipped)"
    return (
        f"the most any stored cache shares with this prompt is {shared} token{'s' * (shared != 1)} "
        f"({best.ref!r} holds {len(best.tokens)}): too few to be worth loading (at least {AUTO_MIN_TOKENS} tokens and "
        f"1/{AUTO_MIN_SHARE} of the cache)"
    )


def _auto_ref(identity: Identity, sequence: Sequence[int]) -> str:
    """The same sequence of the same model always gets the same name."""
    digest = hashlib.sha256(msgspec.json.encode(identity))
    digest.update(msgspec.json.encode(list(sequence)))
    return AUTO_PREFIX + digest.hexdigest()[:24]


def _use(mode: str, *, ref: str | None = None, reused: int = 0, reason: str | None = None,
         skipped: list[SkippedCache] | None = None, store_reason: str | None = None) -> CacheUse:
    return CacheUse(
        mode=mode, ref=ref, reused_tokens=reused, reason=reason, skipped=skipped or [],
        stored=None, stored_tokens=0, store_reason=store_reason,
    )
