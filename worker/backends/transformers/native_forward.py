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

import array
import ctypes
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from worker import c_build
from worker.backends.transformers import decode_step, exact_attention, fast_weights, gguf_weights, hf_compat, rope_tables
from worker.backends.transformers.torch_threads import SHARE_FROM
from worker.backends.transformers.decode_step import Passes

if TYPE_CHECKING:
    from transformers import Gemma3ForCausalLM, LlamaForCausalLM, PretrainedConfig, PreTrainedModel
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    from worker.backends.transformers.cache_layers import GrowingKeysAndValues
    from worker.c_build import CFunction
    from worker.backends.transformers.torch_adapter import TorchCache

SOURCE = Path(__file__).with_name("native_forward.c")
# What the cache identity calls this arithmetic (hf_compat.config_digest), and llama.cpp's.
# Its RoPE tables are rope_tables' ("lm_worker_native" named those of PyTorch's rotary embedding).
FORWARD = "lm_worker_native_rope64"
FORWARD_LLAMA_CPP = "lm_worker_native_llama_cpp"
_OWN, _LLAMA_CPP = 0, 1  # native_forward.c's enum arithmetic

# native_forward.c's enum activation
_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}

_I64, _PTR, _FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Product(ctypes.Structure):
    _fields_ = [("function", _PTR), ("type", _I64), ("weights", _PTR), ("scale", _PTR), ("outputs", _I64), ("inputs", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("norm_in", _PTR), ("norm_mid", _PTR), ("norm_q", _PTR), ("norm_k", _PTR), ("norm_attended", _PTR),
        ("norm_out", _PTR), ("qkv_bias", _PTR), ("window", _I64), ("rope", _I64), ("qkv", _Product * 3), ("out", _Product),
        ("gate_up", _Product * 2), ("down", _Product),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("dim", _I64), ("intermediate", _I64),
        ("vocab", _I64), ("activation", _I64), ("epsilon", _FLOAT), ("scaling", _FLOAT), ("share_from", _I64), ("norm", _PTR),
        ("head", _Product), ("layer", ctypes.POINTER(_Layer)), ("attention", _PTR), ("step", _PTR), ("arithmetic", _I64),
    ]


class _Pass(ctypes.Structure):
    _fields_ = [
        ("sequences", _I64), ("rows", _PTR), ("lengths", _PTR), ("kb", _PTR), ("vb", _PTR), ("kh", _PTR), ("vh", _PTR),
        ("tb", _PTR), ("th", _PTR), ("tc", _PTR), ("hidden", _PTR), ("cos", _PTR), ("sin", _PTR), ("wanted", _PTR), ("wanted_count", _I64), ("logits", _PTR),
        ("best", _PTR), ("threads", ctypes.c_int),
    ]


_forward: CFunction | None = None
_rope: CFunction | None = None
_highest: CFunction | None = None


def load_kernel(data_dir: Path) -> None:
    """Build (on first use) and load native_forward.c; raises c_build.KernelUnavailable."""
    global _forward, _rope, _highest
    if _forward is None:
        function = c_build.built_function(data_dir / "kernels", SOURCE, "lmw_forward")
        function.argtypes, function.restype = [ctypes.POINTER(_Model), ctypes.POINTER(_Pass)], ctypes.c_int
        rope = c_build.built_function(data_dir / "kernels", SOURCE, "lmw_llama_cpp_rope")
        rope.argtypes, rope.restype = [_I64, _I64, _I64, _FLOAT, _PTR, _PTR], ctypes.c_int
        highest = c_build.built_function(data_dir / "kernels", SOURCE, "lmw_highest")
        highest.argtypes, highest.restype = [_PTR, _I64, _I64, _PTR, ctypes.c_int], ctypes.c_int
        _forward, _rope, _highest = function, rope, highest


def highest(rows: torch.Tensor, threads: int) -> list[int]:
    """The index of each row's highest number (a float32 matrix), as native_forward.c's pass
    finds it for greedy choices: the first of equal ones, the first NaN where there is one."""
    assert _highest is not None, "load_kernel() first"
    rows = rows.contiguous()
    best = array.array("q", bytes(8 * rows.shape[0]))
    if _highest(rows.data_ptr(), rows.shape[0], rows.shape[1], best.buffer_info()[0], threads) != 0:
        raise MemoryError("native forward: no memory to find the highest logits")
    return best.tolist()


def applies(config: PretrainedConfig, dtype: str, quantization: str) -> bool:
    """Whether a model of this configuration, loaded with this dtype and quantization, computes
    its passes here: a model decode_step takes (Llama, Gemma 3) with its usual activation
    (SiLU, GELU's tanh form), in float32, every linear multiplied by the worker's kernels
    (int8 rows, gguf blocks), with exact attention of heads its kernel takes."""
    if _forward is None or dtype != "float32" or quantization not in ("int8", "gguf"):
        return False
    if fast_weights.int8_products() is None or hf_compat.attention_implementation(config) != hf_compat.EXACT_ATTENTION:
        return False
    if not decode_step.supports(config) or _activation(config) is None:
        return False
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return exact_attention.Kernel.takes_heads(heads, kv_heads, dim)


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
            assert _rope is not None
            _rope(have, size - have, self._dim, self._base, cos[have:].ctypes.data, sin[have:].ctypes.data)
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
    return _ACTIVATIONS.get(name or "")


def _product(linear: torch.nn.Module, biased: bool = False) -> _Product:
    """The product of a linear's weights; its bias, where ``biased`` lets it have one, is the
    caller's to add (the pass adds q, k and v's: _Layer.qkv_bias)."""
    if getattr(linear, "bias", None) is not None and not biased:
        raise TypeError("native_forward adds a bias to q, k and v only")
    if isinstance(linear, fast_weights.Int8Linear):
        return _Product(
            c_build.address(linear.function), -1, linear.packed.data_ptr(), linear.scale.data_ptr(),
            linear.out_features, linear.in_features,
        )
    if isinstance(linear, gguf_weights.GgufLinear):
        return _Product(
            c_build.address(linear.function), linear.kind, linear.blocks.data_ptr(), None,
            linear.out_features, linear.in_features,
        )
    raise TypeError(f"native_forward takes int8 rows and gguf blocks, not {type(linear).__name__}")


class _Places:
    """What native_forward.c reads of one sequence's layers (its pass's columns kb, vb, kh, vh,
    and for a step tb, th, tc: a number for each layer), gathered with room made for ``total``
    positions. Gathered layer by layer at every step this cost more than a tenth of a
    four-sequence step; a step's are kept while the layers keep their buffers and transposed
    keys (``serves``), which they replace whenever they move or drop them."""

    COLUMNS = ("kb", "vb", "kh", "vh", "tb", "th", "tc")
    __slots__ = ("kv", "layers", "buffers", "transposed", "capacity", "columns")

    def __init__(self, cache: TorchCache, total: int, like: torch.Tensor, transposed: bool) -> None:
        self.kv = cache.kv
        self.layers = [cast("GrowingKeysAndValues", layer) for layer in cache.kv.layers]
        self.columns = tuple(array.array("q") for _ in self.COLUMNS)
        for layer in self.layers:
            if not layer.is_initialized:
                layer.lazy_initialization(like, like)
            keys, values = layer.reserve(total, like, like)
            kept = layer.transposed_keys() if transposed else None
            numbers = (keys.data_ptr(), values.data_ptr(), keys.stride(1), values.stride(1))
            if kept is None:
                numbers += (0, 0, 0)
            else:
                numbers += (kept.tiles.data_ptr(), kept.tiles.stride(0), kept.count.buffer_info()[0])
            for column, number in zip(self.columns, numbers):
                column.append(number)
        self.buffers = [layer.buffers for layer in self.layers]
        self.transposed = [layer.transposed for layer in self.layers]
        self.capacity = min(layer.capacity for layer in self.layers)

    def serves(self, cache: TorchCache, total: int) -> bool:
        """Whether these are still the places of ``cache``'s layers, with room for ``total``."""
        return (
            self.kv is cache.kv
            and total <= self.capacity
            and all(
                layer.buffers is buffers and layer.transposed is kept
                for layer, buffers, kept in zip(self.layers, self.buffers, self.transposed)
            )
        )


class NativeForward(Passes):
    """A Llama or Gemma 3 model's passes, each one call of native_forward.c."""

    def __init__(self, model: PreTrainedModel, quantization: str, llama_cpp: bool = False) -> None:
        """``llama_cpp``: in llama.cpp's arithmetic (llama_cpp_arithmetic), else the worker's own."""
        assert _forward is not None, "load_kernel() first"
        model = cast("LlamaForCausalLM | Gemma3ForCausalLM", model)
        inner, config = model.model, model.config
        self._gemma = config.model_type == "gemma3_text"
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads or self._heads
        self._dim = getattr(config, "head_dim", None) or config.hidden_size // self._heads
        self._llama_cpp = llama_cpp
        self._embed = inner.embed_tokens
        self._ropes = _LlamaCppRopes(cast("LlamaForCausalLM", model), self._dim) if llama_cpp else _ropes(model, self._dim)
        self._like = torch.empty(1, self._kv_heads, 1, self._dim)  # a layer's positions to come, for its buffers
        self._kept: list[torch.Tensor | torch.nn.Module] = []  # what the call reads that nothing else holds
        decoder_layers = [cast("LlamaDecoderLayer | Gemma3DecoderLayer", layer) for layer in inner.layers]
        layers = (_Layer * len(decoder_layers))()
        for index, layer in enumerate(decoder_layers):
            attention, mlp = layer.self_attn, layer.mlp
            # Gemma 3 normalizes each sublayer's output too; Llama's post_attention_layernorm is the MLP's input norm
            pre_mlp = getattr(layer, "pre_feedforward_layernorm", None)
            norm_mid = layer.post_attention_layernorm if pre_mlp is None else pre_mlp
            window = getattr(attention, "sliding_window", None)
            qkv: list[torch.nn.Module] = [attention.q_proj, attention.k_proj, attention.v_proj]
            layers[index] = _Layer(
                self._scale(layer.input_layernorm), self._scale(norm_mid),
                self._scale(getattr(attention, "q_norm", None)), self._scale(getattr(attention, "k_norm", None)),
                self._scale(layer.post_attention_layernorm if pre_mlp is not None else None),
                self._scale(getattr(layer, "post_feedforward_layernorm", None)), self._biases(qkv),
                window or 0, self._ropes.kinds.index(self._ropes.of_layers[index]),
                self._side_by_side(qkv, 3),
                _product(attention.o_proj),
                self._side_by_side([mlp.gate_proj, mlp.up_proj], 2),
                _product(mlp.down_proj),
            )
        head = _product(model.lm_head)
        final = cast("LlamaRMSNorm | Gemma3RMSNorm", inner.norm)
        epsilon = final.eps if self._gemma else final.variance_epsilon
        self._layers = layers
        self._model = _Model(
            len(decoder_layers), config.hidden_size, self._heads, self._kv_heads, self._dim, config.intermediate_size,
            head.outputs, _activation(config), epsilon, float(decoder_layers[0].self_attn.scaling), SHARE_FROM,
            self._scale(final), head, layers, *exact_attention.loaded().addresses(), _LLAMA_CPP if llama_cpp else _OWN,
        )
        self._vocab = head.outputs
        self._steps: weakref.WeakKeyDictionary[TorchCache, _Places] = weakref.WeakKeyDictionary()

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
        return (_Product * count)(*products, *[_Product() for _ in range(count - len(products))])

    def _places_of(self, cache: TorchCache, total: int, step: bool) -> _Places:
        """Where a pass finds the sequence's layers, with room for ``total`` positions; a step's
        (which keeps the keys transposed) are kept for the next one while they still serve, and
        dropped at any other pass (which may move the buffers: the old ones are not kept alive)."""
        if not step:
            self._steps.pop(cache, None)
            return _Places(cache, total, self._like, transposed=False)
        places = self._steps.get(cache)
        if places is None or not places.serves(cache, total):
            places = self._steps[cache] = _Places(cache, total, self._like, transposed=True)
        return places

    def forward(
        self, sequences: Sequence[Sequence[int]], caches: Sequence[TorchCache], last: Sequence[int] | None = None
    ) -> torch.Tensor:
        return self.forward_highest(sequences, caches, last)[0]

    def forward_highest(
        self, sequences: Sequence[Sequence[int]], caches: Sequence[TorchCache], last: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """The highest of each row found by the threads that computed its parts, in their
        cores' caches: read by another thread, a row of a vocabulary's logits first has to come
        across from the other core's cache (bench/README.md, "Figures behind constants")."""
        rows = [len(sequence) for sequence in sequences]
        lengths = [cache.length for cache in caches]
        ids = torch.tensor([token for sequence in sequences for token in sequence], dtype=torch.long)
        positions = np.array([length + i for length, n in zip(lengths, rows) for i in range(n)], dtype=np.int64)
        hidden = self._embed(ids).float().contiguous()  # (total, hidden); the call overwrites it
        cos, sin = self._ropes(positions)  # (ropes, total, dim), in the order of kinds
        columns = [array.array("q") for _ in _Places.COLUMNS]  # [b * layers + layer]
        held = []
        for cache, length, n in zip(caches, lengths, rows):
            # llama.cpp's arithmetic attends a step's row as any other: no transposed keys to keep
            places = self._places_of(cache, length + n, n == 1 and not self._llama_cpp)
            for column, own in zip(columns, places.columns):
                column.extend(own)
            held.append((places.layers, length + n))
        ends, wanted = 0, array.array("q")
        for n, keep in zip(rows, [1] * len(rows) if last is None else last):
            ends += n
            wanted.extend(range(ends - keep, ends))
        logits = torch.empty(len(wanted), self._vocab)
        best = array.array("q", bytes(8 * len(wanted)))
        counts, starts = array.array("q", rows), array.array("q", lengths)
        call = _Pass(
            len(rows), counts.buffer_info()[0], starts.buffer_info()[0], *(column.buffer_info()[0] for column in columns),
            hidden.data_ptr(), cos.ctypes.data, sin.ctypes.data, wanted.buffer_info()[0], len(wanted), logits.data_ptr(),
            best.buffer_info()[0], torch.get_num_threads(),
        )
        assert _forward is not None
        if _forward(ctypes.byref(self._model), ctypes.byref(call)) != 0:
            for layers, _ in held:  # what the layers before the failure wrote past their positions is not theirs
                for layer in layers:
                    layer.keep_first(layer.length)
            raise MemoryError("native forward: no memory for a pass's scratch space")
        for layers, total in held:
            for layer in layers:
                layer.hold(total)
        for cache, n in zip(caches, rows):
            cache.length += n
        return logits, best.tolist()
