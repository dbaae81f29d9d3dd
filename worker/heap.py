"""Python's cycle collector around a loaded model.

A loaded model leaves a few hundred thousand objects the collector tracks (the model's
modules, PyTorch's and transformers' own); a full collection walks them all, about 170 ms
for SmolLM2, and the allocations of streaming trigger one every few seconds: a pause for
every stream in the middle of its tokens (4.6% of 4 streams' time). Once a model is loaded
the heap is collected once and frozen (``gc.freeze``: the collector leaves those objects
alone from then on; reference counting still frees them); unloading thaws it and collects,
so that the model's own cycles are freed with it and not frozen by the next load.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """After a load: free what the load left in cycles, then keep the rest out of collections."""
    gc.collect()
    gc.freeze()


def thaw(*, collect: bool = True) -> None:
    """After an unload: let the collector see everything again, and free the model's cycles now
    (``collect``); at the worker's end, the unfreezing alone (a worker in a host's process
    leaves the host's heap as it found it)."""
    gc.unfreeze()
    if collect:
        gc.collect()
