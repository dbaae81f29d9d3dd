"""The exact attention kernel: a query row's numbers depend only on its query and the keys and
values it attends, whatever the call around it; close to float64 attention; built once per
machine, and a worker without a C compiler still loads quantized models."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.conftest import TORCH_ENV
from worker.host import Host

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory):
    from worker.backends.transformers import exact_attention

    try:
        return exact_attention.kernel(tmp_path_factory.mktemp("data"))
    except exact_attention.KernelUnavailable as exc:  # the worker falls back to float64 (tested below)
        pytest.skip(f"the exact attention kernel cannot be built here: {exc}")


def causal(batch: int, positions: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    hi = torch.arange(n - positions + 1, n + 1).expand(batch, positions).contiguous()
    return torch.zeros_like(hi), hi


def reference(query, keys, values, lo, hi, scaling) -> torch.Tensor:
    """float64 SDPA with the ranges as a mask, (batch, positions, heads, dim)."""
    where = torch.arange(keys.shape[-2])
    mask = ((where >= lo[..., None]) & (where < hi[..., None]))[:, None]
    return torch.nn.functional.scaled_dot_product_attention(
        query.double(), keys.double(), values.double(), attn_mask=mask, scale=scaling, enable_gqa=True
    ).transpose(1, 2)


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 2, 16), (2, 1, 128), (2, 2, 256)])
def test_a_row_gets_the_same_bits_alone_in_any_chunk_and_on_any_thread(kernel, heads, kv_heads, dim):
    """Also where two threads split a call into work items of fewer positions than one thread
    does (a single key/value head)."""
    torch.manual_seed(dim)
    positions, n = 70, 300
    query = torch.randn(1, heads, positions, dim) * 2
    keys, values = torch.randn(1, kv_heads, n + 40, dim), torch.randn(1, kv_heads, n + 40, dim)
    keys, values = keys[:, :, :n], values[:, :, :n]  # a view into room to grow, as a cache holds them
    scaling = dim**-0.5
    torch.set_num_threads(2)
    whole = kernel.attention(query, keys, values, *causal(1, positions, n), scaling)
    torch.set_num_threads(1)
    assert torch.equal(kernel.attention(query, keys, values, *causal(1, positions, n), scaling), whole)
    split = [kernel.attention(query[:, :, a:b], keys[:, :, : n - positions + b], values[:, :, : n - positions + b],
                              *causal(1, b - a, n - positions + b), scaling) for a, b in ((0, 23), (23, 24), (24, 70))]
    assert torch.equal(torch.cat(split, dim=1), whole)
    for row in (0, 17, 69):  # alone, over exactly the keys it attends
        length = n - positions + row + 1
        alone = kernel.attention(query[:, :, row : row + 1], keys[:, :, :length].contiguous(),
                                 values[:, :, :length].contiguous(), *causal(1, 1, length), scaling)
        assert torch.equal(alone[:, 0], whole[:, row])
    assert (whole.double() - reference(query, keys, values, *causal(1, positions, n), scaling)).abs().max() < 2e-5


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 1, 256)])
def test_a_step_of_several_sequences_in_one_call_appends_each_and_gives_each_its_numbers_alone(
    kernel, heads, kv_heads, dim
):
    """Each sequence keeps its keys and values in buffers of its own, of other sizes; one call
    writes each new key and value at the sequence's next position and attends its keys (a
    window of them for one): each row equals the kernel called for that sequence alone."""
    from worker.backends.transformers.exact_attention import StepPlaces

    torch.manual_seed(heads)
    lengths, capacities, windows = [1, 37, 300, 129], [256, 40, 400, 300], [None, None, None, 64]
    buffers = [(torch.randn(1, kv_heads, c, dim), torch.randn(1, kv_heads, c, dim)) for c in capacities]
    before = [(keys.clone(), values.clone()) for keys, values in buffers]
    query = torch.randn(len(lengths), heads, dim)
    fused = torch.randn(len(lengths), kv_heads * dim * 3)  # new keys and values, views of a wider row
    new_keys = fused[:, : kv_heads * dim].view(-1, kv_heads, dim)
    new_values = fused[:, kv_heads * dim : 2 * kv_heads * dim].view(-1, kv_heads, dim)
    places = StepPlaces()
    for (keys, values), held, window in zip(buffers, lengths, windows):
        start = 0 if window is None else max(0, held + 1 - window)
        places.add(keys, values, start, 0, held + 1 - start)
    out = kernel.step_attention(query, new_keys, new_values, places, dim**-0.5)
    for b, ((keys, values), held, window) in enumerate(zip(buffers, lengths, windows)):
        old_keys, old_values = before[b]
        assert torch.equal(keys[0, :, held], new_keys[b]) and torch.equal(values[0, :, held], new_values[b])
        assert torch.equal(keys[:, :, :held], old_keys[:, :, :held]) and torch.equal(keys[:, :, held + 1 :], old_keys[:, :, held + 1 :])
        assert torch.equal(values[:, :, :held], old_values[:, :, :held])
        start = 0 if window is None else max(0, held + 1 - window)
        alone = kernel.attention(
            query[b : b + 1, :, None], keys[:, :, start : held + 1], values[:, :, start : held + 1],
            *causal(1, 1, held + 1 - start), dim**-0.5,
        )
        assert torch.equal(out[b], alone[0, 0])


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 1, 256), (2, 1, 16)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_sequence_s_step_shared_among_threads_gives_the_numbers_of_its_rows_alone(kernel, heads, kv_heads, dim, threads):
    """A step of one sequence has as many work items as key/value heads, fewer than twice the
    threads: its items' scores and rows are shared out in parts instead (past 64
    keys), and each row still gets the bits the kernel gives it alone, at every length around
    the tiles and the parts' edges, on any thread count, within a window too."""
    from worker.backends.transformers.exact_attention import StepPlaces

    torch.manual_seed(dim + threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for held, window in ((0, None), (40, None), (63, None), (64, None), (65, None), (95, None), (300, None),
                             (1000, None), (1000, 100)):
            keys, values = torch.randn(1, kv_heads, held + 8, dim), torch.randn(1, kv_heads, held + 8, dim)
            query, new_key, new_value = torch.randn(1, heads, dim), torch.randn(1, kv_heads, dim), torch.randn(1, kv_heads, dim)
            start = 0 if window is None else max(0, held + 1 - window)
            places = StepPlaces()
            places.add(keys, values, start, 0, held + 1 - start)
            out = kernel.step_attention(query, new_key, new_value, places, dim**-0.5)
            alone = kernel.attention(query[:, :, None], keys[:, :, start : held + 1], values[:, :, start : held + 1],
                                     *causal(1, 1, held + 1 - start), dim**-0.5)
            assert torch.equal(out[0], alone[0, 0]), (held, window)
    finally:
        torch.set_num_threads(before)


def test_a_step_reads_no_key_past_a_short_sequence_s_buffer(kernel, tmp_path: Path):
    """Beside a long sequence, a short one's buffer may end right after its keys: the kernel
    must read none past them (a page it may not read follows the buffer here; a read past it
    kills the process, so the step runs in one of its own)."""
    import subprocess
    import sys

    script = tmp_path / "guarded.py"
    script.write_text(GUARDED_STEP)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "data")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "attended"


