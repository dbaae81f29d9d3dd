"""KVC3: the file format of a persistent KV prompt cache. Torch-free.

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
computed fast). Every field a reader uses is checked against the others before a
tensor is handed out, and any damaged byte is found: the header by its SHA-256, padding by being zero,
tensors by their CRC, and the file by its exact expected size. Reading reads
the tensors into memory of the reader's own, where a reader may ask for room to
grow after each key and value tensor's positions, and hands out memoryviews of
it; the pages under a view are given back once nothing uses it any more. Writing goes to a
temporary file in the same directory, is flushed to disk and renamed, so a
reader never sees half a file. The writer holds its temporary locked, so that one
left behind by a killed writer can be recognised and removed
(``remove_stale_temporaries``). Nothing here unpickles anything.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import math
import mmap
import os
import re
import struct
import threading
import weakref
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec

from worker.files import NotRegularFile, open_regular

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
_PREFIX = struct.Struct("<8sQ32s")  # magic, header length, header sha256
# A header holds the token ids (about 7 bytes each): 16 MiB is two million tokens and more.
# Listing reads every header on the reader thread, so a made-up length must not cost seconds.
MAX_HEADER_BYTES = 16 << 20
TEMPORARY_SUFFIX = ".tmp"  # a temporary is named ".{target name}.{writer pid}.{random}.tmp"
# That name exactly (tempfile's eight random characters), so a cleaner never takes another's file for one.
_TEMPORARY_NAME = re.compile(r"\.(?P<target>.+)\.[0-9]+\.[a-z0-9_]{8}" + re.escape(TEMPORARY_SUFFIX))
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
# Reads and the CRC let go of the GIL on large buffers, so tensors are checked on several threads;
# beyond a few, memory bandwidth is the limit.
CHECK_THREADS = min(8, os.cpu_count() or 1)
# Bytes read and then checked at a time: small enough to stay in a core's own cache in between.
READ_PIECE = 256 << 10
# Buffers one preadv may take (POSIX promises at least 16).
IOV_MAX = max(16, os.sysconf("SC_IOV_MAX")) if "SC_IOV_MAX" in os.sysconf_names else 16


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
_KV_KINDS = ("full", "sliding", "full+linear", "sliding+linear")
_STATE_KINDS = ("linear", "full+linear", "sliding+linear")


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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _c_strides(shape: Iterable[int], itemsize: int) -> list[int]:
    strides: list[int] = []
    step = itemsize
    for size in reversed(list(shape)):
        strides.append(step)
        step *= size
    return strides[::-1]


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


def write(
    path: str | os.PathLike[str], contents: Contents, tensors: list[tuple[TensorSpec, memoryview]], *,
    format: str | None = None,
) -> int:
    """Write a cache atomically; returns the file size. Tensors are written one by one.
    A cache whose header would not pass the reader's checks is refused (ValueError; one too
    large for a reader: UnsupportedCache). ``format``: KVC3 where CRC-32C has its kernel
    (checksum.writes_crc32c), else KVC2; either may be asked for."""
    if format is None:
        format = FORMAT if checksum.writes_crc32c() else "KVC2"
    if format not in CHECKSUMS:
        raise ValueError(f"cannot write format {format!r}, only {sorted(CHECKSUMS)}")
    magic = next(magic for magic, name in FORMATS.items() if name == format)
    views = [memoryview(buffer).cast("B") for _, buffer in tensors]
    # Offsets depend on the header's length, which depends on the offsets: first lay out a
    # header whose numbers are as long as they can get, and put the data after it.
    longest = _layout(contents, tensors, views, data_start=10**15, format=format)
    data_start = _align(_PREFIX.size + len(msgspec.json.encode(longest)))
    header = _layout(contents, tensors, views, data_start=data_start, format=format)
    problem = manifest_problem(header)
    if problem is not None:
        raise ValueError(f"not a sound cache: {problem}")
    header_bytes = msgspec.json.encode(header)
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise UnsupportedCache(
            f"its header would take {len(header_bytes)} bytes, more than the {MAX_HEADER_BYTES >> 20} MiB a reader "
            "accepts (too many tokens)"
        )
    if _PREFIX.size + len(header_bytes) > data_start:
        raise AssertionError("header outgrew its reserved space")
    target = Path(path)
    fd, temporary = _locked_temporary(target)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # as open() would: others sharing the directory can read it
        with os.fdopen(fd, "wb") as file:
            file.write(_PREFIX.pack(magic, len(header_bytes), hashlib.sha256(header_bytes).digest()))
            file.write(header_bytes)
            position = _PREFIX.size + len(header_bytes)
            for entry, view in zip(header.tensors, views, strict=True):
                file.write(bytes(entry.offset - position))
                file.write(view)
                position = entry.offset + entry.nbytes
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return position


def _locked_temporary(target: Path) -> tuple[int, str]:
    """A new temporary beside ``target``, locked (flock) for as long as its writer lives: the
    lock, not the process id in its name, is what tells others that it is still being
    written. It holds across PID namespaces, and across hosts where the filesystem carries
    locks (NFS does). Should a cleaner take the new file in the moment before it is locked,
    the writer sees it unlinked and makes another."""
    import fcntl
    import tempfile

    for _ in range(3):
        fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=TEMPORARY_SUFFIX,
                                         dir=target.parent)
        with contextlib.suppress(OSError):  # a filesystem without locks: cleaners there cannot lock it either
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_nlink > 0:
            return fd, temporary
        os.close(fd)
    raise OSError(f"temporaries in {target.parent} keep vanishing before they can be locked")


def remove_stale_temporaries(directory: str | os.PathLike[str], target_suffix: str = "") -> list[str]:
    """Delete the temporaries in ``directory`` that no writer holds any more (a writer killed
    mid-write leaves its temporary behind, unlocked); returns their names. Those a live
    writer holds locked, any this process cannot lock (another user's, a filesystem without
    locks), and files not named exactly as this module names temporaries of targets ending
    in ``target_suffix`` are left alone."""
    import fcntl

    removed: list[str] = []
    try:
        candidates = [entry for entry in os.scandir(directory) if entry.name.startswith(".")]
    except OSError:
        return removed
    for entry in candidates:
        named = _TEMPORARY_NAME.fullmatch(entry.name)
        if named is None or not named["target"].endswith(target_suffix):
            continue
        try:
            fd = open_regular(entry.path, follow_symlinks=False)
        except OSError:  # gone already, a symbolic link, not a regular file, not ours to read
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken: no writer holds it
            os.unlink(entry.path)
        except OSError:  # held by a live writer (or no locks here), or removed by another cleaner first
            continue
        finally:
            os.close(fd)
        removed.append(entry.name)
    return removed


def _layout(
    contents: Contents, tensors: list[tuple[TensorSpec, memoryview]], views: list[memoryview], *, data_start: int,
    format: str,
) -> Header:
    entries: list[TensorEntry] = []
    crc = CHECKSUMS[format]
    offset = data_start
    for (spec, _), view in zip(tensors, views, strict=True):
        itemsize = DTYPE_SIZES[spec.dtype]
        if view.nbytes != math.prod(spec.shape) * itemsize:
            raise ValueError(f"tensor {spec.name}: {view.nbytes} bytes for shape {spec.shape} of {spec.dtype}")
        entries.append(
            TensorEntry(
                name=spec.name,
                kind=spec.kind,
                layer=spec.layer,
                state=spec.state,
                position=spec.position,
                shape=list(spec.shape),
                strides=_c_strides(spec.shape, itemsize),
                offset=offset,
                nbytes=view.nbytes,
                dtype=spec.dtype,
                crc32=crc(view, 0) if data_start < 10**15 else 0xFFFFFFFF,
            )
        )
        offset = _align(offset + view.nbytes)
    return Header(
        format=format,
        identity=contents.identity,
        sequence_start=contents.sequence_start,
        sequence_length=len(contents.tokens),
        tokens=contents.tokens,
        prefix_offsets=contents.prefix_offsets,
        prefix_hashes=contents.prefix_hashes,
        layers=contents.layers,
        states=contents.states,
        tensors=entries,
        created_by=contents.created_by,
    )


def read_header(path: str | os.PathLike[str]) -> Header:
    """The header, verified, without touching the tensors (for listing and info).
    Raises OutdatedCache for a file of an earlier format."""
    with _open_regular(path) as fd:
        prefix = _pread(path, fd, _PREFIX.size, 0)
        header_length = _check_prefix(path, prefix)
        header_bytes = _pread(path, fd, header_length, _PREFIX.size)
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
            if mapping is _reserve.buffer:
                weakref.finalize(tensor, _reserve.give_back, mapping)
            else:
                weakref.finalize(tensor, _release, mapping, region.start, region.nbytes)
            self.tensors.append(tensor)


def _release(mapping: mmap.mmap, offset: int, nbytes: int) -> None:
    """Give back the pages wholly inside these bytes, which nothing uses any more."""
    start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


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
        prefix = _pread(path, fd, _PREFIX.size, 0)
        header_length = _check_prefix(path, prefix)
        header_bytes = _pread(path, fd, header_length, _PREFIX.size)
        try:
            header = _parse_header(path, prefix, header_bytes)
        except OutdatedCache as exc:
            raise IdentityMismatch(path, "format", FORMAT, exc.header.format) from exc
        if expected is not None:  # before reading the tensors: a foreign cache costs only its header
            check_identity(path, header.identity, expected)
        if check is not None and (problem := check(header)) is not None:
            raise CacheFormatError(path, problem)
        size = max((e.offset + e.nbytes for e in header.tensors), default=_PREFIX.size + header_length)
        on_disk = os.fstat(fd).st_size
        if on_disk < size:
            raise CacheFormatError(path, f"truncated: the header describes {size} bytes, the file has {on_disk}")
        if on_disk > size:
            raise CacheFormatError(path, f"{on_disk - size} unexpected bytes after the last tensor")
        header_end = _PREFIX.size + header_length
        if _pread(path, fd, header_end, 0) != prefix + header_bytes:
            raise CacheFormatError(path, "changed while being read (the header is not the one checked)")
        regions = _regions(header, room)
        memory = max((region.start + region.nbytes for region in regions), default=0)
        buffer = _reserve.take(memory, len(regions)) or _faulted_in(_anonymous(memory))
        try:
            _read_and_check(path, fd, header, buffer, regions, header_end)
            if _pread(path, fd, 1, size):
                raise CacheFormatError(path, "changed while being read (it is longer than its header says)")
        except BaseException:
            _reserve.put_back(buffer)  # no tensors to hold it: free for the next restore
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
        start = _align(start + nbytes)
    return regions


def _anonymous(size: int) -> mmap.mmap:
    """Private anonymous memory: its pages can be given back one tensor at a time (shared ones
    could not). Huge pages make filling it several times faster (a few dozen page faults
    instead of tens of thousands)."""
    buffer = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


# madvise(MADV_POPULATE_WRITE) (Linux 5.14): fault a mapping's pages in, writable, in one call.
_MADV_POPULATE_WRITE = 23


def _faulted_in(buffer: mmap.mmap) -> mmap.mmap:
    """New memory with its pages faulted in by this thread, before the reading threads write
    into it. Faulted in by a second reading thread instead, one restore in four on the 2-core
    virtual machines took ~100 ms more (a 90 MiB file, after the model's forward had freed its
    memory; bench/README.md, "KVC3"), where from here it takes ~3 ms, every time. A kernel
    without the call leaves it to the readers."""
    with contextlib.suppress(OSError, ValueError):
        buffer.madvise(_MADV_POPULATE_WRITE)
    return buffer


class _Reserve:
    """Memory filled in ahead of the restores to come (``reserve``). A virtual machine that
    hands freed memory back to its host (free page reporting) makes the first touch of new
    memory slow, many times the copy of the file into it (bench/README.md, "Figures behind
    constants"). Memory the worker filled at ``load`` and keeps costs nothing to write again. One restore at a
    time holds it: the next finds it free once every tensor of the last is gone."""

    def __init__(self) -> None:
        self.buffer: mmap.mmap | None = None
        self._users = 0  # tensors of a LoadedCache still using the buffer
        self._lock = threading.Lock()

    def replace(self, nbytes: int) -> int:
        with self._lock:
            self.buffer, self._users = None, 0  # a restored cache still using it keeps it until it goes
            if nbytes <= 0:
                return 0
            buffer = _anonymous(nbytes)
            memoryview(buffer)[:: mmap.PAGESIZE] = bytes(-(-nbytes // mmap.PAGESIZE))  # a byte a page
            self.buffer = buffer
            return nbytes

    def take(self, nbytes: int, users: int) -> mmap.mmap | None:
        """The reserve, for a LoadedCache of ``users`` tensors, if it is free and large enough."""
        with self._lock:
            if self.buffer is None or self._users or nbytes > len(self.buffer) or users == 0:
                return None
            self._users = users
            return self.buffer

    def put_back(self, buffer: mmap.mmap) -> None:
        """``buffer`` was taken for a restore that failed: free again if it is the reserve."""
        with self._lock:
            if buffer is self.buffer:
                self._users = 0

    def give_back(self, buffer: mmap.mmap) -> None:
        with self._lock:
            if buffer is self.buffer:  # not one replaced since
                self._users -= 1


_reserve = _Reserve()


def reserve(nbytes: int) -> int:
    """Fill ``nbytes`` of memory now for the restores to come (``load`` reads a file that fits
    into it instead of new memory), replacing what was reserved before; 0 lets it go.
    Returns the bytes reserved. The memory stays with the process until replaced."""
    return _reserve.replace(nbytes)


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


def layout_problem(header: Header, tensors: Iterable[TensorSpec] | None, max_positions: int) -> str | None:
    """What makes a sound header of a model's identity other than what that model computes, or
    None: more positions than its context, or a tensor whose shape or dtype is not that of the
    model's own tensor of the same layer, kind and state (``tensors``: those of a cache of one
    position the model computed; None where its caches cannot be stored, so none are read).
    The identity repeats head counts and sizes, but a header could still claim others."""
    if header.sequence_length > max_positions:
        return f"it holds {header.sequence_length} positions, more than the model's context of {max_positions}"
    own = {(spec.layer, spec.kind, spec.state): spec for spec in tensors or ()}
    for entry in header.tensors:
        spec = own.get((entry.layer, entry.kind, entry.state))
        if spec is None:
            return f"tensor {entry.name}: the model keeps no {entry.kind} tensor {entry.state} in layer {entry.layer}"
        shape = list(spec.shape)
        if entry.kind in ("key", "value"):  # [1, heads, positions, head_dim]: any number of positions
            shape[2] = entry.shape[2]
        if entry.shape != shape or entry.dtype != spec.dtype:
            return f"tensor {entry.name}: {entry.dtype} of shape {entry.shape}, where the model's is {spec.dtype} of {shape}"
    return None


def check_identity(path: str | os.PathLike[str], found: Identity, expected: Identity) -> None:
    # The fields a person can read (the quantization, say) before the digests that also
    # cover them, so that a mismatch is named plainly.
    for field in sorted(expected.__struct_fields__, key=lambda name: name.endswith("_sha256")):
        if getattr(found, field) != getattr(expected, field):
            raise IdentityMismatch(path, field, getattr(expected, field), getattr(found, field))


def _check_prefix(path: str | os.PathLike[str], prefix: bytes) -> int:
    if len(prefix) < _PREFIX.size:
        raise CacheFormatError(path, f"truncated: {len(prefix)} bytes is shorter than the fixed prefix")
    magic, header_length, _ = _PREFIX.unpack(prefix)
    if magic not in FORMATS and magic not in OLD_MAGICS:
        raise CacheFormatError(path, f"not a {FORMAT} cache file (wrong magic bytes)")
    if header_length > MAX_HEADER_BYTES:
        raise CacheFormatError(
            path, f"a header of {header_length} bytes, more than the {MAX_HEADER_BYTES >> 20} MiB a reader accepts"
        )
    return header_length


def _parse_header(path: str | os.PathLike[str], prefix: bytes, header_bytes: bytes) -> Header:
    magic, header_length, digest = _PREFIX.unpack(prefix)
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


def manifest_problem(header: Header) -> str | None:
    """What makes the header's description of the cache inconsistent, or None. Everything a
    reader builds tensors from is checked here, so that a header with a sound checksum but
    made-up numbers is refused before any tensor exists."""
    length = header.sequence_length
    if length != len(header.tokens):
        return "sequence_length does not match the token list"
    if any(not 0 <= token < 2**32 for token in header.tokens):
        return "a token id is out of range"
    if header.sequence_start != 0:
        return f"sequence_start {header.sequence_start}: only caches of a whole prefix (0) are read"
    if [layer.index for layer in header.layers] != list(range(header.identity.layers)):
        return f"the layer list is not layers 0 to {header.identity.layers - 1} in order"
    kinds = [layer.kind for layer in header.layers]
    for layer in header.layers:
        if (layer.kind in ("sliding", "sliding+linear")) != (layer.sliding_window is not None):
            return f"layer {layer.index}: a sliding window goes with sliding layers, and only with them"
        if layer.sliding_window is not None and layer.sliding_window < 1:
            return f"layer {layer.index}: sliding window {layer.sliding_window}"
    states: set[tuple[int, int, int]] = set()
    for state in header.states:
        if not 0 <= state.layer < len(kinds) or kinds[state.layer] not in _STATE_KINDS:
            return f"a state of layer {state.layer}, which keeps no linear-attention state"
        if not 0 < state.position <= length or state.state < 0:
            return f"a state of layer {state.layer} at position {state.position} of a {length}-token sequence"
        key = (state.layer, state.state, state.position)
        if key in states:
            return f"two states {key} of layer {state.layer}"
        states.add(key)
    if length and any(
        kind in _STATE_KINDS and not any(s.layer == i and s.position == length for s in header.states)
        for i, kind in enumerate(kinds)
    ):
        return "a linear-attention layer has no state at the end of the sequence"
    seen: set[tuple[int | str | None, ...]] = set()
    names: set[str] = set()
    used_states: set[tuple[int, int, int | None]] = set()
    for entry in header.tensors:
        where = f"tensor {entry.name}"
        if entry.name in names:
            return f"{where} is listed twice"
        names.add(entry.name)
        if entry.dtype not in DTYPE_SIZES:
            return f"{where}: unknown dtype {entry.dtype!r}"
        itemsize = DTYPE_SIZES[entry.dtype]
        if any(size < 0 for size in entry.shape) or entry.nbytes != math.prod(entry.shape) * itemsize:
            return f"{where}: shape {entry.shape} of {entry.dtype} is not {entry.nbytes} bytes"
        if entry.strides != _c_strides(entry.shape, itemsize):
            return f"{where}: strides {entry.strides} are not those of C order"
        if not 0 <= entry.layer < len(kinds):
            return f"{where}: there is no layer {entry.layer}"
        if entry.kind in ("key", "value"):
            if kinds[entry.layer] not in _KV_KINDS:
                return f"{where}: layer {entry.layer} ({kinds[entry.layer]}) keeps no keys and values"
            if len(entry.shape) != 4 or entry.shape[0] != 1 or entry.shape[2] != length or entry.position is not None:
                return f"{where}: shape {entry.shape} is not [1, heads, {length}, head_dim]"
            key = (entry.layer, entry.kind)
        else:
            state = (entry.layer, entry.state, entry.position)
            if state not in states:
                return f"{where}: no state {entry.state} of layer {entry.layer} at position {entry.position}"
            used_states.add(state)
            key = (entry.layer, entry.kind, entry.state, entry.position)
        if key in seen:
            return f"{where}: a second {entry.kind} tensor of layer {entry.layer}"
        seen.add(key)
    for i, kind in enumerate(kinds):
        if length and kind in _KV_KINDS and not {(i, "key"), (i, "value")} <= seen:
            return f"layer {i} ({kind}) lacks its keys or values"
    if states - used_states:
        return f"states without tensors: {sorted(states - used_states)[:3]}"
    return None
