"""A gguf file's own 4- and 8-bit weights, multiplied as llama.cpp multiplies them.

transformers loads a gguf by dequantizing it to floats; quantizing those again (int8
rows, an int4 refit: fast_weights) gives a second lossy copy whose answers drift from the
published model's (a refit int4 SmolLM2 named the wrong capital of France). Here the
linears whose gguf tensors are Q4_1 (groups of 32 weights with an fp16 scale d and
minimum m: w = d·q + m) or Q8_0 (w = d·q) keep those blocks byte for byte, and a kernel of
the worker's own (gguf_kernel.c) multiplies them the way llama.cpp's CPU backend does:
each activation row quantized to 8-bit blocks first, integer dot products, scales and sums
in llama.cpp's order. So the products are llama.cpp's, and greedy output follows
llama.cpp's (tests/test_gguf_weights.py checks it against llama.cpp's own tokens); a
decode step reads 20 bytes per 32 weights (int8: 32).

Each output row is computed from its input row alone, so a position gets the same numbers
in a prompt chunk of any size, in a decode step and in a batch (with exact_attention, as
for the other quantized weights). The kernel is built like exact_attention's, once per
machine into ``<data dir>/kernels``; where it cannot be built the worker loads int8
weights instead and says why.

Models of the Llama architecture only: the gguf stores their q and k rows permuted (for
llama.cpp's rotary embedding), and this module puts them back in transformers' order, as
transformers' own gguf loader does.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from worker.backends.transformers.torch_threads import threads_for
from worker.files import open_regular
from worker.gguf.types import BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TYPES

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from worker.backends.transformers.exact_attention import CFunction

KERNEL_SOURCE = Path(__file__).with_name("gguf_kernel.c")
ARCHITECTURES = {"llama": "LLAMA"}  # transformers' model_type: gguf's MODEL_ARCH
# ggml's type number: bytes per block of 32 weights
BLOCK_BYTES = {3: 20, 8: 34}  # Q4_1, Q8_0
BLOCK = 32
# Every type gguf_kernel.c multiplies, by ggml's type number: (weights per block, bytes per
# block). A row of n weights is n / weights blocks.
LAYOUTS = {number: (TYPES[number].weights, TYPES[number].bytes) for number in (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)}


def bytes_per_row(kind: int, in_features: int) -> int | None:
    """Bytes of one weight row of type ``kind`` with ``in_features`` weights; None where the
    kernel does not take the type or the row is not whole blocks."""
    if kind not in LAYOUTS or in_features <= 0 or in_features % LAYOUTS[kind][0]:
        return None
    weights, size = LAYOUTS[kind]
    return in_features // weights * size

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [ctypes.c_int, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, ctypes.c_int]
_matmul: CFunction | None = None


def load_kernel(data_dir: Path) -> None:
    """Build (on first use) and load gguf_kernel.c; raises exact_attention.KernelUnavailable."""
    global _matmul
    if _matmul is None:
        from worker.backends.transformers.exact_attention import built_function

        function = built_function(data_dir / "kernels", KERNEL_SOURCE, "lmw_gguf_matmul")
        function.argtypes, function.restype = _ARGTYPES, ctypes.c_int
        _matmul = function


class GgufLinear(torch.nn.Module):
    """A linear whose weight rows are gguf blocks of one type (``kind``: ggml's type number), as
    a (out_features, row bytes) uint8 tensor, and its float32 bias where it has one (Qwen2's q,
    k and v)."""

    blocks: torch.Tensor  # a buffer (moved with the module)

    def __init__(self, kind: int, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if _matmul is None:
            raise RuntimeError("load_kernel() first")
        if blocks.dim() != 2 or blocks.dtype != torch.uint8 or blocks.shape[1] != bytes_per_row(kind, in_features):
            shape = tuple(blocks.shape)
            raise ValueError(f"gguf weights: {shape} bytes are not rows of {in_features} weights of type {kind}")
        self.kind, self.in_features, self.out_features = kind, in_features, blocks.shape[0]
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.register_buffer("blocks", blocks.contiguous())
        self.function = _matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def product(*rows_args: int) -> None:
            status = self.function(self.kind, self.blocks.data_ptr(), self.out_features, self.in_features, *rows_args)
            if status == 1:
                raise MemoryError("gguf weights: no memory for the quantized activations")
            if status != 0:
                raise RuntimeError(f"gguf kernel: status {status} for type {self.kind}, {self.in_features} inputs")

        y = float_rows_product(x, self.in_features, self.out_features, product)
        return y if self.bias is None else y + self.bias


def float_rows_product(x: torch.Tensor, inputs: int, outputs: int, product: Callable[..., None]) -> torch.Tensor:
    """x's rows (float32, each `inputs` numbers) times a kernel's weights, in x's dtype: the
    calling convention the worker's product kernels share. ``product(x, rows, row_stride, out,
    threads)`` (addresses and counts) writes `outputs` floats per row; small products run on
    the calling thread alone (threads wake slower than they would help)."""
    flat = x.reshape(-1, inputs).float()
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    out = torch.empty(rows, outputs)
    threads = threads_for(rows * outputs * inputs)
    product(flat.data_ptr(), rows, flat.stride(0) if rows > 1 else inputs, out.data_ptr(), threads)
    return out.to(x.dtype).reshape(*x.shape[:-1], outputs)


def joined(linears: list[GgufLinear]) -> GgufLinear | None:
    """One GgufLinear for linears of one block type that read the same input (their rows one
    after another): each output number is computed as by its own linear, bit for bit."""
    first = linears[0]
    if any(linear.kind != first.kind or linear.in_features != first.in_features for linear in linears):
        return None
    return GgufLinear(first.kind, torch.cat([linear.blocks for linear in linears]), first.in_features)


def blocks_of(model: PreTrainedModel, gguf_file: Path) -> dict[str, tuple[int, torch.Tensor]]:
    """The gguf blocks of the model's linears that the kernel takes, by module name
    (``model.layers.0.self_attn.q_proj``): (ggml type, (out_features, row bytes) uint8 rows in
    the model's row order). Empty for an architecture this module does not know."""
    import gguf
    import numpy as np

    config: Any = model.config  # the architecture's own config class: which one, ARCHITECTURES decides
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        return {}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], config.num_hidden_layers)
    data = _mapped(gguf_file)
    tensors = _tensor_table(data)
    if getattr(config, "tie_word_embeddings", False) and "token_embd.weight" in tensors:
        tensors.setdefault("output.weight", tensors["token_embd.weight"])  # the output shares the embedding
    found = {}
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or module.bias is not None:
            continue
        gguf_name = names.get_name(f"{name}.weight", try_suffixes=(".weight",)) or ""
        if gguf_name not in tensors:
            continue
        kind, shape, offset = tensors[gguf_name]
        if kind not in BLOCK_BYTES or shape != [module.in_features, module.out_features] or module.in_features % BLOCK:
            continue
        row_bytes = module.in_features // BLOCK * BLOCK_BYTES[kind]
        rows = np.frombuffer(data, np.uint8, module.out_features * row_bytes, offset).reshape(-1, row_bytes)
        if name.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = config.num_attention_heads if name.endswith("q_proj") else config.num_key_value_heads
            rows = rows[_unpermuted_rows(module.out_features, heads)]
        found[name] = (kind, torch.from_numpy(rows.copy()))
    return found


