"""The ``openai`` backend: the same protocol on a model that another program serves over the
OpenAI-compatible HTTP API (vLLM first; SGLang, llama.cpp's server and the gateways in front of
vLLM replicas speak it too).

The engine owns the model, its batching and its KV memory; the worker keeps its protocol:
chunks with cumulative counts, stop strings, flow control, cancels, errors. Each ``generate``
is one streamed HTTP request, sent as soon as the request is made and read on a thread of its
own (``lm-worker-engine-stream``); the model lane only collects what each stream has received
(``Model.step`` waits until some stream has something, or the session wakes it for a new
request, a cancel or an ack), so requests run side by side on the engine, bounded by
``--max-batch``. A cancel closes the request's connection, which makes the engine drop it.
What the worker refuses before it sends a request, and the stream as a generation's token source,
are generation.py's, beside this module.

- ``prompt`` and ``tokens`` go to ``/v1/completions`` (token ids as the prompt where given),
  ``messages`` to ``/v1/chat/completions`` with the tools, so that the engine applies its own
  chat template and reads tool calls with its own parser.
- Token ids come back with vLLM's ``return_token_ids``, so counts are exact there; an engine
  that does not return them gets each streamed delta counted as one token (estimated), and the
  result's usage is the engine's own.
- ``cache: "auto"`` lets the engine's prefix cache work and reports what it reused
  (``usage.prompt_tokens_details.cached_tokens``); named and ``memory://`` refs are refused.
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import msgspec

from protocol.errors import ErrorKind, RpcError
from protocol.methods import (
    ChatMessage,
    GenerateParams,
    JsonObjectFormat,
    JsonSchemaFormat,
    LoadParams,
    ModelInfo,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolCallSupport,
)
from worker.backends.base import Piece, StreamEnd
from worker.backends.openai.engine import MAX_EVENT_BYTES, Engine, EngineAddress, EngineStatusError, EventStream
from worker.tool_calls import template_dict

if TYPE_CHECKING:
    from worker.grammar import GrammarTokenizer, OutputConstraint

T = TypeVar("T")

# A step waits until a stream receives something or the lane is woken (a new request, a cancel,
# an ack); at most this long, so that a wake that never comes costs a pause, not a hang. Rounds
# every few ms while the streams are quiet between the engine's steps took CPU that an engine on
# the same cores lost (bench/README.md).
STEP_WAIT_S = 0.05
CONNECT_TIMEOUT_S = 10.0
# A model /v1/models does not serve is refused naming at most this many of those it does (a
# server may list a million), each cut to NAME_CHARS, with their count.
NAMES_QUOTED = 5
NAME_CHARS = 100

# What the protocol can pass on of a server's answers (PROTOCOL 22): a token id or a count is
# an integer 0 ... 2^31-1 (a host's JSON numbers hold it exactly), a context length too.
EngineInt = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]


class OpenAIBackend:
    name = "openai"
    description = (
        "A model served by an OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, a gateway): "
        "base_url and the served model's name."
    )

    def unavailable_reason(self) -> str | None:
        return None  # the standard library is all it needs

    def check(self, params: LoadParams, *, data_dir: Path) -> None:
        if params.base_url is None:
            raise RpcError(
                ErrorKind.INVALID_PARAMS,
                "The openai backend needs base_url, the server's OpenAI API root "
                '(e.g. "base_url": "http://127.0.0.1:8000/v1").',
                field="params.base_url",
            )
        EngineAddress.parse(params.base_url)
        for field, value, default in (
            ("device", params.device, "cpu"),
            ("dtype", params.dtype, "auto"),
            ("quantization", params.quantization, "auto"),
            ("token_delay_ms", params.token_delay_ms, 0.0),
            ("trust_remote_code", params.trust_remote_code, False),
        ):
            if value != default:
                raise RpcError(
                    ErrorKind.INVALID_PARAMS,
                    f"{field} is decided by the server for the openai backend; leave it out of load.",
                    field=f"params.{field}",
                )
        _api_key(params)

    def load(self, params: LoadParams, *, data_dir: Path) -> OpenAIModel:
        self.check(params, data_dir=data_dir)
        started = time.perf_counter()
        assert params.base_url is not None
        engine = Engine(
            EngineAddress.parse(params.base_url),
            _api_key(params),
            connect_timeout_s=CONNECT_TIMEOUT_S,
            stall_timeout_s=params.stall_timeout_s,
        )
        listed = _served_models(engine)
        served = _choose(listed, params.model, engine)
        return OpenAIModel(params, engine, served, started)


class ServedModel(msgspec.Struct):
    """An entry of /v1/models (fields beyond the id are vLLM's and llama.cpp's)."""

    id: str
    max_model_len: EngineInt | None = None


class ModelList(msgspec.Struct):
    data: list[ServedModel]


def _served_models(engine: Engine) -> list[ServedModel]:
    try:
        return engine.get("/models", ModelList).data
    except EngineStatusError as exc:
        if exc.status != 404:
            raise
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            f"The server at {engine.address} has no models list there (404 on GET {engine.address.path}/models): "
            "is base_url the OpenAI API root (it usually ends in /v1)?",
            field="params.base_url",
        ) from None


def _choose(listed: list[ServedModel], wanted: str, engine: Engine) -> ServedModel:
    if wanted == "default" and len(listed) == 1:  # the one model the server serves
        return listed[0]
    for served in listed:
        if served.id == wanted:
            return served
    names = ", ".join(repr(engine.quote(m.id, NAME_CHARS)) for m in listed[:NAMES_QUOTED])
    if len(listed) > NAMES_QUOTED:
        names = f"{len(listed)} models, among them {names}, …"
    raise RpcError(
        ErrorKind.MODEL_NOT_SERVED,
        f"The server at {engine.address} does not serve {engine.quote(wanted, NAME_CHARS)!r}; it serves "
        f"{names or 'none'}. Load one of those "
        "(the name the server was started with, e.g. vLLM's --served-model-name).",
        field="params.model",
    )


def _api_key(params: LoadParams) -> str | None:
    if params.api_key_env is None:
        return None
    key = os.environ.get(params.api_key_env)
    if not key:
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            f"api_key_env names the environment variable {params.api_key_env!r}, which is not set in the "
            "worker's environment; set it before starting the worker, or leave api_key_env out.",
            field="params.api_key_env",
        )
    return key


class OpenAIModel:
    """A model on the server; every call goes over HTTP."""

    chunks_in_step = False
    grammar_tokenizer: GrammarTokenizer | None = None  # the engine constrains output itself (response_format is passed on)
    eos_token_ids: frozenset[int] = frozenset()  # the engine ends a stream at its end-of-sequence

    def __init__(self, params: LoadParams, engine: Engine, served: ServedModel, started: float) -> None:
        self._engine = engine
        self._name = served.id
        self._arrived = threading.Condition()  # notified whenever a stream receives something, and by wake
        self._woken = False
        self.info = ModelInfo(
            model=engine.quote.redact(served.id),  # the key never crosses the protocol, even as a name
            backend="openai",
            path=str(engine.address),
            vocab_size=0,  # not told by the API: the engine checks token ids
            context_length=served.max_model_len or 0,
            special_tokens=[],
            has_chat_template=True,
            device="engine",
            dtype="engine",
            quantization="engine",
            # The engine renders tools with its template and reads calls with its parser.
            tool_calls=ToolCallSupport(template_takes_tools=True, format=None, forced=True),
            load_time_ms=(time.perf_counter() - started) * 1000.0,
        )

    # --- text, through the engine's tokenizer endpoints ----------------------------------

    def tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]:
        body = {"model": self._name, "prompt": text, "add_special_tokens": add_special_tokens}
        return self._tokenizer_call("/tokenize", body, _Tokens).tokens

    def detokenize(self, tokens: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tokenizer_call("/detokenize", {"model": self._name, "tokens": list(tokens)}, _Text).prompt

    def render(
        self, messages: Sequence[ChatMessage], *, tools: Sequence[Tool], add_generation_prompt: bool
    ) -> tuple[str, list[int]]:
        body: dict[str, Any] = {
            "model": self._name,
            "messages": [template_dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        if tools:
            body["tools"] = [msgspec.to_builtins(t) for t in tools]
        tokens = self._tokenizer_call("/tokenize", body, _Tokens).tokens
        return self.detokenize(tokens), tokens

    def _tokenizer_call(self, path: str, body: dict[str, Any], answer: type[T]) -> T:
        try:
            return self._engine.post(path, body, answer, root=True)
        except EngineStatusError as exc:
            if exc.status == 404 and exc.kind is not ErrorKind.MODEL_NOT_SERVED:
                raise RpcError(
                    ErrorKind.UNSUPPORTED,
                    f"The server at {self._engine.address} has no {path} endpoint (vLLM has one); "
                    f"tokenize, detokenize and render need it. Send text or messages to generate instead.",
                ) from None
            raise

    # --- generation -------------------------------------------------------------------

    def submit(self, params: GenerateParams, *, add_generation_prompt: bool = True) -> EngineDecoding:
        path, body = self._request(params)
        if not add_generation_prompt and params.messages is not None:
            body["add_generation_prompt"] = False  # vLLM's chat endpoint
        return EngineDecoding(self._engine, path, body, self._arrived, params)

    def start(
        self, prompt: Sequence[int], params: GenerateParams | None, *, constraint: OutputConstraint | None = None
    ) -> EngineDecoding:
        raise AssertionError("an engine's requests are sent whole (submit)")

    def _request(self, params: GenerateParams) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self._name,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "return_token_ids": True,  # vLLM: the prompt's and each delta's token ids
        }
        # Sampling fields past OpenAI's own only where set, for engines that refuse unknown ones.
        for field, default in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0)):
            if (value := getattr(params, field)) != default:
                body[field] = value
        if params.seed is not None:
            body["seed"] = params.seed
        if isinstance(params.response_format, JsonObjectFormat):
            body["response_format"] = {"type": "json_object"}
        elif isinstance(params.response_format, JsonSchemaFormat):
            spec = params.response_format.json_schema
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": spec.name, "schema": spec.schema, "strict": True},
            }
        if params.messages is not None:
            body["messages"] = [template_dict(m) for m in params.messages]
            if params.tools:
                # strict: a forced call's arguments follow the tool's schema, as on the local backend
                body["tools"] = [_strict(msgspec.to_builtins(t)) for t in params.tools]
                choice = params.tool_choice
                body["tool_choice"] = msgspec.to_builtins(choice) if isinstance(choice, NamedToolChoice) else choice
                body["parallel_tool_calls"] = params.parallel_tool_calls
            return "/chat/completions", body
        body["prompt"] = list(params.tokens) if params.tokens is not None else params.prompt
        if params.prompt is not None:
            body["add_special_tokens"] = params.add_special_tokens
        return "/completions", body

    def step(self, decodings: Sequence[Any], chunks: Sequence[Any] = ()) -> None:
        """Wait until some stream has received something or the lane is woken."""
        with self._arrived:
            self._arrived.wait_for(
                lambda: self._woken or any(d.has_next() or d.end is not None for d in decodings), STEP_WAIT_S
            )
            self._woken = False

    def wake(self) -> None:
        with self._arrived:
            self._woken = True
            self._arrived.notify_all()

    def close(self) -> None:
        pass  # each request's connection closes with it


class _Tokens(msgspec.Struct):
    """vLLM's /tokenize answer (its other fields unused)."""

    tokens: list[EngineInt]


