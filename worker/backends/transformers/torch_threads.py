"""Torch's intra-op threads: one on the worker's threads other than the model's, and on the
model's thread as many as the cores other processes leave free.

The model thread runs the decode steps with torch's default intra-op threads (one per
core). Each other OS thread that runs a parallel torch operation gets an OpenMP thread
pool of its own, and while such a pool exists, more OpenMP threads exist than cores:
OpenMP then lets idle threads sleep at once instead of spinning briefly, and each of the
several hundred small parallel operations of a decode step waits for its threads to wake
(bench/README.md, "Figures behind constants", has what that cost). Torch work on the other
threads (restoring, copying and storing caches) therefore runs on one thread, which makes no
pool.

A core another process keeps busy (the Node host, a build) hurts the same way: each of those
small operations waits at its end for the thread that shares a core with that process, and
one thread on a core of its own is faster than two that share one with it (bench/README.md).
:class:`CoreShare` measures how much of the cores others use and gives the model thread one
thread fewer for each core they take.

It does so only for a model whose every pass is the worker's native pass (native_forward.c:
the int8 and gguf products split their outputs between threads, never a sum, and the
attention kernel fixes its order), where the thread count changes no number the model
computes: a cache computed on two threads gives the same tokens on one. Any other pass
(dense weights, transformers' forward, the layers' PyTorch operations) multiplies through a
library whose order is its own: MKL's sgemm splits a product's inner dimension among threads
on some processors (Intel's), so its last bits follow the thread count. Such a model keeps the
count it was loaded with, and its cache identity names that count and the processor
(:func:`library_arithmetic`), so a cache is read only where those numbers would be the same.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

# A kernel call of less work than this (multiply-adds) runs on the calling thread alone: waking
# the other threads costs more than they would save. The native pass (native_forward.c) is
# handed the same number.
SHARE_FROM = 1 << 16


def attention_work(pairs: int, dim: int) -> int:
    """The multiply-adds of attention over ``pairs`` query-key pairs of ``dim``-float heads: a
    score and a weighted sum each (native_forward.c counts them the same way), so that
    attention is measured against SHARE_FROM in the products' unit: counted in pairs, a decode
    step's attention at a long context would stay on one thread."""
    return pairs * 2 * dim

_state = threading.local()


def threads_for(work: int) -> int:
    """The threads a kernel call of ``work`` takes: torch's intra-op threads, one below SHARE_FROM."""
    import torch

    return torch.get_num_threads() if work >= SHARE_FROM else 1


def library_arithmetic() -> str:
    """What a pass computed by library products depends on besides the model: the calling
    thread's torch thread count (the model thread's, at load) and the processor, whose kind
    picks the library's code paths."""
    import torch

    return f"{torch.get_num_threads()} threads on {processor_name()}"


def processor_name() -> str:
    """The processor's model name as /proc/cpuinfo gives it, else the platform's."""
    import platform

    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                key, _, value = line.partition(b":")
                if key.strip() == b"model name":
                    return value.strip().decode(errors="replace")
    except OSError:
        pass
    return platform.processor() or platform.machine()


def keep_to_one_thread() -> None:
    """Make torch's operations on the calling thread single-threaded; a no-op until torch has
    been imported (by a backend's ``load``), and after the first time on a thread."""
    if getattr(_state, "kept", False) or "torch" not in sys.modules:
        return
    import torch

    torch.set_num_threads(1)  # for the calling thread: OpenMP's thread count is per thread
    _state.kept = True


TAKE_AT = 0.5  # a core counts as taken once other processes keep more than half of one busy
GIVE_BACK_BELOW = 0.3  # and is given back once they use less than 0.3 of it: no flapping at the edge
INTERVAL_S = 0.25  # how often the model thread looks (a reading of /proc/stat is cheap beside a step)
STALE_S = 1.0  # a longer look spans a time the model was idle: start a new one instead


def cores_taken(others: float, taken: int, most: int) -> int:
    """How many cores count as taken by other processes that use ``others`` cores on
    average, when ``taken`` did before; at most ``most``."""
    while taken < most and others > taken + TAKE_AT:
        taken += 1
    while taken > 0 and others < taken - 1 + GIVE_BACK_BELOW:
        taken -= 1
    return taken


def cpu_seconds() -> tuple[float, float]:
    """(seconds the CPUs this process may run on spent busy, by anyone; this process's CPU
    seconds), from /proc/stat (OSError where there is none)."""
    allowed = {f"cpu{n}" for n in os.sched_getaffinity(0)}
    busy = 0
    with open("/proc/stat", "rb") as f:
        for line in f:
            if not line.startswith(b"cpu"):
                break
            fields = line.split()
            if fields[0].decode() in allowed:
                ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
                busy += sum(ticks) - ticks[3] - ticks[4] - ticks[7]
    return busy / os.sysconf("SC_CLK_TCK"), time.process_time()


class ThreadCount(Protocol):
    """A thread count CoreShare reads once and then sets."""

    def get(self) -> int: ...

    def set(self, threads: int) -> None: ...


class TorchThreads:
    """torch's intra-op threads on the calling thread."""

    def get(self) -> int:
        import torch

        return torch.get_num_threads()

    def set(self, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)


class PassThreads:
    """The thread count of a torch-free native pass (gguf_pass.GgufPass.threads)."""

    def __init__(self, passes: Any) -> None:
        self._passes = passes

    def get(self) -> int:
        return self._passes.threads

    def set(self, threads: int) -> None:
        self._passes.threads = threads


class CoreShare:
    """The model thread's torch threads, one fewer for each core other processes take from
    them (their load past the cores those threads leave free: none on 2 cores and 2 threads).

    ``adjust`` is called before the model's work (a step, a prompt chunk); on the thread that
    called it first (the model thread; side threads keep to one), at most every INTERVAL_S it
    compares the busy time of the CPUs this process may use with its own
    CPU time, and sets the thread count. Where the CPU times cannot be read (no /proc/stat),
    the count stays as it is."""

    def __init__(
        self,
        read: Callable[[], tuple[float, float]] = cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
        cpus: Callable[[], int] = lambda: len(os.sched_getaffinity(0)),
        count: ThreadCount | None = None,
    ):
        """``count``: the thread count it sets (torch's intra-op threads if None)."""
        self._read = read
        self._clock = clock
        self._cpus = cpus
        self._count = count if count is not None else TorchThreads()
        self._thread: int | None = None  # the thread whose count it sets
        self._most: int | None = None  # that thread's count before the first adjust
        self._taken = 0
        self._last: tuple[float, float, float] | None = None  # (when, busy, own)

    @property
    def threads(self) -> int | None:
        return None if self._most is None else max(1, self._most - self._taken)

    def adjust(self) -> None:
        now = self._clock()
        if self._most is None:
            self._thread, self._most = threading.get_ident(), self._count.get()
        elif threading.get_ident() != self._thread:
            return
        elif self._last is not None and now - self._last[0] < INTERVAL_S:
            return
        try:
            busy, own = self._read()
        except (OSError, ValueError):
            return
        last, self._last = self._last, (now, busy, own)
        if last is None or now - last[0] > STALE_S or self._most < 2:
            return
        others = max(0.0, (busy - last[1]) - (own - last[2])) / (now - last[0])
        spare = max(0, self._cpus() - self._most)  # cores the model's threads leave to others anyway
        taken = cores_taken(max(0.0, others - spare), self._taken, self._most - 1)
        if taken != self._taken:
            self._taken = taken
            self._count.set(max(1, self._most - taken))
            log.info(
                "model threads: %d of %d, other processes keep %.1f of the cores busy",
                self._most - taken, self._most, others,
            )
