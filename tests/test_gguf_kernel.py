"""gguf_kernel.c on every block type it takes (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K): its products equal, bit for bit, the arithmetic its header writes down
(here in numpy, an exact fused multiply-add included), for every count of activation rows, each
row as computed alone, on any number of threads, and in the builds for narrower processors."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

T = gguf.GGMLQuantizationType
SMALL = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]  # blocks of 32
SUPER = [T.Q4_K, T.Q5_K, T.Q6_K]  # superblocks of 256
FLOATS = [T.F32, T.F16, T.BF16]
ALL = FLOATS + SMALL + SUPER
ROW_COUNTS = (1, 2, 3, 4, 7, 8, 9, 11, 12, 16, 25, 40, 64)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory):
    from worker.backends.transformers import exact_attention, gguf_weights

    try:
        gguf_weights.load_kernel(tmp_path_factory.mktemp("data"))
    except exact_attention.KernelUnavailable as exc:
        pytest.skip(f"no C compiler here: {exc}")
    return gguf_weights


# --- numpy: the blocks, the activations' quantization, the products -------------------------------


def fma32(a, b, c) -> np.ndarray:
    """fmaf, elementwise: a · b + c rounded once to float32. The product of two float32 numbers
    is exact in float64; the float64 sum's rounding error (Knuth's two-sum) decides the one case
    where rounding that sum to float32 would round twice: a sum exactly between two floats."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c = np.asarray(c, np.float64)
    s = p + c
    virtual = s - p
    error = (p - (s - virtual)) + (c - virtual)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    other = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)))
    tie = (s != r64) & (s == (r64 + other.astype(np.float64)) / 2) & (error != 0)
    upper, lower = np.maximum(r, other), np.minimum(r, other)
    return np.where(tie, np.where(error > 0, upper, lower), r).astype(np.float32)


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def halves(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def sum_tree8(acc: np.ndarray) -> np.ndarray:
    a = [acc[..., k] for k in range(8)]
    return ((a[4] + a[0]) + (a[6] + a[2])) + ((a[5] + a[1]) + (a[7] + a[3]))


def sum_tree16(acc: np.ndarray) -> np.ndarray:
    s = acc[..., :8] + acc[..., 8:]
    t = s[..., :4] + s[..., 4:]
    u = t[..., :2] + t[..., 2:]
    return u[..., 0] + u[..., 1]


def quantized_32(x: np.ndarray):
    """quantize_row_q8_0 / q8_1: per block of 32, (q, d, s)."""
    groups = x.reshape(x.shape[0], -1, 32)
    largest = np.abs(groups).max(-1, keepdims=True)
    d = largest / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(largest != 0, np.float32(127) / largest, np.float32(0))
    q = np.rint(groups * inverse).astype(np.int64)
    return q, f16(d[..., 0]), f16(d[..., 0] * q.sum(-1).astype(np.float32))


def quantized_256(x: np.ndarray):
    """quantize_row_q8_K_ref: per block of 256, (q, d, sums of each 32)."""
    groups = x.reshape(x.shape[0], -1, 256)
    first_largest = np.abs(groups).argmax(-1)[..., None]
    extreme = np.take_along_axis(groups, first_largest, -1)
    with np.errstate(divide="ignore"):
        inverse = np.where(extreme != 0, np.float32(-127) / extreme, np.float32(0)).astype(np.float32)
    q = np.minimum(np.rint(inverse * groups), 127).astype(np.int64)
    with np.errstate(divide="ignore"):
        d = np.where(extreme != 0, np.float32(1) / inverse, np.float32(0)).astype(np.float32)[..., 0]
    return q, d, q.reshape(*q.shape[:-1], 8, 32).sum(-1)


def nibbles(packed: np.ndarray) -> np.ndarray:
    packed = packed.astype(np.int64)
    return np.concatenate([packed & 15, packed >> 4], -1)


def bits(raw: np.ndarray, count: int) -> np.ndarray:
    """Bit j of the little-endian bytes, for j < count."""
    return np.unpackbits(raw, axis=-1, bitorder="little")[..., :count].astype(np.int64)


def small_weights(kind, blocks: np.ndarray):
    """A row of 32-blocks as (q, d, m): integers with the offsets taken off, scales, mins (or None)."""
    per = blocks.reshape(blocks.shape[0], -1, gguf.GGML_QUANT_SIZES[kind][1])
    d = halves(per[..., 0:2])
    if kind == T.Q8_0:
        return per[..., 2:].copy().view(np.int8).astype(np.int64), d, None
    if kind == T.Q4_0:
        return nibbles(per[..., 2:]) - 8, d, None
    if kind == T.Q4_1:
        return nibbles(per[..., 4:]), d, halves(per[..., 2:4])
    if kind == T.Q5_0:
        return (nibbles(per[..., 6:]) | bits(per[..., 2:6], 32) << 4) - 16, d, None
    return nibbles(per[..., 8:]) | bits(per[..., 4:8], 32) << 4, d, halves(per[..., 2:4])  # Q5_1


def scales_and_mins(packed: np.ndarray):
    """ggml's get_scale_min_k4, for all 8 sub-blocks."""
    s = packed.astype(np.int64)
    scales = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6) << 4], -1)
    mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6) << 4], -1)
    return scales, mins


