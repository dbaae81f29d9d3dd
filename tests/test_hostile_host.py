"""A hostile host, third and fourth rounds (issues 27 and 47; a hostile server behind the openai
backend: tests/test_hostile_engine.py): each case through a real worker over real pipes.
Whatever a host sends or leaves in the data directory, the worker answers precisely, loses
no result, never hangs, and keeps serving."""

from __future__ import annotations

import array
import asyncio
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from protocol.envelope import MAX_PARAMS_DEPTH
from protocol.methods import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.cache_samples import IDENTITY
from tests.conftest import TORCH_ENV, SpawnWorker
from tests.test_cache_sharing import read_only_python
from worker.host import REPO_ROOT, Host, WorkerError
from worker.kvcache import container

DENSE = {"quantization": "none"}  # no attention kernel to build: for tests about something else


async def tiny_worker(spawn_worker: SpawnWorker, model: Path, data_dir: Path, *args: str, load: dict | None = None,
                      **kwargs) -> Host:
    """A worker process on ``data_dir`` with the tiny model loaded (quantized, the default on the CPU, unless
    ``load`` says): a process, since these tests read its log and what it loads from the data directory
    (the attention kernel is loaded once per process)."""
    host = await spawn_worker("--data-dir", str(data_dir), *args, env=TORCH_ENV, process=True, **kwargs)
    await host.call("load", {"model": str(model), **(load or {})}, timeout=300)
    return host


# --- 1: stop strings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop", "field"),
    [(["x" * (MAX_STOP_CHARS + 1)], "params.stop[0]"), ([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], "params.stop")],
)
async def test_stop_strings_past_the_bounds_are_refused_naming_the_field(echo_worker: Host, stop, field):
    with pytest.raises(WorkerError) as caught:
        await echo_worker.call("generate", {"prompt": "abc", "stop": stop})
    assert (caught.value.code, caught.value.kind, caught.value.data["field"]) == (-32602, "invalid_params", field)


async def test_the_largest_stop_strings_allowed_cost_little_per_token(echo_worker: Host):
    """Each stop string is always one character from complete: every token extends the text
    held back, the worst case for matching (quadratic before: seconds for this generation)."""
    stops = ["a" * (MAX_STOP_CHARS - 1) + chr(ord("A") + i) for i in range(MAX_STOP_STRINGS)]
    started = time.perf_counter()
    result = await echo_worker.call("generate", {"prompt": "a" * 2000, "stop": stops, "max_tokens": 4000})
    elapsed = time.perf_counter() - started
    assert result["text"] == "a" * 2000 and result["stop_reason"]["kind"] == "eos"
    assert elapsed < 3.0, elapsed


# --- 2: the weights-digest memo ------------------------------------------------------------------


def memo_of(data_dir: Path, file: Path) -> Path:
    """Where a worker remembers ``file``'s digest (worker.fingerprint)."""
    info = file.stat()
    name = f"{info.st_dev}-{info.st_ino}-{info.st_size}-{info.st_mtime_ns}-{info.st_ctime_ns}.sha256"
    return data_dir / "digests" / name


@pytest.mark.parametrize("plant", ["fifo", "link to /dev/zero", "sparse 8 GB file"])
async def test_a_digest_memo_that_is_not_a_small_regular_file_is_passed_over_and_the_weights_hashed_again(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path, plant: str
):
    weights = tiny_model_dir / "model.safetensors"
    memo = memo_of(tmp_path / "data", weights)
    memo.parent.mkdir(parents=True)
    if plant == "fifo":
        os.mkfifo(memo)
    elif plant == "link to /dev/zero":
        memo.symlink_to("/dev/zero")
    else:
        with open(memo, "wb") as file:
            file.truncate(8 << 30)
    host = await tiny_worker(spawn_worker, tiny_model_dir, tmp_path / "data", load=DENSE)
    assert (await host.call("generate", {"prompt": "the cat", "max_tokens": 4}))["usage"]["completion_tokens"] == 4
    await host.close()
    assert "hashed model.safetensors" in host.stderr.decode()
    assert memo.read_text().strip() == hashlib.sha256(weights.read_bytes()).hexdigest()  # remembered anew


