"""The attention of llama.cpp's arithmetic (native_forward.c's attend_ggml: a directory loaded
with quantization "gguf"): its AVX-512 form gives the bits of the plain C written number by
number after llama.cpp's flash attention, for every shape a Llama head takes."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from worker.c_build import FLAGS

HARNESS = """
#include "{source}"
void wide(const float *q, const float *k, const float *v, int64_t lo, int64_t hi, int64_t dim, float scale, float *out)
{{ attend_ggml(q, k, dim, v, dim, lo, hi, dim, scale, out); }}
void plain(const float *q, const float *k, const float *v, int64_t lo, int64_t hi, int64_t dim, float scale, float *out)
{{ attend_ggml_plain(q, k, dim, v, dim, lo, hi, dim, scale, out); }}
"""


@pytest.fixture(scope="module")
def attention(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    from worker.backends.transformers import native_pass

    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler here")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx512f " not in flags or " avx512dq " not in flags:
        pytest.skip("this processor has no AVX-512 (F and DQ): attend_ggml is the plain C itself")
    folder = tmp_path_factory.mktemp("ggml_attention")
    (folder / "harness.c").write_text(HARNESS.format(source=native_pass.SOURCE))
    library = folder / "harness.so"
    subprocess.run([compiler, *FLAGS, "-march=native", "-o", str(library), str(folder / "harness.c")], check=True,
                   capture_output=True)
    lib = ctypes.CDLL(str(library))
    for name in ("wide", "plain"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_void_p]
    return lib


def run(function, q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: int, hi: int, scale: float) -> np.ndarray:
    out = np.full(q.shape[0], np.nan, np.float32)
    function(q.ctypes.data, k.ctypes.data, v.ctypes.data, lo, hi, q.shape[0], scale, out.ctypes.data)
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
        wide, plain = (run(f, q, k, v, lo, keys, 0.125) for f in (attention.wide, attention.plain))
        assert np.isfinite(plain).all()
        assert wide.tobytes() == plain.tobytes(), (dim, keys, lo, rising)
