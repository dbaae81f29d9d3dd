"""Reading a cache file: its header alone (``read_header``), or all of it verified into memory
of the reader's own (``load``). Torch-free.

Any damaged byte is found: the header by its SHA-256 (and its fields against each other,
validate.py), padding by being zero, tensors by their CRC, and the file by its exact expected
size. A file of an earlier format (KVC1) is recognised, its header read for listing, and never
used. Tensors are read with preadv into memory.py's memory, where a reader may ask for room to
grow after each key and value tensor's positions, and handed out as memoryviews of it; the
pages under a view are given back once nothing uses it any more.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import mmap
import os
import threading
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Literal, NamedTuple

import msgspec

from worker.files import NotRegularFile, open_regular
from worker.kvcache import checksum, memory
from worker.kvcache.format import (
    ALIGNMENT, CHECKSUMS, DTYPE_SIZES, FORMAT, FORMATS, LAYOUT, MAX_HEADER_BYTES, OLD_MAGICS, PREFIX, CacheFormatError,
    CacheMissing, Header, Identity, IdentityMismatch, OldHeader, OutdatedCache, TensorEntry, align,
)
from worker.kvcache.validate import check_identity, manifest_problem

# Reads and the CRC let go of the GIL on large buffers, so tensors are checked on several threads;
# beyond a few, memory bandwidth is the limit.
CHECK_THREADS = min(8, os.cpu_count() or 1)
# Bytes read and then checked at a time: small enough to stay in a core's own cache in between.
READ_PIECE = 256 << 10
# Buffers one preadv may take (POSIX promises at least 16).
IOV_MAX = max(16, os.sysconf("SC_IOV_MAX")) if "SC_IOV_MAX" in os.sysconf_names else 16


def read_header(path: str | os.PathLike[str]) -> Header:
    """The header, verified, without touching the tensors (for listing and info).
    Raises OutdatedCache for a file of an earlier format."""
    with _open_regular(path) as fd:
        prefix, header_bytes = _read_prefix_and_header(path, fd)
    return _parse_header(path, prefix, header_bytes)


@contextlib.contextmanager
def _open_regular(path: str | os.PathLike[str]) -> Generator[int]:
    """A descriptor of ``path`` if it is a regular file (following symbolic links). Opening
    never blocks (a FIFO named like a cache would wait for a writer forever) and anything
    that is not a regular file is refused as not a cache."""
    try:
        fd = open_regular(path)
    except FileNotFoundError as exc:
        raise CacheMissing(path, "cannot be read: no such file") from exc
    except NotRegularFile as exc:
        raise CacheFormatError(path, "not a regular file (a FIFO, device or directory named like a cache)") from exc
    except OSError as exc:  # a symbolic link loop, no permission, ...
        raise CacheFormatError(path, f"cannot be read: {exc.strerror or exc}") from exc
    try:
        yield fd
    finally:
        os.close(fd)


def _pread(path: str | os.PathLike[str], fd: int, size: int, offset: int) -> bytes:
    try:
        return os.pread(fd, size, offset)
    except OSError as exc:
        raise CacheFormatError(path, f"cannot be read: {exc.strerror or exc}") from exc


def _read_prefix_and_header(path: str | os.PathLike[str], fd: int) -> tuple[bytes, bytes]:
    """The fixed prefix and the bytes it says the header takes (fewer where the file ends first)."""
    prefix = _pread(path, fd, PREFIX.size, 0)
    return prefix, _pread(path, fd, _check_prefix(path, prefix), PREFIX.size)


def _check_prefix(path: str | os.PathLike[str], prefix: bytes) -> int:
    if len(prefix) < PREFIX.size:
        raise CacheFormatError(path, f"truncated: {len(prefix)} bytes is shorter than the fixed prefix")
    magic, header_length, _ = PREFIX.unpack(prefix)
    if magic not in FORMATS and magic not in OLD_MAGICS:
        raise CacheFormatError(path, f"not a {FORMAT} cache file (wrong magic bytes)")
    if header_length > MAX_HEADER_BYTES:
        raise CacheFormatError(
            path, f"a header of {header_length} bytes, more than the {MAX_HEADER_BYTES >> 20} MiB a reader accepts"
        )
    return header_length


def _parse_header(path: str | os.PathLike[str], prefix: bytes, header_bytes: bytes) -> Header:
    magic, header_length, digest = PREFIX.unpack(prefix)
    if len(header_bytes) != header_length:
        raise CacheFormatError(path, f"truncated inside the header ({len(header_bytes)} of {header_length} bytes)")
    if hashlib.sha256(header_bytes).digest() != digest:
        raise CacheFormatError(path, "header checksum mismatch: the header is damaged")
    if magic in OLD_MAGICS:
        try:
            old = msgspec.json.decode(header_bytes, type=OldHeader)
        except msgspec.DecodeError as exc:
            raise CacheFormatError(path, f"header is not a {OLD_MAGICS[magic]} header: {exc}") from exc
        raise OutdatedCache(path, old)
    try:
        header = msgspec.json.decode(header_bytes, type=Header)
    except msgspec.DecodeError as exc:  # a sound checksum over an unreadable header: a foreign writer
        raise CacheFormatError(path, f"header is not a {FORMATS[magic]} header: {exc}") from exc
    if header.format != FORMATS[magic] or header.identity.layout != LAYOUT:
        raise CacheFormatError(path, f"unsupported format {header.format!r} / layout {header.identity.layout!r}")
    problem = manifest_problem(header)
    if problem is not None:
        raise CacheFormatError(path, problem)
    return header


class Region(NamedTuple):
    """Where a tensor lies in a LoadedCache's memory: ``shape`` in memory (a key or value
    tensor read with spare room holds more positions than its own), and the spans of bytes,
    (start, size) in file order, that its bytes in the file were read into."""

    start: int
    nbytes: int
    shape: tuple[int, ...]
    spans: list[tuple[int, int]]


class LoadedCache:
    """A verified cache in memory. ``tensors`` are memoryviews of it (no copy), each laid out
    as ``shapes`` says: a tensor's own shape, or for a key or value tensor read with spare
    room ([1, heads, positions, head_dim] with positions past the tensor's own), each head's
    positions followed by room for more.

    When a tensor's view is no longer used (whatever was built on it, a torch tensor say,
    is gone too), its pages leave the process: a restored cache whose layers are replaced
    one by one holds each layer once, never the mapping and the copies together. Memory
    from the reserve (``reserve``) stays filled instead, for the next restore."""

    def __init__(self, header: Header, mapping: mmap.mmap, regions: list[Region]) -> None:
        self.header = header
        self.shapes = [region.shape for region in regions]
        self._mapping = mapping
        view = memoryview(mapping)
        self.tensors: list[memoryview] = []
        for region in regions:
            tensor = view[region.start : region.start + region.nbytes]
            memory.release_when_unused(mapping, region.start, tensor)
            self.tensors.append(tensor)


def load(
    path: str | os.PathLike[str], expected: Identity | None = None, *, room: Callable[[TensorEntry], int] | None = None,
    check: Callable[[Header], str | None] | None = None,
) -> LoadedCache:
    """Read and verify a cache: header, identity (if given), padding and every tensor's CRC.

    ``room`` gives, for a key or value tensor, how many positions of spare room to leave
    after each head's positions in memory: a cache that is fed further then grows into it,
    where otherwise every restored position would be copied into larger buffers.

    ``check`` is what the reading model finds wrong with a sound header (``layout_problem``),
    asked before any memory is taken for the tensors: a problem is a CacheFormatError.

    The file is read into memory of this process, not mapped: a mapped file that someone
    truncates or rewrites in place (``cp backup.kvc x.kvc``) kills the reader with SIGBUS.
    What was read is checked as a whole, so a file that changed while it was read is
    refused as damaged, never used half old and half new."""
    with _open_regular(path) as fd:
        prefix, header_bytes = _read_prefix_and_header(path, fd)
        try:
            header = _parse_header(path, prefix, header_bytes)
        except OutdatedCache as exc:
            raise IdentityMismatch(path, "format", FORMAT, exc.header.format) from exc
        header_end = PREFIX.size + len(header_bytes)  # the header parsed, so it is as long as the prefix says
        if expected is not None:  # before reading the tensors: a foreign cache costs only its header
            check_identity(path, header.identity, expected)
        if check is not None and (problem := check(header)) is not None:
            raise CacheFormatError(path, problem)
        size = max((e.offset + e.nbytes for e in header.tensors), default=header_end)
        on_disk = os.fstat(fd).st_size
        if on_disk < size:
            raise CacheFormatError(path, f"truncated: the header describes {size} bytes, the file has {on_disk}")
        if on_disk > size:
            raise CacheFormatError(path, f"{on_disk - size} unexpected bytes after the last tensor")
        if _pread(path, fd, header_end, 0) != prefix + header_bytes:
            raise CacheFormatError(path, "changed while being read (the header is not the one checked)")
        regions = _regions(header, room)
        nbytes = max((region.start + region.nbytes for region in regions), default=0)
        buffer = memory.take(nbytes, len(regions))
        try:
            _read_and_check(path, fd, header, buffer, regions, header_end)
            if _pread(path, fd, 1, size):
                raise CacheFormatError(path, "changed while being read (it is longer than its header says)")
        except BaseException:
            memory.put_back(buffer)  # no tensors to hold it: free for the next restore
            raise
    return LoadedCache(header, buffer, regions)


def _regions(header: Header, room: Callable[[TensorEntry], int] | None) -> list[Region]:
    """Where each tensor goes in memory: one after another, aligned, key and value tensors
    with the spare room ``room`` asks for after each head's positions."""
    regions: list[Region] = []
    start = 0
    for entry in header.tensors:
        spare = room(entry) if room is not None and entry.kind in ("key", "value") else 0
        if spare > 0:
            _, heads, positions, dim = entry.shape
            itemsize = DTYPE_SIZES[entry.dtype]
            head_bytes, stride = positions * dim * itemsize, (positions + spare) * dim * itemsize
            shape = (1, heads, positions + spare, dim)
            spans = [(start + head * stride, head_bytes) for head in range(heads)]
            nbytes = heads * stride
        else:
            shape, spans, nbytes = tuple(entry.shape), [(start, entry.nbytes)], entry.nbytes
        regions.append(Region(start, nbytes, shape, spans))
        start = align(start + nbytes)
    return regions


