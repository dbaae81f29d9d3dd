"""A mapped gguf's configuration as the torch-free pass needs it (gguf_pass): the numbers of a
Llama, Qwen2, Qwen3 or Gemma 3 model read from the file's metadata. Torch-free.

What is read, checked and refused is gguf_model.config_of's too (``metadata_values``, which both
use): the metadata keys transformers maps for the architecture (``KEYS``, held to
hf_compat.gguf_config_keys by a test), each value of the kind and range the model can be built
of, the layer count against the file's tensors (GgufError); what the file leaves out takes the default of transformers'
configuration class (a Qwen3's head size, Gemma 3's pattern of sliding layers and their RoPE
base), so that both paths compute one model. A file the torch-free pass does not compute (another
architecture, a Mistral named as a Llama) raises NotTaken.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from worker.gguf.reader import GgufError, GgufFile

# gguf's general.architecture: transformers' model_type, for the architectures computed here
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
_COMMON = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size", "rope.dimension_count": None,
    "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# The metadata keys (after ``<architecture>.``) transformers reads a configuration from, with its names for them.
KEYS: dict[str, dict[str, str | None]] = {
    "llama": {**_COMMON, "rope.dimension_count": "head_dim"},
    "qwen2": _COMMON,
    "qwen3": _COMMON,
    "gemma3": {**_COMMON, "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"},
}
# Layers' count bounds a header's block_count before any name is made from it.
MAX_LAYERS = 1024
# A model's sizes (hidden, feed-forward, heads, head) from the metadata are at most this (PROTOCOL.md §13):
# the rotary tables are made of the head's size before a tensor is checked against it.
MAX_DIMENSION = 1 << 20
_DIMENSIONS = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"}
# The real values of the configuration, with the open range each must be in.
_REALS = {"rope_theta": (0.0, math.inf), "rms_norm_eps": (0.0, 1.0)}
# transformers' defaults for what a file may leave out: key/value heads, head size, RoPE base, epsilon
_DEFAULT_KV_HEADS = {"qwen2": 32, "qwen3": 32, "gemma3": 4}  # Llama's: its query heads
_DEFAULT_HEAD_DIM = {"qwen3": 128, "gemma3": 256}  # the others': hidden size / heads
_DEFAULT_ROPE_THETA = {"gemma3": 1_000_000.0}  # the others': 10,000
_GEMMA_LOCAL_ROPE_THETA = 10_000.0  # Gemma 3's sliding layers' RoPE base (rope_local_base_freq)
_GEMMA_PATTERN = 6  # Gemma 3: every sixth layer attends all positions, the others a window
_GEMMA_WINDOW = 4096
_GEMMA_QUERY_SCALAR = 256  # query_pre_attn_scalar: attention scales by its inverse square root
_DEFAULT_EPSILON = 1e-6
SLIDING, FULL = "sliding_attention", "full_attention"


class NotTaken(Exception):
    """The file is a model the torch-free pass does not compute (the message says why)."""


class GgufConfig(msgspec.Struct, frozen=True):
    architecture: str  # gguf's general.architecture
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    dim: int  # a head's size
    intermediate: int
    vocab: int
    epsilon: float
    rope_bases: dict[str | None, float]  # each kind of layer's RoPE base (None: every layer's)
    layer_kinds: list[str | None]  # each layer's kind
    window: int  # a sliding layer's window (Gemma 3), 0 without
    scaling: float  # attention's scale
    activation: str  # transformers' name of the MLP's activation
    tied: bool  # the output is the embedding (no output.weight)

    @property
    def gemma(self) -> bool:
        return self.architecture == "gemma3"

    @property
    def biased(self) -> bool:
        """Whether q, k and v have biases (Qwen2)."""
        return self.architecture == "qwen2"

    @property
    def head_norms(self) -> bool:
        """Whether each query and key head is normalized (Qwen3, Gemma 3)."""
        return self.architecture in ("qwen3", "gemma3")


def config_of(file: GgufFile) -> GgufConfig:
    """The model's configuration from the file's metadata, checked against its tensors; GgufError
    for a file that cannot make it (gguf_model.config_of's message), NotTaken for one that is not
    a model computed here."""
    arch = file.architecture
    if arch not in ARCHITECTURES:
        raise NotTaken(f"{file.path}: a {arch} model (the torch-free pass computes {', '.join(ARCHITECTURES)})")
    values = metadata_values(file, KEYS[arch])
    if arch == "llama" and "mistral" in str(file.get("general.name", str, "")).lower():
        raise NotTaken(f"{file.path}: a Mistral model (its configuration is transformers' Mistral one)")
    layers, hidden = int(values["num_hidden_layers"]), int(values["hidden_size"])
    heads, intermediate = int(values["num_attention_heads"]), int(values["intermediate_size"])
    given_kv_heads = values.get("num_key_value_heads")
    kv_heads = int(given_kv_heads if given_kv_heads is not None else _DEFAULT_KV_HEADS.get(arch, heads))
    dim = int(values.get("head_dim") or _DEFAULT_HEAD_DIM.get(arch) or hidden // heads)
    # transformers' own checks of its configuration (a hidden size its heads do not divide, an odd head)
    problem = None
    if arch in ("llama", "gemma3") and hidden % heads:
        problem = f"The hidden size ({hidden}) is not a multiple of the number of attention heads ({heads})."
    elif dim % 2:
        problem = f"RoPE requires an even rotary dimension, but got `head_dim`={dim}"
    if problem is not None:
        raise GgufError(f"{file.path}: the metadata does not make a {arch} configuration: {problem}")
    theta = float(values.get("rope_theta", _DEFAULT_ROPE_THETA.get(arch, 10_000.0)))
    epsilon = float(values.get("rms_norm_eps", _DEFAULT_EPSILON))
    kinds: list[str | None] = [None] * layers
    bases: dict[str | None, float] = {None: theta}
    window, scaling, activation = 0, dim**-0.5, "silu"
    if arch == "gemma3":
        typed = [SLIDING if (i + 1) % _GEMMA_PATTERN else FULL for i in range(layers)]
        kinds, bases = list(typed), {kind: theta if kind == FULL else _GEMMA_LOCAL_ROPE_THETA for kind in sorted(set(typed))}
        window, scaling, activation = int(values.get("sliding_window", _GEMMA_WINDOW)), _GEMMA_QUERY_SCALAR**-0.5, "gelu_pytorch_tanh"
    return GgufConfig(
        architecture=arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, dim=dim,
        intermediate=intermediate, vocab=int(values["vocab_size"]), epsilon=epsilon, rope_bases=bases,
        layer_kinds=kinds, window=window, scaling=scaling, activation=activation,
        tied=bool(values["tie_word_embeddings"]),
    )


def metadata_values(file: GgufFile, keys: Mapping[str, str | None]) -> dict[str, int | float]:
    """The configuration's values the metadata gives under ``keys`` (the metadata keys after
    ``<architecture>.``, with the configuration's names: KEYS', or transformers' for an
    architecture gguf_model alone builds), each checked (``_checked``), then held to the file's
    tensors: a layer count its blocks hold, positive sizes, key/value heads that divide the
    heads, an embedding matrix, whose rows are ``vocab_size``; ``tie_word_embeddings`` where the
    file has no output matrix. GgufError, with the messages both paths give, for a file that
    cannot make a model."""
    arch = file.architecture
    values: dict[str, int | float] = {}
    for suffix, name in keys.items():
        value = file.get(f"{arch}.{suffix}", (int, float))
        if value is not None and name is not None:
            values[name] = _checked(file, f"{arch}.{suffix}", name, value)
    layers = values.get("num_hidden_layers")
    if not isinstance(layers, int) or not 1 <= layers <= MAX_LAYERS:
        raise GgufError(f"{file.path}: {arch}.block_count is {layers!r}, not a layer count from 1 to {MAX_LAYERS}")
    present = sum(1 for name in file.tensors if name.startswith(f"blk.{layers - 1}."))
    beyond = sum(1 for name in file.tensors if name.startswith(f"blk.{layers}."))
    if not present or beyond:
        raise GgufError(f"{file.path}: {arch}.block_count says {layers} layers, and the file's tensors "
                        f"{'have none for layer ' + str(layers - 1) if not present else 'go past them'}")
    for name in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if not isinstance(values.get(name), int) or values[name] <= 0:
            raise GgufError(f"{file.path}: the metadata has no positive {name} ({arch}.*)")
    heads, kv_heads = values["num_attention_heads"], values.get("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        raise GgufError(f"{file.path}: {arch}.attention.head_count_kv is {kv_heads}, which does not divide "
                        f"{arch}.attention.head_count ({heads})")
    values["tie_word_embeddings"] = "output.weight" not in file.tensors
    embedding = file.tensors.get("token_embd.weight")
    if embedding is None or len(embedding.shape) != 2:
        raise GgufError(f"{file.path}: no token_embd.weight matrix")
    values["vocab_size"] = embedding.shape[1]
    return values


def _checked(file: GgufFile, key: str, name: str, value: int | float) -> int | float:
    """A configuration value from the metadata, of the kind and range the model can be built of:
    a finite positive rope base, a finite epsilon from 0 to 1, a count of at most MAX_DIMENSION
    (a model's sizes, which the rotary tables are made of before any tensor is checked), else a
    GgufError naming the key and the value."""
    if name in _REALS:
        low, high = _REALS[name]
        if not (math.isfinite(value) and low < value < high) and not (name == "rms_norm_eps" and value == 0):
            raise GgufError(f"{file.path}: the metadata's {key} is {value!r}, not a finite number "
                            f"{'above 0' if high == math.inf else 'from 0 to 1'}")
        return float(value)
    if not isinstance(value, int):
        raise GgufError(f"{file.path}: the metadata's {key} is {value!r}, not an integer")
    if name in _DIMENSIONS and not 1 <= value <= MAX_DIMENSION:
        raise GgufError(f"{file.path}: the metadata's {key} is {value}, not a size from 1 to {MAX_DIMENSION}")
    if name == "sliding_window" and not 1 <= value < 1 << 31:
        raise GgufError(f"{file.path}: the metadata's {key} is {value}, not a window from 1 to {(1 << 31) - 1} tokens")
    return value
