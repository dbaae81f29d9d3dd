"""CRC-32C (Castagnoli), the checksum of a KVC3 cache file's tensors. Torch-free.

crc32c.c computes it with the processor's own instructions: AVX-512 carry-less multiplies
(VPCLMULQDQ) where there are, else the SSE4.2 crc32 instruction on three streams, else
tables; which one is chosen when the library loads (``path``). It is compiled once per
machine with the system's C compiler into ``<data dir>/kernels`` by worker.c_build, as the
transformers backend's kernels are (within a load, under the load's one bound on the
compiler's time), and loaded with ctypes (``load_kernel``; the first checksum asked for
loads it from the default data directory if nothing did before).

Where it cannot be built (no compiler), ``crc32c`` computes the same value with numpy
(``crc32c_numpy``: many stretches of the buffer a table step at a time, then joined), a
hundred times slower; a writer then writes the previous format, KVC2, whose CRC-32 ISA-L
computes as fast (``writes_crc32c``), and reads KVC3 files all the same.
"""

from __future__ import annotations

import array
import ctypes
import functools
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from worker.c_build import KernelUnavailable, built, library_function

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("crc32c.c")
POLY = 0x82F63B78  # reflected; x^32 + x^28 + x^27 + ... (0x1EDC6F41) as the CRC's registers hold it
# The kernel chooses its instructions at run time (target attributes), so one build serves
# any x86-64 processor (its name does not depend on the processor); tried in turn, as the
# other kernels' flags are.
FLAGS = ["-O3", "-shared", "-fPIC"]
_OPTIONS: tuple[list[str], ...] = (["-std=gnu11"], [])
# A build on first use runs in the request that needs a checksum: a hung compiler holds it this
# long, once in the process's life, and the numpy path serves from then on.
FIRST_USE_TIMEOUT_S = 10.0
PATHS = {0: "tables", 1: "sse4.2 crc32", 2: "avx512 vpclmulqdq"}


class _Kernel:
    def __init__(self, library: Path) -> None:
        functions = [library_function(library, name) for name in ("lmw_crc32c", "lmw_crc32c_sse42", "lmw_crc32c_portable")]
        for function in functions:
            function.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
            function.restype = ctypes.c_uint32
        self.fastest, self.sse42, self.portable = functions
        path = library_function(library, "lmw_crc32c_path")
        self.read = library_function(library, "lmw_read_crc32c")
        self.read.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                              ctypes.POINTER(ctypes.c_uint32)]
        self.read.restype = ctypes.c_int64
        self.run = library_function(library, "lmw_read_check_run")
        self.run.argtypes = [ctypes.c_int, ctypes.c_int64, *[ctypes.c_void_p] * 4, ctypes.c_int64, ctypes.c_void_p,
                             ctypes.c_void_p]
        self.run.restype = ctypes.c_int64
        path.restype = ctypes.c_int
        self.path = PATHS.get(path(), "tables")


_kernel: _Kernel | None = None
_tried: str | None = None  # why there is no kernel, once a load failed
_lock = threading.Lock()


def load_kernel(directory: Path, timeout_s: float | None = None) -> str:
    """Build crc32c.c into ``directory`` unless it is there (the compiler given ``timeout_s``
    outside a load's shared bound), and load it; returns the instructions it uses (``path``).
    Raises KernelUnavailable with the compiler's words. A worker's load may call it with the
    worker's data directory; otherwise the first checksum builds it into the default one."""
    global _kernel, _tried
    with _lock:
        if _kernel is None:
            try:
                _kernel = built(directory, SOURCE, _Kernel, flags=FLAGS, options=_OPTIONS, per_machine=False,
                                bound_s=timeout_s)
            except KernelUnavailable as exc:
                _tried = exc.args[0]
                raise
            _tried = None
        return _kernel.path