def super_weights(kind, blocks: np.ndarray):
    """Rows of K superblocks as (q, scale of each weight, d, dmin, mins): q and scale a number
    per weight (Q6_K's q with its offset taken off), the others per superblock (Q6_K: dmin and
    mins None)."""
    per = blocks.reshape(blocks.shape[0], -1, gguf.GGML_QUANT_SIZES[kind][1])
    if kind == T.Q6_K:
        ql, qh = per[..., 0:128].astype(np.int64), per[..., 128:192].astype(np.int64)
        parts = []
        for h in range(2):
            low, high = ql[..., 64 * h : 64 * h + 64], qh[..., 32 * h : 32 * h + 32]
            for v in range(4):
                nib = low[..., 32 * (v & 1) : 32 * (v & 1) + 32]
                nib = nib >> 4 if v & 2 else nib & 15
                parts.append(nib | ((high >> 2 * v) & 3) << 4)
        q = np.concatenate(parts, -1) - 32
        scale = np.repeat(per[..., 192:208].copy().view(np.int8).astype(np.int64), 16, -1)
        return q.reshape(q.shape[0], -1), scale.reshape(q.shape[0], -1), halves(per[..., 208:210]), None, None
    scales, mins = scales_and_mins(per[..., 4:16])
    qs = per[..., 16:144] if kind == T.Q4_K else per[..., 48:176]
    parts = []
    for c in range(4):
        chunk = qs[..., 32 * c : 32 * c + 32].astype(np.int64)
        for half in range(2):
            q = chunk >> 4 if half else chunk & 15
            if kind == T.Q5_K:
                q = q | ((per[..., 16:48].astype(np.int64) >> (2 * c + half)) & 1) << 4
            parts.append(q)
    rows = per.shape[0]
    q, scale = np.concatenate(parts, -1).reshape(rows, -1), np.repeat(scales, 32, -1).reshape(rows, -1)
    return q, scale, halves(per[..., 0:2]), halves(per[..., 2:4]), mins


