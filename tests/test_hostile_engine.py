"""A hostile server behind the openai backend (issue 47, fourth round): each case through a real
worker against a small HTTP server on 127.0.0.1 whose answers the test scripts byte by byte
(trickled, never ended, oversized, malformed, quoting the API key). Whatever the server does,
the worker answers each request precisely and in bounded time, passes on only what the
protocol promises, never lets the key out, and keeps serving."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from worker.host import Host, WorkerError

Answer = Callable[["Request", socket.socket], None]
MODELS = {"data": [{"id": "served-model", "max_model_len": 2048}]}
FIRST_EVENT = {"choices": [{"index": 0, "text": "Hi", "token_ids": [7], "finish_reason": None}], "prompt_token_ids": [1, 2, 3]}
LAST_EVENT = {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


class Request(msgspec.Struct):
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class Scripted:
    """An HTTP server whose answer to each path is a function writing raw bytes to the socket;
    every connection on a thread of its own, all of them ended when the test ends."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/v1"
        self.stopped = threading.Event()
        self.requests: list[Request] = []
        self.answers: dict[str, Answer] = {"/v1/models": json_answer(MODELS), "/v1/completions": events(FIRST_EVENT, LAST_EVENT)}
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self._open.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                if not (part := sock.recv(65536)):
                    return
                head += part
            head, _, body = head.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = dict(line.split(": ", 1) for line in lines[1:])
            while len(body) < int(headers.get("Content-Length", 0)):
                body += sock.recv(65536)
            request = Request(method, path, headers, body)
            self.requests.append(request)
            self.answers.get(path, json_answer({"detail": "Not Found"}, 404))(request, sock)
        except OSError:
            pass  # the worker let go of the connection
        finally:
            sock.close()

    def pause(self, seconds: float) -> None:
        """Sleep in an answer, but no longer than the test."""
        self.stopped.wait(seconds)

    def close(self) -> None:
        self.stopped.set()
        self._listener.close()
        for sock in self._open:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def http_head(status: int, content_type: str = "application/json", length: int | None = None) -> bytes:
    head = f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nConnection: close\r\n"
    return (head + (f"Content-Length: {length}\r\n" if length is not None else "") + "\r\n").encode()


def json_answer(body: object, status: int = 200) -> Answer:
    data = json.dumps(body).encode()
    return lambda request, sock: sock.sendall(http_head(status, length=len(data)) + data)


def events(*sent: object, done: bool = True) -> Answer:
    data = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in sent)
    return lambda request, sock: sock.sendall(http_head(200, "text/event-stream") + data + (b"data: [DONE]\n\n" if done else b""))


@pytest.fixture
def server() -> Iterator[Scripted]:
    scripted = Scripted()
    yield scripted
    scripted.close()


