"""The generate request, backend-independent: prompt, limits, streaming, counts, timings.

A generation takes its tokens from a :class:`TokenSource`: a local model's steps
(:class:`LocalSteps`), or an engine's stream (worker/backends/openai/generation.py). One loop
(:meth:`Generation.advance`) takes what the source made since the last step, and every limit
(the context, max_tokens, stop strings, a cancel) is applied there, the same way to both.
"""

from __future__ import annotations

import time
from typing import Final, Literal, Protocol

import msgspec
from collections.abc import Callable, Iterator, Sequence

from protocol.errors import ErrorKind, RpcError
from protocol.methods import (
    CacheUse,
    ChatMessage,
    GenerateChunk,
    GenerateParams,
    GenerateResult,
    PrefillParams,
    StopReason,
    Timings,
    Tool,
    ToolCall,
    Usage,
)
from worker.backends.base import Decoding, DraftingDecoding, DraftingModel, Model, Piece
from worker.grammar import OutputConstraint
from worker.reasoning import ReasoningSplitter, splitter_for
from worker.streaming import IncrementalDetokenizer, StopMatcher
from worker.tool_calls import call_reader, for_template, request_tools

SendChunk = Callable[[GenerateChunk], None]

# The cache ref that leaves the choice to the worker (caching.py) or an engine: reuse the longest
# stored prefix, store the sequence computed.
AUTO: Final = "auto"


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


