"""The worker's kernel for 8-bit rows (int8_kernel.c, fast_weights.Int8Linear): each activation
row is quantized in blocks of 32 and each output is one chain of fused multiply-adds over the
blocks' integer sums in order, so a row gets the same bits in a call
of any size, beside any other outputs, on any thread and on any processor's code path; linears
joined for the decode step give each output its own linear's bits; a cache computed with
PyTorch's int8 products is another identity."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import kernel_variant

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def fast_weights(tmp_path_factory: pytest.TempPathFactory):
    from worker.backends.transformers import exact_attention, fast_weights

    try:
        fast_weights.load_int8_kernel(tmp_path_factory.mktemp("data"))
    except exact_attention.KernelUnavailable as exc:  # PyTorch's kernel takes the rows then (test_exact_attention)
        pytest.skip(f"no C compiler here: {exc}")
    return fast_weights


def chained_product(q: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The kernel's arithmetic written out in numpy: each activation row rounded to bfloat16 and
    quantized in blocks of 32 (d = max |x| / 127, q = x · (127 / max |x|) rounded to nearest,
    ties to even), the block's integer sum S of q_w · q_x, then per output acc = fma(s_w · d, S,
    acc) over the blocks in order, s_w · d rounded to float32 first (float64 then rounded: one
    rounding, since (s_w · d) · S is exact in float64)."""
    n, inputs = x.shape
    blocks = scale.shape[1]
    padded = np.zeros((n, blocks * 32), np.float32)
    padded[:, :inputs] = torch.from_numpy(x).bfloat16().float().numpy()
    by_block = padded.reshape(n, blocks, 32)
    largest = np.abs(by_block).max(axis=2)
    with np.errstate(divide="ignore"):
        inverse = np.where(largest != 0, np.float32(127) / largest, np.float32(0)).astype(np.float32)
    # 0 · ∞ (a zero in a block of subnormal numbers, whose 127 / max |x| overflows) is NaN: taken to 0
    qx = np.nan_to_num(np.clip(np.rint(by_block * inverse[..., None]), -127, 127), nan=0.0).astype(np.int64)
    d = (largest / np.float32(127)).astype(np.float32)
    qw = q.astype(np.int64).reshape(q.shape[0], blocks, 32)
    acc = np.zeros((n, q.shape[0]), np.float32)
    for b in range(blocks):
        sums = (qx[:, b, :] @ qw[:, b, :].T).astype(np.float64)
        scales = (scale[None, :, b].astype(np.float32) * d[:, b : b + 1]).astype(np.float64)
        acc = (scales * sums + acc).astype(np.float32)
    return acc


def a_linear(rows: int, inputs: int, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inputs, rows, bias=False)


