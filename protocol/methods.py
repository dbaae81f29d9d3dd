"""Every method's params and result, and every notification, as msgspec Structs.

This module is the single source of truth for the wire: the worker decodes
params with these types, ``python -m protocol.schema`` turns them into
``schemas/``, and docs/PROTOCOL.md describes them field by field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from protocol.envelope import RequestId

PROTOCOL_VERSION = "1.0"

NonNegativeInt = Annotated[int, Meta(ge=0)]
TokenId = Annotated[int, Meta(ge=0)]


class Params(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Base of every params struct: unknown fields are refused, by name."""


class Result(msgspec.Struct, kw_only=True):
    """Base of every result struct: every field is always present."""


class NoParams(Params):
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


class SpecialToken(Result):
    role: str  # "bos", "eos", "pad", "unk"
    id: int
    text: str


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
    load_time_ms: float


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


class LoadParams(Params):
    model: str = "default"
    backend: str = "transformers"
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    trust_remote_code: bool = False
    # Backends that simulate work (echo) sleep this long per generated token;
    # others refuse a non-zero value.
    token_delay_ms: Annotated[float, Meta(ge=0, le=60_000)] = 0.0


class UnloadResult(Result):
    unloaded: bool
    model: str | None


# --- tokenize / detokenize / render -----------------------------------------


class ChatMessage(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # passed through to the chat template


class TokenizeParams(Params):
    text: str
    add_special_tokens: bool = True


class TokenizeResult(Result):
    tokens: list[int]
    count: int


class DetokenizeParams(Params):
    tokens: list[TokenId]
    skip_special_tokens: bool = False


class DetokenizeResult(Result):
    text: str


class RenderParams(Params):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


class RenderResult(Result):
    text: str
    tokens: list[int]
    count: int


# --- generate -----------------------------------------------------------------


class GenerateParams(Params):
    # Exactly one of prompt, tokens, messages.
    prompt: str | None = None
    tokens: list[TokenId] | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True  # for prompt: add BOS (once) as the model expects
    max_tokens: Annotated[int, Meta(ge=1)] = 256
    temperature: Annotated[float, Meta(ge=0)] = 0.0  # 0 is greedy
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: NonNegativeInt = 0  # 0 is off
    min_p: Annotated[float, Meta(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0)] = 1.0
    seed: int | None = None
    stop: list[Annotated[str, Meta(min_length=1)]] = []
    stream: bool = True  # send generate/chunk notifications


class GenerateChunk(Result):
    """params of the generate/chunk notification; counts are cumulative."""

    id: RequestId  # the generate request's id
    index: int
    text: str
    tokens: list[int]
    generated_tokens: int
    prompt_tokens: int
    cache_read_tokens: int


class StopReason(Result):
    kind: Literal["eos", "stop_string", "max_tokens", "cancelled"]
    token: int | None  # the end-of-sequence token, for kind "eos"
    stop: str | None  # the stop string, for kind "stop_string"


class Usage(Result):
    prompt_tokens: int
    completion_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int


class Timings(Result):
    queued_ms: float  # waiting for earlier model requests
    prompt_ms: float  # prompt processing up to the first token
    decode_ms: float  # first token to last
    total_ms: float
    tokens_per_second: float  # completion tokens after the first, per second of decode


class GenerateResult(Result):
    text: str
    tokens: list[int]
    finish_reason: Literal["stop", "length", "cancelled"]
    stop_reason: StopReason
    usage: Usage
    timings: Timings


# --- cancel / shutdown -------------------------------------------------------


class CancelParams(Params):
    id: RequestId


class CancelResult(Result):
    cancelled: bool
    state: Literal["running", "queued", "unknown"]  # the target's state when cancel arrived


# --- the registry -------------------------------------------------------------


class MethodSpec(msgspec.Struct, frozen=True):
    params: type[Params]
    result: Any  # a Result subclass, or None for methods that answer null
    summary: str


METHODS: dict[str, MethodSpec] = {
    "capabilities": MethodSpec(NoParams, CapabilitiesResult, "What this worker speaks and can run."),
    "load": MethodSpec(LoadParams, ModelInfo, "Load a model, replacing any loaded one."),
    "unload": MethodSpec(NoParams, UnloadResult, "Unload the model and free its memory."),
    "tokenize": MethodSpec(TokenizeParams, TokenizeResult, "Text to token ids."),
    "detokenize": MethodSpec(DetokenizeParams, DetokenizeResult, "Token ids to text."),
    "render": MethodSpec(RenderParams, RenderResult, "Chat messages to prompt text and tokens."),
    "generate": MethodSpec(GenerateParams, GenerateResult, "Generate a continuation, streaming chunks."),
    "cancel": MethodSpec(CancelParams, CancelResult, "Cancel a queued or running request."),
    "shutdown": MethodSpec(NoParams, None, "Finish up; answers after every earlier request."),
}

# Notifications by direction: what the host may send, what the worker sends.
HOST_NOTIFICATIONS: dict[str, type[Params]] = {
    "$/cancelRequest": CancelParams,
    "exit": NoParams,
}
WORKER_NOTIFICATIONS: dict[str, type[Result]] = {
    "generate/chunk": GenerateChunk,
}