def _read_into(path: str | os.PathLike[str], fd: int, views: list[memoryview], offset: int) -> int:
    """Read the file's bytes from ``offset`` on into ``views``, one after another; how many
    were read (fewer than they hold: the file ended)."""
    done, views = 0, [view for view in views if view.nbytes]
    while views:
        try:
            count = os.preadv(fd, views[:IOV_MAX], offset + done)
        except OSError as exc:
            raise CacheFormatError(path, f"cannot be read: {exc.strerror or exc}") from exc
        if count == 0:
            break
        done += count
        while views and count >= views[0].nbytes:
            count -= views.pop(0).nbytes
        if count:
            views[0] = views[0][count:]
    return done


def _read_and_check(
    path: str | os.PathLike[str], fd: int, header: Header, buffer: mmap.mmap, regions: list[Region], header_end: int
) -> None:
    """Read each tensor (with the padding before it) and check it: its place in file order,
    the padding, its CRC (the format's). The tensors are cut into as many runs of neighbours
    as there are threads, of about as many bytes each, and each thread reads its run in file
    order a piece at a time, checking each piece as soon as it is read, while its bytes are
    still in the processor's caches: memory is crossed once, by the read's copy. With the
    CRC-32C kernel a run is one call of it, the interpreter out of the way (reads and CRCs
    let go of the GIL either way). The first failure in file order is the one reported."""
    position, failure = header_end, None
    placed: list[tuple[int, TensorEntry, Region]] = []
    for entry, region in zip(header.tensors, regions):
        if entry.offset % ALIGNMENT or entry.offset < position:
            failure = f"tensor {entry.name}: bad offset {entry.offset}"
            break
        placed.append((position, entry, region))
        position = entry.offset + entry.nbytes
    if header.format == "KVC3" and checksum.writes_crc32c():
        read_run = _kernel_reader(path, fd, buffer)
    else:
        read_run = _python_reader(path, fd, buffer, CHECKSUMS[header.format])
    runs = _runs(placed, CHECK_THREADS)
    others = [_pool().submit(read_run, run) for run in runs[1:]]
    try:
        checked = read_run(runs[0])  # this thread reads the first run itself
    except BaseException:
        wait(others)  # none still writing into the buffer once it is let go
        raise
    for other in others:
        checked += other.result()
    for (_, entry, _), result in zip(placed, checked, strict=True):
        if result == "short":
            raise CacheFormatError(path, "changed while being read (it is shorter than when it was opened)")
        if result == "padding":
            raise CacheFormatError(path, f"damaged padding before tensor {entry.name}")
        if result != entry.crc32:
            raise CacheFormatError(path, f"tensor {entry.name}: checksum mismatch, the data is damaged")
    if failure is not None:
        raise CacheFormatError(path, failure)


