"""The stdio transport: the protocol stream's bytes in, parsed messages to the dispatcher, and
the dispatcher's replies out through the writer.

Threads: :meth:`StdioTransport.serve` (and ``feed``/``feed_eof``) run on the reader thread
(``lm-worker-reader``): bytes go through the sans-I/O codec (protocol/framing.py) and the
envelope (protocol/envelope.py), and each message goes to the :class:`Receiver` on that same
thread. The sending half (``send_result``, ``send_error``, ``send_notification``) is called
from any thread (the reader, the lanes, the cache I/O thread); it encodes the message there
and hands it to the :class:`~worker.writer.Writer`, whose own thread is the only code that
writes to stdout. ``python -m worker`` serves stdin and stdout; an in-process worker
(worker/host.py) serves a pair of pipes through this same code.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import msgspec

from protocol.envelope import (
    Incoming,
    Rejected,
    RequestId,
    encode_error,
    encode_notification,
    encode_result,
    parse_incoming,
)
from protocol.errors import RpcError
from protocol.framing import Frame, FrameDecoder, FramingError
from worker.transcript import Recorder
from worker.writer import Writer

READ_BYTES = 1 << 16


class Receiver(Protocol):
    """What the transport feeds (worker/dispatcher.py's Dispatcher)."""

    @property
    def accepting(self) -> bool:
        """False once no more input should be read (the session is ending)."""
        ...

    def receive(self, message: Incoming) -> None:
        """One message, in the order it arrived; a frame the codec refused comes as ``Rejected``."""
        ...

    def input_ended(self) -> None:
        """The end of input: nothing more will arrive."""
        ...


class StdioTransport:
    def __init__(self, writer: Writer, *, max_message_bytes: int, recorder: Recorder | None = None) -> None:
        self._writer = writer
        self._decoder = FrameDecoder(max_message_bytes)
        self._recorder = recorder

    # --- sending (worker/responder.py's Replies) -----------------------------------

    def send_result(self, msg_id: RequestId, result: Any) -> None:
        """Raises what encoding ``result`` raises, before anything is sent."""
        self._writer.send(encode_result(msg_id, result))

    def send_error(self, msg_id: RequestId | None, error: RpcError) -> None:
        self._writer.send(encode_error(msg_id, error))

    def send_notification(self, method: str, params: msgspec.Struct) -> None:
        self._writer.send(encode_notification(method, params))

    # --- receiving ----------------------------------------------------------------

    def serve(self, fd: int, receiver: Receiver) -> None:
        """Feed ``receiver`` what arrives on ``fd`` until the end of input, or until it stops
        accepting."""
        while True:
            try:
                data = os.read(fd, READ_BYTES)
            except OSError:
                data = b""
            if not data:
                self.feed_eof(receiver)
                return
            if not self.feed(data, receiver):
                return

    def feed(self, data: bytes, receiver: Receiver) -> bool:
        """Handle bytes from the host; False once no more input should be read."""
        for event in self._decoder.feed(data):
            self._deliver(event, receiver)
            if not receiver.accepting:
                return False
        return True

    def feed_eof(self, receiver: Receiver) -> None:
        for event in self._decoder.feed_eof():
            self._deliver(event, receiver)
        receiver.input_ended()

    def _deliver(self, event: Frame | FramingError, receiver: Receiver) -> None:
        if not receiver.accepting:
            return
        if not isinstance(event, Frame):
            if self._recorder is not None:
                self._recorder.record_unframed(event.message)
            receiver.receive(Rejected(None, RpcError(event.kind, event.message, limit=event.limit)))
            return
        self._writer.adopt_framing(event.framing)
        if self._recorder is not None:
            self._recorder.record_in(event.body, event.framing.value)
        receiver.receive(parse_incoming(event.body))
