"""A sequence's keys and values as native_forward.c reads and writes them, in numpy buffers:
the cache of the torch-free pass (gguf_pass). Torch-free.

The layout and growth are cache_layers.GrowingKeysAndValues' (TransposedKeys serves both): per
layer, keys and values in buffers (kv_heads, capacity, dim) of float32 with room to grow
(``growth_capacity``), the pass writing a chunk's positions past the ones
held and the layer then holding them (``hold``); a decode step's keys also kept transposed
in tiles (kv_heads, capacity + TRANSPOSED_ROOM, dim) with a count of the keys written there,
which the kernel brings up to its position. A sliding-window layer keeps every position too
(the pass attends its window), so a cache can be cut back anywhere (``Cache.crop``).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any

import numpy as np

# Room a layer's transposed keys keep past its buffers' positions: exact_attention.c's tiles of
# up to 16 keys reach two tiles past the last key at most (lmw_step_attention).
TRANSPOSED_ROOM = 32


def growth_capacity(positions: int) -> int:
    """How many positions a buffer with room to grow is made for, holding ``positions``."""
    return max(positions * 3 // 2, positions + 256)


def growth_room(positions: int, max_positions: int) -> int:
    """How many positions of room to leave past a stored buffer's ``positions`` when reading it,
    for a cache that will hold at most ``max_positions``: what a buffer grown to hold it gets,
    but no more than the request can use (the room is resident memory from the start)."""
    return max(0, min(growth_capacity(positions), max_positions) - positions)


class TransposedKeys:
    """A layer's keys as exact_attention.c's decode step reads them (tiles of keys, dimension-
    major), kept from one step to the next: a step then transposes its new key (and the tile
    it ends in), where transposing every key again cost as much as the attention itself at a
    few thousand keys. Made for the key buffer whose memory starts at ``source`` (a numpy array's
    or a torch tensor's: ``tiles`` is of the same kind), its first ``valid`` keys written; the
    kernel writes them, so it holds the keys' own numbers, and counts them in ``count`` (an int64
    where a step's call finds it without a line of Python; not a tensor, which made in inference
    mode could not be cut back outside it). It takes as much memory as the keys: a decoding
    sequence's layers half as much again as their keys and values (a prompt's chunks make none)."""

    __slots__ = ("source", "count", "tiles")

    def __init__(self, source: int, tiles: Any) -> None:
        self.source = source
        self.count = array.array("q", [0])
        self.tiles = tiles  # (kv_heads, capacity + TRANSPOSED_ROOM, dim) float32

    @property
    def valid(self) -> int:
        """How many keys, from the first, are here."""
        return self.count[0]

    @valid.setter
    def valid(self, keys: int) -> None:
        self.count[0] = keys

    def holds(self, source: int, capacity: int) -> bool:
        """Whether this is of the key buffer at ``source``, with room for its ``capacity`` positions."""
        return self.source == source and self.tiles.shape[1] == capacity + TRANSPOSED_ROOM


class KeysAndValues:
    """One layer's keys and values of every position, in buffers with room to grow
    (native_pass.PassLayer: what a pass reads and writes of it)."""

    __slots__ = ("kv_heads", "dim", "buffers", "length", "transposed")

    def __init__(self, kv_heads: int, dim: int) -> None:
        self.kv_heads, self.dim = kv_heads, dim
        self.buffers: tuple[np.ndarray, np.ndarray] | None = None
        self.length = 0  # positions held
        self.transposed: TransposedKeys | None = None

    @property
    def capacity(self) -> int:
        """How many positions the buffers hold room for (0 without buffers)."""
        return 0 if self.buffers is None else self.buffers[0].shape[1]

    @property
    def keys(self) -> np.ndarray:
        """The keys of the positions held, (kv_heads, length, dim)."""
        return self._held(0)

    @property
    def values(self) -> np.ndarray:
        """The values of the positions held, (kv_heads, length, dim)."""
        return self._held(1)

    def _held(self, side: int) -> np.ndarray:
        if self.buffers is None:
            return np.empty((self.kv_heads, 0, self.dim), np.float32)
        return self.buffers[side][:, : self.length]

    def reserve(self, total: int) -> tuple[np.ndarray, np.ndarray]:
        """Buffers (contiguous) with room for ``total`` positions, beginning with the layer's
        own: the present ones, or larger ones they are copied into."""
        buffers = self.buffers
        if buffers is None or buffers[0].shape[1] < total:
            shape = (self.kv_heads, growth_capacity(total), self.dim)
            grown = (np.empty(shape, np.float32), np.empty(shape, np.float32))
            held = self.length
            if held:
                assert buffers is not None
                grown[0][:, :held], grown[1][:, :held] = buffers[0][:, :held], buffers[1][:, :held]
            self.buffers = buffers = grown
        return buffers

    def hold(self, total: int) -> None:
        """Hold the first ``total`` positions of the buffers (written there)."""
        assert self.buffers is not None
        self.length = total

    def keep_first(self, keep: int) -> None:
        """Cut the layer back to its first ``keep`` positions (those past it are written anew)."""
        self.length = min(self.length, keep)
        if self.transposed is not None:
            self.transposed.valid = min(self.transposed.valid, keep)

    def transposed_keys(self) -> TransposedKeys:
        """The keys of the buffers (reserve made them) as a decode step reads them, transposed
        up to ``valid``; the step's call brings them up to its own position and counts them."""
        assert self.buffers is not None
        keys = self.buffers[0]
        if self.transposed is None or not self.transposed.holds(keys.ctypes.data, keys.shape[1]):
            heads, capacity, dim = keys.shape
            self.transposed = TransposedKeys(keys.ctypes.data, np.empty((heads, capacity + TRANSPOSED_ROOM, dim), np.float32))
        return self.transposed

    def place(self, total: int, transposed: bool) -> tuple[int, ...]:
        """What a pass reads of the layer with room for ``total`` positions: the buffers'
        addresses and the floats between their heads, and where ``transposed`` (a step's), the
        transposed keys' tiles, the floats between their heads and their count's address."""
        keys, values = self.reserve(total)
        numbers = (keys.ctypes.data, values.ctypes.data, keys.shape[1] * self.dim, values.shape[1] * self.dim)
        if not transposed:
            return (*numbers, 0, 0, 0)
        kept = self.transposed_keys()
        return (*numbers, kept.tiles.ctypes.data, kept.tiles.shape[1] * self.dim, kept.count.buffer_info()[0])

    def placed(self) -> tuple[object, object]:
        """What the places a pass gathered depend on: the buffers and the transposed keys."""
        return self.buffers, self.transposed


class Cache:
    """One sequence's keys and values, a KeysAndValues for each layer, and the positions they
    hold (``length``)."""

    def __init__(self, layers: int, kv_heads: int, dim: int) -> None:
        self.layers: Sequence[KeysAndValues] = tuple(KeysAndValues(kv_heads, dim) for _ in range(layers))
        self.length = 0

    def reusable(self, tokens: int) -> int:
        """The longest prefix of at most ``tokens`` positions the cache can be cut back to: any."""
        return min(tokens, self.length)

    def crop(self, keep: int) -> None:
        """Keep the first ``keep`` positions."""
        if not 0 <= keep <= self.length:
            raise ValueError(f"this cache of {self.length} positions cannot be cut back to {keep}")
        for layer in self.layers:
            layer.keep_first(keep)
        self.length = keep