def check_context(model: Model, prompt_length: int | None, max_tokens: int) -> None:
    """A prompt has tokens, and leaves room for max_tokens in the model's context: where its
    length is known (``prompt_length`` None: an engine has not counted it yet, so max_tokens must
    leave room for one token), and the model's context is (0: the backend cannot tell)."""
    if prompt_length == 0:
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            "The prompt is empty (no tokens to start from); give some text or tokens.",
            field="params.prompt",
        )
    context = model.info.context_length
    if not context:
        return
    if prompt_length is None:
        if max_tokens >= context:
            raise RpcError(
                ErrorKind.CONTEXT_OVERFLOW,
                f"max_tokens is {max_tokens}, which leaves no room for a prompt in the model's context of "
                f"{context} tokens; lower max_tokens.",
                field="params.max_tokens",
                limit=context,
            )
        return
    if prompt_length + max_tokens > context:
        raise RpcError(
            ErrorKind.CONTEXT_OVERFLOW,
            f"The prompt has {prompt_length} tokens and max_tokens is {max_tokens}, together more than "
            f"the model's context of {context} tokens; shorten the prompt or lower max_tokens.",
            field="params.max_tokens",
            limit=context,
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


class TokenSource(Protocol):
    """Where a generation's tokens come from: a local model's steps (LocalSteps) or an engine's
    stream (worker/backends/openai/generation.py's EngineStream)."""

    @property
    def decoding(self) -> Decoding:
        """What the scheduler feeds and steps."""
        ...

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens; 0 until counted (an engine counts them once its stream begins)."""
        ...

    @property
    def cached_tokens(self) -> int:
        """Of the prompt's tokens, those a cache supplied."""
        ...

    @property
    def reasoning(self) -> ReasoningSplitter | None:
        """What tells the thinking in the text apart from the answer; None: none of it is thinking."""
        ...

    @property
    def drafted_tokens(self) -> int: ...

    @property
    def accepted_tokens(self) -> int: ...

    def pieces(self) -> Iterator[Piece]:
        """What the last step (or the prompt's last chunk) made, each piece computed only when it
        is taken: a generation that stops takes no more."""
        ...

    def end(self, tokens: Sequence[int]) -> StopReason | None:
        """How the source itself ended the sequence (``tokens``: those taken), once every piece
        is taken; None while it goes on. Raises what broke it."""
        ...

    def flush(self) -> str:
        """The text held back at the end (the start of a character not yet whole)."""
        ...

    def close(self) -> None:
        """Stop the source's work (an engine's request); idempotent."""
        ...

    def report(self, tokens: Sequence[int]) -> CacheReport | None:
        """After the last token: what the result says of the cache (None: no cache was asked for)."""
        ...


class LocalSteps:
    """A local model's decoding as a token source: each step chooses one token, or more where it
    checked a draft; its text comes from the incremental detokenizer."""

    def __init__(
        self,
        model: Model,
        params: GenerateParams,
        prompt: Sequence[int],
        cache: CacheLifecycle | None = None,
        constraint: OutputConstraint | None = None,
    ) -> None:
        self._eos = model.eos_token_ids
        self._detokenizer = IncrementalDetokenizer(model.detokenize, prompt)
        # A constrained output is the answer the grammar asked for, never thinking: after a prompt
        # that opens the thinking too, and a marker inside it (a JSON string's "<think>") is text.
        self.reasoning = None if constraint is not None else splitter_for(model, prompt)
        self.prompt_tokens = len(prompt)
        self.cached_tokens = cache.reused if cache is not None else 0
        self._cache = cache
        if cache is not None:
            self.decoding = cache.start(params, constraint)
        else:
            self.decoding = model.start(prompt, params, constraint=constraint)
        # With a draft, the decoding is a DraftingDecoding (check_draft refused any other model).
        drafting = self.decoding if params.draft is not None else None
        self._drafting = drafting if isinstance(drafting, DraftingDecoding) else None

    @property
    def drafted_tokens(self) -> int:
        return self._drafting.drafted_tokens if self._drafting else 0

    @property
    def accepted_tokens(self) -> int:
        return self._drafting.accepted_tokens if self._drafting else 0

    def pieces(self) -> Iterator[Piece]:
        while True:
            token = self.decoding.next_token()
            eos = token in self._eos
            yield Piece(tokens=[token], text="" if eos else self._detokenizer.push(token), eos=eos)
            if self._drafting is None or not self._drafting.has_next():
                return

    def end(self, tokens: Sequence[int]) -> StopReason | None:
        return None  # a local model's sequence ends with one of its tokens (Piece.eos)

    def flush(self) -> str:
        return self._detokenizer.flush()

    def close(self) -> None:
        pass  # nothing runs outside the model lane's steps

    def report(self, tokens: Sequence[int]) -> CacheReport | None:
        return self._cache.finish(tokens) if self._cache is not None else None


class Generation:
    """One generate request on its way: the scheduler feeds its prompt and steps it; what each
    step made goes through the stream (text deltas, stop strings) and the limits, until
    something stops it."""

    def __init__(
        self,
        model: Model,
        params: GenerateParams,
        source: TokenSource,
        *,
        request_id: int | str,
        is_cancelled: Callable[[], bool],
        send_chunk: SendChunk,
        queued_ms: float,
        acked: Callable[[], int] = lambda: -1,
        started: float | None = None,
    ) -> None:
        self.model = model
        self.decoding = source.decoding
        self._params = params
        self._source = source
        self._is_cancelled = is_cancelled
        self._queued_ms = queued_ms
        self._started = started or time.perf_counter()
        self._stream = _Stream(
            model, params, request_id, source.prompt_tokens, source.cached_tokens, send_chunk, acked, source.reasoning
        )
        self._first_token_at: float | None = None
        self._stop: StopReason | None = None

    def feed(self, chunk_tokens: int) -> None:
        """A chunk of the prompt; the first token once the prompt is in."""
        self.decoding.feed(chunk_tokens)
        self.chunk_taken()

    def chunk_taken(self) -> None:
        """After a chunk of the prompt (fed here or in a step): the first token once it is in."""
        if not self.decoding.prompt_left:
            self.advance()

    def advance(self) -> None:
        """Take what the last step (or the prompt's last chunk) made, until something stops the
        generation; a request cancelled meanwhile takes nothing."""
        try:
            self._count_prompt()
            pieces = self._source.pieces()
            while not self.done and (piece := next(pieces, None)) is not None:
                self._first_token_at = self._first_token_at or time.perf_counter()
                self._stop = self._stream.push(piece)
                if self._stop is None and self._stream.generated >= self._params.max_tokens:
                    self._stop = stop_reason("max_tokens")
            if not self.done:
                self._stop = self._source.end(self._stream.tokens)
        except BaseException:
            self.close()  # the request fails here: an engine must not go on computing it
            raise

    def _count_prompt(self) -> None:
        """The prompt's counts as the source has them. A prompt counted only once the source runs
        (an engine's) is checked against the context then, as a local one was before it started."""
        counted_before = self._stream.prompt_tokens
        self._stream.counts(self._source.prompt_tokens, self._source.cached_tokens)
        if self._source.prompt_tokens and not counted_before:
            check_context(self.model, self._source.prompt_tokens, self._params.max_tokens)

    @property
    def done(self) -> bool:
        if self._stop is None and self._is_cancelled():
            self._stop = stop_reason("cancelled")
        return self._stop is not None

    def close(self) -> None:
        """Let go of the source's work: after the end, a cancel or a failure."""
        self._source.close()

    def finish(self) -> GenerateResult:
        assert self.done  # which sets _stop for a cancel
        stop = self._stop
        assert stop is not None
        self.close()
        self._stream.counts(self._source.prompt_tokens, self._source.cached_tokens)  # as an engine's last events gave them
        self._stream.finish(self._source.flush())
        finished = time.perf_counter()
        first = self._first_token_at or finished
        decode_s = finished - first
        tokens = self._stream.tokens
        report = self._source.report(tokens)
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
            cache=report.use if report else None,
            timings=Timings(
                queued_ms=self._queued_ms,
                prompt_ms=(first - self._started) * 1000.0,
                decode_ms=decode_s * 1000.0,
                total_ms=(finished - self._started) * 1000.0,
                tokens_per_second=(self._stream.generated - 1) / decode_s if decode_s > 0 and self._stream.generated > 1 else 0.0,
                draft_tokens=self._source.drafted_tokens,
                draft_accepted_tokens=self._source.accepted_tokens,
            ),
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
        stop_reason=stop_reason("cancelled"),
        usage=Usage(prompt_tokens=0, completion_tokens=0, cache_read_tokens=0, cache_write_tokens=0, reasoning_tokens=0),
        timings=Timings(
            queued_ms=queued_ms, prompt_ms=0.0, decode_ms=0.0, total_ms=0.0, tokens_per_second=0.0,
            draft_tokens=0, draft_accepted_tokens=0,
        ),
        cache=None,
    )


