"""Writing a cache file atomically, and removing the temporaries of writers that died. Torch-free.

Writing goes to a temporary file in the same directory, is flushed to disk and renamed, so a
reader never sees half a file. The writer holds its temporary locked, so that one left behind
by a killed writer can be recognised and removed (``remove_stale_temporaries``).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
from collections.abc import Generator
from pathlib import Path
from typing import BinaryIO

import msgspec

from worker.files import open_regular
from worker.kvcache import checksum
from worker.kvcache.format import (
    CHECKSUMS, DTYPE_SIZES, FORMAT, FORMATS, MAX_HEADER_BYTES, PREFIX, Contents, Header, TensorEntry, TensorSpec,
    UnsupportedCache, align, c_strides,
)
from worker.kvcache.validate import manifest_problem

TEMPORARY_SUFFIX = ".tmp"  # a temporary is named ".{target name}.{writer pid}.{random}.tmp"
# That name exactly (tempfile's eight random characters), so a cleaner never takes another's file for one.
_TEMPORARY_NAME = re.compile(r"\.(?P<target>.+)\.[0-9]+\.[a-z0-9_]{8}" + re.escape(TEMPORARY_SUFFIX))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
    data_start = align(PREFIX.size + len(msgspec.json.encode(longest)))
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
    if PREFIX.size + len(header_bytes) > data_start:
        raise AssertionError("header outgrew its reserved space")
    with atomic_file(Path(path)) as file:
        file.write(PREFIX.pack(magic, len(header_bytes), hashlib.sha256(header_bytes).digest()))
        file.write(header_bytes)
        position = PREFIX.size + len(header_bytes)
        for entry, view in zip(header.tensors, views, strict=True):
            file.write(bytes(entry.offset - position))
            file.write(view)
            position = entry.offset + entry.nbytes
    return position


@contextlib.contextmanager
def atomic_file(target: Path) -> Generator[BinaryIO]:
    """A file to write ``target``'s bytes to: a locked temporary beside it, flushed to disk and
    renamed over ``target`` when the block ends, removed where it raises. Readers of ``target``
    see the old file or the whole new one; remove_stale_temporaries recognises what a killed
    writer leaves."""
    fd, temporary = _locked_temporary(target)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # as open() would: others sharing the directory can read it
        with os.fdopen(fd, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


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
                strides=c_strides(spec.shape, itemsize),
                offset=offset,
                nbytes=view.nbytes,
                dtype=spec.dtype,
                crc32=crc(view, 0) if data_start < 10**15 else 0xFFFFFFFF,
            )
        )
        offset = align(offset + view.nbytes)
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
