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


def test_the_demo_loads_on_the_device_given_and_says_a_refused_load_in_one_line(tiny_model_dir):
    def demo(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "worker.demo", "--model", str(tiny_model_dir), "--max-tokens", "4", *args]
        return subprocess.run(command, env={**os.environ, **TORCH_ENV}, capture_output=True, text=True, timeout=300)

    on_cpu = demo("--device", "cpu:0")  # torch's name for the one CPU: the worker's is "cpu"
    assert on_cpu.returncode == 0, on_cpu.stderr[-2000:]
    assert "weights, on cpu)" in on_cpu.stdout and "tokens/s over the three streams" in on_cpu.stdout
    refused = demo("--device", "quantum")
    assert refused.returncode == 1
    assert "Unknown device 'quantum'" in refused.stderr and "(invalid_params)" in refused.stderr
    assert "Traceback" not in refused.stderr
