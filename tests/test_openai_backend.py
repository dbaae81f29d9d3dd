"""The openai backend through real workers: faults against small real HTTP servers that
misbehave on purpose, and the protocol's behaviour against a real vLLM server (the fixture
``vllm_url``)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests import engine_server
from worker.host import Host, WorkerError


class Misbehaving(BaseHTTPRequestHandler):
    """A server speaking just enough of the API to fail in the way ``server.mode`` says."""

    protocol_version = "HTTP/1.1"
    STATUS_MODES = {
        "busy": (429, "Too many requests"),
        "refuse_param": (400, "temperature must be in [0, 2], got 100.0."),
        "unavailable": (503, "Service Unavailable"),
        "server_error": (500, "Internal Server Error"),
    }

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.server.seen.append(dict(self.headers))  # type: ignore[attr-defined]
        mode = self.server.mode  # type: ignore[attr-defined]
        if mode == "garbage":
            self.wfile.write(b"this is not HTTP at all\r\n\r\n")
            return
        if mode == "refuse_key":
            self._json(401, {"error": {"message": "Unauthorized"}})
            return
        if mode == "no_api":  # a web server, not an OpenAI API, at base_url
            self._json(404, {"detail": "Not Found"})
            return
        self._json(200, {"data": [{"id": "served-model", "max_model_len": 2048}]})

    def do_POST(self) -> None:
        self.server.seen.append(dict(self.headers))  # type: ignore[attr-defined]
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        mode = self.server.mode  # type: ignore[attr-defined]
        if mode in self.STATUS_MODES:
            status, message = self.STATUS_MODES[mode]
            self._json(status, {"error": {"message": message, "param": message.split()[0]}})
            return
        if mode == "slow_first":  # the first request's answer is slow to begin, the others' are not
            with self.server.lock:  # type: ignore[attr-defined]
                first, self.server.mode = True, "ok"  # type: ignore[attr-defined]
            if first:
                time.sleep(1.5)
        if self.path in ("/tokenize", "/detokenize"):  # a server without vLLM's tokenizer endpoints
            self._json(404, {"detail": "Not Found"})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        event = {"choices": [{"index": 0, "text": "Hi", "token_ids": [7], "finish_reason": None}],
                 "prompt_token_ids": [1, 2, 3]}
        self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        self.wfile.flush()
        if mode == "stall":
            time.sleep(3)
        elif mode == "not_json":
            self.wfile.write(b"data: {not json\n\n")
        # "drop": the connection closes before [DONE], as when the server restarts mid-stream
        self.close_connection = True


@pytest.fixture
def misbehaving() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    server.mode = "ok"  # type: ignore[attr-defined]
    server.seen = []  # type: ignore[attr-defined]
    server.lock = threading.Lock()  # type: ignore[attr-defined]
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def url_of(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def error_of(host: Host, method: str, params: dict) -> dict:
    with pytest.raises(WorkerError) as raised:
        await host.call(method, params)
    error = raised.value
    return {"code": error.code, "message": error.message, "data": error.data}


async def test_load_names_each_fault_by_its_own_kind_and_the_worker_keeps_serving(spawn_worker, misbehaving):
    host = await spawn_worker()
    nothing = f"http://127.0.0.1:{free_port()}/v1"
    assert (await error_of(host, "load", {"backend": "openai", "base_url": nothing}))["data"]["kind"] == "engine_unreachable"
    misbehaving.mode = "garbage"
    garbage = await error_of(host, "load", {"backend": "openai", "base_url": url_of(misbehaving)})
    assert garbage["data"]["kind"] == "engine_unreachable", garbage  # no HTTP answer at all
    misbehaving.mode = "refuse_key"
    refused = await error_of(host, "load", {"backend": "openai", "base_url": url_of(misbehaving)})
    assert (refused["code"], refused["data"]["kind"]) == (-32014, "engine_auth_failed")
    misbehaving.mode = "ok"
    missing = await error_of(host, "load", {"backend": "openai", "base_url": url_of(misbehaving), "model": "other"})
    assert missing["data"]["kind"] == "model_not_served" and "'served-model'" in missing["message"]
    unset = await error_of(
        host, "load", {"backend": "openai", "base_url": url_of(misbehaving), "api_key_env": "LM_WORKER_NO_SUCH_KEY"}
    )
    assert unset["data"] == {"kind": "invalid_params", "field": "params.api_key_env", "method": "load"}
    wrong = await error_of(host, "load", {"backend": "openai", "base_url": url_of(misbehaving), "quantization": "int8"})
    assert wrong["data"]["field"] == "params.quantization"
    info = await host.call("load", {"backend": "openai", "base_url": url_of(misbehaving)})
    assert (info["model"], info["context_length"]) == ("served-model", 2048), "default: the one model served"


@pytest.mark.parametrize(
    ("base_url", "said"),
    [
        ("http://[::1/v1", "is not a valid URL"),
        ("http://127.0.0.1:99999/v1", "is not a valid URL"),
        ("http://127.0.0.1:8000/v1\r\nX-Injected: 1", "control character"),
        ("http://127.0.0.1:8000/v 1", "a space"),
        ("http://user:secret@127.0.0.1:8000/v1", "holds credentials"),
        ("http://127.0.0.1:8000/v1?key=secret", "query or fragment"),
        ("ftp://127.0.0.1:8000/v1", "not an http(s) URL"),
    ],
)
async def test_a_base_url_that_is_not_a_plain_api_root_is_refused_naming_the_field(echo_worker: Host, base_url, said):
    error = await error_of(echo_worker, "load", {"backend": "openai", "base_url": base_url})
    assert (error["code"], error["data"]["field"]) == (-32602, "params.base_url"), error
    assert said in error["message"]
    assert (await echo_worker.call("tokenize", {"text": "ok"}))["tokens"], "the echo model is still loaded"


async def test_a_base_url_without_an_api_behind_it_is_refused_naming_the_field(spawn_worker, misbehaving):
    host = await spawn_worker()
    misbehaving.mode = "no_api"
    error = await error_of(host, "load", {"backend": "openai", "base_url": url_of(misbehaving)})
    assert (error["code"], error["data"]["field"]) == (-32602, "params.base_url"), error
    assert "usually ends in /v1" in error["message"]


async def test_the_api_key_goes_to_the_server_and_nowhere_else(spawn_worker, misbehaving, tmp_path: Path):
    secret = "sk-test-" + "5ecret" * 4
    transcript = tmp_path / "session.jsonl"
    host = await spawn_worker("--record", str(transcript), env={"LM_WORKER_TEST_KEY": secret})
    await host.call("load", {"backend": "openai", "base_url": url_of(misbehaving), "api_key_env": "LM_WORKER_TEST_KEY"})
    await host.call("generate", {"prompt": "x", "max_tokens": 1})
    assert all(headers.get("Authorization") == f"Bearer {secret}" for headers in misbehaving.seen)
    await host.close()
    assert secret not in transcript.read_text() and secret.encode() not in host.stderr
    assert "LM_WORKER_TEST_KEY" in transcript.read_text(), "the variable's name is what is recorded"


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        ("drop", "engine_error"), ("not_json", "engine_error"), ("stall", "engine_stalled"),
        ("busy", "engine_overloaded"), ("unavailable", "engine_overloaded"), ("server_error", "engine_error"),
    ],
)
async def test_a_fault_mid_request_ends_that_request_with_its_kind_and_the_next_works(spawn_worker, misbehaving, mode, kind):
    host = await spawn_worker()
    await host.call("load", {"backend": "openai", "base_url": url_of(misbehaving), "stall_timeout_s": 0.5})
    misbehaving.mode = mode
    error = await error_of(host, "generate", {"prompt": "x", "max_tokens": 5})
    assert error["data"]["kind"] == kind, error
    assert "127.0.0.1" in error["message"]
    misbehaving.mode = "ok"
    with pytest.raises(WorkerError) as dropped:  # the fake server always drops after one event
        await host.call("generate", {"prompt": "x", "max_tokens": 5})
    assert dropped.value.kind == "engine_error"
    result = await host.call("generate", {"prompt": "x", "max_tokens": 1})
    assert (result["text"], result["tokens"], result["usage"]["prompt_tokens"]) == ("Hi", [7], 3)


async def test_what_can_be_told_before_the_engine_counts_is_refused_as_a_local_model_refuses_it(spawn_worker, misbehaving):
    """The fake server serves a context of 2048 tokens; none of these reaches it."""
    host = await spawn_worker()
    await host.call("load", {"backend": "openai", "base_url": url_of(misbehaving)})
    sent = len(misbehaving.seen)
    for params, kind, field in [
        ({"prompt": "x", "max_tokens": 2048}, "context_overflow", "params.max_tokens"),
        ({"tokens": [5] * 2000, "max_tokens": 49}, "context_overflow", "params.max_tokens"),
        ({"prompt": "", "max_tokens": 4}, "invalid_params", "params.prompt"),
        ({"tokens": [], "max_tokens": 4}, "invalid_params", "params.prompt"),
    ]:
        error = await error_of(host, "generate", params)
        assert (error["data"]["kind"], error["data"]["field"]) == (kind, field), (params, error)
    assert len(misbehaving.seen) == sent, "refused without a round trip"
    assert (await host.call("generate", {"tokens": [5] * 2000, "max_tokens": 1}))["tokens"] == [7]


async def test_a_server_slow_to_answer_one_request_does_not_hold_up_the_next(spawn_worker, misbehaving):
    host = await spawn_worker()
    await host.call("load", {"backend": "openai", "base_url": url_of(misbehaving)})
    misbehaving.mode = "slow_first"
    _, slow = host.start("generate", {"prompt": "x", "max_tokens": 1})
    await asyncio.sleep(0.2)
    started = time.perf_counter()
    quick = await host.call("generate", {"prompt": "y", "max_tokens": 1})
    assert time.perf_counter() - started < 1.0 and not slow.done(), "the second waited for the first's answer"
    assert quick["tokens"] == [7] and (await slow)["result"]["tokens"] == [7]


def test_a_step_waiting_on_quiet_streams_returns_when_the_lane_is_woken(misbehaving, tmp_path, monkeypatch):
    """The model lane waits in the engine's step while streams are quiet; a new request or a
    cancel wakes it (the session calls wake), instead of the lane going round every few ms."""
    from protocol.methods import GenerateParams, LoadParams
    from worker.backends.openai import backend

    monkeypatch.setattr(backend, "STEP_WAIT_S", 30.0)  # a step that is not woken waits this long
    model = backend.OpenAIBackend().load(
        LoadParams(backend="openai", model="served-model", base_url=url_of(misbehaving)), data_dir=tmp_path
    )
    misbehaving.mode = "stall"  # one event, then nothing for 3 s
    decoding = model.submit(GenerateParams(prompt="x", max_tokens=5))
    model.step([decoding])
    while not decoding.has_next():
        model.step([decoding])
    decoding.next_piece()
    threading.Timer(0.2, model.wake).start()
    started = time.monotonic()
    model.step([decoding])
    assert time.monotonic() - started < 2.0 and decoding.end is None, "the step waited for the stream, not the wake"
    decoding.close()


def test_the_session_wakes_the_model_at_every_change_its_running_requests_must_see():
    from protocol.methods import CancelParams, GenerateParams
    from worker.locked_session import LockedSession

    wakes = []
    session = LockedSession(max_batch=4, wake_model=lambda: wakes.append(1))
    job = session.receive(1, "generate", GenerateParams(prompt="x"), 0.0)
    assert job is not None and len(wakes) == 1, "a new request"
    session.ack(1, 0)
    assert len(wakes) == 2, "an ack (a stream held for its window may go on)"
    session.cancel(1)
    assert len(wakes) == 3, "a cancel"
    session.wake()
    assert len(wakes) == 4, "a task made off the model thread"
    session.end(cancel=True)
    assert len(wakes) == 5, "the end of input"


async def test_a_value_the_server_refuses_names_the_field_the_server_blames(spawn_worker, misbehaving):
    host = await spawn_worker()
    await host.call("load", {"backend": "openai", "base_url": url_of(misbehaving)})
    misbehaving.mode = "refuse_param"
    error = await error_of(host, "generate", {"prompt": "x", "max_tokens": 2, "temperature": 100.0})
    assert (error["code"], error["data"]["field"]) == (-32602, "params.temperature"), error
    assert "temperature must be in [0, 2]" in error["message"]


async def test_named_caches_drafts_and_tools_without_messages_are_refused_with_the_reason(spawn_worker, misbehaving):
    host = await spawn_worker()
    await host.call("load", {"backend": "openai", "base_url": url_of(misbehaving)})
    named = await error_of(host, "generate", {"prompt": "x", "cache": "mine"})
    assert named["data"]["kind"] == "unsupported" and "auto" in named["message"]
    draft = await error_of(host, "generate", {"prompt": "x", "draft": {"method": "prompt_lookup"}})
    assert draft["data"]["field"] == "params.draft"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    tools = await error_of(host, "generate", {"prompt": "x", "tools": [tool]})
    assert tools["data"]["field"] == "params.tools"
    for params, field in (({"cache": "mine"}, "params.cache"), ({"cache": "auto", "base": "mine"}, "params.base")):
        refused = await error_of(host, "prefill", {"prompt": "x", **params})
        assert (refused["data"]["kind"], refused["data"]["field"]) == ("unsupported", field)


# --- against a real vLLM server -----------------------------------------------------------


def metric(base_url: str, name: str) -> float:
    root = base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def engine_load(url: str) -> dict:
    return {"backend": "openai", "base_url": url, "model": "smollm2", "api_key_env": engine_server.API_KEY_ENV}


@pytest.fixture
async def engine_worker(spawn_worker, vllm_url: str) -> Host:
    host = await spawn_worker()
    await host.call("load", engine_load(vllm_url))
    return host


@pytest.mark.slow
async def test_the_real_server_refuses_a_wrong_key_as_engine_auth_failed(spawn_worker, vllm_url: str, monkeypatch):
    monkeypatch.setenv("LM_WORKER_WRONG_KEY", "not-the-key")
    host = await spawn_worker()
    refused = await error_of(host, "load", {**engine_load(vllm_url), "api_key_env": "LM_WORKER_WRONG_KEY"})
    assert (refused["data"]["kind"], refused["data"]["field"]) == ("engine_auth_failed", "params.api_key_env")
    assert "Unauthorized" in refused["message"]


@pytest.mark.slow
async def test_streamed_chunks_add_up_to_the_result_with_exact_counts(engine_worker: Host):
    host = engine_worker
    counted = await host.call("tokenize", {"text": "The history of the city of Rome begins"})
    request_id, answer = host.start("generate", {"prompt": "The history of the city of Rome begins", "max_tokens": 24})
    result = (await answer)["result"]
    chunks = host.chunks[request_id]
    assert "".join(c["text"] for c in chunks) == result["text"]
    assert [t for c in chunks for t in c["tokens"]] == result["tokens"]
    assert chunks[-1]["generated_tokens"] == result["usage"]["completion_tokens"] == len(result["tokens"]) == 24
    assert result["usage"]["prompt_tokens"] == chunks[-1]["prompt_tokens"] == counted["count"]
    assert result["finish_reason"] == "length"


@pytest.mark.slow
async def test_a_stop_string_ends_the_text_before_it_as_on_a_local_model(engine_worker: Host):
    free = await engine_worker.call("generate", {"prompt": "Count: 1, 2, 3, 4,", "max_tokens": 30})
    assert ", 7" in free["text"], free["text"]
    stopped = await engine_worker.call("generate", {"prompt": "Count: 1, 2, 3, 4,", "max_tokens": 30, "stop": [", 7"]})
    assert stopped["text"] == free["text"][: free["text"].index(", 7")]
    assert stopped["stop_reason"] == {"kind": "stop_string", "token": None, "stop": ", 7"}


@pytest.mark.slow
async def test_cancel_stops_the_engine_within_a_second(engine_worker: Host, vllm_url: str):
    host = engine_worker
    request_id, answer = host.start("generate", {"prompt": "Once upon a time", "max_tokens": 2000})
    await host.wait_until(lambda: len(host.chunks[request_id]) >= 3)
    assert metric(vllm_url, "vllm:num_requests_running") >= 1
    await host.call("cancel", {"id": request_id})
    cancelled_at = time.monotonic()
    assert (await answer)["result"]["finish_reason"] == "cancelled"
    while metric(vllm_url, "vllm:num_requests_running") > 0:
        assert time.monotonic() - cancelled_at < 1.0, "the engine still runs the cancelled request"
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_a_repeated_long_prefix_is_read_from_the_engines_cache(engine_worker: Host):
    prefix = " ".join(f"Item {i} is on shelf {i % 7}." for i in range(120))
    questions = [prefix + " Where is item 3?", prefix + " Where is item 9?"]
    first, second = [await engine_worker.call("generate", {"prompt": q, "max_tokens": 4, "cache": "auto"}) for q in questions]
    ids = [(await engine_worker.call("tokenize", {"text": q}))["tokens"] for q in questions]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert shared > 1000
    # The engine caches whole blocks of positions (64 on vLLM's CPU backend): all but the last one shared.
    assert shared - 64 < second["usage"]["cache_read_tokens"] <= shared
    assert second["cache"]["reused_tokens"] == second["usage"]["cache_read_tokens"]
    assert second["usage"]["prompt_tokens"] == len(ids[1]) and first["usage"]["prompt_tokens"] == len(ids[0])


@pytest.mark.slow
async def test_an_auto_prefill_warms_the_engines_cache_for_the_generate_after_it(engine_worker: Host):
    prefix = " ".join(f"Gate {i} opens at {i % 12} o'clock." for i in range(100))
    warm = await engine_worker.call("prefill", {"prompt": prefix, "cache": "auto"})
    assert (warm["cache"], warm["bytes"]) == ("auto", 0) and warm["token_count"] > 1000
    assert warm["cache_read_tokens"] + warm["cache_write_tokens"] == warm["token_count"]
    result = await engine_worker.call("generate", {"prompt": prefix + " When does gate 5 open?", "max_tokens": 4})
    assert result["usage"]["cache_read_tokens"] > warm["token_count"] - 64


@pytest.mark.slow
async def test_concurrent_requests_run_together_on_the_engine_bounded_by_max_batch(spawn_worker, vllm_url: str):
    host = await spawn_worker("--max-batch", "2")
    await host.call("load", engine_load(vllm_url))
    counting = [f"Count from {n} upwards: {n}, {n + 1}," for n in range(4)]
    pending = [host.start("generate", {"prompt": prompt, "max_tokens": 48}) for prompt in counting]
    running: list[float] = []
    while not all(future.done() for _, future in pending):
        running.append(metric(vllm_url, "vllm:num_requests_running"))
        await asyncio.sleep(0.05)
    results = [(await future)["result"] for _, future in pending]
    assert max(running) == 2, "two at once on the engine: not one after another, not past --max-batch"
    assert all(r["finish_reason"] == "length" for r in results), [r["text"] for r in results]
    # (Each stream's tokens may differ from the same request alone: the engine's batched
    # arithmetic is not the local backend's, whose streams in a batch equal themselves alone.)


@pytest.mark.slow
async def test_a_prompt_past_the_context_is_refused_as_on_a_local_model(engine_worker: Host):
    for prompt in ({"prompt": "Hello there"}, {"tokens": [1, 2, 3]}, {"messages": [{"role": "user", "content": "Hi"}]}):
        error = await error_of(engine_worker, "generate", {**prompt, "max_tokens": 4095})
        assert (error["data"]["kind"], error["data"]["field"]) == ("context_overflow", "params.max_tokens"), prompt
    assert (await engine_worker.call("generate", {"prompt": "Hello there", "max_tokens": 2}))["usage"]["completion_tokens"] == 2


@pytest.mark.slow
async def test_a_schema_the_engine_refuses_mid_stream_is_invalid_params(engine_worker: Host):
    bad = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(unclosed"}}, "required": ["code"]}
    error = await error_of(engine_worker, "generate", {
        "prompt": "Code:", "max_tokens": 10,
        "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}},
    })
    assert error["data"]["kind"] == "invalid_params" and "server" in error["message"], error
    assert error["data"]["field"] == "params.response_format", error


@pytest.mark.slow
async def test_a_value_the_engine_refuses_is_invalid_params_naming_the_field(engine_worker: Host):
    """vLLM bounds temperature to [0, 2] (the local backend does not) and names its parameter."""
    error = await error_of(engine_worker, "generate", {"prompt": "Hi", "max_tokens": 2, "temperature": 100.0})
    assert (error["data"]["kind"], error["data"]["field"]) == ("invalid_params", "params.temperature"), error


@pytest.mark.slow
async def test_json_schema_output_comes_from_the_engines_structured_output(engine_worker: Host):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
    result = await engine_worker.call(
        "generate",
        {"messages": [{"role": "user", "content": "Name a city."}], "max_tokens": 40,
         "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}},
    )
    assert isinstance(json.loads(result["text"])["city"], str)


class Relay:
    """A TCP relay in front of the real server that can be cut and brought back: to the worker,
    what a server that stops, or restarts, mid-stream looks like."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._server: asyncio.base_events.Server | None = None
        self._links: list[asyncio.StreamWriter] = []
        self.port = free_port()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", self.port)

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._links:
            writer.transport.abort()
        self._links.clear()
        await self._server.wait_closed()

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        self._links += [writer, up_writer]

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