async def until(condition: Callable[[], bool], timeout: float = 10) -> None:
    """Wait for what the server sees (Host.wait_until checks as messages arrive)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def error_of(host: Host, method: str, params: dict, timeout: float = 30) -> WorkerError:
    with pytest.raises(WorkerError) as raised:
        await host.call(method, params, timeout=timeout)
    return raised.value


async def loaded(spawn_worker, server: Scripted, **load) -> Host:
    host = await spawn_worker()
    await host.call("load", {"backend": "openai", "base_url": server.url, **load})
    return host


# --- item 5: an event that never ends -----------------------------------------------------------------


async def test_an_event_that_never_ends_is_refused_past_its_bound_in_size(spawn_worker, server: Scripted):
    """Data lines of a megabyte each, without the blank line that ends an event: every one was kept."""

    def endless(request: Request, sock: socket.socket) -> None:
        sock.sendall(http_head(200, "text/event-stream"))
        line = b"data: " + b"x" * (1 << 20) + b"\n"
        while not server.stopped.is_set():
            sock.sendall(line)

    host = await loaded(spawn_worker, server)
    server.answers["/v1/completions"] = endless
    started = time.perf_counter()
    error = await error_of(host, "generate", {"prompt": "x", "max_tokens": 4})
    assert (error.code, error.kind) == (-32017, "engine_error")
    assert "an event of more than 16777216 bytes" in error.message
    assert time.perf_counter() - started < 10
    server.answers["/v1/completions"] = events(FIRST_EVENT, LAST_EVENT)
    assert (await host.call("generate", {"prompt": "x", "max_tokens": 4}))["text"] == "Hi"


async def test_an_event_trickled_line_by_line_is_refused_once_it_takes_longer_than_a_stall(spawn_worker, server: Scripted):
    def trickled(request: Request, sock: socket.socket) -> None:
        sock.sendall(http_head(200, "text/event-stream") + b"data: " + json.dumps(FIRST_EVENT).encode() + b"\n\n")
        while not server.stopped.is_set():  # each line well within a stall; the event never whole
            sock.sendall(b"data: x\n")
            server.pause(0.1)

    host = await loaded(spawn_worker, server, stall_timeout_s=0.8)
    server.answers["/v1/completions"] = trickled
    started = time.perf_counter()
    error = await error_of(host, "generate", {"prompt": "x", "max_tokens": 4})
    assert (error.code, error.kind) == (-32018, "engine_stalled")
    assert "not whole within 0.8 s of its first byte" in error.message
    assert time.perf_counter() - started < 5


# --- item 6: answers trickled a byte at a time, and cancels of the calls waiting for them ----------


def trickle(server: Scripted, body: object, every_s: float = 0.1) -> Answer:
    """A JSON answer sent a byte at a time: each byte within a stall, the whole never."""
    data = json.dumps(body).encode()

    def answer(request: Request, sock: socket.socket) -> None:
        for byte in http_head(200, length=len(data)) + data:
            if server.stopped.is_set():
                return
            sock.sendall(bytes([byte]))
            server.pause(every_s)

    return answer


@pytest.mark.parametrize("method", ["load", "tokenize", "detokenize", "render"])
async def test_an_answer_trickled_a_byte_at_a_time_ends_as_stalled_once_it_takes_longer_than_a_stall(
    spawn_worker, server: Scripted, method: str
):
    host = await loaded(spawn_worker, server, stall_timeout_s=0.8)
    server.answers |= {
        "/v1/models": trickle(server, MODELS),
        "/tokenize": trickle(server, {"tokens": [1, 2]}),
        "/detokenize": trickle(server, {"prompt": "hi"}),
    }
    params = {
        "load": {"backend": "openai", "base_url": server.url, "stall_timeout_s": 0.8},
        "tokenize": {"text": "hi"},
        "detokenize": {"tokens": [1, 2]},
        "render": {"messages": [{"role": "user", "content": "hi"}]},
    }[method]
    started = time.perf_counter()
    error = await error_of(host, method, params)
    assert (error.code, error.kind) == (-32018, "engine_stalled"), error.message
    assert "within 0.8 s" in error.message
    assert time.perf_counter() - started < 3


def held(server: Scripted) -> Answer:
    """Reads the request and answers nothing until the test ends."""
    return lambda request, sock: server.pause(60)


@pytest.mark.parametrize("method", ["load", "tokenize", "render"])
async def test_a_call_waiting_on_the_server_is_cancelled_and_answers_at_once(spawn_worker, server: Scripted, method: str):
    host = await loaded(spawn_worker, server)  # stall_timeout_s 120: only a cancel ends the wait
    server.answers |= {"/v1/models": held(server), "/tokenize": held(server)}
    params = {
        "load": {"backend": "openai", "base_url": server.url},
        "tokenize": {"text": "hi"},
        "render": {"messages": [{"role": "user", "content": "hi"}]},
    }[method]
    before = len(server.requests)
    msg_id, waiting = host.start(method, params)
    await until(lambda: len(server.requests) > before)
    started = time.perf_counter()
    assert await host.call("cancel", {"id": msg_id}) == {"cancelled": True, "state": "running"}
    answer = await asyncio.wait_for(waiting, 5)
    assert (answer["error"]["code"], answer["error"]["data"]["kind"]) == (-32800, "request_cancelled")
    assert time.perf_counter() - started < 1
    server.answers |= {"/v1/models": json_answer(MODELS), "/tokenize": json_answer({"tokens": [5]})}
    if method == "load":
        await host.call("load", {"backend": "openai", "base_url": server.url})
    assert (await host.call("tokenize", {"text": "hi"}))["tokens"] == [5]


async def test_an_answer_past_its_bound_in_size_is_an_engine_error(spawn_worker, server: Scripted, monkeypatch):
    from worker.backends.openai import engine

    monkeypatch.setattr(engine, "MAX_BODY_BYTES", 1000)
    host = await loaded(spawn_worker, server)
    server.answers["/tokenize"] = json_answer({"tokens": list(range(1000))})
    error = await error_of(host, "tokenize", {"text": "hi"})
    assert (error.code, error.kind) == (-32017, "engine_error") and "more than 1000 bytes" in error.message


# --- item 16: a server that never sends its status line ------------------------------------------------


@pytest.mark.parametrize("method", ["load", "generate"])
async def test_a_server_that_takes_the_connection_but_sends_no_status_line_is_stalled(
    spawn_worker, server: Scripted, method: str
):
    host = await loaded(spawn_worker, server, stall_timeout_s=0.5)
    server.answers |= {"/v1/models": held(server), "/v1/completions": held(server)}
    params = {"backend": "openai", "base_url": server.url, "stall_timeout_s": 0.5} if method == "load" else {"prompt": "x"}
    error = await error_of(host, method, params)
    assert (error.code, error.kind) == (-32018, "engine_stalled"), error.message
    assert "sent no answer within 0.5 s" in error.message


# --- item 13: the API key, wherever a server quotes it ---------------------------------------------------

KEY = "sk-hostile-" + "k3y" * 8


def key_forms() -> list[str]:
    """The key as a server may echo it: as is, in its header, base64-encoded (either alphabet)."""
    encoded = [coder(text.encode()).decode() for text in (KEY, f"Bearer {KEY}", f"Authorization: Bearer {KEY}")
               for coder in (base64.b64encode, base64.urlsafe_b64encode)]
    return [KEY, *encoded, *(e.rstrip("=") for e in encoded)]


def echoing(status: int, *, json_body: bool = True) -> Answer:
    """An error answer that quotes the request's Authorization header, plain and base64-encoded."""

    def answer(request: Request, sock: socket.socket) -> None:
        header = request.headers["Authorization"]
        said = f"{header} (as received: {base64.b64encode(header.encode()).decode()})"
        data = json.dumps({"error": {"message": said, "param": None}}).encode() if json_body else said.encode()
        sock.sendall(http_head(status, length=len(data)) + data)

    return answer