class _Text(msgspec.Struct):
    """vLLM's /detokenize answer."""

    prompt: str


class _PromptDetails(msgspec.Struct):
    cached_tokens: EngineInt | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: EngineInt = 0
    completion_tokens: EngineInt = 0
    prompt_tokens_details: _PromptDetails | None = None


class _FunctionDelta(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolCallDelta(msgspec.Struct):
    index: EngineInt = 0
    id: str | None = None
    function: _FunctionDelta | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ToolCallDelta] | None = None


class _Choice(msgspec.Struct):
    index: EngineInt = 0
    text: str | None = None  # /completions
    delta: _Delta | None = None  # /chat/completions
    token_ids: list[EngineInt] | None = None
    prompt_token_ids: list[EngineInt] | None = None  # /completions: in the first event's choice
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _ServerError(msgspec.Struct):
    message: str = ""
    code: int | str | None = None


class _Event(msgspec.Struct):
    """One event of a streamed completion (both endpoints' shapes; vLLM's extra fields)."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    prompt_token_ids: list[EngineInt] | None = None  # /chat/completions: in the first event
    error: _ServerError | str | None = None  # a request the server refused after its stream began


def _naming_the_field(refused: EngineStatusError, params: GenerateParams) -> RpcError:
    """The server's refusal, naming the request's field where the server named its own
    parameter (vLLM does: ``"param": "temperature"``)."""
    param = refused.param
    if param in ("prompt", "input_tokens", "messages"):
        field = "params." + next(n for n in ("tokens", "messages", "prompt") if getattr(params, n) is not None)
    elif param is not None and param in GenerateParams.__struct_fields__:
        field = f"params.{param}"
    else:
        return refused
    return RpcError(refused.kind, refused.message, field=field, limit=refused.data.limit)


# The finish reasons an engine's stream may end with: its end of sequence or stop string, its
# length limit, a tool call. Any other (vLLM's "abort", an API's "content_filter", a word of a
# server's own) is an engine error, not reported as an end of sequence that did not happen.
FINISH_REASONS = frozenset({"stop", "length", "tool_calls"})
# The tool calls a stream is building, their names and arguments together, hold at most this
# many characters: fragments of arguments count for no token, so nothing else bounded them.
MAX_CALL_BYTES = MAX_EVENT_BYTES


class _CallParts(msgspec.Struct):
    id: str | None = None
    name: str = ""
    arguments: str = ""


class EngineDecoding:
    """One streamed request: a thread reads its events into a queue of deltas that the model
    lane takes (``Model.step`` waits for them). The worker never feeds a prompt: ``prompt_left``
    is 0 from the start, and the engine's counts arrive with the stream."""

    prompt_left = 0

    def __init__(
        self, engine: Engine, path: str, body: dict[str, Any], arrived: threading.Condition, params: GenerateParams
    ) -> None:
        self._arrived = arrived
        self._engine = engine
        self._deltas: collections.deque[Piece] = collections.deque()
        self._tools = {tool.function.name for tool in params.tools or []}
        self._stops = set(params.stop)
        self._response_format = params.response_format is not None
        self._calls: dict[int, _CallParts] = {}
        self._call_bytes = 0
        self._token_ids = 0  # the engine's token ids so far, which max_tokens bounds
        self.prompt_tokens = 0
        self.cached_tokens: int | None = None  # None until the engine has reported it
        self.exact = True  # token ids came with every delta so far
        self.end: StreamEnd | None = None
        self._last: Piece | None = None
        self._finish: StreamEnd | None = None
        self._stream: EventStream[_Event] | None = None
        self._closed = False
        # Opened on the stream's own thread, not the caller's (the cache I/O thread, which makes
        # every request's task): a server slow to answer one request's headers held up the start
        # of every request after it, up to stall_timeout_s.
        self._open = lambda: engine.stream(path, body, _Event)
        self._params = params
        threading.Thread(target=self._read, name="lm-worker-engine-stream", daemon=True).start()

    def feed(self, chunk_tokens: int) -> None:
        raise AssertionError("the engine computes the prompt: nothing to feed")

    def has_next(self) -> bool:
        return bool(self._deltas)

    def next_piece(self) -> Piece:
        return self._deltas.popleft()

    def next_token(self) -> int:
        raise AssertionError("an engine's stream is taken by piece (next_piece)")

    def close(self) -> None:
        """Stop the request (a cancel, a stop string, the end): the engine sees the connection close."""
        self._closed = True
        if self._stream is not None:
            self._stream.close()

    def _read(self) -> None:
        try:
            try:
                self._stream = stream = self._open()
            except EngineStatusError as exc:
                raise _naming_the_field(exc, self._params) from None
            if self._closed:  # closed while it opened: close() found no stream to close
                stream.close()
            for event in stream:
                self._take(event)
            if self._last is not None:  # the delta that ended the text, now with the final counts
                self._push(self._last)
            if not self._closed:
                if self._finish is None:  # not an end of sequence the server never reported
                    raise self._engine.error("ended the stream ([DONE]) with no choice finished (no finish_reason)")
                self._ended(self._finish)
        except BaseException as exc:  # any: a thread that ends without an end leaves its request waiting for ever
            self._ended(StreamEnd(reason="error", error=exc))

    def _take(self, event: _Event) -> None:
        if event.error is not None:
            said = event.error if isinstance(event.error, str) else event.error.message
            # vLLM compiles the schema only once the stream has begun, and says so in these words
            grammar = self._response_format and "grammar" in said.lower()
            raise RpcError(
                ErrorKind.INVALID_PARAMS,
                f"The server refused the request after its stream began: {self._engine.quote(said)}",
                field="params.response_format" if grammar else None,
            )
        if event.prompt_token_ids is not None:
            self.prompt_tokens = len(event.prompt_token_ids)
        if event.usage is not None:
            self.prompt_tokens = event.usage.prompt_tokens or self.prompt_tokens
            details = event.usage.prompt_tokens_details
            cached = details.cached_tokens if details is not None else None
            if cached is not None and cached > self.prompt_tokens:
                raise self._engine.error(
                    f"reported {cached} cached tokens (usage.prompt_tokens_details.cached_tokens) of a prompt of "
                    f"{self.prompt_tokens}"
                )
            self.cached_tokens = cached if cached is not None else self.cached_tokens
        for choice in event.choices:
            self._choice(choice)

    def _choice(self, choice: _Choice) -> None:
        if choice.index != 0:  # one choice is asked for (n is 1)
            raise self._engine.error(f"sent a choice of index {choice.index} (choices[].index) where one choice, 0, was asked for")
        if choice.finish_reason is not None and choice.finish_reason not in FINISH_REASONS:
            raise self._engine.error(
                f"ended the stream with finish_reason {self._engine.quote(choice.finish_reason[:64])!r}, which is "
                f"none of {', '.join(sorted(FINISH_REASONS))}"
            )
        if choice.token_ids:
            self._token_ids += len(choice.token_ids)
            if self._token_ids > self._params.max_tokens:
                raise self._engine.error(
                    f"sent {self._token_ids} token ids (choices[].token_ids) where max_tokens is {self._params.max_tokens}"
                )
        if choice.prompt_token_ids is not None:
            self.prompt_tokens = len(choice.prompt_token_ids)
        text = choice.text if choice.text is not None else (choice.delta.content if choice.delta else None) or ""
        tokens = choice.token_ids
        calls = self._tool_call_parts(choice.delta.tool_calls if choice.delta else None)
        if choice.finish_reason is not None:
            calls += self._whole_calls()
        delta = None
        if text or tokens or calls:
            if tokens is None:
                self.exact = False
            counted = len(tokens) if tokens is not None else 1
            delta = Piece(tokens=tokens or [], text=text, calls=calls, counted=counted)
        if choice.finish_reason is None:
            if delta is not None:
                self._push(delta)
            return
        # The last delta waits for the usage that follows it (cached tokens come only there), so
        # that its chunk carries the final counts.
        self._last = delta
        # A stop string is one of the request's (the worker sends none: the server's own is its end)
        stop = choice.stop_reason if isinstance(choice.stop_reason, str) and choice.stop_reason in self._stops else None
        self._finish = StreamEnd(reason=choice.finish_reason, stop=stop)

    def _tool_call_parts(self, parts: list[_ToolCallDelta] | None) -> list[ToolCall]:
        """Accumulate streamed call fragments; a call is whole once a later one starts."""
        done: list[ToolCall] = []
        for part in parts or []:
            if part.index not in self._calls:
                done += self._whole_calls()
                self._calls[part.index] = _CallParts()
            call = self._calls[part.index]
            call.id = call.id or part.id
            if part.function is not None:
                self._call_bytes += len(part.function.name or "") + len(part.function.arguments or "")
                if self._call_bytes > MAX_CALL_BYTES:
                    raise self._engine.error(
                        f"sent tool calls of more than {MAX_CALL_BYTES} characters of names and arguments"
                    )
                call.name += part.function.name or ""
                call.arguments += part.function.arguments or ""
        return done

    def _whole_calls(self) -> list[ToolCall]:
        calls = [_tool_call(parts, self._tools) for parts in self._calls.values()]
        self._calls.clear()
        return calls

    def _push(self, delta: Piece) -> None:
        with self._arrived:
            self._deltas.append(delta)
            self._arrived.notify_all()

    def _ended(self, end: StreamEnd) -> None:
        with self._arrived:
            if self.end is None:
                self.end = end
            self._arrived.notify_all()


