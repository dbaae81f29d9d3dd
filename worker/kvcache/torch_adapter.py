"""DynamicCache ⇄ KVC1 tensors. Imports torch: use only from the transformers backend."""

from __future__ import annotations

import torch

from worker.backends import hf_compat
from worker.kvcache.container import LoadedCache, TensorSpec

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


class UnsupportedCache(Exception):
    """A cache whose layers a KVC1 file cannot represent."""


def to_tensors(cache, keep_tokens: int | None = None) -> list[tuple[TensorSpec, memoryview]]:
    """The cache's tensors as KVC1 specs and byte views (layer-major, key then value).
    ``keep_tokens`` limits them to the first positions of the sequence."""
    if not hf_compat.full_attention_only(cache):
        raise UnsupportedCache(
            "this model's cache has sliding-window or linear-attention layers, which KVC1 cannot store yet"
        )
    out = []
    for index, layer in enumerate(hf_compat.cache_layers(cache)):
        for kind, tensor in (("key", layer.keys), ("value", layer.values)):
            if keep_tokens is not None:
                tensor = tensor[..., :keep_tokens, :]
            tensor = tensor.detach().to("cpu").contiguous()
            spec = TensorSpec(
                name=f"layers.{index}.{kind}", kind=kind, layer=index, shape=tuple(tensor.shape),
                dtype=_DTYPES[tensor.dtype],
            )
            out.append((spec, memoryview(tensor.view(torch.uint8).numpy()).cast("B")))
    return out


def from_loaded(loaded: LoadedCache, config, device: str):
    """A DynamicCache whose tensors are views of the mapped file (no copy on the CPU)."""
    cache = hf_compat.new_cache(config)
    pairs: dict[int, dict[str, torch.Tensor]] = {}
    for entry, view in zip(loaded.header.tensors, loaded.tensors, strict=True):
        tensor = torch.frombuffer(view, dtype=_TORCH_DTYPES[entry.dtype]).reshape(entry.shape)
        pairs.setdefault(entry.layer, {})[entry.kind] = tensor.to(device)
    for index, pair in sorted(pairs.items()):
        hf_compat.set_layer(cache, index, pair["key"], pair["value"])
    return cache
