"""A generate and a prefill on an engine (an EngineModel: the openai backend's): what the worker
refuses before it sends the request, the engine's stream as a generation's token source, and a
prefill as a request for one token.

The engine resolves the prompt, samples and keeps its own cache; the worker's Generation
(worker/generation.py) applies its limits, stop strings and streaming to the stream as it does to a
local model's steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from protocol.errors import ErrorKind, RpcError
from protocol.methods import CacheUse, GenerateParams, PrefillParams, PrefillResult, StopReason
from worker.backends.base import EngineModel, Piece, StreamedDecoding, StreamEnd
from worker.generation import (
    AUTO,
    CacheReport,
    Generation,
    PromptSource,
    check_context,
    check_draft,
    check_source,
    stop_reason,
)
from worker.tool_calls import request_tools


def check_engine_request(model: EngineModel, params: GenerateParams) -> None:
    """What a request to an engine may not ask (the engine resolves the prompt and keeps its
    own cache; the rest of the checks are the engine's)."""
    check_source(PromptSource(params.prompt, params.tokens, params.messages))
    request_tools(params)
    check_draft(model, params)
    if params.cache not in (None, AUTO) or params.cache_trim_tokens is not None:
        field = "params.cache" if params.cache_trim_tokens is None else "params.cache_trim_tokens"
        raise RpcError(
            ErrorKind.UNSUPPORTED,
            f"The {model.info.backend} backend's server keeps the KV cache in its own memory, so the worker "
            'cannot store or read a named or memory:// cache; send cache: "auto" to let the server reuse '
            "prefixes it has computed (usage.cache_read_tokens reports them), or no cache.",
            field=field,
        )
    if params.tools and params.messages is None:
        raise RpcError(
            ErrorKind.UNSUPPORTED,
            f"The {model.info.backend} backend passes tools to the server's chat endpoint, which takes "
            "'messages'; send the conversation as messages.",
            field="params.tools",
        )
    # What can be told before the engine counts the prompt, refused as a local model refuses it
    # (the engine's own refusals name no field, or the wrong error kind).
    length = 0 if params.prompt == "" else len(params.tokens) if params.tokens is not None else None
    check_context(model, length, params.max_tokens)


class EngineStream:
    """An engine's stream as a generation's token source: the pieces it has received since the
    last step, the prompt's counts once the engine has said them, and how it ended."""

    reasoning = None  # the engine's text is the answer: the worker splits no thinking out of it
    drafted_tokens = accepted_tokens = 0  # an engine drafts on its own, if at all

    def __init__(self, decoding: StreamedDecoding, params: GenerateParams) -> None:
        self.decoding = decoding
        self._auto = params.cache == AUTO

    @property
    def prompt_tokens(self) -> int:
        return self.decoding.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.decoding.cached_tokens or 0

    def pieces(self) -> Iterator[Piece]:
        while self.decoding.has_next():
            yield self.decoding.next_piece()

    def end(self, tokens: Sequence[int]) -> StopReason | None:
        end = self.decoding.end
        if end is None or self.decoding.has_next():
            return None
        if end.error is not None:
            raise end.error
        return engine_stop(end, tokens)

    def flush(self) -> str:
        return ""  # the engine's text comes whole

    def close(self) -> None:
        self.decoding.close()

    def report(self, tokens: Sequence[int]) -> CacheReport | None:
        """What ``cache: "auto"`` did on an engine: its prefix cache's reuse; nothing is stored by
        the worker (the engine keeps what it computed as long as its memory allows)."""
        if not self._auto:
            return None
        reused = self.cached_tokens
        use = CacheUse(
            mode=AUTO, ref=None, reused_tokens=reused,
            reason=None if reused else "the server's prefix cache held none of this prompt",
            skipped=[], stored=None, stored_tokens=0,
            store_reason="the server keeps its own prefix cache; the worker stores nothing on this backend",
        )
        return CacheReport(use=use, written_tokens=0)


def engine_stop(end: StreamEnd, tokens: Sequence[int]) -> StopReason:
    """How an engine's own end reads in the worker's terms: its length limit (or context) as
    max_tokens, its stop string as one, anything else (end of sequence, tool calls) as eos."""
    if end.reason == "length":
        return stop_reason("max_tokens")
    if end.stop is not None:
        return stop_reason("stop_string", stop=end.stop)
    return stop_reason("eos", token=tokens[-1] if tokens else None)


class EnginePrefill:
    """A prefill on an engine: the prompt sent as a request for one token, so that the engine's
    prefix cache holds it for the requests after; what the engine read from that cache and
    computed is the answer. Only ``cache: "auto"`` names where the result goes: the engine's
    own memory."""

    def __init__(self, generation: Generation, started: float) -> None:
        self._generation = generation
        self._started = started
        self.model = generation.model
        self.decoding = generation.decoding

    @classmethod
    def start(
        cls, model: EngineModel, params: PrefillParams, *, request_id: int | str, is_cancelled: Callable[[], bool]
    ) -> EnginePrefill:
        started = time.perf_counter()
        backend = model.info.backend
        if params.cache != AUTO or params.base is not None or params.trim_to_tokens is not None:
            field = "params.cache" if params.cache != AUTO else "params.base" if params.base else "params.trim_to_tokens"
            raise RpcError(
                ErrorKind.UNSUPPORTED,
                f"The {backend} backend's server keeps the KV cache in its own memory, so a prefill cannot store a "
                'named or memory:// cache or start from one; send cache: "auto" (and no base) to compute the '
                "prompt into the server's prefix cache.",
                field=field,
            )
        one = GenerateParams(
            prompt=params.prompt, tokens=params.tokens, messages=params.messages, tools=params.tools,
            add_special_tokens=params.add_special_tokens, max_tokens=1, stream=False,
        )
        check_engine_request(model, one)  # what is known bad (an empty prompt, one past the context) is not sent
        source = EngineStream(model.submit(one, add_generation_prompt=params.add_generation_prompt), one)
        generation = Generation(
            model, one, source, request_id=request_id, is_cancelled=is_cancelled, send_chunk=lambda chunk: None,
            queued_ms=0.0, started=started,
        )
        return cls(generation, started)

    def feed(self, chunk_tokens: int) -> None:
        raise AssertionError("the engine computes the prompt")

    def chunk_taken(self) -> None:
        raise AssertionError("the engine computes the prompt")

    def advance(self) -> None:
        self._generation.advance()

    @property
    def done(self) -> bool:
        return self._generation.done

    def finish(self) -> PrefillResult:
        result = self._generation.finish()
        if result.finish_reason == "cancelled":
            raise RpcError(ErrorKind.REQUEST_CANCELLED, "prefill was cancelled; the server may hold part of it.")
        usage = result.usage
        return PrefillResult(
            cache=AUTO, token_count=usage.prompt_tokens, cache_read_tokens=usage.cache_read_tokens,
            cache_write_tokens=usage.prompt_tokens - usage.cache_read_tokens, bytes=0,
            time_ms=(time.perf_counter() - self._started) * 1000.0,
        )