GUARDED_STEP = """
import ctypes, mmap, sys
from pathlib import Path
import torch
from worker.backends.transformers import exact_attention

kernel = exact_attention.kernel(Path(sys.argv[1]))
kv_heads, dim, heads = 3, 64, 9
page = mmap.PAGESIZE
short_bytes = 2 * kv_heads * 40 * dim * 4  # keys and values of 40 positions, then a guard page
size = (short_bytes + page - 1) // page * page
area = mmap.mmap(-1, size + page)
libc = ctypes.CDLL(None)
address = ctypes.addressof(ctypes.c_char.from_buffer(area))
assert libc.mprotect(ctypes.c_void_p(address + size), page, 0) == 0  # PROT_NONE
whole = torch.frombuffer(area, dtype=torch.float32, count=(size + page) // 4)
end = size // 4
short_values = whole[end - kv_heads * 40 * dim : end].view(1, kv_heads, 40, dim)
short_keys = whole[end - 2 * kv_heads * 40 * dim : end - kv_heads * 40 * dim].view(1, kv_heads, 40, dim)
long_keys, long_values = torch.randn(1, kv_heads, 5000, dim), torch.randn(1, kv_heads, 5000, dim)
places = exact_attention.StepPlaces()
places.add(long_keys, long_values, 0, 0, 4000)
places.add(short_keys, short_values, 0, 0, 40)
new = torch.randn(2, kv_heads, dim)
kernel.step_attention(torch.randn(2, heads, dim), new, new, places, dim**-0.5)
print("attended")
"""


