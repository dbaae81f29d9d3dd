"""Float32 attention that gives a position the same numbers however it is computed.

With 8- or 4-bit weights (fast_weights) every product gives a row the numbers it gets
alone; attention is what remains. PyTorch's float32 attention does not: its products and
sums are blocked by the shape of the call, so a position computed in a chunk of 256
differs in its last bits from the same position computed alone or in a chunk of 100, and
the bfloat16 rounding before the next quantized product can turn that into a whole
bfloat16 step. Greedy output from a cache (the prompt's start computed in an earlier
request, in other chunks) then differs from greedy output without one.

exact_attention.c computes every sum of one query row in a fixed order (its header says
which), so a row's output depends only on its query and the keys and values it attends
to: the same bits in a chunk of any size, in a decode step, and on any thread. Float64
attention reaches the same end more slowly (bench/README.md, "Figures behind constants"),
and is what hf_compat uses where this kernel cannot be built or cannot take a call.

The file is compiled once per machine with the system's C compiler into ``<data dir>/kernels``
when a model with quantized weights is loaded, and loaded with ctypes (worker.c_build, which
the other kernels share, with its one bound on a load's compiler time): a build that fails
leaves the worker on float64 attention, not without a model.
"""

from __future__ import annotations

import array
import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from worker.backends.transformers import native_pass
from worker.backends.transformers.torch_threads import attention_work, threads_for
from worker.c_build import KernelUnavailable, address, built_function, library_function

if TYPE_CHECKING:
    from worker.c_build import CFunction

SOURCE = Path(__file__).with_name("exact_attention.c")

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR, _I64, _I64, _I64] * 3 + [_PTR, _PTR, _PTR] + [_I64] * 5 + [ctypes.c_float, ctypes.c_int]
_STEP_ARGTYPES = [_PTR, _I64, _I64] * 3 + [_PTR] * 10 + [_I64] * 4 + [ctypes.c_float, ctypes.c_int]