# --- 3, 6: the attention kernel's directory --------------------------------------------------------


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The file name a worker on this machine gives the attention kernel it builds."""
    from worker import c_build
    from worker.backends.transformers import exact_attention

    # Built here, not loaded: this process may have loaded the kernel already (workers run in it).
    return c_build._build(tmp_path_factory.mktemp("kernel") / "kernels", exact_attention.SOURCE).name


async def test_a_fifo_under_the_kernels_name_is_built_over_and_the_worker_answers_meanwhile(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path, kernel_name: str
):
    """Loading a FIFO as a library blocks inside the loader, holding the GIL: nothing would answer."""
    library = tmp_path / "data" / "kernels" / kernel_name
    library.parent.mkdir(parents=True)
    os.mkfifo(library)
    host = await spawn_worker("--data-dir", str(tmp_path / "data"), env=TORCH_ENV, process=True)  # the loader, its log
    _, load = host.start("load", {"model": str(tiny_model_dir)})
    await host.call("capabilities", timeout=30)
    assert "result" in await asyncio.wait_for(load, 300)
    assert (await host.call("generate", {"prompt": "the cat", "max_tokens": 4}))["usage"]["completion_tokens"] == 4
    await host.close()
    assert library.is_file() and "float64" not in host.stderr.decode()


@pytest.mark.parametrize("obstacle", ["kernels is a file", "a directory under the kernel's name", "read-only"])
async def test_a_kernels_directory_that_cannot_be_written_leaves_attention_in_float64_with_a_warning(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path, kernel_name: str, obstacle: str
):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    python = {}
    if obstacle == "kernels is a file":
        (data_dir / "kernels").write_text("not a directory")
    elif obstacle == "a directory under the kernel's name":
        (data_dir / "kernels" / kernel_name).mkdir(parents=True)
    else:
        python = {"python": read_only_python(tmp_path, data_dir)}
    host = await tiny_worker(spawn_worker, tiny_model_dir, data_dir, **python)
    assert (await host.call("generate", {"prompt": "the cat", "max_tokens": 4}))["usage"]["completion_tokens"] == 4
    await host.close()
    assert "attention in float64" in host.stderr.decode()


# --- 4, 15: recording ------------------------------------------------------------------------------


def limited_python(tmp_path: Path, blocks: int) -> str:
    """A python whose files cannot grow past ``blocks`` of 512 bytes (as on a full disk)."""
    wrapper = tmp_path / "python-limited"
    wrapper.write_text(f"#!/bin/sh\nulimit -f {blocks}\nexec '{sys.executable}' \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


async def test_a_transcript_that_cannot_grow_ends_recording_loudly_and_the_worker_serves_on(
    spawn_worker: SpawnWorker, tmp_path: Path
):
    record = tmp_path / "t.jsonl"
    host = await spawn_worker("--record", str(record), python=limited_python(tmp_path, 8))
    await host.call("load", {"backend": "echo"})
    result = await host.call("generate", {"prompt": "x" * 600, "max_tokens": 600}, timeout=30)
    assert result["text"] == "x" * 600
    assert (await host.call("tokenize", {"text": "still here"}))["count"] == 11
    assert await host.close() == 0
    assert "recording stopped: cannot write" in host.stderr.decode() and "File too large" in host.stderr.decode()
    lines = record.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) > 3  # whole lines only, each one JSON
    assert all(json.loads(line) for line in lines[:-1])


@pytest.mark.parametrize("where", ["a missing directory", "a directory", "a FIFO nobody reads"])
async def test_a_record_file_that_cannot_be_opened_is_a_usage_error_with_exit_code_2(tmp_path: Path, where: str):
    path = {"a missing directory": tmp_path / "missing" / "t.jsonl", "a directory": tmp_path}.get(where)
    if path is None:
        path = tmp_path / "fifo"
        os.mkfifo(path)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker", "--record", str(path), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO_ROOT,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2 and stdout == b""
    assert "Traceback" not in stderr.decode()
    assert stderr.decode().splitlines()[-1].startswith(f"lm-worker: error: --record {path}: cannot write it: ")


# --- 17: a host that never reads stderr ---------------------------------------------------------------


# An unknown notification, each a warning of some 10 KB on stderr; then a request to answer.
NOISE = json.dumps({"jsonrpc": "2.0", "method": "x" * 10_000}).encode() + b"\n"
CAPABILITIES = b'{"jsonrpc":"2.0","id":1,"method":"capabilities"}\n'


async def worker_with_unread_stderr() -> tuple[asyncio.subprocess.Process, Callable[[], None], bytearray]:
    """A worker whose stderr is a pipe nobody reads until the returned reader runs (asyncio's pipes
    would be read all along), and the bytes that reader receives."""
    read_end, write_end = os.pipe()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=write_end, cwd=REPO_ROOT,
    )
    os.close(write_end)
    received = bytearray()

    def read_stderr() -> None:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                received.extend(chunk)

    return process, read_stderr, received


async def test_a_host_that_never_reads_stderr_never_stalls_the_worker_and_learns_what_was_dropped():
    """The warnings fill the pipe and the buffer many times before the host reads stderr."""
    process, read_stderr, received = await worker_with_unread_stderr()
    try:
        process.stdin.write(NOISE * 400 + CAPABILITIES)
        await asyncio.wait_for(process.stdin.drain(), 30)  # a worker stalled on stderr stops reading
        reply = await asyncio.wait_for(process.stdout.readline(), 30)
        assert json.loads(reply)["id"] == 1
        reading = asyncio.ensure_future(asyncio.to_thread(read_stderr))  # the host reads at last
        for _ in range(600):
            if b"were dropped" in bytes(received):
                break
            await asyncio.sleep(0.05)
        process.stdin.write(b'{"jsonrpc":"2.0","method":"after-the-gap"}\n')
        process.stdin.close()
        await asyncio.wait_for(reading, 30)
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    dropped = re.search(rb"(\d+) bytes of log output were dropped: the host did not read stderr", received)
    assert dropped and int(dropped[1]) > 2_000_000
    assert b"ignored unknown notification 'after-the-gap'" in received[dropped.end() :]


async def test_a_fatal_signal_while_the_host_reads_no_stderr_ends_the_worker_and_the_host_then_reads_the_report():
    """Python's report of a fatal signal goes straight to the real stderr; with that pipe full (a
    host that does not read it) the report must not wait: the worker dies, it never hangs. A
    host that does read gets the report (kill -BUS stands for a mapped model file cut short)."""
    import signal

    for reads in (False, True):
        process, read_stderr, received = await worker_with_unread_stderr()
        reading = asyncio.ensure_future(asyncio.to_thread(read_stderr)) if reads else None
        try:
            process.stdin.write(NOISE * (20 if reads else 400) + CAPABILITIES)
            await asyncio.wait_for(process.stdin.drain(), 30)
            assert json.loads(await asyncio.wait_for(process.stdout.readline(), 30))["id"] == 1
            process.send_signal(signal.SIGBUS)
            assert await asyncio.wait_for(process.wait(), 30) == -signal.SIGBUS
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        if reading is None:  # what the pipe held when the worker died, read to its end (and closed)
            await asyncio.wait_for(asyncio.to_thread(read_stderr), 30)
        else:
            await asyncio.wait_for(reading, 30)
            assert b"Fatal Python error: Bus error" in received


# --- 7: a shared cache directory -------------------------------------------------------------------


def other_user_python(tmp_path: Path) -> str:
    """A python that runs the worker as root of a user namespace of its own: files of users not
    mapped there (1000, 1001) are other users' to it, as on a machine shared by several."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "--user", "--map-root-user", "true"]).returncode:
        pytest.skip("needs root and user namespaces to act as several users")
    wrapper = tmp_path / "python-one-user"
    wrapper.write_text(f"#!/bin/sh\nexec unshare --user --map-root-user '{sys.executable}' \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


async def test_an_auto_cache_of_another_user_in_a_sticky_directory_stays_and_the_result_is_kept(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path
):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 1000, 1000)
    shared.chmod(0o1777)
    host = await tiny_worker(spawn_worker, tiny_model_dir, tmp_path / "data", "--cache-dir", str(shared),
                             python=other_user_python(tmp_path), load=DENSE)
    prompt = (await host.call("tokenize", {"text": "the cat sat on the mat and the dog runs to the river. " * 3}))
    first = await host.call("generate", {"tokens": prompt["tokens"], "max_tokens": 4, "cache": "auto"})
    theirs = shared / f"{first['cache']['stored']}.kvc"
    os.chown(theirs, 1001, 1001)  # as if another user's worker had stored it
    turn = prompt["tokens"] + first["tokens"] + [prompt["tokens"][1]] * 4  # extends what the first one stored
    second = await host.call("generate", {"tokens": turn, "max_tokens": 4, "cache": "auto"})
    assert second["cache"]["reused_tokens"] > 0 and second["cache"]["stored"] not in (None, first["cache"]["stored"])
    assert theirs.exists() and (shared / f"{second['cache']['stored']}.kvc").exists()
    assert second["cache"]["store_reason"] == (
        f"stored; {first['cache']['stored']!r}, which it extends, could not be deleted: Operation not permitted"
    )


