"""Torch's intra-op threads on the worker's threads other than the model's.

The model thread runs the decode steps with torch's default intra-op threads (one per
core). Each other OS thread that runs a parallel torch operation gets an OpenMP thread
pool of its own, and while such a pool exists, more OpenMP threads exist than cores:
OpenMP then lets idle threads sleep at once instead of spinning briefly, and each of the
several hundred small parallel operations of a decode step waits for its threads to wake.
Measured on SmolLM2 with int8 weights on 2 cores: 25 ms a step alone, 46–52 ms while the
cache I/O thread that had stored a cache was alive. Torch work on the other threads
(restoring, copying and storing caches) therefore runs on one thread, which makes no pool.
"""

from __future__ import annotations

import sys
import threading

_state = threading.local()


def keep_to_one_thread() -> None:
    """Make torch's operations on the calling thread single-threaded; a no-op until torch has
    been imported (by a backend's ``load``), and after the first time on a thread."""
    if getattr(_state, "kept", False) or "torch" not in sys.modules:
        return
    import torch

    torch.set_num_threads(1)  # for the calling thread: OpenMP's thread count is per thread
    _state.kept = True
