"""response_format through real workers: the output always parses and validates, on the tiny
models (random weights: only the grammar makes them write JSON) and on SmolLM2; with caches,
batched beside other requests, streamed, cancelled; and what cannot be enforced is refused."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import TORCH_ENV, SpawnWorker
from tests.json_schemas import SCHEMAS
from worker.host import Host, WorkerError


def json_schema(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def loaded(spawn_worker: SpawnWorker, model: str, *flags: str) -> Host:
    host = await spawn_worker(*flags, env=TORCH_ENV)
    await host.call("load", {"model": model}, timeout=600)
    return host


@pytest.mark.parametrize("model", ["tiny", pytest.param("default", marks=pytest.mark.slow)])
async def test_output_validates_against_each_of_ten_schemas(spawn_worker: SpawnWorker, tiny_model_dir: Path, model: str):
    host = await loaded(spawn_worker, str(tiny_model_dir) if model == "tiny" else model)
    for name, schema in SCHEMAS.items():
        params = {
            "messages": [{"role": "user", "content": f"Reply with a {name.replace('_', ' ')} in JSON."}],
            "max_tokens": 200,
            "response_format": json_schema(schema, name),
        }
        msg_id, done = host.start("generate", params)
        result = (await asyncio.wait_for(done, 300))["result"]
        assert result["finish_reason"] == "stop", (name, result["text"])
        jsonschema.validate(json.loads(result["text"]), schema)
        assert "".join(chunk["text"] for chunk in host.chunks[msg_id]) == result["text"]
        assert result["content"] == result["text"] and result["tool_calls"] == []


async def test_json_object_output_is_an_object(spawn_worker: SpawnWorker, tiny_model_dir: Path):
    host = await loaded(spawn_worker, str(tiny_model_dir))
    result = await host.call("generate", {"prompt": "{", "max_tokens": 300, "response_format": {"type": "json_object"}})
    if result["finish_reason"] == "stop":
        assert isinstance(json.loads(result["text"]), dict)
    else:  # a random model may not close its object within max_tokens; what it wrote is still JSON so far
        assert result["finish_reason"] == "length" and result["text"].startswith("{")


async def test_constrained_output_from_a_cache_equals_it_without_one(cache_model: str, tmp_path: Path, device: str):
    """On every family of cache layers: from a named cache, and from auto's stored turn."""
    host = await Host.start_in_process("--cache-dir", str(tmp_path / "caches"))
    try:
        await host.call("load", {"model": cache_model, "device": device}, timeout=600)
        prompt = "the cat sat on the mat and the dog runs quickly to the river. " * 3 + "As JSON:"
        params = {"prompt": prompt, "max_tokens": 150, "response_format": json_schema(SCHEMAS["nested_object"])}
        plain = await host.call("generate", params, timeout=300)
        ids = (await host.call("tokenize", {"text": prompt}))["tokens"]
        await host.call("prefill", {"tokens": ids[:25], "cache": "head"})
        from_ref = await host.call("generate", {**params, "cache": "head"}, timeout=300)
        first = await host.call("generate", {**params, "cache": "auto"}, timeout=300)
        again = await host.call("generate", {**params, "cache": "auto"}, timeout=300)
        assert from_ref["tokens"] == first["tokens"] == again["tokens"] == plain["tokens"]
        assert from_ref["usage"]["cache_read_tokens"] == 25 and again["usage"]["cache_read_tokens"] > 25
        assert plain["finish_reason"] == "stop"
        jsonschema.validate(json.loads(plain["text"]), SCHEMAS["nested_object"])
    finally:
        await host.close()


async def test_constrained_requests_batched_with_a_free_one_each_equal_alone(spawn_worker: SpawnWorker, tiny_model_dir: Path):
    host = await loaded(spawn_worker, str(tiny_model_dir))
    requests = [
        {"prompt": "a point:", "response_format": json_schema(SCHEMAS["definitions_ref"])},
        {"prompt": "free text, the cat", "max_tokens": 30},
        {"prompt": "a colour:", "response_format": json_schema(SCHEMAS["enum"])},
    ]
    requests = [{"max_tokens": 80, **r} for r in requests]
    alone = [(await host.call("generate", r))["tokens"] for r in requests]
    started = [host.start("generate", r) for r in requests]
    together = [(await done)["result"] for _, done in started]
    assert [r["tokens"] for r in together] == alone
    jsonschema.validate(json.loads(together[0]["text"]), SCHEMAS["definitions_ref"])


async def test_cancel_ends_a_constrained_generation(spawn_worker: SpawnWorker, tiny_model_dir: Path):
    host = await loaded(spawn_worker, str(tiny_model_dir))
    msg_id, done = host.start(
        "generate", {"prompt": "a long string:", "max_tokens": 1500, "response_format": json_schema({"type": "string"})}
    )
    await host.wait_until(lambda: len(host.chunks[msg_id]) >= 3)
    await host.notify("$/cancelRequest", {"id": msg_id})
    result = (await done)["result"]
    assert result["finish_reason"] == "cancelled" and result["text"].startswith('"')
    assert (await host.call("generate", {"prompt": "x", "max_tokens": 2}))["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"not": {"type": "string"}}, '"not"'),
        ({"type": "object", "properties": {"when": {"type": "string", "format": "stardate"}}}, "stardate"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "strng"}, "strng"),
        # Accepted by the schema compiler, failing when the grammar runs: recursion that cannot
        # end, a pattern too large to compile, a number past 64 bits.
        ({"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}, "Too many items"),
        ({"type": "string", "pattern": "^a{1000000}$"}, "too many expressions"),
        ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "constrained"),
        ({"type": "integer", "minimum": -(10**30)}, "not valid"),
    ],
)
async def test_a_schema_that_cannot_be_enforced_is_invalid_params_naming_the_part(
    spawn_worker: SpawnWorker, tiny_model_dir: Path, schema: dict, named: str
):
    host = await loaded(spawn_worker, str(tiny_model_dir))
    with pytest.raises(WorkerError) as refused:
        await host.call("generate", {"prompt": "x", "response_format": json_schema(schema)})
    assert refused.value.code == -32602 and named in refused.value.message and len(refused.value.message) < 500
    assert refused.value.data["field"] == "params.response_format.json_schema.schema"
    assert (await host.call("generate", {"prompt": "x", "max_tokens": 1}))["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("response_format", "problem"),
    [
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "xml"}, "xml"),
        ({"type": "json_schema", "json_schema": {"schema": "{}"}}, "schema"),
    ],
)
async def test_a_malformed_response_format_is_invalid_params(echo_worker: Host, response_format: dict, problem: str):
    with pytest.raises(WorkerError) as refused:
        await echo_worker.call("generate", {"prompt": "x", "response_format": response_format})
    assert refused.value.code == -32602 and problem in refused.value.message


async def test_the_echo_backend_says_it_cannot_constrain_its_output(echo_worker: Host):
    with pytest.raises(WorkerError) as refused:
        await echo_worker.call("generate", {"prompt": "x", "response_format": {"type": "json_object"}})
    assert refused.value.kind == "unsupported" and "cannot constrain" in refused.value.message
    assert (await echo_worker.call("generate", {"prompt": "ok", "add_special_tokens": False}))["text"] == "ok"
