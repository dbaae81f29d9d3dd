"""An OpenAI-compatible server over HTTP: JSON calls, server-sent event streams, and its
failures as the worker's error kinds.

The standard library's http.client, one connection per call: a stream is read on a thread of
its own and closed from any other to stop it (closing the connection is how an OpenAI-compatible
server learns that a request was abandoned; vLLM then stops computing it). Every read has a
deadline (``_Timed``): the next bytes within ``stall_timeout_s``, and each piece of an answer
whole within ``stall_timeout_s`` of its start (a JSON answer, a stream's status line and
headers, one event of a stream), so that a server that stops answering, or trickles an
answer a byte at a time, ends the request with ``engine_stalled`` instead of holding it for
ever. Each piece is bounded in size too. A call that waits for a whole answer stops when the
request it serves is cancelled (worker/stopping.py). What the server says is quoted without
the API key (redact.py), and what it answers is decoded into the type the caller asks for,
so that an answer the protocol cannot pass on is ``engine_error`` naming what is wrong.
"""

from __future__ import annotations

import http.client
import io
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import msgspec

from protocol.errors import ErrorKind, RpcError
from worker import stopping
from worker.backends.openai.redact import Quoter

log = logging.getLogger(__name__)
T = TypeVar("T")

# The longest line of an event stream read, and the most data lines of one event hold together
# (a server that streams garbage without newlines, or data lines without the blank line that
# ends an event, must not fill memory).
MAX_LINE_BYTES = 16 * 1024 * 1024
MAX_EVENT_BYTES = 16 * 1024 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_ERROR_BODY_BYTES = 1024 * 1024  # an error answer: only its message is quoted


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
            port = parts.port
        except ValueError as exc:  # a bad port, an unclosed [IPv6 address
            raise refuse(f"is not a valid URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise refuse("is not an http(s) URL")
        if port == 0:  # no server listens there (a connection to it went to port 80)
            raise refuse("has port 0")
        if parts.username is not None or parts.password is not None:
            # they would be sent nowhere (the key goes in a header) and shown in every message
            raise refuse("holds credentials; put the API key in an environment variable that api_key_env names")
        if parts.query or parts.fragment:
            raise refuse("has a query or fragment, which the API root cannot have")
        default = 443 if parts.scheme == "https" else 80
        return cls(parts.scheme, parts.hostname, default if port is None else port, parts.path.rstrip("/"))

    @property
    def root(self) -> str:
        """The server's root path, where vLLM serves /tokenize, /detokenize and /metrics."""
        return self.path[: -len("/v1")] if self.path.endswith("/v1") else self.path

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.path}"


class _Late(Exception):
    """A read past its time: past the piece's deadline (``whole``), or a stall."""

    def __init__(self, whole: bool) -> None:
        super().__init__()
        self.whole = whole


class _LetGo(Exception):
    """The connection was let go of from another thread (a cancel, a stream's close)."""


class _Timed(io.RawIOBase):
    """The socket as http.client reads it (its ``makefile``), every read bounded in time: the
    next bytes within ``stall_s``, and none past the deadline of the piece being read."""

    def __init__(self, stall_s: float) -> None:
        super().__init__()
        self.stall_s = stall_s
        self.sock: socket.socket | None = None
        self.let_go = False
        self._raw: io.RawIOBase | None = None
        self._deadline: float | None = None
        self._whole_s: float | None = None
        self.received = False  # any byte of the piece being read

    def attach(self, sock: socket.socket) -> _Timed:
        self.sock = sock
        self._raw = sock.makefile("rb", buffering=0)  # the socket's own reader: it stays open while read
        return self

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(self)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if self._raw is not None:  # lets the socket close
            self._raw.close()
        super().close()

    def whole_within(self, seconds: float, *, from_first_byte: bool = False) -> None:
        """The piece read next must be whole within ``seconds`` from now, or from its first byte."""
        self._deadline = None if from_first_byte else time.monotonic() + seconds
        self._whole_s = seconds if from_first_byte else None
        self.received = False

    def readinto(self, buffer: Any) -> int:
        assert self.sock is not None and self._raw is not None
        timeout, whole = self.stall_s, False
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise _Late(whole=True)
            if left < timeout:
                timeout, whole = left, True
        self.sock.settimeout(timeout)
        try:
            read = self._raw.readinto(buffer) or 0
        except TimeoutError:
            raise _LetGo() if self.let_go else _Late(whole) from None
        except OSError:
            if self.let_go:
                raise _LetGo() from None
            raise
        if self.let_go:  # the end of file a shutdown gives
            raise _LetGo()
        if read and not self.received and self._whole_s is not None:
            self._deadline = time.monotonic() + self._whole_s
        self.received = self.received or bool(read)
        return read


