"""A gguf file's own quantized weights, multiplied as llama.cpp multiplies them.

transformers loads a gguf by dequantizing it to floats; quantizing those again (int8 rows, an
int4 refit: fast_weights) gives a second lossy copy whose answers drift from the published
model's (a refit int4 SmolLM2 named the wrong capital of France). A GgufLinear keeps a
linear's blocks byte for byte (any type of LAYOUTS: the float types, Q4_0 to Q8_0, Q4_K to
Q6_K), and a kernel of the worker's own (gguf_kernel.c, whose header gives each type's order)
multiplies them the way llama.cpp's CPU backend does: each activation row quantized to 8-bit
blocks first, integer dot products, scales and sums in a fixed order. So the products are
llama.cpp's, and each output row is computed from its input row alone: a position gets the
same numbers in a prompt chunk of any size, in a decode step and in a batch (with
exact_attention, as for the other quantized weights). The kernel is built like
exact_attention's, once per machine into ``<data dir>/kernels``.

A .gguf path loads mapped, its GgufLinears views of the file (gguf_model). ``blocks_of`` takes
the blocks of a model transformers loaded from a gguf, for the shipped default's conversion
loaded with quantization gguf: Llama models only, whose q and k rows the file keeps permuted
(for llama.cpp's rotary embedding) and which are put back in transformers' order here.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from worker.backends.transformers.gguf_pass import KERNEL_TYPES, unpermuted_rows
from worker.backends.transformers.torch_threads import threads_for
from worker.gguf.types import Q4_1, Q8_0, TYPES

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from worker.c_build import CFunction

KERNEL_SOURCE = Path(__file__).with_name("gguf_kernel.c")
ARCHITECTURES = {"llama": "LLAMA"}  # transformers' model_type: gguf's MODEL_ARCH
# Every type gguf_kernel.c multiplies (gguf_pass.KERNEL_TYPES), by ggml's type number: (weights
# per block, bytes per block). A row of n weights is n / weights blocks.
LAYOUTS = {number: (TYPES[number].weights, TYPES[number].bytes) for number in KERNEL_TYPES}


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
    """Build (on first use) and load gguf_kernel.c; raises c_build.KernelUnavailable."""
    global _matmul
    if _matmul is None:
        from worker.c_build import built_function

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


def blocks_of(model: PreTrainedModel, gguf_file: Path) -> dict[str, tuple[int, torch.Tensor]]:
    """The Q4_1 and Q8_0 blocks of the model's linears, by module name
    (``model.layers.0.self_attn.q_proj``): (ggml type, (out_features, row bytes) uint8 rows in
    the model's row order, copied out of the file). Empty for an architecture this module does
    not know. (A .gguf path loads mapped instead: gguf_model.)"""
    import gguf
    import numpy as np

    from worker.gguf.reader import read

    config: Any = model.config  # the architecture's own config class: which one, ARCHITECTURES decides
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        return {}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], config.num_hidden_layers)
    file = read(gguf_file)
    tensors = dict(file.tensors)
    if getattr(config, "tie_word_embeddings", False) and "token_embd.weight" in tensors:
        tensors.setdefault("output.weight", tensors["token_embd.weight"])  # the output shares the embedding
    found = {}
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or module.bias is not None:
            continue
        tensor = tensors.get(names.get_name(f"{name}.weight", try_suffixes=(".weight",)) or "")
        if tensor is None or tensor.shape != (module.in_features, module.out_features):
            continue
        if tensor.type not in (Q4_1, Q8_0) or bytes_per_row(tensor.type, module.in_features) is None:
            continue  # the others get int8 rows, as PROTOCOL.md says of the default's gguf blocks
        rows = np.frombuffer(file.view(tensor), np.uint8).reshape(module.out_features, -1)
        if name.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = config.num_attention_heads if name.endswith("q_proj") else config.num_key_value_heads
            rows = rows[unpermuted_rows(module.out_features, heads)]
        found[name] = (tensor.type, torch.from_numpy(rows.copy()))
    file.close()
    return found


def dequantized(kind: int, blocks: torch.Tensor) -> torch.Tensor:
    """The float32 weights the blocks stand for, (rows, weights per row) (for checks: the
    kernel never needs them): gguf's own dequantization."""
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(kind)).copy())
