"""The worker's kernel for 8-bit rows (int8_kernel.c, fast_weights.Int8Linear): each output is
one chain of fused multiply-adds over its inputs in order, so a row gets the same bits in a call
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
    """The kernel's arithmetic written out in numpy: x rounded to bfloat16, then per output
    acc = fma(x[k], q[k], acc) for k in order (float64 then rounded: one rounding, since a
    product of a bfloat16 and an int8 is exact in float64), times the row's scale."""
    rounded = torch.from_numpy(x).bfloat16().float().numpy().astype(np.float64)
    acc = np.zeros((x.shape[0], q.shape[0]), np.float32)
    for k in range(x.shape[1]):
        acc = (rounded[:, k : k + 1] * q[:, k].astype(np.float64) + acc).astype(np.float32)
    return acc * scale


def a_linear(rows: int, inputs: int, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inputs, rows, bias=False)


def int8_rows(linear: torch.nn.Linear) -> tuple[np.ndarray, np.ndarray]:
    weight = linear.weight.detach().float()
    scale = weight.abs().amax(1) / 127
    return (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8).numpy(), scale.numpy()


def test_each_output_is_one_chain_of_multiply_adds_for_every_count_of_rows(fast_weights):
    """1 to 13 activation rows (each grouping the kernel has: 4 panels against one row, pairs
    against two, a panel against 3 to 6, and the rows past 6) and 64 (work units of 60 rows and
    of 4), against weight rows that fill no whole work item (23, 100) and several (576)."""
    rng = np.random.default_rng(0)
    for rows, inputs in ((23, 64), (100, 96), (576, 576)):
        linear = a_linear(rows, inputs, rows)
        ours = fast_weights.Int8Linear.of(linear, torch.float32)
        q, scale = int8_rows(linear)
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


@pytest.mark.parametrize("flags", [["-mavx2", "-mfma"], []], ids=["avx2", "plain-c"])
def test_the_kernel_built_for_other_processors_gives_the_same_bits(fast_weights, flags, tmp_path: Path):
    """The worker builds the kernel for the machine it runs on (with AVX-512 where it has it:
    a panel a vector, 4 panels against up to 6 rows at once); the AVX2 code (what a processor
    without AVX-512 runs) and the plain C (without AVX2) are built here on purpose: the same
    bits as the loaded kernel, so a cache file means the same numbers on every machine."""
    matmul = kernel_variant(fast_weights.KERNEL_SOURCE, tmp_path / "int8_kernel.so", flags, "lmw_int8_matmul")
    matmul.argtypes, matmul.restype = fast_weights._ARGTYPES, ctypes.c_int
    linear = fast_weights.Int8Linear.of(a_linear(100, 96, 3), torch.float32)
    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 4, 5, 6, 9):
        x = rng.standard_normal((n, 96)).astype(np.float32)
        out = np.empty((n, 100), np.float32)
        assert matmul(linear.packed.data_ptr(), linear.scale.data_ptr(), 100, 96, x.ctypes.data, n, 96,
                      out.ctypes.data, 1) == 0
        assert np.array_equal(out, linear(torch.from_numpy(x)).numpy()), n


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
