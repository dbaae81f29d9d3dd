"""Whether a cache header is sound, and whether it is of the model that reads it. Torch-free.

Every field a reader uses is checked against the others before a tensor is handed out
(``manifest_problem``), so that made-up numbers under a sound checksum are refused; what the
identity cannot tell, a reading model checks against its own tensors (``layout_problem``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

from worker.kvcache.format import DTYPE_SIZES, Header, Identity, IdentityMismatch, TensorSpec, c_strides

# The layer kinds that keep keys and values, and those that keep linear-attention states.
_KV_KINDS = ("full", "sliding", "full+linear", "sliding+linear")
_STATE_KINDS = ("linear", "full+linear", "sliding+linear")


def layout_problem(header: Header, tensors: Iterable[TensorSpec] | None, max_positions: int) -> str | None:
    """What makes a sound header of a model's identity other than what that model computes, or
    None: more positions than its context, or a tensor whose shape or dtype is not that of the
    model's own tensor of the same layer, kind and state (``tensors``: those of a cache of one
    position the model computed; None where its caches cannot be stored, so none are read).
    The identity repeats head counts and sizes, but a header could still claim others."""
    if header.sequence_length > max_positions:
        return f"it holds {header.sequence_length} positions, more than the model's context of {max_positions}"
    own = {(spec.layer, spec.kind, spec.state): spec for spec in tensors or ()}
    for entry in header.tensors:
        spec = own.get((entry.layer, entry.kind, entry.state))
        if spec is None:
            return f"tensor {entry.name}: the model keeps no {entry.kind} tensor {entry.state} in layer {entry.layer}"
        shape = list(spec.shape)
        if entry.kind in ("key", "value"):  # [1, heads, positions, head_dim]: any number of positions
            shape[2] = entry.shape[2]
        if entry.shape != shape or entry.dtype != spec.dtype:
            return f"tensor {entry.name}: {entry.dtype} of shape {entry.shape}, where the model's is {spec.dtype} of {shape}"
    return None


def check_identity(path: str | os.PathLike[str], found: Identity, expected: Identity) -> None:
    """Raises IdentityMismatch naming a field where ``found`` is not ``expected``."""
    # The fields a person can read (the quantization, say) before the digests that also
    # cover them, so that a mismatch is named plainly.
    for field in sorted(expected.__struct_fields__, key=lambda name: name.endswith("_sha256")):
        if getattr(found, field) != getattr(expected, field):
            raise IdentityMismatch(path, field, getattr(expected, field), getattr(found, field))


def manifest_problem(header: Header) -> str | None:
    """What makes the header's description of the cache inconsistent, or None. Everything a
    reader builds tensors from is checked here, so that a header with a sound checksum but
    made-up numbers is refused before any tensor exists."""
    length = header.sequence_length
    if length != len(header.tokens):
        return "sequence_length does not match the token list"
    if any(not 0 <= token < 2**32 for token in header.tokens):
        return "a token id is out of range"
    if header.sequence_start != 0:
        return f"sequence_start {header.sequence_start}: only caches of a whole prefix (0) are read"
    if [layer.index for layer in header.layers] != list(range(header.identity.layers)):
        return f"the layer list is not layers 0 to {header.identity.layers - 1} in order"
    kinds = [layer.kind for layer in header.layers]
    for layer in header.layers:
        if (layer.kind in ("sliding", "sliding+linear")) != (layer.sliding_window is not None):
            return f"layer {layer.index}: a sliding window goes with sliding layers, and only with them"
        if layer.sliding_window is not None and layer.sliding_window < 1:
            return f"layer {layer.index}: sliding window {layer.sliding_window}"
    states: set[tuple[int, int, int]] = set()
    for state in header.states:
        if not 0 <= state.layer < len(kinds) or kinds[state.layer] not in _STATE_KINDS:
            return f"a state of layer {state.layer}, which keeps no linear-attention state"
        if not 0 < state.position <= length or state.state < 0:
            return f"a state of layer {state.layer} at position {state.position} of a {length}-token sequence"
        key = (state.layer, state.state, state.position)
        if key in states:
            return f"two states {key} of layer {state.layer}"
        states.add(key)
    if length and any(
        kind in _STATE_KINDS and not any(s.layer == i and s.position == length for s in header.states)
        for i, kind in enumerate(kinds)
    ):
        return "a linear-attention layer has no state at the end of the sequence"
    seen: set[tuple[int | str | None, ...]] = set()
    names: set[str] = set()
    used_states: set[tuple[int, int, int | None]] = set()
    for entry in header.tensors:
        where = f"tensor {entry.name}"
        if entry.name in names:
            return f"{where} is listed twice"
        names.add(entry.name)
        if entry.dtype not in DTYPE_SIZES:
            return f"{where}: unknown dtype {entry.dtype!r}"
        itemsize = DTYPE_SIZES[entry.dtype]
        if any(size < 0 for size in entry.shape) or entry.nbytes != math.prod(entry.shape) * itemsize:
            return f"{where}: shape {entry.shape} of {entry.dtype} is not {entry.nbytes} bytes"
        if entry.strides != c_strides(entry.shape, itemsize):
            return f"{where}: strides {entry.strides} are not those of C order"
        if not 0 <= entry.layer < len(kinds):
            return f"{where}: there is no layer {entry.layer}"
        if entry.kind in ("key", "value"):
            if kinds[entry.layer] not in _KV_KINDS:
                return f"{where}: layer {entry.layer} ({kinds[entry.layer]}) keeps no keys and values"
            if len(entry.shape) != 4 or entry.shape[0] != 1 or entry.shape[2] != length or entry.position is not None:
                return f"{where}: shape {entry.shape} is not [1, heads, {length}, head_dim]"
            key = (entry.layer, entry.kind)
        else:
            state = (entry.layer, entry.state, entry.position)
            if state not in states:
                return f"{where}: no state {entry.state} of layer {entry.layer} at position {entry.position}"
            used_states.add(state)
            key = (entry.layer, entry.kind, entry.state, entry.position)
        if key in seen:
            return f"{where}: a second {entry.kind} tensor of layer {entry.layer}"
        seen.add(key)
    for i, kind in enumerate(kinds):
        if length and kind in _KV_KINDS and not {(i, "key"), (i, "value")} <= seen:
            return f"layer {i} ({kind}) lacks its keys or values"
    if states - used_states:
        return f"states without tensors: {sorted(states - used_states)[:3]}"
    return None
