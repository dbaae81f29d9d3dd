"""stdout is sacred: a backend that prints or writes to fd 1 cannot corrupt the protocol stream.

The noisy backend is a real third-party plug-in: a module plus a dist-info
directory with an ``lm_worker.backends`` entry point, put on PYTHONPATH.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.conftest import SpawnWorker, install_plugin

NOISY_BACKEND = textwrap.dedent(
    '''
    import ctypes, os, sys
    from worker.backends.echo import EchoBackend, EchoModel

    def shout(where):
        print(f"NOISE print in {where}")                      # Python's sys.stdout
        sys.stdout.flush()
        os.write(1, f"NOISE fd1 in {where}\\n".encode())       # the descriptor itself
        ctypes.CDLL(None).puts(f"NOISE libc in {where}".encode())  # C code's stdout
        ctypes.CDLL(None).fflush(None)

    class NoisyModel(EchoModel):
        def tokenize(self, text, *, add_special_tokens):
            shout("tokenize")
            return super().tokenize(text, add_special_tokens=add_special_tokens)

        def step(self, decodings, chunks=()):
            shout("generate")
            super().step(decodings, chunks)

    class NoisyBackend(EchoBackend):
        name = "noisy"
        description = "echo, but it writes to stdout at every step"

        def load(self, params, *, data_dir):
            shout("load")
            return NoisyModel(params, 0.0)
    '''
)


@pytest.fixture
def noisy_plugin(tmp_path: Path) -> dict[str, str]:
    return install_plugin(tmp_path, "noisy_backend", NOISY_BACKEND, {"noisy": "noisy_backend:NoisyBackend"})


async def test_a_plugin_backend_is_found_through_its_entry_point(spawn_worker: SpawnWorker, noisy_plugin):
    host = await spawn_worker(env=noisy_plugin)
    backends = {b["name"]: b for b in (await host.call("capabilities"))["backends"]}
    assert backends["noisy"]["available"] and backends["noisy"]["description"].startswith("echo, but")
    assert backends["echo"]["available"]


async def test_a_backend_writing_to_stdout_does_not_corrupt_the_stream(spawn_worker: SpawnWorker, noisy_plugin):
    host = await spawn_worker(env=noisy_plugin)
    await host.call("load", {"backend": "noisy"})
    assert (await host.call("tokenize", {"text": "hi"}))["count"] == 3
    msg_id, done = host.start("generate", {"prompt": "héllo", "max_tokens": 50})
    result = (await done)["result"]
    assert result["text"] == "héllo"
    assert "".join(c["text"] for c in host.chunks[msg_id]) == "héllo"
    await host.close()
    assert host.malformed == []
    assert all(json.dumps(m) and m["jsonrpc"] == "2.0" for m in host.messages)
    noise = host.stderr.decode()
    for where in ("load", "tokenize", "generate"):
        for how in ("print", "fd1", "libc"):
            assert f"NOISE {how} in {where}" in noise, f"{how} noise from {where} went missing"
