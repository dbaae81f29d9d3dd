"""Transcripts: every message in and out of a session, one JSON object per line.

The first line is a header::

    {"transcript": 1, "worker_version": "0.1.0", "args": ["--max-message-bytes", "4096"]}

then one line per message, in the order the worker saw or wrote them::

    {"t": 12.5, "dir": "in", "msg": {"jsonrpc": "2.0", "id": 1, "method": "capabilities"}}
    {"t": 13.1, "dir": "out", "msg": {"jsonrpc": "2.0", "id": 1, "result": {...}}}

``t`` is milliseconds since the worker started. An incoming frame that is not
valid JSON is kept as text under ``raw`` instead of ``msg``; ``"framing":
"lsp"`` marks a message that came with a Content-Length header. Input that was
not a frame at all is noted as ``unframed`` (the reason); its bytes are not
kept, so a hand-written transcript gives them under ``send`` instead.
docs/TRANSCRIPTS.md describes how a transcript is replayed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Literal

import msgspec

FORMAT_VERSION = 1
log = logging.getLogger(__name__)


class Header(msgspec.Struct, kw_only=True):
    transcript: int
    worker_version: str
    args: list[str] = []


class Entry(msgspec.Struct, kw_only=True, omit_defaults=True):
    t: float = 0.0
    dir: Literal["in", "out"]
    msg: Any = None  # a JSON message
    raw: str | None = None  # a frame whose body is not JSON
    send: str | None = None  # exact input text (hand-written transcripts)
    unframed: str | None = None  # input that was not a frame: the worker's reason
    framing: Literal["ndjson", "lsp"] = "ndjson"


class Recorder:
    """Writes the transcript as the worker runs. A transcript that cannot grow (a full disk, a
    file-size limit) ends recording, said once on stderr, and cut back to its last whole line;
    the worker serves on: a recording must never cost the host its answers."""

    def __init__(self, path: str, *, worker_version: str, args: list[str]) -> None:
        self.path = path
        # Opened without waiting: a FIFO that nobody reads is refused (ENXIO), never waited on.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        os.set_blocking(fd, True)
        self._file = open(fd, "wb", buffering=0)  # noqa: SIM115 - lives as long as the worker
        self._written = 0  # bytes of whole lines in the file
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._write(msgspec.json.encode(Header(transcript=FORMAT_VERSION, worker_version=worker_version, args=args)))

    def record_in(self, body: bytes, framing: Literal["ndjson", "lsp"]) -> None:
        try:
            entry = Entry(t=self._now(), dir="in", msg=msgspec.json.decode(body), framing=framing)
        except msgspec.DecodeError:
            entry = Entry(t=self._now(), dir="in", raw=body.decode("utf-8", "backslashreplace"), framing=framing)
        self._write(msgspec.json.encode(entry))

    def record_unframed(self, reason: str) -> None:
        self._write(msgspec.json.encode(Entry(t=self._now(), dir="in", unframed=reason)))

    def record_out(self, body: bytes) -> None:
        # Outgoing bodies are compact JSON already: splice them in without re-encoding.
        self._write(b'{"t":%.3f,"dir":"out","msg":%s}' % (self._now(), body))

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def _now(self) -> float:
        return round((time.perf_counter() - self._t0) * 1000.0, 3)

    def _write(self, line: bytes) -> None:
        with self._lock:
            if self._file.closed:
                return
            view = memoryview(line + b"\n")
            try:
                while view:
                    view = view[self._file.write(view) :]
            except OSError as exc:
                log.error("recording stopped: cannot write %s (%s); the worker goes on without it",
                          self.path, exc.strerror or exc)
                with contextlib.suppress(OSError):  # a half-written line would end the transcript unreadably
                    os.ftruncate(self._file.fileno(), self._written)
                self._file.close()
                return
            self._written += len(line) + 1


def read(path: str | os.PathLike[str]) -> tuple[Header, list[Entry]]:
    with open(path, "rb") as file:
        lines = file.read().splitlines()
    header = msgspec.json.decode(lines[0], type=Header)
    if header.transcript != FORMAT_VERSION:
        raise ValueError(f"{path}: transcript format {header.transcript}, this worker reads {FORMAT_VERSION}")
    return header, [msgspec.json.decode(line, type=Entry) for line in lines[1:] if line.strip()]
