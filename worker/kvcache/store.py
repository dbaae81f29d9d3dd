"""Where caches live: ``name`` → ``name.kvc`` in the cache directory, ``memory://name`` in this process.

Refs are validated by the protocol (a name of ``[A-Za-z0-9._-]``, not starting
with a dot), so a path never leaves the cache directory. Disk caches are
written atomically by the container; a damaged or foreign file is refused
with the reason, never used. A directory may be shared by several workers: a
file that another worker deletes between listing and use is "not found", never
"corrupt", and a store removes the temporaries of killed writers when it opens
the directory.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import NamedTuple, Protocol, Self, TypeVar, cast

from protocol.errors import ErrorKind, RpcError
from protocol.methods import CacheInfo, SkippedCache
from worker import __version__
from worker.kvcache import container
from worker.kvcache.container import (
    CacheFormatError,
    CacheMissing,
    Contents,
    Header,
    Identity,
    IdentityMismatch,
    LayerEntry,
    LoadedCache,
    OldHeader,
    OutdatedCache,
    StateEntry,
    TensorEntry,
    TensorSpec,
    UnsupportedCache,
)

log = logging.getLogger(__name__)

MEMORY = "memory://"
SUFFIX = ".kvc"
# The memory reserve_for fills at load is at most this share of the machine's.
RESERVE_SHARE = 8


class StorableCache(Protocol):
    """What the store needs of a backend's cache object."""

    @property
    def nbytes(self) -> int: ...

    def resume_points(self) -> list[int] | None:
        """The prefix lengths it can be cut back to; None when any."""
        ...

    def copy(self) -> Self: ...

    def to_file(self) -> tuple[list[LayerEntry], list[StateEntry], list[tuple[TensorSpec, memoryview]]]:
        """Its layers, states and tensors as a file holds them; raises UnsupportedCache."""
        ...


C = TypeVar("C", bound=StorableCache)
C_co = TypeVar("C_co", bound=StorableCache, covariant=True)


class CacheReader(Protocol[C_co]):
    """What the store asks of the model a stored file is read for (a CachingModel is one)."""

    def cache_room(self, entry: TensorEntry, max_positions: int, /) -> int:
        """Positions of room to grow to read a key or value tensor with (container.load's ``room``),
        for a request whose cache will hold at most ``max_positions``."""
        ...

    def cache_problem(self, header: Header) -> str | None:
        """What makes a sound header of the model's identity other than what it computes, or None
        (container.load's ``check``)."""
        ...

    def load_cache(self, loaded: LoadedCache) -> C_co:
        """The model's own cache object of a verified file; raises UnsupportedCache where its layers
        are not the model's."""
        ...


class _MemoryCache:
    def __init__(self, identity: Identity, tokens: list[int], cache: StorableCache, offsets: list[int],
                 hashes: list[str]):
        self.identity, self.tokens, self.cache = identity, tokens, cache
        self.offsets, self.hashes = offsets, hashes
        self.last_used = time.time()
        self.nbytes = cache.nbytes


class Candidate(NamedTuple):
    """A stored cache of the model in use, as auto sees it: its ref, the tokens it covers,
    the prefix lengths it can be cut back to (None: any) and, for a file, its tensors' bytes."""

    ref: str
    tokens: list[int]
    resume_points: list[int] | None
    file_tensor_bytes: int = 0


