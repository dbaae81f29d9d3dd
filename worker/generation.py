"""The generate request, backend-independent: prompt, limits, streaming, counts, timings."""

from __future__ import annotations

import time
from typing import Literal, Protocol

import msgspec
from collections.abc import Callable, Sequence

from protocol.errors import ErrorKind, RpcError
from protocol.methods import (
    CacheUse,
    ChatMessage,
    GenerateChunk,
    GenerateParams,
    GenerateResult,
    PrefillParams,
    PrefillResult,
    StopReason,
    Timings,
    Tool,
    ToolCall,
    Usage,
)
from worker.backends.base import (
    Decoding,
    DraftingDecoding,
    DraftingModel,
    EngineDelta,
    EngineModel,
    Model,
    StreamedDecoding,
    StreamEnd,
)
from worker.constraints import OutputConstraint
from worker.reasoning import ReasoningSplitter, splitter_for
from worker.streaming import IncrementalDetokenizer, StopMatcher
from worker.tool_calls import call_reader, for_template, request_tools

SendChunk = Callable[[GenerateChunk], None]


class PromptSource(msgspec.Struct, frozen=True):
    """What a request says its prompt is: exactly one of the three fields."""

    prompt: str | None
    tokens: Sequence[int] | None
    messages: Sequence[ChatMessage] | None


def check_source(source: PromptSource) -> None:
    given = [name for name in ("prompt", "tokens", "messages") if getattr(source, name) is not None]
    if len(given) != 1:
        found = f"got {' and '.join(given)}" if given else "got none"
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            f"Give exactly one of 'prompt' (text), 'tokens' (ids) or 'messages' (chat); {found}.",
            field=f"params.{given[-1] if given else 'prompt'}",
        )


def resolve_prompt(
    model: Model,
    source: PromptSource,
    *,
    add_special_tokens: bool,
    tools: Sequence[Tool] = (),
    add_generation_prompt: bool = True,
) -> list[int]:
    check_source(source)
    if source.messages is not None:
        return render_messages(model, source.messages, tools, add_generation_prompt=add_generation_prompt)[1]
    if source.tokens is not None:
        check_vocabulary(model, source.tokens, "params.tokens")
        return list(source.tokens)
    assert source.prompt is not None
    return model.tokenize(source.prompt, add_special_tokens=add_special_tokens)


def render_messages(
    model: Model, messages: Sequence[ChatMessage], tools: Sequence[Tool], *, add_generation_prompt: bool
) -> tuple[str, list[int]]:
    """A conversation as the model's prompt: text and tokens, with the tools described in the way
    the model takes them (worker/tool_calls.py)."""
    conversation, template_tools = for_template(messages, tools, model.info.tool_calls)
    return model.render(conversation, tools=template_tools, add_generation_prompt=add_generation_prompt)


def check_vocabulary(model: Model, tokens: Sequence[int], field: str) -> None:
    vocab = model.info.vocab_size
    if not vocab:  # the backend cannot tell (an engine checks the ids itself)
        return
    for i, token in enumerate(tokens):
        if token >= vocab:
            raise RpcError(
                ErrorKind.INVALID_PARAMS,
                f"Token id {token} at {field}[{i}] is outside the vocabulary (0 to {vocab - 1}); "
                "send ids that this model's tokenize returned.",
                field=f"{field}[{i}]",
            )


class CacheReport(msgspec.Struct, frozen=True):
    """What a generate's result says of its cache."""

    use: CacheUse  # the result's ``cache``
    written_tokens: int  # its ``usage.cache_write_tokens``


class CacheLifecycle(Protocol):
    """The KV cache one generate runs on, from start to result (worker/caching.py makes it):
    the prompt's first ``reused`` tokens come from it, the decoding runs on it, and once the
    generation ends it stores what the request asks and says what the result reports."""

    reused: int

    def start(self, params: GenerateParams, constraint: OutputConstraint | None) -> Decoding:
        """The decoding of the prompt, on this cache."""
        ...

    def finish(self, generated: Sequence[int]) -> CacheReport:
        """After the last token (``generated``: the tokens chosen): store, and report."""
        ...


def prompt_tokens(model: Model, params: GenerateParams) -> list[int]:
    """The prompt's tokens, checked to leave room for max_tokens in the model's context."""
    source = PromptSource(params.prompt, params.tokens, params.messages)
    prompt = resolve_prompt(
        model, source, add_special_tokens=params.add_special_tokens, tools=request_tools(params)
    )
    check_context(model, len(prompt), params.max_tokens)
    return prompt


