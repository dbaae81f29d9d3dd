"""Python's cycle collector around a loaded model.

A loaded model leaves a few hundred thousand objects the collector tracks (the model's
modules, PyTorch's and transformers' own); a full collection walks them all, and the
allocations of streaming trigger one every few seconds: a pause for every stream in the
middle of its tokens (bench/README.md, "Figures behind constants"). Once a model is loaded
the heap is frozen (``gc.freeze``: the collector leaves those objects alone from then on;
reference counting still frees them); unloading thaws it, and collects where a reference
cycle holds the model, so that it is freed now and not frozen again by the next load.
"""

from __future__ import annotations

import gc
import logging
import os
import weakref
from collections.abc import Callable

log = logging.getLogger(__name__)


def settle() -> None:
    """After a load: keep the heap out of collections. Not collected first: a load leaves next
    to nothing in cycles, and a collection in a process that imported PyTorch walks all of its
    objects (bench/README.md), a cost every load would pay."""
    gc.freeze()
    if log.isEnabledFor(logging.INFO):  # the count walks the frozen objects
        log.info("%d objects kept out of the cycle collector's full collections", gc.get_freeze_count())


def outlives(model: object) -> Callable[[], bool]:
    """Whether ``model`` is still alive, asked after its last reference is dropped (True where
    it cannot be watched)."""
    try:
        watched = weakref.ref(model)
    except TypeError:
        return lambda: True
    return lambda: watched() is not None


def thaw(*, collect: bool) -> None:
    """After an unload: let the collector see everything again, and collect now where a cycle
    holds the model (``collect``: a model freed by its references alone needs nothing more);
    at the worker's end, the unfreezing alone (a worker in a host's process leaves the host's
    heap as it found it)."""
    gc.unfreeze()
    if collect:
        gc.collect()


def resident_bytes() -> int | None:
    """This process's resident memory in bytes (/proc/self/statm), None where there is none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
