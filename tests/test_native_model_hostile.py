"""A mapped gguf served by native_model (no torch, no transformers) under a hostile host: the
tokenizer it keeps in the data directory damaged between loads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from worker.host import Host, WorkerError


async def load_and_greet(tiny_gguf: Path, data_dir: Path) -> dict:
    host = await Host.start_in_process("--data-dir", str(data_dir))
    try:
        info = await host.call("load", {"model": str(tiny_gguf)}, timeout=120)
        done = await host.call("generate", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=60)
        return {"info": info, "tokens": done["tokens"]}
    finally:
        await host.close()


def kept_tokenizer(data_dir: Path) -> Path:
    (kept,) = (data_dir / "gguf").iterdir()
    return kept


async def test_a_fifo_in_place_of_the_kept_tokenizer_config_is_built_over_not_waited_on(tiny_gguf: Path, tmp_path: Path):
    """Reading it waited for a writer forever: the load timed out and the worker hung."""
    first = await load_and_greet(tiny_gguf, tmp_path)
    config = kept_tokenizer(tmp_path) / "tokenizer_config.json"
    config.unlink()
    os.mkfifo(config)
    again = await load_and_greet(tiny_gguf, tmp_path)
    assert again["tokens"] == first["tokens"] and again["info"]["special_tokens"] == first["info"]["special_tokens"]
    assert config.is_file()


async def test_a_kept_tokenizer_that_lost_its_chat_template_is_built_again_from_the_file(tiny_gguf: Path, tmp_path: Path):
    """It loaded without one: 'messages' were refused, and no cache of the model matched."""
    first = await load_and_greet(tiny_gguf, tmp_path)
    template = kept_tokenizer(tmp_path) / "chat_template.jinja"
    kept_text = template.read_text()
    template.unlink()
    again = await load_and_greet(tiny_gguf, tmp_path)
    assert again["info"]["has_chat_template"] and again["tokens"] == first["tokens"]
    assert template.read_text() == kept_text


async def test_a_gguf_whose_eos_id_is_past_its_vocabulary_is_a_load_error_naming_it(tiny_gguf: Path, tmp_path: Path):
    """It loaded with no end-of-sequence token at all: every generate ran to max_tokens."""
    import gguf
    import numpy as np

    original = gguf.GGUFReader(tiny_gguf)
    writer = gguf.GGUFWriter(str(tmp_path / "eos.gguf"), "llama")
    for field in original.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = 4_000_000_000 if field.name == "tokenizer.ggml.eos_token_id" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for tensor in original.tensors:
        kind = gguf.GGMLQuantizationType(tensor.tensor_type)
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=None if kind == gguf.GGMLQuantizationType.F32 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    host = await Host.start_in_process("--data-dir", str(tmp_path / "data"))
    try:
        with pytest.raises(WorkerError) as refused:
            await host.call("load", {"model": str(tmp_path / "eos.gguf")}, timeout=120)
    finally:
        await host.close()
    assert refused.value.code == -32002 and "the metadata of eos.gguf names the EOS token 4000000000" in str(refused.value)
