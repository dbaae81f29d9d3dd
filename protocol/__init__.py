"""The lm-worker wire protocol: pure types, errors and framing. No I/O, no torch."""

from protocol.errors import ErrorKind, RpcError
from protocol.framing import Frame, FrameDecoder, Framing, FramingError, encode_frame
from protocol.methods import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "ErrorKind",
    "Frame",
    "FrameDecoder",
    "Framing",
    "FramingError",
    "RpcError",
    "encode_frame",
]
