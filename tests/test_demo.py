"""The main job, as the README gives it: the demo session on the default model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import TORCH_ENV


@pytest.mark.slow
def test_the_demo_runs_its_whole_session_and_prints_the_counts():
    done = subprocess.run(
        [sys.executable, "-m", "worker.demo"], env={**os.environ, **TORCH_ENV}, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "prefilled the system prompt into cache 'memory://demo-system'" in out
    assert out.count("finish_reason=") == 4 and "cache_read_tokens=19" in out
    assert "auto cache: reused" in out
    assert "Three questions at once" in out and "tokens/s over the three streams" in out
    assert "The capital of France is Paris." in out
