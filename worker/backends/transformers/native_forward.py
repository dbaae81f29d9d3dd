"""A forward pass of a Llama or Gemma 3 model with quantized weights in one native call.

decode_step.py computes a decode step with PyTorch's operations, one by one: about 30 a
layer, each with its dispatch, its output tensor and its line of Python. For a small model
on a CPU that framework work takes longer than the products themselves (bench/README.md,
"Figures behind constants"). native_forward.c does a whole pass (every layer, then the
logits of the rows asked for) in one call, calling the same product and attention kernels,
so a step costs little more than its arithmetic.

What it computes differs from decode_step's PyTorch operations in the last bits of the
steps it computes itself, RMSNorm's sum and the activation's exponential (native_forward.c
says how: one fixed order, the same bits on every machine), where PyTorch's are blocked by
the processor's vectors, and in its RoPE tables (rope_tables: the same bits on every
machine; PyTorch's for a RoPE type rope_tables does not compute). It is the model's
arithmetic for every pass, the prompt's chunks as well as the steps and drafts, so a
position's numbers still depend on its tokens alone, and the cache identity names it
(``FORWARD``: hf_compat.config_digest), so caches computed with PyTorch's operations are
another identity.

A Llama model on a gguf file's own blocks (``quantization: "gguf"``) is computed as llama.cpp's
CPU backend computes it, not in the worker's own order (``FORWARD_LLAMA_CPP``): RMSNorm's squares
rounded to float, RoPE's angles by llama.cpp's recurrence and ``sincosf`` with its fused
rotation, the query, keys and values rounded to float16, attention as its flash attention for
batches under 64 rows (each score a float16 dot product in AVX-512's lane order over the head's
numbers in the gguf's order, an online softmax with ``expf``, the weighted sum a float16 vector),
SwiGLU with ggml's vector exponential. With the gguf kernel's products, greedy output is then
llama.cpp's token for token (tests/test_gguf_weights.py: 4 of 4 recorded prompts). Each row is
still computed alone, so a position's numbers do not depend on the chunk or step it is in.

It takes the models decode_step takes (the Llama and Gemma 3 architectures) whose every
linear multiplies int8 rows or gguf blocks with the worker's kernels, with exact attention
(``applies``); others keep decode_step, and so do these where the kernel cannot be built.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from worker import c_build
from worker.backends.transformers import decode_step, exact_attention, fast_weights, gguf_weights, hf_compat, native_pass
from worker.backends.transformers import rope_tables
from worker.backends.transformers.decode_step import Passes
from worker.backends.transformers.native_pass import Layer, Model, Product
from worker.backends.transformers.torch_threads import SHARE_FROM

if TYPE_CHECKING:
    from transformers import Gemma3ForCausalLM, LlamaForCausalLM, PretrainedConfig, PreTrainedModel
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    from worker.backends.transformers.cache_layers import GrowingKeysAndValues
    from worker.backends.transformers.torch_adapter import TorchCache

FORWARD, FORWARD_LLAMA_CPP = native_pass.FORWARD, native_pass.FORWARD_LLAMA_CPP


def load_kernel(data_dir: Path) -> None:
    """Build (on first use) and load native_forward.c (native_pass); raises c_build.KernelUnavailable."""
    native_pass.load_kernel(data_dir)


def applies(config: PretrainedConfig, dtype: str, quantization: str) -> bool:
    """Whether a model of this configuration, loaded with this dtype and quantization, computes
    its passes here: a model decode_step takes (Llama, Gemma 3) with its usual activation
    (SiLU, GELU's tanh form), in float32, every linear multiplied by the worker's kernels
    (int8 rows, gguf blocks), with exact attention of heads its kernel takes."""
    if not native_pass.loaded() or dtype != "float32" or quantization not in ("int8", "gguf"):
        return False
    if fast_weights.int8_products() is None or hf_compat.attention_implementation(config) != hf_compat.EXACT_ATTENTION:
        return False
    if not decode_step.supports(config) or _activation(config) is None:
        return False
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return native_pass.takes_heads(heads, kv_heads, dim)


def forward_name(config: PretrainedConfig, dtype: str, quantization: str, llama_cpp: bool) -> str | None:
    """What the cache identity calls the passes' arithmetic (``llama_cpp``: llama_cpp_arithmetic's
    answer), None where the native pass does not apply."""
    if not applies(config, dtype, quantization):
        return None
    return FORWARD_LLAMA_CPP if llama_cpp else FORWARD


def llama_cpp_arithmetic(config: PretrainedConfig, quantization: str, *, mapped: bool) -> bool:
    """Whether the passes are computed in llama.cpp's arithmetic: a Llama model on the gguf blocks
    of a converted directory (the shipped default loaded with quantization gguf), so that its
    greedy output is llama.cpp's token for token. A mapped gguf's passes are the worker's own:
    the attention llama.cpp computes for batches under 64 rows takes one key at a time, many
    times slower over a long context than the worker's (bench/README.md, "Figures behind
    constants")."""
    scaling = getattr(config, "rope_scaling", None) or {}
    return (
        not mapped and quantization == "gguf" and config.model_type == "llama"
        and scaling.get("rope_type", "default") == "default"
    )