def prefill_prompt(model: Model, params: PrefillParams) -> list[int]:
    """A prefill's prompt tokens, checked to fit the model's context."""
    source = PromptSource(params.prompt, params.tokens, params.messages)
    tokens = resolve_prompt(
        model, source, add_special_tokens=params.add_special_tokens, tools=params.tools or [],
        add_generation_prompt=params.add_generation_prompt,
    )
    check_context(model, len(tokens), 0)
    return tokens


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


def check_engine_request(model: Model, params: GenerateParams) -> None:
    """What a request to an engine may not ask (the engine resolves the prompt and keeps its
    own cache; the rest of the checks are the engine's)."""
    check_source(PromptSource(params.prompt, params.tokens, params.messages))
    request_tools(params)
    check_draft(model, params)
    if params.cache not in (None, "auto") or params.cache_trim_tokens is not None:
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
    if params.prompt == "" or params.tokens == []:
        check_context(model, 0, params.max_tokens)  # the engine has no tokens to start from either
    elif params.tokens is not None and model.info.context_length:
        check_context(model, len(params.tokens), params.max_tokens)
    elif 0 < model.info.context_length <= params.max_tokens:
        raise RpcError(
            ErrorKind.CONTEXT_OVERFLOW,
            f"max_tokens is {params.max_tokens}, which leaves no room for a prompt in the model's context of "
            f"{model.info.context_length} tokens; lower max_tokens.",
            field="params.max_tokens",
            limit=model.info.context_length,
        )


def check_draft(model: Model, params: GenerateParams) -> None:
    draft = params.draft
    if draft is None:
        return
    if isinstance(model, DraftingModel):
        refused = model.drafting()
    else:
        refused = f"The {model.info.backend} backend does not draft tokens; leave out 'draft'."
    if refused is not None:
        raise RpcError(ErrorKind.UNSUPPORTED, refused, field="params.draft")
    if draft.ngram_min > draft.ngram_max:
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            f"draft.ngram_min ({draft.ngram_min}) is more than draft.ngram_max ({draft.ngram_max}); "
            "the lookup tries tails from ngram_max tokens down to ngram_min.",
            field="params.draft.ngram_min",
        )


