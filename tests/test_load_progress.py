"""load/progress: the stages of a long load, in order, before its answer."""

from __future__ import annotations

from pathlib import Path

from protocol.methods import LoadProgress
from tests.conftest import TORCH_ENV
from worker import load_progress
from worker.host import Host


def _progress(host: Host, request_id: int) -> tuple[list[dict], int]:
    """The load/progress params of a request, and where its answer came among the messages."""
    answered = next(i for i, m in enumerate(host.messages) if m.get("id") == request_id and "method" not in m)
    progress = [
        (i, m["params"]) for i, m in enumerate(host.messages)
        if m.get("method") == "load/progress" and m["params"]["id"] == request_id
    ]
    assert all(i < answered for i, _ in progress), "progress after the load's answer"
    return [p for _, p in progress], answered


def _check_stages(progress: list[dict]) -> list[str]:
    """Each stage's done goes up from 0 to its total, the stages in the documented order (a
    stage may come again right after it ended: each kernel built is a building_kernel stage);
    the stages seen, once each."""
    stages: list[str] = []
    for report in progress:
        again = bool(stages) and stages[-1] == report["stage"] and report["done"] == 0 and previous["done"] == total
        if not stages or stages[-1] != report["stage"] or again:
            assert report["done"] == 0, f"{report['stage']} began at {report['done']}"
            stages.append(report["stage"])
            total = report["total"]
        else:
            assert report["total"] == total and report["done"] >= previous["done"]
        if report["done"] == total:
            assert report["unit"] == {"building_kernel": "steps", "hashing": "bytes"}.get(report["stage"], "tensors")
        previous = report
    ends = [p for i, p in enumerate(progress) if i + 1 == len(progress) or progress[i + 1]["stage"] != p["stage"]]
    assert all(p["done"] == p["total"] for p in ends), ends
    order = [load_progress.STAGES.index(stage) for stage in stages]
    assert order == sorted(order), stages
    return list(dict.fromkeys(stages))


async def test_a_load_from_a_gguf_reports_each_stage_up_to_its_total_in_order_before_its_answer(
    tiny_gguf: Path, tmp_path: Path
):
    """A worker process with a fresh data directory: the kernels are built and the gguf's bytes
    hashed; its blocks are mapped as they are (nothing dequantized or quantized). Loaded again,
    the file's digest is remembered: nothing left to report."""
    host = await Host.spawn(env={**TORCH_ENV, "LM_WORKER_DATA_DIR": str(tmp_path / "data")})
    try:
        first, answer = host.start("load", {"model": str(tiny_gguf), "progress": True})
        loaded = (await answer)["result"]
        second, answer = host.start("load", {"model": str(tiny_gguf), "progress": True})
        await answer
    finally:
        await host.close()
    assert loaded["quantization"] == "gguf"
    progress, _ = _progress(host, first)
    assert _check_stages(progress) == ["building_kernel", "hashing"]
    # four kernels (attention, int8 products, native pass, gguf products), a first and last report each
    assert [p["stage"] for p in progress].count("building_kernel") == 8
    by_stage = {p["stage"]: p["total"] for p in progress}
    assert by_stage["hashing"] == tiny_gguf.stat().st_size
    again, _ = _progress(host, second)
    assert _check_stages(again) == []


async def test_a_load_reports_progress_only_when_asked_and_only_the_stages_it_has_work_in(
    spawn_worker, tiny_model_dir: Path
):
    host = await spawn_worker()
    unasked, answer = host.start("load", {"model": str(tiny_model_dir)})
    await answer
    echo, answer = host.start("load", {"backend": "echo", "progress": True})
    await answer
    plain, answer = host.start("load", {"model": str(tiny_model_dir), "quantization": "none", "progress": True})
    await answer  # its digests were remembered by the first load: nothing long left to do
    assert _progress(host, unasked)[0] == _progress(host, echo)[0] == _progress(host, plain)[0] == []
    assert not [m for m in host.messages if m.get("method") == "load/progress"]


def test_a_stage_between_its_first_and_last_report_sends_at_most_one_per_interval():
    sent: list[LoadProgress] = []
    now = [0.0]
    with load_progress.reporting(sent.append, 7, clock=lambda: now[0]):
        report = load_progress.stage("hashing", 100, "bytes")
        for done in range(1, 101):
            now[0] = done * load_progress.INTERVAL_S / 10
            report(done)
    assert [p.done for p in sent] == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert {(p.id, p.stage, p.total, p.unit) for p in sent} == {(7, "hashing", 100, "bytes")}
    assert load_progress.stage("hashing", 5, "bytes")(5) is None  # outside a load: nothing, no error
