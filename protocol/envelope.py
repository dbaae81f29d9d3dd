"""The JSON-RPC 2.0 envelope: classify an incoming frame body, encode outgoing messages.

Incoming bodies are decoded loosely first and then checked by hand, so that
each way a message can be wrong gets its own precise error.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, TypeGuard, cast

import msgspec

from protocol.errors import ErrorKind, ErrorObject, RpcError

RequestId = int | str

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
# Values in a request's params nest at most this deep below params: the worker, chat templates
# and grammars walk them recursively, and no real request needs more (a JSON Schema shares its
# parts through $defs and $ref). The field named in the error goes at most _NAMED_LEVELS deep.
MAX_PARAMS_DEPTH = 64
_NAMED_LEVELS = 4
# A message nested past what the decoder takes (about a thousand levels) is read again with every
# value below this level cut out: the envelope (1), params (2), and a level more than params may
# hold, so that the refusal names the field and answers the request's id, whatever the depth.
_KEPT_LEVELS = MAX_PARAMS_DEPTH + 3
# A JSON string whole (its brackets are not structure), or a run of opening or closing brackets.
_STRUCTURE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]+|[\]}]+')


class Request(msgspec.Struct, frozen=True):
    id: RequestId
    method: str
    params: dict[str, Any] | None


class Notification(msgspec.Struct, frozen=True):
    method: str
    params: dict[str, Any] | None


class Response(msgspec.Struct, frozen=True):
    """A response from the host. The worker sends no requests, so it is dropped."""

    id: RequestId | None


class Rejected(msgspec.Struct, frozen=True):
    """A frame that is not a valid message; ``id`` is what the reply must carry."""

    id: RequestId | None
    error: RpcError


Incoming = Request | Notification | Response | Rejected


class OutgoingResult(msgspec.Struct, kw_only=True):
    jsonrpc: str = "2.0"
    id: RequestId
    result: Any


class OutgoingError(msgspec.Struct, kw_only=True):
    jsonrpc: str = "2.0"
    id: RequestId | None
    error: ErrorObject


class OutgoingNotification(msgspec.Struct, kw_only=True):
    jsonrpc: str = "2.0"
    method: str
    params: Any


def parse_incoming(body: bytes) -> Incoming:
    try:
        return _classify(body)
    except RecursionError:
        return _too_deep_to_decode(body)


def _too_deep_to_decode(body: bytes) -> Incoming:
    """A message nested past what the decoders take, refused from a reading of it without its
    deepest values (linear in its length), so that a request is answered with its id: too deep
    params name the field as in any request; another member too deep is an invalid request."""
    shallow = _classify(_cut_below(body, _KEPT_LEVELS))  # _KEPT_LEVELS deep at most: it decodes
    if isinstance(shallow, Rejected) and shallow.error.kind is not ErrorKind.PARSE_ERROR:
        return shallow
    if isinstance(shallow, Request):
        return Rejected(shallow.id, _invalid(f"a member other than params nests more than {MAX_PARAMS_DEPTH} levels deep"))
    return Rejected(None, RpcError(ErrorKind.PARSE_ERROR, "Parse error: JSON nested too deeply; send a flatter message."))


def _cut_below(body: bytes, levels: int) -> bytes:
    """``body`` with every array or object nested below ``levels`` replaced by 0. One pass of a
    regular expression over the text: strings are skipped whole, runs of brackets taken at once."""
    parts: list[bytes] = []
    depth, kept_from, cutting = 0, 0, False
    for token in _STRUCTURE.finditer(body):
        start, end = token.span()
        first = body[start]
        if first == 0x22:  # a string
            continue
        if first in b"[{":
            if not cutting and depth + end - start > levels:
                parts += [body[kept_from : start + levels - depth], b"0"]
                cutting = True
            depth += end - start
        else:
            depth -= end - start
            if cutting and depth <= levels:
                kept_from, cutting = end - (levels - depth), False  # the closing brackets of kept levels stay
    if not cutting:
        parts.append(body[kept_from:])
    return b"".join(parts)


def _classify(body: bytes) -> Incoming:
    """Raises RecursionError for a message nested past what the decoders take."""
    try:
        obj = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        obj = _with_lone_surrogates_replaced(body)  # walks the value: as deep as msgspec let it be
        if obj is None:
            return Rejected(None, RpcError(ErrorKind.PARSE_ERROR, f"Parse error: {exc}; send one valid JSON object."))
    if isinstance(obj, list):
        return Rejected(
            None,
            RpcError(
                ErrorKind.BATCH_NOT_SUPPORTED,
                "Batch requests are not supported; send each request as its own message.",
            ),
        )
    if not isinstance(obj, dict):
        return Rejected(None, _invalid(f"a message must be a JSON object, got {_json_type(obj)}"))
    obj = cast(dict[str, Any], obj)  # JSON objects' keys are strings
    if "method" not in obj and ("result" in obj or "error" in obj):
        # A response, whatever its id: answering it could start two peers answering each other forever.
        return Response(obj.get("id") if _is_valid_id(obj.get("id")) else None)
    has_id = "id" in obj  # 0 and "" are valid ids: test the key, not the value
    msg_id: RequestId | None = None
    if has_id:
        if not _is_valid_id(given := obj["id"]):
            return Rejected(None, _invalid(f"'id' must be an integer or a string, got {_json_type(given)}", "id"))
        msg_id = given
    reply_id = msg_id
    if obj.get("jsonrpc") != "2.0":
        got = "it is missing" if "jsonrpc" not in obj else f"got {obj['jsonrpc']!r}"
        return Rejected(reply_id, _invalid(f"'jsonrpc' must be \"2.0\" ({got})", "jsonrpc"))
    if "method" not in obj:
        return Rejected(reply_id, _invalid("'method' is missing", "method"))
    method = obj["method"]
    if not isinstance(method, str):
        return Rejected(reply_id, _invalid(f"'method' must be a string, got {_json_type(method)}", "method"))
    params: Any = obj.get("params")
    if params is not None and not isinstance(params, dict):
        error = RpcError(
            ErrorKind.INVALID_PARAMS,
            f"Invalid params for '{method}': params must be an object of named fields, "
            f"got {_json_type(params)}.",
            field="params",
            method=method,
        )
        return Rejected(reply_id, error)
    if has_id and params is not None and (field := _too_deep(cast(dict[str, Any], params))) is not None:
        error = RpcError(
            ErrorKind.INVALID_PARAMS,
            f"Invalid params for '{method}': {field} nests more than {MAX_PARAMS_DEPTH} levels deep; flatten it "
            "(a JSON Schema can share its parts through $defs and $ref).",
            field=field,
            method=method,
        )
        return Rejected(reply_id, error)
    fields = cast(dict[str, Any] | None, params)  # JSON objects' keys are strings
    return Request(msg_id, method, fields) if msg_id is not None else Notification(method, fields)


def _too_deep(params: dict[str, Any]) -> str | None:
    """The field of ``params`` (named at most _NAMED_LEVELS deep) holding a value nested more
    than MAX_PARAMS_DEPTH levels below params, or None. Walked without recursion."""
    stack: list[tuple[dict[str, Any] | list[Any], int, str]] = [(params, 0, "params")]
    while stack:
        value, depth, field = stack.pop()
        if depth > MAX_PARAMS_DEPTH:
            return field
        items: Iterable[tuple[str | int, Any]] = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(item, dict | list):
                named = field if depth >= _NAMED_LEVELS else field + (f"[{key}]" if isinstance(key, int) else f".{key[:40]}")
                stack.append((cast(dict[str, Any] | list[Any], item), depth + 1, named))
    return None


def encode_result(msg_id: RequestId, result: Any) -> bytes:
    return _encoder.encode(OutgoingResult(id=msg_id, result=result))


def encode_error(msg_id: RequestId | None, error: RpcError) -> bytes:
    return _encoder.encode(OutgoingError(id=msg_id, error=error.to_object()))


def encode_notification(method: str, params: Any) -> bytes:
    return _encoder.encode(OutgoingNotification(method=method, params=params))


def _with_lone_surrogates_replaced(body: bytes) -> Any | None:
    """``body`` decoded with every lone UTF-16 surrogate escape replaced by U+FFFD, or None if it
    is not JSON at all. JavaScript's JSON.stringify writes a string cut inside an emoji with
    such an escape ("\\ud83d"); it is no character, so the stricter decoder refuses it."""
    import json  # only on this error path
    import math
    import re

    if not re.search(rb"\\u[dD][89a-fA-F]", body):  # no surrogate escape: some other fault
        return None

    def refuse(constant: str) -> None:  # NaN and Infinity are not JSON
        raise ValueError(constant)

    def finite(text: str) -> float:
        if not math.isfinite(number := float(text)):
            raise ValueError(text)
        return number

    try:
        obj = json.loads(body.decode("utf-8"), parse_constant=refuse, parse_float=finite)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return _replace_surrogates(obj)


def _replace_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_replace_surrogates(item) for item in cast(list[Any], value)]
    if isinstance(value, dict):
        entries = cast(dict[Any, Any], value).items()
        return {_replace_surrogates(key): _replace_surrogates(item) for key, item in entries}
    return value


def _is_valid_id(value: object) -> TypeGuard[RequestId]:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _invalid(what: str, field: str | None = None) -> RpcError:
    return RpcError(
        ErrorKind.INVALID_REQUEST,
        f"Invalid request: {what}. A request looks like "
        '{"jsonrpc":"2.0","id":1,"method":"capabilities","params":{}}.',
        field=field,
    )


def _json_type(value: object) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int() | float():
            return "a number"
        case str():
            return "a string"
        case list():
            return "an array"
        case _:
            return "an object"
