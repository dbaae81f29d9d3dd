"""The model thread gives up a torch thread for each core other processes keep busy, and
takes it back when they let it go (worker/backends/transformers/torch_threads.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from worker.backends.transformers.torch_threads import CoreShare, cores_taken, cpu_seconds

BUSY_LOOP = [sys.executable, "-c", "while True: pass"]


def test_a_core_counts_as_taken_past_half_and_is_given_back_below_a_third():
    assert cores_taken(0.45, 0, most=1) == 0
    assert cores_taken(0.55, 0, most=1) == 1
    assert cores_taken(0.4, 1, most=1) == 1  # between the two edges: as it was
    assert cores_taken(0.25, 1, most=1) == 0
    assert cores_taken(3.0, 0, most=1) == 1  # at least one thread is left
    assert cores_taken(2.6, 0, most=7) == 3
    assert cores_taken(0.1, 3, most=7) == 0


class FakeCpus:
    """CPU readings and a clock, moved by hand: `run(seconds, others, own)`."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 100.0, 0.0, 0.0

    def run(self, seconds: float, *, others: float, own: float) -> None:
        self.now += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own

    def read(self) -> tuple[float, float]:
        return self.busy, self.own


def watched(cpus: int = 2) -> tuple[FakeCpus, CoreShare]:
    """A CoreShare over FakeCpus on ``cpus`` CPUs, its first look (a baseline) taken."""
    fake = FakeCpus()
    share = CoreShare(read=fake.read, clock=lambda: fake.now, cpus=lambda: cpus)
    share.adjust()
    return fake, share


@pytest.fixture
def two_threads():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_model_thread_runs_on_one_thread_while_another_process_keeps_a_core_busy_and_on_two_after(two_threads):
    import torch

    cpus, share = watched()
    cpus.run(0.3, others=0.05, own=2.0)
    share.adjust()
    assert torch.get_num_threads() == 2 and share.threads == 2
    cpus.run(0.3, others=0.67, own=1.33)  # a busy loop shares the cores with both threads
    share.adjust()
    assert torch.get_num_threads() == 1 and share.threads == 1
    cpus.run(0.3, others=1.0, own=1.0)  # it has a core of its own now: still taken
    share.adjust()
    assert torch.get_num_threads() == 1
    cpus.run(0.3, others=0.0, own=1.0)
    share.adjust()
    assert torch.get_num_threads() == 2 and share.threads == 2


def test_other_processes_on_cores_the_threads_leave_free_take_none_of_them(two_threads):
    import torch

    cpus, share = watched(cpus=4)
    cpus.run(0.3, others=1.9, own=2.0)  # two more cores than the two threads: room for both
    share.adjust()
    assert torch.get_num_threads() == 2
    cpus.run(0.3, others=2.7, own=1.3)  # a third busy core comes out of the threads' two
    share.adjust()
    assert torch.get_num_threads() == 1


def test_a_look_that_spans_an_idle_model_only_starts_a_new_one(two_threads):
    import torch

    cpus, share = watched()
    cpus.run(30.0, others=1.0, own=0.0)  # a build ran while the model was idle, and ended
    share.adjust()
    assert torch.get_num_threads() == 2
    cpus.run(0.3, others=1.0, own=1.0)
    share.adjust()
    assert torch.get_num_threads() == 1


def test_looks_closer_together_than_the_interval_change_nothing(two_threads):
    import torch

    cpus, share = watched()
    cpus.run(0.05, others=1.0, own=1.0)
    share.adjust()
    assert torch.get_num_threads() == 2


def test_only_the_thread_that_looked_first_has_its_count_changed(two_threads):
    import torch

    cpus, share = watched()
    cpus.run(0.3, others=1.0, own=1.0)
    seen: list[int] = []

    def side_thread() -> None:
        torch.set_num_threads(1)
        share.adjust()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=side_thread)
    thread.start()
    thread.join()
    assert seen == [1] and torch.get_num_threads() == 2 and share.threads == 2
    share.adjust()
    assert torch.get_num_threads() == 1


def test_unreadable_cpu_times_leave_the_count_as_it_is(two_threads):
    import torch

    def unreadable() -> tuple[float, float]:
        raise OSError("no /proc/stat")

    share = CoreShare(read=unreadable, cpus=lambda: 2)
    for _ in range(3):
        share.adjust()
        time.sleep(0.01)
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="CPU times are read from Linux's /proc/stat")
def test_the_cpu_reading_counts_another_processs_busy_loop_and_not_this_process():
    busy = subprocess.Popen(BUSY_LOOP)
    try:
        time.sleep(0.2)
        before, own_before, start = *cpu_seconds(), time.monotonic()
        deadline = start + 0.6
        while time.monotonic() < deadline:  # this process busy too: it must not count as another's
            pass
        after, own_after = cpu_seconds()
        seconds = time.monotonic() - start
    finally:
        busy.kill()
        busy.wait()
    own = (own_after - own_before) / seconds
    others = ((after - before) - (own_after - own_before)) / seconds
    assert own > 0.4, own
    assert others > 0.5, others


