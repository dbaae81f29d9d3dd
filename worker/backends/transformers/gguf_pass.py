"""A mapped gguf's passes without torch or transformers: a Llama, Qwen2, Qwen3 or Gemma 3 model
read from worker.gguf.reader's GgufFile straight into native_forward.c's structs (native_pass).

What NativeForward computes from the torch model gguf_model builds of the same file, this
computes from the file: the same products over the same blocks (Llama's q and k rows put back
in transformers' order, the one copy; the others views of the mapping), the norms and biases
as float32 copies (Gemma's scales 1 + weight as the torch path makes them: the file's, less one,
plus one, in float32), the embedding's rows dequantized by gguf-py as a pass looks them up
(times Gemma's √hidden in float32), rope_tables' tables (a gguf's rope_freqs factors applied),
and kv_buffers' caches. So its logits are NativeForward's bit for bit; importing it costs numpy
and gguf-py, where torch and transformers cost about a second and 200 MB.

Every tensor the model needs must be in the file with its shape and a type the gguf kernel
multiplies, and the file must hold no other (GgufError): the checks and messages of both paths,
gguf_model taking them from here (``rows_of``, ``vector_of``, ``check_all_used``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from worker.backends.transformers import native_pass, rope_tables
from worker.backends.transformers.gguf_config import SLIDING, NotTaken, config_of
from worker.backends.transformers.kv_buffers import Cache
from worker.backends.transformers.native_pass import Layer, Model, Product
from worker.backends.transformers.torch_threads import SHARE_FROM
from worker.gguf.reader import GgufError, GgufFile, TensorInfo
from worker.gguf.types import BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, type_name

# The types gguf_kernel.c multiplies (gguf_weights.LAYOUTS gives their blocks), and those a vector may be.
KERNEL_TYPES = (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
_FLOAT_TYPES = (F32, F16, BF16)
_TAKEN = "which lm-worker does not multiply; it takes " + ", ".join(type_name(t) for t in sorted(KERNEL_TYPES))
ROPE_FREQUENCIES = "rope_freqs.weight"  # Llama 3.1's scaled frequencies: divide the rotary ones


class ArrayPass:
    """A torch-free model's passes, each one call of native_forward.c: ``forward_highest`` as
    NativeForward's, on kv_buffers' caches (``new_cache``), its logits numpy float32. A subclass
    describes its model (``_start``) from numpy arrays, keeping what the call reads that nothing
    else holds (``_kept_address``)."""

    _kept: list[object]
    _runner: native_pass.Runner[Cache]

    def _start(self, model: Model, embedded: Callable[[list[int]], tuple[int, object]], ropes: rope_tables.Tables) -> None:
        self._runner = native_pass.Runner(
            model, self._kept, embed=embedded, ropes=ropes, owner_of=lambda cache: cache.layers,
            layers_of=lambda cache: cache.layers, transposed_steps=True,
        )
        self._shape = (model.layers, model.kv_heads, model.dim)
        # the threads a pass of enough work takes: the cores this process may run on
        self.threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """A sequence's cache's layers, key/value heads and head size."""
        return self._shape

    def new_cache(self) -> Cache:
        """An empty cache for one sequence."""
        return Cache(*self._shape)

    def forward(self, sequences: Sequence[Sequence[int]], caches: Sequence[Cache], last: Sequence[int] | None = None) -> np.ndarray:
        return self.forward_highest(sequences, caches, last)[0]

    def forward_highest(
        self, sequences: Sequence[Sequence[int]], caches: Sequence[Cache], last: Sequence[int] | None = None
    ) -> tuple[np.ndarray, list[int]]:
        """Each sequence's new tokens fed after its cache (a decode step's one, a prompt chunk's
        many, a draft's few: one pass over the weights for all of them): the logits of the last
        ``last[i]`` (default 1) new positions of each sequence, in order, (sum(last), vocab)
        float32, and the index of each row's highest (native_pass.Runner)."""
        return self._runner.forward_highest(sequences, caches, last, self.threads)

    def _kept_address(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array, dtype=np.float32)
        self._kept.append(array)
        return array.ctypes.data

    def _norm(self, name: str, count: int) -> int:
        """Where the RMSNorm scale of the tensor ``name`` is (each model's own rule)."""
        raise NotImplementedError

    def _layer_norms(self, names: LayerNorms, *, hidden: int, dim: int, head_norms: bool, gemma: bool) -> tuple[int | None, ...]:
        """A layer's norms as Layer takes them (input, middle, q, k, attended, out), None where
        the model has none: q and k with ``head_norms`` (Qwen3, Gemma 3), attended and out for
        Gemma's normalized sublayer outputs. ``names``: the tensors' names in the model's file."""
        norm_q = norm_k = norm_attended = norm_out = None
        if head_norms:
            norm_q, norm_k = self._norm(names.q, dim), self._norm(names.k, dim)
        norm_in = self._norm(names.input, hidden)
        if gemma:
            norm_attended = self._norm(names.attended, hidden)
        norm_mid = self._norm(names.middle, hidden)
        if gemma:
            norm_out = self._norm(names.out, hidden)
        return norm_in, norm_mid, norm_q, norm_k, norm_attended, norm_out


