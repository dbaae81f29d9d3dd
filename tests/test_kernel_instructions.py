"""What the compiler makes of the gguf kernel on this machine: instructions the source asks for
are there, and none that ties a block's arithmetic to the block before it. Both were lost once
without a number changing (only a Xeon's decode speed showed them), so they are read from the
built library."""

from __future__ import annotations

import platform
import shutil
import subprocess
import pytest

from tests.conftest import processor_flags


@pytest.fixture(scope="module")
def disassembly(tmp_path_factory: pytest.TempPathFactory) -> str:
    from worker import c_build
    from worker.backends.transformers.gguf_weights import KERNEL_SOURCE

    if platform.machine() != "x86_64" or shutil.which("objdump") is None or shutil.which("cc") is None:
        pytest.skip("needs an x86-64 processor, objdump and a C compiler")
    if not {"avx2", "fma", "f16c"} <= processor_flags():  # the kernel's VECTOR code
        pytest.skip("the gguf kernel's vector code needs AVX2, FMA and F16C")
    library = c_build.built(tmp_path_factory.mktemp("kernels"), KERNEL_SOURCE, lambda path: path)
    return subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout


def test_the_gguf_kernel_asks_for_weights_ahead_of_its_products(disassembly: str):
    """ask_ahead's prefetches: as a plain inline function holding nothing but a prefetch, GCC 12
    judged it free of effects and dropped every call, and a decode step's weights streamed from
    memory at a third of the speed the machine reads them (bench/README, "Figures behind
    constants")."""
    assert "prefetcht1" in disassembly


def test_the_gguf_kernel_widens_float16_scales_without_a_merge_into_the_last_result(disassembly: str):
    """A block's float16 scale widened by F16C's vcvtph2ps: with AVX512-FP16, `(float)h` became
    vcvtsh2ss, which keeps the rest of its target register, and chained every block of a row to
    the arithmetic of the block before (a Q5_0 row at one third of its speed on such a Xeon)."""
    merging = [line for line in disassembly.splitlines() if "vcvtsh2ss" in line or "vcvtss2sh" in line]
    assert not merging, merging[:5]