class _LlamaCppRopes:
    """llama.cpp's (cos, signed sin) for a Llama model's positions (rope_tables.Tables's interface),
    from native_forward.c, in a table grown as positions come."""

    def __init__(self, model: LlamaForCausalLM, dim: int) -> None:
        self.kinds: list[str | None] = [None]
        self.of_layers: list[str | None] = [None] * len(model.model.layers)
        base = hf_compat.rope_theta(model.config)
        assert base is not None, "a Llama model has a RoPE base"
        self._dim, self._base = dim, base
        self._cos = self._sin = np.empty((0, dim), np.float32)

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        needed, have = int(positions.max()) + 1, self._cos.shape[0]
        if needed > have:
            size = max(needed, 2 * have, 256)
            cos, sin = np.empty((size, self._dim), np.float32), np.empty((size, self._dim), np.float32)
            cos[:have], sin[:have] = self._cos, self._sin
            native_pass.llama_cpp_rope(have, size - have, self._dim, self._base, cos[have:].ctypes.data, sin[have:].ctypes.data)
            self._cos, self._sin = cos, sin
        return self._cos[None, positions], self._sin[None, positions]


class _TorchRopes:
    """PyTorch's tables (decode_step.Ropes), for a rotary embedding rope_tables does not compute
    (rope_tables.Tables's interface)."""

    def __init__(self, model: LlamaForCausalLM | Gemma3ForCausalLM) -> None:
        self._ropes = decode_step.Ropes(model)
        self.kinds, self.of_layers = self._ropes.kinds, self._ropes.of_layers
        self._like = torch.empty(0)  # the tables' dtype and device

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tables = self._ropes(self._like, torch.from_numpy(positions)[:, None]).values()  # in the order of kinds
        cos = torch.stack([cos.reshape(len(positions), -1) for cos, _ in tables])
        sin = torch.stack([sin.reshape(len(positions), -1) for _, sin in tables])
        return cos.numpy(), sin.numpy()


def _ropes(model: LlamaForCausalLM | Gemma3ForCausalLM, dim: int) -> rope_tables.Tables | _TorchRopes:
    """The model's RoPE tables: rope_tables' where it computes its configuration's rotary
    embeddings and the model's are the configuration's (a gguf's rope_freqs divides the model's
    frequencies after it: then, as for other RoPE types, PyTorch's tables)."""
    tables = rope_tables.of_config(model.config, dim, len(model.model.layers))
    rotary = model.model.rotary_emb
    remade: Any = type(rotary)  # its class, of the model's configuration
    made = dict(remade(config=model.config).named_buffers())
    if tables is None or any(not torch.equal(buffer, made[name]) for name, buffer in rotary.named_buffers()):
        return _TorchRopes(model)
    return tables


def _activation(config: PretrainedConfig) -> int | None:
    """native_forward.c's number for the MLP's activation, None for one it does not compute."""
    name = getattr(config, "hidden_activation" if config.model_type == "gemma3_text" else "hidden_act", None)
    return native_pass.ACTIVATIONS.get(name or "")