def test_rows_attending_windows_and_padded_batches_match_float64_attention(kernel):
    """Ranges that start past the first key (a sliding window, left padding), a batch whose
    rows attend different keys, and a row attending no key at all (zeros)."""
    torch.manual_seed(1)
    batch, heads, positions, n, dim = 2, 4, 20, 50, 32
    query = torch.randn(batch, heads, positions, dim)
    keys, values = torch.randn(batch, 2, n, dim), torch.randn(batch, 2, n, dim)
    lo, hi = causal(batch, positions, n)
    lo = torch.stack([(hi[0] - 16).clamp(min=0), torch.full((positions,), 7)])  # a window; padding
    lo[1, 3], hi[1, 3] = 0, 0
    out = kernel.attention(query, keys, values, lo, hi, 0.2)
    assert torch.equal(out[1, 3], torch.zeros(heads, dim))
    expected = reference(query, keys, values, lo, hi, 0.2)
    attended = torch.ones(batch, positions, dtype=torch.bool)
    attended[1, 3] = False
    assert (out[attended].double() - expected[attended]).abs().max() < 2e-5
    window = kernel.attention(query[:1, :, -1:], keys[:1, :, -16:].contiguous(), values[:1, :, -16:].contiguous(),
                              *causal(1, 1, 16), 0.2)
    assert torch.equal(window[0, 0], out[0, -1])  # the window's keys alone give the same bits


def test_shapes_the_kernel_does_not_take_are_left_to_float64_attention(kernel):
    """Values of another head size than the keys' (some architectures), a head size not a
    multiple of 16, a key/value head serving a fraction of the query heads: not taken."""
    query, keys = torch.randn(1, 4, 3, 64), torch.randn(1, 2, 10, 64)
    assert kernel.takes(query, keys, torch.randn(1, 2, 10, 64))
    assert not kernel.takes(query, keys, torch.randn(1, 2, 10, 128))
    assert not kernel.takes(torch.randn(1, 4, 3, 24), torch.randn(1, 2, 10, 24), torch.randn(1, 2, 10, 24))
    assert not kernel.takes(torch.randn(1, 3, 3, 64), keys, torch.randn(1, 2, 10, 64))