def _mapped(path: Path) -> mmap.mmap:
    """The file mapped read-only (unmapped when the last view of it goes), opened through
    worker.files: only a regular file is read."""
    descriptor = open_regular(path)
    try:
        return mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(descriptor)


# gguf's metadata value types (GGUFValueType) of a fixed size, in struct's letters
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _tensor_table(data: mmap.mmap) -> dict[str, tuple[int, list[int], int]]:
    """name: (ggml type, shape as gguf lists it (inputs first), absolute offset of its data).
    Reads the header only: gguf.GGUFReader parses every metadata value (a tokenizer's tens of
    thousands of strings), seconds of a load for nothing the weights need."""
    import struct

    position = 0

    def take(form: str) -> Any:
        nonlocal position
        values = struct.unpack_from("<" + form, data, position)
        position += struct.calcsize("<" + form)
        return values[0] if len(values) == 1 else values

    def text() -> str:
        nonlocal position
        length = take("Q")
        position += length
        return bytes(data[position - length:position]).decode("utf-8", "replace")

    def skip(kind: int) -> None:
        nonlocal position
        if kind == _STRING:
            length = take("Q")  # (not `position += take(...)`: that adds to the position before the take)
            position += length
        elif kind == _ARRAY:
            item, count = take("IQ")
            if item in _SCALARS:
                position += count * struct.calcsize(_SCALARS[item])
            else:
                for _ in range(count):
                    skip(item)
        else:
            position += struct.calcsize(_SCALARS[kind])

    magic, version = take("4sI")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"not a gguf file of version 2 or later (magic {magic!r}, version {version})")
    tensor_count, field_count = take("QQ")
    alignment = 32
    for _ in range(field_count):
        key, kind = text(), take("I")
        if key == "general.alignment" and kind == 4:
            alignment = take("I")
        else:
            skip(kind)
    table = {}
    for _ in range(tensor_count):
        name = text()
        dims = take("I")
        shape = list(struct.unpack_from(f"<{dims}Q", data, position))
        position += 8 * dims
        kind, offset = take("IQ")
        table[name] = (kind, shape, offset)
    start = -(-position // alignment) * alignment
    return {name: (kind, shape, start + offset) for name, (kind, shape, offset) in table.items()}


def _unpermuted_rows(rows: int, heads: int):
    """Which gguf row each of transformers' q (or k) rows is: llama.cpp's converter
    interleaved each head's two rotary halves; this undoes it (transformers'
    LlamaTensorProcessor._reverse_permute_weights, on row indices)."""
    import numpy as np

    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def dequantized(kind: int, blocks: torch.Tensor) -> torch.Tensor:
    """The float32 weights the blocks stand for, (rows, weights per row) (for checks: the
    kernel never needs them): gguf's own dequantization."""
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(kind)).copy())
