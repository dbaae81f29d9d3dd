"""What only a GPU shows: run with ``--device cuda`` (the cache exactness tests, those taking
the ``device`` fixture, then load their models on it too). On the CPU these are skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_kv_cache import SYSTEM, worker
from worker.host import WorkerError


@pytest.fixture
def gpu(device: str) -> str:
    if device == "cpu":
        pytest.skip("needs a GPU: run pytest with --device cuda")
    return device


def made_on(device: str) -> str:
    return f"made-on-{device.split(':')[0]}"


async def test_a_cache_file_made_on_a_gpu_is_refused_on_the_cpu_and_the_other_way_round(
    tiny_model_dir: Path, tmp_path: Path, gpu: str
):
    """The same dtype (bfloat16) and weights (dense) on both, so only the processor's kernels
    differ: each side's cache has other last bits than the other would compute, so each refuses
    the other's by name and then keeps serving, and each reads its own exactly."""
    caches = tmp_path / "caches"
    made: dict[str, list[int]] = {}
    for device in (gpu, "cpu"):
        host = await worker(tiny_model_dir, caches, device, dtype="bfloat16", quantization="none")
        try:
            made[device] = (await host.call("generate", {"prompt": SYSTEM, "max_tokens": 12}))["tokens"]
            await host.call("prefill", {"prompt": SYSTEM[:60], "cache": made_on(device)})
        finally:
            await host.close()
    for device, other in ((gpu, "cpu"), ("cpu", gpu)):
        host = await worker(tiny_model_dir, caches, device, dtype="bfloat16", quantization="none")
        try:
            with pytest.raises(WorkerError) as caught:
                await host.call("generate", {"prompt": SYSTEM, "max_tokens": 12, "cache": made_on(other)})
            own = await host.call("generate", {"prompt": SYSTEM, "max_tokens": 12, "cache": made_on(device)})
        finally:
            await host.close()
        assert caught.value.kind == "cache_identity_mismatch" and "config_sha256" in caught.value.message
        assert own["tokens"] == made[device] and own["usage"]["cache_read_tokens"] > 0