# --- 8, 12: headers that claim what the model does not compute -------------------------------------


def rewrite_cache(source: Path, target: Path, change) -> None:
    """``target``: a cache sound in itself (checksums, layout) of ``source``'s contents, each tensor
    passed through ``change(spec, data) -> (spec, data)``: what a forger with the format at hand makes."""
    loaded = container.load(source)
    header, tensors = loaded.header, []
    for entry, view in zip(header.tensors, loaded.tensors, strict=True):
        spec = container.TensorSpec(name=entry.name, kind=entry.kind, layer=entry.layer, shape=tuple(entry.shape),
                                    dtype=entry.dtype, state=entry.state, position=entry.position)
        spec, data = change(spec, bytes(view))
        tensors.append((spec, memoryview(data)))
    contents = container.Contents(identity=header.identity, tokens=header.tokens, layers=header.layers,
                                  states=header.states, created_by=header.created_by)
    container.write(target, contents, tensors)


def rows(data: bytes, width: int, keep: int) -> bytes:
    """The first ``keep`` of every ``width`` float32 values."""
    values = array.array("f", data)
    return b"".join(values[i : i + keep].tobytes() for i in range(0, len(values), width))


def fewer_heads(spec, data):
    if spec.kind not in ("key", "value"):
        return spec, data
    _, heads, positions, dim = spec.shape
    return msgspec.structs.replace(spec, shape=(1, 1, positions, dim)), data[: positions * dim * 4]


