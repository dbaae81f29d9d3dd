"""load/progress: the stages of a long load, in order, before its answer."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from protocol.errors import ErrorKind, RpcError
from protocol.methods import LoadProgress
from tests.conftest import TORCH_ENV
from worker import load_progress, stopping
from worker.stopping import Stop
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
    # three kernels (the native pass, attention, gguf products: a load without torch needs no int8
    # products), a first and last report each
    assert [p["stage"] for p in progress].count("building_kernel") == 6
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


def test_a_cancelled_load_ends_at_its_next_stage_or_report_after_sending_it():
    sent: list[LoadProgress] = []
    cancelled = [False]
    with load_progress.reporting(sent.append, 7, is_cancelled=lambda: cancelled[0]):
        report = load_progress.stage("quantizing", 3, "tensors")
        report(1)
        cancelled[0] = True
        assert load_progress.cancelled()
        with pytest.raises(RpcError) as caught:
            report(3)
        assert caught.value.kind is ErrorKind.REQUEST_CANCELLED
        with pytest.raises(RpcError):
            load_progress.stage("hashing", 5, "bytes")
    assert [(p.stage, p.done) for p in sent] == [("quantizing", 0), ("quantizing", 3)]  # 1: within INTERVAL_S
    with load_progress.reporting(None, 8, is_cancelled=lambda: True):  # a load that reports nothing: checked all the same
        with pytest.raises(RpcError):
            load_progress.stage("hashing", 5, "bytes")
    assert not load_progress.cancelled()  # outside a load


def test_what_a_loads_steps_share_lives_as_long_as_the_load():
    with load_progress.reporting(None, 1):
        first = load_progress.shared("k", list)
        first.append(1)
        assert load_progress.shared("k", list) is first
    with load_progress.reporting(None, 2):
        assert load_progress.shared("k", list) == []
    assert load_progress.shared("k", list) is not load_progress.shared("k", list)


def test_a_cancel_lets_go_of_every_wait_in_progress_and_waits_nest():
    """A load's handler marks its whole course as a wait; a server's or a compiler's nests in it."""
    stop = Stop()
    outer, inner = threading.Event(), threading.Event()
    with stopping.scope(stop), stopping.while_waiting(outer.set):
        with stopping.while_waiting(inner.set):
            pass
        assert stop.stop() and outer.is_set() and not inner.is_set()  # the inner wait was over
        with stopping.while_waiting(inner.set):
            assert stop.stop() and inner.is_set()
    assert not stop.stop()
