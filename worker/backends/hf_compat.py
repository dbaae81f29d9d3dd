"""Every difference between transformers versions that lm-worker depends on, in one place.

Supported: transformers >= 5.20 (pyproject.toml). Import only from the
transformers backend: importing this module imports torch and transformers.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
os.environ.setdefault("TQDM_DISABLE", "1")  # gguf conversion draws raw tqdm bars on stderr

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402
from transformers.integrations import sdpa_attention  # noqa: E402

VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])

transformers.utils.logging.disable_progress_bar()

# 5.24 renamed the cache keyword of forward() and generate(); 5.23 knows only the old name.
CACHE_KWARG = "cache" if VERSION >= (5, 24) else "past_key_values"


_stock_use_gqa_in_sdpa = sdpa_attention.use_gqa_in_sdpa


def _use_gqa_in_sdpa(attention_mask: torch.Tensor | None, key: torch.Tensor, *rest: torch.Tensor) -> bool:
    """Whether SDPA serves each group of query heads from its key/value head in place.

    A forward of several tokens over a cache comes with a mask, and transformers then copies
    every key and value head once per query head it serves: the whole cache, in every layer of
    every such forward. On the CPU, SDPA reads the grouped heads in place instead, with results
    equal bit for bit. One query position (a decode step) keeps transformers' own path, which
    differs from this one in the last bit. The signature's tail changed between versions."""
    several_queries = attention_mask is not None and attention_mask.shape[-2] > 1
    return (key.device.type == "cpu" and several_queries) or _stock_use_gqa_in_sdpa(attention_mask, key, *rest)


sdpa_attention.use_gqa_in_sdpa = _use_gqa_in_sdpa


def new_cache(config: transformers.PretrainedConfig) -> DynamicCache:
    """A cache with the model's layer kinds, whose sliding-window layers keep every position.

    transformers keeps only the window in a sliding layer, which cannot be cut back past it.
    Recording the past keeps every position while the layer still hands attention exactly
    the window it would otherwise keep (the same tensors, so the same results, bit for bit)."""
    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if type(layer).__name__ == "DynamicSlidingWindowLayer":
            layer.activate_past_recording()
    return cache


# transformers' cache layer classes, by the kind of state they keep (torch_adapter explains each).
_LAYER_KINDS = {
    "DynamicLayer": "full",
    "DynamicSlidingWindowLayer": "sliding",  # sliding_attention and chunked_attention
    "LinearAttentionLayer": "linear",  # conv and linear_attention
    "LinearAttentionAndFullAttentionLayer": "full+linear",  # hybrid
    "LinearAttentionAndSlidingWindowAttentionLayer": "sliding+linear",  # hybrid_sliding
    "DummyLayer": "none",  # layers sharing another's cache, or without attention
}


def layer_kind(layer) -> str:
    """The kind of a cache layer; "other" for a class lm-worker does not know."""
    return _LAYER_KINDS.get(type(layer).__name__, "other")


def keep_positions(layer, keep: int) -> None:
    """Cut a full or (recording) sliding layer back to its first ``keep`` positions."""
    layer.keys = layer.keys[..., :keep, :]
    layer.values = layer.values[..., :keep, :]
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = keep


def set_positions(layer, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
    """Install keys and values of every position as a layer's cache, without the copy that
    update() makes: tensors mapped from a file stay mapped until the first forward replaces them."""
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = length


def set_linear_state(layer, state: int, conv: torch.Tensor | None, recurrent: torch.Tensor | None, flag: bool) -> None:
    """Put copies of one conv/recurrent state into a linear-attention layer, as its forward left them."""
    for tensor in (conv, recurrent):
        if tensor is not None:  # a hybrid layer's attention part may have set the device alone
            layer.device, layer.dtype = layer.device or tensor.device, layer.dtype or tensor.dtype
    layer.conv_states[state] = None if conv is None else conv.clone()
    layer.is_conv_states_initialized[state] = conv is not None
    if conv is not None:
        layer.conv_kernel_size[state] = conv.shape[-1]
    layer.recurrent_states[state] = None if recurrent is None else recurrent.clone()
    layer.is_recurrent_states_initialized[state] = recurrent is not None
    layer.has_previous_state[state] = flag


def rope_theta(config: transformers.PretrainedConfig) -> float | None:
    """The RoPE base frequency: in ``rope_parameters`` from transformers 5 on (per layer type
    for models that differ, where the full-attention layers' one is taken), else ``rope_theta``."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if isinstance(parameters.get("full_attention"), dict):
        parameters = parameters["full_attention"]
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    return None if theta is None else float(theta)


def config_digest(config: transformers.PretrainedConfig) -> str:
    """SHA-256 of the configuration as transformers resolved it, less what does not change the
    computation (where the model was loaded from, which transformers wrote it, the dtype,
    which the identity holds separately)."""
    import hashlib
    import json

    described = config.to_dict()
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        described.pop(key, None)
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=repr).encode()).hexdigest()


def forward(model: torch.nn.Module, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Logits of the last position, extending ``cache`` in place."""
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache})
    return out.logits[:, -1, :]


def make_serializable(model: torch.nn.Module) -> None:
    """A model loaded from a gguf file is dense already, but carries a quantizer that
    refuses save_pretrained(); drop it."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