def _loaded() -> _Kernel | None:
    """The kernel, loaded from the default data directory on first use unless a load failed."""
    if _kernel is None and _tried is None:
        from worker.data_dir import default_data_dir

        try:
            load_kernel(default_data_dir() / "kernels", FIRST_USE_TIMEOUT_S)
        except KernelUnavailable as exc:
            log.warning("CRC-32C computed by numpy (about a hundred times slower); caches are written as KVC2: %s", exc)
    return _kernel


def path() -> str:
    """How ``crc32c`` computes: the kernel's instructions, or ``numpy`` without it."""
    kernel = _loaded()
    return kernel.path if kernel is not None else "numpy"


def writes_crc32c() -> bool:
    """Whether a writer should checksum with CRC-32C (KVC3): where the kernel computes it."""
    return _loaded() is not None


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC-32C of ``data``, continuing ``value`` (the CRC of what came before), as zlib.crc32
    continues a CRC-32."""
    kernel = _loaded()
    if kernel is None:
        return crc32c_numpy(data, value)
    array = _bytes(data)
    return kernel.fastest(value & 0xFFFFFFFF, array.ctypes.data, array.size)


def read_crc32c(fd: int, offset: int, into: memoryview, value: int, piece: int) -> tuple[int, int] | None:
    """Read ``into.nbytes`` bytes of the file ``fd`` from ``offset`` into ``into``, ``piece``
    bytes at a time, continuing the CRC-32C ``value`` over each piece as soon as it is read,
    in one call of the kernel: (bytes read, fewer where the file ended; the CRC of those).
    None without the kernel. Raises OSError where a read fails."""
    kernel = _loaded()
    if kernel is None:
        return None
    array = _bytes(into)
    crc = ctypes.c_uint32(value & 0xFFFFFFFF)
    count = kernel.read(fd, offset, array.ctypes.data, array.size, piece, ctypes.byref(crc))
    if count < 0:
        raise OSError(-count, os.strerror(-count))
    return count, crc.value


def read_check_run(
    fd: int, offsets: array.array[int], into: array.array[int], lengths: array.array[int], fresh: bytearray, piece: int
) -> tuple[array.array[int], bytearray] | None:
    """A reader thread's run of a file in one call of the kernel (lmw_read_check_run): item i
    is ``lengths[i]`` bytes from ``offsets[i]``, read to the address ``into[i]`` and its CRC-32C
    continued from the item before's (from 0 where ``fresh[i]``), or where ``into[i]`` is 0,
    padding checked to be zero. Returns each item's CRC after it and its state (1 whole, 0
    the file ended first, 2 padding that is not zero; the run stops at the first that is not
    1, and those after it stay 3); None without the kernel. Raises OSError where a read fails."""
    kernel = _loaded()
    if kernel is None:
        return None
    count = len(offsets)
    assert len(into) == len(lengths) == len(fresh) == count, "one of each for every item"
    crcs, states = array.array("I", bytes(4 * count)), bytearray(b"\3" * count)
    status = kernel.run(
        fd, count, offsets.buffer_info()[0], into.buffer_info()[0], lengths.buffer_info()[0],
        (ctypes.c_char * count).from_buffer(fresh) if count else None, piece, crcs.buffer_info()[0],
        (ctypes.c_char * count).from_buffer(states) if count else None,
    )
    if status < 0:
        raise OSError(-status, os.strerror(-status))
    return crcs, states


def crc32c_kernels(data: Buffer, value: int = 0) -> dict[str, int]:
    """The CRC-32C of ``data`` by each of the kernel's ways that runs here (for tests)."""
    kernel = _loaded()
    if kernel is None:
        return {}
    array = _bytes(data)
    out = {"portable": kernel.portable(value & 0xFFFFFFFF, array.ctypes.data, array.size)}
    if kernel.path != "tables":
        out["sse4.2 crc32"] = kernel.sse42(value & 0xFFFFFFFF, array.ctypes.data, array.size)
    out[kernel.path] = kernel.fastest(value & 0xFFFFFFFF, array.ctypes.data, array.size)
    return out


