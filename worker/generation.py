"""The generate request, backend-independent: prompt, limits, streaming, counts, timings."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from collections.abc import Callable, Sequence

from protocol.errors import ErrorKind, RpcError
from protocol.methods import (
    CacheUse,
    ChatMessage,
    GenerateChunk,
    GenerateParams,
    GenerateResult,
    StopReason,
    Timings,
    Usage,
)
from worker.backends.base import Model
from worker.streaming import IncrementalDetokenizer, StopMatcher

SendChunk = Callable[[GenerateChunk], None]


class PromptSource(msgspec.Struct, frozen=True):
    """What a request says its prompt is: exactly one of the three fields."""

    prompt: str | None
    tokens: Sequence[int] | None
    messages: Sequence[ChatMessage] | None


def resolve_prompt(
    model: Model,
    source: PromptSource,
    *,
    add_special_tokens: bool,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    given = [name for name in ("prompt", "tokens", "messages") if getattr(source, name) is not None]
    if len(given) != 1:
        found = f"got {' and '.join(given)}" if given else "got none"
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            f"Give exactly one of 'prompt' (text), 'tokens' (ids) or 'messages' (chat); {found}.",
            field=f"params.{given[-1] if given else 'prompt'}",
        )
    if source.messages is not None:
        return model.render(source.messages, tools=tools, add_generation_prompt=add_generation_prompt)[1]
    if source.tokens is not None:
        check_vocabulary(model, source.tokens, "params.tokens")
        return list(source.tokens)
    assert source.prompt is not None
    return model.tokenize(source.prompt, add_special_tokens=add_special_tokens)


def check_vocabulary(model: Model, tokens: Sequence[int], field: str) -> None:
    vocab = model.info.vocab_size
    for i, token in enumerate(tokens):
        if token >= vocab:
            raise RpcError(
                ErrorKind.INVALID_PARAMS,
                f"Token id {token} at {field}[{i}] is outside the vocabulary (0 to {vocab - 1}); "
                "send ids that this model's tokenize returned.",
                field=f"{field}[{i}]",
            )


class CacheStart(msgspec.Struct, frozen=True):
    """Where a generate starts: ``cache`` covers the prompt's first ``reused`` tokens
    (a fresh cache when ``reused`` is 0; None for a backend that keeps no cache)."""

    cache: Any
    reused: int
    use: CacheUse  # what the result reports; auto fills in what it stored afterwards
    written: int = 0  # tokens the prefill that made the cache computed (reported once)


def prompt_tokens(model: Model, params: GenerateParams) -> list[int]:
    """The prompt's tokens, checked to leave room for max_tokens in the model's context."""
    source = PromptSource(params.prompt, params.tokens, params.messages)
    prompt = resolve_prompt(model, source, add_special_tokens=params.add_special_tokens, tools=params.tools)
    check_context(model, len(prompt), params.max_tokens)
    return prompt


def check_context(model: Model, prompt_length: int, max_tokens: int) -> None:
    if prompt_length == 0:
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            "The prompt is empty (no tokens to start from); give some text or tokens.",
            field="params.prompt",
        )
    context = model.info.context_length
    if prompt_length + max_tokens > context:
        raise RpcError(
            ErrorKind.CONTEXT_OVERFLOW,
            f"The prompt has {prompt_length} tokens and max_tokens is {max_tokens}, together more than "
            f"the model's context of {context} tokens; shorten the prompt or lower max_tokens.",
            field="params.max_tokens",
            limit=context,
        )


def generate(
    model: Model,
    params: GenerateParams,
    prompt: list[int],
    *,
    request_id: int | str,
    is_cancelled: Callable[[], bool],
    send_chunk: SendChunk,
    queued_ms: float,
    start: CacheStart | None = None,
    started: float | None = None,
) -> GenerateResult:
    started = started or time.perf_counter()
    reused = start.reused if start else 0
    stream = _Stream(model, params, request_id, len(prompt), reused, send_chunk, prompt)
    first_token_at: float | None = None
    stop_reason: StopReason | None = None
    tokens = stream.tokens
    from_cache = {"cache": start.cache} if start and start.cache is not None else {}
    steps = model.generate(prompt, params, is_cancelled, **from_cache)
    try:
        for token in steps:
            first_token_at = first_token_at or time.perf_counter()
            stop_reason = stream.push(token)
            if stop_reason is None and len(tokens) >= params.max_tokens:
                stop_reason = _reason("max_tokens")
            if stop_reason is None and is_cancelled():
                stop_reason = _reason("cancelled")
            if stop_reason is not None:
                break
    finally:
        steps.close()
    if stop_reason is None:  # the backend stopped: on a cancel, or having ended the sequence itself
        stop_reason = _reason("cancelled" if is_cancelled() else "eos")
    stream.finish()
    finished = time.perf_counter()
    first = first_token_at or finished
    decode_s = finished - first
    return GenerateResult(
        text=stream.text,
        tokens=tokens,
        finish_reason=_FINISH_REASONS[stop_reason.kind],
        stop_reason=stop_reason,
        usage=Usage(
            prompt_tokens=len(prompt),
            completion_tokens=len(tokens),
            cache_read_tokens=reused,
            cache_write_tokens=start.written if start else 0,
        ),
        cache=start.use if start else None,
        timings=Timings(
            queued_ms=queued_ms,
            prompt_ms=(first - started) * 1000.0,
            decode_ms=decode_s * 1000.0,
            total_ms=(finished - started) * 1000.0,
            tokens_per_second=(len(tokens) - 1) / decode_s if decode_s > 0 and len(tokens) > 1 else 0.0,
        ),
    )


def cancelled_before_start(queued_ms: float) -> GenerateResult:
    """The answer of a generate cancelled while it waited in the queue."""
    return GenerateResult(
        text="",
        tokens=[],
        finish_reason="cancelled",
        stop_reason=_reason("cancelled"),
        usage=Usage(prompt_tokens=0, completion_tokens=0, cache_read_tokens=0, cache_write_tokens=0),
        timings=Timings(queued_ms=queued_ms, prompt_ms=0.0, decode_ms=0.0, total_ms=0.0, tokens_per_second=0.0),
        cache=None,
    )


def _reason(kind: str, *, token: int | None = None, stop: str | None = None) -> StopReason:
    return StopReason(kind=kind, token=token, stop=stop)


_FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_tokens": "length", "cancelled": "cancelled"}


class _Stream:
    """Token ids in; stable text deltas out as chunks; the final text is their concatenation."""

    def __init__(
        self,
        model: Model,
        params: GenerateParams,
        request_id: int | str,
        prompt_tokens: int,
        cache_read_tokens: int,
        send_chunk: SendChunk,
        prompt: Sequence[int],
    ) -> None:
        self._eos = model.eos_token_ids
        self._detok = IncrementalDetokenizer(model.detokenize, prompt)
        self._stops = StopMatcher(params.stop)
        self._send = send_chunk if params.stream else None
        self._request_id = request_id
        self._prompt_tokens = prompt_tokens
        self._cache_read_tokens = cache_read_tokens
        self._pieces: list[str] = []
        self._stopped = False
        self.tokens: list[int] = []

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def push(self, token: int) -> StopReason | None:
        self.tokens.append(token)
        if token in self._eos:
            self._emit("", [token])
            return _reason("eos", token=token)
        text, stop = self._stops.push(self._detok.push(token))
        self._emit(text, [token])
        if stop is not None:
            self._stopped = True
            return _reason("stop_string", stop=stop)
        return None

    def finish(self) -> None:
        """Emit what was held back, unless a stop string ended the text."""
        if self._stopped:
            return
        text, stop = self._stops.push(self._detok.flush())
        tail = text + ("" if stop is not None else self._stops.flush())
        if tail:
            self._emit(tail, [])

    def _emit(self, text: str, tokens: list[int]) -> None:
        self._pieces.append(text)
        if self._send is not None:
            self._send(
                GenerateChunk(
                    id=self._request_id,
                    index=len(self._pieces) - 1,
                    text=text,
                    tokens=tokens,
                    generated_tokens=len(self.tokens),
                    prompt_tokens=self._prompt_tokens,
                    cache_read_tokens=self._cache_read_tokens,
                )
            )
