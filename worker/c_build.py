"""The worker's C kernels built with the machine's compiler and loaded with ctypes. Torch-free.

Each kernel is a C file compiled once per machine with the system's C compiler (``cc``, or
``CC``) into ``<data dir>/kernels`` and loaded with ctypes (``built``, ``built_function``): a
library is named after its source, the compiler, its flags and (for code built with
-march=native) the processor's instruction sets, written beside and renamed into place so
that workers sharing a data directory never load half a file, and built again where a file
under its name does not load. A build that fails raises KernelUnavailable with the
compiler's words; each caller falls back as where there is no compiler.

The kernels a load builds share one bound on the compiler's time (COMPILE_TIMEOUT_S, kept in
the load's context: load_progress.shared): a compiler that hangs is killed once it is spent,
and the load's later kernels are not tried, each falling back; the next load tries again. A
cancelled load kills the compiler at once (load_progress.cancelled).
"""

from __future__ import annotations

import _ctypes
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from worker import load_progress
from worker.files import is_regular

if TYPE_CHECKING:
    from ctypes import _NamedFuncPointer as CFunction  # pyright: ignore[reportPrivateUsage] (typeshed's name for it)

log = logging.getLogger(__name__)

# -ffp-contract=off: every multiply and add rounds on its own, as the source's order says.
# -fno-trapping-math: nothing reads the floating-point exception flags, so GCC may compute both
# sides of a choice in vectors (native_forward's activations); no number changes.
FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-shared", "-fPIC"]
# Linked after the source: libm by name, so that a kernel's expf is glibc's current one rather than
# the oldest version an unnamed library's symbol binds to (a wrapper that checks errno around the
# same function: 7% of a prompt in llama.cpp's arithmetic, bench/README "Figures behind constants").
LIBRARIES = ["-lm"]
# Tried in turn: -march=native for the machine's widest vectors, -fopenmp for threads
# (linked against libgomp.so.1, the OpenMP runtime torch has loaded, so the kernel's threads
# are torch's own). Some compilers take neither.
OPTIONS: tuple[list[str], ...] = (["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], [])
# Several times what a load's builds take together (bench/README.md, "Figures behind
# constants"): a compiler that takes this long over one load's builds is hung, and the load
# waits on it. One bound for all the builds of a load (_Budget).
COMPILE_TIMEOUT_S = 30.0
# For tests only: a worker process's bound in seconds, in place of COMPILE_TIMEOUT_S (PROTOCOL 13).
TIMEOUT_ENV = "LM_WORKER_COMPILE_TIMEOUT_S"
_POLL_S = 0.05  # how often a build looks whether its load was cancelled
_UNLOADABLE = "could not load"

T = TypeVar("T")


class KernelUnavailable(Exception):
    """A kernel could not be built or loaded on this machine (the message says why)."""


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
    return built(directory, source, lambda library: library_function(library, name))


def built(
    directory: Path, source: Path, load: Callable[[Path], T], *, flags: Sequence[str] = FLAGS,
    options: Sequence[list[str]] = OPTIONS, per_machine: bool = True, bound_s: float | None = None,
) -> T:
    """``load`` of the library of ``source``, built into ``directory`` if it is not there yet
    (``flags`` with the first of ``options`` the compiler takes; ``per_machine``: named after the
    processor too, for code built for it). ``bound_s``: the compiler's time outside a load's
    shared bound (within a load, the load's bound). A library under its name that ``load`` cannot
    load (KernelUnavailable "could not load ...": damaged, or not ours) is built again."""
    settings = {"flags": flags, "options": options, "per_machine": per_machine, "bound_s": bound_s}
    try:
        return load(_build(directory, source, **settings))
    except KernelUnavailable as exc:
        if not exc.args[0].startswith(_UNLOADABLE):
            raise
        log.warning("%s; building it again", exc)
        return load(_build(directory, source, again=True, **settings))


def _build(
    directory: Path, source: Path, again: bool = False, *, flags: Sequence[str] = FLAGS,
    options: Sequence[list[str]] = OPTIONS, per_machine: bool = True, bound_s: float | None = None,
) -> Path:
    """The library of the C file ``source`` in ``directory`` (named after the file, the
    compiler, its flags and, ``per_machine``, the machine), compiled unless it is there (or ``again``)."""
    compiler = os.environ.get("CC", "cc")
    text = source.read_bytes()
    machine = _machine() if per_machine else None
    built: subprocess.CompletedProcess[str] | None = None
    for option in options:
        command_flags = [*option, *flags]
        named = (text, compiler, command_flags, LIBRARIES, machine) if per_machine else (text, compiler, command_flags, LIBRARIES)
        digest = hashlib.sha256(repr(named).encode()).hexdigest()[:16]
        library = directory / f"{source.stem}-{digest}.so"
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
            built = _compile([compiler, *command_flags, "-o", partial, str(source), *LIBRARIES], bound_s)
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
    assert built is not None, "at least one set of options"
    raise KernelUnavailable(f"{compiler} could not build {source.name}: {built.stderr.strip()[-2000:]}")


class _Budget:
    """The compiler's time left to one load (load_progress.shared; outside a load, to one build):
    each build takes from it, and once one has run past it no other is tried in that load."""

    def __init__(self, bound_s: float | None) -> None:
        self.bound_s = _bound_s() if bound_s is None else bound_s
        self.left_s = self.bound_s
        self.spent: str | None = None  # why the load's later builds are not tried


def _bound_s() -> float:
    try:
        bound = float(os.environ.get(TIMEOUT_ENV, COMPILE_TIMEOUT_S))
    except ValueError:
        return COMPILE_TIMEOUT_S
    return bound if 0 < bound <= COMPILE_TIMEOUT_S else COMPILE_TIMEOUT_S


def _compile(command: list[str], bound_s: float | None) -> subprocess.CompletedProcess[str]:
    """Run the compiler in a process group of its own, all of which is killed when the load's
    time for builds is spent or the load is cancelled (a compiler's own children, cc1 and as,
    would otherwise run on): KernelUnavailable then, or the load's -32800. A load sees it as a
    stage of one step, over when the compiler is, whatever it said."""
    budget = load_progress.shared("kernel builds", lambda: _Budget(bound_s))
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


def _run_compiler(command: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
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
