"""The vLLM server the openai backend's tests run against: started once per test session from
.venv-vllm (``make vllm``), on a free loopback port, serving the default SmolLM2 (the converted
directory the worker makes) as "smollm2", with prefix caching, cached-token counts, and tool
calls read by vLLM's hermes parser through a chat template that lists tools
(tests/engine/smollm2_tools.jinja)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TOOLS_TEMPLATE = Path(__file__).resolve().parent / "engine" / "smollm2_tools.jinja"
SERVED_NAME = "smollm2"
# The server checks this key (its --api-key); the tests' workers read it from this variable.
API_KEY_ENV = "LM_WORKER_TEST_VLLM_KEY"
API_KEY = "lm-worker-test-key"
READY_WITHIN_S = 900  # under a minute on an idle 2-core machine; much more beside a busy test run

_server: subprocess.Popen | None = None
_url: str | None = None
_log: Path | None = None


def installed() -> bool:
    return PYTHON.exists()


def start_early(*, compiled: bool = False) -> None:
    """Start the server without waiting for it (idempotent; nothing where vLLM is not installed
    or LM_WORKER_TEST_VLLM_URL names another). Eager mode unless ``compiled``: it starts in under
    a minute instead of two to three (vLLM compiles its graphs again at every start on the CPU)
    and decodes about a third slower, which no test measures."""
    global _server, _url, _log
    os.environ.setdefault(API_KEY_ENV, API_KEY)
    if _server is not None or not installed() or os.environ.get("LM_WORKER_TEST_VLLM_URL"):
        return
    from worker.backends.transformers.shipped import converted_path
    from worker.data_dir import default_data_dir

    model = converted_path(default_data_dir())  # converted once, shared with the worker's own loads
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _log = Path(tempfile.mkdtemp(prefix="lm-worker-vllm-")) / "server.log"
    with open(_log, "wb") as out:
        _server = subprocess.Popen(
            [
                str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", "4096", "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(TOOLS_TEMPLATE),
                # prefix caching in blocks of 32 positions (the CPU default is 128)
                "--block-size", "32", "--api-key", os.environ[API_KEY_ENV],
                *([] if compiled else ["--enforce-eager"]),
            ],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_own_group_dying_with_us,
            # 1 GiB of KV cache is plenty; no usage reports (the machine has no way out anyway); and
            # not the tests' one-thread OpenMP setting, which would leave vLLM one core
            env={
                **{k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
                "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            },
        )
    _url = f"http://127.0.0.1:{port}/v1"


def ready_url() -> str:
    """The server's base_url once it answers (started now if it was not)."""
    start_early()
    assert _server is not None and _url is not None and _log is not None
    deadline = time.monotonic() + READY_WITHIN_S
    health = _url.removesuffix("/v1") + "/health"  # open without the API key
    while True:
        try:
            with urllib.request.urlopen(health, timeout=2) as answer:
                answer.read()
            return _url
        except OSError:
            if _server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start; the end of its log ({_log}):\n{_log.read_text()[-4000:]}")
            time.sleep(1)


def _own_group_dying_with_us() -> None:
    """In the child: a process group of its own (stop() ends vLLM's processes together), and
    SIGTERM when the test process dies without calling stop() (a killed pytest)."""
    import ctypes

    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop() -> None:
    global _server
    if _server is None:
        return
    server, _server = _server, None
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    except ProcessLookupError:
        pass
