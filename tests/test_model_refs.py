"""Models other tools keep, by their references (worker/model_refs.py): load resolves
``ollama:``, ``hf:`` and names in node-llama-cpp's folder and ``--models-dir`` offline, in the
layouts those tools write (tests/model_layouts.py), and models/list describes what is there
from headers and manifests, bounded in a hostile directory."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from protocol.errors import ErrorKind, RpcError
from tests.model_layouts import hf_download, hf_download_directory, node_llama_cpp_pull, ollama_pull
from tests.test_transformers_backend import generate
from worker import model_refs
from worker.host import Host, WorkerError
from worker.model_refs import ModelPlaces, resolve

SHIPPED = ("default", "gemma3-270m", "qwen2.5-coder-0.5b")
GREEDY = {"prompt": "a red sun", "max_tokens": 6, "temperature": 0}


@pytest.fixture
def places(tmp_path: Path) -> ModelPlaces:
    return ModelPlaces(
        ollama=tmp_path / "ollama", huggingface=tmp_path / "hub", node_llama_cpp=tmp_path / "home" / ".node-llama-cpp" / "models",
        models_dirs=(tmp_path / "models",),
    )


def resolved(model: str, places: ModelPlaces, data_dir: Path) -> model_refs.Resolved:
    found = resolve(model, places, data_dir, SHIPPED)
    assert found is not None, model
    return found


def not_found(model: str, places: ModelPlaces, data_dir: Path) -> str:
    with pytest.raises(RpcError) as caught:
        resolve(model, places, data_dir, SHIPPED)
    error = caught.value
    assert (error.kind, error.data.field) == (ErrorKind.MODEL_NOT_FOUND, "params.model"), error
    return error.message


# --- resolving references --------------------------------------------------------------------------


def test_an_ollama_name_is_its_manifests_model_layer_latest_without_a_tag(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path):
    blob = ollama_pull(places.ollama, "tiny", "latest", tiny_gguf)
    other = ollama_pull(places.ollama, "tiny", "q8", tiny_gguf, namespace="someone")
    for reference in ("ollama:tiny", "ollama:tiny:latest", "ollama:someone/tiny:q8", "ollama:registry.ollama.ai/someone/tiny:q8"):
        found = resolved(reference, places, tmp_path / "data")
        assert found.file == blob == other and found.reference == reference
        # the backend is given a link named .gguf: it knows a gguf by its name
        assert found.path.suffix == ".gguf" and found.path.resolve() == blob.resolve()
    assert resolved("ollama:tiny", places, tmp_path / "data").path == found.path, "every tag of a blob: one link"


def test_the_link_to_an_ollama_blob_follows_the_blob_when_the_models_directory_moves(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path):
    ollama_pull(places.ollama, "tiny", "latest", tiny_gguf)
    first = resolved("ollama:tiny", places, tmp_path / "data")
    moved = ModelPlaces(ollama=tmp_path / "elsewhere", huggingface=places.huggingface, node_llama_cpp=places.node_llama_cpp)
    blob = ollama_pull(moved.ollama, "tiny", "latest", tiny_gguf)
    second = resolved("ollama:tiny", moved, tmp_path / "data")
    assert second.path == first.path and os.readlink(second.path) == str(blob)


def test_an_hf_reference_is_the_snapshot_refs_main_names_or_its_revision(places: ModelPlaces, tiny_model_dir: Path, tmp_path: Path):
    main = hf_download_directory(places.huggingface, "org/tiny", tiny_model_dir, commit="a" * 40)
    other = hf_download_directory(places.huggingface, "org/tiny", tiny_model_dir, commit="b" * 40, revision="v2")
    assert resolved("hf:org/tiny", places, tmp_path).path == main
    assert resolved("hf:org/tiny@v2", places, tmp_path).path == other
    assert resolved(f"hf:org/tiny@{'b' * 40}", places, tmp_path).path == other
    message = not_found("hf:org/tiny@v3", places, tmp_path)
    assert "refs/v3" in message and "'main'" in message and "'v2'" in message, message


def test_an_hf_gguf_repository_takes_a_quantization_or_a_file_and_keeps_the_links_gguf_name(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text("# tiny\n")
    snapshot = hf_download(places.huggingface, "org/tiny-GGUF", {"tiny-Q8_0.gguf": tiny_gguf, "README.md": readme})
    for reference in ("hf:org/tiny-GGUF", "hf:org/tiny-GGUF:Q8_0", "hf:org/tiny-GGUF:q8_0", "hf:org/tiny-GGUF/tiny-Q8_0.gguf"):
        found = resolved(reference, places, tmp_path)
        assert found.path == snapshot / "tiny-Q8_0.gguf" and found.path.is_symlink(), reference
    message = not_found("hf:org/tiny-GGUF:Q4_K_M", places, tmp_path)
    assert "hf:org/tiny-GGUF/tiny-Q8_0.gguf" in message, message


def test_a_name_is_a_gguf_file_in_node_llama_cpps_folder_or_a_models_directory(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path):
    pulled = node_llama_cpp_pull(places.node_llama_cpp.parent.parent, "hf_org_tiny.Q8_0.gguf", tiny_gguf)
    (places.models_dirs[0] / "nested").mkdir(parents=True)
    own = places.models_dirs[0] / "nested" / "mine.gguf"
    own.write_bytes(tiny_gguf.read_bytes())
    assert resolved("hf_org_tiny.Q8_0", places, tmp_path).path == pulled
    assert resolved("hf_org_tiny.Q8_0.gguf", places, tmp_path).path == pulled
    assert resolved("mine", places, tmp_path).path == own


def test_paths_and_shipped_names_are_no_references(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (places.models_dirs[0]).mkdir(parents=True)
    (places.models_dirs[0] / "default.gguf").write_bytes(tiny_gguf.read_bytes())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.gguf").write_bytes(b"")
    for model in ("default", str(tiny_gguf), "here.gguf", "./nowhere", "~/nowhere", "/nowhere"):
        assert resolve(model, places, tmp_path, SHIPPED) is None, model


def test_a_reference_that_matches_nothing_names_where_it_looked(places: ModelPlaces, tmp_path: Path):
    message = not_found("ollama:qwen2.5-coder:0.5b", places, tmp_path)
    assert str(places.ollama / "manifests" / "registry.ollama.ai" / "library" / "qwen2.5-coder" / "0.5b") in message, message
    assert "OLLAMA_MODELS" in message, message
    message = not_found("hf:Qwen/Qwen2.5-0.5B-Instruct", places, tmp_path)
    assert str(places.huggingface / "models--Qwen--Qwen2.5-0.5B-Instruct") in message and "HF_HUB_CACHE" in message, message
    message = not_found("smollm2", places, tmp_path)
    assert str(places.node_llama_cpp) in message and str(places.models_dirs[0]) in message, message
    for malformed in ("ollama:", "ollama:../../etc/passwd", "hf:org/name/../../x.gguf", "hf:", "ollama:a:b:c"):
        assert "reference" in not_found(malformed, places, tmp_path), malformed


def test_an_ollama_tag_that_is_missing_names_the_tags_there(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path):
    ollama_pull(places.ollama, "tiny", "q8", tiny_gguf)
    message = not_found("ollama:tiny", places, tmp_path)
    assert "'q8'" in message and "ollama pull tiny" in message, message


def test_an_ambiguous_reference_lists_its_candidates(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path):
    hf_download(places.huggingface, "org/tiny-GGUF", {"tiny-Q8_0.gguf": tiny_gguf, "tiny-Q8_0-imatrix.gguf": tiny_gguf})
    message = not_found("hf:org/tiny-GGUF:Q8_0", places, tmp_path)
    assert "ambiguous" in message and "hf:org/tiny-GGUF/tiny-Q8_0.gguf" in message and "hf:org/tiny-GGUF/tiny-Q8_0-imatrix.gguf" in message
    node_llama_cpp_pull(places.node_llama_cpp.parent.parent, "same.gguf", tiny_gguf)
    (places.models_dirs[0] / "x").mkdir(parents=True)
    (places.models_dirs[0] / "x" / "same.gguf").write_bytes(tiny_gguf.read_bytes())
    message = not_found("same", places, tmp_path)
    assert "ambiguous" in message and str(places.node_llama_cpp / "same.gguf") in message, message


def test_a_manifest_or_blob_that_cannot_be_used_is_a_load_failure_naming_it(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path):
    blob = ollama_pull(places.ollama, "gone", "latest", tiny_gguf)
    blob.unlink()
    with pytest.raises(RpcError) as caught:
        resolve("ollama:gone", places, tmp_path, SHIPPED)
    assert caught.value.kind is ErrorKind.MODEL_LOAD_FAILED and str(blob) in caught.value.message
    fifo = places.ollama / "manifests" / "registry.ollama.ai" / "library" / "fifo" / "latest"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(RpcError) as caught:
        resolve("ollama:fifo", places, tmp_path, SHIPPED)
    assert time.monotonic() - started < 5 and "not a regular file" in caught.value.message, caught.value.message


# --- models/list -----------------------------------------------------------------------------------


def test_every_model_listed_is_described_from_its_header_and_loads_by_its_reference(
    places: ModelPlaces, tiny_gguf: Path, tiny_model_dir: Path, tmp_path: Path
):
    blob = ollama_pull(places.ollama, "tiny", "latest", tiny_gguf)
    hf_download_directory(places.huggingface, "org/tiny", tiny_model_dir)
    gguf_snapshot = hf_download(places.huggingface, "org/tiny-GGUF", {"tiny-Q8_0.gguf": tiny_gguf})
    pulled = node_llama_cpp_pull(places.node_llama_cpp.parent.parent, "hf_org_tiny.Q8_0.gguf", tiny_gguf)
    listing = model_refs.list_models(places, SHIPPED)
    by_reference = {entry.reference: entry for entry in listing.models}
    assert set(by_reference) == {"ollama:tiny:latest", "hf:org/tiny", "hf:org/tiny-GGUF/tiny-Q8_0.gguf", "hf_org_tiny.Q8_0"}
    assert [(p.source, p.exists, p.models) for p in listing.searched] == [
        ("ollama", True, 1), ("huggingface", True, 2), ("node-llama-cpp", True, 1), ("models-dir", False, 0)
    ]
    for entry in listing.models:
        assert (entry.architecture, entry.parameters, entry.context_length) == ("llama", 139_584, 2048), entry
        assert entry.loadable and entry.reason is None and entry.has_chat_template, entry
        assert entry.tool_calls is not None and entry.tool_calls.format == "hermes", entry
        found = resolved(entry.reference, places, tmp_path / "data")
        assert str(found.file) == entry.path, entry
    gguf = by_reference["ollama:tiny:latest"]
    assert (gguf.format, gguf.quantization, gguf.size_bytes, gguf.path) == ("gguf", "Q8_0", tiny_gguf.stat().st_size, str(blob))
    directory = by_reference["hf:org/tiny"]
    assert (directory.format, directory.quantization) == ("transformers", "float32")
    assert directory.size_bytes == sum(p.stat().st_size for p in tiny_model_dir.iterdir() if p.is_file())
    assert by_reference["hf:org/tiny-GGUF/tiny-Q8_0.gguf"].path == str(gguf_snapshot / "tiny-Q8_0.gguf")
    assert by_reference["hf_org_tiny.Q8_0"].path == str(pulled)


def test_a_listed_model_the_worker_cannot_load_says_why(places: ModelPlaces, tiny_gguf: Path, tiny_model_dir: Path, tmp_path: Path):
    folder = places.models_dirs[0]
    folder.mkdir(parents=True)
    (folder / "garbage.gguf").write_bytes(b"not a gguf at all")
    (folder / "part-00001-of-00002.gguf").write_bytes(tiny_gguf.read_bytes())
    os.mkfifo(folder / "fifo.gguf")
    partial = hf_download_directory(places.huggingface, "org/partial", tiny_model_dir)
    next(partial.glob("*.safetensors")).resolve().unlink()  # the blob a link names: a download cut short
    reasons = {entry.reference: (entry.loadable, entry.reason) for entry in model_refs.list_models(places, SHIPPED).models}
    assert reasons["garbage"][0] is False and "GGUF" in (reasons["garbage"][1] or "")
    assert reasons["part-00001-of-00002"][0] is False and "split" in (reasons["part-00001-of-00002"][1] or "")
    assert reasons["fifo"][0] is False and "not a regular file" in (reasons["fifo"][1] or "")
    assert reasons["hf:org/partial"][0] is False and "missing" in (reasons["hf:org/partial"][1] or "")


def test_listing_a_hostile_directory_stops_at_its_bounds(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path):
    """Ten thousand gguf files, a FIFO, a link loop: models/list looks at a bounded number of
    entries, opens nothing that waits, and says what it passed over."""
    folder = places.models_dirs[0]
    folder.mkdir(parents=True)
    header = tiny_gguf.read_bytes()[:4096]  # a truncated gguf: its header read fails, quickly
    for i in range(10_000):
        (folder / f"m{i:05d}.gguf").write_bytes(header)
    os.mkfifo(folder / "a-fifo.gguf")
    (folder / "loop").symlink_to(folder)
    started = time.monotonic()
    listing = model_refs.list_models(places, SHIPPED)
    took = time.monotonic() - started
    assert took < 30, took
    assert len(listing.models) <= model_refs.MAX_MODELS and listing.truncated
    place = listing.searched[-1]
    assert place.source == "models-dir" and place.note is not None and "stopped after" in place.note, place


def test_the_mapped_architectures_and_kernel_types_are_the_backends():
    from worker.backends.transformers import gguf_model, gguf_weights

    assert set(model_refs.MAPPED_ARCHITECTURES) == set(gguf_model.ARCHITECTURES)
    assert model_refs.KERNEL_TYPES == set(gguf_weights.LAYOUTS)


# --- through a worker ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture
def environment(places: ModelPlaces, monkeypatch: pytest.MonkeyPatch) -> ModelPlaces:
    """The places a worker started now finds: Ollama's and the Hugging Face cache's from the
    environment, node-llama-cpp's under HOME."""
    monkeypatch.setenv("OLLAMA_MODELS", str(places.ollama))
    monkeypatch.setenv("HF_HUB_CACHE", str(places.huggingface))
    monkeypatch.setenv("HOME", str(places.node_llama_cpp.parent.parent))
    return places


