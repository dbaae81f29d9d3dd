"""Every difference between transformers versions that lm-worker depends on, in one place.

Supported: transformers >= 5.21 (pyproject.toml). Import only from the
transformers backend: importing this module imports torch and transformers.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
os.environ.setdefault("TQDM_DISABLE", "1")  # gguf conversion draws raw tqdm bars on stderr

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache, cache_utils  # noqa: E402

from worker import load_progress  # noqa: E402
from worker.kvcache.container import LayerKind  # noqa: E402

if TYPE_CHECKING:
    from worker.gguf.reader import GgufFile

VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])

transformers.utils.logging.disable_progress_bar()

# from_pretrained swaps process-wide state while it runs (no_init_weights and no_tie_weights
# put stand-ins for PreTrainedModel's methods and torch.nn.init's functions, then put back
# what they found): two at once in one process (several workers in one process, as the
# in-process tests run them) leave one another's stand-ins in place for good, and every later
# load skips tying weights (a tied output layer stays on the meta device). Hold this around it.
LOADING = threading.Lock()

# 5.24 renamed the cache keyword of forward() and generate(); 5.23 knows only the old name.
CACHE_KWARG = "cache" if VERSION >= (5, 24) else "past_key_values"


def _use_gqa_in_sdpa(attention_mask: torch.Tensor | None, key: torch.Tensor, *rest: torch.Tensor) -> bool:
    """Whether SDPA serves each group of query heads from its key/value head in place.

    A forward of several tokens over a cache comes with a mask, and transformers then copies
    every key and value head once per query head it serves: the whole cache, in every layer of
    every such forward. On the CPU, SDPA reads the grouped heads in place instead, with results
    equal bit for bit. One query position (a decode step) keeps transformers' own path, which
    differs from this one in the last bit. The signature's tail changed between versions."""
    several_queries = attention_mask is not None and attention_mask.shape[-2] > 1
    stock = _stock_use_gqa_in_sdpa
    assert stock is not None, "register_attention() puts this in place of the stock rule"
    return (key.device.type == "cpu" and several_queries) or stock(attention_mask, key, *rest)

# The attention implementations lm-worker loads models with: transformers' SDPA, but for one
# query position on the CPU (a decode step), one_query_attention. decode_step.py computes
# with the same functions, so its steps equal transformers' forward on the same model.
# For quantized weights, whose products give each row the numbers it gets alone, attention
# must too, so that a position's numbers do not depend on how the prompt was chunked
# (fast_weights says why): EXACT_ATTENTION computes it with exact_attention's kernel, and
# WIDE_ATTENTION (where that kernel cannot be built, or for a call it does not take: logit
# soft-capping, attention sinks, masks that are not one range of keys per position) in
# float64, rounded to float32.
ATTENTION = "lm_worker"
WIDE_ATTENTION = "lm_worker_float64"
EXACT_ATTENTION = "lm_worker_exact"


def one_query_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, implementation: str = ATTENTION
) -> torch.Tensor:
    """Attention of one position: ``query`` (kv_heads, groups, dim), the query heads grouped
    by the key/value head they read; ``keys``, ``values`` (kv_heads, n, dim). Returns
    (kv_heads, groups, dim) in float32.

    Each key/value head is read once for its group (SDPA's decode path copies it per query
    head), in float32 at least: bfloat16 products this small cost more on the CPU than the
    conversion, and the softmax is float32 as in transformers' eager attention."""
    kv_heads, groups, dim = query.shape
    rows, keys4, values4 = query.view(1, kv_heads * groups, 1, dim), keys[None], values[None]
    kernel = _exact_kernel(implementation, rows, keys4, values4)
    if kernel is not None:  # a decode step calls this once a layer and sequence: nothing made twice
        return kernel.attention(rows, keys4, values4, *_one_query_ranges(keys.shape[-2]), scaling).view(kv_heads, groups, dim)
    dtype = torch.float32 if implementation == ATTENTION else torch.float64
    scores = torch.bmm(query.to(dtype), keys.to(dtype).transpose(1, 2)) * scaling
    return torch.bmm(torch.softmax(scores, dim=-1), values.to(dtype)).float()