def echoed_in_an_event(request: Request, sock: socket.socket) -> None:
    header = request.headers["Authorization"]
    events(FIRST_EVENT, {"error": {"message": f"refused {header}", "code": 400}}, done=False)(request, sock)


def echoed_in_the_status_line(request: Request, sock: socket.socket) -> None:
    sock.sendall(f"HTTP/1.1 {request.headers['Authorization']}\r\n\r\n".encode())


def echoed_as_model_names(request: Request, sock: socket.socket) -> None:
    json_answer({"data": [{"id": f"model of {request.headers['Authorization']}"}]})(request, sock)


def echoed_among_model_names(request: Request, sock: socket.socket) -> None:
    json_answer({"data": [{"id": KEY}, {"id": base64.b64encode(KEY.encode()).decode()}]})(request, sock)


@pytest.mark.parametrize(
    ("path", "answer", "method", "params"),
    [
        ("/v1/models", echoing(401), "load", None),
        ("/v1/completions", echoing(400), "generate", {"prompt": "x"}),
        ("/v1/completions", echoing(500, json_body=False), "generate", {"prompt": "x"}),
        ("/tokenize", echoing(400), "tokenize", {"text": "x"}),
        ("/v1/completions", echoed_in_an_event, "generate", {"prompt": "x"}),
        ("/v1/completions", echoed_in_the_status_line, "generate", {"prompt": "x"}),
        ("/v1/models", echoed_as_model_names, "load", None),
        ("/v1/models", echoed_among_model_names, "load", {"model": "other"}),
    ],
    ids=["401 body", "400 body", "500 body", "tokenize's 400 body", "error event", "status line", "model name", "names not served"],
)
async def test_the_api_key_a_server_quotes_never_reaches_the_host_or_the_transcript(
    spawn_worker, server: Scripted, monkeypatch, tmp_path: Path, path: str, answer: Answer, method: str, params
):
    monkeypatch.setenv("LM_WORKER_HOSTILE_KEY", KEY)
    transcript = tmp_path / "session.jsonl"
    host = await spawn_worker("--record", str(transcript))
    load = {"backend": "openai", "base_url": server.url, "api_key_env": "LM_WORKER_HOSTILE_KEY"}
    if method != "load":
        await host.call("load", load)
    server.answers[path] = answer
    _, done = host.start(method, {**load, **(params or {})} if method == "load" else params)
    answered = await asyncio.wait_for(done, 30)
    await host.close()
    assert server.requests[-1].headers["Authorization"] == f"Bearer {KEY}", "the key went to the server"
    seen = json.dumps(host.messages) + transcript.read_text()
    assert "[the API key]" in seen, answered
    assert not [form for form in key_forms() if form in seen], answered


