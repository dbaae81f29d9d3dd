"""The one piece of code that writes to the protocol stream.

Producers (the transport's sending half, called from the reader, the lanes and the cache I/O
thread) hand encoded message bodies to :meth:`Writer.send`; a single thread,
``lm-worker-writer``, frames them and writes them to the private stdout descriptor. The
buffer between them is bounded: when the host stops reading, ``send`` blocks, so a
generation waits instead of growing memory.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from protocol.framing import Framing, encode_frame
from worker.transcript import Recorder

DEFAULT_OUTBOX_MESSAGES = 1024


class Writer:
    def __init__(
        self,
        fd: int,
        *,
        capacity: int = DEFAULT_OUTBOX_MESSAGES,
        framing: Framing | None = None,
        recorder: Recorder | None = None,
        on_broken: Callable[[], None] = lambda: None,
    ) -> None:
        self.capacity = capacity
        self._fd = fd
        self._framing = framing
        self._recorder = recorder
        self._on_broken = on_broken
        self._pending: list[bytes] = []  # framed messages
        self._bodies: list[bytes] = []  # the same messages unframed, kept only for the recorder
        lock = threading.Lock()
        self._has_data = threading.Condition(lock)  # the writer thread waits here when idle
        self._has_room = threading.Condition(lock)  # producers wait here when the outbox is full
        self._writer_idle = False
        self._closing = False
        self._broken = False
        self._thread = threading.Thread(target=self._run, name="lm-worker-writer", daemon=True)
        self._thread.start()

    @property
    def framing(self) -> Framing | None:
        return self._framing

    def adopt_framing(self, framing: Framing) -> None:
        """Replies use the framing of the first message received, unless forced."""
        if self._framing is None:
            self._framing = framing

    def send(self, body: bytes) -> None:
        """Queue one encoded message; blocks while the outbox is full.

        The framing is fixed here, in the order messages are sent, so that a
        reply sent before the framing was known keeps the default."""
        frame = encode_frame(body, self._framing or Framing.NDJSON)
        with self._has_room:
            while len(self._pending) >= self.capacity and not self._broken:
                self._has_room.wait()
            if self._broken:
                return  # nobody is reading: drop, the worker is shutting down
            self._pending.append(frame)
            if self._recorder is not None:
                self._bodies.append(body)
            if self._writer_idle:  # waking the writer only when it sleeps keeps streaming cheap
                self._writer_idle = False
                self._has_data.notify()

    def close(self, timeout: float) -> None:
        """Write what is queued, then stop."""
        with self._has_data:
            self._closing = True
            self._has_data.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._has_data:
                while not self._pending and not self._closing:
                    self._writer_idle = True
                    self._has_data.wait()
                self._writer_idle = False
                batch, self._pending = self._pending, []
                bodies, self._bodies = self._bodies, []
                self._has_room.notify_all()
                if not batch and self._closing:
                    return
            if not self._write_all(b"".join(batch)):
                return
            if self._recorder is not None:
                for body in bodies:
                    self._recorder.record_out(body)

    def _write_all(self, data: bytes) -> bool:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            with self._has_room:
                self._broken = True
                self._pending.clear()
                self._has_room.notify_all()
            self._on_broken()
            return False
        return True
