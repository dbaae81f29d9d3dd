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
    # With the config, sliding-window and hybrid models get the right layer types.
    return DynamicCache(config=config)


def forward(model: torch.nn.Module, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Logits of the last position, extending ``cache`` in place."""
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache})
    return out.logits[:, -1, :]


def crop(cache: DynamicCache, keep_tokens: int) -> None:
    """Keep the first ``keep_tokens`` positions of ``cache``."""
    drop = cache.get_seq_length() - keep_tokens
    if drop > 0:
        # From 5.20 on, crop() takes the (negative) number of tokens to remove;
        # before, the length to keep.
        cache.crop(-drop if VERSION >= (5, 20) else keep_tokens)


def make_serializable(model: torch.nn.Module) -> None:
    """A model loaded from a gguf file is dense already, but carries a quantizer that
    refuses save_pretrained(); drop it."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def cache_layers(cache: DynamicCache) -> list:
    return list(cache.layers)


def full_attention_only(cache: DynamicCache) -> bool:
    """Whether every layer keeps the whole sequence (sliding-window and linear-attention
    layers keep something else, which a KVC1 file cannot represent)."""
    return all(type(layer).__name__ == "DynamicLayer" for layer in cache.layers)


def set_layer(cache: DynamicCache, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Install keys and values as a layer's whole cache, without the copy that update() makes:
    tensors mapped from a file stay mapped until the first decode step replaces them."""
    layer = cache.layers[index]
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