class Kernel:
    def __init__(
        self, library: Path | None = None, function: CFunction | None = None, step: CFunction | None = None
    ) -> None:
        if library is not None:
            function, step = library_function(library, "lmw_attention"), library_function(library, "lmw_step_attention")
        assert function is not None and step is not None, "a Kernel is made from a library or from its functions"
        self._function, self._step = function, step
        self._function.argtypes, self._step.argtypes = _ARGTYPES, _STEP_ARGTYPES
        self._function.restype = self._step.restype = ctypes.c_int

    def takes(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether the kernel computes attention of these shapes (on the CPU): keys and values
        of the query's head size (some models' values have another), a multiple of 16."""
        dim = query.shape[-1]
        return (
            query.device.type == "cpu" and keys.shape[-1] == values.shape[-1] == dim
            and keys.shape[:-1] == values.shape[:-1] and keys.shape[0] == query.shape[0]
            and self.takes_heads(query.shape[1], keys.shape[1], dim)
        )

    def addresses(self) -> tuple[int, int]:
        """Where lmw_attention and lmw_step_attention are, for native code that calls them."""
        return address(self._function), address(self._step)

    @staticmethod
    def takes_heads(heads: int, kv_heads: int, dim: int) -> bool:
        """Whether the kernel takes query and key/value heads of these numbers and size."""
        return native_pass.takes_heads(heads, kv_heads, dim)

    def attention(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """``query`` (batch, heads, positions, dim); ``keys``, ``values`` (batch, kv_heads, n,
        dim); query row (b, i) attends keys ``lo[b, i]`` to ``hi[b, i] - 1`` (int64 tensors of
        shape (batch, positions)). Returns (batch, positions, heads, dim) in float32."""
        query, keys, values = (_rows(tensor) for tensor in (query, keys, values))
        lo, hi = lo.contiguous(), hi.contiguous()
        batch, heads, positions, dim = query.shape
        kv_heads = keys.shape[1]
        out = torch.empty(batch, positions, heads, dim)
        threads = threads_for(attention_work(heads * positions * keys.shape[2], dim))
        status = self._function(
            query.data_ptr(), *query.stride()[:3], keys.data_ptr(), *keys.stride()[:3],
            values.data_ptr(), *values.stride()[:3], lo.data_ptr(), hi.data_ptr(), out.data_ptr(),
            batch, heads, kv_heads, positions, dim, scaling, threads,
        )
        if status != 0:
            raise MemoryError("exact attention: no memory for its scratch space")
        return out

    def step_attention(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, places: StepPlaces, scaling: float
    ) -> torch.Tensor:
        """A decode step's attention for several sequences in one call: ``query`` (batch, heads,
        dim), each sequence's new ``keys`` and ``values`` (batch, kv_heads, dim; each row's last
        dimension contiguous), which the call first writes into the sequence's buffers at its
        new position; ``places`` says where those are and which keys each attends. Returns
        (batch, heads, dim) in float32, each row the numbers ``attention`` gives it."""
        batch, heads, dim = query.shape
        kv_heads = keys.shape[1]
        query, keys, values = (_rows(tensor) for tensor in (query, keys, values))
        out = torch.empty(batch, heads, dim)
        threads = threads_for(attention_work(heads * places.keys, dim))
        kb, vb, kh, vh, lo, hi = places.addresses()
        status = self._step(
            query.data_ptr(), *query.stride()[:2], keys.data_ptr(), *keys.stride()[:2],
            values.data_ptr(), *values.stride()[:2], kb, vb, kh, vh, None, None, None, lo, hi, out.data_ptr(),
            batch, heads, kv_heads, dim, scaling, threads,
        )
        if status != 0:
            raise MemoryError("exact attention: no memory for its scratch space")
        return out


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """float32 with the last dimension contiguous (the kernel's strides are per row)."""
    tensor = tensor.float()
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


class StepPlaces:
    """Where each sequence of a decode step keeps one layer's keys and values (contiguous
    float32 buffers (1, kv_heads, capacity, dim), as GrowingKeysAndValues.reserve makes them),
    and which it attends: the call writes the new key and value at position ``hi - 1`` from
    ``start`` and attends ``lo`` up to ``hi``."""

    __slots__ = ("_columns", "keys")

    def __init__(self) -> None:
        # int64 arrays the kernel reads in place
        self._columns = tuple(array.array("q") for _ in range(6))
        self.keys = 0  # keys attended, in all

    def add(self, keys: torch.Tensor, values: torch.Tensor, start: int, lo: int, hi: int) -> None:
        """A sequence whose buffers are ``keys`` and ``values``, its positions counted from ``start``."""
        kb, vb, kh, vh, los, his = self._columns
        rows = start * keys.shape[3] * 4  # bytes of float32 rows before ``start``
        kb.append(keys.data_ptr() + rows)
        vb.append(values.data_ptr() + rows)
        kh.append(keys.stride(1))
        vh.append(values.stride(1))
        los.append(lo)
        his.append(hi)
        self.keys += hi - lo

    def addresses(self) -> list[int]:
        """Where the columns are (valid while this object lives and nothing is added)."""
        return [column.buffer_info()[0] for column in self._columns]


_loaded: Kernel | None = None


def kernel(data_dir: Path) -> Kernel:
    """The kernel, built into ``data_dir/kernels`` if it is not there yet; raises
    KernelUnavailable with the compiler's words when it cannot be built."""
    global _loaded
    if _loaded is None:
        directory = data_dir / "kernels"
        _loaded = Kernel(
            function=built_function(directory, SOURCE, "lmw_attention"),
            step=built_function(directory, SOURCE, "lmw_step_attention"),
        )
    return _loaded


def loaded() -> Kernel:
    """The kernel a model was loaded with (kernel() ran before any call needs it)."""
    if _loaded is None:
        raise KernelUnavailable("the exact attention kernel was not built")
    return _loaded