def _product(linear: torch.nn.Module, biased: bool = False) -> Product:
    """The product of a linear's weights; its bias, where ``biased`` lets it have one, is the
    caller's to add (the pass adds q, k and v's: Layer.qkv_bias)."""
    if getattr(linear, "bias", None) is not None and not biased:
        raise TypeError("native_forward adds a bias to q, k and v only")
    if isinstance(linear, fast_weights.Int8Linear):
        return Product(
            c_build.address(linear.function), -1, linear.packed.data_ptr(), linear.scale.data_ptr(),
            linear.out_features, linear.in_features,
        )
    if isinstance(linear, gguf_weights.GgufLinear):
        return Product(
            c_build.address(linear.function), linear.kind, linear.blocks.data_ptr(), None,
            linear.out_features, linear.in_features,
        )
    raise TypeError(f"native_forward takes int8 rows and gguf blocks, not {type(linear).__name__}")


class _TorchLayer:
    """A cache_layers layer as a pass places it (native_pass.PassLayer); ``like`` is of its
    positions to come (their shape but for the positions, and their dtype)."""

    __slots__ = ("layer", "like")

    def __init__(self, layer: GrowingKeysAndValues, like: torch.Tensor) -> None:
        self.layer, self.like = layer, like

    @property
    def length(self) -> int:
        return self.layer.length

    @property
    def capacity(self) -> int:
        return self.layer.capacity

    def place(self, total: int, transposed: bool) -> tuple[int, ...]:
        layer, like = self.layer, self.like
        if not layer.is_initialized:
            layer.lazy_initialization(like, like)
        keys, values = layer.reserve(total, like, like)
        numbers = (keys.data_ptr(), values.data_ptr(), keys.stride(1), values.stride(1))
        if not transposed:
            return (*numbers, 0, 0, 0)
        kept = layer.transposed_keys()
        return (*numbers, kept.tiles.data_ptr(), kept.tiles.stride(0), kept.count.buffer_info()[0])

    def placed(self) -> tuple[object, object]:
        return self.layer.buffers, self.layer.transposed

    def hold(self, total: int) -> None:
        self.layer.hold(total)

    def keep_first(self, keep: int) -> None:
        self.layer.keep_first(keep)