def half_head_size(spec, data):
    if spec.kind not in ("key", "value"):
        return spec, data
    _, heads, positions, dim = spec.shape
    return msgspec.structs.replace(spec, shape=(1, heads, positions, dim // 2)), rows(data, dim, dim // 2)


def bfloat16(spec, data):
    """float32 cut to bfloat16: the upper two bytes of each value."""
    cut = bytearray(len(data) // 2)
    cut[0::2], cut[1::2] = data[2::4], data[3::4]
    return msgspec.structs.replace(spec, dtype="bfloat16"), bytes(cut)


def shorter_conv_state(spec, data):
    if spec.kind != "conv":
        return spec, data
    *rest, kernel = spec.shape
    return msgspec.structs.replace(spec, shape=(*rest, kernel - 1)), rows(data, kernel, kernel - 1)


@pytest.mark.parametrize(
    ("family", "forgeries"),
    [("llama", {"fewer-heads": fewer_heads, "half-head-size": half_head_size, "bfloat16": bfloat16}),
     ("qwen3_5", {"shorter-conv-state": shorter_conv_state, "bfloat16": bfloat16})],
)
async def test_a_sound_cache_of_other_heads_sizes_or_dtypes_than_the_models_is_corrupt_and_auto_skips_it(
    spawn_worker: SpawnWorker, tiny_models, tmp_path: Path, family: str, forgeries: dict
):
    caches = tmp_path / "caches"
    host = await tiny_worker(spawn_worker, tiny_models(family), tmp_path / "data", "--cache-dir", str(caches),
                             load=DENSE)
    prompt = "the cat sat on the mat and the dog runs to the river. " * 3
    plain = (await host.call("generate", {"prompt": prompt + "hello", "max_tokens": 8}))["tokens"]
    await host.call("prefill", {"prompt": prompt, "cache": "good"})
    for name, change in forgeries.items():
        rewrite_cache(caches / "good.kvc", caches / f"{name}.kvc", change)
    (caches / "good.kvc").unlink()
    named = {}
    for name in forgeries:
        with pytest.raises(WorkerError) as caught:
            await host.call("generate", {"prompt": prompt + "hello", "max_tokens": 8, "cache": name})
        named[name] = (caught.value.kind, caught.value.message)
    auto = await host.call("generate", {"prompt": prompt + "hello", "max_tokens": 8, "cache": "auto"})
    assert all(kind == "cache_corrupt" and "where the model's is" in message for kind, message in named.values()), named
    assert auto["tokens"] == plain and auto["cache"]["reused_tokens"] == 0
    assert {s["ref"] for s in auto["cache"]["skipped"]} == set(forgeries)


def claim_positions(path: Path, positions: int) -> None:
    """Rewrite a full-attention cache's header to claim ``positions`` (its tensors laid out anew,
    as large as that takes), as a sparse file: a few megabytes on disk."""
    data = path.read_bytes()
    header = msgspec.json.decode(data[48 : 48 + int.from_bytes(data[8:16], "little")])
    header.update(tokens=[1] * positions, sequence_length=positions)
    offset = 0
    for tensor in header["tensors"]:
        _, heads, _, dim = tensor["shape"]
        tensor.update(shape=[1, heads, positions, dim], strides=[heads * positions * dim * 4, positions * dim * 4,
                                                                 dim * 4, 4], nbytes=heads * positions * dim * 4)
    start = -(-(48 + len(msgspec.json.encode(header)) + 64 * len(header["tensors"])) // 64) * 64
    offset = start
    for tensor in header["tensors"]:
        tensor["offset"] = offset
        offset = -(-(offset + tensor["nbytes"]) // 64) * 64
    encoded = msgspec.json.encode(header)
    with open(path, "wb") as file:
        file.write(data[:8] + len(encoded).to_bytes(8, "little") + hashlib.sha256(encoded).digest() + encoded)
        file.truncate(header["tensors"][-1]["offset"] + header["tensors"][-1]["nbytes"])


async def test_a_cache_claiming_more_positions_than_the_context_is_refused_before_its_tensors_are_read(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path
):
    caches = tmp_path / "caches"
    host = await tiny_worker(spawn_worker, tiny_model_dir, tmp_path / "data", "--cache-dir", str(caches), load=DENSE)
    await host.call("prefill", {"prompt": "the cat sat on the mat", "cache": "huge"})
    claim_positions(caches / "huge.kvc", 3_000_000)  # 1.5 GB of keys and values, on a tiny model
    assert (caches / "huge.kvc").stat().st_blocks * 512 < 64 << 20
    with pytest.raises(WorkerError) as caught:
        await host.call("generate", {"prompt": "the cat sat on the mat too", "max_tokens": 2, "cache": "huge"})
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{host.process.pid}/status").read_text())[1]) << 10
    assert caught.value.kind == "cache_corrupt"
    assert "3000000 positions, more than the model's context of 2048" in caught.value.message
    assert peak < 1 << 30, peak


# --- 16: long headers ----------------------------------------------------------------------------------


def write_long_header(path: Path, header_bytes: int) -> None:
    """A cache of no tokens whose header, sound and checksummed, is ``header_bytes`` long."""
    header = msgspec.json.encode({
        "format": "KVC2", "identity": msgspec.to_builtins(IDENTITY), "sequence_start": 0, "sequence_length": 0,
        "tokens": [], "prefix_offsets": [], "prefix_hashes": ["x"], "layers": [{"index": 0, "kind": "full"},
        {"index": 1, "kind": "full"}], "states": [], "tensors": [], "created_by": "a forger",
    })
    header = header.replace(b'["x"]', b'["' + b"x" * (header_bytes - len(header) + 1) + b'"]')
    path.write_bytes(container.MAGIC + len(header).to_bytes(8, "little") + hashlib.sha256(header).digest() + header)


async def test_a_header_past_the_bound_is_not_read_so_a_cancel_behind_a_listing_is_answered_at_once(
    spawn_worker: SpawnWorker, tmp_path: Path
):
    caches = tmp_path / "caches"
    caches.mkdir()
    write_long_header(caches / "long.kvc", 80 << 20)
    host = await spawn_worker("--cache-dir", str(caches))
    await host.call("load", {"backend": "echo", "token_delay_ms": 20})
    generate_id, generating = host.start("generate", {"prompt": "x" * 500})
    await host.wait_until(lambda: host.chunks[generate_id])
    started = time.perf_counter()
    _, listing = host.start("cache/list")
    assert (await host.call("cancel", {"id": generate_id}))["cancelled"]
    cancel_s = time.perf_counter() - started
    listed, generated = await asyncio.wait_for(asyncio.gather(listing, generating), 60)
    assert listed["result"]["caches"] == [] and generated["result"]["finish_reason"] == "cancelled"
    with pytest.raises(WorkerError) as caught:
        await host.call("cache/info", {"cache": "long"})
    assert caught.value.kind == "cache_corrupt"
    assert f"a header of {80 << 20} bytes, more than the 16 MiB a reader accepts" in caught.value.message
    assert cancel_s < 1.0, cancel_s


# --- 13: temporaries ------------------------------------------------------------------------------------


async def test_only_temporaries_named_exactly_as_the_worker_names_its_own_are_removed(
    spawn_worker: SpawnWorker, tmp_path: Path
):
    caches = tmp_path / "caches"
    caches.mkdir()
    ours = ".sys.kvc.4242.k3j9x0ab.tmp"  # what container.write names a temporary of sys.kvc
    others = [".notes.tmp", ".sys.kvc.tmp", ".sys.kvc.4242.tmp", ".sys.kvc.x.k3j9x0ab.tmp", ".sys.kvc.4242.K3J9X0AB.tmp",
              ".sys.kvc.4242.k3j9x0abc.tmp", ".editor.swp.4242.k3j9x0ab.tmp"]
    for name in [ours, *others]:
        (caches / name).write_text("someone's")
    host = await spawn_worker("--cache-dir", str(caches))
    await host.call("cache/list")  # the store opens the directory
    assert sorted(p.name for p in caches.iterdir()) == sorted(others)


# --- found attacking again: deep nesting and a lone surrogate ------------------------------------------


async def test_a_deeply_nested_request_with_a_lone_surrogate_is_refused_with_its_id_and_the_worker_reads_on(
    echo_worker: Host
):
    depth = 600  # within what the JSON decoder takes; the lenient second reading walked it recursively
    await echo_worker.send_raw(b'{"jsonrpc":"2.0","id":1,"method":"capabilities","params":{"x":'
                               + b'{"a":' * depth + b'"\\ud83d"' + b"}" * depth + b"}}\n")
    assert (await echo_worker.call("tokenize", {"text": "ok"}, timeout=10))["count"] == 3
    [refused] = [m for m in echo_worker.messages if "error" in m]
    assert (refused["id"], refused["error"]["code"], refused["error"]["data"]["field"]) == (1, -32602, "params.x.a.a.a")


# --- 9: deep tool parameters ----------------------------------------------------------------------------


async def test_tool_parameters_nested_300_deep_are_refused_naming_the_field(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path
):
    schema: dict = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}}
    model = tmp_path / "tiny-long"  # a context the tools' long system message fits in
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1 << 16}))
    host = await tiny_worker(spawn_worker, model, tmp_path / "data", load=DENSE)
    tools = [{"type": "function", "function": {"name": "deep", "parameters": schema}}]
    for choice in ("required", "auto"):
        with pytest.raises(WorkerError) as caught:
            await host.call("generate", {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                         "tool_choice": choice, "max_tokens": 4})
        assert (caught.value.code, caught.value.data.get("field")) == (-32602, "params.tools[0].function.parameters")
    assert (await host.call("generate", {"prompt": "the cat", "max_tokens": 4}))["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("levels", [600, 900, 200_000])
async def test_tool_parameters_nested_past_what_the_decoder_takes_are_refused_at_once_with_the_requests_id(
    echo_worker: Host, levels: int
):
    """Issue 47 item 7: past about a thousand JSON levels the decoder gave up and the parse error's
    id was null, so the request itself was never answered. A reading of the message without its
    deepest values (linear in its length) answers it with its id, whatever the depth."""
    schema = b'{"type":"string"}'
    for _ in range(levels):
        schema = b'{"type":"object","properties":{"a":' + schema + b"}}"
    started = time.perf_counter()
    await echo_worker.send_raw(
        b'{"jsonrpc":"2.0","id":"deep","method":"generate","params":{"messages":[{"role":"user","content":"hi"}],'
        b'"tool_choice":"required","max_tokens":4,"tools":[{"type":"function","function":{"name":"deep",'
        b'"parameters":' + schema + b"}}]}}\n"
    )
    answer = await echo_worker.wait_for(lambda m: m.get("id") == "deep", timeout=10)
    elapsed = time.perf_counter() - started
    assert (answer["error"]["code"], answer["error"]["data"]["field"]) == (-32602, "params.tools[0].function.parameters")
    assert f"more than {MAX_PARAMS_DEPTH} levels deep" in answer["error"]["message"]
    assert elapsed < 2.0, elapsed
    assert (await echo_worker.call("tokenize", {"text": "ok"}))["count"] == 3


# --- issue 47 item 10: a library's BaseException -------------------------------------------------


@pytest.fixture
def panicking_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with a tokenizer whose pre-tokenizer's regex gives up on "a"*40+"b": the
    tokenizers library then raises pyo3's PanicException, a BaseException, not an Exception."""
    model = tmp_path / "tiny-panicking"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    split = {"type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated", "invert": False}
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, tokenizer["pre_tokenizer"]]}
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model


