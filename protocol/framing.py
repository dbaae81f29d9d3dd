"""Sans-I/O framing: bytes in, frames out; frames in, bytes out.

Each message is framed one of two ways, detected per message:

* NDJSON: a line that starts with ``{`` (or ``[``, so that a batch can be
  answered with a clear error) and ends at ``\\n``; a trailing ``\\r`` is dropped.
* LSP base protocol: a header block (``Content-Length: N``, optionally
  ``Content-Type``; names case-insensitive; lines end in ``\\r\\n`` or ``\\n``),
  an empty line, then exactly N bytes of body.

Anything else is garbage: one :class:`FramingError` is reported and the decoder
resynchronises at the next newline or the next ``Content-Length:`` header,
whichever comes first. The decoder's output depends only on the bytes, never
on how they were chunked: every limit is applied at a fixed byte position.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from protocol.errors import ErrorKind

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_HEADER_BYTES = 8 * 1024

_WHITESPACE = b" \t\r\n"
_CONTENT_LENGTH = b"content-length:"
_HEADER_STARTS = (_CONTENT_LENGTH, b"content-type:")


class Framing(enum.StrEnum):
    NDJSON = "ndjson"
    LSP = "lsp"


@dataclass(frozen=True, slots=True)
class Frame:
    body: bytes
    framing: Framing


@dataclass(frozen=True, slots=True)
class FramingError:
    kind: ErrorKind
    message: str
    limit: int | None = None


Event = Frame | FramingError


class _State(enum.Enum):
    IDLE = enum.auto()
    LINE = enum.auto()
    HEADERS = enum.auto()
    BODY = enum.auto()
    SKIP = enum.auto()


_PROGRESS = object()


class FrameDecoder:
    """Feed bytes, get frames. Never raises on any input."""

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
        self._buf = bytearray()
        self._state = _State.IDLE
        self._scan_from = 0
        self._body_length = 0
        self._closed = False

    def feed(self, data: bytes) -> list[Event]:
        if self._closed:
            raise RuntimeError("feed() after feed_eof()")
        self._buf += data
        return self._drain()

    def feed_eof(self) -> list[Event]:
        """Flush what is left: a final NDJSON line needs no newline."""
        events = self._drain()
        self._closed = True
        buf, self._buf = bytes(self._buf), bytearray()
        if self._state is _State.LINE:
            events.append(self._line_frame(buf))
        elif self._state is _State.HEADERS:
            events.append(_parse_error("input ended inside a Content-Length header block"))
        elif self._state is _State.BODY:
            events.append(
                _parse_error(
                    f"input ended after {len(buf)} of the {self._body_length} body bytes "
                    "that Content-Length announced"
                )
            )
        elif self._state is _State.IDLE and buf:
            events.append(_garbage_error(buf[:1]))
        return events

    def _drain(self) -> list[Event]:
        events: list[Event] = []
        while True:
            step = self._step()
            if step is None:
                return events
            if step is not _PROGRESS:
                events.append(step)

    def _step(self) -> Event | object | None:
        match self._state:
            case _State.IDLE:
                return self._idle()
            case _State.LINE:
                return self._line()
            case _State.HEADERS:
                return self._headers()
            case _State.BODY:
                return self._body()
            case _State.SKIP:
                return self._skip()

    def _idle(self) -> Event | object | None:
        buf = self._buf
        start = len(buf) - len(buf.lstrip(_WHITESPACE))
        if start:
            del buf[:start]
        if not buf:
            return None
        if buf[0] in b"{[":
            self._state, self._scan_from = _State.LINE, 0
            return _PROGRESS
        head = bytes(buf[: len(_CONTENT_LENGTH)]).lower()
        for name in _HEADER_STARTS:
            if head[: len(name)] == name[: len(head)]:
                if len(head) < len(name):
                    return None  # could still become a header: wait
                self._state, self._scan_from = _State.HEADERS, 0
                return _PROGRESS
        self._state = _State.SKIP
        return _garbage_error(bytes(buf[:1]))

    def _line(self) -> Event | object | None:
        buf, limit = self._buf, self.max_message_bytes
        end = buf.find(b"\n", self._scan_from, limit + 1)
        if end < 0:
            if len(buf) <= limit:
                self._scan_from = len(buf)
                return None
            del buf[: limit + 1]
            self._state = _State.SKIP
            return _too_large(f"a JSON line longer than {limit} bytes", limit)
        line = bytes(buf[:end])
        del buf[: end + 1]
        self._state = _State.IDLE
        return self._line_frame(line)

    @staticmethod
    def _line_frame(line: bytes) -> Frame:
        return Frame(line[:-1] if line.endswith(b"\r") else line, Framing.NDJSON)

    def _headers(self) -> Event | object | None:
        buf = self._buf
        ends = [i for i in (buf.find(b"\n\n", self._scan_from), buf.find(b"\n\r\n", self._scan_from)) if i >= 0]
        # A block is accepted only if it ends within MAX_HEADER_BYTES + 1 bytes,
        # so whole and byte-by-byte input agree on where the limit bites.
        end = min(ends, default=-1)
        sep_len = 2 if buf[end + 1 : end + 2] == b"\n" else 3
        if end < 0 or end + sep_len > MAX_HEADER_BYTES + 1:
            if len(buf) <= MAX_HEADER_BYTES:
                self._scan_from = max(0, len(buf) - 2)
                return None
            del buf[: MAX_HEADER_BYTES + 1]
            self._state = _State.SKIP
            return _parse_error(f"header block longer than {MAX_HEADER_BYTES} bytes without an empty line")
        block = bytes(buf[:end])
        del buf[: end + sep_len]
        length_or_error = self._content_length(block)
        if isinstance(length_or_error, FramingError):
            self._state = _State.SKIP
            return length_or_error
        self._state, self._body_length = _State.BODY, length_or_error
        return _PROGRESS

    def _content_length(self, block: bytes) -> int | FramingError:
        length: int | None = None
        for raw_line in block.split(b"\n"):
            name, sep, value = raw_line.rstrip(b"\r").partition(b":")
            if not sep:
                return _parse_error(f"malformed header line {raw_line[:64]!r}; expected 'Name: value'")
            if name.strip().lower() != b"content-length":
                continue  # Content-Type and unknown headers carry nothing we need
            value = value.strip()
            if not value.isdigit() or len(value) > 20:
                return _parse_error(f"Content-Length must be a non-negative integer, got {value[:32]!r}")
            length = int(value)
        if length is None:
            return _parse_error("header block without a Content-Length header")
        if length > self.max_message_bytes:
            return _too_large(f"Content-Length {length}", self.max_message_bytes)
        return length

    def _body(self) -> Event | None:
        if len(self._buf) < self._body_length:
            return None
        body = bytes(self._buf[: self._body_length])
        del self._buf[: self._body_length]
        self._state = _State.IDLE
        return Frame(body, Framing.LSP)

    def _skip(self) -> object | None:
        buf = self._buf
        lowered = bytes(buf).lower()
        newline, header = lowered.find(b"\n"), lowered.find(_CONTENT_LENGTH)
        if header >= 0 and (newline < 0 or header < newline):
            del buf[:header]
        elif newline >= 0:
            del buf[: newline + 1]
        else:
            keep = len(_CONTENT_LENGTH) - 1  # a header may be split across feeds
            if len(buf) > keep:
                del buf[:-keep]
            return None
        self._state = _State.IDLE
        return _PROGRESS


def encode_frame(body: bytes, framing: Framing) -> bytes:
    if framing is Framing.LSP:
        return b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    return body + b"\n"


def _parse_error(message: str) -> FramingError:
    return FramingError(ErrorKind.PARSE_ERROR, f"Parse error: {message}.")


def _garbage_error(first: bytes) -> FramingError:
    return _parse_error(
        f"input starting with {first!r} is neither a JSON object on one line nor a "
        "Content-Length framed message; send one JSON-RPC object per line (skipped to the next line)"
    )


def _too_large(what: str, limit: int) -> FramingError:
    return FramingError(
        ErrorKind.MESSAGE_TOO_LARGE,
        f"Message too large: {what} exceeds the limit of {limit} bytes; send a smaller message "
        "or start the worker with a larger --max-message-bytes (the message was skipped).",
        limit,
    )
