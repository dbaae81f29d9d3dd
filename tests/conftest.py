"""Shared fixtures: workers over real pipes, in this process (the default: the same pieces on
threads, no process start-up) or as real subprocesses where only a process shows what a test
checks (stdout guarding, signals, exit codes, logs on stderr, the environment)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from tests import engine_server
from worker.host import Host

SpawnWorker = Callable[..., Awaitable[Host]]

# Torch threads that spin on cores other work is using make a forward pass tens of
# times slower; tests run torch on one thread, in this process (set before torch is
# imported: workers in this process run on it) and in the workers it spawns.
TORCH_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
os.environ.update(TORCH_ENV)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The tiny offline test model of a family (worker.backends.transformers.tiny_model), each built once per session."""
    from worker.backends.transformers.tiny_model import build

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build(tmp_path_factory.mktemp(f"tiny-{family}"), family=family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_models: Callable[[str], Path]) -> Path:
    """The tiny full-attention (Llama) test model."""
    return tiny_models("llama")


@pytest.fixture(scope="session")
def tiny_thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama test model (the same weights) with a reasoning model's chat template:
    its generation prompt opens the thinking (<think>)."""
    from worker.backends.transformers.tiny_model import THINKING_CHATML, build

    return build(tmp_path_factory.mktemp("tiny-thinking"), chat_template=THINKING_CHATML)


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama test model as a .gguf file, its matrices Q8_0 blocks (loads map them)."""
    from worker.backends.transformers.tiny_model import write_gguf

    return write_gguf(tiny_model_dir, tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="the device the cache exactness tests (those taking the device fixture) load their models on: "
        "cpu (the default), cuda, cuda:N or mps, to run the same tests on a GPU",
    )


def pytest_itemcollected(item: pytest.Item) -> None:
    """Tests that take the device fixture are marked ``device``: ``-m device --device cuda``
    runs just them on a GPU."""
    if "device" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.device)


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> str:
    """The device of ``--device``: the cache exactness tests load on it, so that the same tests
    check greedy from a cache against greedy without one on a GPU."""
    return request.config.getoption("--device")


# Every family of cache layers: full attention, sliding window, linear attention; then (slow
# tier) the default SmolLM2.
CACHE_MODELS = ["llama", "gemma3", "qwen3_5", pytest.param("default", marks=pytest.mark.slow)]


@pytest.fixture(params=CACHE_MODELS)
def cache_model(request: pytest.FixtureRequest, tiny_models: Callable[[str], Path]) -> str:
    """The model a cache exactness test loads: a tiny one of each family, and the default SmolLM2."""
    return "default" if request.param == "default" else str(tiny_models(request.param))


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_dir: Path):
    """The tiny model and its tokenizer, loaded in this process once, for reference outputs."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_as_loaded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny model as a worker's default ``load`` makes it (dtype, quantized weights,
    attention implementation), in this process: transformers' own generate() on it is the
    reference for the worker's decode loop."""
    import torch

    from protocol.methods import LoadParams
    from worker.backends.transformers.backend import TransformersBackend

    torch.set_num_threads(1)
    loaded = TransformersBackend().load(LoadParams(model=str(tiny_model_dir)), data_dir=tmp_path_factory.mktemp("data"))
    return loaded._model


