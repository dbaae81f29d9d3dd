"""What hosts do that the protocol allows or that a host gets wrong: each is answered precisely,
loses nothing, and leaves the worker serving."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TORCH_ENV, SpawnWorker
from worker import transcript
from worker.host import Host, WorkerError
from worker.replay import replay


async def test_a_response_from_the_host_gets_no_reply_whatever_its_id(echo_worker: Host):
    for response in (
        b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"no"}}\n',
        b'{"jsonrpc":"2.0","id":[1],"result":1}\n',
        b'{"jsonrpc":"1.0","id":7,"result":null}\n',
    ):
        await echo_worker.send_raw(response)
    await echo_worker.call("capabilities")
    assert [m for m in echo_worker.messages if "error" in m] == []


async def test_two_workers_wired_to_each_other_fall_silent(spawn_worker: SpawnWorker):
    """Each answers the other's error once at most: nothing to answer then, so no loop."""
    a, b = await spawn_worker(), await spawn_worker()
    await a.send_raw(b'{"jsonrpc":"2.0","id":null}\n{"jsonrpc":"2.0","id":"x"}\n')
    await a.wait_for(lambda m: m.get("id") == "x")
    assert len(a.messages) == 2 and all("error" in m for m in a.messages)
    for message in a.messages:  # a's error responses, fed to b, as a pipe between them would
        await b.send(message)
    await b.call("capabilities")
    assert [m for m in b.messages if "error" in m] == []


async def test_a_lone_surrogate_escape_is_replaced_and_the_request_answered_with_its_id(echo_worker: Host):
    """JSON.stringify writes a string cut inside an emoji as a lone "\\ud83d"."""
    request = b'{"jsonrpc":"2.0","id":"cut","method":"tokenize","params":{"text":"a\\ud83d b \\ud83d\\ude00"}}\n'
    await echo_worker.send_raw(request)
    answer = await echo_worker.wait_for(lambda m: m.get("id") == "cut")
    assert answer["result"]["tokens"][1:] == list("a\ufffd b \U0001F600".encode())


async def test_the_python_host_raises_at_once_for_a_request_it_cannot_encode(echo_worker: Host):
    """A str holding a lone surrogate is not UTF-8: the caller hears so, instead of waiting for
    an answer to a request that was never sent."""
    with pytest.raises(UnicodeEncodeError):
        await echo_worker.call("tokenize", {"text": "\ud800 lone"}, timeout=5)
    assert (await echo_worker.call("tokenize", {"text": "ok"}))["count"] >= 2


async def test_a_body_that_is_not_json_even_leniently_is_still_a_parse_error(echo_worker: Host):
    await echo_worker.send_raw(b'{"jsonrpc":"2.0","id":3,"method":"tokenize","params":{"text":NaN}}\n')
    error = await echo_worker.wait_for(lambda m: "error" in m)
    assert error["id"] is None and error["error"]["code"] == -32700
    await echo_worker.call("capabilities")


@pytest.mark.parametrize(
    "params",
    [{"temperature": 1e-45, "seed": 1}, {"temperature": 1.0, "repetition_penalty": 1e-300, "seed": 2},
     {"temperature": 1.0, "seed": -(2**63)}, {"temperature": 1.0, "seed": 2**63 - 1}],
    ids=["tiny-temperature", "tiny-penalty", "lowest-seed", "highest-seed"],
)
async def test_extreme_sampling_values_that_pass_validation_generate(spawn_worker: SpawnWorker, tiny_model_dir, params):
    host = await spawn_worker(env=TORCH_ENV)
    await host.call("load", {"model": str(tiny_model_dir)}, timeout=120)
    result = await host.call("generate", {"prompt": "the cat sat", "max_tokens": 6, **params}, timeout=120)
    assert len(result["tokens"]) == 6


