"""A model directory's kept int8 weights computed without torch or transformers: a Llama, Qwen2,
Qwen3 or Gemma 3 model's passes from int8_file's views of the kept file, into native_forward.c's
structs (native_pass), as gguf_pass computes a mapped gguf's.

What NativeForward computes from the shell model int8_store maps over the same file, this
computes from the file: the same int8 products over the same rows (q, k and v, and gate and up,
joined where fast_weights.Int8Linear.joined joins them: a copy), the norms (Gemma's scales one
plus the weight in float32, as NativeForward makes them) and Qwen2's biases side by side, the
embedding's rows looked up (times Gemma's √hidden in float32, as the shell's embedding), the RoPE
tables of the frequencies the torch pass used, and kv_buffers' caches: its logits bit for bit.

The numbers the pass needs that the file does not hold (``Int8Config``) are those the torch path
computed with: int8_model keeps them beside the file.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from worker.backends.transformers import native_pass, rope_tables
from worker.backends.transformers.gguf_pass import ArrayPass, LayerNorms
from worker.backends.transformers.int8_file import ITEM_ROWS, StoreError, int8_layout
from worker.backends.transformers.native_pass import Layer, Model, Product
from worker.backends.transformers.torch_threads import SHARE_FROM

GEMMA = "gemma3_text"


class Int8Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What NativeForward's struct held for the model, less the addresses (native_pass.Model)."""

    model_type: str  # transformers': llama, qwen2, qwen3, gemma3_text
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    dim: int
    intermediate: int
    vocab: int
    activation: int  # native_pass.ACTIVATIONS'
    epsilon: float
    scaling: float
    windows: list[int]  # each layer's sliding window, 0 for full attention
    ropes: list[int]  # each layer's RoPE tables (an index into frequencies)
    frequencies: list[list[float]]  # each kind of RoPE's inverse frequencies (rope_tables)

    def problem(self) -> str | None:
        """What makes these numbers no model the pass computes, None where nothing does."""
        sizes = (self.layers, self.hidden, self.heads, self.kv_heads, self.dim, self.intermediate, self.vocab)
        if self.model_type not in ("llama", "qwen2", "qwen3", GEMMA) or min(sizes) < 1 or max(sizes) > 1 << 24:
            return f"a {self.model_type} model of sizes {sizes}"
        if not native_pass.takes_heads(self.heads, self.kv_heads, self.dim):
            return f"heads of {self.dim} ({self.heads} for {self.kv_heads} key/value heads)"
        if self.activation not in native_pass.ACTIVATIONS.values():
            return f"the activation {self.activation}"
        if len(self.windows) != self.layers or len(self.ropes) != self.layers or min(self.windows) < 0:
            return "not a window and a RoPE of each layer"
        if not self.frequencies or any(len(kind) != self.dim // 2 for kind in self.frequencies) or not all(
            0 <= rope < len(self.frequencies) for rope in self.ropes
        ):
            return "not RoPE frequencies of each kind a layer has"
        return None


