"""Every method's params and result, and every notification, as msgspec Structs.

This module is the single source of truth for the wire: the worker decodes
params with these types, ``python -m protocol.schema`` turns them into
``schemas/``, and docs/PROTOCOL.md describes them field by field.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec
from msgspec import Meta

from protocol.envelope import RequestId

PROTOCOL_VERSION = "1.0"

NonNegativeInt = Annotated[int, Meta(ge=0)]
# "name" is a file name.kvc in the cache directory; "memory://name" lives in this process only.
# "auto" is reserved for automatic reuse.
# "$(?!\n)": in Python, "$" also matches before a final newline ("evil\n" would pass); in
# JSON Schema's regular expressions it matches at the end alone, and the lookahead changes nothing.
_NAME = r"(memory://)?[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}"
CacheRef = Annotated[str, Meta(pattern=rf"^(?!auto$){_NAME}$(?!\n)")]
CacheRefOrAuto = Annotated[str, Meta(pattern=rf"^(auto|{_NAME})$(?!\n)")]  # generate's cache: a ref or "auto"
TokenId = Annotated[int, Meta(ge=0)]
# Stop strings are matched at every token on the model thread, beside the other requests of
# the batch: bounded, so that no request's can slow its neighbours (PROTOCOL.md 8.4).
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]


class Params(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Base of every params struct: unknown fields are refused, by name."""


class Result(msgspec.Struct, kw_only=True):
    """Base of every result struct: every field is always present."""


class NoParams(Params, frozen=True):
    pass


# --- capabilities -----------------------------------------------------------


class BackendInfo(Result):
    name: str
    description: str
    available: bool
    reason: str | None  # why it is not available, and how to fix that


class FramingInfo(Result):
    supported: list[str]
    replies: str | None  # the framing replies use, once decided


class Limits(Result):
    max_message_bytes: int
    outbox_messages: int  # messages buffered for stdout before producers wait
    max_batch: int  # generate and prefill requests run side by side; more wait in the queue


class SpecialToken(Result):
    role: str  # "bos", "eos", "pad", "unk"
    id: int
    text: str


class ToolCallSupport(Result):
    """How generate passes ``tools`` to this model and reads its calls back."""

    template_takes_tools: bool  # the chat template renders tools; else the worker writes them as a system message
    format: str | None  # the call format the worker parses ("hermes", "llama3_json", "functiongemma"); null: none
    forced: bool  # tool_choice "required" or a named tool can constrain the output to calls


class ModelInfo(Result):
    model: str  # as given to load
    backend: str
    path: str | None
    vocab_size: int
    context_length: int
    special_tokens: list[SpecialToken]
    has_chat_template: bool
    device: str
    dtype: str
    quantization: str  # "none", "int8", "int4" or "gguf": how the linear layers' weights are held
    tool_calls: ToolCallSupport
    load_time_ms: float
    # the worker process's resident memory just after the load, in bytes (None where the system
    # does not say): what the model takes, with the worker's own and its libraries'
    resident_bytes: int | None = None


class CapabilitiesResult(Result):
    protocol_version: str
    worker_version: str
    pid: int
    backends: list[BackendInfo]
    methods: list[str]
    notifications: list[str]
    framing: FramingInfo
    limits: Limits
    model: ModelInfo | None  # the loaded model, if any


# --- load / unload ----------------------------------------------------------


class LoadParams(Params, frozen=True):
    model: str = "default"
    backend: str = "transformers"
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Weight-only quantization of the linear layers, on the CPU (worker/backends/transformers/fast_weights.py).
    quantization: Literal["auto", "none", "int8", "int4", "gguf"] = "auto"
    trust_remote_code: bool = False
    # Backends that simulate work (echo) sleep this long per generated token;
    # others refuse a non-zero value.
    token_delay_ms: Annotated[float, Meta(ge=0, le=60_000)] = 0.0
    # The openai backend: the server's OpenAI API root (e.g. "http://127.0.0.1:8000/v1"), the
    # environment variable holding its API key (the key itself never crosses the protocol), and
    # how long a request may wait for the server's next byte before it ends as engine_stalled.
    base_url: Annotated[str, Meta(min_length=1, max_length=2048)] | None = None
    api_key_env: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    stall_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 120.0
    # Send load/progress notifications as the load goes through its long stages.
    progress: bool = False


# The stages of a load that can take long, in the order a load goes through them; a load
# reports those it has work in (a converted model, a built kernel, remembered digests: none).
LoadStage = Literal["building_kernel", "dequantizing", "hashing", "quantizing"]