class Generation:
    """One generate request on its way: the scheduler feeds its prompt and steps it; each token
    goes through the stream (text deltas, stop strings) and the limits, until something stops it."""

    def __init__(
        self,
        model: Model,
        params: GenerateParams,
        prompt: list[int],
        *,
        request_id: int | str,
        is_cancelled: Callable[[], bool],
        send_chunk: SendChunk,
        queued_ms: float,
        acked: Callable[[], int] = lambda: -1,
        cache: CacheLifecycle | None = None,
        started: float | None = None,
        constraint: OutputConstraint | None = None,
        streamed: StreamedDecoding | None = None,
    ) -> None:
        """``streamed``: the request as an engine runs it (an EngineModel's submit); then
        ``prompt`` is empty, and the engine's counts arrive with its stream."""
        self.model = model
        self._params = params
        self._is_cancelled = is_cancelled
        self._queued_ms = queued_ms
        self._cache = cache
        self._started = started or time.perf_counter()
        detokenizer = None if streamed is not None else IncrementalDetokenizer(model.detokenize, prompt)
        # A constrained output is the answer the grammar asked for, never thinking: after a prompt
        # that opens the thinking too, and a marker inside it (a JSON string's "<think>") is text.
        answer_only = streamed is not None or constraint is not None
        self._stream = _Stream(
            model, params, request_id, len(prompt), cache.reused if cache else 0, send_chunk, acked, detokenizer,
            None if answer_only else splitter_for(model, prompt),
        )
        self._first_token_at: float | None = None
        self._stop: StopReason | None = None
        self._streamed = streamed
        if streamed is not None:
            self.decoding: Decoding = streamed
        elif cache is not None:
            self.decoding = cache.start(params, constraint)
        else:
            self.decoding = model.start(prompt, params, constraint=constraint)
        # With a draft, the decoding is a DraftingDecoding (check_draft refused any other model).
        drafting = self.decoding if params.draft is not None else None
        self._drafting = drafting if isinstance(drafting, DraftingDecoding) else None

    def feed(self, max_tokens: int) -> None:
        """A chunk of the prompt; the first token once the prompt is in."""
        self.decoding.feed(max_tokens)
        self.chunk_taken()

    def chunk_taken(self) -> None:
        """After a chunk of the prompt (fed here or in a step): the first token once it is in."""
        if not self.decoding.prompt_left:
            self.advance()

    def advance(self) -> None:
        """Take the tokens the last step (or the prompt's last chunk) made possible: one, or
        more where it checked a draft; a request cancelled meanwhile takes none."""
        if self._streamed is not None:
            try:
                self._take_deltas(self._streamed)
            except BaseException:
                self.close()  # the request fails here: the engine must not go on computing it
                raise
            return
        while not self.done:
            token = self.decoding.next_token()
            self._first_token_at = self._first_token_at or time.perf_counter()
            self._stop = self._stream.push(token)
            if self._stop is None and len(self._stream.tokens) >= self._params.max_tokens:
                self._stop = _reason("max_tokens")
            if self._drafting is None or not self._drafting.has_next():
                return

    def _take_deltas(self, decoding: StreamedDecoding) -> None:
        """Everything an engine's stream has received since the last step: any number of deltas,
        none included; then how the stream ended, once it has."""
        counted_before = self._stream.prompt_tokens
        self._stream.counts(decoding.prompt_tokens, decoding.cached_tokens or 0)
        if decoding.prompt_tokens and not counted_before and self.model.info.context_length:
            # The engine would cut max_tokens short in silence; a local model refuses: so does this.
            check_context(self.model, decoding.prompt_tokens, self._params.max_tokens)
        while not self.done and decoding.has_next():
            self._first_token_at = self._first_token_at or time.perf_counter()
            self._stop = self._stream.push_delta(decoding.next_delta())
            if self._stop is None and self._stream.generated >= self._params.max_tokens:
                self._stop = _reason("max_tokens")
        end = decoding.end
        if self.done or end is None or decoding.has_next():
            return
        if end.error is not None:
            raise end.error
        self._stop = _engine_stop(end, self._stream.tokens)

    @property
    def done(self) -> bool:
        if self._stop is None and self._is_cancelled():
            self._stop = _reason("cancelled")
        return self._stop is not None

    def _engine_cache_use(self) -> CacheUse | None:
        """What ``cache: "auto"`` did on an engine: its prefix cache's reuse; nothing is stored by
        the worker (the engine keeps what it computed as long as its memory allows)."""
        if self._streamed is None or self._params.cache != "auto":
            return None
        reused = self._stream.cache_read_tokens
        return CacheUse(
            mode="auto", ref=None, reused_tokens=reused,
            reason=None if reused else "the server's prefix cache held none of this prompt",
            skipped=[], stored=None, stored_tokens=0,
            store_reason="the server keeps its own prefix cache; the worker stores nothing on this backend",
        )

    def close(self) -> None:
        """Let go of the engine's request, if any (it stops computing): after the end, a
        cancel or a failure."""
        if self._streamed is not None:
            self._streamed.close()

    def finish(self) -> GenerateResult:
        assert self.done  # which sets _stop for a cancel
        stop = self._stop
        assert stop is not None
        self.close()
        if self._streamed is not None:  # the counts as the engine's last events gave them
            self._stream.counts(self._streamed.prompt_tokens, self._streamed.cached_tokens or 0)
        self._stream.finish()
        finished = time.perf_counter()
        first = self._first_token_at or finished
        decode_s = finished - first
        tokens = self._stream.tokens
        report = self._cache.finish(tokens) if self._cache is not None else None
        calls = self._stream.tool_calls
        made_calls = any(call.error is None for call in calls) and stop.kind in ("eos", "stop_string")
        return GenerateResult(
            text=self._stream.text,
            tokens=tokens,
            content=self._stream.content,
            reasoning=self._stream.reasoning,
            tool_calls=calls,
            finish_reason="tool_calls" if made_calls else _FINISH_REASONS[stop.kind],
            stop_reason=stop,
            usage=Usage(
                prompt_tokens=self._stream.prompt_tokens,
                completion_tokens=self._stream.generated,
                cache_read_tokens=self._stream.cache_read_tokens,
                cache_write_tokens=report.written_tokens if report else 0,
                reasoning_tokens=self._stream.reasoning_tokens,
            ),
            cache=report.use if report else self._engine_cache_use(),
            timings=Timings(
                queued_ms=self._queued_ms,
                prompt_ms=(first - self._started) * 1000.0,
                decode_ms=decode_s * 1000.0,
                total_ms=(finished - self._started) * 1000.0,
                tokens_per_second=(self._stream.generated - 1) / decode_s if decode_s > 0 and self._stream.generated > 1 else 0.0,
                draft_tokens=self._drafting.drafted_tokens if self._drafting else 0,
                draft_accepted_tokens=self._drafting.accepted_tokens if self._drafting else 0,
            ),
        )


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
        if params.cache != "auto" or params.base is not None or params.trim_to_tokens is not None:
            field = "params.cache" if params.cache != "auto" else "params.base" if params.base else "params.trim_to_tokens"
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
        decoding = model.submit(one, add_generation_prompt=params.add_generation_prompt)
        generation = Generation(
            model, one, [], request_id=request_id, is_cancelled=is_cancelled, send_chunk=lambda chunk: None,
            queued_ms=0.0, started=started, streamed=decoding,
        )
        return cls(generation, started)

    def feed(self, max_tokens: int) -> None:
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
            cache="auto", token_count=usage.prompt_tokens, cache_read_tokens=usage.cache_read_tokens,
            cache_write_tokens=usage.prompt_tokens - usage.cache_read_tokens, bytes=0,
            time_ms=(time.perf_counter() - self._started) * 1000.0,
        )


