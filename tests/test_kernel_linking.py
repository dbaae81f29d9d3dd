"""How the worker links the C kernels it builds (c_build): libm by name, so that their calls of
the C library's mathematics bind to glibc's current functions."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest


def test_a_built_kernel_calls_glibcs_current_expf_not_the_wrapper_an_unnamed_libm_binds_to(tmp_path: Path):
    """Unlinked, a kernel's expf bound to its oldest version (GLIBC_2.2.5): a wrapper that checks
    errno around the same function, 7% of a prompt in llama.cpp's arithmetic (native_forward.c
    calls expf once a key)."""
    from worker import c_build
    from worker.backends.transformers import native_pass

    if platform.libc_ver()[0] != "glibc" or shutil.which("nm") is None or shutil.which("cc") is None:
        pytest.skip("needs glibc, nm and a C compiler")
    library = c_build.built(tmp_path, native_pass.SOURCE, lambda path: path)
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True,
                               check=True).stdout.split()
    calls = [name for name in undefined if name.startswith("expf@")]
    assert calls, undefined
    assert all(name != "expf@GLIBC_2.2.5" for name in calls), calls