# What a reader found of one tensor: its CRC, or that the file ended first or its padding is not zero.
_Checked = int | Literal["short", "padding"]
_Run = list[tuple[int, TensorEntry, Region]]
_pool_lock = threading.Lock()
_reader_pool: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """Threads kept for the runs a restore reads besides its own (starting threads anew at each
    restore cost milliseconds: each waits for the GIL)."""
    global _reader_pool
    with _pool_lock:
        if _reader_pool is None:
            _reader_pool = ThreadPoolExecutor(8, thread_name_prefix="kvc-read")
        return _reader_pool


def _kernel_reader(path: str | os.PathLike[str], fd: int, buffer: mmap.mmap) -> Callable[[_Run], list[_Checked]]:
    """Reads a run in one call of the CRC-32C kernel (checksum.read_check_run)."""
    import numpy as np

    base = int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)  # the export ends with the array

    def read_run(run: _Run) -> list[_Checked]:
        offsets, into, lengths, fresh = array.array("q"), array.array("Q"), array.array("q"), bytearray()
        last: list[int] = []  # each tensor's last item
        for start, entry, region in run:
            offsets.append(start)
            into.append(0)
            lengths.append(entry.offset - start)
            fresh.append(1)
            at_file = entry.offset
            for at, size in region.spans:
                offsets.append(at_file)
                into.append(base + at)
                lengths.append(size)
                fresh.append(0)
                at_file += size
            last.append(len(offsets) - 1)
        try:
            read = checksum.read_check_run(fd, offsets, into, lengths, fresh, READ_PIECE)
        except OSError as exc:
            raise CacheFormatError(path, f"cannot be read: {exc.strerror or exc}") from exc
        assert read is not None, "the kernel is loaded"
        crcs, states = read
        out: list[_Checked] = []
        first = 0
        for end in last:  # the first item of the tensor that is not whole says what is wrong
            result: _Checked = crcs[end]
            for state in states[first : end + 1]:
                if state != 1:
                    result = "padding" if state == 2 else "short"  # 3: a run stopped before (an earlier failure)
                    break
            out.append(result)
            first = end + 1
        return out

    return read_run


