"""Weights that a decode step reads fast on the CPU: 8-bit rows, or 4-bit groups (or a
gguf file's own blocks: gguf_weights).

A decode step reads every weight once per token, so on a CPU its time is the bytes
read (the memory's bandwidth) plus a fixed cost per operation. Dense float32 weights
are 4 bytes a parameter; these are 1 1/16 (int8, its scales included) or ½ (int4).

- ``int8`` (the default on the CPU): a float16 scale per 32 inputs of a row (as gguf's
  Q8_0), multiplied by the worker's own kernel (int8_kernel.c) in integers: each input row
  rounded to bfloat16 and quantized to 8 bits in blocks of 32, a block's byte products summed
  exactly, and each output one chain of fused multiply-adds over the blocks in order. So a
  row gets the numbers it gets alone, in a chunk of any size and in a batch, and the same bits
  on every processor (the AVX-512 VNNI, AVX2 and the plain C code alike). AVX-512 VNNI takes
  64 byte products an instruction where float multiply-adds take 16, so a prompt's products
  run several times as fast (bench/README.md, "Figures behind constants"); the scale per
  block keeps the answers closer to the dense model's than a scale per row. Where it cannot
  be built, PyTorch's kernel takes the rows (TorchInt8Linear: a scale per row, from inputs
  rounded to bfloat16, its sums blocked by the processor's vector width, but still row by
  row), and the log says why.
- ``int4``: groups of 32 inputs share a scale and an offset (w = (q - 8)·scale + zero),
  as in the gguf files the shipped models come from (Q4_1, Q4_K), so those weights
  keep nearly the values they were published with; PyTorch's CPU kernel multiplies
  them, fast with bfloat16 inputs only (float32 ones are many times slower: bench/README.md),
  so the linear rounds its input to bfloat16 and gives its output back in the model's dtype
  (as the int8 kernels do).

A float32 model keeps float32 everywhere else (norms, attention, the residual sum, the
KV cache). The products compute each output row from its input row alone. PyTorch's
attention does not (its sums are blocked by the shape of the call), so for these weights
the worker computes attention with exact_attention's kernel (hf_compat.EXACT_ATTENTION,
or float64 where it cannot be built), so that a position's numbers do not depend on the
chunk or step it is computed in. Without that, last-bit differences grow (through the
bfloat16 rounding, to a whole bfloat16 step), and greedy output with a cache can differ from
greedy output without one (SmolLM2's does).

Every ``nn.Linear`` of the model is replaced, the output projection (``lm_head``)
included; embeddings stay as they are. A linear whose shape the int4 kernel does not
take (inputs not a multiple of 32, outputs not of 16) gets 8-bit rows: a dense product
would not give each row the numbers it gets alone. A linear whose module's own code reads
its ``weight`` (Mamba's mixer multiplies by ``dt_proj.weight`` itself) stays dense, and the
log says so: a quantized one has no ``weight``, so the model's first pass would fail.
"""

from __future__ import annotations

import ctypes
import dis
import functools
import inspect
import logging
import types
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from worker import load_progress
from worker.backends.transformers import native_pass
from worker.backends.transformers.gguf_weights import GgufLinear, float_rows_product
# the kept file's layout is the kernel's (int8_layout: the shapes of a linear's packed rows and scales)
from worker.backends.transformers.int8_file import GROUP, int8_layout
from worker.backends.transformers.int8_file import ITEM_ROWS as _ITEM_ROWS
from worker.backends.transformers.int8_file import PANEL as _PANEL

if TYPE_CHECKING:
    from worker.c_build import CFunction

KERNEL_SOURCE = native_pass.INT8_SOURCE
# What the cache identity calls the kernel's arithmetic (hf_compat.config_digest): its bits
# are not PyTorch's int8 kernel's, so a cache computed with one must not pass for the other's.
# The activations in 8-bit blocks of 32; "lm_worker_int8" names an earlier kernel's float
# arithmetic, so caches computed with that one are another identity.
KERNEL_PRODUCTS = "lm_worker_int8_blocks"

KERNEL_DTYPE = torch.bfloat16
_INT4_ROW_BLOCK = 64  # rows of a packed int4 weight that the CPU kernel keeps together
_OFFSET = 128  # added to the stored weights, so that they are unsigned bytes (OFFSET there)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, ctypes.c_int]
_int8_matmul: CFunction | None = None
log = logging.getLogger(__name__)


def load_int8_kernel(data_dir: Path) -> None:
    """Build (on first use) and load int8_kernel.c; raises c_build.KernelUnavailable.
    Once it is loaded, quantize() gives int8 rows to Int8Linear."""
    global _int8_matmul
    if _int8_matmul is None:
        from worker.c_build import built_function

        function = built_function(data_dir / "kernels", KERNEL_SOURCE, "lmw_int8_matmul")
        function.argtypes, function.restype = _ARGTYPES, ctypes.c_int
        _int8_matmul = function