class Int8Pass(ArrayPass):
    """The passes of a kept int8 model (ArrayPass); ``tensors`` (int8_file.read's) are views of
    the mapping, which stays while the pass lives."""

    def __init__(self, tensors: dict[str, np.ndarray], config: Int8Config, data_dir: Path) -> None:
        """Raises StoreError where the tensors are not this model's (each one's dtype and shape,
        and no other), c_build.KernelUnavailable where a kernel cannot be built."""
        problem = config.problem()
        if problem is not None:
            raise StoreError(f"the kept model's configuration is not one the native pass computes: {problem}")
        self.config = config
        self._tensors = dict(tensors)
        native_pass.load_kernel(data_dir)
        attention, step = native_pass.attention_addresses(data_dir)
        self._matmul = native_pass.int8_address(data_dir)
        self._kept = []
        self._gemma = config.model_type == GEMMA
        self._embedding = self._take("model.embed_tokens.weight", "float32", (config.vocab, config.hidden))
        self._embed_scale = np.float32(config.hidden**0.5) if self._gemma else None  # the shell's, in float32
        layers = (Layer * config.layers)()
        for index in range(config.layers):
            layers[index] = self._layer(index)
        head = self._products(["lm_head"], config.vocab, config.hidden, [config.vocab])[0]
        final = self._norm("model.norm.weight", config.hidden)
        if self._tensors:
            raise StoreError(f"the kept file holds tensors this model does not use: {', '.join(sorted(self._tensors)[:5])}")
        model = Model(
            config.layers, config.hidden, config.heads, config.kv_heads, config.dim, config.intermediate, config.vocab,
            config.activation, config.epsilon, config.scaling, SHARE_FROM, final, head, layers, attention, step,
            native_pass.OWN,
        )
        self._kept.append(layers)
        frequencies: dict[str | None, np.ndarray] = {str(kind): np.array(values, np.float64)
                                                      for kind, values in enumerate(config.frequencies)}
        self._start(model, self._embedded, rope_tables.Tables(frequencies, [str(rope) for rope in config.ropes]))

    def _layer(self, index: int) -> Layer:
        config = self.config
        width, kv_width = config.heads * config.dim, config.kv_heads * config.dim
        name = f"model.layers.{index}."
        attention, mlp = name + "self_attn.", name + "mlp."
        qkv = [attention + part for part in ("q_proj", "k_proj", "v_proj")]
        sizes = [width, kv_width, kv_width]
        biases = None
        if config.model_type == "qwen2":
            biases = self._kept_address(np.concatenate([self._take(f"{linear}.bias", "float32", (size,))
                                                        for linear, size in zip(qkv, sizes)]))
        middle = "pre_feedforward_layernorm" if self._gemma else "post_attention_layernorm"  # Gemma's: after attention
        norms = self._layer_norms(
            LayerNorms(name + "input_layernorm.weight", name + middle + ".weight", attention + "q_norm.weight",
                       attention + "k_norm.weight", name + "post_attention_layernorm.weight",
                       name + "post_feedforward_layernorm.weight"),
            hidden=config.hidden, dim=config.dim, head_norms=config.model_type in ("qwen3", GEMMA), gemma=self._gemma,
        )
        return Layer(
            *norms, biases, config.windows[index], config.ropes[index],
            (Product * 3)(*self._products(qkv, width + 2 * kv_width, config.hidden, sizes, biases is None)),
            self._products([attention + "o_proj"], config.hidden, width, [config.hidden])[0],
            (Product * 2)(*self._products([mlp + "gate_proj", mlp + "up_proj"], 2 * config.intermediate, config.hidden,
                                          [config.intermediate] * 2)),
            self._products([mlp + "down_proj"], config.hidden, config.intermediate, [config.hidden])[0],
        )

    def _products(self, linears: list[str], outputs: int, inputs: int, sizes: list[int], joins: bool = True) -> list[Product]:
        """The products of linears that read the same input, each ``sizes[i]`` outputs: one of
        their rows joined (a copy) where NativeForward joins them (Int8Linear.joined: no bias,
        whole work items of rows), else one each."""
        weights = [(self._take(f"{linear}.packed", "uint8", int8_layout(inputs, size)[0]),
                    self._take(f"{linear}.scale", "float16", int8_layout(inputs, size)[1])) for linear, size in zip(linears, sizes)]
        if len(linears) > 1 and joins and not any(size % ITEM_ROWS for size in sizes):
            packed, scale = (np.concatenate(parts) for parts in zip(*weights))
            self._kept += [packed, scale]
            return [Product(self._matmul, -1, packed.ctypes.data, scale.ctypes.data, outputs, inputs)]
        return [Product(self._matmul, -1, packed.ctypes.data, scale.ctypes.data, size, inputs)
                for (packed, scale), size in zip(weights, sizes)]

    def _take(self, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        array = self._tensors.pop(name, None)
        if array is None:
            raise StoreError(f"the kept file has no tensor {name}")
        if (array.dtype.name, array.shape) != (dtype, shape):
            raise StoreError(f"the kept file's tensor {name} is {array.dtype.name} {list(array.shape)}, "
                             f"where the model needs {dtype} {list(shape)}")
        return array

    def _norm(self, name: str, count: int) -> int:
        """Where an RMSNorm's scale is: the weight; Gemma's one plus the weight, in float32."""
        weight = self._take(name, "float32", (count,))
        return self._kept_address(np.float32(1.0) + weight if self._gemma else weight)

    def _embedded(self, ids: list[int]) -> tuple[int, object]:
        """Where the tokens' embeddings are, (total, hidden) float32 (a copy: the call overwrites
        them), and the array that holds them."""
        rows = self._embedding[np.asarray(ids, dtype=np.int64)]
        if self._embed_scale is not None:
            rows = rows * self._embed_scale
        return rows.ctypes.data, rows