def stop_reason(kind: StopKind, *, token: int | None = None, stop: str | None = None) -> StopReason:
    return StopReason(kind=kind, token=token, stop=stop)


StopKind = Literal["eos", "stop_string", "max_tokens", "cancelled"]
_FINISH_REASONS: dict[StopKind, Literal["stop", "length", "cancelled"]] = {
    "eos": "stop", "stop_string": "stop", "max_tokens": "length", "cancelled": "cancelled",
}


class _Stream:
    """Pieces in (token ids and their text); stable text deltas out as chunks; the final text is
    their concatenation.

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
        reasoning: ReasoningSplitter | None,
    ) -> None:
        """``reasoning`` None: no text is thinking (worker/reasoning.py)."""
        self._stops = StopMatcher(params.stop)
        self._send = send_chunk if params.stream else None
        self._request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.cache_read_tokens = cache_read_tokens
        self._texts: list[str] = []
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
        """The prompt's counts as the source has them (an engine's, once its stream has said)."""
        self.prompt_tokens, self.cache_read_tokens = prompt_tokens, cache_read_tokens

    @property
    def text(self) -> str:
        return "".join(self._texts)

    @property
    def content(self) -> str:
        return "".join(self._contents)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasonings)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._made_calls

    def push(self, piece: Piece) -> StopReason | None:
        """A piece's text (stop strings matched here), its token ids, and the calls an engine's
        parser completed with it."""
        self.tokens += piece.tokens
        self.generated += piece.counted
        text, stop = self._stops.push(piece.text)
        self._emit(text, piece.tokens, calls=piece.calls)
        if piece.eos:
            return stop_reason("eos", token=piece.tokens[-1])
        if stop is not None:
            self._stopped = True
            return stop_reason("stop_string", stop=stop)
        return None

    def finish(self, held: str) -> None:
        """Emit what was held back (``held``: the source's text, then the stop matcher's), unless a
        stop string ended the text, and what a slow reader's window left unsent: the stream is
        whole before the result."""
        if not self._stopped:
            text, stop = self._stops.push(held)
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
        ones, for ``reasoning`` and ``content``; the calls the reader completes join ``calls``
        (``content`` given: the reader's last, read already; ``final``: the splitter's last text)."""
        self._texts.append(text)
        reasoning = ""
        if content is None:
            answer, reasoning = self._split(text, tokens, final=final)
            content, read = self._calls.feed(answer) if self._calls else (answer, [])
            calls = [*read, *calls]
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