class _Exchange:
    """One request and its answer, on a connection of its own: every read timed (``_Timed``),
    and let go of from any thread (``let_go``)."""

    def __init__(self, connection: http.client.HTTPConnection, stall_s: float) -> None:
        self.connection = connection
        self.timed = _Timed(stall_s)
        connection.response_class = lambda sock, **kwargs: http.client.HTTPResponse(  # type: ignore[assignment]
            self.timed.attach(sock), **kwargs  # type: ignore[arg-type]
        )

    def let_go(self) -> None:
        """Wake a read or write blocked on the connection: it fails as let go of."""
        self.timed.let_go = True
        sock = self.timed.sock or self.connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.connection.close()
        self.timed.close()  # the response's socket, where the connection let go of it already (will_close)
        if self.timed.sock is not None:
            self.timed.sock.close()


class Engine:
    """Calls to one server. Safe to use from several threads (each call has its connection)."""

    def __init__(self, address: EngineAddress, api_key: str | None, *, connect_timeout_s: float, stall_timeout_s: float):
        self.address = address
        self.quote = Quoter(api_key)
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._connect_timeout_s = connect_timeout_s
        self._stall_timeout_s = stall_timeout_s

    def get(self, path: str, answer: type[T], *, root: bool = False) -> T:
        return self._call("GET", path, None, answer, root=root)

    def post(self, path: str, body: Any, answer: type[T], *, root: bool = False) -> T:
        return self._call("POST", path, body, answer, root=root)

    def _call(self, method: str, path: str, body: Any, answer: type[T], *, root: bool) -> T:
        """The whole answer (status line, headers, body) within stall_timeout_s of the request."""
        exchange = self._open()
        try:
            with stopping.while_waiting(exchange.let_go):
                exchange.timed.whole_within(self._stall_timeout_s)
                response = self._send(exchange, method, path, body, root=root)
                data = self._body(exchange, response, MAX_BODY_BYTES)
            if exchange.timed.let_go:  # let go of as the answer was complete: the cancel said it stopped
                raise self._cancelled()
        finally:
            exchange.close()
        url = self._url(path, root)
        try:
            return msgspec.json.decode(data, type=answer)
        except msgspec.ValidationError as exc:
            raise self.error(f"answered {method} {url} with what the worker cannot pass on ({self.quote(str(exc))})") from None
        except msgspec.DecodeError:
            raise self.error(f"answered {method} {url} with a body that is not JSON") from None
        except RecursionError:
            raise self.error(f"answered {method} {url} with JSON nested too deeply") from None

    def stream(self, path: str, body: Any, event_type: type[T]) -> EventStream[T]:
        """A POST whose answer is a server-sent event stream (``stream: true``) of ``event_type``s;
        its status line and headers within stall_timeout_s of the request."""
        exchange = self._open()
        try:
            exchange.timed.whole_within(self._stall_timeout_s)
            response = self._send(exchange, "POST", path, body, root=False, accept="text/event-stream")
        except BaseException:
            exchange.close()
            raise
        return EventStream(exchange, response, self, self._stall_timeout_s, event_type)

    def _open(self) -> _Exchange:
        address = self.address
        if address.scheme == "https":
            connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                address.host, address.port, timeout=self._connect_timeout_s, context=ssl.create_default_context()
            )
        else:
            connection = http.client.HTTPConnection(address.host, address.port, timeout=self._connect_timeout_s)
        return _Exchange(connection, self._stall_timeout_s)

    def _url(self, path: str, root: bool) -> str:
        return (self.address.root if root else self.address.path) + path

    def _send(
        self, exchange: _Exchange, method: str, path: str, body: Any, *, root: bool, accept: str = "application/json"
    ) -> http.client.HTTPResponse:
        connection = exchange.connection
        url = self._url(path, root)
        payload = None if body is None else msgspec.json.encode(body)
        try:
            connection.connect()
        except (OSError, http.client.HTTPException) as exc:  # refused, no such host, the connect timed out
            raise self._cancelled() if exchange.timed.let_go else self._unreachable(exc) from None
        # Once connected the server is there: what it takes too long for is a stall, not unreachable.
        try:
            if exchange.timed.let_go:
                raise _LetGo()
            connection.sock.settimeout(self._stall_timeout_s)  # the server must take the request's bytes
            connection.request(method, url, body=payload, headers={**self._headers, "Accept": accept})
            response = connection.getresponse()
        except _Late:
            what = "did not send its answer's status line and headers whole" if exchange.timed.received else "sent no answer"
            raise self.stalled(f"{what} within {self._stall_timeout_s:g} s of {method} {url}") from None
        except TimeoutError:
            raise self.stalled(f"took none of {method} {url} for {self._stall_timeout_s:g} s") from None
        except _LetGo:
            raise self._cancelled() from None
        except (OSError, http.client.HTTPException) as exc:  # reset, or no HTTP answer at all
            raise self._cancelled() if exchange.timed.let_go else self._unreachable(exc) from None
        if response.status >= 400:
            error_body = self._body(exchange, response, MAX_ERROR_BODY_BYTES, quiet=True)
            raise _status_error(self.address, self.quote, method, url, response.status, error_body)
        return response

    def _body(self, exchange: _Exchange, response: http.client.HTTPResponse, limit: int, *, quiet: bool = False) -> bytes:
        """The answer's body, at most ``limit`` bytes. ``quiet``: an error answer, whose status
        says what went wrong: a body that breaks off, comes too slowly or is too long is cut."""
        try:
            data = response.read(limit + 1)
        except _LetGo:
            raise self._cancelled() from None
        except _Late as exc:
            if quiet:
                return b""
            what = "did not send its whole answer" if exc.whole else "stopped sending its answer"
            raise self.stalled(f"{what} within {self._stall_timeout_s:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            if quiet:
                return b""
            raise self.error(f"broke its answer off ({self.quote(repr(exc), 300)})") from None
        if len(data) > limit:
            if quiet:
                return data[:limit]
            raise self.error(f"answered with more than {limit} bytes")
        return data

    def error(self, what: str) -> RpcError:
        """engine_error: the server answered what it should not."""
        return RpcError(ErrorKind.ENGINE_ERROR, _engine_error_message(self.address, what))

    def stalled(self, what: str) -> RpcError:
        """engine_stalled: the server took too long."""
        return RpcError(
            ErrorKind.ENGINE_STALLED,
            f"The server at {self.address} {what}; the request was abandoned. Check the server's load and logs, "
            "or raise stall_timeout_s in load.",
        )

    def _unreachable(self, exc: BaseException) -> RpcError:
        return RpcError(
            ErrorKind.ENGINE_UNREACHABLE,
            f"Could not reach the server at {self.address}: {self.quote(repr(exc), 300)}. Check that it runs and "
            "that base_url is right; the next request tries again.",
        )

    def _cancelled(self) -> RpcError:
        return RpcError(
            ErrorKind.REQUEST_CANCELLED,
            f"The request was cancelled while it waited for the server at {self.address}; the worker closed "
            "the connection.",
        )


class EventStream(Generic[T]):
    """The events of a server-sent event stream, each ``data:`` payload decoded as JSON into
    ``T`` (one typed decode per event: no dict in between); ends at ``data: [DONE]`` or when the
    server closes the stream. Each event is whole within stall_timeout_s of its first byte and
    MAX_EVENT_BYTES at most. ``close`` may be called from any thread: the reading thread then
    sees the end."""

    def __init__(
        self,
        exchange: _Exchange,
        response: http.client.HTTPResponse,
        engine: Engine,
        stall_timeout_s: float,
        event_type: type[T],
    ) -> None:
        self._decoder = msgspec.json.Decoder(event_type)
        self._exchange = exchange
        self._response = response
        self._engine = engine
        self._stall_timeout_s = stall_timeout_s
        self._closed = threading.Event()

    def __iter__(self) -> Iterator[T]:
        data: list[bytes] = []
        size = 0
        self._next_piece()
        while True:
            line = self._readline()
            if line is None:  # closed by us, or by the server before [DONE]
                if not self._closed.is_set():
                    raise self._engine.error("closed the event stream before it ended ([DONE])")
                return
            line = line.rstrip(b"\r\n")
            if line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
                size += len(data[-1]) + 1
                if size > MAX_EVENT_BYTES:
                    raise self._engine.error(
                        f"sent an event of more than {MAX_EVENT_BYTES} bytes of data lines (no blank line ended it)"
                    )
            elif not line and data:  # a blank line ends an event
                payload = b"\n".join(data)
                data, size = [], 0
                self._next_piece()
                if payload == b"[DONE]":
                    return
                yield self._decode(payload)
            elif not data:  # a line between events (a comment, a keep-alive): what follows starts afresh
                self._next_piece()
            # other fields (event:, id:, retry:, comments) carry nothing the worker uses

    def _next_piece(self) -> None:
        self._exchange.timed.whole_within(self._stall_timeout_s, from_first_byte=True)

    def _decode(self, payload: bytes) -> T:
        try:
            return self._decoder.decode(payload)
        except msgspec.ValidationError as exc:
            raise self._engine.error(f"sent an event the worker cannot pass on ({self._engine.quote(str(exc))})") from None
        except msgspec.DecodeError:
            raise self._engine.error(f"sent an event that is not JSON: {self._engine.quote(repr(payload), 200)}") from None
        except RecursionError:
            raise self._engine.error("sent an event of JSON nested too deeply") from None

    def _readline(self) -> bytes | None:
        if self._closed.is_set():
            return None
        try:
            line = self._response.readline(MAX_LINE_BYTES + 1)
        except _Late as exc:
            if self._closed.is_set():
                return None
            if exc.whole:
                raise self._engine.stalled(
                    f"sent an event that was not whole within {self._stall_timeout_s:g} s of its first byte"
                ) from None
            raise self._engine.stalled(f"sent nothing for {self._stall_timeout_s:g} s in the middle of a stream") from None
        except Exception as exc:  # http.client raises odd errors (AttributeError too) when closed mid-read
            if self._closed.is_set():
                return None
            raise self._engine.error(f"broke the event stream ({self._engine.quote(repr(exc), 300)})") from None
        if len(line) > MAX_LINE_BYTES:
            raise self._engine.error(f"sent a line of more than {MAX_LINE_BYTES} bytes in its event stream")
        return line or None

    def close(self) -> None:
        """Stop the stream: the server sees the connection close."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._exchange.let_go()
        self._exchange.close()


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


def _status_error(
    address: EngineAddress, quote: Quoter, method: str, url: str, status: int, body: bytes
) -> EngineStatusError:
    decoded = _decoded(body)
    message = quote(_server_message(decoded, body))
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
        param = _server_param(decoded)
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


def _decoded(body: bytes) -> Any:
    """An error body as JSON, or None where it is not JSON."""
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None


def _server_param(decoded: Any) -> str | None:
    """The ``param`` an OpenAI-style error body names, if any."""
    error = decoded.get("error") if isinstance(decoded, dict) else None
    param = error.get("param") if isinstance(error, dict) else None
    return param if isinstance(param, str) else None


def _server_message(decoded: Any, body: bytes) -> str:
    """The message of an OpenAI-style error body, or the start of whatever the body is (the
    caller quotes it)."""
    error = decoded.get("error") if isinstance(decoded, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(error, str):  # vLLM's answer to a wrong API key: {"error": "Unauthorized"}
        return error
    if isinstance(decoded, dict) and isinstance(decoded.get("message"), str):  # vLLM's own endpoints
        return decoded["message"]
    if isinstance(decoded, dict) and isinstance(decoded.get("detail"), str):
        return decoded["detail"]
    return body[:4096].decode("utf-8", "replace").strip()
