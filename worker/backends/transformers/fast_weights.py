"""Weights that a decode step reads fast on the CPU: 4-bit groups, or 8-bit rows (or a
gguf file's own blocks: gguf_weights).

A decode step reads every weight once per token, so on a CPU its time is the bytes
read (the memory's bandwidth) plus a fixed cost per operation. Dense float32 weights
are 4 bytes a parameter; these are ½ (int4) or 1 (int8), multiplied by PyTorch's own
CPU kernels for weight-only quantized products.

- ``int4``: groups of 32 inputs share a scale and an offset (w = (q - 8)·scale + zero),
  as in the gguf files the shipped models come from (Q4_1, Q4_K), so those weights
  keep nearly the values they were published with.
- ``int8``: one scale per output row.

The kernels are fast with bfloat16 inputs only (float32 ones take 10 to 20 times
longer), so a linear rounds its input to bfloat16 and gives its output back in the
model's dtype: a float32 model keeps float32 everywhere else (norms, attention, the
residual sum, the KV cache). The kernels compute each output row from its input row
alone: a chunk of 256 rows gives each row the numbers it gets alone. PyTorch's attention
does not (its sums are blocked by the shape of the call), so for these weights the
worker computes attention with exact_attention's kernel (hf_compat.EXACT_ATTENTION,
or float64 where it cannot be built), and a position's numbers no longer depend on
the chunk or step it was computed in. Without that, the bfloat16 rounding made
last-bit differences a whole bfloat16 step, and greedy output with a cache differed
from greedy output without one (seen on SmolLM2). ``int8`` is the default on the CPU.

Every ``nn.Linear`` of the model is replaced, the output projection (``lm_head``)
included; embeddings stay as they are. A linear whose shape the int4 kernel does not
take (inputs not a multiple of 32, outputs not of 16) gets 8-bit rows: a dense product
would not give each row the numbers it gets alone.
"""

from __future__ import annotations

import torch

from worker import load_progress
from worker.backends.transformers.gguf_weights import GgufLinear, joined

GROUP = 32
KERNEL_DTYPE = torch.bfloat16
_INT4_ROW_BLOCK = 64  # rows of a packed int4 weight that the CPU kernel keeps together


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
    weight_int8: torch.Tensor  # buffers (moved with the module)
    scale: torch.Tensor

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("weight_int8", (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(KERNEL_DTYPE))
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

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
    report = load_progress.stage("quantizing", len(linears), "tensors")
    for replaced, (qualified, parent, name, child) in enumerate(linears, 1):
        if qualified in blocks:
            kind, rows = blocks[qualified]
            setattr(parent, name, GgufLinear(kind, rows, child.in_features))
        else:
            kind = Int4Linear if scheme == "int4" and _fits_int4(child) else Int8Linear
            setattr(parent, name, kind(child, dtype))
        report(replaced)
    return len(linears)


def fused(linears: list[torch.nn.Module]):
    """One matrix product for linears that read the same input (a layer's q, k and v, say):
    a function of the input giving their outputs side by side, equal bit for bit to each
    linear's own; None unless all of them are quantized alike, without bias."""
    if not all(type(linear) is type(linears[0]) and linear.bias is None for linear in linears):
        return None
    ggufs = [linear for linear in linears if isinstance(linear, GgufLinear)]
    int4s = [linear for linear in linears if isinstance(linear, Int4Linear)]
    int8s = [linear for linear in linears if isinstance(linear, Int8Linear)]
    if len(ggufs) == len(linears):
        return joined(ggufs)
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
