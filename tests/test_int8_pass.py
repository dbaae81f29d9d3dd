"""A model directory's kept int8 weights loaded without torch (int8_model, int8_pass): the torch
path's identity and logits bit for bit on each architecture (NativeForward over the shell model
int8_store maps over the same file), however the prompt is cut and whatever rides in the batch;
a fresh process's load imports neither torch nor transformers; the first load, and any load
whose note is missing, stale or whose kept file is damaged, takes the torch path."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.test_gguf_model import TEXT
from tests.test_gguf_pass import assert_chunks_then_steps_agree, assert_same

torch = pytest.importorskip("torch")

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]


def params(directory: Path):
    from protocol.methods import LoadParams

    return LoadParams(model=str(directory))


def both(directory: Path, data_dir: Path):
    """The torch path's model of the kept weights (the first load keeps them and notes them) and
    its passes, and the torch-free pass of the kept file and its note, one thread each."""
    from worker.backends.transformers import int8_file, int8_model
    from worker.backends.transformers.backend import TransformersBackend
    from worker.backends.transformers.int8_pass import Int8Pass
    from worker.backends.transformers.native_forward import NativeForward

    torch.set_num_threads(1)
    first = TransformersBackend().load_with_torch(params(directory), data_dir=data_dir)
    noted = int8_model.read_note(data_dir, directory)  # by the load that quantized the weights
    theirs = TransformersBackend().load_with_torch(params(directory), data_dir=data_dir)
    assert type(theirs._model).__name__ == "ShellModel" and theirs.cache_identity() == first.cache_identity()
    note = int8_model.read_note(data_dir, directory)  # by the load that mapped them: the same
    assert note is not None and note == noted and note.identity == theirs.cache_identity()
    ours = Int8Pass(int8_file.read(int8_file.path_of(data_dir, note.key), note.key)[1], note.config, data_dir)
    ours.threads = 1
    assert isinstance(theirs._passes, NativeForward)
    return theirs, theirs._passes, ours


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_load_is_the_torch_path_s_model_its_identity_and_its_settings(tiny_models, tmp_path: Path, family: str):
    """(The tiny Qwen models' directories name a tokenizer class worker.tokenizer does not answer
    for: they load through torch.)"""
    from worker.backends.transformers import int8_model

    theirs, _, _ = both(tiny_models(family), tmp_path)
    ours = int8_model.load(params(tiny_models(family)), tiny_models(family), tmp_path, time.perf_counter())
    assert ours is not None
    assert ours.cache_identity() == theirs.cache_identity()
    assert (ours.eos_token_ids, ours.info.context_length, ours._vocab_size, ours._model_type) == (
        theirs.eos_token_ids, theirs.info.context_length, theirs._vocab_size, theirs._model_type)
    assert ours.tokenize(TEXT, add_special_tokens=True) == theirs.tokenize(TEXT, add_special_tokens=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_in_chunks_then_steps_give_the_torch_path_s_logits_bit_for_bit(tiny_models, tmp_path: Path, family: str):
    assert_chunks_then_steps_agree(*both(tiny_models(family), tmp_path))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_two_sequences_in_one_batch_step_and_take_a_chunk_as_the_torch_path_does(tiny_models, tmp_path: Path, family: str):
    loaded, native, ours = both(tiny_models(family), tmp_path)
    ids = loaded.tokenize(TEXT, add_special_tokens=True)
    theirs_caches, our_caches = [loaded.new_cache(), loaded.new_cache()], [ours.new_cache(), ours.new_cache()]
    with torch.inference_mode():
        assert_same(native.forward_highest([ids[:23], ids[5:19]], theirs_caches), ours.forward_highest([ids[:23], ids[5:19]], our_caches))
        for token in (3, 9, 27):
            assert_same(native.forward_highest([[token], [token + 1]], theirs_caches),
                        ours.forward_highest([[token], [token + 1]], our_caches))
        assert_same(native.forward_highest([[5], ids[19:30]], theirs_caches, [1, 11]),
                    ours.forward_highest([[5], ids[19:30]], our_caches, [1, 11]))
        assert_same(native.forward_highest([ids[30:33], [6]], theirs_caches, [3, 1]),
                    ours.forward_highest([ids[30:33], [6]], our_caches, [3, 1]))


def test_a_fresh_process_s_second_load_imports_neither_torch_nor_transformers(tiny_model_dir: Path, tmp_path: Path):
    from tests.conftest import load_in_a_fresh_process

    assert load_in_a_fresh_process(tiny_model_dir, tmp_path, ("torch",)) == "LlamaForCausalLM ['torch']"  # the first: torch's
    assert load_in_a_fresh_process(tiny_model_dir, tmp_path, ("torch", "transformers")) == "Int8Model []"


def load_kind(directory: Path, data_dir: Path) -> str:
    from worker.backends.transformers.backend import TransformersBackend

    return type(TransformersBackend().load(params(directory), data_dir=data_dir)).__name__


def test_a_missing_or_stale_note_or_a_damaged_file_takes_the_torch_path_which_notes_again(
    tiny_model_dir: Path, tmp_path: Path
):
    import shutil

    from tests.test_int8_store import flip_last_byte, kept_file

    directory = tmp_path / "model"
    shutil.copytree(tiny_model_dir, directory)
    data = tmp_path / "data"
    assert load_kind(directory, data) == "TransformersModel"  # the first load keeps the weights
    assert load_kind(directory, data) == "Int8Model"
    (note,) = (data / "int8").glob("*.note")
    note.unlink()
    assert load_kind(directory, data) == "TransformersModel"
    assert load_kind(directory, data) == "Int8Model"
    flip_last_byte(kept_file(data))
    assert load_kind(directory, data) == "TransformersModel"  # which quantizes and keeps them again
    assert load_kind(directory, data) == "Int8Model"
    (note,) = (data / "int8").glob("*.note")
    note.write_bytes(note.read_bytes()[:-9])  # not a note
    assert load_kind(directory, data) == "TransformersModel"
    assert load_kind(directory, data) == "Int8Model"
    (directory / "README.md").write_text("another file: another note")
    assert load_kind(directory, data) == "TransformersModel"
    assert load_kind(directory, data) == "Int8Model"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda config: {**config, "hidden": config["hidden"] * 2}, "where the model needs float32"),
        (lambda config: {**config, "layers": 1, "windows": [0], "ropes": [0]}, "holds tensors this model does not use"),
        (lambda config: {**config, "ropes": [5] * config["layers"]}, "not RoPE frequencies of each kind"),
        (lambda config: {**config, "heads": 3}, "heads of 16 (3 for 2 key/value heads)"),
    ],
    ids=["hidden", "layers", "ropes", "heads"],
)
def test_a_note_that_is_not_the_kept_file_s_model_is_refused_and_the_torch_path_notes_it_again(
    tiny_model_dir: Path, tmp_path: Path, change, says: str, caplog: pytest.LogCaptureFixture
):
    import json

    load_kind(tiny_model_dir, tmp_path)
    (note,) = (tmp_path / "int8").glob("*.note")
    noted = json.loads(note.read_bytes())
    note.write_text(json.dumps({**noted, "config": change(noted["config"])}))
    assert load_kind(tiny_model_dir, tmp_path) == "TransformersModel"
    assert says in caplog.text
    assert json.loads(note.read_bytes()) == noted
    assert load_kind(tiny_model_dir, tmp_path) == "Int8Model"


def test_params_the_torch_path_computes_otherwise_take_it(tiny_model_dir: Path, tmp_path: Path):
    from protocol.methods import LoadParams
    from worker.backends.transformers import int8_model

    load_kind(tiny_model_dir, tmp_path)
    others: list[dict[str, Any]] = [{"quantization": "none"}, {"dtype": "bfloat16"}, {"trust_remote_code": True}, {"quantization": "int4"}]
    assert int8_model.load(LoadParams(model=str(tiny_model_dir)), tiny_model_dir, tmp_path, 0.0) is not None
    for other in others:
        assert int8_model.load(LoadParams(model=str(tiny_model_dir), **other), tiny_model_dir, tmp_path, 0.0) is None


async def test_greedy_from_a_cache_either_load_stored_equals_greedy_without_one_on_the_other(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A cache the torch path's load stored serves the load without torch, and one that load
    stores serves the torch path's: one identity, one arithmetic."""
    from tests.test_transformers_backend import generate
    from worker.backends.transformers import int8_model
    from worker.host import Host

    made: list[object] = []
    init = int8_model.Int8Model.__init__

    def counted(self, *args, **kwargs) -> None:
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(int8_model.Int8Model, "__init__", counted)
    prompt = " ".join(["the history of the city begins with a small settlement by the river."] * 3)
    asked = {"prompt": prompt + " And so", "max_tokens": 12, "temperature": 0}

    async def loaded_then(read: str | None, store: str | None) -> None:
        host = await Host.start_in_process("--data-dir", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "caches"))
        try:
            await host.call("load", {"model": str(tiny_model_dir)}, timeout=120)
            if read is not None:
                cached, _ = await generate(host, {**asked, "cache": read})
                plain, _ = await generate(host, asked)
                assert cached["tokens"] == plain["tokens"] and cached["usage"]["cache_read_tokens"] > 0
            if store is not None:
                await host.call("prefill", {"prompt": prompt, "cache": store}, timeout=60)
        finally:
            await host.close()

    await loaded_then(None, "by-torch")  # the first load: torch's, which keeps the weights
    assert not made
    await loaded_then("by-torch", "by-native")
    assert len(made) == 1
    for note in (tmp_path / "data" / "int8").glob("*.note"):  # the torch path's again
        note.unlink()
    await loaded_then("by-native", None)
    assert len(made) == 1
