"""End to end: the real worker as a subprocess, over real pipes, with the echo backend."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from protocol.framing import Framing
from worker.host import REPO_ROOT, Host, WorkerError
from tests.conftest import SpawnWorker, install_plugin

SLOW_LOADING_BACKEND = """
import sys
import time
from worker.backends.echo import EchoBackend

class Slow(EchoBackend):
    name = "slow"
    def load(self, params, *, data_dir):
        print("slow load started", file=sys.stderr, flush=True)
        time.sleep(1.0)
        return super().load(params, data_dir=data_dir)
"""

CAPABILITIES = b'{"jsonrpc":"2.0","id":1,"method":"capabilities"}'


def run_worker(stdin: bytes, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "worker", *args], input=stdin, capture_output=True, cwd=REPO_ROOT, timeout=timeout
    )


def slow_generate(prompt_len: int = 400, delay_ms: float = 20) -> tuple[dict, dict]:
    return {"backend": "echo", "token_delay_ms": delay_ms}, {"prompt": "x" * prompt_len, "max_tokens": prompt_len + 1}


# --- framing and the pipe -----------------------------------------------------------


def test_capabilities_over_ndjson_prints_one_response_line_and_exits_zero_at_eof():
    done = run_worker(CAPABILITIES + b"\n")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and done.stdout.endswith(b"\n")
    response = json.loads(lines[0])
    assert response["jsonrpc"] == "2.0" and response["id"] == 1
    assert response["result"]["protocol_version"] == "1.0"
    assert "generate" in response["result"]["methods"]


def test_content_length_request_gets_content_length_framed_answer():
    done = run_worker(b"Content-Length: %d\r\n\r\n%s" % (len(CAPABILITIES), CAPABILITIES))
    assert done.returncode == 0, done.stderr
    header, _, body = done.stdout.partition(b"\r\n\r\n")
    assert header.startswith(b"Content-Length: ")
    assert int(header.split(b":")[1]) == len(body)
    assert json.loads(body)["result"]["framing"]["replies"] == "lsp"


def test_forced_framing_overrides_the_framing_of_the_first_message():
    done = run_worker(CAPABILITIES + b"\n", "--framing", "lsp")
    assert done.stdout.startswith(b"Content-Length: ")


def test_capabilities_is_answered_without_importing_torch():
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "worker"],
        input=CAPABILITIES + b"\n",
        capture_output=True,
        cwd=REPO_ROOT,
        timeout=30,
    )
    assert json.loads(done.stdout)["result"]["backends"]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.decode().splitlines() if "|" in line]
    assert "msgspec" in " ".join(imported)  # the import log is really there
    assert not [name for name in imported if name.split(".")[0] in ("torch", "transformers", "numpy")]


def test_several_requests_in_one_pipe_write_are_all_answered_in_order_with_drain():
    requests = [
        {"jsonrpc": "2.0", "id": 1, "method": "load", "params": {"backend": "echo"}},
        {"jsonrpc": "2.0", "id": 2, "method": "generate", "params": {"prompt": "abc", "max_tokens": 10}},
        {"jsonrpc": "2.0", "id": 3, "method": "unload"},
    ]
    done = run_worker(b"".join(json.dumps(r).encode() + b"\n" for r in requests), "--drain")
    responses = [m for m in map(json.loads, done.stdout.splitlines()) if "id" in m]
    assert [r["id"] for r in responses] == [1, 2, 3]
    assert responses[1]["result"]["text"] == "abc"
    assert responses[2]["result"] == {"unloaded": True, "model": "default"}


def test_person_typing_without_final_newline_still_gets_an_answer():
    done = run_worker(CAPABILITIES)
    assert json.loads(done.stdout)["id"] == 1


# --- streaming ------------------------------------------------------------------------


async def test_generate_streams_chunks_that_concatenate_to_the_final_text(echo_worker: Host):
    prompt = "héllo, 世界! 🎉 done"
    msg_id, done = echo_worker.start("generate", {"prompt": prompt, "max_tokens": 100})
    result = (await done)["result"]
    chunks = echo_worker.chunks[msg_id]
    assert "".join(c["text"] for c in chunks) == result["text"] == prompt
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    assert all("\ufffd" not in c["text"] for c in chunks)
    prompt_tokens = len(prompt.encode()) + 1  # the echo tokenizer adds BOS
    for n, chunk in enumerate(chunks, start=1):
        assert chunk["generated_tokens"] == n
        assert chunk["prompt_tokens"] == prompt_tokens
        assert chunk["cache_read_tokens"] == 0
    assert sum(len(c["tokens"]) for c in chunks) == result["usage"]["completion_tokens"] == len(result["tokens"])
    assert result["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(prompt.encode()) + 1,  # the echoed bytes, then EOS
        "cache_read_tokens": 0,
        "cache_write_tokens": 0,
        "reasoning_tokens": 0,
    }
    assert result["finish_reason"] == "stop" and result["stop_reason"]["kind"] == "eos"


async def test_max_tokens_ends_generation_with_finish_reason_length(echo_worker: Host):
    result = await echo_worker.call("generate", {"prompt": "abcdef", "max_tokens": 3})
    assert (result["text"], result["finish_reason"], result["usage"]["completion_tokens"]) == ("abc", "length", 3)


async def test_stop_string_across_tokens_is_never_streamed(echo_worker: Host):
    msg_id, done = echo_worker.start("generate", {"prompt": "one two STOP three", "stop": ["STOP", "zzz"]})
    result = (await done)["result"]
    assert result["text"] == "one two "
    assert result["stop_reason"] == {"kind": "stop_string", "token": None, "stop": "STOP"}
    assert "".join(c["text"] for c in echo_worker.chunks[msg_id]) == "one two "


async def test_generate_with_stream_false_sends_no_chunks(echo_worker: Host):
    msg_id, done = echo_worker.start("generate", {"prompt": "abc", "stream": False})
    assert (await done)["result"]["text"] == "abc"
    assert echo_worker.chunks[msg_id] == []


async def test_chat_messages_are_rendered_and_generated_from(echo_worker: Host):
    messages = [{"role": "user", "content": "hi"}]
    rendered = await echo_worker.call("render", {"messages": messages})
    result = await echo_worker.call("generate", {"messages": messages, "max_tokens": 1000})
    assert rendered["text"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert result["usage"]["prompt_tokens"] == rendered["count"]
    assert result["text"] == rendered["text"]


# --- concurrency and cancel -------------------------------------------------------------


async def _slow_stream(host: Host, prompt_len: int = 400) -> tuple[int, asyncio.Future]:
    load, params = slow_generate(prompt_len)
    await host.call("load", load)
    msg_id, done = host.start("generate", params)
    await host.wait_until(lambda: len(host.chunks[msg_id]) >= 3)
    return msg_id, done


@pytest.mark.parametrize("how", ["cancel", "$/cancelRequest"])
async def test_cancel_stops_generation_within_one_token(spawn_worker: SpawnWorker, how: str):
    host = await spawn_worker()
    msg_id, done = await _slow_stream(host)
    seen = len(host.chunks[msg_id])
    if how == "cancel":
        assert await host.call("cancel", {"id": msg_id}) == {"cancelled": True, "state": "running"}
    else:
        await host.notify("$/cancelRequest", {"id": msg_id})
    result = (await asyncio.wait_for(done, 5))["result"]
    assert result["finish_reason"] == "cancelled"
    # what the host had seen, plus one token in the pipe and one decode step
    assert seen <= result["usage"]["completion_tokens"] <= seen + 2
    assert result["text"] == "x" * result["usage"]["completion_tokens"]
    assert "".join(c["text"] for c in host.chunks[msg_id]) == result["text"]
    after = await host.call("generate", {"prompt": "ok", "max_tokens": 5})
    assert after["text"] == "ok" and after["finish_reason"] == "stop"


async def test_quick_requests_are_answered_while_a_generation_streams(spawn_worker: SpawnWorker):
    host = await spawn_worker()
    msg_id, done = await _slow_stream(host)
    tokens = await host.call("tokenize", {"text": "hé"})
    caps = await host.call("capabilities")
    assert tokens == {"tokens": [256, 104, 195, 169], "count": 4}
    assert caps["model"]["backend"] == "echo"
    assert not done.done(), "the stream ended before the quick requests were answered"
    await host.call("cancel", {"id": msg_id})
    await done


async def test_a_generate_queued_past_max_batch_answers_cancelled_at_once_without_running(
    spawn_worker: SpawnWorker,
):
    host = await spawn_worker("--max-batch", "1")
    first_id, first = await _slow_stream(host)
    second_id, second = host.start("generate", {"prompt": "never", "max_tokens": 10})
    await asyncio.sleep(0.05)
    assert await host.call("cancel", {"id": second_id}) == {"cancelled": True, "state": "queued"}
    result = (await second)["result"]
    assert result["finish_reason"] == "cancelled" and result["text"] == "" and host.chunks[second_id] == []
    assert not first.done(), "the queued request waited for the running one to end"
    await host.call("cancel", {"id": first_id})
    assert (await first)["result"]["finish_reason"] == "cancelled"


async def test_cancel_of_a_running_load_ends_it_when_its_backend_returns(spawn_worker: SpawnWorker, tmp_path):
    """A backend that reports no stage and waits on no other program (PROTOCOL 9): the cancel
    answers cancelled: true, the load -32800 once the backend returns, its model let go."""
    env = install_plugin(tmp_path, "slow_backend", SLOW_LOADING_BACKEND, {"slow": "slow_backend:Slow"})
    host = await spawn_worker(env=env)
    await host.call("load", {"backend": "echo"})
    load_id, load = host.start("load", {"backend": "slow"})
    await host.wait_until(lambda: b"slow load started" in host.stderr)  # it then sleeps for a second
    assert await host.call("cancel", {"id": load_id}) == {"cancelled": True, "state": "running"}
    error = (await load)["error"]
    assert (error["code"], error["data"]["kind"]) == (-32800, "request_cancelled")
    assert (await host.call("capabilities"))["model"] is None  # the echo model was unloaded as the load began


async def test_cancel_of_unknown_id_says_so(echo_worker: Host):
    assert await echo_worker.call("cancel", {"id": "nope"}) == {"cancelled": False, "state": "unknown"}


async def test_cancelled_load_answers_request_cancelled(spawn_worker: SpawnWorker):
    host = await spawn_worker()
    gen_id, gen = await _slow_stream(host)
    load_id, load = host.start("load", {"backend": "echo"})
    await asyncio.sleep(0.05)
    await host.notify("$/cancelRequest", {"id": load_id})
    await host.call("cancel", {"id": gen_id})
    error = (await load)["error"]
    assert (error["code"], error["data"]["kind"]) == (-32800, "request_cancelled")


async def test_duplicate_in_flight_id_is_refused_and_the_original_completes(spawn_worker: SpawnWorker):
    host = await spawn_worker()
    msg_id, _ = await _slow_stream(host, prompt_len=30)
    await host.send({"jsonrpc": "2.0", "id": msg_id, "method": "capabilities"})
    error = await host.wait_for(lambda m: m.get("id") == msg_id and "error" in m)
    assert error["error"]["data"] == {"kind": "duplicate_id", "field": "id"}
    original = await host.wait_for(lambda m: m.get("id") == msg_id and "result" in m)
    assert original["result"]["finish_reason"] == "stop"
    # once answered, the id is free again
    assert (await host.call("capabilities"))["pid"] == host.process.pid


async def test_tokenize_waits_for_an_earlier_load_instead_of_failing(spawn_worker: SpawnWorker):
    host = await spawn_worker()
    _, load = host.start("load", {"backend": "echo"})
    assert (await host.call("tokenize", {"text": "a", "add_special_tokens": False}))["tokens"] == [97]
    assert "result" in await load


# --- bad input ---------------------------------------------------------------------------

BAD_INPUTS = [
    ("garbage bytes", b"\x00\xffgarbage\n", -32700, "parse_error", None),
    ("invalid json", b'{"jsonrpc":"2.0","id":7,\n', -32700, "parse_error", None),
    ("batch", b'[{"jsonrpc":"2.0","id":7,"method":"capabilities"}]\n', -32600, "batch_not_supported", None),
    ("missing jsonrpc", b'{"id":7,"method":"capabilities"}\n', -32600, "invalid_request", 7),
    ("unknown method", b'{"jsonrpc":"2.0","id":7,"method":"fly"}\n', -32601, "method_not_found", 7),
    (
        "wrong param type",
        b'{"jsonrpc":"2.0","id":7,"method":"tokenize","params":{"text":5}}\n',
        -32602,
        "invalid_params",
        7,
    ),
    (
        "unknown param",
        b'{"jsonrpc":"2.0","id":7,"method":"tokenize","params":{"txt":"a"}}\n',
        -32602,
        "invalid_params",
        7,
    ),
    ("positional params", b'{"jsonrpc":"2.0","id":7,"method":"tokenize","params":["a"]}\n', -32602, "invalid_params", 7),
    ("absurd content-length", b"Content-Length: 99999999999999\r\n\r\n", -32700, "message_too_large", None),
    ("bad content-length", b"Content-Length: ten\r\n\r\n", -32700, "parse_error", None),
    ("generate without a model", b'{"jsonrpc":"2.0","id":7,"method":"generate","params":{"prompt":"a"}}\n', -32001,
     "model_not_loaded", 7),
    ("unknown backend", b'{"jsonrpc":"2.0","id":7,"method":"load","params":{"backend":"nope"}}\n', -32003,
     "backend_not_found", 7),
]


@pytest.mark.parametrize(("data", "code", "kind", "reply_id"), [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
async def test_bad_input_gets_a_precise_error_and_the_worker_keeps_serving(
    spawn_worker: SpawnWorker, data: bytes, code: int, kind: str, reply_id
):
    host = await spawn_worker(framing=Framing.LSP if data.startswith(b"Content") else Framing.NDJSON)
    await host.send_raw(data)
    response = await host.wait_for(lambda m: "error" in m)
    assert response["id"] == reply_id
    assert (response["error"]["code"], response["error"]["data"]["kind"]) == (code, kind)
    assert len(response["error"]["message"]) > 30  # says what was wrong and what to do
    assert "result" not in response
    assert (await host.call("capabilities"))["protocol_version"] == "1.0"
    assert [m for m in host.messages if "error" in m] == [response]


async def test_invalid_params_error_names_the_field_and_suggests_the_right_one(echo_worker: Host):
    with pytest.raises(WorkerError) as caught:
        await echo_worker.call("generate", {"prompt": "a", "max_token": 3})
    assert caught.value.data["field"] == "params.max_token"
    assert "did you mean 'max_tokens'" in caught.value.message
    with pytest.raises(WorkerError) as caught:
        await echo_worker.call("generate", {"prompt": "a", "max_tokens": 0})
    assert caught.value.data["field"] == "params.max_tokens" and ">= 1" in caught.value.message


async def test_prompt_must_be_given_exactly_once(echo_worker: Host):
    for params, field in (({}, "params.prompt"), ({"prompt": "a", "tokens": [1]}, "params.tokens")):
        with pytest.raises(WorkerError) as caught:
            await echo_worker.call("generate", params)
        assert caught.value.kind == "invalid_params"
        assert caught.value.data == {"kind": "invalid_params", "field": field, "method": "generate"}


async def test_errors_raised_while_a_request_runs_name_the_method(spawn_worker: SpawnWorker):
    host = await spawn_worker()
    with pytest.raises(WorkerError) as caught:
        await host.call("tokenize", {"text": "a"})
    assert caught.value.data == {"kind": "model_not_loaded", "method": "tokenize"}


async def test_a_notification_sent_with_an_id_is_told_to_drop_the_id(spawn_worker: SpawnWorker):
    host = await spawn_worker()
    with pytest.raises(WorkerError) as caught:
        await host.call("exit")
    assert caught.value.kind == "method_not_found" and "without an 'id'" in caught.value.message
    assert host.process.returncode is None


async def test_token_ids_outside_the_vocabulary_are_refused_naming_the_position(echo_worker: Host):
    with pytest.raises(WorkerError) as caught:
        await echo_worker.call("detokenize", {"tokens": [104, 9999]})
    assert caught.value.data["field"] == "params.tokens[1]"
    with pytest.raises(WorkerError) as caught:
        await echo_worker.call("generate", {"tokens": [104, 9999]})
    assert caught.value.data["field"] == "params.tokens[1]"


async def test_oversized_line_is_refused_and_the_next_message_is_served(spawn_worker: SpawnWorker):
    host = await spawn_worker("--max-message-bytes", "1000")
    await host.send_raw(b'{"jsonrpc":"2.0","id":1,"method":"tokenize","params":{"text":"' + b"a" * 5000 + b'"}}\n')
    error = await host.wait_for(lambda m: "error" in m)
    assert error["error"]["data"] == {"kind": "message_too_large", "limit": 1000}
    assert (await host.call("capabilities"))["limits"]["max_message_bytes"] == 1000


# --- lifecycle -----------------------------------------------------------------------------


async def test_end_of_input_mid_stream_cancels_and_exits_promptly(spawn_worker: SpawnWorker):
    host = await spawn_worker()
    msg_id, done = await _slow_stream(host, prompt_len=5000)
    started = time.monotonic()
    await host.close_stdin()
    assert await host.wait(timeout=5) == 0
    assert time.monotonic() - started < 2
    assert (await done)["result"]["finish_reason"] == "cancelled"


async def test_sigterm_mid_stream_answers_the_generation_and_exits_promptly(spawn_worker: SpawnWorker):
    host = await spawn_worker(process=True)
    msg_id, done = await _slow_stream(host, prompt_len=5000)
    started = time.monotonic()
    host.process.send_signal(signal.SIGTERM)
    assert await host.wait(timeout=5) == 0
    assert time.monotonic() - started < 2
    assert (await done)["result"]["finish_reason"] == "cancelled"


async def test_shutdown_answers_after_earlier_requests_then_exit_ends_with_code_zero(spawn_worker: SpawnWorker):
    host = await spawn_worker()
    msg_id, done = await _slow_stream(host, prompt_len=5000)
    assert await host.call("shutdown", timeout=5) is None
    assert done.done() and (await done)["result"]["finish_reason"] == "cancelled"
    with pytest.raises(WorkerError) as caught:
        await host.call("capabilities")
    assert caught.value.kind == "shutting_down"
    await host.notify("exit")
    assert await host.wait(timeout=5) == 0


async def test_exit_without_shutdown_ends_with_code_one(spawn_worker: SpawnWorker):
    host = await spawn_worker()
    await host.notify("exit")
    assert await host.wait(timeout=5) == 1


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_a_host_that_stops_reading_blocks_generation_instead_of_growing_memory():
    worker = subprocess.Popen(
        [sys.executable, "-m", "worker", "--outbox", "16"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO_ROOT,
    )
    try:
        prompt = "y" * 300_000  # ~45 MB of chunk notifications if they were all buffered
        for request in (
            {"jsonrpc": "2.0", "id": 1, "method": "load", "params": {"backend": "echo"}},
            {"jsonrpc": "2.0", "id": 2, "method": "generate", "params": {"prompt": prompt, "max_tokens": 300_001}},
        ):
            worker.stdin.write(json.dumps(request).encode() + b"\n")
        worker.stdin.flush()
        time.sleep(1.0)
        before = _rss_kib(worker.pid)
        time.sleep(1.5)
        grown = _rss_kib(worker.pid) - before
        assert grown < 4096, f"RSS grew by {grown} KiB while the host was not reading"
        # Now read: everything arrives, and the stream completes.
        lines = 0
        for line in worker.stdout:
            lines += 1
            if line.startswith(b'{"jsonrpc":"2.0","id":2,'):
                assert json.loads(line)["result"]["usage"]["completion_tokens"] == 300_001
                break
        assert lines == 1 + 300_001 + 1  # load answer, chunks, final answer
    finally:
        worker.kill()
        worker.wait()


def test_a_host_that_closes_our_stdout_makes_the_worker_exit():
    worker = subprocess.Popen(
        [sys.executable, "-m", "worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO_ROOT,
    )
    load, params = slow_generate(prompt_len=5000, delay_ms=1)
    for request in (
        {"jsonrpc": "2.0", "id": 1, "method": "load", "params": load},
        {"jsonrpc": "2.0", "id": 2, "method": "generate", "params": params},
    ):
        worker.stdin.write(json.dumps(request).encode() + b"\n")
    worker.stdin.flush()
    worker.stdout.readline()
    worker.stdout.close()  # the host stops listening but keeps stdin open
    try:
        assert worker.wait(timeout=5) == 0
    finally:
        worker.kill()
    assert b"the host stopped reading" in worker.stderr.read()


def test_help_explains_the_flags_and_shows_an_example_request():
    done = subprocess.run(
        [sys.executable, "-m", "worker", "--help"], capture_output=True, cwd=REPO_ROOT, timeout=30, text=True
    )
    assert done.returncode == 0
    for text in ("--framing", "--record", "--drain", "--max-message-bytes", '"method":"capabilities"'):
        assert text in done.stdout


def test_a_terminal_on_stdin_gets_one_hint_line_on_stderr():
    primary, secondary = os.openpty()
    worker = subprocess.Popen(
        [sys.executable, "-m", "worker"], stdin=secondary, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT
    )
    os.close(secondary)
    try:
        os.write(primary, CAPABILITIES + b"\n")
        assert json.loads(worker.stdout.readline())["id"] == 1
        os.write(primary, b"\x04")  # Ctrl-D: end of input
        worker.wait(timeout=10)
    finally:
        worker.kill()
        os.close(primary)
    hints = [line for line in worker.stderr.read().decode().splitlines() if "type one JSON-RPC request" in line]
    assert len(hints) == 1 and '"method":"capabilities"' in hints[0]
