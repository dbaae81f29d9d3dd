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

The file is compiled once per machine with the system's C compiler (``cc``, or ``CC``)
into ``<data dir>/kernels`` when a model with quantized weights is loaded, and loaded
with ctypes: a build happens once per machine and data directory, and a build that fails
leaves the worker on float64 attention, not without a model.

The kernels a load builds (this one, int8_kernel.c, native_forward.c, gguf_kernel.c) share
one bound on the compiler's time (COMPILE_TIMEOUT_S, kept in the load's context:
load_progress.shared): a compiler that hangs is killed once it is spent, and the load's
later kernels are not tried, each falling back as where there is no compiler; the next load
tries again. A cancelled load kills the compiler at once (load_progress.cancelled).
"""

from __future__ import annotations

import _ctypes
import array
import ctypes
import hashlib
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from worker import load_progress
from worker.backends.transformers.torch_threads import attention_work, threads_for
from worker.files import is_regular

if TYPE_CHECKING:
    from ctypes import _NamedFuncPointer as CFunction  # typeshed's name for a library's function

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("exact_attention.c")
# -ffp-contract=off: every multiply and add rounds on its own, as the source's order says.
# -fno-trapping-math: nothing reads the floating-point exception flags, so GCC may compute both
# sides of a choice in vectors (native_forward's activations); no number changes.
FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-shared", "-fPIC"]
# Tried in turn: -march=native for the machine's widest vectors, -fopenmp for threads
# (linked against libgomp.so.1, the OpenMP runtime torch has loaded, so the kernel's threads
# are torch's own). Some compilers take neither.
_OPTIONS = (["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], [])
# Several times what a load's builds take together (bench/README.md, "Figures behind
# constants"): a compiler that takes this long over one load's builds is hung, and the load
# waits on it. One bound for all the builds of a load (_Budget).
COMPILE_TIMEOUT_S = 30.0
# For tests only: a worker process's bound in seconds, in place of COMPILE_TIMEOUT_S (PROTOCOL 13).
TIMEOUT_ENV = "LM_WORKER_COMPILE_TIMEOUT_S"
_POLL_S = 0.05  # how often a build looks whether its load was cancelled
_MOST_GROUPS = 64  # query heads per key/value head the kernel takes (MOST_GROUPS there)

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR, _I64, _I64, _I64] * 3 + [_PTR, _PTR, _PTR] + [_I64] * 5 + [ctypes.c_float, ctypes.c_int]
_STEP_ARGTYPES = [_PTR, _I64, _I64] * 3 + [_PTR] * 10 + [_I64] * 4 + [ctypes.c_float, ctypes.c_int]


_UNLOADABLE = "could not load"


class KernelUnavailable(Exception):
    """The kernel could not be built or loaded on this machine (the message says why)."""


def library_function(library: Path, name: str) -> CFunction:
    """The C function ``name`` of the library at ``library`` (ctypes), or KernelUnavailable."""
    try:
        loaded = ctypes.CDLL(str(library))
    except OSError as exc:
        raise KernelUnavailable(f"{_UNLOADABLE} {library}: {exc}") from exc
    try:
        return getattr(loaded, name)
    except AttributeError as exc:
        # Let go of it: a library stays loaded under its name, and the one built over it would never be.
        _ctypes.dlclose(loaded._handle)
        raise KernelUnavailable(f"{_UNLOADABLE} {library}: {exc}") from exc


def address(function: CFunction) -> int:
    """Where a loaded C function is, for native code that calls it."""
    where = ctypes.cast(function, ctypes.c_void_p).value
    assert where is not None, "a loaded function has an address"
    return where


def built_function(directory: Path, source: Path, name: str) -> CFunction:
    """The C function ``name`` of ``source``, built into ``directory`` if it is not there yet;
    raises KernelUnavailable with the compiler's words when it cannot be built."""
    try:
        return library_function(_build(directory, source=source), name)
    except KernelUnavailable as exc:
        if not exc.args[0].startswith(_UNLOADABLE):
            raise
        # A file under the kernel's name that does not load (damaged, or not ours): build it again.
        log.warning("%s; building it again", exc)
        return library_function(_build(directory, again=True, source=source), name)


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
        return dim % 16 == 0 and heads % kv_heads == 0 and heads // kv_heads <= _MOST_GROUPS

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


