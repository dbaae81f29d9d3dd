"""Fuzz the worker's input path: random and mutated bytes in, valid JSON-RPC out.

Most of it runs in-process for speed: a real transport and dispatcher with real
``Handlers`` (echo backend) writing to a small capturing writer. Each input is fed whole to
one fresh worker and byte by byte to another, and both runs must produce valid
messages, exactly one response per request, and the same messages. An oracle
(the codec and the envelope alone) says which responses each input must get.
One more in-process test streams many inputs through one worker and a real
``Writer`` over a pipe, and one test streams mutated input into the real worker
subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import os
import random
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from protocol.envelope import Notification, Rejected, Request, parse_incoming
from protocol.errors import CODES, ErrorKind
from protocol.framing import DEFAULT_MAX_MESSAGE_BYTES, Frame, FrameDecoder, Framing, FramingError, encode_frame
from protocol.methods import METHODS, GenerateChunk
from worker.backends import BUILTIN, Registry
from worker.dispatcher import Dispatcher
from worker.handlers import Handlers, WireInfo
from worker.replay import VOLATILE_KEYS  # what legitimately differs between two runs of one session
from worker.scheduler import DEFAULT_MAX_BATCH
from worker.transport import StdioTransport
from worker.writer import DEFAULT_OUTBOX_MESSAGES, Writer

SEED = 0x5EED_F022
N_INPUTS = int(os.environ.get("LM_WORKER_FUZZ_INPUTS", "10000"))  # each fed whole and byte by byte
STREAM_INPUTS = 1_500  # through one worker and a real Writer
SUBPROCESS_INPUTS = 1_000
SUBPROCESS_MAX_BYTES = 1 << 16
RESPONSE_TIMEOUT_S = 10.0

# Only the echo backend, so that no fuzzed "load" can reach a heavy backend.
REGISTRY = Registry({"echo": BUILTIN["echo"]}, entry_points=False)


# --- the worker under test ------------------------------------------------------


@contextlib.contextmanager
def hang_guard(seconds: float):
    """A hang inside feed() cannot be interrupted: dump every thread's stack and exit instead."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