def chunk_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, implementation: str = ATTENTION,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the last ``n`` positions: ``query`` (1, heads, n, dim), ``keys``,
    ``values`` (1, kv_heads, positions, dim) ending with those n; with a ``window``, each
    position attends only the last ``window`` positions up to its own. Returns (1, n, heads,
    dim) in the query's dtype: SDPA with the grouped heads read in place and a boolean mask,
    as transformers calls it for a chunk of a prompt on the CPU (or the implementation's own)."""
    n, earlier = query.shape[-2], keys.shape[-2] - query.shape[-2]
    kernel = _exact_kernel(implementation, query, keys, values)
    if kernel is not None:
        lo, hi = causal_ranges(1, n, earlier + n)
        if window is not None:
            lo = (hi - window).clamp(min=0)
        return kernel.attention(query, keys, values, lo, hi, scaling).to(query.dtype)
    mask = torch.ones(n, earlier + n, dtype=torch.bool, device=query.device).tril(diagonal=earlier)
    if window is not None:
        mask = mask.triu(diagonal=earlier - window + 1)
    wide = implementation != ATTENTION
    return torch.nn.functional.scaled_dot_product_attention(
        *((query.double(), keys.double(), values.double()) if wide else (query, keys, values)),
        attn_mask=mask, scale=scaling, enable_gqa=True,
    ).transpose(1, 2).to(query.dtype)


def _exact_kernel(implementation: str, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
    """exact_attention's kernel where the implementation is EXACT_ATTENTION and the kernel takes
    these shapes; else None."""
    kernel = _exact_kernel_of(implementation)
    return kernel if kernel is not None and kernel.takes(query, keys, values) else None


def step_kernel(implementation: str, heads: int, kv_heads: int, dim: int):
    """exact_attention's kernel for a decode step's attention of several sequences in one call,
    where the implementation is EXACT_ATTENTION and the kernel takes these heads; else None."""
    kernel = _exact_kernel_of(implementation)
    return kernel if kernel is not None and kernel.takes_heads(heads, kv_heads, dim) else None


def _exact_kernel_of(implementation: str):
    """exact_attention's kernel where the implementation is EXACT_ATTENTION; else None."""
    if implementation != EXACT_ATTENTION:
        return None
    from worker.backends.transformers import exact_attention

    return exact_attention.loaded()


# The keys each query row attends as one range: (lo, hi), int64 tensors of shape (batch,
# positions), row (b, i) attending keys lo[b, i] to hi[b, i] - 1.
Ranges = tuple[torch.Tensor, torch.Tensor]

# The mask key_ranges last read (a weak reference), the batch it was read for, and its ranges.
_last_ranges: tuple[weakref.ref[torch.Tensor] | None, int, Ranges | None] = (None, 0, None)


@functools.lru_cache(maxsize=8192)
def _one_query_ranges(n: int) -> Ranges:
    """causal_ranges(1, 1, n), made once for each n (the kernel only reads them)."""
    return causal_ranges(1, 1, n)


def causal_ranges(batch: int, positions: int, n: int, causal: bool = True) -> Ranges:
    """The ranges without a mask: a causal layer's last ``positions`` of ``n`` positions attend
    every key up to their own; a layer that is not causal, every key."""
    hi = torch.arange(n - positions + 1, n + 1) if causal else torch.full((positions,), n)
    hi = hi.expand(batch, positions)
    return torch.zeros_like(hi), hi


def key_ranges(mask: torch.Tensor | None, batch: int, positions: int, n: int, causal: bool = True) -> Ranges | None:
    """The keys each query row attends as one range (Ranges) of n, from transformers' mask
    (boolean, or additive: 0 where a key is attended); without one, causal_ranges. None where
    some row's keys are not one range (or the mask is of a form not known here)."""
    global _last_ranges
    if mask is None:
        return causal_ranges(batch, positions, n, causal)
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2:] != (positions, n) or mask.device.type != "cpu":
        return None
    # transformers makes a forward's mask once and hands it to every layer.
    reference, read_for, ranges = _last_ranges
    if reference is not None and reference() is mask and read_for == batch:
        return ranges
    ranges = _ranges_of(mask, batch, positions, n)
    _last_ranges = (weakref.ref(mask), batch, ranges)
    return ranges


def _ranges_of(mask: torch.Tensor, batch: int, positions: int, n: int) -> Ranges | None:
    if mask.dtype == torch.bool:
        allowed = mask[:, 0]
    else:
        allowed = mask[:, 0] == 0
        if not torch.all(allowed | (mask[:, 0] <= torch.finfo(mask.dtype).min)):
            return None  # a bias on the scores, not only a choice of keys
    allowed = allowed.expand(batch, positions, n)
    lo = allowed.to(torch.uint8).argmax(-1)  # the first attended key (0 for a row with none)
    hi = lo + allowed.sum(-1)
    where = torch.arange(n)
    if not torch.equal((where >= lo[..., None]) & (where < hi[..., None]), allowed):
        return None
    return lo, hi


def _sdpa(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, wide: bool, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; with ``wide`` (on the CPU) computed in float64 and given
    back in the query's dtype."""
    from transformers.integrations import sdpa_attention

    if not wide or query.device.type != "cpu":
        return sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out, weights = sdpa_attention.sdpa_attention_forward(
        module, query.double(), key.double(), value.double(), attention_mask, **kwargs
    )
    return out.to(query.dtype), weights


def _attends_every_key(mask: torch.Tensor) -> bool:
    return mask.dtype == torch.bool and bool(mask.all())


def _attention_as(implementation: str):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        batch, heads, positions, dim = query.shape
        plain = not dropout and not kwargs.get("softcap") and kwargs.get("s_aux") is None
        kernel = _exact_kernel(implementation, query, key, value) if plain else None
        if kernel is not None:
            causal = getattr(module, "is_causal", True)
            ranges = key_ranges(attention_mask, batch, positions, key.shape[-2], causal)
            if ranges is not None:
                scale = module.scaling if scaling is None else scaling
                return kernel.attention(query, key, value, *ranges, scale).to(query.dtype), None
        if positions == 1 and attention_mask is not None and _attends_every_key(attention_mask):
            attention_mask = None  # a sliding window's full one: one query over keys the window bounds already
        if positions != 1 or attention_mask is not None or not plain or query.device.type != "cpu":
            wide = implementation != ATTENTION
            return _sdpa(module, query, key, value, attention_mask, wide, dropout=dropout, scaling=scaling, **kwargs)
        kv_heads, scale = key.shape[1], module.scaling if scaling is None else scaling
        rows = [
            one_query_attention(
                query[row].view(kv_heads, heads // kv_heads, dim), key[row], value[row], scale, implementation
            )
            for row in range(batch)
        ]
        return torch.stack(rows).view(batch, 1, heads, dim).to(query.dtype), None

    return attention


_stock_use_gqa_in_sdpa: Callable[..., bool] | None = None


def register_attention() -> None:
    """Make lm-worker's attention implementations known to transformers' modeling code, before
    a model of transformers' classes is made (idempotent). Not at import: that code imports
    much of torch (its compiler with it), a second of every load a model the native pass
    computes (gguf_model's shell) never needs."""
    global _stock_use_gqa_in_sdpa
    with _REGISTERING:
        if _stock_use_gqa_in_sdpa is not None:
            return
        from transformers.integrations import sdpa_attention
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        from transformers.modeling_utils import AttentionInterface

        _stock_use_gqa_in_sdpa = sdpa_attention.use_gqa_in_sdpa
        sdpa_attention.use_gqa_in_sdpa = _use_gqa_in_sdpa
        for name in (ATTENTION, WIDE_ATTENTION, EXACT_ATTENTION):
            AttentionInterface.register(name, _attention_as(name))
            AttentionMaskInterface.register(name, sdpa_mask)


_REGISTERING = threading.Lock()


# transformers' cache layer classes that lm-worker's own extend (cache_layers.py); their
# constructors and fields are the same in every supported version.
DynamicLayer = cache_utils.DynamicLayer
DynamicSlidingWindowLayer = cache_utils.DynamicSlidingWindowLayer
LinearAttentionLayer = cache_utils.LinearAttentionLayer
LinearAttentionAndFullAttentionLayer = cache_utils.LinearAttentionAndFullAttentionLayer
LinearAttentionAndSlidingWindowAttentionLayer = cache_utils.LinearAttentionAndSlidingWindowAttentionLayer

# transformers' cache layer classes, by the kind of state they keep (torch_adapter explains each).
LAYER_KINDS: dict[str, LayerKind] = {
    "DynamicLayer": "full",
    "DynamicSlidingWindowLayer": "sliding",  # sliding_attention and chunked_attention
    "LinearAttentionLayer": "linear",  # conv and linear_attention
    "LinearAttentionAndFullAttentionLayer": "full+linear",  # hybrid
    "LinearAttentionAndSlidingWindowAttentionLayer": "sliding+linear",  # hybrid_sliding
    "DummyLayer": "none",  # layers sharing another's cache, or without attention
}


# A cache layer's kind: "other" for a class lm-worker does not know.
CacheLayerKind = LayerKind | Literal["other"]


def layer_kind(layer) -> CacheLayerKind:
    """The kind of one of transformers' cache layers; "other" for a class lm-worker does not know."""
    return LAYER_KINDS.get(type(layer).__name__, "other")


def new_cache(config: transformers.PretrainedConfig, own: Callable[[CacheLayerKind, Any], Any]) -> DynamicCache:
    """transformers' cache for the model, each layer replaced by ``own(kind, layer)``: the layers
    are of the classes (and settings) transformers chooses for the model's layer types."""
    cache = DynamicCache(config=config)
    cache.layers = [own(layer_kind(layer), layer) for layer in cache.layers]
    return cache


def linear_states(layer) -> tuple[dict[int, torch.Tensor | None], dict[int, torch.Tensor | None], dict[int, bool]]:
    """A linear-attention layer's conv and recurrent states (None where not initialized) and
    has_previous_state flags, per state index: the layer's own tensors."""
    return (
        {i: t if layer.is_conv_states_initialized[i] else None for i, t in layer.conv_states.items()},
        {i: t if layer.is_recurrent_states_initialized[i] else None for i, t in layer.recurrent_states.items()},
        dict(layer.has_previous_state),
    )


def set_linear_length(layer, length: int) -> None:
    """Make ``length`` the positions a linear-attention layer counts. From 5.25 such a layer
    counts them, and a cache's length is read from its first layer's count (a linear layer in
    Qwen3.5): a layer restored or cut back must count what it holds. Earlier versions keep no
    count."""
    count = getattr(layer, "cumulative_length_linear", None)
    if count is not None:
        count.fill_(length)


def set_linear_state(layer, state: int, conv: torch.Tensor | None, recurrent: torch.Tensor | None, flag: bool) -> None:
    """Make ``conv`` and ``recurrent`` a linear-attention layer's state ``state``, as its forward left them."""
    for tensor in (conv, recurrent):
        if tensor is not None:  # a hybrid layer's attention part may have set the device alone
            layer.device, layer.dtype = layer.device or tensor.device, layer.dtype or tensor.dtype
    layer.conv_states[state] = conv
    layer.is_conv_states_initialized[state] = conv is not None
    if conv is not None:
        layer.conv_kernel_size[state] = conv.shape[-1]
    layer.recurrent_states[state] = recurrent
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


def attention_implementation(config: transformers.PretrainedConfig) -> str:
    """The attention implementation the model was loaded with (ATTENTION, WIDE_ATTENTION, ...)."""
    implementation = config._attn_implementation
    # None only for a configuration no model was loaded with yet: loading resolves it.
    assert implementation is not None, "the configuration of a model not loaded yet"
    return implementation


def config_digest(
    config: transformers.PretrainedConfig,
    products: str | None = None,
    forward: str | None = None,
    device: str | None = None,
) -> str:
    """SHA-256 of the configuration as transformers resolved it, less what does not change the
    computation (where the model was loaded from, which transformers wrote it, the dtype,
    which the identity holds separately), with the attention the worker computes with where
    it is not SDPA in float32 (to_dict leaves it out), the kernel of its int8 products where
    it is not PyTorch's (``products``: fast_weights.int8_products), the native pass where
    it computes the layers (``forward``: native_forward.FORWARD), and the processor where it is
    not the CPU (``device``, e.g. "cuda NVIDIA H200"): each gives a position other last bits, so
    a cache computed with one must not pass for one of another."""
    import hashlib
    import json

    described = config.to_dict()
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        described.pop(key, None)
    if attention_implementation(config) in (WIDE_ATTENTION, EXACT_ATTENTION):
        described["attention"] = attention_implementation(config)
    if products is not None:
        described["int8_products"] = products
    if forward is not None:
        described["forward"] = forward
    if device is not None:
        described["device"] = device
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=repr).encode()).hexdigest()


def forward(model: torch.nn.Module, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Logits of the last position, extending ``cache`` in place."""
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache})
    return out.logits[:, -1, :]


def generation_config(directory: Path):
    """The generation configuration from_pretrained gives a model of ``directory``: its
    generation_config.json, else one made from its config.json."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(directory)
    except OSError:
        return GenerationConfig.from_pretrained(directory, config_file_name="config.json", _from_model_config=True)


def make_serializable(model: torch.nn.Module) -> None:
    """A model loaded from a gguf file is dense already, but carries a quantizer that
    refuses save_pretrained(); drop it."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def _gguf_tensors(tensors, **tqdm_options):
    """transformers' loop over a gguf file's tensors, each dequantized in its body (it draws a
    tqdm bar over them): a load's "dequantizing" stage, a tensor at a time."""
    report = load_progress.stage("dequantizing", len(tensors), "tensors")
    done = 0
    for tensor in tensors:
        yield tensor
        done += 1
        report(done)


def report_gguf_dequantizing() -> None:
    """Make transformers' gguf loader report its "dequantizing" stage (idempotent): before
    from_pretrained reads a gguf file. Where a version's loader loops otherwise, its load shows
    no such stage."""
    from transformers import modeling_gguf_pytorch_utils

    if getattr(modeling_gguf_pytorch_utils, "tqdm", None) is not None:
        setattr(modeling_gguf_pytorch_utils, "tqdm", _gguf_tensors)  # a name that module imports, not its own


def gguf_config_keys(architecture: str) -> dict[str, str | None]:
    """The metadata keys (after ``<architecture>.``) transformers reads a gguf's configuration
    from, with the configuration's names for them."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return dict(GGUF_CONFIG_MAPPING.get(architecture, {}))


def gguf_tokenizer(file: GgufFile):
    """The tokenizer a gguf file describes, built by transformers' gguf converter from the
    metadata the worker's reader read (transformers' own reader parses every array again)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    from worker.gguf.reader import GgufError

    architecture = file.architecture
    grouped: dict[str, dict] = {}
    for group, renames in GGUF_TOKENIZER_MAPPING.items():
        grouped[group] = {}
        for key, name in renames.items():
            full = f"tokenizer.{key}"
            if full not in file.metadata:
                continue
            strings = file.strings(full) if key in ("ggml.tokens", "ggml.merges") else None
            grouped[group][name] = strings if strings is not None else file.metadata[full]
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say
    tokens = tokenizer.get("tokens") or []
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unk_token_id"),
                      ("pad_token", "pad_token_id")):
        token_id = tokenizer.get(key)
        config[name] = tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None
    for name, kind in (("chat_template", str), ("add_bos_token", bool), ("add_eos_token", bool)):
        if name in config and not isinstance(config[name], kind):
            raise GgufError(f"{file.path}: the metadata's tokenizer {name} is {type(config[name]).__name__}, not {kind.__name__}")
    if not isinstance(tokenizer.get("tokenizer_type"), str):
        raise GgufError(f"{file.path}: the metadata's tokenizer.ggml.model is not a string")
    try:
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer)
    except (ValueError, KeyError, TypeError) as exc:  # a tokenizer kind, or fields of one, transformers does not build
        raise GgufError(f"{file.path}: the tokenizer its metadata describes does not build: {exc}") from exc
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
