"""Backends are found by name; a broken or missing one is reported, never fatal."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.errors import ErrorKind, RpcError
from worker.backends import Registry
from worker.host import WorkerError
from tests.conftest import SpawnWorker, install_plugin
from tests.test_openai_backend import misbehaving  # noqa: F401 (a fixture)

BROKEN = "raise ImportError('needs libfoo 2.0; pip install foo')\n"
UNAVAILABLE = """
class Shy:
    name = "shy"
    description = "never available here"
    def unavailable_reason(self):
        return "no accelerator; install the shy driver"
    def load(self, params, *, data_dir):
        raise AssertionError("must not be called")
"""


async def test_a_plugin_that_fails_to_import_is_listed_unavailable_and_the_worker_keeps_serving(
    spawn_worker: SpawnWorker, tmp_path: Path
):
    env = install_plugin(tmp_path, "broken_backend", BROKEN, {"broken": "broken_backend:Backend"})
    host = await spawn_worker(env=env)
    backends = {b["name"]: b for b in (await host.call("capabilities"))["backends"]}
    assert not backends["broken"]["available"]
    assert "needs libfoo 2.0" in backends["broken"]["reason"]
    with pytest.raises(WorkerError) as caught:
        await host.call("load", {"backend": "broken"})
    assert caught.value.kind == "backend_unavailable" and "needs libfoo 2.0" in caught.value.message
    assert (await host.call("load", {"backend": "echo"}))["backend"] == "echo"


async def test_an_unavailable_backend_says_why_and_is_never_asked_to_load(spawn_worker: SpawnWorker, tmp_path: Path):
    env = install_plugin(tmp_path, "shy_backend", UNAVAILABLE, {"shy": "shy_backend:Shy"})
    host = await spawn_worker(env=env)
    with pytest.raises(WorkerError) as caught:
        await host.call("load", {"backend": "shy"})
    assert caught.value.code == -32004
    assert caught.value.message == "Backend 'shy' is not available: no accelerator; install the shy driver"


def test_an_unknown_backend_names_the_ones_there_are():
    registry = Registry({"echo": "worker.backends.echo:EchoBackend"}, entry_points=False)
    with pytest.raises(RpcError) as caught:
        registry.get("llama")
    assert caught.value.kind is ErrorKind.BACKEND_NOT_FOUND
    assert caught.value.data.field == "params.backend" and "echo" in caught.value.message


def test_a_plugin_cannot_take_the_name_of_a_builtin(tmp_path: Path, monkeypatch):
    install_plugin(tmp_path, "impostor", "class Echo: pass\n", {"echo": "impostor:Echo"})
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry()
    assert registry.names().count("echo") == 1
    assert type(registry.get("echo")).__module__ == "worker.backends.echo"


def test_each_builtin_backend_is_the_capability_protocols_it_has_and_no_other(tiny_model_dir, tmp_path, misbehaving):
    """The worker asks for optional capabilities with isinstance on runtime-checkable Protocols:
    the built-in backends must answer what they really do."""
    from protocol.methods import LoadParams
    from tests.test_openai_backend import url_of
    from worker.backends.base import (
        CachingModel, CheckingBackend, DraftingModel, EngineModel, SideThreadModel,
    )
    from worker.backends.echo import EchoBackend
    from worker.backends.openai.backend import OpenAIBackend
    from worker.backends.transformers.backend import TransformersBackend

    backends = {"transformers": TransformersBackend(), "echo": EchoBackend(), "openai": OpenAIBackend()}
    loads = {
        "transformers": LoadParams(model=str(tiny_model_dir)),
        "echo": LoadParams(backend="echo"),
        "openai": LoadParams(backend="openai", base_url=url_of(misbehaving)),
    }
    models = {name: backend.load(loads[name], data_dir=tmp_path) for name, backend in backends.items()}
    capabilities = {CachingModel: "caching", DraftingModel: "drafting", EngineModel: "engine", SideThreadModel: "side"}
    has = {name: {what for protocol, what in capabilities.items() if isinstance(model, protocol)}
           for name, model in models.items()}
    assert has == {"transformers": {"caching", "drafting", "side"}, "echo": set(), "openai": {"engine"}}
    assert all(isinstance(backend, CheckingBackend) for backend in backends.values())
    for model in models.values():
        model.close()