class Capture:
    """A writer stand-in: what the transport uses of Writer (send, adopt_framing, framing)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.responses = 0
        self._framing: Framing | None = None
        self._cond = threading.Condition()

    @property
    def framing(self) -> Framing | None:
        return self._framing

    def adopt_framing(self, framing: Framing) -> None:
        if self._framing is None:
            self._framing = framing

    def send(self, body: bytes) -> None:
        assert isinstance(body, bytes)
        with self._cond:
            self.bodies.append(body)
            if not body.startswith(b'{"jsonrpc":"2.0","method"'):
                self.responses += 1
            self._cond.notify_all()

    def wait_responses(self, count: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.responses >= count, timeout)


class FedWorker:
    """A worker's input path without its process: the transport feeding a dispatcher, with
    real handlers, writing to ``writer``; the test feeds it bytes as the reader thread does."""

    def __init__(self, writer: Any, max_bytes: int) -> None:
        self.handlers = Handlers(
            REGISTRY,
            WireInfo(
                methods=Dispatcher.method_names(),
                notifications=Dispatcher.notification_names(),
                framing=lambda: writer.framing,
                max_message_bytes=max_bytes,
                outbox_messages=DEFAULT_OUTBOX_MESSAGES,
                max_batch=DEFAULT_MAX_BATCH,
            ),
            data_dir=Path(tempfile.gettempdir()),
        )
        self.transport = StdioTransport(writer, max_message_bytes=max_bytes)
        # drain_on_eof: at end of input the queue is finished, not cancelled, so runs are comparable.
        self.dispatcher = Dispatcher(self.handlers, self.transport, drain_on_eof=True)

    def feed(self, data: bytes) -> bool:
        return self.transport.feed(data, self.dispatcher)

    def feed_eof(self) -> None:
        self.transport.feed_eof(self.dispatcher)

    def stop(self) -> None:
        self.dispatcher.end("fuzz input done", cancel=True)
        assert self.dispatcher.wait_stopped(5.0), "the model lane did not stop"
        self.handlers.close()


def run_input(data: bytes, expected: Expected, *, bytewise: bool, max_bytes: int) -> list[bytes]:
    capture = Capture()
    worker = FedWorker(capture, max_bytes)
    try:
        chunks = [data[i : i + 1] for i in range(len(data))] if bytewise else [data]
        for chunk in chunks:
            if not worker.feed(chunk):
                break  # as the stdin reader does: stop reading, no feed_eof
        else:
            worker.feed_eof()
        answered = capture.wait_responses(expected.total, RESPONSE_TIMEOUT_S)
    finally:
        worker.stop()
    assert answered, f"only {capture.responses} of {expected.total} responses within {RESPONSE_TIMEOUT_S} s"
    return list(capture.bodies)


# --- the oracle -------------------------------------------------------------------


@dataclass
class Expected:
    """What an input must be answered with, from the codec and envelope alone."""

    ids: Counter = field(default_factory=Counter)  # response id (None included) -> count
    methods: dict[Any, list[str]] = field(default_factory=lambda: defaultdict(list))
    racy: bool = False  # the outcome depends on timing (cancels, duplicate ids, exit, shutdown)

    @property
    def total(self) -> int:
        return sum(self.ids.values())


def expect(data: bytes, max_bytes: int) -> Expected:
    decoder = FrameDecoder(max_bytes)
    expected = Expected()
    for event in decoder.feed(data) + decoder.feed_eof():
        if isinstance(event, FramingError):
            expected.ids[None] += 1
            continue
        message = parse_incoming(event.body)
        if isinstance(message, Request):
            expected.ids[message.id] += 1
            expected.methods[message.id].append(message.method)
            if message.method in ("cancel", "shutdown") or len(expected.methods[message.id]) > 1:
                expected.racy = True
        elif isinstance(message, Rejected):
            expected.ids[message.id] += 1
        elif isinstance(message, Notification):
            if message.method in ("$/cancelRequest", "exit"):
                expected.racy = True
            if message.method == "exit" and not message.params:
                break  # the worker stops reading here
    return expected


# --- checking output ----------------------------------------------------------------

CHUNK_FIELDS = set(GenerateChunk.__struct_fields__)


def is_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def check_message(message: Any) -> None:
    assert isinstance(message, dict), message
    assert message.get("jsonrpc") == "2.0", message
    if "method" in message:
        assert set(message) == {"jsonrpc", "method", "params"}, message
        assert message["method"] == "generate/chunk", message
        assert set(message["params"]) == CHUNK_FIELDS, message
        msgspec.convert(message["params"], GenerateChunk)
        return
    assert "id" in message, message
    msg_id = message["id"]
    assert msg_id is None or is_id(msg_id), message
    if "error" in message:
        assert set(message) == {"jsonrpc", "id", "error"}, message
        error = message["error"]
        assert isinstance(error, dict) and set(error) == {"code", "message", "data"}, message
        assert isinstance(error["code"], int) and not isinstance(error["code"], bool), message
        assert isinstance(error["message"], str) and error["message"], message
        assert isinstance(error["data"], dict) and isinstance(error["data"].get("kind"), str), message
        kind = ErrorKind(error["data"]["kind"])
        assert error["code"] == CODES[kind], message
    else:
        assert set(message) == {"jsonrpc", "id", "result"}, message
        assert msg_id is not None, message


def decode_bodies(bodies: list[bytes]) -> list[dict[str, Any]]:
    messages = []
    for body in bodies:
        assert b"\n" not in body, body[:200]  # one line, whatever the framing
        message = msgspec.json.decode(body)
        check_message(message)
        messages.append(message)
    return messages


def response_ids(messages: list[dict[str, Any]]) -> Counter:
    return Counter(m["id"] for m in messages if "method" not in m)


def check_against_oracle(messages: list[dict[str, Any]], expected: Expected, data: bytes) -> None:
    assert response_ids(messages) == expected.ids, f"input {data[:300]!r}"
    generate_ids = {i for i, methods in expected.methods.items() if "generate" in methods}
    for m in messages:
        if "method" in m:
            assert m["params"]["id"] in generate_ids, m
    if expected.racy:
        return
    # Every id is unique: check each result's shape and each generation's stream.
    chunks: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for m in messages:
        if "method" in m:
            chunks[m["params"]["id"]].append(m["params"])
            continue
        if "result" not in m:
            continue
        method = expected.methods[m["id"]][0]
        msgspec.convert(m["result"], METHODS[method].result)  # shutdown's type(None) takes only null
        if method == "generate":
            stream = chunks.pop(m["id"], [])
            assert [c["index"] for c in stream] == list(range(len(stream))), stream
            if stream:  # chunks come before the response and add up to it
                assert "".join(c["text"] for c in stream) == m["result"]["text"], (stream, m)
                assert [t for c in stream for t in c["tokens"]] == m["result"]["tokens"], (stream, m)
                assert stream[-1]["generated_tokens"] == m["result"]["usage"]["completion_tokens"], (stream, m)
    assert not chunks, f"chunks after (or without) their generate response: {chunks}"


def normalized(message: Any) -> Any:
    """The message without what legitimately varies between runs."""
    if isinstance(message, dict):
        out = {k: normalized(v) for k, v in message.items() if k not in VOLATILE_KEYS}
        if isinstance(out.get("result"), dict) and "protocol_version" in out["result"]:
            out["result"].pop("model", None)  # capabilities answers inline, racing a queued load
            out["result"].pop("pid", None)
        return out
    if isinstance(message, list):
        return [normalized(v) for v in message]
    return message


def canonical(messages: list[dict[str, Any]]) -> list[str]:
    return sorted(json.dumps(normalized(m), sort_keys=True) for m in messages)


def check_framed_output(bodies: list[bytes], framing: Framing | None) -> None:
    """What a Writer would make of the bodies decodes back to exactly them."""
    data = b"".join(encode_frame(body, framing or Framing.NDJSON) for body in bodies)
    decoder = FrameDecoder()
    events = decoder.feed(data) + decoder.feed_eof()
    assert [e.body if isinstance(e, Frame) else e for e in events] == bodies


# --- inputs -------------------------------------------------------------------------

TEXTS = ["", "hi", "héllo", "☃ 😀", "a\nb\r\n", "stop here", "你好", "xyz" * 7, '\t"\\/', "\u2028é"]
STRINGS = ["", "a", "é", "0", "generate", "\\", '"', "\u0000", "😀", "x" * 40]
METHOD_NAMES = [*METHODS, "$/cancelRequest", "exit", "generate/chunk", "", "Generate", "foo", "cache/list"]


def rand_id(rng: random.Random) -> Any:
    return rng.choice([0, "", 1, 2, 3, rng.randint(-5, 50), f"r{rng.randint(0, 9)}", 2**63, -(2**63), 2**70, "é"])


def rand_bad_id(rng: random.Random) -> Any:
    return rng.choice([None, True, False, 1.5, 0.0, [], [1], {}, {"a": 1}])


def rand_json(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth >= 4 or roll < 0.45:
        return rng.choice(
            [None, True, False, 0, -1, rng.randint(-(2**70), 2**70), rng.random() * 1e6, 1e300, -0.0]
            + [rng.choice(STRINGS), rng.choice(TEXTS)]
        )
    if roll < 0.7:
        return [rand_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["jsonrpc", "id", "method", "params", "result", "error", "prompt", "tokens", *STRINGS]
    return {rng.choice(keys): rand_json(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def rand_chat(rng: random.Random) -> list[dict[str, Any]]:
    messages = [{"role": rng.choice(["user", "system", "assistant"]), "content": rng.choice(TEXTS)}]
    return messages * rng.randint(1, 2)


def rand_params(rng: random.Random, method: str) -> dict[str, Any] | None:
    match method:
        case "load":
            return {"backend": "echo", **({"model": rng.choice(STRINGS)} if rng.random() < 0.3 else {})}
        case "generate":
            params: dict[str, Any] = {"max_tokens": rng.randint(1, 8)}
            source = rng.choice(["prompt", "prompt", "tokens", "messages"])
            if source == "prompt":
                params["prompt"] = rng.choice(TEXTS)
            elif source == "tokens":
                params["tokens"] = [rng.randint(0, 257) for _ in range(rng.randint(0, 8))]
            else:
                params["messages"] = rand_chat(rng)
            if rng.random() < 0.3:
                params["stop"] = [rng.choice(["l", "e", "ll", "😀", "\n", "xyz"])]
            if rng.random() < 0.2:
                params["stream"] = False
            if rng.random() < 0.2:
                params["temperature"] = rng.choice([0, 0.7, 1.5])
                params["seed"] = rng.randint(0, 9)
            return params
        case "tokenize":
            return {"text": rng.choice(TEXTS), "add_special_tokens": rng.random() < 0.5}
        case "detokenize":
            return {"tokens": [rng.randint(0, 257) for _ in range(rng.randint(0, 6))]}
        case "render":
            return {"messages": rand_chat(rng)}
        case "cancel" | "$/cancelRequest":
            return {"id": rand_id(rng)}
        case _:
            return rng.choice([None, {}])


def valid_message(rng: random.Random, *, allow_ending: bool = True) -> dict[str, Any]:
    methods = ["generate"] * 8 + ["tokenize", "detokenize", "render", "capabilities", "unload", "cancel"]
    methods += ["load", "$/cancelRequest"]
    if allow_ending and rng.random() < 0.1:
        methods = ["shutdown", "exit"]
    method = rng.choice(methods)
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if method not in ("exit", "$/cancelRequest"):
        message["id"] = rand_id(rng)
    params = rand_params(rng, method)
    if params is not None:
        message["params"] = params
    return message


def encode(rng: random.Random, message: Any) -> bytes:
    body = json.dumps(message, ensure_ascii=rng.random() < 0.3, separators=rng.choice([(",", ":"), (", ", ": ")]))
    data = body.encode("utf-8", "surrogatepass")
    roll = rng.random()
    if roll < 0.55:
        return data + rng.choice([b"\n", b"\n", b"\r\n", b"\n\n"])
    if roll < 0.9:
        return encode_frame(data, Framing.LSP)
    end = rng.choice([b"\n", b"\r\n"])
    headers = [b"content-length: %d" % len(data), b"Content-Type: application/vscode-jsonrpc; charset=utf-8"]
    rng.shuffle(headers)
    return b"".join(h + end for h in headers) + end + data


def valid_sequence(rng: random.Random, *, allow_ending: bool = True) -> bytes:
    messages = []
    if rng.random() < 0.75:
        messages.append({"jsonrpc": "2.0", "id": rand_id(rng), "method": "load", "params": {"backend": "echo"}})
    messages += [valid_message(rng, allow_ending=allow_ending) for _ in range(rng.randint(1, 3))]
    return b"".join(encode(rng, m) for m in messages)


INTERESTING = [b"{", b"}", b"[", b"]", b'"', b"\\", b":", b",", b"\n", b"\r\n", b"\r", b" ", b"\x00", b"\xff",
               b"\xc3", b"\xe2\x98", b"0", b"9", b"-", b".", b"e", b"null", b"Content-Length: ", b"\r\n\r\n",
               b'"id":', b'"method":', b'"jsonrpc":"2.0",', b"99999999999999999999"]  # fmt: skip


def mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 3, 4])):
        pos = rng.randint(0, len(buf))
        op = rng.random()
        if op < 0.3 and buf:
            pos = min(pos, len(buf) - 1)
            buf[pos] = rng.randrange(256) if rng.random() < 0.5 else buf[pos] ^ (1 << rng.randrange(8))
        elif op < 0.6:
            buf[pos:pos] = rng.choice(INTERESTING) if rng.random() < 0.7 else rng.randbytes(rng.randint(1, 4))
        elif op < 0.8:
            del buf[pos : pos + rng.randint(1, 8)]
        elif op < 0.9 and buf:
            start = rng.randrange(len(buf))
            buf[pos:pos] = buf[start : start + rng.randint(1, 16)]
        else:
            del buf[pos:]
    return bytes(buf)


def random_headers(rng: random.Random) -> bytes:
    body = rng.choice([b"{}", b'{"jsonrpc":"2.0","id":1,"method":"capabilities"}', rng.randbytes(rng.randint(0, 20))])
    lines = []
    for _ in range(rng.randint(0, 4)):
        lines.append(
            rng.choice(
                [
                    b"Content-Length: %d" % rng.choice([len(body), len(body) + 1, max(0, len(body) - 1), 0, 7]),
                    b"Content-Length: " + rng.choice([b"", b"x", b"-1", b"1" * 30, b"99999999999999", b" 3 "]),
                    b"Content-Type: application/json",
                    b"X-" + rng.randbytes(3).hex().encode() + b": " + rng.randbytes(2).hex().encode(),
                    b"no colon here",
                    b"",
                ]
            )
        )
    if rng.random() < 0.8:
        lines.insert(0, rng.choice([b"Content-Length: %d" % len(body), b"content-length:%d" % len(body)]))
    end = rng.choice([b"\r\n", b"\n"])
    return b"".join(line + end for line in lines) + rng.choice([end, b""]) + body


def truncated_frame(rng: random.Random) -> bytes:
    frame = encode_frame(json.dumps(valid_message(rng)).encode(), Framing.LSP)
    cut = frame[: rng.randrange(len(frame))]
    return cut + (valid_sequence(rng) if rng.random() < 0.5 else b"")


def random_request_like(rng: random.Random) -> bytes:
    message: dict[str, Any] = {}
    if rng.random() < 0.8:
        message["jsonrpc"] = rng.choice(["2.0", "2.0", "2.0", "1.0", 2.0, None])
    if rng.random() < 0.7:
        message["id"] = rand_id(rng) if rng.random() < 0.7 else rand_bad_id(rng)
    if rng.random() < 0.9:
        message["method"] = rng.choice(METHOD_NAMES) if rng.random() < 0.9 else rand_json(rng, 3)
    if rng.random() < 0.7:
        method = message.get("method")
        message["params"] = (
            rand_params(rng, method) if isinstance(method, str) and rng.random() < 0.5 else rand_json(rng, 2)
        )
    if rng.random() < 0.1:
        message[rng.choice(["result", "error"])] = rand_json(rng, 3)
    return encode(rng, message)


def random_bytes(rng: random.Random) -> bytes:
    data = rng.randbytes(rng.randint(0, 160))
    return rng.choice([b"", b"{", b"[", b"Content-Length: ", b"\n"]) + data


def fuzz_inputs_that_keep_serving(rng: random.Random, count: int) -> list[bytes]:
    """Inputs without shutdown or exit, so that a worker fed all of them still serves."""
    inputs = []
    while len(inputs) < count:
        data = fuzz_input(rng, allow_ending=False)
        lowered = data.lower()
        if b"exit" not in lowered and b"shutdown" not in lowered:
            inputs.append(data)
    return inputs


def fuzz_input(rng: random.Random, *, allow_ending: bool = True) -> bytes:
    roll = rng.random()
    if roll < 0.1:
        return random_bytes(rng)
    if roll < 0.2:
        return encode(rng, rand_json(rng))
    if roll < 0.35:
        return random_request_like(rng)
    if roll < 0.45:
        return valid_sequence(rng, allow_ending=allow_ending)  # unmutated: the happy path
    if roll < 0.85:
        return mutate(rng, valid_sequence(rng, allow_ending=allow_ending))
    if roll < 0.93:
        return truncated_frame(rng)
    return random_headers(rng)


# --- the tests ------------------------------------------------------------------------


def test_fuzzed_inputs_fed_whole_and_byte_by_byte_give_the_same_valid_answers():
    rng = random.Random(SEED)
    stats: Counter = Counter()
    started = time.monotonic()
    with hang_guard(240):
        run_fuzz(rng, stats)
    # The fuzzer must reach the interesting paths, not just bounce off the parser.
    for key in ("results", "chunks", "parse_error", "invalid_request", "invalid_params", "method_not_found",
                "message_too_large", "batch_not_supported", "model_not_loaded", "duplicate_id"):  # fmt: skip
        assert stats[key] > 0, (key, stats)
    print(f"fuzz: {stats.most_common()} in {time.monotonic() - started:.1f} s")


def run_fuzz(rng: random.Random, stats: Counter) -> None:
    for n in range(N_INPUTS):
        data = fuzz_input(rng)
        max_bytes = 64 if rng.random() < 0.1 else DEFAULT_MAX_MESSAGE_BYTES
        expected = expect(data, max_bytes)
        outputs = []
        for bytewise in (False, True):
            try:
                bodies = run_input(data, expected, bytewise=bytewise, max_bytes=max_bytes)
                messages = decode_bodies(bodies)
                check_against_oracle(messages, expected, data)
                check_framed_output(bodies, Framing.LSP if bytewise else Framing.NDJSON)
            except Exception as exc:
                raise AssertionError(f"input #{n} (bytewise={bytewise}): {data!r}") from exc
            outputs.append(messages)
        if not expected.racy:
            assert canonical(outputs[0]) == canonical(outputs[1]), f"input #{n}: {data!r}"
        else:
            assert response_ids(outputs[0]) == response_ids(outputs[1]), f"input #{n}: {data!r}"
        stats["inputs"] += 1
        stats["racy"] += expected.racy
        for m in outputs[0]:
            if "error" in m:
                stats[m["error"]["data"]["kind"]] += 1
            elif "result" in m:
                stats["results"] += 1
            else:
                stats["chunks"] += 1


def test_fuzzed_stream_through_one_server_and_a_real_writer_is_well_framed():
    rng = random.Random(SEED + 1)
    data = b"".join(fuzz_inputs_that_keep_serving(rng, STREAM_INPUTS))
    max_bytes = 4096
    expected = expect(data, max_bytes)

    read_fd, write_fd = os.pipe()
    received = bytearray()

    def drain() -> None:
        while chunk := os.read(read_fd, 1 << 16):
            received.extend(chunk)

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    writer = Writer(write_fd, capacity=64)  # small outbox: producers wait for the pipe
    worker = FedWorker(writer, max_bytes)
    with hang_guard(120), contextlib.ExitStack() as cleanup:
        cleanup.callback(os.close, read_fd)
        cleanup.callback(drainer.join, 5.0)
        cleanup.callback(os.close, write_fd)
        cleanup.callback(writer.close, 5.0)
        cleanup.callback(worker.stop)
        stopped = False
        pos = 0
        while pos < len(data) and not stopped:
            size = rng.choice([1, 7, 64, 1000, 1 << 16])
            stopped = not worker.feed(data[pos : pos + size])
            pos += size
        if not stopped:
            worker.feed_eof()
        deadline = time.monotonic() + RESPONSE_TIMEOUT_S * 3
        while time.monotonic() < deadline:
            frames = FrameDecoder().feed(bytes(received))
            if sum(isinstance(e, Frame) and not e.body.startswith(b'{"jsonrpc":"2.0","method"') for e in frames) >= (
                expected.total
            ):
                break
            time.sleep(0.05)
    decoder = FrameDecoder()
    events = decoder.feed(bytes(received)) + decoder.feed_eof()
    assert not [e for e in events if isinstance(e, FramingError)], "the writer produced malformed framing"
    messages = decode_bodies([e.body for e in events])
    assert response_ids(messages) == expected.ids


def test_server_answers_after_deeply_nested_json():
    capture = Capture()
    worker = FedWorker(capture, DEFAULT_MAX_MESSAGE_BYTES)
    try:
        worker.feed(b"[" * 5000 + b"\n" + b'{"jsonrpc":"2.0","id":1,"method":"capabilities"}\n')
        worker.feed_eof()
        assert capture.wait_responses(2, RESPONSE_TIMEOUT_S)
    finally:
        worker.stop()
    messages = decode_bodies(capture.bodies)
    assert response_ids(messages) == Counter({None: 1, 1: 1})


async def test_real_worker_survives_a_stream_of_mutated_input(spawn_worker):
    rng = random.Random(SEED + 2)
    inputs = fuzz_inputs_that_keep_serving(rng, SUBPROCESS_INPUTS)
    # Enough newlines to end any partial line, header block or (capped) body the stream leaves open.
    stream = b"".join(inputs) + b"\n" * (SUBPROCESS_MAX_BYTES * 2 + 20_000)
    expected = expect(stream, SUBPROCESS_MAX_BYTES)
    assert not any("shutdown" in methods for methods in expected.methods.values())

    host = await spawn_worker("--max-message-bytes", str(SUBPROCESS_MAX_BYTES), "--log-level", "error")
    await host.send_raw(stream)
    await host.wait_until(lambda: sum("method" not in m for m in host.messages) >= expected.total, timeout=30)
    msg_id, future = host.start("capabilities", id="final-capabilities-check")
    response = await asyncio.wait_for(future, 30)
    assert "result" in response, response
    assert response["result"]["protocol_version"]
    assert not host.malformed, host.malformed
    for message in host.messages:
        check_message(message)
    assert response_ids(host.messages) == expected.ids + Counter({msg_id: 1})
    assert await host.close() == 0
    assert not host.malformed