def test_transformers_masks_become_one_range_of_keys_per_row_or_none():
    from worker.backends.transformers.hf_compat import key_ranges

    n, positions = 12, 4
    causal_mask = torch.ones(positions, n, dtype=torch.bool).tril(diagonal=n - positions)[None, None]
    lo, hi = key_ranges(causal_mask, 1, positions, n)
    assert lo.tolist() == [[0] * 4] and hi.tolist() == [[9, 10, 11, 12]]
    window = causal_mask & ~torch.ones(positions, n, dtype=torch.bool).tril(diagonal=n - positions - 5)
    assert key_ranges(window, 1, positions, n)[0].tolist() == [[4, 5, 6, 7]]
    additive = torch.zeros(1, 1, positions, n).masked_fill(~causal_mask, torch.finfo(torch.float32).min)
    assert key_ranges(additive, 1, positions, n)[1].tolist() == hi.tolist()
    assert key_ranges(None, 2, positions, n)[1].tolist() == [[9, 10, 11, 12]] * 2
    holed = causal_mask.clone()
    holed[..., 0, 3] = False
    assert key_ranges(holed, 1, positions, n) is None  # not one range: float64 attention takes it
    assert key_ranges(additive + 0.5, 1, positions, n) is None  # a bias on scores, not a choice of keys


def test_vectors_of_8_and_of_16_floats_give_the_same_bits(kernel, tmp_path: Path):
    """The kernel's vectors are 16 floats with AVX-512 and 8 without; built here both ways (the
    sums' lanes and order do not depend on the width), they give the same bits for every head
    shape and a range of positions, keys and starts, so a cache means the same numbers on
    either kind of processor."""
    import torch

    from tests.conftest import kernel_variant
    from worker.backends.transformers import exact_attention

    functions = []
    for width in (8, 16):
        library = tmp_path / f"attention-{width}.so"
        kernel_variant(exact_attention.SOURCE, library, ["-march=native", f"-DW={width}"], "lmw_attention")
        functions.append(exact_attention.Kernel(library))
    torch.manual_seed(0)
    for heads, kv_heads, dim in ((9, 3, 64), (4, 1, 16), (8, 2, 128), (6, 3, 32), (2, 2, 48), (4, 1, 256)):
        for positions, keys in ((1, 1), (1, 37), (5, 20), (17, 100), (40, 300), (2, 9)):
            query = torch.randn(2, heads, positions, dim)
            keys_, values = torch.randn(2, kv_heads, keys, dim), torch.randn(2, kv_heads, keys, dim)
            hi = torch.arange(keys - positions + 1, keys + 1).repeat(2, 1)
            lo = torch.randint(0, 3, hi.shape).clamp(max=hi - 1)
            narrow, wide = (f.attention(query, keys_, values, lo, hi, 0.125) for f in functions)
            assert torch.equal(narrow, wide), (heads, kv_heads, dim, positions, keys)


def test_the_kernel_is_built_once_per_machine_and_reused(kernel, tmp_path: Path):
    from worker import c_build
    from worker.backends.transformers import exact_attention

    built = c_build._build(tmp_path, exact_attention.SOURCE)
    stamp = built.stat().st_mtime_ns
    assert c_build._build(tmp_path, exact_attention.SOURCE) == built and built.stat().st_mtime_ns == stamp
    assert [path.name for path in tmp_path.iterdir()] == [built.name]  # no partial file left behind


async def test_a_worker_without_a_c_compiler_loads_int8_with_float64_attention_and_pytorchs_int8_products(
    tiny_model_dir: Path, tmp_path: Path
):
    env = {**TORCH_ENV, "CC": str(tmp_path / "no-such-compiler"), "LM_WORKER_DATA_DIR": str(tmp_path / "data")}
    host = await Host.spawn(env=env)
    try:
        loaded = await host.call("load", {"model": str(tiny_model_dir)}, timeout=120)
        assert loaded["quantization"] == "int8"
        result = await host.call("generate", {"prompt": "the cat sat", "max_tokens": 8})
        assert result["usage"]["completion_tokens"] == 8
    finally:
        await host.close()
    assert "attention in float64" in host.stderr.decode() and "no C compiler" in host.stderr.decode()
    assert "int8 rows multiplied by PyTorch's kernel" in host.stderr.decode()
    assert not (tmp_path / "data" / "kernels").exists() or not any((tmp_path / "data" / "kernels").glob("*.so"))


