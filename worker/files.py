"""Reading files that the worker did not write itself in this process.

The data and cache directories may hold anything by the time the worker looks: a FIFO
(opening it waits for a writer, forever), a device or a link to one (``/dev/zero`` never
ends), a directory, a sparse file of terabytes. Every such read goes through here, so
that one rule holds everywhere: only regular files are read, opening never blocks, and
no more is read than the caller can use. Torch-free.
"""

from __future__ import annotations

import errno
import os
import stat


class NotRegularFile(OSError):
    """Something other than a regular file (a FIFO, device, socket or directory) under the name."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(errno.EINVAL, "not a regular file (a FIFO, device or directory)", os.fspath(path))


class FileTooLarge(OSError):
    def __init__(self, path: str | os.PathLike[str], size: int, limit: int) -> None:
        super().__init__(errno.EFBIG, f"{size} bytes, more than the {limit} such a file can hold", os.fspath(path))


def open_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (after following symbolic
    links, unless told not to). Raises FileNotFoundError, NotRegularFile, or the OSError of the open."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: a FIFO opens at once, then is refused
    fd = os.open(path, flags if follow_symlinks else flags | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (FileTooLarge beyond); raises as
    open_regular does."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise FileTooLarge(path, size, limit)
        data = os.read(fd, limit + 1)  # a file that grew meanwhile shows as one byte too many
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FileTooLarge(path, len(data), limit)
    return data


def is_regular(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a regular file (after following symbolic links), for a file that
    is handed to a loader which opens it by name (a shared library)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False
