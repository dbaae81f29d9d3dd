"""A loaded model's objects are kept out of the cycle collector's full collections (a pause of
every stream each few seconds, worker/heap.py), and unloading gives them back to it, so that a
model held in a reference cycle is still freed."""

from __future__ import annotations

import gc
import re
import threading
import weakref
from pathlib import Path

import pytest

from protocol.methods import LoadParams, NoParams
from worker.backends import Registry
from worker.backends.echo import EchoBackend
from worker.handlers import Context, Handlers, WireInfo
from tests.conftest import SpawnWorker


class CyclicEchoBackend(EchoBackend):
    """The echo model caught in a reference cycle: only the cycle collector can free it."""

    def load(self, params, *, data_dir):
        model = super().load(params, data_dir=data_dir)
        model.itself = model  # type: ignore[attr-defined]
        return model


def handlers_of(backend: str, data_dir: Path) -> Handlers:
    """Handlers whose only backend, "echo", is ``backend`` (module:class)."""
    wire = WireInfo(methods=[], notifications=[], framing=lambda: None, max_message_bytes=1 << 20,
                    outbox_messages=16, max_batch=4)
    return Handlers(Registry({"echo": backend}, entry_points=False), wire, data_dir=data_dir)


@pytest.fixture
def handlers(tmp_path: Path):
    handlers = handlers_of("tests.test_heap:CyclicEchoBackend", tmp_path)
    yield handlers
    handlers.close()
    assert gc.get_freeze_count() == 0  # closing leaves the process's heap as it was


def context() -> Context:
    return Context(1, threading.Event(), 0.0, lambda method, params: None)


def loaded(handlers: Handlers) -> weakref.ref:
    handlers.load(context(), LoadParams(backend="echo"))
    return weakref.ref(handlers._model)


def test_a_loaded_models_objects_are_out_of_the_collectors_sight(handlers: Handlers):
    model = loaded(handlers)
    assert gc.get_freeze_count() > 0
    assert not any(o is model() for o in gc.get_objects())


def test_unloading_frees_a_model_held_by_a_cycle(handlers: Handlers):
    model = loaded(handlers)
    assert handlers.unload(context(), NoParams()).unloaded
    assert model() is None
    assert gc.get_freeze_count() == 0


def test_a_model_replaced_by_another_load_is_freed_and_the_new_one_frozen(handlers: Handlers):
    first = loaded(handlers)
    second = loaded(handlers)
    assert first() is None and second() is not None
    assert not any(o is second() for o in gc.get_objects())


def test_unloading_a_model_its_references_free_runs_no_full_collection(tmp_path: Path):
    """A collection costs a tenth of a second in a process that imported PyTorch: it runs only
    where a cycle holds the model (a host that loads and unloads the echo model often, or a
    fuzzer, would pay it every time)."""
    plain = handlers_of("worker.backends.echo:EchoBackend", tmp_path)
    full: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    plain.load(context(), LoadParams(backend="echo"))
    gc.callbacks.append(count)
    try:
        assert plain.unload(context(), NoParams()).unloaded
    finally:
        gc.callbacks.remove(count)
        plain.close()
    assert full == [] and gc.get_freeze_count() == 0


async def test_a_spawned_worker_keeps_a_loaded_models_objects_out_of_full_collections(
    spawn_worker: SpawnWorker, tiny_model_dir: Path
):
    """Through the real entry point: after a load the worker's log says how many objects the
    collector leaves alone (PyTorch's, transformers' and the model's: hundreds of thousands; a
    load of weights kept in int8 imports neither, so the weights here are the float ones)."""
    host = await spawn_worker(process=True)
    await host.call("load", {"model": str(tiny_model_dir), "quantization": "none"}, timeout=300)
    await host.wait_until(lambda: b"kept out of the cycle collector" in host.stderr, timeout=30)
    found = re.search(rb"(\d+) objects kept out of the cycle collector's full collections", bytes(host.stderr))
    assert found and int(found.group(1)) > 50_000, host.stderr_tail()
    result = await host.call("generate", {"prompt": "hello", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert len(result["tokens"]) == 4  # and it serves as before


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="resident memory is read from Linux's /proc")
async def test_a_load_reports_the_worker_s_resident_memory_which_a_model_makes_grow(spawn_worker: SpawnWorker, tiny_gguf: Path):
    """What a host plans a machine's memory with: the process's resident bytes just after the load."""
    import os

    host = await spawn_worker(process=True)
    echo = await host.call("load", {"backend": "echo"})
    model = await host.call("load", {"model": str(tiny_gguf)}, timeout=120)
    resident = int(Path(f"/proc/{host.process.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert 0 < echo["resident_bytes"] < model["resident_bytes"]  # torch and the model came since
    assert abs(model["resident_bytes"] - resident) < 0.25 * resident
    assert (await host.call("capabilities"))["model"]["resident_bytes"] == model["resident_bytes"]