class LayerNorms(NamedTuple):
    """The tensor names of a layer's norms (ArrayPass._layer_norms): before attention, before the
    MLP, of the heads' queries and keys, and Gemma's after attention and after the MLP."""

    input: str
    middle: str
    q: str
    k: str
    attended: str
    out: str


class GgufPass(ArrayPass):
    """The passes of a mapped gguf's model (ArrayPass). The file stays mapped while the pass lives
    (its weights are views of it)."""

    def __init__(self, file: GgufFile, data_dir: Path) -> None:
        """Raises GgufError for a file whose tensors do not make its model, NotTaken for a model
        not computed here, c_build.KernelUnavailable where a kernel cannot be built."""
        self.file = file
        self.config = config = config_of(file)
        if not native_pass.takes_heads(config.heads, config.kv_heads, config.dim):
            raise NotTaken(f"{file.path}: heads of {config.dim} ({config.heads} for {config.kv_heads} key/value heads), "
                           "which exact attention does not take")
        native_pass.load_kernel(data_dir)
        attention, step, self._matmul = native_pass.kernel_addresses(data_dir)
        self._used: set[str] = set()
        self._kept: list[object] = []  # what the call reads that the mapping does not hold
        self._embedding = self._rows("token_embd.weight", config.vocab, config.hidden, embedding=True)
        self._embedding_type = file.tensors["token_embd.weight"].type
        # Gemma's scaled embedding: √hidden in the model's dtype
        self._embed_scale = np.float32(np.sqrt(config.hidden)) if config.gemma else None
        layers = (Layer * config.layers)()
        for index in range(config.layers):
            layers[index] = self._layer(index)
        head = self._product("token_embd.weight" if config.tied else "output.weight", config.vocab, config.hidden)
        final = self._norm("output_norm.weight", config.hidden)
        self._ropes = self._rope_tables()
        check_all_used(file, config.architecture, self._used)
        model = Model(
            config.layers, config.hidden, config.heads, config.kv_heads, config.dim, config.intermediate, config.vocab,
            native_pass.ACTIVATIONS[config.activation], config.epsilon, config.scaling, SHARE_FROM, final, head,
            layers, attention, step, native_pass.OWN,
        )
        self._kept.append(layers)
        self._start(model, self._embedded, self._ropes)

    # --- the file's tensors into the pass's structs ---------------------------------------------

    def _layer(self, index: int) -> Layer:
        config = self.config
        width, kv_width = config.heads * config.dim, config.kv_heads * config.dim
        name = f"blk.{index}."
        qkv = [self._product(name + "attn_q.weight", width, config.hidden, unpermute=config.heads),
               self._product(name + "attn_k.weight", kv_width, config.hidden, unpermute=config.kv_heads),
               self._product(name + "attn_v.weight", kv_width, config.hidden)]
        biases = None
        if config.biased:
            biases = self._kept_address(np.concatenate([
                self._vector(name + f"attn_{part}.bias", size) for part, size in (("q", width), ("k", kv_width), ("v", kv_width))
            ]))
        out = self._product(name + "attn_output.weight", config.hidden, width)
        gate_up = [self._product(name + "ffn_gate.weight", config.intermediate, config.hidden),
                   self._product(name + "ffn_up.weight", config.intermediate, config.hidden)]
        down = self._product(name + "ffn_down.weight", config.hidden, config.intermediate)
        norms = self._layer_norms(
            LayerNorms(*(name + part + ".weight" for part in (
                "attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"))),
            hidden=config.hidden, dim=config.dim, head_norms=config.head_norms, gemma=config.gemma,
        )
        kind = config.layer_kinds[index]
        window = config.window if kind == SLIDING else 0
        return Layer(
            *norms, biases, window,
            list(config.rope_bases).index(kind), (Product * 3)(*qkv), out, (Product * 2)(*gate_up), down,
        )

    def _rows(self, name: str, outputs: int, inputs: int, embedding: bool = False) -> np.ndarray:
        self._used.add(name)
        return rows_of(self.file, name, outputs, inputs, embedding)

    def _product(self, name: str, outputs: int, inputs: int, unpermute: int = 0) -> Product:
        """The product of a linear's blocks; a Llama q or k (``unpermute``: its heads) has its rows
        put back in transformers' order, a copy (llama.cpp's converter interleaved each head's two
        rotary halves)."""
        rows = self._rows(name, outputs, inputs)
        if unpermute and self.config.architecture == "llama":
            rows = rows[unpermuted_rows(outputs, unpermute)]
            self._kept.append(rows)
        return Product(self._matmul, self.file.tensors[name].type, rows.ctypes.data, None, outputs, inputs)

    def _vector(self, name: str, count: int) -> np.ndarray:
        self._used.add(name)
        return vector_of(self.file, name, count)

    def _norm(self, name: str, count: int) -> int:
        """Where an RMSNorm's scale is: Llama's weight; Gemma's one plus its weight, as the torch
        path makes it of the file's one plus weight (less one, then one added, in float32)."""
        scale = self._vector(name, count)
        if self.config.gemma:
            one = np.float32(1.0)
            scale = one + (scale - one)
        return self._kept_address(scale)

    def _rope_tables(self) -> rope_tables.Tables:
        config = self.config
        factors = self._vector(ROPE_FREQUENCIES, config.dim // 2) if ROPE_FREQUENCIES in self.file.tensors else None
        frequencies = {}
        for kind, base in config.rope_bases.items():
            made = rope_tables.inverse_frequencies({"rope_type": "default", "rope_theta": base}, config.dim, factors)
            assert made is not None, "a default RoPE of an even head size"
            frequencies[kind] = made
        return rope_tables.Tables(frequencies, config.layer_kinds)

    def _embedded(self, ids: list[int]) -> tuple[int, object]:
        """Where the tokens' embeddings are, (total, hidden) float32 (the call overwrites them),
        and the array that holds them: the rows looked up widened (gguf-py's dequantization, as
        gguf_model.GgufEmbedding's), Gemma's times √hidden in float32."""
        rows = _dequantized(self._embedding_type, self._embedding[np.asarray(ids, dtype=np.int64)])
        if self._embed_scale is not None:
            rows = rows * self._embed_scale
        hidden = np.ascontiguousarray(rows, dtype=np.float32)
        if not hidden.flags.writeable:
            hidden = hidden.copy()
        return hidden.ctypes.data, hidden


def rows_of(file: GgufFile, name: str, outputs: int, inputs: int, embedding: bool = False) -> np.ndarray:
    """A linear's (or the ``embedding``'s) blocks as (outputs, row bytes) uint8, a view of the
    mapping; GgufError where the tensor is missing, its shape is not (inputs, outputs) as gguf
    lists it, or its type is not one the kernel multiplies (both paths' checks: gguf_model's too)."""
    tensor = _tensor(file, name)
    if embedding and tensor.type not in KERNEL_TYPES:
        raise GgufError(f"{file.path}: the embedding {name} is {type_name(tensor.type)}, {_TAKEN}")
    _check_shape(file, tensor, outputs, inputs)
    if tensor.type not in KERNEL_TYPES:
        raise GgufError(f"{file.path}: the tensor {name} is {type_name(tensor.type)}, {_TAKEN}")
    return _view(file, tensor, outputs)


def vector_of(file: GgufFile, name: str, count: int) -> np.ndarray:
    """A norm's scales or a bias as float32 (a copy: they are small); GgufError where the tensor
    is missing or is not ``count`` floats."""
    tensor = _tensor(file, name)
    if tensor.type not in _FLOAT_TYPES or tensor.count != count:
        raise GgufError(f"{file.path}: the tensor {name} is {type_name(tensor.type)} of shape "
                        f"{list(tensor.shape)}, where the model needs {count} floats")
    _check_shape(file, tensor, 1, count)
    return np.array(_dequantized(tensor.type, _view(file, tensor, 1)).reshape(count), np.float32)


def check_all_used(file: GgufFile, architecture: str, used: set[str]) -> None:
    """GgufError naming the file's tensors not in ``used``: no tensor is left out of the model."""
    left = sorted(set(file.tensors) - used)
    if left:
        raise GgufError(f"{file.path}: the file holds tensors a {architecture} model of this configuration does not "
                        "use: " + ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else ""))