@pytest.mark.parametrize("seed", [2**63, 2**64, -(2**63) - 1])
async def test_a_seed_outside_64_bits_is_refused_naming_the_field(echo_worker: Host, seed: int):
    with pytest.raises(WorkerError) as caught:
        await echo_worker.call("generate", {"prompt": "x", "temperature": 1.0, "seed": seed})
    assert caught.value.kind == "invalid_params" and caught.value.data["field"] == "params.seed"


@pytest.mark.parametrize(
    ("params", "field"),
    [({"device": "cdua"}, "params.device"), ({"model": "/no/such/model"}, "params.model"),
     ({"token_delay_ms": 5}, "params.token_delay_ms")],
)
async def test_a_load_with_a_mistake_leaves_the_loaded_model_working(
    spawn_worker: SpawnWorker, tiny_model_dir, params, field
):
    host = await spawn_worker(env=TORCH_ENV)
    await host.call("load", {"model": str(tiny_model_dir)}, timeout=120)
    with pytest.raises(WorkerError) as caught:
        await host.call("load", {"model": str(tiny_model_dir), **params}, timeout=120)
    assert caught.value.data["field"] == field
    assert (await host.call("capabilities"))["model"]["model"] == str(tiny_model_dir)
    assert len((await host.call("generate", {"prompt": "the cat", "max_tokens": 3}))["tokens"]) == 3


async def test_replaying_a_session_recorded_with_record_equals_leaves_the_transcript_alone(tmp_path: Path):
    record = tmp_path / "session.jsonl"
    host = await Host.spawn(f"--record={record}")
    await host.call("load", {"backend": "echo"})
    await host.call("generate", {"prompt": "once", "max_tokens": 3})
    await host.close()
    recorded = record.read_bytes()
    assert transcript.read(str(record))[0].args == []
    assert await replay(record) == []
    assert record.read_bytes() == recorded


async def test_a_huge_unknown_method_name_is_answered_quickly_and_cancel_still_works(spawn_worker: SpawnWorker):
    host = await spawn_worker()
    await host.call("load", {"backend": "echo", "token_delay_ms": 20})
    msg_id, done = host.start("generate", {"prompt": "x" * 200, "max_tokens": 200})
    await host.wait_for(lambda m: m.get("method") == "generate/chunk")
    await host.send({"jsonrpc": "2.0", "id": "big", "method": "m" * (8 << 20)})
    await host.send({"jsonrpc": "2.0", "id": "c", "method": "cancel", "params": {"id": msg_id}})
    result = (await asyncio.wait_for(done, 20))["result"]
    error = await host.wait_for(lambda m: m.get("id") == "big")
    assert result["finish_reason"] == "cancelled" and len(result["tokens"]) < 200
    assert error["error"]["code"] == -32601 and len(error["error"]["message"]) < 2000


async def test_a_huge_tokenize_does_not_keep_a_cancel_from_being_read(spawn_worker: SpawnWorker, tiny_model_dir):
    """Text requests run on their own lane: the reader goes on reading (and answering `cancel`)
    while a tokenize of megabytes runs."""
    host = await spawn_worker(env=TORCH_ENV)
    await host.call("load", {"model": str(tiny_model_dir)}, timeout=120)
    gen_id, generation = host.start("generate", {"prompt": "the cat", "max_tokens": 1500})
    await host.wait_for(lambda m: m.get("method") == "generate/chunk")
    await host.send({"jsonrpc": "2.0", "id": "huge", "method": "tokenize", "params": {"text": "the cat sat. " * 400_000}})
    await host.send({"jsonrpc": "2.0", "id": "stop", "method": "cancel", "params": {"id": gen_id}})
    await host.wait_for(lambda m: m.get("id") == "huge", timeout=120)
    result = (await asyncio.wait_for(generation, 60))["result"]
    order = [m["id"] for m in host.messages if m.get("id") in ("huge", "stop")]
    assert order == ["stop", "huge"]
    assert result["finish_reason"] == "cancelled"