def _bytes(data: Buffer) -> np.ndarray:
    import numpy as np

    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("a checksum of a buffer that is not contiguous")
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8)


# --- without the kernel: numpy --------------------------------------------------------------------


@functools.cache
def _table() -> np.ndarray:
    import numpy as np

    table = np.zeros(256, dtype=np.uint32)
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ POLY if crc & 1 else crc >> 1
        table[byte] = crc
    return table


def _reflect(value: int) -> int:
    return int(f"{value:032b}"[::-1], 2)


_P = (1 << 32) | _reflect(POLY)  # the polynomial, highest power first


def _multiply(a: int, b: int) -> int:
    """a * b modulo P, both polynomials of degree below 32, highest power in the highest bit."""
    product = 0
    while b:
        if b & 1:
            product ^= a
        a <<= 1
        b >>= 1
    for bit in range(product.bit_length() - 1, 31, -1):
        if product >> bit & 1:
            product ^= _P << (bit - 32)
    return product


@functools.lru_cache(maxsize=256)
def _x_to_the_bytes(count: int) -> int:
    """x^(8 * count) modulo P: what feeding ``count`` zero bytes multiplies a CRC register by."""
    result, power, exponent = 1, 2, 8 * count  # 2: x
    while exponent:
        if exponent & 1:
            result = _multiply(result, power)
        power = _multiply(power, power)
        exponent >>= 1
    return result


def _shift(register: int, count: int) -> int:
    """A CRC register (bit-reflected, as the CRC keeps it) after ``count`` zero bytes."""
    return _reflect(_multiply(_reflect(register), _x_to_the_bytes(count)))


@functools.lru_cache(maxsize=64)
def _shift_tables(count: int) -> np.ndarray:
    """Four tables of 256 that shift a register over ``count`` zero bytes a byte of it each."""
    import numpy as np

    images = np.array([_shift(1 << bit, count) for bit in range(32)], dtype=np.uint32)
    values = np.arange(256)
    tables = np.zeros((4, 256), dtype=np.uint32)
    for byte in range(4):
        for bit in range(8):
            tables[byte] ^= np.where(values >> bit & 1, images[8 * byte + bit], 0).astype(np.uint32)
    return tables


def _shift_all(registers: np.ndarray, count: int) -> np.ndarray:
    tables = _shift_tables(count)
    return (tables[0][registers & 0xFF] ^ tables[1][registers >> 8 & 0xFF]
            ^ tables[2][registers >> 16 & 0xFF] ^ tables[3][registers >> 24])


def _register(data: np.ndarray) -> int:
    """The CRC register after ``data`` from a register of zero (no inversions)."""
    import numpy as np

    size = data.size
    if size < 4096:
        table, register = _table(), 0
        for byte in data.tobytes():
            register = int(table[(register ^ byte) & 0xFF]) ^ (register >> 8)
        return register
    lanes = min(1 << 16, 1 << (size // 64).bit_length() - 1)  # a power of two; each lane 64 bytes or more
    length = size // lanes
    columns = np.ascontiguousarray(data[: lanes * length].reshape(lanes, length).T)
    table = _table()
    registers = np.zeros(lanes, dtype=np.uint32)
    for column in columns:  # every lane one byte further
        registers = table[(registers ^ column) & 0xFF] ^ (registers >> 8)
    while registers.size > 1:  # neighbours joined: the first shifted over the second, xored
        registers = _shift_all(registers[0::2], length) ^ registers[1::2]
        length *= 2
    register, rest = int(registers[0]), data[size - size % lanes :]
    return _shift(register, rest.size) ^ _register(rest) if rest.size else register


def crc32c_numpy(data: Buffer, value: int = 0) -> int:
    """``crc32c`` without the kernel: the same value, a hundred times slower."""
    array = _bytes(data)
    start = _shift((value & 0xFFFFFFFF) ^ 0xFFFFFFFF, array.size) if array.size else value ^ 0xFFFFFFFF
    return (start ^ _register(array)) ^ 0xFFFFFFFF