async def test_a_tokenizer_that_panics_fails_that_request_alone_and_every_lane_keeps_serving(
    spawn_worker: SpawnWorker, panicking_model: Path
):
    host = await spawn_worker()
    await host.call("load", {"model": str(panicking_model), **DENSE}, timeout=300)
    panics = "a" * 40 + "b"
    for method, params in [("tokenize", {"text": panics}),
                           ("render", {"messages": [{"role": "user", "content": panics}]}),
                           ("generate", {"prompt": panics, "max_tokens": 2})]:
        with pytest.raises(WorkerError) as caught:
            await host.call(method, params, timeout=30)
        assert (caught.value.code, caught.value.kind) == (-32603, "internal_error"), (method, caught.value.message)
        assert "PanicException" in caught.value.message
    tokens = (await host.call("tokenize", {"text": "the cat"}, timeout=30))["tokens"]
    assert (await host.call("detokenize", {"tokens": tokens}, timeout=30))["text"].endswith("the cat")
    assert (await host.call("render", {"messages": [{"role": "user", "content": "hi"}]}, timeout=30))["count"] > 0
    _, failed = host.start("generate", {"prompt": panics, "max_tokens": 2}, id="panics")
    assert (await asyncio.wait_for(failed, 30))["error"]["code"] == -32603
    _, reused = host.start("generate", {"prompt": "the cat", "max_tokens": 2}, id="panics")
    assert (await asyncio.wait_for(reused, 30))["result"]["usage"]["completion_tokens"] == 2, "the id is free again"
    assert await host.close() == 0, "the lanes drain and end"


# --- issue 47 item 12: cancels of requests queued behind a running load ------------------------------


