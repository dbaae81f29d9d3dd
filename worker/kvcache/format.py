"""KVC3: the file format of a persistent KV prompt cache, its Structs and its errors. Torch-free.

Layout (docs/CACHE_FORMAT.md is the byte-level specification)::

    magic            8 bytes   b"KVC3\\r\\n\\x1a\\n" (KVC2: b"KVC2\\r\\n\\x1a\\n")
    header_length    8 bytes   unsigned little-endian
    header_sha256   32 bytes   of the header bytes
    header           JSON, UTF-8, header_length bytes
    zero padding     to the next multiple of ALIGNMENT
    tensors          each at an ALIGNMENT-aligned offset, zero padding between

The header describes every layer of the model (full attention, sliding window,
linear-attention state, or none) and names every tensor with its offset, size
and CRC: CRC-32C in KVC3 (checksum.py, the processor's instructions), CRC-32 in
KVC2, the format before, which is read as well (and written where CRC-32C cannot be
computed fast).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable
from typing import Literal

import msgspec

from worker.kvcache import checksum

try:  # ISA-L's CRC-32 is zlib's, computed several times as fast (carry-less multiplies)
    from isal.isal_zlib import crc32  # pyright: ignore[reportUnknownVariableType] (its stub leaves data untyped)
except ImportError:  # a platform without its wheels
    from zlib import crc32

MAGIC = b"KVC3\r\n\x1a\n"
FORMAT = "KVC3"
# The formats read and written, by magic: KVC3 checksums tensors with CRC-32C, KVC2 (the same
# layout) with CRC-32; a writer takes KVC2 where CRC-32C has no fast kernel (checksum.py).
FORMATS = {MAGIC: FORMAT, b"KVC2\r\n\x1a\n": "KVC2"}
CHECKSUMS: dict[str, Callable[[memoryview, int], int]] = {
    "KVC3": checksum.crc32c,
    "KVC2": crc32,  # pyright: ignore[reportUnknownArgumentType]
}
# Files of earlier formats are recognised, listed and refused as written for another identity.
OLD_MAGICS = {b"KVC1\r\n\x1a\n": "KVC1"}
ALIGNMENT = 64
LAYOUT = "layer-major-k-then-v"
PREFIX = struct.Struct("<8sQ32s")  # magic, header length, header sha256
# A header holds the token ids (about 7 bytes each): 16 MiB is two million tokens and more.
# Listing reads every header on the reader thread, so a made-up length must not cost seconds.
MAX_HEADER_BYTES = 16 << 20
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class CacheFormatError(Exception):
    """The file is not a sound KVC3 (or KVC2) cache. ``reason`` says what is wrong, for a person."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{os.fspath(path)}: {reason}")
        self.path = os.fspath(path)
        self.reason = reason


class CacheMissing(CacheFormatError):
    """There is no file (any more): another process may have deleted it since it was listed."""


class IdentityMismatch(Exception):
    """A sound cache computed by another model, tokenizer, configuration or file format."""

    def __init__(self, path: str | os.PathLike[str], field: str, expected: object, found: object) -> None:
        super().__init__(f"{os.fspath(path)}: {field} is {found!r} in the cache, {expected!r} here")
        self.path = os.fspath(path)
        self.field = field
        self.expected = expected
        self.found = found


