"""schemas/ is generated from protocol/, kept fresh, and describes what the worker really sends."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from protocol import schema
from protocol.errors import CODES, ErrorKind
from worker import transcript

SCHEMAS = Path(__file__).parent.parent / "schemas"
TRANSCRIPTS = sorted((Path(__file__).parent / "transcripts").glob("*.jsonl"))


def load(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text())


def test_checked_in_schemas_match_the_protocol_package():
    assert schema.stale(SCHEMAS) == [], "run: make schemas"


def test_stale_check_notices_a_changed_file(tmp_path: Path):
    assert schema.main([str(tmp_path)]) == 0
    assert schema.stale(tmp_path) == []
    (tmp_path / "generate.params.json").write_text("{}")
    (tmp_path / "extra.json").write_text("{}")
    assert schema.stale(tmp_path) == ["generate.params.json", "extra.json"]
    assert schema.main([str(tmp_path), "--check"]) == 1


def test_every_method_and_notification_has_its_files():
    index = load("index.json")
    for entry in index["methods"].values():
        assert (SCHEMAS / entry["params"]).is_file() and (SCHEMAS / entry["result"]).is_file()
    assert set(index["notifications"]) == {
        "generate/chunk", "prefill/progress", "load/progress", "$/cancelRequest", "generate/ack", "exit"
    }


def test_the_index_names_every_error_kind_with_its_code():
    assert load("index.json")["errors"] == {kind.value: CODES[kind] for kind in ErrorKind}


def test_params_schemas_refuse_unknown_fields_like_the_worker():
    params = load("generate.params.json")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"prompt": "a", "max_token": 3}, params)
    jsonschema.validate({"prompt": "a", "max_tokens": 3, "stop": ["\n"]}, params)


@pytest.mark.parametrize("path", TRANSCRIPTS, ids=[p.stem for p in TRANSCRIPTS])
def test_every_recorded_message_validates_against_its_schema(path: Path):
    index = load("index.json")
    _, entries = transcript.read(str(path))
    methods = {}
    checked = 0
    for entry in entries:
        message = entry.msg
        if not isinstance(message, dict):
            continue
        if entry.dir == "in" and message.get("method") in index["methods"] and "id" in message:
            methods[message["id"]] = message["method"]
        elif entry.dir == "out" and "result" in message:
            jsonschema.validate(message["result"], load(index["methods"][methods[message["id"]]]["result"]))
            checked += 1
        elif entry.dir == "out" and message.get("method") in index["notifications"]:
            jsonschema.validate(message["params"], load(index["notifications"][message["method"]]["params"]))
            checked += 1
    assert checked > 0
