"""An OpenAI-compatible server over HTTP: JSON calls, server-sent event streams, and its
failures as the worker's error kinds.

The standard library's http.client, one connection per call: a stream is read on a thread of
its own and closed from any other to stop it (closing the connection is how an OpenAI-compatible
server learns that a request was abandoned; vLLM then stops computing it). Every read has a
deadline, so a server that stops answering ends the request with ``engine_stalled`` instead of
holding it for ever.
"""

from __future__ import annotations

import http.client
import logging
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import msgspec

from protocol.errors import ErrorKind, RpcError

log = logging.getLogger(__name__)
T = TypeVar("T")

# The longest line of an event stream read (a server that streams garbage without newlines
# must not fill memory).
MAX_LINE_BYTES = 16 * 1024 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024


class EngineAddress(msgspec.Struct, frozen=True):
    scheme: str
    host: str
    port: int
    path: str  # the base path, e.g. "/v1", without a trailing slash

    @classmethod
    def parse(cls, base_url: str) -> EngineAddress:
        def refuse(what: str) -> RpcError:
            return RpcError(
                ErrorKind.INVALID_PARAMS,
                f"base_url {base_url!r} {what}; give the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1.",
                field="params.base_url",
            )

        if any(ch.isspace() or not ch.isprintable() for ch in base_url):
            raise refuse("holds a space or a control character")
        try:
            parts = urlsplit(base_url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:  # a bad port, an unclosed [IPv6 address
            raise refuse(f"is not a valid URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise refuse("is not an http(s) URL")
        if parts.username is not None or parts.password is not None:
            # they would be sent nowhere (the key goes in a header) and shown in every message
            raise refuse("holds credentials; put the API key in an environment variable that api_key_env names")
        if parts.query or parts.fragment:
            raise refuse("has a query or fragment, which the API root cannot have")
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def root(self) -> str:
        """The server's root path, where vLLM serves /tokenize, /detokenize and /metrics."""
        return self.path[: -len("/v1")] if self.path.endswith("/v1") else self.path

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.path}"


class Engine:
    """Calls to one server. Safe to use from several threads (each call has its connection)."""

    def __init__(self, address: EngineAddress, api_key: str | None, *, connect_timeout_s: float, stall_timeout_s: float):
        self.address = address
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._connect_timeout_s = connect_timeout_s
        self._stall_timeout_s = stall_timeout_s

    def get(self, path: str, *, root: bool = False) -> Any:
        return self._call("GET", path, None, root=root)

    def post(self, path: str, body: Any, *, root: bool = False) -> Any:
        return self._call("POST", path, body, root=root)

    def _call(self, method: str, path: str, body: Any, *, root: bool) -> Any:
        connection = self._connect()
        try:
            response = self._send(connection, method, path, body, root=root)
            data = _read_bounded(response, self.address)
            try:
                return msgspec.json.decode(data)
            except msgspec.DecodeError:
                raise _engine_error(self.address, f"answered {method} {path} with a body that is not JSON") from None
        finally:
            connection.close()

    def stream(self, path: str, body: Any, event_type: type[T]) -> EventStream[T]:
        """A POST whose answer is a server-sent event stream (``stream: true``) of ``event_type``s."""
        connection = self._connect()
        try:
            response = self._send(connection, "POST", path, body, root=False, accept="text/event-stream")
        except BaseException:
            connection.close()
            raise
        return EventStream(connection, response, self.address, self._stall_timeout_s, event_type)

    def _connect(self) -> http.client.HTTPConnection:
        address = self.address
        if address.scheme == "https":
            return http.client.HTTPSConnection(
                address.host, address.port, timeout=self._connect_timeout_s, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(address.host, address.port, timeout=self._connect_timeout_s)

    def _send(
        self,
        connection: http.client.HTTPConnection,
        method: str,
        path: str,
        body: Any,
        *,
        root: bool,
        accept: str = "application/json",
    ) -> http.client.HTTPResponse:
        address = self.address
        url = (address.root if root else address.path) + path
        payload = None if body is None else msgspec.json.encode(body)
        try:
            connection.request(method, url, body=payload, headers={**self._headers, "Accept": accept})
            connection.sock.settimeout(self._stall_timeout_s)  # the answer may take as long as a stall
            response = connection.getresponse()
        except (ConnectionError, socket.gaierror, socket.timeout, OSError, http.client.HTTPException) as exc:
            raise _unreachable(address, exc) from None
        if response.status >= 400:
            raise _status_error(address, method, url, response.status, _read_bounded(response, address, quiet=True))
        return response


class EventStream(Generic[T]):
    """The events of a server-sent event stream, each ``data:`` payload decoded as JSON into
    ``T`` (one typed decode per event: no dict in between); ends at ``data: [DONE]`` or when the
    server closes the stream. ``close`` may be called from any thread: the reading thread then
    sees the end."""

    def __init__(
        self,
        connection: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        address: EngineAddress,
        stall_timeout_s: float,
        event_type: type[T],
    ) -> None:
        self._decoder = msgspec.json.Decoder(event_type)
        self._connection = connection
        self._response = response
        self._address = address
        self._stall_timeout_s = stall_timeout_s
        self._closed = threading.Event()

    def __iter__(self) -> Iterator[T]:
        data: list[bytes] = []
        while True:
            line = self._readline()
            if line is None:  # closed by us, or by the server before [DONE]
                if not self._closed.is_set():
                    raise _engine_error(self._address, "closed the event stream before it ended ([DONE])")
                return
            line = line.rstrip(b"\r\n")
            if line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
            elif not line and data:  # a blank line ends an event
                payload = b"\n".join(data)
                data = []
                if payload == b"[DONE]":
                    return
                try:
                    event = self._decoder.decode(payload)
                except msgspec.ValidationError as exc:
                    raise _engine_error(self._address, f"sent an event of an unexpected shape ({exc})") from None
                except msgspec.DecodeError:
                    raise _engine_error(self._address, f"sent an event that is not JSON: {payload[:200]!r}") from None
                yield event
            # other fields (event:, id:, retry:, comments) carry nothing the worker uses

    def _readline(self) -> bytes | None:
        if self._closed.is_set():
            return None
        try:
            line = self._response.readline(MAX_LINE_BYTES + 1)
        except socket.timeout:
            if self._closed.is_set():
                return None
            raise RpcError(
                ErrorKind.ENGINE_STALLED,
                f"The server at {self._address} sent nothing for {self._stall_timeout_s:g} s in the middle of a "
                "stream; the request was abandoned. Check the server's load and logs, or raise stall_timeout_s "
                "in load.",
            ) from None
        except Exception as exc:  # http.client raises odd errors (AttributeError too) when closed mid-read
            if self._closed.is_set():
                return None
            raise _engine_error(self._address, f"broke the event stream ({exc!r})") from None
        if len(line) > MAX_LINE_BYTES:
            raise _engine_error(self._address, f"sent a line of more than {MAX_LINE_BYTES} bytes in its event stream")
        return line or None

    def close(self) -> None:
        """Stop the stream: the server sees the connection close."""
        if self._closed.is_set():
            return
        self._closed.set()
        sock = self._connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
            except OSError:
                pass
        self._connection.close()


def _read_bounded(response: http.client.HTTPResponse, address: EngineAddress, *, quiet: bool = False) -> bytes:
    try:
        data = response.read(MAX_BODY_BYTES + 1)
    except socket.timeout:
        raise RpcError(
            ErrorKind.ENGINE_STALLED, f"The server at {address} stopped sending its answer; check its load and logs."
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        if quiet:
            return b""
        raise _engine_error(address, f"broke its answer off ({exc!r})") from None
    if len(data) > MAX_BODY_BYTES:
        raise _engine_error(address, f"answered with more than {MAX_BODY_BYTES} bytes")
    return data


def _unreachable(address: EngineAddress, exc: BaseException) -> RpcError:
    return RpcError(
        ErrorKind.ENGINE_UNREACHABLE,
        f"Could not reach the server at {address}: {exc!r}. Check that it runs and that base_url is right; "
        "the next request tries again.",
    )


def _engine_error(address: EngineAddress, what: str) -> RpcError:
    return RpcError(ErrorKind.ENGINE_ERROR, _engine_error_message(address, what))


def _engine_error_message(address: EngineAddress, what: str) -> str:
    return f"The server at {address} {what}; the request was abandoned and the worker keeps serving. Check the server's logs."


class EngineStatusError(RpcError):
    """An error answer of the server, with its HTTP status for a caller that tells some apart
    (a 404 from an endpoint the server lacks)."""

    def __init__(
        self, status: int, kind: ErrorKind, message: str, *, field: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(kind, message, field=field)
        self.status = status
        self.param = param  # the request field the server's answer blames, in its own words


def _status_error(address: EngineAddress, method: str, url: str, status: int, body: bytes) -> EngineStatusError:
    message = _server_message(body)
    said = f" It said: {message}" if message else ""
    if status in (401, 403):
        return EngineStatusError(
            status,
            ErrorKind.ENGINE_AUTH_FAILED,
            f"The server at {address} refused the API key ({status} on {method} {url}).{said} Set the key in the "
            "environment variable that api_key_env names, or check which key the server expects.",
            field="params.api_key_env",
        )
    if status == 429 or status == 503:
        return EngineStatusError(
            status,
            ErrorKind.ENGINE_OVERLOADED,
            f"The server at {address} is overloaded ({status} on {method} {url}).{said} Send the request again later.",
        )
    if status == 404 and "model" in message.lower():
        return EngineStatusError(
            status,
            ErrorKind.MODEL_NOT_SERVED,
            f"The server at {address} does not serve the model asked for ({status}).{said} Load a model it serves "
            "(its /v1/models lists them).",
            field="params.model",
        )
    if 400 <= status < 500:
        param = _server_param(body)
        overflow = "context length" in message.lower() or param == "input_tokens"  # vLLM's words
        return EngineStatusError(
            status,
            ErrorKind.CONTEXT_OVERFLOW if overflow else ErrorKind.INVALID_PARAMS,
            f"The server at {address} refused the request ({status} on {method} {url}).{said}",
            param=param,
        )
    return EngineStatusError(
        status, ErrorKind.ENGINE_ERROR, _engine_error_message(address, f"failed with {status} on {method} {url}.{said}")
    )


def _server_param(body: bytes) -> str | None:
    """The ``param`` an OpenAI-style error body names, if any."""
    try:
        error = msgspec.json.decode(body).get("error")
    except (msgspec.DecodeError, AttributeError):
        return None
    param = error.get("param") if isinstance(error, dict) else None
    return param if isinstance(param, str) else None


def _server_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, or the start of whatever the body is."""
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body[:300].decode("utf-8", "replace").strip()
    error = decoded.get("error") if isinstance(decoded, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"][:1000]
    if isinstance(error, str):  # vLLM's answer to a wrong API key: {"error": "Unauthorized"}
        return error[:1000]
    if isinstance(decoded, dict) and isinstance(decoded.get("message"), str):  # vLLM's own endpoints
        return decoded["message"][:1000]
    if isinstance(decoded, dict) and isinstance(decoded.get("detail"), str):
        return decoded["detail"][:1000]
    return body[:300].decode("utf-8", "replace").strip()