class Identity(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What must match for a cache to be valid for a model: all of it. The digests cover
    every byte of the weights and tokenizer files and the whole resolved configuration;
    the other fields repeat parts of them so that a mismatch can be named plainly."""

    model_id: str
    weights_sha256: str  # of every weights file, in full
    tokenizer_sha256: str  # of the tokenizer's files and its chat template, in full
    rope_theta: float | None
    config_sha256: str  # of the model's configuration as transformers resolves it
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    quantization: str = "none"  # of the weights (the load param); files from before it was recorded: none
    layout: str = LAYOUT
    cache_class: str
    attention_type: str  # "full", "sliding", "linear" or "hybrid": the kinds of layers there are


LayerKind = Literal["full", "sliding", "linear", "full+linear", "sliding+linear", "none"]
TensorKind = Literal["key", "value", "conv", "recurrent"]

class LayerEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One layer of the model. Layers with keys and values hold them for every position of
    the sequence, sliding-window layers too (they attend to their window only); layers with
    a linear-attention state hold it at each checkpoint position (``states``)."""

    index: int
    kind: LayerKind
    sliding_window: int | None = None


class StateEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A linear-attention state (conv and/or recurrent tensors) of one layer after ``position`` tokens."""

    layer: int
    state: int  # a layer may keep several states
    position: int
    has_previous_state: bool


class TensorEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    kind: TensorKind
    layer: int
    state: int = 0  # for conv and recurrent tensors: which state of the layer
    position: int | None = None  # for conv and recurrent tensors: the StateEntry's position
    shape: list[int]
    strides: list[int]  # in bytes, C order
    offset: int  # from the start of the file
    nbytes: int
    dtype: str
    crc32: int  # the format's CRC of the tensor's bytes: CRC-32C in KVC3, CRC-32 in KVC2


class Header(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: str
    identity: Identity
    sequence_start: int
    sequence_length: int
    tokens: list[int]
    prefix_offsets: list[int]
    prefix_hashes: list[str]
    layers: list[LayerEntry]
    states: list[StateEntry]
    tensors: list[TensorEntry]
    created_by: str

    @property
    def resume_points(self) -> list[int] | None:
        """The prefix lengths this cache can be cut back to: None when any (every layer
        keeps every position), else 0 and the positions of its stored states."""
        if not self.states:
            return None
        return sorted({0, *(entry.position for entry in self.states)})


class UnsupportedCache(Exception):
    """A cache whose layers a KVC3 file cannot represent."""


def cut_point(resume_points: list[int] | None, tokens: int) -> int:
    """The longest prefix of at most ``tokens`` positions that a cache with these resume points
    can be cut back to (None: any)."""
    return tokens if resume_points is None else max(p for p in resume_points if p <= tokens)


class OldIdentity(msgspec.Struct, frozen=True):
    model_id: str


class OldHeader(msgspec.Struct, frozen=True):
    """What cache/list shows of a file of an earlier format; it is never used."""

    format: str
    identity: OldIdentity
    tokens: list[int]
    prefix_offsets: list[int] = []
    prefix_hashes: list[str] = []
    created_by: str = ""


class OutdatedCache(Exception):
    """A file of an earlier format: written for another identity, so never used."""

    def __init__(self, path: str | os.PathLike[str], header: OldHeader) -> None:
        super().__init__(f"{os.fspath(path)}: a {header.format} cache, this worker reads {FORMAT}")
        self.path = os.fspath(path)
        self.header = header


class TensorSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A tensor to write: its description and a C-contiguous buffer of its bytes."""

    name: str
    kind: TensorKind
    layer: int
    shape: tuple[int, ...]
    dtype: str
    state: int = 0
    position: int | None = None


class Contents(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a cache file holds but the layout of its bytes."""

    identity: Identity
    tokens: list[int]
    layers: list[LayerEntry]
    states: list[StateEntry] = []
    sequence_start: int = 0
    prefix_offsets: list[int] = []
    prefix_hashes: list[str] = []
    created_by: str = "lm-worker"


def align(n: int) -> int:
    """``n`` rounded up to a multiple of ALIGNMENT (where a tensor may start)."""
    return -(-n // ALIGNMENT) * ALIGNMENT


def c_strides(shape: Iterable[int], itemsize: int) -> list[int]:
    """The byte strides of a C-order tensor of ``shape``."""
    strides: list[int] = []
    step = itemsize
    for size in reversed(list(shape)):
        strides.append(step)
        step *= size
    return strides[::-1]
