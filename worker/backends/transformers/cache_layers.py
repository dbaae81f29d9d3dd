"""lm-worker's own cache layers, which the model's forward and decode_step fill.

transformers builds one cache layer per model layer; new_cache puts one of these classes in
place of each layer of a kind lm-worker knows (hf_compat.layer_kind), with the same settings.
Each extends transformers' class of that kind, so that transformers' forward uses it as its
own, and adds what lm-worker needs and transformers' does not do:

- FullAttentionLayer and SlidingWindowLayer grow in place (GrowingKeysAndValues: buffers
  with room to grow, no copy of the whole cache at every step) and keep a float64 copy of
  their positions for WIDE_ATTENTION;
- SlidingWindowLayer keeps every position (transformers keeps only the window, which could
  not be cut back past it), while attention still gets exactly the window transformers'
  layer hands it;
- layers with linear-attention states (conv and recurrent) snapshot and restore them.

The rest of the package uses their small interface (KeysAndValues: state, keep_first, restore,
compact; GrowingKeysAndValues: update_and_fetch, reserve, take, wide_state, transposed_keys, and
a sliding layer's window; LinearStates: snapshot, restore_states), not transformers' fields;
what lm-worker reads of transformers' internals, and what differs between its versions, is in
hf_compat.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from worker.backends.transformers import hf_compat
from worker.backends.transformers.kv_buffers import TRANSPOSED_ROOM, TransposedKeys, growth_capacity
from worker.kvcache.container import LayerKind


def new_cache(config) -> hf_compat.DynamicCache:
    """A cache with the model's layer kinds, each layer one of lm-worker's own where it knows the kind."""
    return hf_compat.new_cache(config, _own)


def layer_kind(layer) -> hf_compat.CacheLayerKind:
    """The kind of a cache layer (hf_compat.LAYER_KINDS): "none" for layers without a cache,
    "other" for a class lm-worker does not know."""
    return layer.kind if isinstance(layer, KeysAndValues | LinearStates) else hf_compat.layer_kind(layer)


class KeysAndValues:
    """What every layer that keeps keys and values offers. Where they are every position the
    cache covers (full attention, and SlidingWindowLayer, which records them), the layer can be
    cut back anywhere."""

    kind: LayerKind
    if TYPE_CHECKING:  # given by the transformers class each layer extends
        keys: Any
        values: Any
        is_initialized: bool

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None: ...

    @property
    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of every position, (batch, kv_heads, positions, dim) each."""
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def keep_first(self, keep: int) -> None:
        """Cut the layer back to its first ``keep`` positions."""
        self.keys, self.values = self.state[0][..., :keep, :], self.state[1][..., :keep, :]
        if hasattr(self, "cumulative_length"):  # a sliding window's count of positions
            self.cumulative_length = keep

    def restore(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Take keys and values of ``length`` positions as the layer's (a cache read from a file)."""
        self.lazy_initialization(keys, values)  # transformers' layer's: device and dtype
        self.keys, self.values = keys[..., :length, :], values[..., :length, :]
        if hasattr(self, "cumulative_length"):
            self.cumulative_length = length

    def compact(self) -> None:
        """Hold nothing but the positions (a copy kept for later); nothing to do here."""


class WideCopy:
    """A full-attention layer's keys and values in a wider dtype (float64 for WIDE_ATTENTION),
    made from the buffers whose memory starts at ``source``, correct for their first ``valid``
    positions, with room to grow as the buffers have."""

    __slots__ = ("source", "valid", "keys", "values")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> None:
        capacity = growth_capacity(keys.shape[-2])
        self.source = keys.data_ptr()
        self.valid = 0
        self.keys = keys.new_empty((*keys.shape[:-2], capacity, keys.shape[-1]), dtype=dtype)
        self.values = values.new_empty((*values.shape[:-2], capacity, values.shape[-1]), dtype=dtype)

    def holds(self, keys: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether this copy is of these keys' buffers, in ``dtype``, with room for all of them."""
        return self.source == keys.data_ptr() and self.keys.dtype == dtype and self.keys.shape[-2] >= keys.shape[-2]

    def of(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The copy of ``keys`` and ``values``, converting only the positions not converted yet."""
        total = keys.shape[-2]
        if self.valid < total:
            self.keys[..., self.valid:total, :] = keys[..., self.valid:total, :]
            self.values[..., self.valid:total, :] = values[..., self.valid:total, :]
            self.valid = total
        return self.keys[..., :total, :], self.values[..., :total, :]


class GrowingKeysAndValues(KeysAndValues):
    """Keys and values of every position in buffers with room to grow.

    transformers' layers concatenate, which copies the whole cache at every decode step
    (90 MB a step at 2,000 positions of SmolLM2). Here the buffers grow by half again (at least
    256 positions) when full, and ``keys`` and ``values`` are views of their used part; cutting
    back keeps them views, and tensors restored from elsewhere move into new buffers at the
    next append (or are the buffers, when read with room to grow).

    A native pass writes a step's position into every layer at once; making each layer's two
    views then cost about a twentieth of a four-sequence step, so it only says how many
    positions the layer holds (``hold``), and the views are made when next read (by the one
    thread that uses the cache at a time, as every method here assumes)."""

    _unviewed: int | None = None  # positions recorded by hold whose views are not made yet

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.wide: WideCopy | None = None
        self.transposed: TransposedKeys | None = None

    @property
    def keys(self) -> Any:
        self._make_views()
        return self._keys

    @keys.setter
    def keys(self, keys: Any) -> None:
        self._make_views()
        self._keys = keys

    @property
    def values(self) -> Any:
        self._make_views()
        return self._values

    @values.setter
    def values(self, values: Any) -> None:
        self._make_views()
        self._values = values

    def _make_views(self) -> None:
        """The keys' and values' views of the positions ``hold`` recorded, where it recorded any."""
        total = self._unviewed
        if total is not None:
            assert self.buffers is not None
            self._unviewed = None
            self._keys, self._values = self.buffers[0].narrow(2, 0, total), self.buffers[1].narrow(2, 0, total)

    @property
    def capacity(self) -> int:
        """How many positions the buffers hold room for (0 without buffers)."""
        return 0 if self.buffers is None else self.buffers[0].shape[-2]

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append positions; the keys and values of all of them."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        length = self.length
        total = length + keys.shape[-2]
        buffers = self.reserve(total, keys, values)
        buffers[0][..., length:total, :] = keys
        buffers[1][..., length:total, :] = values
        return self.take(total)

    @property
    def length(self) -> int:
        """How many positions the layer holds."""
        if self._unviewed is not None:
            return self._unviewed
        keys = self.keys
        return keys.shape[-2] if keys is not None and keys.dim() == 4 else 0

    def reserve(self, total: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers (contiguous) with room for ``total`` positions, beginning with the layer's own:
        the present ones, or larger ones they are copied into; ``keys`` and ``values`` are of
        the positions to come (their shape but for the positions, and their dtype)."""
        length = self.length
        buffers = self.buffers
        if buffers is None or buffers[0].shape[-2] < total or (length and not _starts(self.keys, buffers[0])):
            capacity = growth_capacity(total)
            buffers = (
                keys.new_empty((*keys.shape[:-2], capacity, keys.shape[-1])),
                values.new_empty((*values.shape[:-2], capacity, values.shape[-1])),
            )
            if length:
                buffers[0][..., :length, :] = self.keys
                buffers[1][..., :length, :] = self.values
            self.buffers = buffers
        return buffers

    def hold(self, total: int) -> None:
        """Hold the first ``total`` positions of the buffers (written there)."""
        assert self.buffers is not None
        self._unviewed = total

    def take(self, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hold the first ``total`` positions of the buffers (written there); their keys and values."""
        self.hold(total)
        return self.keys, self.values

    def wide_state(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values in ``dtype`` (float64 for WIDE_ATTENTION).

        Converting every position at every step costs more than the attention itself at a few
        thousand positions; so a copy in ``dtype`` is kept beside the buffers and only positions
        appended since are converted. Cut back, its valid part shrinks; keys and values restored
        from elsewhere or moved into larger buffers are converted again, once."""
        keys, values = self.state
        if self.wide is None or not self.wide.holds(keys, dtype):
            self.wide = WideCopy(keys, values, dtype)
        return self.wide.of(keys, values)

    def transposed_keys(self) -> TransposedKeys:
        """The keys of the buffers (reserve made them) as a decode step reads them, transposed
        up to ``valid``; the step's call brings them up to its own position and counts them."""
        assert self.buffers is not None
        keys = self.buffers[0]
        if self.transposed is None or not self.transposed.holds(keys.data_ptr(), keys.shape[-2]):
            _, heads, capacity, dim = keys.shape
            self.transposed = TransposedKeys(keys.data_ptr(), keys.new_empty((heads, capacity + TRANSPOSED_ROOM, dim)))
        return self.transposed

    def keep_first(self, keep: int) -> None:
        super().keep_first(keep)
        for copy in (self.wide, self.transposed):  # the positions past keep will be written anew
            if copy is not None:
                copy.valid = min(copy.valid, keep)

    def restore(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """As for any layer; tensors that hold more than ``length`` positions (a file read with
        room to grow) become the buffers."""
        super().restore(keys, values, length)
        self.buffers = (keys, values) if keys.shape[-2] > length and keys.is_contiguous() and values.is_contiguous() else None
        self.wide = self.transposed = None

    def compact(self) -> None:
        """Keys and values in tensors of their own size, without a wide copy or transposed keys
        (made again when used)."""
        if self.buffers is not None:
            self.keys, self.values = self.state[0].clone(), self.state[1].clone()
            self.buffers = None
        self.wide = self.transposed = None


def _starts(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``view`` is the first positions of ``buffer``."""
    return view.data_ptr() == buffer.data_ptr() and view.stride() == buffer.stride()


class FullAttentionLayer(GrowingKeysAndValues, hf_compat.DynamicLayer):
    """A full-attention layer: attention reads every position."""

    kind = "full"

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' forward appends through this."""
        return self.update_and_fetch(key_states, value_states)


class SlidingWindowLayer(GrowingKeysAndValues, hf_compat.DynamicSlidingWindowLayer):
    """A sliding-window (or chunked) attention layer that keeps every position (transformers'
    keeps only the window), and hands attention exactly the positions transformers' layer
    hands it when recording the past: the same tensors, so the same results, bit for bit."""

    kind = "sliding"

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' forward appends through this."""
        return self.window(*self.update_and_fetch(key_states, value_states), key_states.shape[-2])

    def hold(self, total: int) -> None:
        # transformers' forward takes the cache's length from the count of its first layer's
        # positions, which is this one's in Gemma 3.
        self.cumulative_length = total
        super().hold(total)

    def window(self, keys: torch.Tensor, values: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``new`` positions just appended attend: the window before the first of them, and them."""
        first = self.first_visible(keys.shape[-2], new)
        return keys[..., first:, :], values[..., first:, :]

    def first_visible(self, total: int, new: int) -> int:
        """The first of ``total`` positions that the last ``new`` of them attend together."""
        return max(0, total - (self.sliding_window - 1 + new))


class LayerState(NamedTuple):
    """One linear-attention layer's states at one position: per state index, the conv and
    recurrent tensors (None where the layer keeps no such tensor) and the flag the model reads."""

    conv: dict[int, torch.Tensor | None]
    recurrent: dict[int, torch.Tensor | None]
    has_previous_state: dict[int, bool]


class LinearStates:
    """What every layer with linear-attention states offers: a state summarises every position
    before it and cannot be cut, so it is snapshot where the cache may be cut back to."""

    kind: LayerKind

    def snapshot(self, *, clone: bool = True) -> LayerState:
        """The states now (copies, unless ``clone`` is False: for writing them out at once)."""
        conv, recurrent, flags = hf_compat.linear_states(self)
        if clone:
            conv = {i: None if t is None else t.clone() for i, t in conv.items()}
            recurrent = {i: None if t is None else t.clone() for i, t in recurrent.items()}
        return LayerState(conv, recurrent, flags)

    def restore_states(self, snapshot: LayerState, length: int) -> None:
        """Put the states back as they were at the snapshot, taken after ``length`` positions
        (copies: the model updates them in place, and the snapshot may be restored again)."""
        hf_compat.set_linear_length(self, length)
        for state, flag in snapshot.has_previous_state.items():
            conv, recurrent = snapshot.conv.get(state), snapshot.recurrent.get(state)
            hf_compat.set_linear_state(
                self, state,
                None if conv is None else conv.clone(), None if recurrent is None else recurrent.clone(), flag,
            )


class LinearStatesLayer(LinearStates, hf_compat.LinearAttentionLayer):
    """A layer with conv and recurrent states only (linear attention, or a convolution)."""

    kind = "linear"


class FullAndLinearLayer(LinearStates, KeysAndValues, hf_compat.LinearAttentionAndFullAttentionLayer):
    """A hybrid layer: full attention (transformers' concatenating update) and linear-attention states."""

    kind = "full+linear"


class SlidingAndLinearLayer(LinearStates, KeysAndValues, hf_compat.LinearAttentionAndSlidingWindowAttentionLayer):
    """A hybrid layer: a sliding window (kept as transformers keeps it: only the window, so the
    cache cannot be cut back) and linear-attention states."""

    kind = "sliding+linear"


def _own(kind: str, made):
    """lm-worker's layer of ``kind`` with the settings of the one transformers made; that one
    where lm-worker has no class of its own for the kind."""
    if kind == "full":
        return FullAttentionLayer()
    if kind == "sliding":
        return SlidingWindowLayer(made.sliding_window)
    if kind == "linear":
        return LinearStatesLayer(number_of_states=made.number_of_states)
    if kind == "full+linear":
        return FullAndLinearLayer(number_of_states=made.number_of_states)
    if kind == "sliding+linear":
        return SlidingAndLinearLayer(made.sliding_window, number_of_states=made.number_of_states)
    return made