async def test_requests_queued_behind_a_running_load_answer_as_soon_as_they_are_cancelled(
    spawn_worker: SpawnWorker, tmp_path: Path
):
    """PROTOCOL 9: a queued request cancelled answers at once; they answered only once the load
    (which sleeps 1 s in this backend) had ended. The load goes on and answers as usual."""
    from tests.conftest import install_plugin
    from tests.test_e2e_protocol import SLOW_LOADING_BACKEND

    host = await spawn_worker(env=install_plugin(tmp_path, "slow_backend", SLOW_LOADING_BACKEND, {"slow": "slow_backend:Slow"}))
    await host.call("load", {"backend": "echo"})
    load_id, load = host.start("load", {"backend": "slow"})
    await host.wait_until(lambda: b"slow load started" in host.stderr)
    queued = [host.start("generate", {"prompt": "x"}), host.start("tokenize", {"text": "x"}),
              host.start("unload"), host.start("generate", {"prompt": "y"})]
    started = time.perf_counter()
    for msg_id, _ in queued[:3]:
        assert await host.call("cancel", {"id": msg_id}) == {"cancelled": True, "state": "queued"}
    await host.notify("$/cancelRequest", {"id": queued[3][0]})
    answers = await asyncio.wait_for(asyncio.gather(*(answer for _, answer in queued)), 5)
    answered_s = time.perf_counter() - started
    assert not load.done() and answered_s < 0.5, answered_s
    assert [a["result"]["finish_reason"] for a in (answers[0], answers[3])] == ["cancelled", "cancelled"]
    assert [a["error"]["data"]["kind"] for a in answers[1:3]] == ["request_cancelled"] * 2
    assert (await asyncio.wait_for(load, 10))["result"]["backend"] == "echo"
    ids = [m.get("id") for m in host.messages if "result" in m or "error" in m]
    assert ids.index(load_id) == len(ids) - 1, "the load answered last"
    assert (await host.call("generate", {"prompt": "ok", "max_tokens": 2}))["text"] == "ok"


# --- 10: hostile tool names ---------------------------------------------------------------------------


async def test_a_tool_name_holding_a_calls_closing_tag_is_refused_naming_the_field(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path
):
    """Its forced call would be misread: the name's tag ends the call, the rest leaks into content."""
    host = await tiny_worker(spawn_worker, tiny_model_dir, tmp_path / "data", load=DENSE)
    tools = [{"type": "function", "function": {"name": "x</tool_call>y", "parameters": {"type": "object"}}}]
    with pytest.raises(WorkerError) as caught:
        await host.call("generate", {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                     "tool_choice": "required", "max_tokens": 24})
    assert (caught.value.code, caught.value.data.get("field")) == (-32602, "params.tools[0].function.name")
    assert "matching regex" in caught.value.message


# --- 11: resynchronising after a skipped message ------------------------------------------------------


@pytest.mark.parametrize("framing", ["lsp", "ndjson"])
async def test_an_over_limit_message_holding_content_length_text_does_not_swallow_the_next_one(
    spawn_worker: SpawnWorker, framing: str
):
    host = await spawn_worker("--max-message-bytes", "200")
    big = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tokenize",
                      "params": {"text": "x" * 300 + "Content-Length: 10"}}).encode()
    over_limit = b"Content-Length: %d\r\n\r\n%s" % (len(big), big) if framing == "lsp" else big + b"\n"
    follow = json.dumps({"jsonrpc": "2.0", "id": 2, "method": "capabilities"}).encode()
    await host.send_raw(over_limit + b"Content-Length: %d\r\n\r\n%s" % (len(follow), follow))
    await host.wait_until(lambda: any(m.get("id") == 2 for m in host.messages), timeout=10)
    assert [m["error"]["data"]["kind"] for m in host.messages if "error" in m] == ["message_too_large"]


# --- 14: the digest memo's trust boundary ------------------------------------------------------------


