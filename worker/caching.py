"""prefill, and generate from a cache: which tokens are reused, which are computed, what is stored.

Greedy output from a cache equals greedy output without one because a cache is
used only when its tokens are exactly a prefix of the prompt, and at least the
last prompt token is always fed again (a cache covering the whole prompt would
leave no logits to pick the first token from).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import msgspec

from protocol.errors import ErrorKind, RpcError
from protocol.methods import (
    CacheUse,
    GenerateParams,
    PrefillParams,
    PrefillProgress,
    PrefillResult,
    SkippedCache,
)
from worker.backends.base import CachingDecoding, CachingModel, Decoding, Model
from worker.generation import AUTO, CacheReport, prefill_prompt
from worker.kvcache.container import Identity, cut_point
from worker.kvcache.store import MEMORY, Candidate, CacheStore, StorableCache

if TYPE_CHECKING:
    from worker.grammar import OutputConstraint

C = TypeVar("C", bound=StorableCache)

AUTO_PREFIX = "auto-"  # the refs auto stores under; an auto cache another one extends is deleted
# Restoring a token costs far less than computing it (bench/README.md, "Figures behind
# constants"), so a stored cache is worth loading when it saves a few tokens and at least
# 1/64 of what it holds.
AUTO_MIN_TOKENS = 4
AUTO_MIN_SHARE = 64


def as_caching_model(model: Model) -> CachingModel[Any]:
    """``model`` as the CachingModel it must be for a cache ref or a prefill (its cache type is
    its own: the worker only hands its caches back to it and to the store)."""
    if not isinstance(model, CachingModel):
        raise RpcError(
            ErrorKind.UNSUPPORTED,
            f"The {model.info.backend} backend keeps no KV cache, so 'cache' and prefill are not available; "
            "load a model with the transformers backend.",
            field="params.cache",
        )
    return model


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
        prompt: list[int] | None = None,
        request_id: int | str,
        is_cancelled: Callable[[], bool],
        send_progress: Callable[[PrefillProgress], None],
    ) -> None:
        self._started = time.perf_counter()
        model = as_caching_model(model)
        if params.cache != AUTO and params.cache.startswith(AUTO_PREFIX):
            # auto deletes an auto- cache that a longer one extends: a host's own would be lost
            raise RpcError(
                ErrorKind.INVALID_PARAMS,
                f"Refs that start with {AUTO_PREFIX!r} are the ones cache: \"auto\" makes and deletes; store under "
                f"another name, or prefill with cache: \"auto\".",
                field="params.cache",
            )
        tokens = prompt if prompt is not None else prefill_prompt(model, params)
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
                params.base, self._identity, model, max_positions=len(tokens), field="params.base"
            )
            limit = len(base_tokens) if params.trim_to_tokens is None else min(params.trim_to_tokens, len(base_tokens))
            reused = model.reusable_tokens(cache, common_prefix(base_tokens[:limit], tokens))
            model.crop_cache(cache, reused)
        self.model = model
        self.decoding = model.start(tokens, None, cache)
        self._store, self._params, self._tokens, self._reused = store, params, tokens, reused
        self._is_cancelled = is_cancelled
        self._progress = _progress(send_progress, request_id, len(tokens), reused)

    def feed(self, chunk_tokens: int) -> None:
        self.decoding.feed(chunk_tokens)
        self.chunk_taken()

    def chunk_taken(self) -> None:
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


def start_generate(
    store: CacheStore, model: Model, params: GenerateParams, prompt: Sequence[int]
) -> RequestCache[Any] | NoCache | None:
    """The cache a generate runs on, per its ``cache`` and ``cache_trim_tokens`` (None: no cache)."""
    if params.cache_trim_tokens is not None and params.cache in (None, AUTO):
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            "cache_trim_tokens limits the tokens used from a named 'cache'; give 'cache' a ref (not auto), "
            "or leave cache_trim_tokens out.",
            field="params.cache_trim_tokens",
        )
    if params.cache is None:
        return None
    max_positions = len(prompt) + params.max_tokens  # the most positions the cache will hold
    if params.cache == AUTO:
        if not isinstance(model, CachingModel):
            return NoCache(model, prompt, f"the {model.info.backend} backend keeps no KV cache")
        return _start_auto(store, model, prompt, max_positions)
    model = as_caching_model(model)
    return _start_from_ref(store, model, params.cache, prompt, params.cache_trim_tokens, max_positions)


class RequestCache(Generic[C]):
    """The KV cache of one generate, from start to result: the prompt's first ``reused`` tokens
    are in ``cache`` (made by start_generate), the decoding extends it in place, and at the end
    an auto request stores the sequence computed for the next turn; what the result says of it
    is built once, in ``finish``."""

    def __init__(
        self, store: CacheStore, model: CachingModel[C], prompt: Sequence[int], cache: C, *,
        mode: Literal["ref", "auto"], reused: int = 0, ref: str | None = None, reason: str | None = None,
        skipped: list[SkippedCache] | None = None, written: int = 0,
    ) -> None:
        """``written``: tokens the prefill that made a named cache computed (reported once)."""
        self._store, self._model, self._prompt = store, model, prompt
        self.cache, self.reused = cache, reused
        self._mode: Literal["ref", "auto"] = mode
        self._ref, self._reason, self._skipped, self._written = ref, reason, skipped or [], written

    def start(self, params: GenerateParams | None, constraint: OutputConstraint | None = None) -> CachingDecoding[C]:
        return self._model.start(self._prompt, params, self.cache, constraint=constraint)

    def finish(self, generated: Sequence[int]) -> CacheReport:
        stored, stored_tokens, store_reason, written = None, 0, None, self._written
        if self._mode == AUTO:
            stored, stored_tokens, store_reason = self._store_sequence(generated)
            written = stored_tokens - self.reused if stored else 0
        use = CacheUse(
            mode=self._mode, ref=self._ref, reused_tokens=self.reused, reason=self._reason, skipped=self._skipped,
            stored=stored, stored_tokens=stored_tokens, store_reason=store_reason,
        )
        return CacheReport(use=use, written_tokens=written)

    def _store_sequence(self, generated: Sequence[int]) -> tuple[str | None, int, str | None]:
        """Store the sequence computed (prompt and generated tokens) for the next turn: the ref
        stored under, the tokens it covers, and why nothing was stored or something went wrong."""
        store, model, cache = self._store, self._model, self.cache
        cached = model.cached_tokens(cache)
        covered = min(cached, len(self._prompt) + max(0, len(generated) - 1))  # the last token was never fed
        if covered < cached:  # drafted positions past the output
            model.crop_cache(cache, covered)
        sequence = (list(self._prompt) + list(generated))[:covered]
        if not sequence:
            return None, 0, "nothing was computed: the generate was cancelled before its first chunk"
        identity = model.cache_identity()
        candidates, _ = store.candidates(identity)  # again: other workers may have stored some meanwhile
        # Only a sound file counts as holding the sequence: a memory:// cache does not survive a restart,
        # and a damaged file of this very sequence is overwritten.
        unusable = {s.ref for s in self._skipped}
        holder = next(
            (
                c.ref for c in candidates
                if not c.ref.startswith(MEMORY) and c.ref not in unusable and c.tokens[: len(sequence)] == sequence
                and _can_resume(c.resume_points, [len(sequence)])
            ),
            None,
        )
        if holder is not None:
            return None, 0, f"nothing new to store: {holder!r} already covers these {len(sequence)} tokens"
        ref = _auto_ref(identity, sequence)
        try:
            store.save(ref, identity, sequence, cache, offsets=[], hashes=[], written_tokens=None)
        except (RpcError, OSError) as exc:
            return None, 0, f"not stored: {exc}"
        problem = None
        points = cache.resume_points()
        for old in candidates:  # an auto cache this one extends, and can be cut back like, is no longer needed
            if (
                old.ref.startswith(AUTO_PREFIX) and old.ref != ref and sequence[: len(old.tokens)] == old.tokens
                and _can_resume(points, old.resume_points or [len(old.tokens)])
            ):
                try:
                    store.delete(old.ref)
                except RpcError as exc:  # another user's, in a shared directory: it stays theirs, the result stands
                    reason = exc.__cause__.strerror if isinstance(exc.__cause__, OSError) else exc.message
                    problem = f"stored; {old.ref!r}, which it extends, could not be deleted: {reason}"
        return ref, len(sequence), problem


class NoCache:
    """``cache: "auto"`` on a model that keeps no KV cache: nothing is reused or stored, and
    the result says why."""

    def __init__(self, model: Model, prompt: Sequence[int], reason: str) -> None:
        self._model, self._prompt, self._reason = model, prompt, reason
        self.reused = 0

    def start(self, params: GenerateParams | None, constraint: OutputConstraint | None = None) -> Decoding:
        return self._model.start(self._prompt, params, constraint=constraint)

    def finish(self, generated: Sequence[int]) -> CacheReport:
        use = CacheUse(
            mode=AUTO, ref=None, reused_tokens=0, reason=self._reason, skipped=[], stored=None, stored_tokens=0,
            store_reason=self._reason,
        )
        return CacheReport(use=use, written_tokens=0)


def _start_from_ref(
    store: CacheStore, model: CachingModel[C], ref: str, prompt: Sequence[int], trim: int | None, max_positions: int
) -> RequestCache[C]:
    cached, cache = store.load(ref, model.cache_identity(), model, max_positions=max_positions)
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
    reused = model.reusable_tokens(cache, at_most_all_but_last(matched, prompt))  # the cache says how far back it cuts
    model.crop_cache(cache, reused)
    return RequestCache(
        store, model, prompt, cache, mode="ref", ref=ref, reused=reused, written=store.take_pending_writes(ref)
    )


def _start_auto(
    store: CacheStore, model: CachingModel[C], prompt: Sequence[int], max_positions: int
) -> RequestCache[C]:
    """From the stored cache that gives the most of ``prompt`` and is worth loading; else a fresh one."""
    identity = model.cache_identity()
    candidates, skipped = store.candidates(identity)
    ranked = sorted(candidates, key=lambda c: (-_reusable(c, prompt), len(c.tokens)))
    for candidate in ranked:
        if not _worth_loading(_reusable(candidate, prompt), len(candidate.tokens)):
            continue
        try:
            cached, cache = store.load(candidate.ref, identity, model, max_positions=max_positions)
        except RpcError as exc:  # damaged, or deleted by another worker since it was listed
            skipped.append(SkippedCache(ref=candidate.ref, reason=exc.message))
            continue
        # From the file itself, not the listing:
        reused = model.reusable_tokens(cache, at_most_all_but_last(common_prefix(cached, prompt), prompt))
        if not _worth_loading(reused, len(cached)):
            continue
        model.crop_cache(cache, reused)
        return RequestCache(
            store, model, prompt, cache, mode=AUTO, ref=candidate.ref, reused=reused, skipped=skipped
        )
    reason = _why_nothing_reused(candidates, skipped, prompt)
    return RequestCache(store, model, prompt, model.new_cache(), mode=AUTO, reason=reason, skipped=skipped)


def _reusable(candidate: Candidate, prompt: Sequence[int]) -> int:
    """How much of ``prompt`` a stored cache can give, by its listing: the prefix they share
    (at_most_all_but_last), as far back as the cache can be cut."""
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
