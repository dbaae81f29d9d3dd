"""The module tree of a model the native pass computes, made without transformers' modeling code.

A mapped gguf of an architecture native_forward computes (Llama, Qwen2, Qwen3, Gemma 3) never
runs transformers' forward: native_forward.c computes every pass from the modules' weights and
the rotary embedding's frequencies. Its model is this shell: modules of the names and shapes
transformers' classes have (``model.layers.N.self_attn.q_proj`` and so on, so that gguf_model
fills them by the same names), the attributes native_forward and decode_step read (``scaling``,
``sliding_window``, the norms' epsilons), and transformers' rotary embedding written out. Importing
transformers' modeling code imports much of torch, its compiler with it: a second of every load.

What transformers' classes compute that this shell must match is pinned by tests: the shell's
modules and rotary tables against those of transformers' own classes on the same configuration.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters, dynamic_rope_update

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# transformers' model_type of the architectures the shell makes
MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text")


@strict
class LlamaConfig(PreTrainedConfig):
    """transformers' LlamaConfig, field for field and default for default, without its module's
    import of transformers.utils.type_validators: that module imports transformers.activations
    and, through it, torch.distributed, for a check of ``initializer_range`` that a gguf never
    sets. tests/test_shell_model.py holds its fields and its dictionary to transformers' class."""

    model_type = "llama"

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pretraining_tp: int | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False
    head_dim: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"The hidden size ({self.hidden_size}) is not a multiple of the number of attention "
                             f"heads ({self.num_attention_heads}).")


def configuration(model_type: str, values: dict[str, Any]) -> PretrainedConfig:
    """The configuration of a model of ``model_type``: transformers' class, but for Llama's (above)."""
    if model_type == "llama":
        return LlamaConfig(**values)
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **values)


def pretrained_configuration(directory: Path) -> PretrainedConfig:
    """A model directory's configuration as transformers' AutoConfig reads it, Llama's as the
    class above."""
    from transformers import AutoConfig

    values, _ = PreTrainedConfig.get_config_dict(directory)
    if values.get("model_type") != "llama":
        return AutoConfig.from_pretrained(directory)
    return LlamaConfig.from_dict(values, name_or_path=str(directory))  # the file read once; named as AutoConfig names it