async def test_a_text_request_sees_the_model_as_it_was_when_it_arrived(spawn_worker: SpawnWorker):
    """tokenize runs on the text lane, load on the model lane: a load sent right after a
    tokenize waits for it, so the tokenize never sees the model loaded after it."""
    host = await spawn_worker()
    outcomes = set()
    for round_no in range(40):
        await host.send_raw(
            b'{"jsonrpc":"2.0","id":"t%d","method":"tokenize","params":{"text":"x"}}\n'
            b'{"jsonrpc":"2.0","id":"l%d","method":"load","params":{"backend":"echo"}}\n' % (round_no, round_no)
        )
        answer = await host.wait_for(lambda m, r=round_no: m.get("id") == f"t{r}")
        await host.wait_for(lambda m, r=round_no: m.get("id") == f"l{r}")
        await host.call("unload")
        outcomes.add(answer.get("error", {}).get("data", {}).get("kind"))
    assert outcomes == {"model_not_loaded"}


async def test_shutdown_answers_after_a_text_request_sent_before_it(spawn_worker: SpawnWorker, tiny_model_dir):
    host = await spawn_worker(env=TORCH_ENV)
    await host.call("load", {"model": str(tiny_model_dir)}, timeout=120)
    await host.send_raw(
        b'{"jsonrpc":"2.0","id":"big","method":"tokenize","params":{"text":"' + b"the cat sat. " * 400_000 + b'"}}\n'
        b'{"jsonrpc":"2.0","id":"bye","method":"shutdown"}\n'
    )
    await host.wait_for(lambda m: m.get("id") == "bye", timeout=120)
    assert [m["id"] for m in host.messages if m.get("id") in ("big", "bye")] == ["big", "bye"]


async def test_loads_in_workers_sharing_a_process_leave_transformers_as_they_found_it(spawn_worker, tiny_model_dir: Path):
    """from_pretrained swaps PreTrainedModel's methods for stand-ins while it runs; loads at
    once in one process (in-process workers) left a stand-in for tie_weights in place, and
    every later load of a model with a tied output layer failed (its weights on the meta device)."""
    from transformers import PreTrainedModel

    tie_weights, init_weights = PreTrainedModel.tie_weights, PreTrainedModel.init_weights
    hosts = [await spawn_worker() for _ in range(4)]
    for _ in range(2):
        await asyncio.gather(*(host.call("load", {"model": str(tiny_model_dir)}, timeout=300) for host in hosts))
    assert (PreTrainedModel.tie_weights, PreTrainedModel.init_weights) == (tie_weights, init_weights)


async def test_a_cancel_sent_without_an_id_is_ignored_and_stderr_names_the_notification_that_cancels(
    spawn_worker: SpawnWorker,
):
    host = await spawn_worker(process=True)
    await host.call("load", {"backend": "echo"})
    await host.send_raw(b'{"jsonrpc":"2.0","method":"cancel","params":{"id":5}}\n')
    assert (await host.call("tokenize", {"text": "a"}))["tokens"]  # still serving
    await host.close()
    said = host.stderr_tail(100_000)
    assert (
        "ignored 'cancel' without an id: a request needs an id to be answered; give it one, "
        "or send '$/cancelRequest', which does the same without an answer"
    ) in said, said


def test_the_stderr_protocol_md_shows_for_ignored_messages_is_what_the_worker_writes():
    """PROTOCOL 3's example of messages a worker ignores: its stderr block is the real output."""
    text = (Path(__file__).parent.parent / "docs" / "PROTOCOL.md").read_text()
    start = text.index('→ {"jsonrpc":"2.0","id":0,"method":"cancel","params":{"id":"x"}}')
    sent = [line[2:] for line in text[start : text.index("```", start)].splitlines() if line.startswith("→ ")]
    fence = text.index("```\n", text.index("stderr said", start)) + 4
    expected = text[fence : text.index("```", fence)].splitlines()
    done = subprocess.run(
        [sys.executable, "-m", "worker", "--drain"], input="\n".join(sent) + "\n", capture_output=True, text=True,
        cwd=Path(__file__).parent.parent, timeout=60,
    )
    assert done.stderr.splitlines() == expected
