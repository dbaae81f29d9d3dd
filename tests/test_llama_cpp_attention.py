"""The attention of llama.cpp's arithmetic (native_forward.c's attend_ggml: a directory loaded
with quantization "gguf"): its AVX-512 form gives the bits of the plain C written number by
number after llama.cpp's flash attention, for every shape a Llama head takes, a row alone or
beside other heads of its key/value head."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from tests.conftest import processor_flags
from worker.c_build import FLAGS

HARNESS = """
#include "{source}"
void wide(const float *q, int64_t rows, const float *k, const float *v, int64_t lo, int64_t hi, int64_t dim, float scale,
          float *out)
{{ attend_ggml(q, dim, rows, k, dim, v, dim, lo, hi, dim, scale, out, dim); }}
void plain(const float *q, const float *k, const float *v, int64_t lo, int64_t hi, int64_t dim, float scale, float *out)
{{ attend_ggml_plain(q, k, dim, v, dim, lo, hi, dim, scale, out); }}
"""


@pytest.fixture(scope="module")
def attention(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    from worker.backends.transformers import native_pass

    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler here")
    if not {"avx512f", "avx512dq"} <= processor_flags():
        pytest.skip("this processor has no AVX-512 (F and DQ): attend_ggml is the plain C itself")
    folder = tmp_path_factory.mktemp("ggml_attention")
    (folder / "harness.c").write_text(HARNESS.format(source=native_pass.SOURCE))
    library = folder / "harness.so"
    subprocess.run([compiler, *FLAGS, "-march=native", "-o", str(library), str(folder / "harness.c")], check=True,
                   capture_output=True)
    lib = ctypes.CDLL(str(library))
    lib.plain.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_void_p]
    lib.wide.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [
        ctypes.c_float, ctypes.c_void_p]
    return lib


def plain(attention: ctypes.CDLL, q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: int, hi: int,
          scale: float) -> np.ndarray:
    out = np.full(q.shape[0], np.nan, np.float32)
    attention.plain(q.ctypes.data, k.ctypes.data, v.ctypes.data, lo, hi, q.shape[0], scale, out.ctypes.data)
    return out


def wide(attention: ctypes.CDLL, q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: int, hi: int,
         scale: float) -> np.ndarray:
    """q: (rows, dim), heads that share the keys, taken in one call."""
    out = np.full(q.shape, np.nan, np.float32)
    attention.wide(q.ctypes.data, q.shape[0], k.ctypes.data, v.ctypes.data, lo, hi, q.shape[1], scale, out.ctypes.data)
    return out


@pytest.mark.parametrize("dim", [64, 128])
def test_the_wide_llama_cpp_attention_gives_the_plain_c_s_bits(attention, dim: int):
    """Random float16 heads over 1 to 600 keys, from the first key or later, with scores that
    rise key after key too (each new largest score shrinks the sum so far: that path as well)."""
    rng = np.random.default_rng(dim)
    for keys, lo, rising in ((1, 0, False), (37, 0, False), (300, 5, False), (600, 0, True), (64, 63, True)):
        q = rng.standard_normal(dim).astype(np.float16).astype(np.float32)
        k = rng.standard_normal((keys, dim)).astype(np.float16).astype(np.float32)
        if rising:  # keys ever more along q: each score the largest so far
            k += (np.arange(keys, dtype=np.float32)[:, None] * 0.05 * q[None, :]).astype(np.float16).astype(np.float32)
        v = rng.standard_normal((keys, dim)).astype(np.float16).astype(np.float32)
        alone = plain(attention, q, k, v, lo, keys, 0.125)
        assert np.isfinite(alone).all()
        assert wide(attention, q[None, :], k, v, lo, keys, 0.125)[0].tobytes() == alone.tobytes(), (dim, keys, lo, rising)


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 9])
@pytest.mark.parametrize("dim", [64, 128])
def test_heads_taken_side_by_side_each_get_their_bits_alone(attention, dim: int, rows: int):
    """A prompt's heads of one key/value head go through the keys together (4 at most at once:
    9 is 4, 4 and 1); each one's output is the plain C's for it alone, a head whose scores rise
    (its sum shrunk at every key) beside heads whose do not."""
    rng = np.random.default_rng(rows * dim)
    keys = 200
    q = rng.standard_normal((rows, dim)).astype(np.float16).astype(np.float32)
    k = rng.standard_normal((keys, dim)).astype(np.float16).astype(np.float32)
    k += (np.arange(keys, dtype=np.float32)[:, None] * 0.05 * q[rows // 2][None, :]).astype(np.float16).astype(np.float32)
    v = rng.standard_normal((keys, dim)).astype(np.float16).astype(np.float32)
    together = wide(attention, q, k, v, 3, keys, 0.125)
    for r in range(rows):
        assert together[r].tobytes() == plain(attention, q[r], k, v, 3, keys, 0.125).tobytes(), (dim, rows, r)