def _strict(tool: dict[str, Any]) -> dict[str, Any]:
    return {**tool, "function": {**tool["function"], "strict": True}}


def _tool_call(parts: _CallParts, tools: set[str]) -> ToolCall:
    """A call the engine's parser read, in the worker's shape (checked as the local reader checks)."""
    call_id = "call_" + secrets.token_hex(12)
    raw = parts.arguments
    try:
        arguments = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        return ToolCall(id=call_id, name=parts.name or None, arguments=None, raw=raw, error="the arguments are not JSON")
    if not parts.name:
        return ToolCall(id=call_id, name=None, arguments=None, raw=raw, error="the call names no function")
    if parts.name not in tools:
        error = f"there is no tool named {parts.name!r} among the tools given"
        return ToolCall(id=call_id, name=parts.name, arguments=None, raw=raw, error=error)
    if not isinstance(arguments, dict):
        return ToolCall(id=call_id, name=parts.name, arguments=None, raw=raw, error="the call's arguments are not a JSON object")
    return ToolCall(id=call_id, name=parts.name, arguments=arguments, raw=raw, error=None)


if TYPE_CHECKING:  # the registry finds backends by import path: these hold the classes to the boundary
    from worker.backends.base import CheckingBackend, EngineModel, StreamedDecoding

    _backend: type[CheckingBackend] = OpenAIBackend
    _model: type[EngineModel] = OpenAIModel
    _decoding: type[StreamedDecoding] = EngineDecoding