def cancelled_before_start(queued_ms: float) -> GenerateResult:
    """The answer of a generate cancelled while it waited in the queue."""
    return GenerateResult(
        text="",
        tokens=[],
        content="",
        reasoning="",
        tool_calls=[],
        finish_reason="cancelled",
        stop_reason=_reason("cancelled"),
        usage=Usage(prompt_tokens=0, completion_tokens=0, cache_read_tokens=0, cache_write_tokens=0, reasoning_tokens=0),
        timings=Timings(
            queued_ms=queued_ms, prompt_ms=0.0, decode_ms=0.0, total_ms=0.0, tokens_per_second=0.0,
            draft_tokens=0, draft_accepted_tokens=0,
        ),
        cache=None,
    )


def _reason(kind: StopKind, *, token: int | None = None, stop: str | None = None) -> StopReason:
    return StopReason(kind=kind, token=token, stop=stop)


def _engine_stop(end: StreamEnd, tokens: list[int]) -> StopReason:
    """How an engine's own end reads in the worker's terms: its length limit (or context) as
    max_tokens, its stop string as one, anything else (end of sequence, tool calls) as eos."""
    if end.reason == "length":
        return _reason("max_tokens")
    if end.stop is not None:
        return _reason("stop_string", stop=end.stop)
    return _reason("eos", token=tokens[-1] if tokens else None)


StopKind = Literal["eos", "stop_string", "max_tokens", "cancelled"]
_FINISH_REASONS: dict[StopKind, Literal["stop", "length", "cancelled"]] = {
    "eos": "stop", "stop_string": "stop", "max_tokens": "length", "cancelled": "cancelled",
}


