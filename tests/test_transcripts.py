"""Recorded sessions replayed against a fresh worker: responses by id, chunks in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker import transcript
from worker.host import Host
from worker.replay import replay

TRANSCRIPTS = sorted((Path(__file__).parent / "transcripts").glob("*.jsonl"))


def test_there_are_at_least_three_transcripts():
    assert len(TRANSCRIPTS) >= 3


@pytest.mark.parametrize("path", TRANSCRIPTS, ids=[p.stem for p in TRANSCRIPTS])
async def test_recorded_session_replays_identically(path: Path):
    assert await replay(path) == []


async def test_a_recorded_session_replays_identically(tmp_path: Path):
    record = tmp_path / "session.jsonl"
    host = await Host.spawn("--record", str(record))
    await host.call("load", {"backend": "echo"})
    await host.call("generate", {"prompt": "réplay ✓", "max_tokens": 4})
    await host.send_raw(b"Content-Length: 48\r\n\r\n" + b'{"jsonrpc":"2.0","id":"lsp","method":"unload"}  ')
    await host.wait_for(lambda m: m.get("id") == "lsp")
    await host.close()
    header, entries = transcript.read(str(record))
    assert header.args == []
    assert [e.framing for e in entries if e.dir == "in"] == ["ndjson", "ndjson", "lsp"]
    assert sum(e.dir == "out" for e in entries) == len(host.messages)
    assert await replay(record) == []


async def test_replay_reports_a_response_that_differs_from_the_recording(tmp_path: Path):
    source = next(p for p in TRANSCRIPTS if p.stem == "streaming")
    lines = source.read_text().splitlines()
    for i, line in enumerate(lines):
        entry = json.loads(line)
        if entry.get("dir") == "out" and "result" in entry["msg"] and "text" in entry["msg"]["result"]:
            entry["msg"]["result"]["text"] += "!"
            lines[i] = json.dumps(entry)
            break
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("\n".join(lines) + "\n")
    differences = await replay(tampered)
    assert len(differences) == 1 and differences[0].startswith("response to id")


async def test_replay_refuses_input_it_cannot_reproduce(tmp_path: Path):
    path = tmp_path / "unframed.jsonl"
    path.write_text('{"transcript":1,"worker_version":"0"}\n{"t":0,"dir":"in","unframed":"Parse error: junk"}\n')
    assert "give its bytes under 'send'" in (await replay(path))[0]