# --- item 14: a server listing a million models -------------------------------------------------------


async def test_a_model_not_served_among_a_million_is_refused_naming_a_few_and_the_count(spawn_worker, server: Scripted):
    names = b",".join(b'{"id":"model-%d-%s"}' % (i, b"x" * 200 if i == 0 else b"") for i in range(1_000_000))
    body = b'{"data":[' + names + b"]}"
    server.answers["/v1/models"] = lambda request, sock: sock.sendall(http_head(200, length=len(body)) + body)
    host = await spawn_worker()
    error = await error_of(host, "load", {"backend": "openai", "base_url": server.url, "model": "other"})
    assert (error.code, error.kind, error.data["field"]) == (-32015, "model_not_served", "params.model")
    assert "1000000 models, among them 'model-0-xxx" in error.message and "'model-4-'" in error.message
    assert len(error.message) < 1000, len(error.message)


# --- item 15: what a server answers is checked against what the protocol promises ------------------------


@pytest.mark.parametrize(
    "answer",
    [{"tokens": ["1"]}, {"tokens": [1.5]}, {"tokens": [-1]}, {"tokens": [2**70]}, {"tokens": None}, {"count": 1}],
    ids=["string", "float", "negative", "2^70", "null", "missing"],
)
async def test_token_ids_the_protocol_cannot_pass_on_are_an_engine_error_naming_them(spawn_worker, server: Scripted, answer):
    host = await loaded(spawn_worker, server)
    server.answers["/tokenize"] = json_answer(answer)
    for method, params in [("tokenize", {"text": "x"}), ("render", {"messages": [{"role": "user", "content": "x"}]})]:
        error = await error_of(host, method, params)
        assert (error.code, error.kind) == (-32017, "engine_error"), error.message
        assert "$.tokens" in error.message or "`tokens`" in error.message, error.message
    server.answers["/detokenize"] = json_answer({"prompt": 5})
    error = await error_of(host, "detokenize", {"tokens": [1]})
    assert error.kind == "engine_error" and "$.prompt" in error.message


@pytest.mark.parametrize("length", [-5, 2**70])
async def test_a_context_length_the_protocol_cannot_pass_on_is_an_engine_error_naming_it(spawn_worker, server: Scripted, length):
    server.answers["/v1/models"] = json_answer({"data": [{"id": "served-model", "max_model_len": length}]})
    host = await spawn_worker()
    error = await error_of(host, "load", {"backend": "openai", "base_url": server.url})
    assert (error.code, error.kind) == (-32017, "engine_error") and "max_model_len" in error.message