async def test_a_model_loaded_by_each_reference_generates_what_its_path_does(
    environment: ModelPlaces, tiny_gguf: Path, tiny_model_dir: Path, data_dir: Path, spawn_worker
):
    places = environment
    blob = ollama_pull(places.ollama, "tiny", "latest", tiny_gguf)
    snapshot = hf_download_directory(places.huggingface, "org/tiny", tiny_model_dir)
    gguf_snapshot = hf_download(places.huggingface, "org/tiny-GGUF", {"tiny-Q8_0.gguf": tiny_gguf})
    pulled = node_llama_cpp_pull(places.node_llama_cpp.parent.parent, "hf_org_tiny.Q8_0.gguf", tiny_gguf)
    places.models_dirs[0].mkdir(parents=True)
    mine = places.models_dirs[0] / "mine.gguf"
    mine.write_bytes(tiny_gguf.read_bytes())
    host: Host = await spawn_worker("--data-dir", str(data_dir), "--models-dir", str(places.models_dirs[0]))
    await host.call("load", {"model": str(tiny_gguf)}, timeout=120)
    expected, _ = await generate(host, GREEDY)
    await host.call("load", {"model": str(tiny_model_dir)}, timeout=120)
    expected_dense, _ = await generate(host, GREEDY)
    for reference, path, quantization, tokens in [
        ("ollama:tiny", blob, "gguf", expected["tokens"]),
        ("hf:org/tiny-GGUF:Q8_0", gguf_snapshot / "tiny-Q8_0.gguf", "gguf", expected["tokens"]),
        ("hf_org_tiny.Q8_0", pulled, "gguf", expected["tokens"]),
        ("mine", mine, "gguf", expected["tokens"]),
        ("hf:org/tiny", snapshot, "int8", expected_dense["tokens"]),
    ]:
        info = await host.call("load", {"model": reference}, timeout=120)
        assert (info["model"], info["path"], info["quantization"]) == (reference, str(path), quantization), info
        result, _ = await generate(host, GREEDY)
        assert result["tokens"] == tokens, reference
        capabilities = await host.call("capabilities")
        assert capabilities["model"]["model"] == reference


async def test_models_list_through_a_worker_and_a_reference_to_nothing(
    environment: ModelPlaces, tiny_gguf: Path, data_dir: Path, spawn_worker
):
    ollama_pull(environment.ollama, "tiny", "latest", tiny_gguf)
    host: Host = await spawn_worker("--data-dir", str(data_dir))
    assert "models/list" in (await host.call("capabilities"))["methods"]
    listing = await host.call("models/list")
    assert [m["reference"] for m in listing["models"]] == ["ollama:tiny:latest"], listing
    assert [p["source"] for p in listing["searched"]] == ["ollama", "huggingface", "node-llama-cpp"]
    with pytest.raises(WorkerError) as caught:
        await host.call("load", {"model": "ollama:nothing:here"})
    assert (caught.value.code, caught.value.kind, caught.value.data.get("field")) == (-32002, "model_not_found", "params.model")
    assert str(environment.ollama) in caught.value.message
    with pytest.raises(WorkerError) as caught:
        await host.call("models/list", {"extra": 1})
    assert caught.value.code == -32602
    # echo's model is any name: no reference is resolved for it
    assert (await host.call("load", {"backend": "echo", "model": "ollama:nothing"}))["model"] == "ollama:nothing"
    json.dumps(listing)