async def test_a_damaged_kernel_file_is_built_again_and_two_workers_starting_together_both_use_it(
    kernel, tiny_model_dir: Path, tmp_path: Path
):
    """A file under the kernel's name that does not load (damaged, or planted) is built again,
    and two workers starting at once on the same data directory each end with a kernel that
    loads, no partial file left behind, and the same greedy tokens."""
    from worker import c_build
    from worker.backends.transformers import exact_attention

    kernels = tmp_path / "data" / "kernels"
    name = c_build._build(kernels, exact_attention.SOURCE).name
    (kernels / name).write_bytes(b"not a shared library")
    env = {**TORCH_ENV, "LM_WORKER_DATA_DIR": str(tmp_path / "data")}
    hosts = [await Host.spawn(env=env) for _ in range(2)]
    try:
        await asyncio.gather(*(host.call("load", {"model": str(tiny_model_dir)}, timeout=120) for host in hosts))
        results = [await host.call("generate", {"prompt": "the cat sat", "max_tokens": 8}) for host in hosts]
        assert results[0]["tokens"] == results[1]["tokens"]
    finally:
        for host in hosts:
            await host.close()
    for host in hosts:
        assert "attention in float64" not in host.stderr.decode()
    # the attention kernel, built again, the int8 products', the native pass's and the CRC-32C one the
    # kept int8 weights are checked with: no partial file left behind
    names = sorted(path.name for path in kernels.iterdir())
    assert len(names) == 4 and names[1] == name, names
    assert names[0].startswith("crc32c-") and names[2].startswith("int8_kernel-"), names
    assert names[3].startswith("native_forward-"), names
    exact_attention.Kernel(kernels / name)  # loads


def test_a_hung_compiler_is_killed_with_its_children_at_the_timeout(tmp_path: Path, monkeypatch):
    from worker import c_build
    from worker.backends.transformers import exact_attention

    pids = tmp_path / "pids"
    compiler = tmp_path / "hung-cc"
    compiler.write_text(f"#!/bin/sh\nsleep 1000 &\necho $! > {pids}\nsleep 1000\n")  # cc1 and as are children too
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setattr(c_build, "COMPILE_TIMEOUT_S", 1.0)
    started = time.perf_counter()
    with pytest.raises(c_build.KernelUnavailable, match="timed out"):
        c_build._build(tmp_path / "kernels", exact_attention.SOURCE)
    assert time.perf_counter() - started < 10
    child = Path(f"/proc/{pids.read_text().strip()}/stat")
    for _ in range(100):  # killed, then reaped by whoever adopted it
        if not child.exists() or child.read_text().split(") ")[1][0] in "ZX":
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the compiler's child still runs")
    assert list((tmp_path / "kernels").iterdir()) == []


def test_a_decode_step_at_a_long_context_shares_its_attention_among_the_threads(kernel, monkeypatch):
    """Attention's work is counted in multiply-adds, as a product's is (a score and a weighted
    sum per query-key pair and dimension): one sequence's step at 2,000 keys (SmolLM2's 9 heads
    of 64) is shared among torch's threads; a step at 8 keys stays on the calling thread.
    Counted in pairs, the long step stayed on one thread, its attention ~40% of the step."""
    from worker.backends.transformers.exact_attention import StepPlaces

    heads, kv_heads, dim = 9, 3, 64
    threads_asked: list[int] = []
    step = kernel._step
    monkeypatch.setattr(kernel, "_step", lambda *args: threads_asked.append(args[-1]) or step(*args))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for held in (7, 1999):
            keys, values = torch.randn(1, kv_heads, held + 1, dim), torch.randn(1, kv_heads, held + 1, dim)
            places = StepPlaces()
            places.add(keys, values, 0, 0, held + 1)
            new = torch.randn(1, kv_heads, dim)
            kernel.step_attention(torch.randn(1, heads, dim), new, new, places, dim**-0.5)
    finally:
        torch.set_num_threads(before)
    assert threads_asked == [1, 2]
