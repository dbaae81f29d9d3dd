"""Sans-I/O framing: bytes in, frames out; frames in, bytes out.

Each message is framed one of two ways, detected per message:

* NDJSON: a line that starts with ``{`` (or ``[``, so that a batch can be
  answered with a clear error) and ends at ``\\n``; a trailing ``\\r`` is dropped.
* LSP base protocol: a header block (``Content-Length: N``, optionally
  ``Content-Type``; names case-insensitive; lines end in ``\\r\\n`` or ``\\n``),
  an empty line, then exactly N bytes of body.

Anything else is garbage: one :class:`FramingError` is reported and the decoder
resynchronises at the next newline or the next ``Content-Length:`` header,
whichever comes first. A ``Content-Length:`` counts as a header there only where a
whole, well-formed header block starts with it: the same text inside a skipped
message (a JSON string, say) is passed over, so that resynchronising never reads
part of a skipped message as a header and swallows the well-formed message after
it. The decoder's output depends only on the bytes, never on how they were
chunked: every limit is applied at a fixed byte position.
"""

from __future__ import annotations

import enum
import re
from typing import Final

import msgspec

from protocol.errors import ErrorKind

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_HEADER_BYTES = 8 * 1024

_NON_WHITESPACE = re.compile(rb"[^ \t\r\n]")
_HEADER_END = re.compile(rb"\n\r?\n")  # the empty line after the last header
_RESYNC = re.compile(rb"\n|content-length:", re.IGNORECASE)
_CONTENT_LENGTH_HEADER = re.compile(rb"content-length:", re.IGNORECASE)
_CONTENT_LENGTH = b"content-length:"
_HEADER_STARTS = (_CONTENT_LENGTH, b"content-type:")
# A header block that a resynchronisation may start at, line by line: the Content-Length line,
# then other header lines, then the empty line. *_PART: what a line not yet ended may be.
_FIRST_LINE = re.compile(rb"content-length:[ \t]*[0-9]{1,20}[ \t]*\r?", re.IGNORECASE)
_FIRST_PART = re.compile(rb"content-length:[ \t]*(?:[0-9]{1,20}[ \t]*\r?)?", re.IGNORECASE)
_OTHER_LINE = re.compile(rb"[^\r\n:]+:[^\r\n]*\r?")
_OTHER_PART = re.compile(rb"[^\r\n:]*(?::[^\r\n]*)?\r?")


class Framing(enum.StrEnum):
    NDJSON = "ndjson"
    LSP = "lsp"


class Frame(msgspec.Struct, frozen=True):
    body: bytes
    framing: Framing


class FramingError(msgspec.Struct, frozen=True):
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
    SKIP_BODY = enum.auto()


class _Progress(enum.Enum):
    """A step that consumed input without completing an event."""

    PROGRESS = enum.auto()


_PROGRESS: Final = _Progress.PROGRESS