def int8_products() -> str | None:
    """KERNEL_PRODUCTS where the worker's kernel multiplies int8 rows; None where PyTorch's does."""
    return KERNEL_PRODUCTS if _int8_matmul is not None else None


def _int8_rows(linear: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as 8-bit rows: (rows, inputs) int8 and a float32 scale per row (|q| ≤ 127)."""
    weight = linear.weight.detach().float()
    scale = weight.abs().amax(1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def _int8_blocks(linear: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as 8-bit blocks of 32 inputs (the inputs padded with zeros to a multiple of 32):
    (rows, padded inputs) int8, and a float16 scale per block, (rows, blocks); each weight
    within half a step of its block's scale (|q| ≤ 127)."""
    weight = linear.weight.detach().float()
    blocks = torch.nn.functional.pad(weight, (0, -weight.shape[1] % GROUP)).reshape(weight.shape[0], -1, GROUP)
    # the scale the kernel reads (within float16's range), and so the one to divide by
    scale = (blocks.abs().amax(2) / 127).clamp(max=torch.finfo(torch.float16).max).half()
    wide = scale.float()[..., None]
    q = torch.where(wide > 0, blocks / wide.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    return q.round().clamp(-127, 127).to(torch.int8).reshape(weight.shape[0], -1), scale


class Int4Linear(torch.nn.Module):
    packed: torch.Tensor  # buffers (moved with the module)
    scale_and_zero: torch.Tensor

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        rows, inputs = weight.shape
        groups = weight.reshape(rows, inputs // GROUP, GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).reshape(rows, inputs)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2))
        self.register_buffer(
            "scale_and_zero", torch.stack([scale.t(), (low + 8 * scale).t()], -1).to(KERNEL_DTYPE).contiguous()
        )
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
        self.in_features, self.out_features = inputs, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scale_and_zero).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8Linear(torch.nn.Module):
    """8-bit blocks multiplied by int8_kernel.c (load_int8_kernel first), in its layout: the rows
    padded with zero rows to a multiple of 64 and the inputs with zeros to a multiple of 32, each
    panel of 16 rows stored by groups of 4 inputs, 128 added (``packed``: panels, inputs / 4, 16,
    4, unsigned bytes), and each panel's float16 scales block by block (``scale``: panels,
    blocks, 16)."""

    packed: torch.Tensor  # buffers (moved with the module)
    scale: torch.Tensor

    def __init__(
        self, packed: torch.Tensor, scale: torch.Tensor, in_features: int, out_features: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        if _int8_matmul is None:
            raise RuntimeError("load_int8_kernel() first")
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = in_features, out_features
        self.function = _int8_matmul

    @classmethod
    def of(cls, linear: torch.nn.Linear, dtype: torch.dtype) -> Int8Linear:
        q, scale = _int8_blocks(linear)
        rows, inputs = linear.out_features, linear.in_features
        padding = -rows % _ITEM_ROWS
        unsigned = (torch.nn.functional.pad(q, (0, 0, 0, padding)).to(torch.int16) + _OFFSET).to(torch.uint8)
        groups = unsigned.reshape(-1, _PANEL, q.shape[1] // 4, 4).transpose(1, 2)
        scales = torch.nn.functional.pad(scale, (0, 0, 0, padding)).reshape(-1, _PANEL, scale.shape[1]).transpose(1, 2)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls(groups.contiguous(), scales.contiguous(), inputs, rows, bias)

    @classmethod
    def joined(cls, linears: list[Int8Linear]) -> Int8Linear | None:
        """One linear for linears without bias that read the same input (their rows one after
        another), each output computed as by its own linear; None unless each has whole work
        items of rows (the padding would sit between their outputs)."""
        if any(linear.out_features % _ITEM_ROWS or linear.bias is not None for linear in linears):
            return None
        return cls(
            torch.cat([linear.packed for linear in linears]), torch.cat([linear.scale for linear in linears]),
            linears[0].in_features, sum(linear.out_features for linear in linears), None,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def product(*rows_args: int) -> None:
            if self.function(self.packed.data_ptr(), self.scale.data_ptr(), self.out_features, self.in_features, *rows_args):
                raise MemoryError("int8 weights: no memory for the quantized activations")

        y = float_rows_product(x, self.in_features, self.out_features, product)
        return y if self.bias is None else y + self.bias


class TorchInt8Linear(torch.nn.Module):
    """8-bit rows multiplied by PyTorch's CPU kernel, from inputs rounded to bfloat16 (fast only
    with those): where int8_kernel.c cannot be built."""

    weight_int8: torch.Tensor  # buffers (moved with the module)
    scale: torch.Tensor

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        q, scale = _int8_rows(linear)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale.to(KERNEL_DTYPE))
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
        self.in_features, self.out_features = q.shape[1], q.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def _fits_int4(linear: torch.nn.Linear) -> bool:
    return linear.in_features % GROUP == 0 and linear.out_features % 16 == 0


def quantize(model: torch.nn.Module, scheme: str, gguf_blocks: dict | None = None) -> int:
    """Replace the model's linears, in place, by ``scheme``'s; how many were replaced. With
    ``gguf_blocks`` (gguf_weights.blocks_of: module name to blocks), the linears it names keep
    their gguf blocks (GgufLinear) and the others get ``scheme``'s. The model must be on the CPU."""
    dtype = next(model.parameters()).dtype
    blocks = gguf_blocks or {}
    linears = [
        (f"{parent_name}.{name}" if parent_name else name, parent, name, child)
        for parent_name, parent in list(model.named_modules())
        for name, child in list(parent.named_children())
        if type(child) is torch.nn.Linear
    ]
    dense = [qualified for qualified, parent, name, _ in linears if _reads_weight(parent, name)]
    if dense:
        log.warning("%d linear%s kept dense, since %s module's code reads the weight itself: %s", len(dense),
                    "s" if len(dense) > 1 else "", "each one's" if len(dense) > 1 else "its", ", ".join(dense))
    report = load_progress.stage("quantizing", len(linears), "tensors")
    for replaced, (qualified, parent, name, child) in enumerate(linears, 1):
        if qualified in dense:
            pass
        elif qualified in blocks:
            kind, rows = blocks[qualified]
            setattr(parent, name, GgufLinear(kind, rows, child.in_features))
        else:
            int8 = Int8Linear.of if _int8_matmul is not None else TorchInt8Linear
            kind = Int4Linear if scheme == "int4" and _fits_int4(child) else int8
            setattr(parent, name, kind(child, dtype))
        report(replaced)
    return len(linears) - len(dense)


def _reads_weight(parent: torch.nn.Module, name: str) -> bool:
    """Whether ``parent``'s own code reads its child ``name``'s weight (``self.<name>.weight``)."""
    return name in _weights_read(type(parent))


@functools.cache
def _weights_read(kind: type) -> frozenset[str]:
    """The attributes whose ``weight`` a module class's methods read, PyTorch's own classes left
    out; found in their bytecode (reading their source parses whole files: seconds a load)."""
    found: set[str] = set()
    for klass in kind.__mro__:
        if klass.__module__.split(".")[0] in ("torch", "builtins"):
            continue
        for value in vars(klass).values():
            function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            function = inspect.unwrap(function) if callable(function) else function  # under its decorators
            if isinstance(code := getattr(function, "__code__", None), types.CodeType):
                found |= _read_in(code)
    return frozenset(found)


def _read_in(code: types.CodeType) -> set[str]:
    """``name`` of each ``self.<name>.weight`` in ``code`` and the code nested in it."""
    found = set()
    if "weight" in code.co_names:
        steps = list(dis.get_instructions(code))
        for first, second, third in zip(steps, steps[1:], steps[2:]):
            if (first.argval == "self" and first.opname.startswith(("LOAD_FAST", "LOAD_DEREF"))
                    and second.opname == "LOAD_ATTR" and third.argval == "weight"
                    and third.opname in ("LOAD_ATTR", "LOAD_METHOD")):
                found.add(second.argval)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            found |= _read_in(constant)
    return found


def fused(linears: list[torch.nn.Module]):
    """One matrix product for linears that read the same input (a layer's q, k and v, say):
    a function of the input giving their outputs side by side, equal bit for bit to each
    linear's own; None unless all of them are quantized alike, without bias."""
    if not all(type(linear) is type(linears[0]) and linear.bias is None for linear in linears):
        return None
    if isinstance(linears[0], GgufLinear):
        return None  # joined blocks are a copy: a mapped file's weights would be resident twice
    if isinstance(linears[0], Int8Linear):
        return Int8Linear.joined(cast("list[Int8Linear]", linears))
    int4s = [linear for linear in linears if isinstance(linear, Int4Linear)]
    int8s = [linear for linear in linears if isinstance(linear, TorchInt8Linear)]
    if len(int4s) == len(linears):
        if any(linear.out_features % _INT4_ROW_BLOCK for linear in int4s):
            return None  # the packed layout interleaves rows within blocks: only whole blocks join
        packed = torch.cat([linear.packed for linear in int4s])
        scale_and_zero = torch.cat([linear.scale_and_zero for linear in int4s], dim=1).contiguous()
        int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        return lambda x: int4_mm(x.to(KERNEL_DTYPE), packed, GROUP, scale_and_zero).to(x.dtype)
    if len(int8s) == len(linears):
        weight = torch.cat([linear.weight_int8 for linear in int8s])
        scale = torch.cat([linear.scale for linear in int8s])
        int8_mm = torch.ops.aten._weight_int8pack_mm
        return lambda x: int8_mm(x.to(KERNEL_DTYPE), weight, scale).to(x.dtype)
    return None