@pytest.mark.parametrize(
    ("usage", "said"),
    [({"prompt_tokens": -3, "completion_tokens": 1}, "$.usage.prompt_tokens"),
     ({"prompt_tokens": 3, "completion_tokens": -1}, "$.usage.completion_tokens"),
     ({"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}}, "4 cached tokens"),
     ({"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": -1}}, "cached_tokens")],
    ids=["negative prompt", "negative completion", "more cached than the prompt", "negative cached"],
)
async def test_usage_the_protocol_cannot_pass_on_is_an_engine_error_naming_it(spawn_worker, server: Scripted, usage, said):
    host = await loaded(spawn_worker, server)
    server.answers["/v1/completions"] = events(FIRST_EVENT, {**LAST_EVENT, "usage": usage})
    error = await error_of(host, "generate", {"prompt": "x", "max_tokens": 4})
    assert (error.code, error.kind) == (-32017, "engine_error") and said in error.message, error.message


async def test_event_token_ids_the_protocol_cannot_pass_on_are_an_engine_error(spawn_worker, server: Scripted):
    host = await loaded(spawn_worker, server)
    bad = {"choices": [{"index": 0, "text": "Hi", "token_ids": [-7], "finish_reason": None}]}
    server.answers["/v1/completions"] = events(bad, LAST_EVENT)
    error = await error_of(host, "generate", {"prompt": "x", "max_tokens": 1})
    assert error.kind == "engine_error" and "$.choices[0].token_ids[0]" in error.message, error.message


async def test_a_base_url_of_port_0_is_refused_naming_the_field(echo_worker: Host):
    error = await error_of(echo_worker, "load", {"backend": "openai", "base_url": "http://127.0.0.1:0/v1"})
    assert (error.code, error.data["field"]) == (-32602, "params.base_url") and "port 0" in error.message


@pytest.mark.parametrize("prompt", [{"prompt": ""}, {"tokens": []}, {"tokens": [1] * 2048}])
async def test_a_prefill_known_bad_is_refused_without_a_request_to_the_server(spawn_worker, server: Scripted, prompt):
    host = await loaded(spawn_worker, server)
    sent = len(server.requests)
    error = await error_of(host, "prefill", {**prompt, "cache": "auto"})
    field = "params.prompt" if prompt in ({"prompt": ""}, {"tokens": []}) else "params.max_tokens"
    assert (error.data["field"], len(server.requests)) == (field, sent), error.message


# --- the closing round: every field of a streamed event ---------------------------------------------------


def finished(reason: object) -> dict:
    return {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": reason}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


@pytest.mark.parametrize(
    ("sent", "said"),
    [
        ((FIRST_EVENT, finished("banana")), "finish_reason 'banana', which is none of length, stop, tool_calls"),
        ((FIRST_EVENT, finished("")), "finish_reason '', which is none of"),
        ((FIRST_EVENT, finished("abort")), "finish_reason 'abort'"),
        ((FIRST_EVENT, {"choices": [{"index": 1, "text": "X", "token_ids": [8], "finish_reason": None}]}, LAST_EVENT),
         "a choice of index 1 (choices[].index)"),
        (({"choices": [{"index": 10**9, "text": "X", "token_ids": [8], "finish_reason": None}]}, LAST_EVENT),
         "a choice of index 1000000000"),
        (({"choices": [{"index": 0, "text": "Hi", "token_ids": list(range(50)), "finish_reason": None}]}, LAST_EVENT),
         "sent 50 token ids (choices[].token_ids) where max_tokens is 4"),
        ((FIRST_EVENT,), "ended the stream ([DONE]) with no choice finished (no finish_reason)"),
    ],
    ids=["finish-unknown", "finish-empty", "finish-abort", "second-choice", "choice-10^9", "tokens-past-max", "done-unfinished"],
)
async def test_an_event_field_the_protocol_cannot_pass_on_is_an_engine_error_naming_it(spawn_worker, server: Scripted, sent, said):
    """Before: an unknown finish_reason, or none before [DONE], was reported as "stop" with an
    end-of-sequence token that never came, a second choice's text was joined to the first's, and 50 token ids in a delta
    came back from a generate of max_tokens 4."""
    host = await loaded(spawn_worker, server)
    server.answers["/v1/completions"] = events(*sent)
    error = await error_of(host, "generate", {"prompt": "x", "max_tokens": 4})
    assert (error.code, error.kind) == (-32017, "engine_error") and said in error.message, error.message
    server.answers["/v1/completions"] = events(FIRST_EVENT, LAST_EVENT)
    assert (await host.call("generate", {"prompt": "x", "max_tokens": 4}))["text"] == "Hi"


async def test_tool_call_arguments_streamed_without_end_are_refused_past_their_bound(spawn_worker, server: Scripted):
    """Fragments of a call's arguments count for no token: a server sending a megabyte of them an
    event, for ever, grew the worker by 30 MB a second (628 MB in 20 s) until it was stopped."""
    from worker.backends.openai.backend import MAX_CALL_BYTES

    fragment = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "x" * (1 << 20)}}]},
                             "finish_reason": None}]}
    data = b"data: " + json.dumps(fragment).encode() + b"\n\n"

    def endless(request: Request, sock: socket.socket) -> None:
        sock.sendall(http_head(200, "text/event-stream"))
        while not server.stopped.is_set():
            sock.sendall(data)

    host = await loaded(spawn_worker, server)
    server.answers["/v1/chat/completions"] = endless
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    started = time.perf_counter()
    error = await error_of(host, "generate", {"messages": [{"role": "user", "content": "x"}], "tools": tools, "max_tokens": 8})
    assert (error.code, error.kind) == (-32017, "engine_error")
    assert f"tool calls of more than {MAX_CALL_BYTES} characters" in error.message, error.message
    assert time.perf_counter() - started < 10
    assert await host.call("capabilities")


def test_protocol_md_states_the_stream_s_checks_as_the_code_has_them():
    from worker.backends.openai.backend import FINISH_REASONS, MAX_CALL_BYTES

    text = " ".join((Path(__file__).parent.parent / "docs" / "PROTOCOL.md").read_text().split())
    assert f"tool calls it streams at most {MAX_CALL_BYTES:,} characters of names and arguments" in text
    assert FINISH_REASONS == {"stop", "length", "tool_calls"}
    assert "its `finish_reason` one of `stop`, `length` and `tool_calls`" in text