def transformers_configuration(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` as transformers' own class, which its model classes are registered by."""
    if not isinstance(config, LlamaConfig):
        return config
    from transformers import LlamaConfig as TheirLlamaConfig

    return TheirLlamaConfig.from_dict(config.to_dict())


class Linear(torch.nn.Linear):
    """A linear's place, on the meta device: gguf_model puts the file's blocks in it (no values
    are drawn for it: drawing them on the meta device imports torch's compiler)."""

    def __init__(self, inputs: int, outputs: int, bias: bool) -> None:
        super().__init__(inputs, outputs, bias=bias, device="meta")

    def reset_parameters(self) -> None:
        pass


class Embedding(torch.nn.Embedding):
    """The embedding's place, as Linear is a linear's; its rows times ``embed_scale`` where the
    model scales them (Gemma: √hidden, as transformers' Gemma3TextScaledWordEmbedding in float32)."""

    def __init__(self, rows: int, size: int, embed_scale: float | None = None) -> None:
        super().__init__(rows, size, device="meta")
        self.embed_scale = embed_scale

    def reset_parameters(self) -> None:
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(ids)
        return rows if self.embed_scale is None else rows * torch.tensor(self.embed_scale).to(rows.dtype)


class RMSNorm(torch.nn.Module):
    """A norm's scales, with the epsilon under both names transformers' classes give it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(size, device="meta"), requires_grad=False)
        self.eps = self.variance_epsilon = eps


class Attention(torch.nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int) -> None:
        super().__init__()
        model_type = config.model_type
        dim = head_dim(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        biased = bool(getattr(config, "attention_bias", False))
        qkv_biased = True if model_type == "qwen2" else biased  # Qwen2 always has q, k and v biases
        self.q_proj = Linear(config.hidden_size, heads * dim, bias=qkv_biased)
        self.k_proj = Linear(config.hidden_size, kv_heads * dim, bias=qkv_biased)
        self.v_proj = Linear(config.hidden_size, kv_heads * dim, bias=qkv_biased)
        self.o_proj = Linear(heads * dim, config.hidden_size, bias=biased and model_type != "qwen2")
        if model_type in ("qwen3", "gemma3_text"):
            self.q_norm = RMSNorm(dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(dim, config.rms_norm_eps)
        pre_scalar = config.query_pre_attn_scalar if model_type == "gemma3_text" else dim
        self.scaling = pre_scalar**-0.5
        layer_types = getattr(config, "layer_types", None)
        if model_type != "llama":
            sliding = layer_types is not None and layer_types[layer] == "sliding_attention"
            self.sliding_window = config.sliding_window if sliding else None


class MLP(torch.nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        biased = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=biased)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=biased)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=biased)


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(size, eps)
        self.post_attention_layernorm = RMSNorm(size, eps)
        if config.model_type == "gemma3_text":  # Gemma 3 normalizes each sublayer's input and output
            self.pre_feedforward_layernorm = RMSNorm(size, eps)
            self.post_feedforward_layernorm = RMSNorm(size, eps)


class RotaryEmbedding(torch.nn.Module):
    """transformers' rotary embedding of Llama, Qwen2 and Qwen3: (cos, sin) of a position's
    angles, from the frequencies the configuration's RoPE type gives."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        inv_freq, self.attention_scaling = _frequencies(config, self.rope_type, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _cos_sin(x, position_ids, cast(torch.Tensor, self.inv_freq), self.attention_scaling)


class LayerTypeRotaryEmbedding(torch.nn.Module):
    """transformers' rotary embedding of Gemma 3: frequencies for each layer type (its sliding
    layers' RoPE base is not its full layers')."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.layer_types = sorted(set(config.layer_types))
        self.rope_type: dict[str, str] = {}
        for layer_type in self.layer_types:
            parameters = config.rope_parameters[layer_type]
            if parameters is None:
                continue
            self.rope_type[layer_type] = parameters["rope_type"]
            inv_freq, scaling = _frequencies(config, parameters["rope_type"], layer_type)
            self.register_buffer(f"{layer_type}_inv_freq", inv_freq, persistent=False)
            self.register_buffer(f"{layer_type}_original_inv_freq", inv_freq.clone(), persistent=False)
            setattr(self, f"{layer_type}_attention_scaling", scaling)

    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = getattr(self, f"{layer_type}_inv_freq")
        return _cos_sin(x, position_ids, inv_freq, getattr(self, f"{layer_type}_attention_scaling"))


def _frequencies(config: PretrainedConfig, rope_type: str, layer_type: str | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling) as the model classes' __init__ makes them."""
    if rope_type != "default":
        initialize: Any = ROPE_INIT_FUNCTIONS[rope_type]
        return initialize(config) if layer_type is None else initialize(config, None, layer_type=layer_type)
    parameters = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    dim = head_dim(config)
    return 1.0 / (parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def _cos_sin(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float):
    freqs = positions[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scaling).to(dtype=x.dtype), (angles.sin() * scaling).to(dtype=x.dtype)


class Inner(torch.nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        scaled = config.model_type == "gemma3_text"
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.hidden_size**0.5 if scaled else None)
        self.layers = torch.nn.ModuleList(DecoderLayer(config, layer) for layer in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        typed = config.model_type == "gemma3_text"
        self.rotary_emb = LayerTypeRotaryEmbedding(config) if typed else RotaryEmbedding(config)


class ShellModel(torch.nn.Module):
    """A causal language model's modules by transformers' names; computed only by the native pass.
    Its weights are on the meta device until gguf_model puts the file's in their places; its
    rotary embedding is made on the CPU."""

    generation_config: Any = None  # transformers' GenerationConfig, where the model's directory gives one
    mapping: Any = None  # the memory its weights are views of, where they are: held as long as the model

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        assert config.model_type in MODEL_TYPES, config.model_type
        self.config = config
        self.model = Inner(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a shell model is computed by the native pass alone")


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