def _python_reader(
    path: str | os.PathLike[str], fd: int, buffer: mmap.mmap, crc: Callable[[memoryview, int], int]
) -> Callable[[_Run], list[_Checked]]:
    """Reads a run with preadv and ``crc``, a piece at a time."""
    view = memoryview(buffer)

    def read_and_sum(item: tuple[int, TensorEntry, Region]) -> _Checked:
        start, entry, region = item
        padding = bytearray(entry.offset - start)
        if _read_into(path, fd, [memoryview(padding)], start) != len(padding):
            return "short"
        if padding.count(0) != len(padding):
            return "padding"
        value, at_file = 0, entry.offset
        for at, size in region.spans:
            for piece_start in range(at, at + size, READ_PIECE):
                piece = view[piece_start : min(piece_start + READ_PIECE, at + size)]
                if _read_into(path, fd, [piece], at_file) != piece.nbytes:
                    return "short"
                value = crc(piece, value)
                at_file += piece.nbytes
        return value

    def read_run(run: _Run) -> list[_Checked]:
        return [read_and_sum(item) for item in run]

    return read_run


def _runs(placed: list[tuple[int, TensorEntry, Region]], count: int) -> list[list[tuple[int, TensorEntry, Region]]]:
    """``placed`` cut into at most ``count`` runs of neighbours of about equal bytes (padding
    and tensor), in file order: one thread reads a run from one place on, without crossing
    another's (reading neighbouring pieces by turns is slower)."""
    total = sum(entry.offset + entry.nbytes - start for start, entry, _ in placed)
    runs: list[list[tuple[int, TensorEntry, Region]]] = [[]]
    done = 0
    for item in placed:
        start, entry, _ = item
        if runs[-1] and done >= total * len(runs) / count:
            runs.append([])
        runs[-1].append(item)
        done += entry.offset + entry.nbytes - start
    return runs