class CacheStore:
    def __init__(self, directory: Path, max_bytes: int | None = None, memory_max_bytes: int | None = None) -> None:
        self.directory = directory
        self.max_bytes = max_bytes  # disk caches beyond it are evicted, least recently used first
        self.memory_max_bytes = memory_max_bytes  # and memory:// caches beyond this
        self._memory: dict[str, _MemoryCache] = {}
        self._pending_writes: dict[str, int] = {}  # tokens a prefill computed, reported by the next generate
        # ref -> ((inode, size, mtime_ns, ctime_ns), header)
        self._headers: dict[str, tuple[tuple[int, int, int, int], Header]] = {}
        self._lock = threading.Lock()
        container.remove_stale_temporaries(directory, SUFFIX)

    # --- writing ------------------------------------------------------------------

    def save(
        self, ref: str, identity: Identity, tokens: list[int], cache: StorableCache, *,
        offsets: list[int], hashes: list[str], written_tokens: int | None,
    ) -> int:
        """Store ``cache`` (covering ``tokens``) under ``ref``; returns its size in bytes.
        ``written_tokens``, if given, is reported by the next generate from ``ref``."""
        if ref.startswith(MEMORY):
            entry = _MemoryCache(identity, list(tokens), cache.copy(), offsets, hashes)
            self._keep_in_memory(ref, entry)
            self._note_writes(ref, written_tokens)
            return entry.nbytes
        try:
            layers, states, tensors = cache.to_file()
            contents = Contents(
                identity=identity, tokens=list(tokens), layers=layers, states=states,
                prefix_offsets=offsets, prefix_hashes=hashes, created_by=f"lm-worker {__version__}",
            )
            self.directory.mkdir(parents=True, exist_ok=True)
            size = container.write(self._path(ref), contents, tensors)
        except UnsupportedCache as exc:
            raise RpcError(ErrorKind.UNSUPPORTED, f"Cannot store {ref!r}: {exc}; use a memory:// ref.") from exc
        except OSError as exc:  # a full disk, a read-only directory, no permission: nothing was stored
            raise _storage_failed(f"Could not store cache {ref!r} as {self._path(ref)}", exc) from exc
        _touch(self._path(ref))
        self._note_writes(ref, written_tokens)
        self._evict(keep=ref)
        return size

    def _keep_in_memory(self, ref: str, entry: _MemoryCache) -> None:
        """Hold ``entry``, first letting go of the least recently used memory caches it does not fit beside."""
        budget = self.memory_max_bytes
        if budget is not None and entry.nbytes > budget:
            raise RpcError(
                ErrorKind.CACHE_TOO_LARGE,
                f"Cache {ref!r} takes {entry.nbytes} bytes, more than all memory caches may together "
                f"(--memory-cache-max-bytes {budget}); store it on disk (a ref without memory://) or raise the limit.",
                field="params.cache",
                limit=budget,
            )
        with self._lock:
            self._memory.pop(ref, None)
            held = sum(e.nbytes for e in self._memory.values())
            for old in sorted(self._memory, key=lambda r: self._memory[r].last_used):
                if budget is None or held + entry.nbytes <= budget:
                    break
                held -= self._memory.pop(old).nbytes
                self._pending_writes.pop(old, None)
            self._memory[ref] = entry

    def reserve_for(self, identity: Identity, max_bytes: int) -> int:
        """Fill memory now for restoring the largest stored cache of ``identity``, with a quarter
        more for positions a request adds (container.reserve), up to 1/RESERVE_SHARE of the
        machine's memory and ``max_bytes``: a restore after a restart then does not wait for
        new memory. Returns the bytes reserved (0: no stored cache of the model, or a
        cache directory that cannot be listed)."""
        try:
            largest = max((c.file_tensor_bytes for c in self.candidates(identity)[0]), default=0)
        except OSError:
            largest = 0
        limit = min(max_bytes, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // RESERVE_SHARE)
        return container.reserve(min(largest * 5 // 4, limit))

    def release_memory(self) -> int:
        """Forget every memory:// cache and the memory reserved for restores (the model they
        belong to is unloaded); returns how many caches."""
        container.reserve(0)
        with self._lock:
            refs = list(self._memory)
            self._memory.clear()
            for ref in refs:
                self._pending_writes.pop(ref, None)
        return len(refs)

    def _note_writes(self, ref: str, written_tokens: int | None) -> None:
        with self._lock:
            if written_tokens is None:
                self._pending_writes.pop(ref, None)
            else:
                self._pending_writes[ref] = written_tokens

    def _evict(self, *, keep: str) -> None:
        """Delete the least recently used disk caches until the directory fits max_bytes."""
        if self.max_bytes is None:
            return
        files: list[tuple[float, int, Path]] = []
        for path in self._files():
            try:
                info = path.lstat()
            except OSError:  # another worker deleted it meanwhile
                continue
            if stat.S_ISREG(info.st_mode):  # caches only: not links, FIFOs or directories named like them
                files.append((info.st_mtime, info.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            if path.name == f"{keep}{SUFFIX}":
                continue
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # a directory this worker may not change: the bound cannot be kept
                log.warning("could not evict %s to keep the cache directory bounded: %s", path.name, exc)
                return
            total -= size

    # --- reading ------------------------------------------------------------------

    def load(
        self, ref: str, identity: Identity, reader: CacheReader[C], *, max_positions: int, field: str = "params.cache",
    ) -> tuple[list[int], C]:
        """The tokens a cache covers and a cache object of them that the caller may change: the
        ``reader``'s own cache type, a file read with the room to grow it asks for a request whose
        cache will hold at most ``max_positions``."""
        if ref.startswith(MEMORY):
            with self._lock:
                entry = self._memory.get(ref)
            if entry is None:
                raise _not_found(ref, field)
            try:
                container.check_identity(ref, entry.identity, identity)
            except IdentityMismatch as exc:
                raise _mismatch(ref, exc, field) from exc
            entry.last_used = time.time()
            # Saved by a model of this identity, so of the type ``reader.load_cache`` makes.
            return list(entry.tokens), cast(C, entry.cache.copy())
        path = self._path(ref)
        try:
            loaded = container.load(
                path, identity, room=lambda entry: reader.cache_room(entry, max_positions), check=reader.cache_problem
            )
        except IdentityMismatch as exc:
            raise _mismatch(ref, exc, field) from exc
        except CacheMissing as exc:  # there is none, or another worker deleted it
            raise _not_found(ref, field) from exc
        except CacheFormatError as exc:
            raise RpcError(
                ErrorKind.CACHE_CORRUPT,
                f"Cache {ref!r} is damaged and was not used: {exc.reason}. Delete it (cache/delete) and prefill again.",
                field=field,
            ) from exc
        try:
            cache = reader.load_cache(loaded)
        except UnsupportedCache as exc:  # its layers are not this model's: a header forged to pass
            raise RpcError(
                ErrorKind.CACHE_CORRUPT,
                f"Cache {ref!r} was not used: {exc}. Delete it (cache/delete) and prefill again.",
                field=field,
            ) from exc
        _touch(path)
        return list(loaded.header.tokens), cache

    def candidates(self, identity: Identity) -> tuple[list[Candidate], list[SkippedCache]]:
        """Every stored cache of ``identity`` (memory and disk), and the disk files passed over
        because their header is damaged. Headers are read once per file version."""
        with self._lock:
            found = [
                Candidate(ref, e.tokens, e.cache.resume_points()) for ref, e in self._memory.items()
                if e.identity == identity
            ]
        skipped: list[SkippedCache] = []
        for path in self._files():
            ref = path.name[: -len(SUFFIX)]
            try:
                found_stat = path.stat()
                # A rewrite by rename is a new inode; one in place changes the times.
                version = (found_stat.st_ino, found_stat.st_size, found_stat.st_mtime_ns, found_stat.st_ctime_ns)
                known = self._headers.get(ref)
                header = known[1] if known and known[0] == version else container.read_header(path)
            except (FileNotFoundError, CacheMissing, OutdatedCache):  # deleted meanwhile, or of another format
                continue
            except CacheFormatError as exc:
                skipped.append(SkippedCache(ref=ref, reason=f"damaged: {exc.reason}"))
                continue
            except OSError as exc:  # a symbolic link loop, no permission to look: not a cache to use
                skipped.append(SkippedCache(ref=ref, reason=f"cannot be read: {exc.strerror or exc}"))
                continue
            self._headers[ref] = (version, header)
            if header.identity == identity:
                # No more than the file holds past its header: a header may claim anything.
                past_header = found_stat.st_size - (header.tensors[0].offset if header.tensors else found_stat.st_size)
                tensor_bytes = max(0, min(sum(e.nbytes for e in header.tensors), past_header))
                found.append(Candidate(ref, header.tokens, header.resume_points, tensor_bytes))
        return found, skipped

    def take_pending_writes(self, ref: str) -> int:
        with self._lock:
            return self._pending_writes.pop(ref, 0)

    # --- cache/list, cache/info, cache/delete -------------------------------------------

    def info(self, ref: str) -> CacheInfo:
        if ref.startswith(MEMORY):
            with self._lock:
                entry = self._memory.get(ref)
            if entry is None:
                raise _not_found(ref)
            return CacheInfo(
                cache=ref, token_count=len(entry.tokens), bytes=entry.nbytes, model_id=entry.identity.model_id,
                created_by=f"lm-worker {__version__}", last_used=entry.last_used,
                prefix_offsets=entry.offsets, prefix_hashes=entry.hashes,
            )
        path = self._path(ref)
        try:
            try:
                header: Header | OldHeader = container.read_header(path)
            except OutdatedCache as exc:  # listed, so that it can be seen and deleted; never used
                header = exc.header
            file_stat = path.stat()
        except (CacheMissing, FileNotFoundError) as exc:  # deleted by another worker meanwhile
            raise _not_found(ref) from exc
        except CacheFormatError as exc:
            raise RpcError(ErrorKind.CACHE_CORRUPT, f"Cache {ref!r} is damaged: {exc.reason}.", field="params.cache") from exc
        return CacheInfo(
            cache=ref, token_count=len(header.tokens), bytes=file_stat.st_size, model_id=header.identity.model_id,
            created_by=header.created_by, last_used=file_stat.st_mtime,
            prefix_offsets=header.prefix_offsets, prefix_hashes=header.prefix_hashes,
        )

    def list(self) -> list[CacheInfo]:
        refs = list(self._memory) + [p.name[: -len(SUFFIX)] for p in self._files()]
        infos: list[CacheInfo] = []
        for ref in refs:
            try:
                infos.append(self.info(ref))
            except RpcError:
                continue  # deleted meanwhile, or damaged: cache/info on it says which
        return sorted(infos, key=lambda info: info.last_used, reverse=True)

    def delete(self, ref: str) -> bool:
        with self._lock:
            self._pending_writes.pop(ref, None)
            if ref.startswith(MEMORY):
                return self._memory.pop(ref, None) is not None
        try:
            self._path(ref).unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:  # a read-only directory, no permission
            raise _storage_failed(f"Could not delete cache {ref!r} ({self._path(ref)})", exc) from exc
        return True

    def _files(self) -> list[Path]:
        """The disk caches; temporaries being written start with a dot and are never listed."""
        if not self.directory.is_dir():
            return []
        return [p for p in self.directory.glob(f"*{SUFFIX}") if not p.name.startswith(".")]

    def _path(self, ref: str) -> Path:
        return self.directory / f"{ref}{SUFFIX}"


def _touch(path: Path) -> None:
    """Mark a cache as just used: eviction goes by modification time. An explicit
    nanosecond time, not the kernel's coarse clock, keeps uses in their real order.
    A cache this worker may not change (another user's, a read-only mount) is used all
    the same; its use is simply not recorded."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:  # deleted by another worker meanwhile, or not ours to change
        pass


def _storage_failed(what: str, exc: OSError) -> RpcError:
    return RpcError(
        ErrorKind.CACHE_STORAGE_FAILED,
        f"{what}: {exc.strerror or exc}. Free some space, or give the worker a cache directory it can write "
        "(--cache-dir).",
        field="params.cache",
    )


def _not_found(ref: str, field: str = "params.cache") -> RpcError:
    return RpcError(
        ErrorKind.CACHE_NOT_FOUND,
        f"No cache {ref!r}; create it with prefill, or see cache/list for the ones there are.",
        field=field,
    )


def _mismatch(ref: str, exc: IdentityMismatch, field: str) -> RpcError:
    # The configuration's digest also names how the worker computes the model (its attention,
    # int8 products and native pass): a cache from another worker version may differ there alone.
    what = "another configuration or arithmetic" if exc.field == "config_sha256" else "another model or tokenizer"
    return RpcError(
        ErrorKind.CACHE_IDENTITY_MISMATCH,
        f"Cache {ref!r} was computed by {what} ({exc.field} is {exc.found!r} there, "
        f"{exc.expected!r} here), so it cannot be used; prefill it again with this model.",
        field=field,
    )