class FrameDecoder:
    """Feed bytes, get frames. Never raises on any input.

    Consumed input is tracked by an offset and dropped once per ``feed``, so
    many small messages in one large read cost linear time.
    """

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
        self._buf = bytearray()
        self._pos = 0  # start of the unconsumed input in _buf
        self._scan = 0  # bytes after _pos already searched for a terminator
        self._state = _State.IDLE
        self._body_length = 0
        self._closed = False

    def feed(self, data: bytes) -> list[Event]:
        if self._closed:
            raise RuntimeError("feed() after feed_eof()")
        self._buf += data
        events = self._drain()
        del self._buf[: self._pos]
        self._pos = 0
        return events

    def feed_eof(self) -> list[Event]:
        """Flush what is left: a final NDJSON line needs no newline."""
        self._closed = True  # from here on, no more bytes will complete a skip
        events = self._drain()
        rest = bytes(self._buf[self._pos :])
        self._buf, self._pos = bytearray(), 0
        if self._state is _State.LINE:
            events.append(self._line_frame(rest))
        elif self._state is _State.HEADERS:
            events.append(_parse_error("input ended inside a Content-Length header block"))
        elif self._state is _State.BODY:
            events.append(
                _parse_error(
                    f"input ended after {len(rest)} of the {self._body_length} body bytes "
                    "that Content-Length announced"
                )
            )
        elif self._state is _State.IDLE and rest:
            events.append(_garbage_error(rest[:1]))
        return events

    def _drain(self) -> list[Event]:
        events: list[Event] = []
        while True:
            step = self._step()
            if step is None:
                return events
            if step is not _PROGRESS:
                events.append(step)

    def _step(self) -> Event | _Progress | None:
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
            case _State.SKIP_BODY:
                return self._skip_body()

    def _enter(self, state: _State, consumed_to: int | None = None) -> _Progress:
        if consumed_to is not None:
            self._pos = consumed_to
        self._state, self._scan = state, 0
        return _PROGRESS

    def _idle(self) -> Event | _Progress | None:
        buf = self._buf
        start = _NON_WHITESPACE.search(buf, self._pos)
        if start is None:
            self._pos = len(buf)
            return None
        self._pos = start.start()
        if buf[self._pos] in b"{[":
            return self._enter(_State.LINE)
        head = bytes(buf[self._pos : self._pos + len(_CONTENT_LENGTH)]).lower()
        for name in _HEADER_STARTS:
            if head[: len(name)] == name[: len(head)]:
                if len(head) < len(name):
                    return None  # could still become a header: wait
                return self._enter(_State.HEADERS)
        self._enter(_State.SKIP)
        return _garbage_error(bytes(buf[self._pos : self._pos + 1]))

    def _line(self) -> Event | _Progress | None:
        buf, pos, limit = self._buf, self._pos, self.max_message_bytes
        end = buf.find(b"\n", pos + self._scan, pos + limit + 1)
        if end < 0:
            if len(buf) - pos <= limit:
                self._scan = len(buf) - pos
                return None
            self._enter(_State.SKIP, pos + limit + 1)
            return _too_large(f"a JSON line longer than {limit} bytes", limit)
        line = bytes(buf[pos:end])
        self._enter(_State.IDLE, end + 1)
        return self._line_frame(line)

    @staticmethod
    def _line_frame(line: bytes) -> Frame:
        return Frame(line[:-1] if line.endswith(b"\r") else line, Framing.NDJSON)

    def _headers(self) -> Event | _Progress | None:
        buf, pos = self._buf, self._pos
        # A block is accepted only if it ends within MAX_HEADER_BYTES + 1 bytes,
        # so whole and byte-by-byte input agree on where the limit bites.
        found = _HEADER_END.search(buf, pos + self._scan)
        if found is None or found.end() - pos > MAX_HEADER_BYTES + 1:
            if len(buf) - pos <= MAX_HEADER_BYTES:
                self._scan = max(0, len(buf) - pos - 2)  # a terminator may straddle feeds
                return None
            self._enter(_State.SKIP, pos + MAX_HEADER_BYTES + 1)
            return _parse_error(f"header block longer than {MAX_HEADER_BYTES} bytes without an empty line")
        block = bytes(buf[pos : found.start()])
        length, error = self._content_length(block)
        if error is not None:
            # An over-limit body is skipped by its length, so none of it can run as a request.
            self._body_length = length or 0
            self._enter(_State.SKIP_BODY if length else _State.SKIP, found.end())
            return error
        self._body_length = length
        return self._enter(_State.BODY, found.end())

    def _content_length(self, block: bytes) -> tuple[int, FramingError | None]:
        """The announced length, and an error if the block is bad (length 0 then)
        or the length is over the limit."""
        length: int | None = None
        for raw_line in block.split(b"\n"):
            name, sep, value = raw_line.rstrip(b"\r").partition(b":")
            if not sep:
                return 0, _parse_error(f"malformed header line {raw_line[:64]!r}; expected 'Name: value'")
            if name.strip().lower() != b"content-length":
                continue  # Content-Type and unknown headers carry nothing we need
            value = value.strip()
            if not value.isdigit() or len(value) > 20:
                return 0, _parse_error(f"Content-Length must be a non-negative integer, got {value[:32]!r}")
            length = int(value)
        if length is None:
            return 0, _parse_error("header block without a Content-Length header")
        if length > self.max_message_bytes:
            return length, _too_large(f"Content-Length {length}", self.max_message_bytes)
        return length, None

    def _body(self) -> Event | None:
        pos, end = self._pos, self._pos + self._body_length
        if len(self._buf) < end:
            return None
        body = bytes(self._buf[pos:end])
        self._enter(_State.IDLE, end)
        return Frame(body, Framing.LSP)

    def _skip_body(self) -> _Progress | None:
        """Skip an over-limit body by its length; a header block that starts inside it ends
        the skip early, so that a lying length cannot swallow the stream."""
        buf, pos, remaining = self._buf, self._pos, self._body_length
        stop, start = min(len(buf), pos + remaining + len(_CONTENT_LENGTH) - 1), pos
        while (header := _CONTENT_LENGTH_HEADER.search(buf, start, stop)) is not None:
            whole = self._header_block_at(header.start())
            if whole is None:  # it may be one: wait for the bytes that decide
                self._pos, self._body_length = header.start(), remaining - (header.start() - pos)
                return None
            if whole:
                return self._enter(_State.IDLE, header.start())
            start = header.start() + 1
        if self._closed or len(buf) >= pos + remaining + len(_CONTENT_LENGTH) - 1:
            return self._enter(_State.IDLE, min(len(buf), pos + remaining))
        # keep the bytes that could still start a header within the body
        consumed = max(0, min(remaining, len(buf) - pos - (len(_CONTENT_LENGTH) - 1)))
        self._pos, self._body_length = pos + consumed, remaining - consumed
        return None

    def _skip(self) -> _Progress | None:
        start = self._pos
        while (found := _RESYNC.search(self._buf, start)) is not None:
            if found.group() == b"\n":
                return self._enter(_State.IDLE, found.end())
            whole = self._header_block_at(found.start())
            if whole is None:  # it may be one: wait for the bytes that decide
                self._pos = found.start()
                return None
            if whole:
                return self._enter(_State.IDLE, found.start())
            start = found.start() + 1
        # keep a possible partial "Content-Length:" that the next feed completes
        self._pos = max(self._pos, len(self._buf) - (len(_CONTENT_LENGTH) - 1))
        return None

    def _header_block_at(self, start: int) -> bool | None:
        """Whether a whole, well-formed header block starts at ``start`` (a "Content-Length:"):
        its Content-Length line, any other header lines, the empty line, within MAX_HEADER_BYTES
        + 1 bytes as _headers takes them. None while the bytes to decide have not all arrived."""
        buf, limit, line_start, first = self._buf, start + MAX_HEADER_BYTES + 1, start, True
        while True:
            end = buf.find(b"\n", line_start, limit)
            if end < 0:
                line = bytes(buf[line_start : min(len(buf), limit)])
                may_grow = len(buf) < limit and not self._closed
                return None if may_grow and (_FIRST_PART if first else _OTHER_PART).fullmatch(line) else False
            line = bytes(buf[line_start:end])
            if not first and line in (b"", b"\r"):
                return True
            if not (_FIRST_LINE if first else _OTHER_LINE).fullmatch(line):
                return False
            line_start, first = end + 1, False


def encode_frame(body: bytes, framing: Framing) -> bytes:
    if framing is Framing.LSP:
        return b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    return body + b"\n"


def _parse_error(message: str) -> FramingError:
    return FramingError(ErrorKind.PARSE_ERROR, f"Parse error: {message}.")


def _garbage_error(first: bytes) -> FramingError:
    return _parse_error(
        f"input starting with {first!r} is neither a JSON object on one line nor a "
        "Content-Length framed message; send one JSON-RPC object per line (skipped to the next line or Content-Length header)"
    )


def _too_large(what: str, limit: int) -> FramingError:
    return FramingError(
        ErrorKind.MESSAGE_TOO_LARGE,
        f"Message too large: {what} exceeds the limit of {limit} bytes; send a smaller message "
        "or start the worker with a larger --max-message-bytes (the message was skipped).",
        limit,
    )