@pytest.mark.slow
async def test_a_server_gone_mid_stream_ends_that_request_and_the_next_works_once_it_is_back(
    spawn_worker, vllm_url: str
):
    relay = Relay(int(vllm_url.rsplit(":", 1)[1].split("/")[0]))
    await relay.start()
    host = await spawn_worker()
    await host.call("load", engine_load(f"http://127.0.0.1:{relay.port}/v1"))
    msg_id, done = host.start("generate", {"prompt": "Once upon a time", "max_tokens": 500})
    await host.wait_until(lambda: len(host.chunks[msg_id]) >= 3)
    await relay.cut()
    failed = await asyncio.wait_for(done, 60)
    assert failed["error"]["data"]["kind"] == "engine_error" and "closed the event stream" in failed["error"]["message"]
    gone = await error_of(host, "generate", {"prompt": "Hello", "max_tokens": 2})
    assert gone["data"]["kind"] == "engine_unreachable"
    await relay.start()
    assert (await host.call("generate", {"prompt": "Hello", "max_tokens": 2}))["usage"]["completion_tokens"] == 2
    await relay.cut()


async def test_text_methods_on_a_server_without_tokenizer_endpoints_are_unsupported_naming_the_endpoint(
    spawn_worker, misbehaving
):
    """Only vLLM serves /tokenize and /detokenize; another OpenAI-compatible server answers 404 there."""
    host = await spawn_worker()
    await host.call("load", {"backend": "openai", "base_url": url_of(misbehaving)})
    for method, params, endpoint in [
        ("tokenize", {"text": "hello"}, "/tokenize"),
        ("detokenize", {"tokens": [1, 2]}, "/detokenize"),
        ("render", {"messages": [{"role": "user", "content": "hi"}]}, "/tokenize"),
    ]:
        error = await error_of(host, method, params)
        assert (error["code"], error["data"]["kind"]) == (-32006, "unsupported"), error
        assert f"no {endpoint} endpoint" in error["message"]
    result = await host.call("generate", {"prompt": "x", "max_tokens": 1})  # generation does not need them
    assert result["tokens"] == [7]