@pytest.fixture
def torch_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Models loaded in the test compute their passes with decode_step's PyTorch operations,
    as where native_forward.c cannot be built: for the tests of decode_step itself."""
    from worker.backends.transformers import native_forward

    monkeypatch.setattr(native_forward, "applies", lambda *args: False)


@pytest.fixture
async def spawn_worker() -> AsyncIterator[SpawnWorker]:
    """A worker with the given arguments, in this process; a real ``python -m worker`` process
    with ``process=True`` (or given ``python``, or an ``env`` beyond TORCH_ENV). Every worker is
    ended after the test."""
    hosts: list[Host] = []

    async def spawn(*args: str, process: bool = False, **kwargs) -> Host:
        if process or kwargs.get("python") or kwargs.get("env", TORCH_ENV) != TORCH_ENV:
            host = await Host.spawn(*args, **kwargs)
        else:
            host = await Host.start_in_process(*args, **{k: v for k, v in kwargs.items() if k == "framing"})
        hosts.append(host)
        return host

    yield spawn
    for host in hosts:
        if host.process.returncode is None:
            host.process.kill()
        await host.process.wait()
        assert not host.malformed, f"the worker wrote malformed output: {host.malformed}"


@pytest.fixture
async def echo_worker(spawn_worker: SpawnWorker) -> Host:
    """A worker with the echo backend loaded."""
    host = await spawn_worker()
    await host.call("load", {"backend": "echo"})
    return host


def processor_flags() -> set[str]:
    """The instruction sets /proc/cpuinfo names for this processor (none where it cannot be read)."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def kernel_variant(source: Path, library: Path, flags: list[str], function: str):
    """The C function ``function`` of ``source`` built with the worker's flags plus ``flags``
    (another processor's code path, built here on purpose), loaded with ctypes; skips the test
    where there is no C compiler."""
    import ctypes
    import shutil
    import subprocess

    from worker.c_build import FLAGS

    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler here")
    subprocess.run(
        [compiler, *FLAGS, *flags, "-o", str(library), str(source)],
        check=True, capture_output=True,
    )
    return getattr(ctypes.CDLL(str(library)), function)


# What a load computed by the native pass never needs: transformers' modeling code (it imports
# torch's compiler) and transformers' activations (its Llama configuration's module imports them,
# and torch.distributed through them).
HEAVY_MODULES = ("torch._dynamo", "transformers.modeling_utils", "transformers.activations", "torch.distributed.tensor")


def load_in_a_fresh_process(model: Path, data_dir: Path, modules: tuple[str, ...] = HEAVY_MODULES) -> str:
    """The class of the model a backend load of ``model`` makes in a fresh process (its torch
    model's, where it has one), and which of ``modules`` it imported: "ShellModel []" for a load
    of the native pass over a torch model, "NativeModel []" for one without torch."""
    import subprocess
    import sys

    script = f"""
import sys
from pathlib import Path
from protocol.methods import LoadParams
from worker.backends.transformers.backend import TransformersBackend
model = TransformersBackend().load(LoadParams(model={str(model)!r}), data_dir=Path({str(data_dir)!r}))
print(type(getattr(model, "_model", model)).__name__, sorted(m for m in {modules!r} if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    return done.stdout.split("\n")[-2]


def install_plugin(directory: Path, module: str, source: str, backends: dict[str, str]) -> dict[str, str]:
    """A third-party backend package: a module and a dist-info with ``lm_worker.backends``
    entry points, in ``directory``. Returns the environment that puts it on the path."""
    (directory / f"{module}.py").write_text(source)
    dist_info = directory / f"{module}-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in backends.items())
    (dist_info / "entry_points.txt").write_text(f"[lm_worker.backends]\n{lines}")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))}



def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start the vLLM server as soon as some selected test needs it: its two minutes of warm-up
    overlap the tests that run before."""
    if any("vllm_url" in getattr(item, "fixturenames", ()) for item in items):
        engine_server.start_early()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    engine_server.stop()


@pytest.fixture(scope="session")
def vllm_url() -> str:
    """A real vLLM server serving the default SmolLM2 as "smollm2", the openai backend's engine
    (tests/engine_server.py); LM_WORKER_TEST_VLLM_URL names one already running instead."""
    if explicit := os.environ.get("LM_WORKER_TEST_VLLM_URL"):
        return explicit
    if not engine_server.installed():
        pytest.skip("vLLM is not installed in .venv-vllm (make vllm); the openai backend's engine tests need it")
    return engine_server.ready_url()
