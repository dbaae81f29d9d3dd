"""The memory a cache file is read into: private anonymous memory whose pages leave the
process tensor by tensor once nothing uses them, and a process-wide reserve filled ahead of the
restores to come (``reserve``). Torch-free."""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref


def take(nbytes: int, tensors: int) -> mmap.mmap:
    """Memory of ``nbytes`` for a cache of ``tensors`` tensors: the reserve if it is free and
    large enough, else new memory, its pages faulted in."""
    return _reserve.take(nbytes, tensors) or _faulted_in(_anonymous(nbytes))


def put_back(buffer: mmap.mmap) -> None:
    """``buffer`` was taken for a restore that failed: the reserve, if it is that, is free again."""
    _reserve.put_back(buffer)


def release_when_unused(mapping: mmap.mmap, start: int, tensor: memoryview) -> None:
    """Once nothing uses ``tensor``, the view of ``mapping`` from ``start`` (whatever was built on
    it, a torch tensor say, gone too), its pages leave the process; the reserve's stay filled
    instead, for the next restore."""
    if mapping is _reserve.buffer:
        weakref.finalize(tensor, _reserve.give_back, mapping)
    else:
        weakref.finalize(tensor, _release, mapping, start, tensor.nbytes)


def _release(mapping: mmap.mmap, offset: int, nbytes: int) -> None:
    """Give back the pages wholly inside these bytes, which nothing uses any more."""
    start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


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