async def test_weights_changed_in_place_with_their_size_and_times_put_back_are_hashed_again(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path
):
    """Only a writer of the data directory can make a memo lie (PROTOCOL 13: it is trusted like
    the model files); a change to the weights themselves always gets a new status-change time."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, model)
    caches, weights = tmp_path / "caches", model / "model.safetensors"
    first = await tiny_worker(spawn_worker, model, tmp_path / "data", "--cache-dir", str(caches), load=DENSE)
    await first.call("prefill", {"prompt": "the cat sat on the mat", "cache": "before"})
    await first.close()
    before = weights.stat()
    with open(weights, "r+b") as file:  # the last byte of the last tensor
        file.seek(-1, os.SEEK_END)
        last = file.read(1)
        file.seek(-1, os.SEEK_END)
        file.write(bytes([last[0] ^ 1]))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    second = await tiny_worker(spawn_worker, model, tmp_path / "data", "--cache-dir", str(caches), load=DENSE)
    with pytest.raises(WorkerError) as caught:
        await second.call("generate", {"prompt": "the cat sat on the mat too", "max_tokens": 2, "cache": "before"})
    await second.close()
    assert caught.value.kind == "cache_identity_mismatch" and "weights_sha256" in caught.value.message
    assert "hashed model.safetensors" in second.stderr.decode()


# --- 5: the kernel's build ---------------------------------------------------------------------------


async def test_a_library_without_the_kernel_under_its_name_is_built_again_and_the_new_one_used(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path, kernel_name: str
):
    """A shared library that loads but lacks the kernel's function stayed loaded under that name,
    so the library built over it was never loaded: float64 attention for the whole process."""
    kernels = tmp_path / "data" / "kernels"
    kernels.mkdir(parents=True)
    (tmp_path / "other.c").write_text("int lmw_something_else(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(kernels / kernel_name), str(tmp_path / "other.c")], check=True)
    host = await tiny_worker(spawn_worker, tiny_model_dir, tmp_path / "data")
    assert (await host.call("generate", {"prompt": "the cat", "max_tokens": 4}))["usage"]["completion_tokens"] == 4
    await host.close()
    stderr = host.stderr.decode()
    assert "float64" not in stderr and "building it again" in stderr and "lmw_attention" in stderr


# --- issue 47 items 1 and 2: chat templates that never end or build a huge string ----------------------


def with_template(tiny_model_dir: Path, target: Path, template: str) -> Path:
    """The tiny model with ``template`` as its chat template."""
    shutil.copytree(tiny_model_dir, target)
    (target / "chat_template.jinja").write_text(template)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


HUGE_TEMPLATES = {
    "doubled 40 times": "{% set ns = namespace(v='x') %}{% for i in range(40) %}{% set ns.v = ns.v ~ ns.v %}"
                        "{% endfor %}{{ ns.v }}",
    "100 MB of text to tokenize": "{{ 'x' * 100000000 }}",
    "the tools 100,000 times": "{% for i in range(100000) %}{{ tools | tojson }}{% endfor %}",
}
NEVER_ENDS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
TOOLS = [{"type": "function", "function": {"name": "f", "description": "a tool " * 20}}]


@pytest.mark.parametrize("template", HUGE_TEMPLATES)
async def test_a_chat_template_that_builds_a_huge_string_is_refused_naming_the_template_and_memory_stays_bounded(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path, template: str
):
    """The worker grew until the OOM killer ended it: the template's string, then its tokens."""
    model = with_template(tiny_model_dir, tmp_path / "huge", HUGE_TEMPLATES[template])
    host = await tiny_worker(spawn_worker, model, tmp_path / "data", load=DENSE)
    asked = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    for method, params in [("render", asked), ("generate", {**asked, "max_tokens": 2})]:
        with pytest.raises(WorkerError) as caught:
            await host.call(method, params, timeout=60)
        assert (caught.value.code, caught.value.data["field"]) == (-32602, "params.messages"), caught.value.message
        assert "chat template" in caught.value.message
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{host.process.pid}/status").read_text())[1]) << 10
    assert (await host.call("generate", {"prompt": "the cat", "max_tokens": 2}))["usage"]["completion_tokens"] == 2
    assert peak < 1536 << 20, peak


async def test_a_chat_template_that_never_ends_holds_only_its_own_request_and_a_cancel_ends_it_at_once(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path
):
    """It rendered on the cache I/O thread, which every generate needs to start and finish: the
    running stream never got its result, later requests never started, and its cancel answered
    cancelled true with nothing after."""
    model = with_template(tiny_model_dir, tmp_path / "never", NEVER_ENDS)
    host = await spawn_worker()
    await host.call("load", {"model": str(model), **DENSE}, timeout=300)
    messages = [{"role": "user", "content": "hi"}]
    streaming_id, streaming = host.start("generate", {"prompt": "the cat", "max_tokens": 40})
    await host.wait_until(lambda: host.chunks[streaming_id])
    stuck_id, stuck = host.start("generate", {"messages": messages, "max_tokens": 4})
    rendering_id, rendering = host.start("render", {"messages": messages})
    await asyncio.sleep(0.5)  # both templates are rendering
    assert (await asyncio.wait_for(streaming, 30))["result"]["usage"]["completion_tokens"] == 40
    later = await host.call("generate", {"prompt": "the dog", "max_tokens": 4}, timeout=30)
    assert later["usage"]["completion_tokens"] == 4
    started = time.perf_counter()
    assert await host.call("cancel", {"id": stuck_id}) == {"cancelled": True, "state": "running"}
    assert await host.call("cancel", {"id": rendering_id}) == {"cancelled": True, "state": "running"}
    stuck_answer, rendering_answer = await asyncio.wait_for(asyncio.gather(stuck, rendering), 5)
    assert time.perf_counter() - started < 1.0
    assert stuck_answer["result"]["finish_reason"] == "cancelled"
    assert rendering_answer["error"]["data"]["kind"] == "request_cancelled"
    assert (await host.call("tokenize", {"text": "still here"}))["count"] > 0


async def test_a_chat_template_past_its_deadline_is_refused_naming_the_template(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from worker import chat_template

    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 1.0)  # the worker runs in this process
    model = with_template(tiny_model_dir, tmp_path / "never", NEVER_ENDS)
    host = await spawn_worker()
    await host.call("load", {"model": str(model), **DENSE}, timeout=300)
    for method in ("render", "generate", "prefill"):
        params = {"messages": [{"role": "user", "content": "hi"}], **({"cache": "memory://x"} if method == "prefill" else {})}
        started = time.perf_counter()
        with pytest.raises(WorkerError) as caught:
            await host.call(method, params, timeout=30)
        assert time.perf_counter() - started < 5.0
        assert (caught.value.code, caught.value.data["field"]) == (-32602, "params.messages")
        assert "chat template did not finish rendering these messages within 1 s" in caught.value.message


# --- issue 47 item 17: a model's files that say what the worker cannot use ------------------------------