def _build(directory: Path, again: bool = False, source: Path = SOURCE) -> Path:
    """The library of the C file ``source`` in ``directory`` (named after the file, the
    compiler, its flags and the machine), compiled unless it is there (or ``again``)."""
    compiler = os.environ.get("CC", "cc")
    path, text = source, source.read_bytes()
    machine = _machine()
    for options in _OPTIONS:
        flags = [*options, *FLAGS]
        digest = hashlib.sha256(repr((text, compiler, flags, machine)).encode()).hexdigest()[:16]
        library = directory / f"{path.stem}-{digest}.so"
        if is_regular(library) and not again:  # a FIFO there would block the loader, holding the GIL
            return library
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # Written beside and renamed into place: workers sharing a data directory never load half a file.
            handle, partial = tempfile.mkstemp(dir=directory, suffix=".so.partial")
            os.close(handle)
        except OSError as exc:
            raise KernelUnavailable(f"cannot write the kernel into {directory}: {exc.strerror or exc}") from exc
        try:
            built = _compile([compiler, *flags, "-o", partial, str(path)])
        except OSError as exc:
            os.unlink(partial)
            raise KernelUnavailable(f"no C compiler ({compiler!r}: {exc})") from exc
        except BaseException:  # out of time (KernelUnavailable), or the load was cancelled
            os.unlink(partial)
            raise
        if built.returncode == 0:
            try:
                os.replace(partial, library)
            except OSError as exc:  # a directory under the library's name
                os.unlink(partial)
                raise KernelUnavailable(f"cannot write the kernel as {library}: {exc.strerror or exc}") from exc
            return library
        os.unlink(partial)
    raise KernelUnavailable(f"{compiler} could not build {path.name}: {built.stderr.strip()[-2000:]}")


class _Budget:
    """The compiler's time left to one load (load_progress.shared; outside a load, to one build):
    each build takes from it, and once one has run past it no other is tried in that load."""

    def __init__(self) -> None:
        self.bound_s = _bound_s()
        self.left_s = self.bound_s
        self.spent: str | None = None  # why the load's later builds are not tried


def _bound_s() -> float:
    try:
        bound = float(os.environ.get(TIMEOUT_ENV, COMPILE_TIMEOUT_S))
    except ValueError:
        return COMPILE_TIMEOUT_S
    return bound if 0 < bound <= COMPILE_TIMEOUT_S else COMPILE_TIMEOUT_S


def _compile(command: list[str]) -> subprocess.CompletedProcess:
    """Run the compiler in a process group of its own, all of which is killed when the load's
    time for builds is spent or the load is cancelled (a compiler's own children, cc1 and as,
    would otherwise run on): KernelUnavailable then, or the load's -32800. A load sees it as a
    stage of one step, over when the compiler is, whatever it said."""
    budget = load_progress.shared("kernel builds", _Budget)
    if budget.spent is not None:
        raise KernelUnavailable(budget.spent)
    report = load_progress.stage("building_kernel", 1, "steps")
    started = time.monotonic()
    try:
        return _run_compiler(command, budget.left_s)
    except subprocess.TimeoutExpired:
        budget.left_s = 0.0
        raise KernelUnavailable(
            f"the C compiler ({command[0]!r}) timed out: still running when the {budget.bound_s:g} s that a load's "
            "kernel builds share were spent, so it was killed (the next load tries again)"
        ) from None
    finally:
        budget.left_s -= time.monotonic() - started
        if budget.left_s <= 0 and budget.spent is None:
            budget.spent = (
                f"not tried: the C compiler ({command[0]!r}) timed out earlier in this load, the {budget.bound_s:g} s "
                "that a load's kernel builds share being spent (the next load tries again)"
            )
        report(1)


def _run_compiler(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """The compiler's run; subprocess.TimeoutExpired after ``timeout_s``, and the load's -32800
    as soon as it is cancelled (load_progress.check), the process group killed either way."""
    deadline = time.monotonic() + timeout_s
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            while True:
                try:  # retried after a timeout, communicate loses no output
                    stdout, stderr = process.communicate(timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    load_progress.check()
                    if time.monotonic() >= deadline:
                        raise subprocess.TimeoutExpired(command, timeout_s) from None
        except BaseException:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # the group is gone already
                pass
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _machine() -> str:
    """What code built with -march=native depends on: the processor's instruction sets."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {platform.processor()} {sys.platform} {flags}"
