"""A model's cache as lm-worker keeps it, and its KVC2 tensors. Imports torch: use only
from the transformers backend.

A cache has one layer per model layer, of one of a few kinds (cache_layers.py holds
lm-worker's class of each). What each kind allows decides how far a cache can be cut
back, and so how much of it a later prompt can reuse:

- full attention keeps every position: cut anywhere;
- sliding window: transformers keeps only the window, which could not be cut back
  past it. lm-worker's sliding layers keep every position (they still attend to
  their window only, with bit-identical results), so they cut anywhere too;
- linear attention (conv and recurrent states): a state summarises every position
  before it and cannot be cut at all. ``TorchCache`` therefore keeps copies of these
  states at chosen positions (checkpoints): the cache can be cut back to those;
- no state (layers that share another's cache, or have no attention): nothing to do.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence

import torch

from worker.backends.transformers import cache_layers, hf_compat
from worker.backends.transformers.cache_layers import KeysAndValues, LayerState, LinearStates
from worker.backends.transformers.kv_buffers import growth_room
from worker.kvcache.container import (
    LayerEntry, LoadedCache, StateEntry, TensorEntry, TensorKind, TensorSpec, UnsupportedCache, cut_point,
)

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
# Each request keeps two (before and after its prompt's last token), so a cache carries the
# checkpoints of its last few turns.
MAX_CHECKPOINTS = 16


class TorchCache:
    """transformers' DynamicCache of lm-worker's own layers (cache_layers) for one sequence, and
    the linear-attention states at the positions it can be cut back to (``checkpoints``; empty
    for a model without such layers).

    Every forward goes through ``feed`` (or, for a decode step of a Llama-architecture model,
    decode_step.DecodeStep, which appends to the same layers and counts the same way), so
    ``length`` is always the number of positions the cache covers, whatever kinds of layers
    it has."""

    def __init__(self, config) -> None:
        self._config = config
        self.kv = cache_layers.new_cache(config)
        self.length = 0
        self.checkpoints: dict[int, dict[int, LayerState]] = {}  # position -> layer index -> its states
        self.kinds: list[hf_compat.CacheLayerKind] = [cache_layers.layer_kind(layer) for layer in self.kv.layers]

    @property
    def has_states(self) -> bool:
        return any("linear" in kind for kind in self.kinds)

    def feed(self, model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the last of ``input_ids``, which the cache then covers too."""
        logits = hf_compat.forward(model, input_ids, self.kv)
        self.length += input_ids.shape[1]
        return logits

    def checkpoint(self) -> None:
        """Remember the linear-attention states at the current position, so the cache can be cut
        back here. The newest MAX_CHECKPOINTS are kept: a long conversation's file stays bounded."""
        if self.has_states and self.length > 0:
            self.checkpoints[self.length] = {
                index: layer.snapshot() for index, layer in enumerate(self.kv.layers) if isinstance(layer, LinearStates)
            }
            for position in sorted(self.checkpoints)[:-MAX_CHECKPOINTS]:
                del self.checkpoints[position]

    def resume_points(self) -> list[int] | None:
        """The lengths the cache can be cut back to: None when any."""
        if all(kind in ("full", "sliding", "none") for kind in self.kinds):
            return None
        if any(kind in ("sliding+linear", "other") for kind in self.kinds):
            return sorted({0, self.length})  # no checkpoints of a sliding window's contents
        return sorted({0, self.length, *self.checkpoints})

    def reusable(self, tokens: int) -> int:
        """The longest prefix of at most ``tokens`` positions that the cache can be cut back to."""
        return cut_point(self.resume_points(), min(tokens, self.length))

    def crop(self, keep: int) -> None:
        """Keep the first ``keep`` positions; ``keep`` must be one that ``reusable`` gives."""
        if keep == self.length:
            return
        if self.reusable(keep) != keep:
            raise ValueError(f"this cache cannot be cut back to {keep} positions (it can to {self.resume_points()})")
        if keep == 0:
            self.kv, self.length, self.checkpoints = cache_layers.new_cache(self._config), 0, {}
            return
        for index, layer in enumerate(self.kv.layers):
            if isinstance(layer, KeysAndValues):
                layer.keep_first(keep)
            if isinstance(layer, LinearStates):
                layer.restore_states(self.checkpoints[keep][index], keep)
        self.length = keep
        self.checkpoints = {p: states for p, states in self.checkpoints.items() if p <= keep}

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for *_, tensor in self._parts())

    def copy(self) -> TorchCache:
        twin = copy.deepcopy(self, {id(self._config): self._config})  # the tensors, not the model's config
        for layer in twin.kv.layers:
            if isinstance(layer, KeysAndValues):
                layer.compact()
        return twin

    # --- to and from a file ----------------------------------------------------------

    def layer_entries(self) -> list[LayerEntry]:
        """The layers as a KVC2 file describes them; UnsupportedCache where a file cannot hold one."""
        entries = []
        for i, (kind, layer) in enumerate(zip(self.kinds, self.kv.layers)):
            if kind == "sliding+linear" or kind == "other":
                raise UnsupportedCache(
                    "this model has cache layers that a cache file cannot hold yet (a sliding window and a "
                    "linear-attention state in one layer, or a class lm-worker does not know)"
                )
            window = getattr(layer, "sliding_window", None) if "sliding" in kind else None
            entries.append(LayerEntry(index=i, kind=kind, sliding_window=window))
        return entries

    def to_file(self) -> tuple[list[LayerEntry], list[StateEntry], list[tuple[TensorSpec, memoryview]]]:
        """The layers, the states at every resume point, and the tensors, as a KVC2 file holds them."""
        layers = self.layer_entries()
        states = [
            StateEntry(layer=layer, state=state, position=position, has_previous_state=flag)
            for position, layers in sorted(self._states_by_position().items())
            for layer, snapshot in layers.items()
            for state, flag in snapshot.has_previous_state.items()
            if snapshot.conv[state] is not None or snapshot.recurrent[state] is not None
        ]
        return layers, states, self._tensors()

    def _states_by_position(self) -> dict[int, dict[int, LayerState]]:
        if not self.has_states or self.length == 0:
            return {}
        current = {i: layer.snapshot(clone=False) for i, layer in enumerate(self.kv.layers) if isinstance(layer, LinearStates)}
        return {**self.checkpoints, self.length: current}

    def _tensors(self) -> list[tuple[TensorSpec, memoryview]]:
        return [
            _spec(name, kind, layer, tensor, state=state, position=position)
            for name, kind, layer, state, position, tensor in self._parts()
        ]

    def _parts(self) -> Iterator[tuple[str, TensorKind, int, int, int | None, torch.Tensor]]:
        """Every tensor the cache holds, in file order: (name, kind, layer, state, position, tensor)."""
        for index, layer in enumerate(self.kv.layers):
            if isinstance(layer, KeysAndValues) and self.length:
                keys, values = layer.state
                yield f"layers.{index}.key", "key", index, 0, None, keys
                yield f"layers.{index}.value", "value", index, 0, None, values
        for position, layers in sorted(self._states_by_position().items()):
            for index, snapshot in layers.items():
                for state in snapshot.has_previous_state:
                    conv, recurrent = snapshot.conv[state], snapshot.recurrent[state]
                    if conv is not None:
                        yield f"layers.{index}.conv.{state}@{position}", "conv", index, state, position, conv
                    if recurrent is not None:
                        yield f"layers.{index}.recurrent.{state}@{position}", "recurrent", index, state, position, recurrent

    @classmethod
    def from_file(cls, loaded: LoadedCache, config, device: str) -> TorchCache:
        """The cache of a verified file read into memory. Keys and values stay views of that
        memory on the CPU (read with room to grow, room_to_grow, a layer's forwards append
        to them in place); states are copied, as the model updates them in place."""
        cache = cls(config)
        header = loaded.header
        if [entry.kind for entry in header.layers] != cache.kinds:
            raise UnsupportedCache("the file's layer kinds are not this model's")  # the identity rules this out
        kv: dict[int, dict[str, torch.Tensor]] = {}
        states: dict[int, dict[int, LayerState]] = {}
        flags = {(s.layer, s.state, s.position): s.has_previous_state for s in header.states}
        for entry, view, shape in zip(header.tensors, loaded.tensors, loaded.shapes, strict=True):
            tensor = torch.frombuffer(view, dtype=_TORCH_DTYPES[entry.dtype]).reshape(shape).to(device)
            if entry.kind in ("key", "value"):
                kv.setdefault(entry.layer, {})[entry.kind] = tensor
                continue
            assert entry.position is not None  # the reader checked it
            snapshot = states.setdefault(entry.position, {}).setdefault(entry.layer, LayerState({}, {}, {}))
            snapshot.has_previous_state[entry.state] = flags[(entry.layer, entry.state, entry.position)]
            getattr(snapshot, entry.kind)[entry.state] = tensor
            other = "recurrent" if entry.kind == "conv" else "conv"
            getattr(snapshot, other).setdefault(entry.state, None)
        for index, pair in kv.items():
            layer = cache.kv.layers[index]
            assert isinstance(layer, KeysAndValues)  # the file's layer kinds are the cache's
            layer.restore(pair["key"], pair["value"], header.sequence_length)
        cache.length = header.sequence_length
        for index, snapshot in states.get(cache.length, {}).items():
            layer = cache.kv.layers[index]
            assert isinstance(layer, LinearStates)
            layer.restore_states(snapshot, cache.length)
        cache.checkpoints = states  # the end too: once fed further, the cache can still come back to it
        return cache


def room_to_grow(kinds: Sequence[str], device: str, entry: TensorEntry, max_positions: int) -> int:
    """How many positions of room to grow to leave after a stored key or value tensor's when
    reading it (container.load), for a cache whose layers are of ``kinds`` and that will hold
    at most ``max_positions`` positions: room for those, up to what a layer's buffers get when a
    forward appends to them. Only full-attention and sliding-window layers on the CPU append in
    place (others keep tensors of their own making). The room is resident memory from the start (huge
    pages), so no more than the request can use: a cache that outgrows it moves into
    larger buffers then, as a computed one does."""
    if device != "cpu" or kinds[entry.layer] not in ("full", "sliding"):
        return 0
    return growth_room(entry.shape[2], max_positions)


def _spec(
    name: str, kind: TensorKind, layer: int, tensor: torch.Tensor, *, state: int = 0, position: int | None = None
) -> tuple[TensorSpec, memoryview]:
    tensor = tensor.detach().to("cpu").contiguous()
    spec = TensorSpec(
        name=name, kind=kind, layer=layer, shape=tuple(tensor.shape), dtype=_DTYPES[tensor.dtype],
        state=state, position=position,
    )
    return spec, tensor.view(torch.uint8).numpy().data.cast("B")