@pytest.fixture(scope="module")
def tiny_mamba(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Mamba with the tiny model's tokenizer: its mixer multiplies by dt_proj.weight itself."""
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    model = tmp_path_factory.mktemp("tiny-mamba")
    torch.manual_seed(0)
    config = MambaConfig(vocab_size=512, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                         time_step_rank=8, bos_token_id=1, eos_token_id=3, pad_token_id=0)
    MambaForCausalLM(config).save_pretrained(model)
    for file in tiny_model_dir.iterdir():
        if file.name.startswith("tokenizer") or file.name == "chat_template.jinja":
            shutil.copy(file, model / file.name)
    return model


async def test_a_linear_whose_module_reads_its_weight_stays_dense_and_the_log_says_so(
    spawn_worker: SpawnWorker, tiny_mamba: Path, tmp_path: Path
):
    """It loaded as int8 and every pass failed: 'Int8Linear' object has no attribute 'weight'."""
    host = await tiny_worker(spawn_worker, tiny_mamba, tmp_path / "data")
    assert (await host.call("generate", {"prompt": "the cat", "max_tokens": 4}))["usage"]["completion_tokens"] == 4
    await host.close()
    [logged] = [line for line in host.stderr.decode().splitlines() if "kept dense" in line]
    assert "since each one's module's code reads the weight itself: " in logged
    assert "backbone.layers.0.mixer.dt_proj" in logged and "in_proj" not in logged


@pytest.mark.parametrize(("file", "value"), [("generation_config.json", 1 << 40), ("generation_config.json", -5),
                                             ("generation_config.json", "3"), ("config.json", [3, 512])])
async def test_an_eos_id_that_is_no_token_of_the_model_is_refused_at_load_naming_the_file_and_value(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path, file: str, value
):
    """The tokenizer could not convert it: every request failed with -32603."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, model)
    settings = json.loads((model / file).read_text())
    (model / file).write_text(json.dumps({**settings, "eos_token_id": value}))
    host = await spawn_worker()
    with pytest.raises(WorkerError) as caught:
        await host.call("load", {"model": str(model), **DENSE}, timeout=300)
    bad = value[-1] if isinstance(value, list) else value
    assert (caught.value.code, caught.value.kind, caught.value.data["field"]) == (-32002, "model_load_failed", "params.model")
    assert caught.value.message.startswith(f"{file} names the EOS token {bad!r}, which is no token of this model")


@pytest.mark.parametrize("value", [-1, 0, 1 << 31])
async def test_a_context_length_that_is_no_number_of_tokens_is_refused_at_load_naming_config_json(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, tmp_path: Path, value
):
    """It loaded, and load answered context_length -1."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": value}))
    host = await spawn_worker()
    with pytest.raises(WorkerError) as caught:
        await host.call("load", {"model": str(model), **DENSE}, timeout=300)
    assert (caught.value.code, caught.value.data["field"]) == (-32002, "params.model")
    assert f"config.json gives the context length (max_position_embeddings) as {value!r}" in caught.value.message


# --- issue 47 items 3, 4 and 9: a gguf or directory through transformers' loader ------------------------


def gguf_with_array(path: Path, items: int) -> Path:
    """A gguf of no tensors whose one metadata entry is an array of ``items`` bytes."""
    key = b"x.big"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
                     + len(key).to_bytes(8, "little") + key + (9).to_bytes(4, "little") + (0).to_bytes(4, "little")
                     + items.to_bytes(8, "little") + bytes(items))
    return path


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize(("items", "says"), [(20_000_000, "is an array of 20000000 items, more than 16777216"),
                                             (3_000_000, "metadata arrays hold 3000000 items, more than the 2097152")])
async def test_a_gguf_header_is_read_by_the_bounded_reader_before_transformers_loader_whatever_the_quantization(
    spawn_worker: SpawnWorker, tmp_path: Path, quantization: str, items: int, says: str
):
    """gguf-py's reader, under transformers' gguf loader, made a Python object of each of the
    20,000,000 items: 9 GB."""
    model = gguf_with_array(tmp_path / "big.gguf", items)
    host = await spawn_worker("--data-dir", str(tmp_path / "data"), env=TORCH_ENV, process=True)
    with pytest.raises(WorkerError) as caught:
        await host.call("load", {"model": str(model), "quantization": quantization}, timeout=120)
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{host.process.pid}/status").read_text())[1]) << 10
    assert (caught.value.code, caught.value.data["field"]) == (-32002, "params.model")
    assert says in caught.value.message
    assert peak < 1536 << 20, peak


@pytest.fixture
def tiny_missing_and_extra(tiny_model_dir: Path, tmp_path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    model = tmp_path / "tiny-missing"
    shutil.copytree(tiny_model_dir, model)
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    tensors["model.extra.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return model


@pytest.mark.parametrize("quantization", ["none", "int8"])
async def test_a_model_directory_with_a_weight_missing_or_left_over_is_refused_naming_them(
    spawn_worker: SpawnWorker, tiny_missing_and_extra: Path, quantization: str
):
    """transformers made up the missing weight at random, and the model answered nonsense."""
    host = await spawn_worker()
    with pytest.raises(WorkerError) as caught:
        await host.call("load", {"model": str(tiny_missing_and_extra), "quantization": quantization}, timeout=300)
    assert (caught.value.code, caught.value.data["field"]) == (-32002, "params.model")
    assert "tensors 1 missing (model.layers.0.mlp.up_proj.weight); 1 not used by the model (model.extra.weight)" in (
        caught.value.message
    )


async def test_a_gguf_loaded_by_transformers_with_a_tensor_missing_is_refused_naming_it(
    spawn_worker: SpawnWorker, tiny_gguf: Path, tmp_path: Path
):
    from tests.test_gguf_model import rewritten

    model = rewritten(tiny_gguf, tmp_path / "missing.gguf", drop="blk.0.ffn_up.weight")
    host = await spawn_worker()
    with pytest.raises(WorkerError) as caught:
        await host.call("load", {"model": str(model), **DENSE}, timeout=300)
    assert (caught.value.code, caught.value.data["field"]) == (-32002, "params.model")
    assert "tensors 1 missing (model.layers.0.mlp.up_proj.weight)" in caught.value.message
    info = await host.call("load", {"model": str(tiny_gguf), **DENSE}, timeout=300)  # the whole file still loads
    assert info["quantization"] == "none"
