"""A kept file of a model directory's int8 weights (int8_store.py says what it is and why), read
without torch: the file mapped, its header, every tensor's place and the checksum checked, and
each tensor a numpy view of the mapping. int8_store maps the views into torch's modules (after
holding each tensor to the shell model's); a load without torch reads them as they are.

    b"LMW8", format (u32), header length (u64), the header (UTF-8 JSON), zeros to a multiple
    of 64, the tensors' bytes (each at a multiple of 64 from the data's start)
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from worker.files import open_regular

MAGIC = b"LMW8"
FORMAT = 1
ALIGN = 64
MAX_HEADER = 16 << 20  # bytes of the header: a few hundred bytes a tensor
SUFFIX = ".lmw8"
DTYPES = ("uint8", "float16", "float32")  # the tensors' dtypes, numpy's (and torch's) names
PREFIX = struct.Struct("<4sIQ")
# int8_kernel.c's layout (fast_weights.Int8Linear): blocks of GROUP inputs; PANEL rows stored
# input-major together; the rows padded to a multiple of ITEM_ROWS, one of its work items
GROUP, PANEL, ITEM_ROWS = 32, 16, 64
# tensors the passes read a few rows at a time: the checksum's pages of them are let go after it
ROW_READ = ("model.embed_tokens.weight",)
PIECE = 16 << 20  # bytes checked at a time, so that no more of ROW_READ is resident at once


class StoreError(Exception):
    """A kept file that cannot serve (the message says why)."""


def int8_layout(in_features: int, out_features: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of an int8 linear's ``packed`` and ``scale`` for a linear of this size."""
    panels = (out_features + -out_features % ITEM_ROWS) // PANEL
    inputs = in_features + -in_features % GROUP
    return (panels, inputs // 4, PANEL, 4), (panels, inputs // GROUP, PANEL)


def path_of(data_dir: Path, key: str) -> Path:
    return data_dir / "int8" / f"{key}{SUFFIX}"


def read(path: Path, key: str) -> tuple[mmap.mmap, dict[str, np.ndarray]]:
    """The mapping of ``path`` and its tensors (read-only views of it, by name, in the file's
    order), checked whole: the key, each tensor's dtype, shape and place, and the checksum.
    Raises FileNotFoundError where there is none, StoreError for one that cannot serve."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StoreError(f"{path} cannot be read: {exc.strerror or exc}") from exc
    try:
        size = os.fstat(fd).st_size
        if size < PREFIX.size:
            raise StoreError(f"{path} is {size} bytes long, shorter than its header")
        data = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return data, _tensors(path, data, key)  # a mapping refused is closed when nothing holds it


def _tensors(path: Path, data: mmap.mmap, key: str) -> dict[str, np.ndarray]:
    magic, version, length = PREFIX.unpack_from(data, 0)
    if magic != MAGIC or version != FORMAT:
        raise StoreError(f"{path} is not a file of int8 weights of format {FORMAT} ({magic!r}, format {version})")
    if length > MAX_HEADER or PREFIX.size + length > len(data):
        raise StoreError(f"{path}'s header says {length} bytes, more than the file or {MAX_HEADER} holds")
    try:
        header = json.loads(bytes(data[PREFIX.size:PREFIX.size + length]))
        if header["key"] != key:
            raise StoreError(f"{path} holds the weights of {header['key']!r}, not of {key!r}")
        checksum, table = int(header["crc32c"]), dict(header["tensors"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"{path}'s header is not one this worker writes ({type(exc).__name__}: {exc})") from exc
    start = -(-(PREFIX.size + length) // ALIGN) * ALIGN
    views: dict[str, np.ndarray] = {}
    places: list[tuple[int, int, str]] = []
    for name, entry in table.items():
        if not (isinstance(entry, list) and len(entry) == 4 and entry[0] in DTYPES and isinstance(entry[1], list)
                and all(type(size) is int and 0 <= size < 1 << 40 for size in entry[1])):
            raise StoreError(f"{path}'s tensor {name} is {entry!r}, not a tensor of {', '.join(DTYPES)}")
        dtype, shape, offset, count = np.dtype(entry[0]), tuple(entry[1]), entry[2], entry[3]
        if count != int(np.prod(shape, dtype=object)) * dtype.itemsize:
            raise StoreError(f"{path}'s tensor {name} is {entry[0]} {list(shape)} in {count!r} bytes: misshapen")
        if not (type(offset) is int and offset >= 0 and offset % ALIGN == 0 and start + offset + count <= len(data)):
            raise StoreError(f"{path}'s tensor {name} lies at {offset!r} ({count!r} bytes), out of its place")
        places.append((offset, count, name))
        views[name] = np.frombuffer(data, np.uint8, count, start + offset).view(dtype).reshape(shape)
    end = 0
    for offset, count, name in sorted(places):
        if offset < end:
            raise StoreError(f"{path}'s tensor {name} overlaps the tensor before it")
        end = offset + count
    if start + end != len(data):
        raise StoreError(f"{path} is {len(data)} bytes long, where its tensors end at {start + end}: truncated or added to")
    from worker.kvcache.checksum import crc32c

    row_read = [(start + offset, count) for offset, count, name in places if name in ROW_READ]
    whole, crc = memoryview(data), 0
    for begin in range(start, len(data), PIECE):
        end = min(begin + PIECE, len(data))
        crc = crc32c(whole[begin:end], crc)
        _let_go(data, [(max(at, begin), min(at + count, end) - max(at, begin)) for at, count in row_read
                       if at < end and at + count > begin])
    if crc != checksum:
        raise StoreError(f"{path}'s checksum does not match its bytes: damaged")
    return views


def _let_go(data: mmap.mmap, spans: list[tuple[int, int]]) -> None:
    """Drop from the process the pages of ``spans`` that the checksum brought in (a float32
    embedding is the largest tensor of a small model's file, and a decode reads a row of it a
    token). The pages stay in the page cache; a row read again is mapped again from there."""
    page = mmap.PAGESIZE
    if not hasattr(mmap, "MADV_DONTNEED"):  # a platform without it keeps the pages
        return
    for begin, count in spans:
        first, last = -(-begin // page) * page, (begin + count) // page * page
        if last > first:
            data.madvise(mmap.MADV_DONTNEED, first, last - first)