def _tensor(file: GgufFile, name: str) -> TensorInfo:
    tensor = file.tensors.get(name)
    if tensor is None:
        raise GgufError(f"{file.path}: the tensor {name} is missing")
    return tensor


def _check_shape(file: GgufFile, tensor: TensorInfo, outputs: int, inputs: int) -> None:
    if tensor.shape != ((inputs, outputs) if outputs > 1 else (inputs,)) and tensor.shape != (inputs, outputs):
        raise GgufError(f"{file.path}: the tensor {tensor.name} has the shape {list(tensor.shape)}, "
                        f"where the model needs {[inputs, outputs]}")


def _view(file: GgufFile, tensor: TensorInfo, outputs: int) -> np.ndarray:
    return np.frombuffer(file.view(tensor), np.uint8).reshape(outputs, -1)


def unpermuted_rows(rows: int, heads: int) -> np.ndarray:
    """Which gguf row each of transformers' q (or k) rows is: llama.cpp's converter
    interleaved each head's two rotary halves; this undoes it (transformers'
    LlamaTensorProcessor._reverse_permute_weights, on row indices)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def _dequantized(kind: int, blocks: np.ndarray) -> np.ndarray:
    """The float32 numbers the blocks stand for, (rows, numbers per row): gguf-py's own dequantization."""
    import gguf

    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(kind))