def widened(kind, blocks: np.ndarray) -> np.ndarray:
    if kind == T.F32:
        return blocks.copy().view(np.float32)
    if kind == T.F16:
        return blocks.copy().view(np.float16).astype(np.float32)
    return (blocks.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def written_out(kind, blocks: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The kernel's header, in numpy: every output of x's rows times the weight rows."""
    rows, outputs = x.shape[0], blocks.shape[0]
    if kind in FLOATS:
        w = widened(kind, blocks)
        acc = np.zeros((rows, outputs, 16), np.float32)
        for j in range(0, x.shape[1], 16):
            width = min(16, x.shape[1] - j)
            acc[..., :width] = fma32(w[None, :, j : j + width], x[:, None, j : j + width], acc[..., :width])
        return sum_tree16(acc)
    acc = np.zeros((rows, outputs, 8), np.float32)
    if kind in SMALL:
        wq, wd, wm = small_weights(kind, blocks)
        xq, xd, xs = quantized_32(x)
        sum_m = np.zeros((rows, outputs), np.float32)
        for b in range(wq.shape[1]):
            lanes = (wq[None, :, b] * xq[:, None, b]).reshape(rows, outputs, 8, 4).sum(-1).astype(np.float32)
            acc = fma32((wd[None, :, b] * xd[:, None, b])[..., None], lanes, acc)
            if wm is not None:
                sum_m = sum_m + wm[None, :, b] * xs[:, None, b]
        return sum_tree8(acc) + sum_m if wm is not None else sum_tree8(acc)
    wq, scale, wd, wdmin, mins = super_weights(kind, blocks)
    xq, xd, xsums = quantized_256(x)
    acc_m = np.zeros((rows, outputs, 4), np.float32)
    sum_m = np.zeros((rows, outputs), np.float32)
    for b in range(wq.shape[1] // 256):
        part = slice(256 * b, 256 * b + 256)
        products = (scale[None, :, part] * wq[None, :, part]) * xq[:, None, b]
        lanes = products.reshape(rows, outputs, 8, 8, 4).sum((2, 4)).astype(np.float32)
        acc = fma32((xd[:, None, b] * wd[None, :, b])[..., None], lanes, acc)
        if kind != T.Q6_K:
            dmin = -xd[:, None, b] * wdmin[None, :, b]
            paired = (mins[None, :, b] * xsums[:, None, b]).reshape(rows, outputs, 4, 2).sum(-1)
            if kind == T.Q4_K:
                acc_m = fma32(dmin[..., None], paired.astype(np.float32), acc_m)
            else:
                sum_m = sum_m + dmin * paired.sum(-1).astype(np.float32)
    if kind == T.Q4_K:
        return sum_tree8(acc) + ((acc_m[..., 0] + acc_m[..., 2]) + (acc_m[..., 1] + acc_m[..., 3]))
    return sum_tree8(acc) + sum_m if kind == T.Q5_K else sum_tree8(acc)


# --- weights of each type -----------------------------------------------------------------------


def random_super_blocks(kind, rows: int, inputs: int, rng: np.random.Generator) -> np.ndarray:
    """K superblocks with random bytes in every field and fp16 scales of a model's size."""
    size = gguf.GGML_QUANT_SIZES[kind][1]
    blocks = rng.integers(0, 256, (rows, inputs // 256, size), dtype=np.uint8)
    d = rng.uniform(1e-4, 1e-2, (rows, inputs // 256, 1)).astype(np.float16).view(np.uint8)
    if kind == T.Q6_K:
        blocks[..., 208:210] = d
    else:
        blocks[..., 0:2] = d
        blocks[..., 2:4] = rng.uniform(1e-4, 1e-2, (rows, inputs // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def weights_of(kind, rows: int, inputs: int, rng: np.random.Generator) -> np.ndarray:
    if kind in SUPER:
        return random_super_blocks(kind, rows, inputs, rng)
    dense = rng.standard_normal((rows, inputs)).astype(np.float32)
    if kind == T.F32:
        return dense.view(np.uint8)
    return gguf.quants.quantize(dense, kind).view(np.uint8)  # F16 comes back as float16


def inputs_of(kind) -> int:
    return {**dict.fromkeys(SUPER, 512), **dict.fromkeys(SMALL, 96)}.get(kind, 83)  # floats: 5 · 16 and 3 more


def activations(rows: int, inputs: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((rows, inputs)).astype(np.float32)
    if rows > 1:
        x[1, :32] = 0.0  # a block of zeros: scale 0
    if rows > 2 and inputs >= 256:
        x[2, :256] = 0.0  # a superblock of zeros
    return x


def product(function, kind, blocks: np.ndarray, x: np.ndarray, threads: int = 1) -> np.ndarray:
    out = np.full((x.shape[0], blocks.shape[0]), np.nan, np.float32)
    status = function(int(kind), blocks.ctypes.data, blocks.shape[0], x.shape[1], x.ctypes.data, x.shape[0], x.shape[1],
                      out.ctypes.data, threads)
    assert status == 0
    return out


# --- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", SMALL + SUPER + FLOATS, ids=lambda kind: kind.name)
def test_dequantized_is_gguf_s_dequantization_and_the_written_out_decoding_agrees(kernel, kind):
    rng = np.random.default_rng(int(kind))
    inputs = inputs_of(kind)
    blocks = weights_of(kind, 5, inputs, rng)
    theirs = gguf.quants.dequantize(blocks, kind)
    assert np.array_equal(kernel.dequantized(int(kind), torch.from_numpy(blocks)).numpy(), theirs)
    if kind in SMALL:
        q, d, m = small_weights(kind, blocks)
        ours = d[..., None] * q if m is None else d[..., None] * q + m[..., None]
    elif kind in SUPER:
        q, scale, d, dmin, mins = super_weights(kind, blocks)
        d_sub = np.repeat(d, 256, -1) * scale.astype(np.float32)
        ours = d_sub * q
        if kind != T.Q6_K:
            ours = ours - np.repeat(dmin, 256, -1) * np.repeat(mins, 32, -1).reshape(5, -1)
    else:
        ours = widened(kind, blocks)
    assert np.array_equal(ours.reshape(5, -1).astype(np.float32), theirs)


@pytest.mark.parametrize("kind", ALL, ids=lambda kind: kind.name)
def test_every_count_of_rows_multiplies_as_the_header_writes_it(kernel, kind):
    """1 to 64 activation rows (each group the kernel takes together, and what is left past
    them) against 23 and 100 weight rows (work items of 16 and what is left; pairs and a row
    alone)."""
    rng = np.random.default_rng(10 + int(kind))
    inputs = inputs_of(kind)
    for outputs in (23, 100):
        blocks = weights_of(kind, outputs, inputs, rng)
        for rows in ROW_COUNTS:
            x = activations(rows, inputs, rng)
            ours = product(kernel._matmul, kind, blocks, x)
            assert np.array_equal(ours, written_out(kind, blocks, x)), (outputs, rows)


@pytest.mark.parametrize("kind", ALL, ids=lambda kind: kind.name)
def test_a_row_gets_the_numbers_it_gets_alone_on_any_number_of_threads(kernel, kind):
    rng = np.random.default_rng(30 + int(kind))
    inputs = inputs_of(kind)
    blocks = weights_of(kind, 100, inputs, rng)
    x = activations(37, inputs, rng)
    together = product(kernel._matmul, kind, blocks, x)
    for threads in (2, 3):
        assert np.array_equal(product(kernel._matmul, kind, blocks, x, threads), together), threads
    for start, count in ((0, 1), (5, 3), (9, 8), (36, 1)):
        alone = product(kernel._matmul, kind, blocks, x[start : start + count])
        assert np.array_equal(alone, together[start : start + count]), (start, count)


NARROWER = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx2-vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni"],
    # AVX-512F named without FMA and F16C (a virtual machine may hide them): the plain code
    "avx512f-alone": ["-mavx512f"],
    "plain-c": [],
}


@pytest.mark.parametrize("flags", NARROWER.values(), ids=NARROWER.keys())
def test_the_kernel_built_for_narrower_processors_multiplies_as_the_header_writes_it(kernel, flags, tmp_path: Path):
    """The worker builds the kernel for the machine it runs on; these are the code paths of a
    processor with AVX2 alone, with AVX-512's 256-bit byte products but not its wide path, with
    AVX-512F named alone, and with none, built here on purpose and held to the same numbers."""
    from tests.conftest import kernel_variant

    matmul = kernel_variant(kernel.KERNEL_SOURCE, tmp_path / "gguf_kernel.so", flags, "lmw_gguf_matmul")
    matmul.argtypes, matmul.restype = kernel._ARGTYPES, ctypes.c_int
    rng = np.random.default_rng(4)
    for kind in ALL:
        inputs = inputs_of(kind)
        blocks = weights_of(kind, 23, inputs, rng)
        for rows in (1, 2, 5, 9):
            x = activations(rows, inputs, rng)
            assert np.array_equal(product(matmul, kind, blocks, x), written_out(kind, blocks, x)), (kind.name, rows)


def test_a_type_the_kernel_does_not_take_and_a_shape_it_cannot_take_are_refused(kernel):
    x = np.ones((2, 512), np.float32)
    blocks = np.zeros((4, 1024), np.uint8)
    out = np.zeros((2, 4), np.float32)

    def call(kind, inputs, n=2, stride=512, outputs=4):
        return kernel._matmul(int(kind), blocks.ctypes.data, outputs, inputs, x.ctypes.data, n, stride, out.ctypes.data,
                              1)

    assert call(T.Q2_K, 512) == 2
    assert call(T.Q8_1, 512) == 2
    assert call(T.Q4_K, 384) == 3  # not whole superblocks
    assert call(T.Q4_0, 48) == 3
    assert call(T.Q4_0, 0) == 3
    assert call(T.Q4_0, 64, outputs=-1) == 3
    assert call(T.F16, 64, stride=32) == 3  # rows that overlap
    assert call(T.F16, 64, n=1, stride=0) == 0  # one row: no stride needed
    assert call(T.F16, 17) == 0  # the float types take any length


def test_a_linear_refuses_blocks_that_are_not_its_rows_and_multiplies_its_type(kernel):
    rng = np.random.default_rng(5)
    blocks = random_super_blocks(T.Q6_K, 8, 512, rng)
    with pytest.raises(ValueError):
        kernel.GgufLinear(int(T.Q6_K), torch.from_numpy(blocks), 256)
    with pytest.raises(ValueError):
        kernel.GgufLinear(int(T.Q2_K), torch.from_numpy(blocks), 512)
    linear = kernel.GgufLinear(int(T.Q6_K), torch.from_numpy(blocks), 512)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    assert np.array_equal(linear(torch.from_numpy(x)).numpy(), written_out(T.Q6_K, blocks, x))
