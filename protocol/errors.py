"""Error codes, stable error kinds, and the exception that carries them.

Every error the worker sends has a JSON-RPC ``code`` (coarse, for generic
clients) and an ``error.data.kind`` (fine-grained and stable, for hosts that
branch on it). Worker-defined codes live in -32000..-32019; -32096..-32099 are
left to vscode-jsonrpc.
"""

from __future__ import annotations

import enum

import msgspec


class ErrorKind(enum.StrEnum):
    PARSE_ERROR = "parse_error"
    MESSAGE_TOO_LARGE = "message_too_large"
    INVALID_REQUEST = "invalid_request"
    BATCH_NOT_SUPPORTED = "batch_not_supported"
    DUPLICATE_ID = "duplicate_id"
    METHOD_NOT_FOUND = "method_not_found"
    INVALID_PARAMS = "invalid_params"
    INTERNAL_ERROR = "internal_error"
    REQUEST_CANCELLED = "request_cancelled"
    SHUTTING_DOWN = "shutting_down"
    MODEL_NOT_LOADED = "model_not_loaded"
    MODEL_LOAD_FAILED = "model_load_failed"
    # The model path names nothing: a host tells "no such model" from a broken one by kind alone.
    MODEL_NOT_FOUND = "model_not_found"
    BACKEND_NOT_FOUND = "backend_not_found"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    CONTEXT_OVERFLOW = "context_overflow"
    UNSUPPORTED = "unsupported"
    CACHE_NOT_FOUND = "cache_not_found"
    CACHE_IDENTITY_MISMATCH = "cache_identity_mismatch"
    CACHE_CORRUPT = "cache_corrupt"
    CACHE_PREFIX_MISMATCH = "cache_prefix_mismatch"
    CACHE_TOO_LARGE = "cache_too_large"
    CACHE_STORAGE_FAILED = "cache_storage_failed"
    # A model served by another program (the openai backend)
    ENGINE_UNREACHABLE = "engine_unreachable"
    ENGINE_AUTH_FAILED = "engine_auth_failed"
    MODEL_NOT_SERVED = "model_not_served"
    ENGINE_OVERLOADED = "engine_overloaded"
    ENGINE_ERROR = "engine_error"
    ENGINE_STALLED = "engine_stalled"


CODES: dict[ErrorKind, int] = {
    ErrorKind.PARSE_ERROR: -32700,
    ErrorKind.MESSAGE_TOO_LARGE: -32700,
    ErrorKind.INVALID_REQUEST: -32600,
    ErrorKind.BATCH_NOT_SUPPORTED: -32600,
    ErrorKind.DUPLICATE_ID: -32600,
    ErrorKind.METHOD_NOT_FOUND: -32601,
    ErrorKind.INVALID_PARAMS: -32602,
    ErrorKind.INTERNAL_ERROR: -32603,
    ErrorKind.REQUEST_CANCELLED: -32800,
    ErrorKind.SHUTTING_DOWN: -32000,
    ErrorKind.MODEL_NOT_LOADED: -32001,
    ErrorKind.MODEL_LOAD_FAILED: -32002,
    ErrorKind.MODEL_NOT_FOUND: -32002,
    ErrorKind.BACKEND_NOT_FOUND: -32003,
    ErrorKind.BACKEND_UNAVAILABLE: -32004,
    ErrorKind.CONTEXT_OVERFLOW: -32005,
    ErrorKind.UNSUPPORTED: -32006,
    ErrorKind.CACHE_NOT_FOUND: -32007,
    ErrorKind.CACHE_IDENTITY_MISMATCH: -32008,
    ErrorKind.CACHE_CORRUPT: -32009,
    ErrorKind.CACHE_PREFIX_MISMATCH: -32010,
    ErrorKind.CACHE_TOO_LARGE: -32011,
    ErrorKind.CACHE_STORAGE_FAILED: -32012,
    ErrorKind.ENGINE_UNREACHABLE: -32013,
    ErrorKind.ENGINE_AUTH_FAILED: -32014,
    ErrorKind.MODEL_NOT_SERVED: -32015,
    ErrorKind.ENGINE_OVERLOADED: -32016,
    ErrorKind.ENGINE_ERROR: -32017,
    ErrorKind.ENGINE_STALLED: -32018,
}


class ErrorData(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``error.data``: ``kind`` always; the rest only where it helps."""

    kind: str
    field: str | None = None
    method: str | None = None
    limit: int | None = None


class ErrorObject(msgspec.Struct, kw_only=True):
    code: int
    message: str
    data: ErrorData


class RpcError(Exception):
    """Raised anywhere below the dispatcher; becomes one error response."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        field: str | None = None,
        method: str | None = None,
        limit: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.data = ErrorData(kind=kind.value, field=field, method=method, limit=limit)

    @property
    def code(self) -> int:
        return CODES[self.kind]

    def to_object(self) -> ErrorObject:
        return ErrorObject(code=self.code, message=self.message, data=self.data)