class LoadProgress(Result):
    """params of the load/progress notification: a stage of a load, as it goes."""

    id: RequestId  # the load request's id
    stage: LoadStage
    done: int  # of total, in unit
    total: int
    unit: Literal["steps", "tensors", "bytes"]


class UnloadResult(Result):
    unloaded: bool
    model: str | None


# --- tokenize / detokenize / render -----------------------------------------


# A tool's name is read back from the model's output between each call format's delimiters
# ("</tool_call>", "<end_function_call>", "{"): a name holding one would end the call early.
# Letters, digits and "_-.:/" (dotted and slashed namespaces) hold none of them.
ToolNameText = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.:/-]{1,256}$(?!\n)")]


class ToolFunction(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    name: ToolNameText
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object


class Tool(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A tool the model may call, in OpenAI's shape."""

    type: Literal["function"] = "function"
    function: ToolFunction


class CalledFunction(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    name: str
    arguments: dict[str, Any] | str  # an object, or its JSON text


class MessageToolCall(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A call an earlier assistant message made, as the chat template receives it."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None  # a "tool" message: the call it answers
    tool_calls: list[MessageToolCall] | None = None  # an "assistant" message: the calls it made


class TokenizeParams(Params, frozen=True):
    text: str
    add_special_tokens: bool = True


class TokenizeResult(Result):
    tokens: list[int]
    count: int


class DetokenizeParams(Params, frozen=True):
    tokens: list[TokenId]
    skip_special_tokens: bool = False


class DetokenizeResult(Result):
    text: str


class RenderParams(Params, frozen=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True


class RenderResult(Result):
    text: str
    tokens: list[int]
    count: int


# --- generate -----------------------------------------------------------------


class PromptParams(Params, frozen=True):
    """The prompt of generate and prefill: exactly one of prompt, tokens, messages."""

    prompt: str | None = None
    tokens: list[TokenId] | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    tools: list[Tool] | None = None  # for messages
    add_special_tokens: bool = True  # for prompt: add BOS (once) as the model expects


class JsonSchemaSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    name: str = "response"
    schema: dict[str, Any] = {}
    strict: bool = True  # accepted for OpenAI's shape; the output is always constrained
    description: str | None = None


class TextFormat(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, tag_field="type", tag="text"):
    pass


class JsonObjectFormat(
    msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, tag_field="type", tag="json_object"
):
    pass


class JsonSchemaFormat(
    msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, tag_field="type", tag="json_schema"
):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class ToolName(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    type: Literal["function"] = "function"
    function: ToolName


class ToolCall(Result):
    """A call the model made, parsed from its output."""

    id: str  # unique, "call_" and 24 hex digits
    name: str | None  # null when the call's text named no function
    arguments: dict[str, Any] | None  # null for a malformed call
    raw: str  # the call as the model wrote it
    error: str | None  # why the call is malformed (not JSON, an unknown tool); null when it is not


class PromptLookup(
    msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, tag_field="method", tag="prompt_lookup"
):
    """Draft tokens from the sequence itself: after its last n tokens, those that followed
    their latest earlier occurrence. The model checks a draft in one pass and the output is
    the same as without it."""

    draft_tokens: Annotated[int, Meta(ge=1, le=64)] = 8  # at most this many drafted per step
    ngram_max: Annotated[int, Meta(ge=1, le=16)] = 3  # the longest tail looked up...
    ngram_min: Annotated[int, Meta(ge=1, le=16)] = 2  # ...down to this one


class GenerateParams(PromptParams, frozen=True):
    max_tokens: Annotated[int, Meta(ge=1)] = 256
    temperature: Annotated[float, Meta(ge=0)] = 0.0  # 0 is greedy
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: NonNegativeInt = 0  # 0 is off
    min_p: Annotated[float, Meta(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0)] = 1.0
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None  # a signed 64-bit integer
    stop: Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] = []
    stream: bool = True  # send generate/chunk notifications
    # Chunks sent past the last one acknowledged with generate/ack; later text waits, merged
    # into one chunk, until an ack makes room (None: no limit, no acks needed).
    stream_window: Annotated[int, Meta(ge=1)] | None = None
    # A cache ref ("name" on disk, "memory://name" in this process) whose tokens
    # must be a prefix of the prompt's; only the rest is computed. "auto": reuse the
    # stored cache sharing the longest prefix with the prompt, store the new sequence.
    cache: CacheRefOrAuto | None = None
    cache_trim_tokens: NonNegativeInt | None = None  # use at most this many of the cache's tokens
    # Constrain the output to JSON (any object, or one matching a JSON Schema).
    response_format: ResponseFormat | None = None
    # With tools: "auto" parses the calls the model makes; "none" gives it no tools; "required"
    # or a named tool constrains the output to calls (of that tool).
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice = "auto"
    # false: a tool_choice that forces calls allows exactly one
    parallel_tool_calls: bool = True
    # Speculative decoding: tokens drafted and checked several per step (same output, sooner).
    draft: PromptLookup | None = None


class GenerateChunk(Result):
    """params of the generate/chunk notification; counts are cumulative."""

    id: RequestId  # the generate request's id
    index: int
    text: str
    tokens: list[int]
    generated_tokens: int
    prompt_tokens: int
    cache_read_tokens: int
    content: str  # the part of text outside tool calls and the model's thinking
    reasoning: str  # the part of text inside the thinking markers the chat template declares, without them
    tool_calls: list[ToolCall]  # the calls this chunk completed


class StopReason(Result):
    kind: Literal["eos", "stop_string", "max_tokens", "cancelled"]
    token: int | None  # the end-of-sequence token, for kind "eos"
    stop: str | None  # the stop string, for kind "stop_string"


class Usage(Result):
    prompt_tokens: int
    completion_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    reasoning_tokens: int  # of completion_tokens, those of the model's thinking (its markers included)


class Timings(Result):
    queued_ms: float  # waiting for earlier model requests
    prompt_ms: float  # prompt processing up to the first token
    decode_ms: float  # first token to last
    total_ms: float
    tokens_per_second: float  # completion tokens after the first, per second of decode
    draft_tokens: int  # drafted tokens the model checked (params.draft)
    draft_accepted_tokens: int  # of those, the ones the output took


class SkippedCache(Result):
    ref: str
    reason: str  # why auto did not use it (damaged, or removed meanwhile)


class CacheUse(Result):
    """What a generate did with its cache."""

    mode: Literal["ref", "auto"]
    ref: str | None  # the cache reused; null when auto found none to reuse
    reused_tokens: int  # prompt tokens taken from the cache instead of computed
    reason: str | None  # auto: why nothing was reused
    skipped: list[SkippedCache]  # auto: stored caches passed over because they could not be used
    stored: str | None  # auto: the ref the new sequence (prompt and generated tokens) was stored under
    stored_tokens: int  # auto: tokens that stored cache covers
    store_reason: str | None  # auto: why nothing was stored


class GenerateResult(Result):
    text: str
    tokens: list[int]
    content: str  # text outside tool calls and the model's thinking
    reasoning: str  # the model's thinking, without its markers ("" for a model whose template declares none)
    tool_calls: list[ToolCall]  # every call the model made, in order
    finish_reason: Literal["stop", "length", "cancelled", "tool_calls"]
    stop_reason: StopReason
    usage: Usage
    timings: Timings
    cache: CacheUse | None  # null when no cache was given


# --- prefill and the cache store -----------------------------------------------


class PrefillParams(PromptParams, kw_only=True, frozen=True):
    add_generation_prompt: bool = True  # for messages
    # Where to store the result; "auto": where auto generates look (the stored cache sharing the
    # longest prefix is the start, and the result is stored under an auto ref).
    cache: CacheRefOrAuto
    base: CacheRef | None = None  # start from this cache's tokens where they are a prefix
    trim_to_tokens: NonNegativeInt | None = None  # use at most this many of base's tokens
    prefix_offsets: list[NonNegativeInt] = []  # kept with the cache for the host, never read
    prefix_hashes: list[str] = []


class PrefillResult(Result):
    cache: str
    token_count: int  # tokens the cache now covers
    cache_read_tokens: int  # taken from base
    cache_write_tokens: int  # computed now
    bytes: int  # size of the stored cache
    time_ms: float


class PrefillProgress(Result):
    """params of the prefill/progress notification, sent after each chunk of a long prefill."""

    id: RequestId  # the prefill request's id
    processed_tokens: int  # tokens the cache covers so far, read ones included
    total_tokens: int
    cache_read_tokens: int


class CacheRefParams(Params, frozen=True):
    cache: CacheRef


class CacheInfo(Result):
    cache: str
    token_count: int
    bytes: int
    model_id: str
    created_by: str
    last_used: float  # seconds since the epoch
    prefix_offsets: list[int]
    prefix_hashes: list[str]


class CacheListResult(Result):
    caches: list[CacheInfo]
    total_bytes: int
    max_bytes: int | None


class CacheDeleteResult(Result):
    deleted: bool


# --- models/list -----------------------------------------------------------------


class ModelEntry(Result):
    """A model found on this machine, described from its headers and manifests (no weights read)."""

    reference: str  # what load's model takes to load it
    source: Literal["ollama", "huggingface", "node-llama-cpp", "models-dir"]
    path: str  # the file (a gguf) or directory (a transformers model) the reference resolves to
    format: Literal["gguf", "transformers"]
    architecture: str | None  # gguf's general.architecture, or a directory's model_type
    parameters: int | None  # the numbers in its tensors
    quantization: str | None  # a gguf's file type ("Q4_K_M"), or a directory's dtype ("bfloat16")
    size_bytes: int  # on disk: the file, or the directory's files
    context_length: int | None
    has_chat_template: bool
    tool_calls: ToolCallSupport | None  # as load would report it; null without a chat template
    loadable: bool  # false: load refuses it, for the reason given
    reason: str | None  # why not loadable, or how it loads where that is not the usual way


class SearchedPlace(Result):
    """A directory models/list looked in."""

    source: Literal["ollama", "huggingface", "node-llama-cpp", "models-dir"]
    path: str
    exists: bool
    models: int  # entries it gave
    note: str | None  # what was passed over there (entries past the bound, unreadable files)


class ModelsListResult(Result):
    models: list[ModelEntry]
    searched: list[SearchedPlace]
    truncated: bool  # more models were there than the answer holds


# --- cancel / shutdown -------------------------------------------------------


class CancelParams(Params, frozen=True):
    id: RequestId


class AckParams(Params, frozen=True):
    id: RequestId  # the generate request
    index: Annotated[int, Meta(ge=0)]  # the host has taken this chunk and those before it


class CancelResult(Result):
    cancelled: bool
    state: Literal["running", "queued", "unknown"]  # the target's state when cancel arrived


# --- the registry -------------------------------------------------------------

P = TypeVar("P", bound=Params)
R = TypeVar("R", bound="Result | None")


class MethodSpec(msgspec.Struct, Generic[P, R], frozen=True):
    """A method on the wire. Each has a constant below, typed with its params and result, for
    the worker's declaration of it (worker/policy.py) to be checked against."""

    name: str
    params: type[P]
    result: type[R]  # a Result subclass, or type(None) for a method that answers null
    summary: str


METHODS: dict[str, MethodSpec[Any, Any]] = {}  # every method, in the order capabilities lists them


def _method(name: str, params: type[P], result: type[R], summary: str) -> MethodSpec[P, R]:
    METHODS[name] = spec = MethodSpec(name, params, result, summary)
    return spec


CAPABILITIES = _method("capabilities", NoParams, CapabilitiesResult, "What this worker speaks and can run.")
LOAD = _method("load", LoadParams, ModelInfo, "Load a model, replacing any loaded one.")
UNLOAD = _method("unload", NoParams, UnloadResult, "Unload the model and free its memory.")
TOKENIZE = _method("tokenize", TokenizeParams, TokenizeResult, "Text to token ids.")
DETOKENIZE = _method("detokenize", DetokenizeParams, DetokenizeResult, "Token ids to text.")
RENDER = _method("render", RenderParams, RenderResult, "Chat messages to prompt text and tokens.")
GENERATE = _method("generate", GenerateParams, GenerateResult, "Generate a continuation, streaming chunks.")
PREFILL = _method("prefill", PrefillParams, PrefillResult, "Compute a prompt's KV cache once and store it.")
CACHE_LIST = _method("cache/list", NoParams, CacheListResult, "The stored caches, most recently used first.")
CACHE_INFO = _method("cache/info", CacheRefParams, CacheInfo, "One cache's header, without loading its tensors.")
CACHE_DELETE = _method("cache/delete", CacheRefParams, CacheDeleteResult, "Delete a cache.")
MODELS_LIST = _method("models/list", NoParams, ModelsListResult, "The models on this machine that load can name.")
CANCEL = _method("cancel", CancelParams, CancelResult, "Cancel a queued or running request.")
SHUTDOWN = _method("shutdown", NoParams, type(None), "Finish up; answers after every earlier request.")

# Notifications by direction: what the host may send, what the worker sends.
HOST_NOTIFICATIONS: dict[str, type[Params]] = {
    "$/cancelRequest": CancelParams,
    "generate/ack": AckParams,
    "exit": NoParams,
}
WORKER_NOTIFICATIONS: dict[str, type[Result]] = {
    "generate/chunk": GenerateChunk,
    "prefill/progress": PrefillProgress,
    "load/progress": LoadProgress,
}