@contextlib.asynccontextmanager
async def beside_a_busy_loop(spawn_worker):
    """A worker (logging at info) and a busy loop on the same two cores, spawned while this
    process is kept to them: on a machine with more, the loop would run on a core of its own
    and take nothing."""
    everywhere = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(everywhere)[:2])
    try:
        host = await spawn_worker("--log-level", "info", env={"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"})
        busy = subprocess.Popen(BUSY_LOOP)
    finally:
        os.sched_setaffinity(0, everywhere)
    try:
        yield host
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the worker has one thread on one core: none to give up")
async def test_a_worker_decodes_on_one_thread_while_another_process_keeps_one_of_its_two_cores_busy(
    spawn_worker, tiny_model_dir: Path
):
    """The rule wired to the real CPU times. Taking the thread back once the loop ends is held
    by the tests with readings given above: on a machine shared with other work (the test
    suite's vLLM server warms up on these cores), a real worker rightly keeps it given up."""
    async with beside_a_busy_loop(spawn_worker) as host:
        await host.call("load", {"model": str(tiny_model_dir)}, timeout=120)
        deadline = time.monotonic() + 60
        while "model threads: 1 of 2" not in host.stderr_tail(100_000):
            assert time.monotonic() < deadline, host.stderr_tail()
            await host.call("generate", {"prompt": "the cat sat on the mat", "max_tokens": 64, "stream": False}, timeout=60)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the worker has one thread on one core: none to give up")
async def test_a_worker_on_dense_weights_keeps_its_threads_while_another_process_keeps_a_core_busy(
    spawn_worker, tiny_model_dir: Path
):
    """Dense products are a library's (MKL's sgemm splits their inner dimension among threads on
    Intel processors): a thread count changed between a cache's making and its use would change
    the numbers the cache promises. The same steps as above, on weights kept dense."""
    async with beside_a_busy_loop(spawn_worker) as host:
        await host.call("load", {"model": str(tiny_model_dir), "quantization": "none"}, timeout=120)
        deadline = time.monotonic() + 3  # a model that shares its cores gives one up within 0.5 s
        while time.monotonic() < deadline:
            await host.call("generate", {"prompt": "the cat sat on the mat", "max_tokens": 32, "stream": False}, timeout=60)
    log = host.stderr_tail(100_000)
    assert "model threads: 2, kept" in log, log
    assert "model threads: 1 of 2" not in log, log


def test_a_cache_of_library_products_is_bound_to_the_thread_count_and_one_of_the_native_pass_is_not(
    tiny_model_dir: Path, tmp_path: Path
):
    """A worker on another thread count (another machine, OMP_NUM_THREADS) computes dense
    products with other last bits, so their caches must not pass for its own; the native pass's
    numbers are the same on any count, and its caches are shared whatever the count."""
    import torch

    from protocol.methods import LoadParams
    from worker.backends.transformers.backend import TransformersBackend

    before = torch.get_num_threads()
    identities: dict[tuple[str, int], str] = {}
    try:
        for quantization in ("none", "int8"):
            for threads in (2, 1):
                torch.set_num_threads(threads)
                loaded = TransformersBackend().load(
                    LoadParams(model=str(tiny_model_dir), quantization=quantization), data_dir=tmp_path
                )
                identities[quantization, threads] = loaded.cache_identity().config_sha256
                assert (loaded._cores is not None) == (quantization == "int8")
                loaded.close()
    finally:
        torch.set_num_threads(before)
    assert identities["none", 2] != identities["none", 1]
    assert identities["int8", 2] == identities["int8", 1]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "quantization"), [("default", "auto"), ("default", "gguf"), ("gemma3-270m", "auto")])
def test_the_thread_count_changes_no_bit_of_the_logits_of_a_model_that_shares_its_cores(model: str, quantization: str):
    """What lets the count change between steps: a cache computed on two threads, or a request
    begun on them, continues on one with the numbers it would have had. Checked on every model
    whose count the worker changes (dense weights keep theirs: the test above)."""
    import torch

    from protocol.methods import LoadParams
    from worker.backends.transformers.backend import TransformersBackend
    from worker.data_dir import default_data_dir

    before = torch.get_num_threads()
    loaded = TransformersBackend().load(LoadParams(model=model, quantization=quantization), data_dir=default_data_dir())
    assert loaded._cores is not None, "the worker changes this model's thread count"
    loaded._cores = None  # the test sets the count itself
    ids = loaded.tokenize("The history of the city of Rome begins with a small settlement by the river. " * 6, add_special_tokens=True)
    logits = {}
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                cache = loaded.new_cache()
                logits[threads] = (torch.from_numpy(loaded.forward_chunk(cache, ids[:-1])), torch.from_numpy(loaded.forward_chunk(cache, ids[-1:])))
    finally:
        torch.set_num_threads(before)
        loaded.close()
    assert torch.equal(logits[1][0], logits[2][0]) and torch.equal(logits[1][1], logits[2][1])
