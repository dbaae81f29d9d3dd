"""SHA-256 digests of model files, computed in full once and remembered.

A cache is valid only for the exact weights that computed it, so the identity
holds a digest of every byte of them. Hashing a gigabyte takes about half a
second here, too slow for every load: the digest of each file is remembered under
the data directory, keyed by what changes whenever the file's bytes can have
changed (device, inode, size, modification and status-change times). A file
rewritten in place gets a new status-change time, which nobody can set back, so
its digest is computed again. The memo itself is trusted, as the data directory is
(it also holds the compiled kernel the worker runs): PROTOCOL.md 13. Torch-free.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from worker import load_progress
from worker.files import open_regular, read_small

log = logging.getLogger(__name__)

_HEX = frozenset("0123456789abcdef")
_MEMO_BYTES = 128  # a memo is 64 hex digits and a newline: anything larger is not one
_READ_BYTES = 1 << 20


def file_sha256(path: Path, memo_dir: Path, on_read: Callable[[int], None] = lambda size: None) -> str:
    """The SHA-256 of ``path``'s bytes, from the memo when this version of the file was hashed
    before; ``on_read`` is told the size of each piece read to hash it."""
    memo = _memo(path, memo_dir)
    digest = _remembered(memo)
    if digest is not None:
        return digest
    started = time.perf_counter()
    sha, buffer = hashlib.sha256(), bytearray(_READ_BYTES)
    view = memoryview(buffer)
    with os.fdopen(open_regular(path), "rb", buffering=0) as file:
        while read := file.readinto(buffer):
            sha.update(view[:read])
            on_read(read)
    digest = sha.hexdigest()
    log.info("hashed %s (%.1f MB) in %.0f ms", path.name, path.stat().st_size / 1e6, (time.perf_counter() - started) * 1e3)
    _remember(memo, digest)
    return digest


def digests(files: Sequence[Path], memo_dir: Path) -> dict[Path, str]:
    """Each file's SHA-256 (file_sha256). Hashing those not remembered is a load's "hashing"
    stage, in bytes (worker.load_progress)."""
    unknown = [path for path in files if _remembered(_memo(path, memo_dir)) is None]
    if not unknown:
        return {path: file_sha256(path, memo_dir) for path in files}
    total = sum(path.stat().st_size for path in unknown)
    report = load_progress.stage("hashing", total, "bytes")
    hashed = 0

    def count(size: int) -> None:
        nonlocal hashed
        hashed += size
        report(min(hashed, total))  # a file that grew meanwhile

    found = {path: file_sha256(path, memo_dir, count) for path in files}
    report(total)  # also when a file shrank meanwhile
    return found


def remembered(files: Sequence[Path], memo_dir: Path) -> dict[Path, str] | None:
    """Each file's SHA-256 where every one is remembered, else None: nothing is hashed."""
    found: dict[Path, str] = {}
    for path in files:
        digest = _remembered(_memo(path, memo_dir))
        if digest is None:
            return None
        found[path] = digest
    return found


def combined_sha256(files: Sequence[Path], digests: Mapping[Path, str], *, extra: str = "") -> str:
    """One digest over the files' names and ``digests`` (in the order given) and ``extra``."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{digests[path]}\0".encode())
    digest.update(extra.encode())
    return digest.hexdigest()


def _memo(path: Path, memo_dir: Path) -> Path:
    """Where the digest of this version of ``path`` is remembered."""
    stat = path.stat()
    return memo_dir / f"{stat.st_dev}-{stat.st_ino}-{stat.st_size}-{stat.st_mtime_ns}-{stat.st_ctime_ns}.sha256"


def _remembered(memo: Path) -> str | None:
    try:
        remembered = read_small(memo, _MEMO_BYTES).decode("ascii", "replace").strip()
    except OSError:  # not hashed yet, or unreadable, or not a regular file (a FIFO, a device): hash again
        return None
    return remembered if len(remembered) == 64 and set(remembered) <= _HEX else None


def _remember(memo: Path, digest: str) -> None:
    """Write the memo atomically; a data directory that cannot be written only costs a rehash."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{memo.name}.", dir=memo.parent)
        with os.fdopen(fd, "w") as file:
            file.write(digest + "\n")
        os.replace(temporary, memo)
    except OSError as exc:
        log.warning("could not remember the digest of a model file in %s: %s", memo.parent, exc)