class _Stream:
    """Token ids in; stable text deltas out as chunks; the final text is their concatenation.

    With a ``stream_window``, at most that many chunks are out past the last one the host
    acknowledged; the text of later tokens waits unsent, merged into one chunk, until an ack
    makes room (the stream's reader is slow) or the generation ends. The generation itself
    never waits for a slow reader, and neither do the requests decoding beside it."""

    def __init__(
        self,
        model: Model,
        params: GenerateParams,
        request_id: int | str,
        prompt_tokens: int,
        cache_read_tokens: int,
        send_chunk: SendChunk,
        acked: Callable[[], int],
        detokenizer: IncrementalDetokenizer | None,
        reasoning: ReasoningSplitter | None = None,
    ) -> None:
        """``detokenizer`` None: the text comes with the tokens (an engine's deltas, push_delta).
        ``reasoning`` None: no text is thinking (worker/reasoning.py)."""
        self._eos = model.eos_token_ids
        self._detok = detokenizer
        self._stops = StopMatcher(params.stop)
        self._send = send_chunk if params.stream else None
        self._request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.cache_read_tokens = cache_read_tokens
        self._pieces: list[str] = []
        self._contents: list[str] = []
        self._reasoning = reasoning
        self._reasonings: list[str] = []
        self.reasoning_tokens = 0
        self._calls = call_reader(params, model.info.tool_calls)
        self._stopped = False
        self._window = params.stream_window
        self._acked = acked
        self._sent = 0  # chunks sent
        self._unsent: _Unsent | None = None
        self.tokens: list[int] = []
        self.generated = 0  # tokens generated: len(tokens), unless an engine gave no ids
        self._made_calls: list[ToolCall] = []

    def counts(self, prompt_tokens: int, cache_read_tokens: int) -> None:
        """The prompt's counts as an engine reported them (known only once its stream starts)."""
        self.prompt_tokens, self.cache_read_tokens = prompt_tokens, cache_read_tokens

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    @property
    def content(self) -> str:
        return "".join(self._contents)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasonings)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._made_calls

    def push(self, token: int) -> StopReason | None:
        assert self._detok is not None
        self.tokens.append(token)
        self.generated += 1
        if token in self._eos:
            self._emit("", [token])
            return _reason("eos", token=token)
        text, stop = self._stops.push(self._detok.push(token))
        self._emit(text, [token])
        if stop is not None:
            self._stopped = True
            return _reason("stop_string", stop=stop)
        return None

    def push_delta(self, delta: EngineDelta) -> StopReason | None:
        """An engine's delta: its text (stop strings matched here, as for local models), its
        token ids, and the calls its parser completed."""
        self.tokens += delta.tokens
        self.generated += delta.counted
        text, stop = self._stops.push(delta.text)
        self._emit(text, delta.tokens, text, delta.calls)
        if stop is not None:
            self._stopped = True
            return _reason("stop_string", stop=stop)
        return None

    def finish(self) -> None:
        """Emit what was held back (unless a stop string ended the text), and what a slow
        reader's window left unsent: the stream is whole before the result."""
        if not self._stopped:
            text, stop = self._stops.push(self._detok.flush() if self._detok else "")
            tail = text + ("" if stop is not None else self._stops.flush())
            if tail or (self._reasoning is not None and self._reasoning.holding):
                self._emit(tail, [], final=True)
        if self._calls is not None:
            content, calls = self._calls.finish()
            if content or calls:
                self._emit("", [], content, calls)
        self._send_unsent(force=True)

    def _emit(
        self, text: str, tokens: list[int], content: str | None = None, calls: Sequence[ToolCall] = (),
        *, final: bool = False,
    ) -> None:
        """``text`` goes through the reasoning splitter and the tool-call reader, when there are
        ones, for ``reasoning``, ``content`` and ``calls`` (``final``: the splitter's last text)."""
        self._pieces.append(text)
        reasoning = ""
        if content is None:
            answer, reasoning = self._split(text, tokens, final=final)
            content, calls = self._calls.feed(answer) if self._calls else (answer, ())
        self._contents.append(content)
        self._reasonings.append(reasoning)
        self._made_calls += calls
        if self._send is None:
            return
        unsent = self._unsent or _Unsent()
        unsent.texts.append(text)
        unsent.tokens += tokens
        unsent.contents.append(content)
        unsent.reasonings.append(reasoning)
        unsent.calls += calls
        self._unsent = unsent
        self._send_unsent(force=False)

    def _split(self, text: str, tokens: list[int], *, final: bool) -> tuple[str, str]:
        """The answer and the thinking in ``text``; ``tokens`` count as thinking when any of
        their text is."""
        if self._reasoning is None:
            return text, ""
        split = self._reasoning.push(text)
        answer, reasoning = split.content, split.reasoning
        if final:
            rest = self._reasoning.flush()
            answer, reasoning = answer + rest.content, reasoning + rest.reasoning
        if split.thinking:
            self.reasoning_tokens += len(tokens)
        return answer, reasoning

    def _send_unsent(self, *, force: bool) -> None:
        if self._unsent is None or self._send is None:
            return
        if not force and self._window is not None and self._sent - (self._acked() + 1) >= self._window:
            return
        unsent, self._unsent = self._unsent, None
        self._send(
            GenerateChunk(
                id=self._request_id,
                index=self._sent,
                text="".join(unsent.texts),
                tokens=unsent.tokens,
                generated_tokens=self.generated,
                prompt_tokens=self.prompt_tokens,
                cache_read_tokens=self.cache_read_tokens,
                content="".join(unsent.contents),
                reasoning="".join(unsent.reasonings),
                tool_calls=unsent.calls,
            )
        )
        self._sent += 1


class _Unsent(msgspec.Struct):
    """What the stream has not sent yet: merged into one chunk when it goes."""

    texts: list[str] = []
    tokens: list[int] = []
    contents: list[str] = []
    reasonings: list[str] = []
    calls: list[ToolCall] = []