def int8_blocks(linear: torch.nn.Linear) -> tuple[np.ndarray, np.ndarray]:
    """The weight as the kernel holds it: 8-bit blocks of 32 inputs (padded with zeros), a float16
    scale per block, written out here (not fast_weights' own code)."""
    weight = linear.weight.detach().float().numpy()
    rows, inputs = weight.shape
    blocks = -(-inputs // 32)
    padded = np.zeros((rows, blocks * 32), np.float32)
    padded[:, :inputs] = weight
    scale = (np.abs(padded.reshape(rows, blocks, 32)).max(axis=2) / np.float32(127)).astype(np.float16)
    q = np.clip(np.rint(padded.reshape(rows, blocks, 32) / scale.astype(np.float32)[..., None]), -127, 127)
    return q.astype(np.int8).reshape(rows, -1), scale


def test_each_output_is_one_chain_of_multiply_adds_for_every_count_of_rows(fast_weights):
    """1 to 13 activation rows (each tile the kernel has: 1 to 4 rows, two tiles for 5 to 8, and
    the rows past 8; on 2 threads a step's rows are shared out in half items, so a thread's share
    may begin or end in the middle of one) and 64 (work units of 60 rows and of 4), against weight
    rows that fill no whole work item (23, 100) and several (576), and inputs that fill no whole
    block (100: the last one padded with zeros)."""
    rng = np.random.default_rng(0)
    for rows, inputs in ((23, 64), (100, 100), (576, 576)):
        linear = a_linear(rows, inputs, rows)
        ours = fast_weights.Int8Linear.of(linear, torch.float32)
        q, scale = int8_blocks(linear)
        for n in [*range(1, 14), 64]:
            x = rng.standard_normal((n, inputs)).astype(np.float32)
            out = ours(torch.from_numpy(x)).numpy()
            assert np.array_equal(out, chained_product(q, scale, x)), (rows, inputs, n)
            assert np.array_equal(ours(torch.from_numpy(x[-1:])).numpy(), out[-1:])  # the last row alone


def test_a_row_gets_the_same_bits_on_one_thread_and_on_two(fast_weights):
    linear = fast_weights.Int8Linear.of(a_linear(1536, 576, 1), torch.float32)
    x = torch.randn(40, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = linear(x)
        torch.set_num_threads(2)
        assert torch.equal(linear(x), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("flags", [["-mavx2", "-mfma", "-mf16c"], []], ids=["avx2", "plain-c"])
def test_the_kernel_built_for_other_processors_gives_the_same_bits(fast_weights, flags, tmp_path: Path):
    """The worker builds the kernel for the machine it runs on (with AVX-512 VNNI where it has it:
    a panel's 4 inputs a vector, summed by vpdpbusd); the AVX2 code (what a processor without it
    runs: byte products summed in pairs) and the plain C (without AVX2) are built here on
    purpose: the same bits as the loaded kernel, so a cache file means the same numbers on every
    machine."""
    matmul = kernel_variant(
        fast_weights.KERNEL_SOURCE, tmp_path / "int8_kernel.so", [*flags, "-fopenmp"], "lmw_int8_matmul"
    )
    matmul.argtypes, matmul.restype = fast_weights._ARGTYPES, ctypes.c_int
    linear = fast_weights.Int8Linear.of(a_linear(100, 100, 3), torch.float32)
    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 9):
        x = rng.standard_normal((n, 100)).astype(np.float32)
        for threads in (1, 2, 3):  # whole items on one thread; two or three shares of 4 half items
            out = np.empty((n, 100), np.float32)
            assert matmul(linear.packed.data_ptr(), linear.scale.data_ptr(), 100, 100, x.ctypes.data, n, 100,
                          out.ctypes.data, threads) == 0
            assert np.array_equal(out, linear(torch.from_numpy(x)).numpy()), (n, threads)


@pytest.mark.parametrize("flags", [None, ["-mavx2", "-mfma", "-mf16c"], []], ids=["loaded", "avx2", "plain-c"])
def test_zeros_nans_infinities_huge_and_tiny_inputs_give_defined_outputs_on_every_code_path(
    fast_weights, flags, tmp_path: Path
):
    """A block of zeros quantizes to zeros (its scale 0, no division by it); a NaN or an infinity
    in a row makes its outputs NaN (as float products would), never a number made from an
    undefined conversion; huge and subnormal numbers follow the written-out arithmetic."""
    dense = a_linear(64, 64, 5)
    linear = fast_weights.Int8Linear.of(dense, torch.float32)
    if flags is None:
        def matmul(*args):
            return fast_weights._int8_matmul(*args)
    else:
        matmul = kernel_variant(fast_weights.KERNEL_SOURCE, tmp_path / "int8_kernel.so", flags, "lmw_int8_matmul")
        matmul.argtypes, matmul.restype = fast_weights._ARGTYPES, ctypes.c_int
    x = np.random.default_rng(5).standard_normal((6, 64)).astype(np.float32)
    x[0] = 0
    x[1, 3] = np.nan
    x[2, 40] = np.inf
    x[3] *= np.float32(1e30)
    x[4] *= np.float32(1e-40)  # subnormal: 127 / max |x| is infinite
    x[5, :32] = 0  # one block of zeros beside another of numbers
    out = np.empty((6, 64), np.float32)
    assert matmul(linear.packed.data_ptr(), linear.scale.data_ptr(), 64, 64, x.ctypes.data, 6, 64, out.ctypes.data, 1) == 0
    assert np.array_equal(out[0], np.zeros(64, np.float32))
    assert np.isnan(out[1]).all() and np.isnan(out[2]).all()
    q, scale = int8_blocks(dense)
    with np.errstate(all="ignore"):
        assert np.array_equal(out[3:], chained_product(q, scale, x[3:]))
    assert np.isfinite(out[3:]).all() and (out[4] != 0).any()


@pytest.mark.parametrize("sizes", [(576, 192, 192), (1536, 1536), (64, 40)])
def test_joined_linears_give_each_output_its_own_linears_bits(fast_weights, sizes):
    linears = [fast_weights.Int8Linear.of(a_linear(size, 128, size), torch.float32) for size in sizes]
    one = fast_weights.fused(linears)
    if any(size % 64 for size in sizes):
        assert one is None  # each linear's rows are padded to whole work items: they cannot sit side by side
        return
    x = torch.randn(7, 128)
    assert torch.equal(one(x), torch.cat([linear(x) for linear in linears], dim=-1))


def test_a_bias_is_added_after_the_product(fast_weights):
    torch.manual_seed(4)
    dense = torch.nn.Linear(64, 70)
    ours = fast_weights.Int8Linear.of(dense, torch.float32)
    x = torch.randn(3, 64)
    without = fast_weights.Int8Linear.of(torch.nn.Linear(64, 70, bias=False), torch.float32)
    without.packed, without.scale = ours.packed, ours.scale
    assert torch.equal(ours(x), without(x) + dense.bias.detach())


def test_a_cache_of_pytorchs_int8_products_is_another_identity(fast_weights, tiny_model_dir: Path, tmp_path: Path):
    """The two kernels give a position other last bits: a cache file computed with one must not
    be read as the other's (the config digest names the worker's kernel)."""
    from tests.test_fast_decode import load
    from worker.backends.transformers import hf_compat, native_forward

    model = load(tiny_model_dir, tmp_path)
    config = model._model.config
    named = hf_compat.config_digest(config, fast_weights.KERNEL_PRODUCTS, native_forward.FORWARD)
    assert model.cache_identity().config_sha256 == named
    assert hf_compat.config_digest(config, fast_weights.KERNEL_PRODUCTS) != hf_compat.config_digest(config)
