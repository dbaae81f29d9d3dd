"""Files the worker reads and did not write, attacked value by value (issue 47's closing round):
a gguf's metadata of the wrong kind or out of range for each key the loader reads, and a model
directory's tokenizer settings. Each is a load error (-32002) naming the key or file, never an
internal error (-32603), a model of NaN rotary frequencies, or gigabytes allocated from a size
no tensor has; the worker keeps serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from worker.host import Host, WorkerError

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

T = gguf.GGUFValueType if gguf is not None else None


def with_metadata(source: Path, out: Path, changes: dict) -> Path:
    """``source`` written again with the metadata in ``changes`` (key: (value, kind, item kind))."""
    import numpy as np

    original = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(out), "llama")
    for field in original.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in changes:
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for name, (value, kind, item) in changes.items():
        writer.add_key_value(name, value, kind, sub_type=item)
    for tensor in original.tensors:
        raw = gguf.GGMLQuantizationType(tensor.tensor_type)
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=raw if raw != gguf.GGMLQuantizationType.F32 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


async def refused(model: Path, data_dir: Path) -> WorkerError:
    host = await Host.start_in_process("--data-dir", str(data_dir))
    try:
        with pytest.raises(WorkerError) as error:
            await host.call("load", {"model": str(model)}, timeout=120)
        assert await host.call("capabilities")
        return error.value
    finally:
        await host.close()


@pytest.mark.parametrize(
    ("key", "value", "kind", "says"),
    [
        ("llama.context_length", float("nan"), "FLOAT32", "llama.context_length is nan, not an integer"),
        ("llama.attention.head_count", 6, "UINT32", "not a multiple of the number of attention heads"),
        ("llama.attention.head_count", 1 << 63, "UINT64", "llama.attention.head_count is 9223372036854775808, not a size"),
        ("llama.attention.head_count_kv", -2, "INT32", "llama.attention.head_count_kv is -2, not a size"),
        ("llama.attention.head_count_kv", 2.5, "FLOAT32", "llama.attention.head_count_kv is 2.5, not an integer"),
        ("llama.attention.head_count_kv", 3, "UINT32", "head_count_kv is 3, which does not divide"),
        ("llama.rope.freq_base", float("nan"), "FLOAT32", "llama.rope.freq_base is nan, not a finite number above 0"),
        ("llama.rope.freq_base", -10000.0, "FLOAT32", "llama.rope.freq_base is -10000.0"),
        ("llama.rope.freq_base", 0.0, "FLOAT32", "llama.rope.freq_base is 0.0"),
        ("llama.rope.freq_base", float("inf"), "FLOAT32", "llama.rope.freq_base is inf"),
        ("llama.attention.layer_norm_rms_epsilon", float("nan"), "FLOAT32", "layer_norm_rms_epsilon is nan, not a finite number from 0 to 1"),
        ("llama.attention.layer_norm_rms_epsilon", -1.0, "FLOAT32", "layer_norm_rms_epsilon is -1.0"),
        ("llama.rope.dimension_count", 1 << 40, "UINT64", "llama.rope.dimension_count is 1099511627776, not a size"),
        ("llama.feed_forward_length", 1 << 62, "UINT64", "llama.feed_forward_length is 4611686018427387904, not a size"),
        ("tokenizer.chat_template", 5, "UINT32", "tokenizer chat_template is int, not str"),
        ("tokenizer.chat_template", ["a", "b"], "ARRAY", "tokenizer chat_template is Strings, not str"),
        ("tokenizer.ggml.model", "bert", "STRING", "the tokenizer its metadata describes does not build"),
        ("tokenizer.ggml.model", 3, "UINT32", "tokenizer.ggml.model is not a string"),
        ("tokenizer.ggml.add_bos_token", "yes", "STRING", "tokenizer add_bos_token is str, not bool"),
    ],
    ids=["ctx-nan", "heads-6", "heads-2^63", "kv-negative", "kv-float", "kv-not-dividing", "rope-nan", "rope-negative",
         "rope-zero", "rope-inf", "eps-nan", "eps-negative", "head-dim-2^40", "ffn-2^62", "template-int", "template-array",
         "tokenizer-bert", "tokenizer-int", "add-bos-string"],
)
async def test_a_gguf_metadata_value_of_the_wrong_kind_or_range_is_a_load_error_naming_it(
    tiny_gguf: Path, tmp_path: Path, key: str, value, kind: str, says: str
):
    """Before: -32603 for a float context length, heads not dividing the hidden size, negative or
    float kv heads, a non-text chat template or an unknown tokenizer kind; a NaN, zero, negative or
    infinite rope base or epsilon loaded and computed garbage; a head size of 2^40 asked for 2 TB."""
    item = gguf.GGUFValueType.STRING if kind == "ARRAY" else None
    path = with_metadata(tiny_gguf, tmp_path / "hostile.gguf", {key: (value, getattr(T, kind), item)})
    error = await refused(path, tmp_path / "data")
    assert error.code == -32002 and says in error.message and str(path) in error.message, error.message


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"chat_template": 5}, "tokenizer_config.json gives a chat_template that is not a text or named texts: 5"),
        ({"chat_template": [{"name": "default", "template": 7}]}, "chat_template that is not a text or named texts"),
        ({"model_max_length": "big"}, "tokenizer_config.json gives model_max_length as 'big', not a number of tokens"),
        ({"model_max_length": float("nan")}, "model_max_length as 'nan'"),
    ],
    ids=["template-int", "named-template-int", "max-length-string", "max-length-nan"],
)
async def test_a_tokenizer_config_setting_of_the_wrong_kind_is_a_load_error_naming_it(
    tiny_model_dir: Path, tmp_path: Path, settings: dict, says: str
):
    """Before: -32603 at load (a chat template of 5, a model_max_length of "big"), or a load that
    succeeded and a render that failed -32603 (a named template that is not text)."""
    directory = tmp_path / "model"
    shutil.copytree(tiny_model_dir, directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)  # else it, not tokenizer_config.json's, is the template
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(settings)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    error = await refused(directory, tmp_path / "data")
    assert error.code == -32002 and says in error.message, error.message


def test_protocol_md_states_the_metadata_size_bound_as_the_code_has_it():
    from worker.backends.transformers import gguf_model

    text = " ".join((Path(__file__).parent.parent / "docs" / "PROTOCOL.md").read_text().split())
    assert f"that is not an integer from 1 to {gguf_model.MAX_DIMENSION:,}" in text


def test_a_model_file_cut_short_under_a_running_worker_ends_it_with_python_s_report_on_stderr(tiny_gguf: Path, tmp_path: Path):
    """A mapped gguf truncated in place while the worker computes on it: the next read of a page
    past its new end is SIGBUS, which no code can answer from. The worker dies of it (as llama.cpp
    does), but its stderr says so and where, instead of nothing: the host's log explains the exit."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import TORCH_ENV

    model = shutil.copy(tiny_gguf, tmp_path / "victim.gguf")
    worker = subprocess.Popen(
        [sys.executable, "-m", "worker", "--data-dir", str(tmp_path / "data")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **TORCH_ENV},
    )
    try:
        assert worker.stdin is not None and worker.stdout is not None
        worker.stdin.write(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "load", "params": {"model": str(model)}}).encode() + b"\n")
        worker.stdin.flush()
        assert json.loads(worker.stdout.readline())["result"]["quantization"] == "gguf"
        os.truncate(model, 4096)
        request = {"jsonrpc": "2.0", "id": 2, "method": "generate", "params": {"prompt": "hello", "max_tokens": 4}}
        worker.stdin.write(json.dumps(request).encode() + b"\n")
        worker.stdin.flush()
        answer = worker.stdout.readline()  # none: the worker died before it answered
        _, stderr = worker.communicate(timeout=120)
    finally:
        worker.kill()
    assert worker.returncode == -signal.SIGBUS and answer == b"", answer
    report = stderr.decode(errors="replace")
    assert "Fatal Python error" in report and "Bus error" in report and "native_pass.py" in report, report[-3000:]