class NativeForward(Passes):
    """A Llama or Gemma 3 model's passes, each one call of native_forward.c (native_pass.Runner)."""

    def __init__(self, model: PreTrainedModel, quantization: str, llama_cpp: bool = False) -> None:
        """``llama_cpp``: in llama.cpp's arithmetic (llama_cpp_arithmetic), else the worker's own."""
        model = cast("LlamaForCausalLM | Gemma3ForCausalLM", model)
        inner, config = model.model, model.config
        self._gemma = config.model_type == "gemma3_text"
        heads = config.num_attention_heads
        kv_heads = config.num_key_value_heads or heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self._embed = inner.embed_tokens
        ropes = _LlamaCppRopes(cast("LlamaForCausalLM", model), dim) if llama_cpp else _ropes(model, dim)
        self._ropes = ropes
        like = torch.empty(1, kv_heads, 1, dim)  # a layer's positions to come, for its buffers
        self._kept: list[object] = []  # what the call reads that nothing else holds
        decoder_layers = [cast("LlamaDecoderLayer | Gemma3DecoderLayer", layer) for layer in inner.layers]
        layers = (Layer * len(decoder_layers))()
        for index, layer in enumerate(decoder_layers):
            attention, mlp = layer.self_attn, layer.mlp
            # Gemma 3 normalizes each sublayer's output too; Llama's post_attention_layernorm is the MLP's input norm
            pre_mlp = getattr(layer, "pre_feedforward_layernorm", None)
            norm_mid = layer.post_attention_layernorm if pre_mlp is None else pre_mlp
            window = getattr(attention, "sliding_window", None)
            qkv: list[torch.nn.Module] = [attention.q_proj, attention.k_proj, attention.v_proj]
            layers[index] = Layer(
                self._scale(layer.input_layernorm), self._scale(norm_mid),
                self._scale(getattr(attention, "q_norm", None)), self._scale(getattr(attention, "k_norm", None)),
                self._scale(layer.post_attention_layernorm if pre_mlp is not None else None),
                self._scale(getattr(layer, "post_feedforward_layernorm", None)), self._biases(qkv),
                window or 0, ropes.kinds.index(ropes.of_layers[index]),
                self._side_by_side(qkv, 3),
                _product(attention.o_proj),
                self._side_by_side([mlp.gate_proj, mlp.up_proj], 2),
                _product(mlp.down_proj),
            )
        head = _product(model.lm_head)
        final = cast("LlamaRMSNorm | Gemma3RMSNorm", inner.norm)
        epsilon = final.eps if self._gemma else final.variance_epsilon
        described = Model(
            len(decoder_layers), config.hidden_size, heads, kv_heads, dim, config.intermediate_size,
            head.outputs, _activation(config), epsilon, float(decoder_layers[0].self_attn.scaling), SHARE_FROM,
            self._scale(final), head, layers, *exact_attention.loaded().addresses(),
            native_pass.LLAMA_CPP if llama_cpp else native_pass.OWN,
        )
        self._runner: native_pass.Runner[TorchCache] = native_pass.Runner(
            described, [layers, *self._kept], embed=self._embedded, ropes=ropes, owner_of=lambda cache: cache.kv,
            layers_of=lambda cache: [_TorchLayer(cast("GrowingKeysAndValues", layer), like) for layer in cache.kv.layers],
            # llama.cpp's arithmetic attends a step's row as any other: no transposed keys to keep
            transposed_steps=not llama_cpp,
        )

    @property
    def described(self) -> tuple[Model, rope_tables.Tables | _TorchRopes | _LlamaCppRopes]:
        """What the passes compute: the struct and the RoPE tables (a kept int8 model's note: int8_store)."""
        return self._runner.model, self._ropes

    def _scale(self, norm: torch.nn.Module | None) -> int | None:
        """Where an RMSNorm's scale is (Llama's weight; Gemma's one plus its weight, in float32,
        as transformers computes it): None without the norm."""
        if norm is None:
            return None
        weight = cast(torch.Tensor, norm.weight)
        if not self._gemma:
            return weight.data_ptr()
        scale = 1.0 + weight.float()
        self._kept.append(scale)
        return scale.data_ptr()

    def _biases(self, linears: list[torch.nn.Module]) -> int | None:
        """Where the linears' biases lie side by side (float32; zeros for one without), None
        where none of them has one."""
        biases = [getattr(linear, "bias", None) for linear in linears]
        if all(bias is None for bias in biases):
            return None
        side_by_side = torch.cat([
            torch.zeros(cast(int, linear.out_features)) if bias is None else cast(torch.Tensor, bias).detach().float()
            for linear, bias in zip(linears, biases)
        ])
        self._kept.append(side_by_side)
        return side_by_side.data_ptr()

    def _side_by_side(self, linears: list[torch.nn.Module], count: int):
        """Products of linears that read the same input (their biases, where q, k and v have them,
        added by the pass): one joined where they join."""
        joined = fast_weights.fused(linears)
        if isinstance(joined, (fast_weights.Int8Linear, gguf_weights.GgufLinear)):
            self._kept.append(joined)
            products = [_product(joined)]
        else:
            products = [_product(linear, biased=count == 3) for linear in linears]
        return (Product * count)(*products, *[Product() for _ in range(count - len(products))])

    def _embedded(self, ids: list[int]) -> tuple[int, object]:
        """Where the tokens' embeddings are, (total, hidden) float32 (the call overwrites them),
        and the tensor that holds them."""
        hidden = self._embed(torch.tensor(ids, dtype=torch.long)).float().contiguous()
        return hidden.data_ptr(), hidden

    def forward(
        self, sequences: Sequence[Sequence[int]], caches: Sequence[TorchCache], last: Sequence[int] | None = None
    ) -> torch.Tensor:
        return self.forward_highest(sequences, caches, last)[0]

    def forward_highest(
        self, sequences: Sequence[Sequence[int]], caches: Sequence[TorchCache], last: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """The highest of each row found by the threads that computed its parts (native_pass.Runner)."""
        logits, best = self._runner.forward_highest(sequences, caches, last, torch.get_num_threads())
        return torch.from_numpy(logits), best
