"""Load's references and models/list against a hostile host and a hostile disk
(worker/model_refs.py): references that try to leave the directories they name, manifests,
refs and snapshots that lead out of them or are built to exhaust the reader, file names no
JSON answer can carry, a data directory with something already where the link to an Ollama
blob goes. Each gets a precise -32002 (or an entry that says why) quickly, nothing outside the
named directories is read or linked, and the worker keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import struct
import time
from pathlib import Path

import msgspec
import pytest

from protocol.errors import ErrorKind, RpcError
from tests.conftest import install_plugin
from tests.model_layouts import OLLAMA_MODEL, hf_download, hf_download_directory, ollama_pull
from tests.test_e2e_protocol import SLOW_LOADING_BACKEND
from worker import model_refs
from worker.host import Host, WorkerError
from worker.model_refs import ModelPlaces, resolve

SHIPPED = ("default", "gemma3-270m", "qwen2.5-coder-0.5b")


@pytest.fixture
def places(tmp_path: Path) -> ModelPlaces:
    return ModelPlaces(
        ollama=tmp_path / "ollama", huggingface=tmp_path / "hub", node_llama_cpp=tmp_path / "home" / ".node-llama-cpp" / "models",
        models_dirs=(tmp_path / "models",),
    )


@pytest.fixture
def outside(tmp_path: Path, tiny_gguf: Path) -> Path:
    """A folder outside every models directory, holding a gguf that loads."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret.gguf").write_bytes(tiny_gguf.read_bytes())
    (folder / "config.json").write_text("{}")
    return folder


def error(model: str, places: ModelPlaces, data_dir: Path) -> RpcError:
    started = time.monotonic()
    with pytest.raises(RpcError) as caught:
        resolve(model, places, data_dir, SHIPPED)
    assert time.monotonic() - started < 5, model
    assert caught.value.data.field == "params.model", caught.value
    msgspec.json.encode(caught.value.message)  # an answer can carry it
    return caught.value


def load_failed(model: str, places: ModelPlaces, data_dir: Path) -> str:
    caught = error(model, places, data_dir)
    assert caught.kind is ErrorKind.MODEL_LOAD_FAILED, (model, caught)
    return caught.message


def manifest(places: ModelPlaces, name: str, content: bytes | dict) -> Path:
    path = places.ollama / "manifests" / "registry.ollama.ai" / "library" / name / "latest"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return path


def model_layer(digest: str) -> dict:
    return {"layers": [{"mediaType": OLLAMA_MODEL, "digest": digest, "size": 1}]}


# --- references a host sends -----------------------------------------------------------------------


def test_a_revision_of_dots_is_no_reference_not_a_folder_of_the_cache(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path):
    """refs/. and refs/.. are the cache's own folders: a revision never starts with a dot."""
    hf_download(places.huggingface, "org/tiny-GGUF", {"tiny-Q8_0.gguf": tiny_gguf})
    for model in ("hf:org/tiny-GGUF@..", "hf:org/tiny-GGUF@.", "hf:org/tiny-GGUF@.hidden", "hf:org/tiny-GGUF@../../refs"):
        caught = error(model, places, tmp_path)
        assert caught.kind is ErrorKind.MODEL_NOT_FOUND and "not a Hugging Face reference" in caught.message, caught


def test_references_that_climb_out_are_no_references(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path):
    ollama_pull(places.ollama, "tiny", "latest", tiny_gguf)
    hf_download(places.huggingface, "org/tiny-GGUF", {"tiny-Q8_0.gguf": tiny_gguf})
    for model in ("ollama:../../x", "ollama:a/../../b:tag", "ollama:tiny:..", "ollama:tiny:../x", "ollama:tiny:a/b",
                  "ollama:./tiny", "hf:../x/y", "hf:org/../x", "hf:org/tiny-GGUF/../x.gguf", "hf:org/tiny-GGUF/./tiny-Q8_0.gguf",
                  "hf:org/tiny-GGUF/a/../tiny-Q8_0.gguf", "hf:/etc/passwd", "ollama:/etc/passwd", "ollama:", "hf:"):
        caught = error(model, places, tmp_path)
        assert caught.kind is ErrorKind.MODEL_NOT_FOUND and "reference" in caught.message, (model, caught)


def test_a_huge_or_unprintable_reference_comes_back_short_and_escaped(places: ModelPlaces, tmp_path: Path):
    for model in ("x" * 100_000, "ollama:" + "a" * 100_000, "hf:" + "a/" * 50_000, "a\x00b", "\ud800", "tiny\u202e.gguf"):
        caught = error(model, places, tmp_path)
        assert caught.kind is ErrorKind.MODEL_NOT_FOUND, caught
        assert len(caught.message) < 2_000, (model[:20], len(caught.message))
        assert "\x00" not in caught.message and "\u202e" not in caught.message, caught.message


# --- a hostile Ollama models directory -------------------------------------------------------------


def test_a_manifest_nested_too_deeply_is_a_load_failure_not_an_internal_error(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path):
    ollama_pull(places.ollama, "tiny", "latest", tiny_gguf)
    manifest(places, "deep", b'{"layers":[],"x":' + b"[" * 5000 + b"]" * 5000 + b"}")
    assert "nested too deeply" in load_failed("ollama:deep", places, tmp_path)
    listing = model_refs.list_models(places, SHIPPED)
    assert [m.reference for m in listing.models] == ["ollama:tiny:latest"]
    assert "nested too deeply" in (listing.searched[0].note or ""), listing.searched[0]


def test_manifests_that_are_no_manifests_are_load_failures(places: ModelPlaces, tmp_path: Path):
    cases = {
        "dotdot": (model_layer("sha256-../../etc/passwd"), "not sha256:<64 hex digits>"),
        "nothex": (model_layer("sha256:" + "z" * 64), "not sha256:<64 hex digits>"),
        "notjson": (b"\xff\xfe\x00garbage", "malformed"),
        "huge": (b'{"layers":[' + b" " * (2 << 20) + b"]}", "more than the 1048576"),
        "layers": (b'{"layers":[' + b",".join([b'{"mediaType":"x","digest":"sha256:0"}'] * 100_000) + b"]}", "more than"),
        "wrongtype": ({"layers": "no"}, "Expected `array`"),
        "nolayer": ({"layers": []}, "has no layer"),
    }
    for name, (content, why) in cases.items():
        manifest(places, name, content)
        assert why in load_failed(f"ollama:{name}", places, tmp_path), name


@pytest.mark.parametrize("kind", ["link to a file", "link to a folder", "link to a device", "folder", "fifo"])
def test_a_blob_that_is_a_link_out_of_the_models_directory_or_no_file_is_not_loaded(
    places: ModelPlaces, outside: Path, tmp_path: Path, kind: str
):
    digest = "ab" * 32
    blob = places.ollama / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True)
    target = {"link to a file": outside / "secret.gguf", "link to a folder": outside, "link to a device": Path("/dev/zero")}
    if kind in target:
        blob.symlink_to(target[kind])
    elif kind == "folder":
        blob.mkdir()
    else:
        os.mkfifo(blob)
    manifest(places, "evil", model_layer(f"sha256:{digest}"))
    message = load_failed("ollama:evil", places, tmp_path / "data")
    assert ("outside" if kind in target else "not a regular file") in message, message
    assert not (tmp_path / "data" / "links" / "ollama" / f"{blob.name}.gguf").exists()
    listing = model_refs.list_models(places, SHIPPED)
    assert all(m.path != str(outside / "secret.gguf") for m in listing.models)
    if kind in target:
        assert listing.models == [] and "outside" in (listing.searched[0].note or ""), listing


def test_a_manifest_that_is_a_link_out_of_the_models_directory_is_not_read(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path):
    blob = ollama_pull(places.ollama, "tiny", "latest", tiny_gguf)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(model_layer("sha256:" + blob.name.removeprefix("sha256-"))))
    manifest(places, "linked", b"").unlink()
    (places.ollama / "manifests" / "registry.ollama.ai" / "library" / "linked" / "latest").symlink_to(elsewhere)
    assert "outside" in load_failed("ollama:linked", places, tmp_path)


def test_a_manifest_under_a_name_ollama_never_gives_is_passed_over_by_models_list(places: ModelPlaces, tiny_gguf: Path):
    ollama_pull(places.ollama, "tiny", "latest", tiny_gguf)
    ollama_pull(places.ollama, "bad name", "latest", tiny_gguf)
    ollama_pull(places.ollama, "tiny", "-dash", tiny_gguf)
    listing = model_refs.list_models(places, SHIPPED)
    assert [m.reference for m in listing.models] == ["ollama:tiny:latest"], listing.models
    assert "no name Ollama gives" in (listing.searched[0].note or ""), listing.searched[0]


# --- the link in DATA_DIR/links/ollama -------------------------------------------------------------


def test_what_already_lies_where_the_link_goes_never_makes_load_open_another_file(
    places: ModelPlaces, tiny_gguf: Path, outside: Path, tmp_path: Path
):
    blob = ollama_pull(places.ollama, "tiny", "latest", tiny_gguf)
    data = tmp_path / "data"
    link = data / "links" / "ollama" / f"{blob.name}.gguf"
    link.parent.mkdir(parents=True)
    for planted in ("a link to another file", "a file", "a dangling link", "a link to a folder"):
        if planted == "a link to another file":
            link.symlink_to(outside / "secret.gguf")
        elif planted == "a file":
            link.write_bytes(b"GGUF not this one")
        elif planted == "a dangling link":
            link.symlink_to(tmp_path / "nothing")
        else:
            link.symlink_to(outside)
        found = resolve("ollama:tiny", places, data, SHIPPED)
        assert found is not None and found.path == link, planted
        assert os.path.realpath(found.path) == os.path.realpath(blob), planted
        link.unlink()
    link.mkdir()  # a folder under the link's name: no link can go there, and nothing else is loaded
    (link / "x").write_text("")
    message = load_failed("ollama:tiny", places, data)
    assert str(data / "links" / "ollama") in message and "Is a directory" in message, message
    assert [p.name for p in link.parent.iterdir()] == [link.name], "no temporary link left behind"


def test_a_relative_ollama_models_directory_links_to_the_blob_itself(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A link's relative target is read from the link's own folder: the link names the blob by
    its absolute path, and the places from the environment are absolute (from the directory
    the worker started in)."""
    monkeypatch.chdir(tmp_path)
    blob = ollama_pull(tmp_path / "relative", "tiny", "latest", tiny_gguf)
    relative = ModelPlaces(ollama=Path("relative"), huggingface=Path("hub"), node_llama_cpp=Path("nlc"))
    found = resolve("ollama:tiny", relative, Path("data"), SHIPPED)
    assert found is not None and os.path.realpath(found.path) == str(blob.resolve())
    from_environment = ModelPlaces.from_environment([Path("models")], {"OLLAMA_MODELS": "relative", "HF_HUB_CACHE": "hub", "HOME": "home"})
    assert from_environment.ollama == tmp_path / "relative" and from_environment.huggingface == tmp_path / "hub"
    assert from_environment.node_llama_cpp == tmp_path / "home" / ".node-llama-cpp" / "models"
    assert from_environment.models_dirs == (tmp_path / "models",)


# --- a hostile Hugging Face cache ------------------------------------------------------------------


def _repo(places: ModelPlaces, name: str, commit: str = "c" * 40) -> tuple[Path, Path]:
    folder = places.huggingface / f"models--org--{name}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "snapshots").mkdir()
    return folder, folder / "snapshots" / commit


def test_a_snapshot_or_a_file_of_it_that_links_out_of_the_cache_is_not_loaded(
    places: ModelPlaces, outside: Path, tiny_gguf: Path, tiny_model_dir: Path, tmp_path: Path
):
    _, snapshot = _repo(places, "snapshot-link")
    snapshot.symlink_to(outside)  # the whole snapshot: / would do
    _, snapshot = _repo(places, "file-link")
    snapshot.mkdir()
    (snapshot / "x.gguf").symlink_to(outside / "secret.gguf")
    (snapshot / "sub").symlink_to(outside)
    directory = hf_download_directory(places.huggingface, "org/directory-link", tiny_model_dir)
    next(directory.glob("*.safetensors")).unlink()
    next(tiny_model_dir.glob("*.safetensors")).rename(outside / "model.safetensors")
    try:
        (directory / "model.safetensors").symlink_to(outside / "model.safetensors")
        for model in ("hf:org/snapshot-link", "hf:org/snapshot-link/secret.gguf", "hf:org/snapshot-link:secret",
                      "hf:org/snapshot-link/config.json", "hf:org/file-link", "hf:org/file-link/x.gguf",
                      "hf:org/file-link/sub/secret.gguf", "hf:org/directory-link"):
            message = load_failed(model, places, tmp_path)
            assert "outside" in message and str(outside) in message, (model, message)
        listing = model_refs.list_models(places, SHIPPED)
    finally:
        (outside / "model.safetensors").rename(tiny_model_dir / "model.safetensors")
    entries = {m.reference: m for m in listing.models}
    assert set(entries) == {"hf:org/file-link/x.gguf", "hf:org/directory-link"}, entries
    for entry in entries.values():  # listed, their files not read
        assert not entry.loadable and "a link out of" in (entry.reason or "") and entry.architecture is None, entry
    assert "outside" in (listing.searched[1].note or ""), listing.searched[1]


def test_refs_that_are_huge_or_name_no_snapshot_are_load_failures(places: ModelPlaces, tmp_path: Path):
    folder, _ = _repo(places, "huge")
    (folder / "refs" / "main").write_bytes(b"a" * (10 << 20))
    _repo(places, "missing", "d" * 40)
    folder, _ = _repo(places, "dots")
    (folder / "refs" / "main").write_text("../../../etc")
    _, snapshot = _repo(places, "loop", "e" * 40)
    snapshot.symlink_to(snapshot)
    folder, _ = _repo(places, "fifo")
    (folder / "refs" / "main").unlink()
    os.mkfifo(folder / "refs" / "main")
    assert "more than the 256" in load_failed("hf:org/huge", places, tmp_path)
    for name in ("missing", "dots", "loop"):
        assert "which is no snapshot" in load_failed(f"hf:org/{name}", places, tmp_path), name
    assert "not a regular file" in load_failed("hf:org/fifo", places, tmp_path)
    assert model_refs.list_models(places, SHIPPED).models == []


def test_without_refs_main_only_a_snapshot_named_by_a_commit_is_taken(places: ModelPlaces, outside: Path, tmp_path: Path):
    snapshots = places.huggingface / "models--org--noref" / "snapshots"
    snapshots.mkdir(parents=True)
    (snapshots / "not-a-commit").symlink_to(outside)
    caught = error("hf:org/noref", places, tmp_path)
    assert caught.kind is ErrorKind.MODEL_NOT_FOUND and "refs/main" in caught.message, caught


def test_refs_and_files_no_reference_spells_are_listed_by_what_loads_them(places: ModelPlaces, tiny_gguf: Path, tmp_path: Path):
    snapshot = hf_download(places.huggingface, "org/tiny-GGUF", {"_odd name.gguf": tiny_gguf}, revision="my branch")
    listing = model_refs.list_models(places, SHIPPED)
    [entry] = listing.models
    assert entry.reference == str(snapshot / "_odd name.gguf") and entry.loadable, entry
    directory = hf_download(places.huggingface, "org/tiny", {"tiny-Q8_0.gguf": tiny_gguf}, commit="b" * 40, revision="my branch")
    by_reference = {m.reference: m for m in model_refs.list_models(places, SHIPPED).models}
    reference = f"hf:org/tiny@{'b' * 40}/tiny-Q8_0.gguf"
    assert reference in by_reference, by_reference
    assert resolve(reference, places, tmp_path, SHIPPED).path == directory / "tiny-Q8_0.gguf"  # type: ignore[union-attr]


# --- models directories ----------------------------------------------------------------------------


def test_a_file_name_that_is_not_utf8_is_passed_over_not_an_internal_error(places: ModelPlaces, tiny_gguf: Path):
    folder = places.models_dirs[0]
    folder.mkdir(parents=True)
    (folder / os.fsdecode(b"bad\xff.gguf")).write_bytes(tiny_gguf.read_bytes())
    (folder / os.fsdecode(b"dir\xfe")).mkdir()
    (folder / "good.gguf").write_bytes(tiny_gguf.read_bytes())
    listing = model_refs.list_models(places, SHIPPED)
    msgspec.json.encode(listing)
    assert [m.reference for m in listing.models] == ["good"]


def test_a_models_dir_that_is_a_file_or_missing_says_so(places: ModelPlaces, tmp_path: Path):
    file = tmp_path / "a-file"
    file.write_text("")
    odd = ModelPlaces(ollama=file, huggingface=tmp_path / "missing", node_llama_cpp=file, models_dirs=(file, tmp_path / "nowhere"))
    listing = model_refs.list_models(odd, SHIPPED)
    assert listing.models == []
    assert [(p.exists, p.note) for p in listing.searched] == [
        (False, "not a directory"), (False, None), (False, "not a directory"), (False, "not a directory"), (False, None)
    ]
    assert "no model" in error("anything", odd, tmp_path).message.lower()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a folder of mode 000")
def test_an_unreadable_models_dir_says_so(places: ModelPlaces, tmp_path: Path):
    folder = places.models_dirs[0]
    folder.mkdir(parents=True)
    folder.chmod(0)
    try:
        place = model_refs.list_models(places, SHIPPED).searched[-1]
    finally:
        folder.chmod(0o755)
    assert place.exists and "cannot be read" in (place.note or ""), place


def test_a_models_dir_of_100000_entries_and_deep_folders_is_bounded(places: ModelPlaces, tiny_gguf: Path):
    folder = places.models_dirs[0]
    folder.mkdir(parents=True)
    for i in range(100_000):
        (folder / f"n{i:06d}").touch()
    deep = folder / "a"
    for _ in range(50):
        deep = deep / "a"
    deep.mkdir(parents=True)
    (deep / "deep.gguf").write_bytes(tiny_gguf.read_bytes())
    started = time.monotonic()
    listing = model_refs.list_models(places, SHIPPED)
    caught = error("deep", places, Path("/nonexistent"))
    assert time.monotonic() - started < 20
    assert listing.models == [] and "stopped after" in (listing.searched[-1].note or "")
    assert caught.kind is ErrorKind.MODEL_NOT_FOUND


def test_a_safetensors_header_of_a_million_extents_or_negative_ones_counts_nothing(tmp_path: Path):
    """The product of millions of extents is a number of millions of digits, computed in
    minutes: a shape is at most a few extents, each a count."""
    headers = {
        "long": {"w": {"dtype": "F32", "shape": [3] * 1_000_000, "data_offsets": [0, 0]}},
        "negative": {"w": {"dtype": "F32", "shape": [-5, 3], "data_offsets": [0, 0]}},
        "boolean": {"w": {"dtype": "F32", "shape": [True, 3], "data_offsets": [0, 0]}},
        "huge": {"w": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 0]}},
        "deep": b"{" + b'"a":[' * 3000 + b"]" * 3000 + b"}",
    }
    for name, header in headers.items():
        data = header if isinstance(header, bytes) else json.dumps(header).encode()
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(struct.pack("<Q", len(data)) + data)
        started = time.monotonic()
        assert model_refs._safetensors_parameters([path]) is None, name
        assert time.monotonic() - started < 2, name


def test_a_model_directory_whose_configuration_is_nested_too_deeply_says_why(places: ModelPlaces, tiny_model_dir: Path):
    folder = places.models_dirs[0] / "deep"
    folder.mkdir(parents=True)
    for path in tiny_model_dir.iterdir():
        if path.is_file():
            (folder / path.name).write_bytes(path.read_bytes())
    (folder / "config.json").write_bytes(b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}")
    (folder / "tokenizer_config.json").write_bytes(b"[" * 5000 + b"]" * 5000)
    [entry] = model_refs.list_models(places, SHIPPED).models
    assert not entry.loadable and "nested too deeply" in (entry.reason or ""), entry


# --- through a worker ------------------------------------------------------------------------------


@pytest.fixture
def environment(places: ModelPlaces, monkeypatch: pytest.MonkeyPatch) -> ModelPlaces:
    monkeypatch.setenv("OLLAMA_MODELS", str(places.ollama))
    monkeypatch.setenv("HF_HUB_CACHE", str(places.huggingface))
    monkeypatch.setenv("HOME", str(places.node_llama_cpp.parent.parent))
    return places


async def test_a_worker_answers_every_attack_precisely_and_keeps_serving(
    environment: ModelPlaces, tiny_gguf: Path, outside: Path, tmp_path: Path, spawn_worker
):
    places = environment
    ollama_pull(places.ollama, "tiny", "latest", tiny_gguf)
    manifest(places, "deep", b'{"layers":[],"x":' + b"[" * 5000 + b"]" * 5000 + b"}")
    _, snapshot = _repo(places, "evil")
    snapshot.symlink_to(outside)
    places.models_dirs[0].mkdir(parents=True)
    (places.models_dirs[0] / os.fsdecode(b"bad\xff.gguf")).write_bytes(b"x")
    host: Host = await spawn_worker("--data-dir", str(tmp_path / "data"), "--models-dir", str(places.models_dirs[0]))
    attacks = {
        "ollama:deep": "model_load_failed", "hf:org/evil": "model_load_failed", "hf:org/evil/secret.gguf": "model_load_failed",
        "ollama:../../etc/passwd": "model_not_found", "hf:org/evil@..": "model_not_found", "x" * 100_000: "model_not_found",
    }
    for model, kind in attacks.items():
        with pytest.raises(WorkerError) as caught:
            await host.call("load", {"model": model}, timeout=30)
        assert (caught.value.code, caught.value.kind, caught.value.data.get("field")) == (-32002, kind, "params.model"), caught.value
        assert len(caught.value.message) < 2_000
    # a lone surrogate, as a JSON escape a host may send
    await host.send_raw(b'{"jsonrpc":"2.0","id":"s","method":"load","params":{"model":"\\ud800"}}\n')
    listing = await host.call("models/list")
    assert [m["reference"] for m in listing["models"]] == ["ollama:tiny:latest"], listing
    for params in ({"extra": 1}, [], {"models_dir": "/"}):
        with pytest.raises(WorkerError) as caught:
            await host.call("models/list", params)  # type: ignore[arg-type]
        assert caught.value.code == -32602, caught.value
    info = await host.call("load", {"model": "ollama:tiny"}, timeout=120)
    assert info["model"] == "ollama:tiny" and info["path"] == str(places.ollama / "blobs" / Path(info["path"]).name)


async def test_models_list_sent_while_a_load_runs_answers_after_it(
    environment: ModelPlaces, tiny_gguf: Path, tmp_path: Path, spawn_worker
):
    """models/list is on the text lane: received behind a load, it waits for that load (as
    tokenize does), then answers; the load is not disturbed."""
    ollama_pull(environment.ollama, "tiny", "latest", tiny_gguf)
    env = install_plugin(tmp_path, "slow_backend", SLOW_LOADING_BACKEND, {"slow": "slow_backend:Slow"})
    host: Host = await spawn_worker("--data-dir", str(tmp_path / "data"), env=env)
    _, load = host.start("load", {"backend": "slow"})
    _, listing = host.start("models/list")
    answers = await asyncio.wait_for(asyncio.gather(load, listing), 60)
    assert "result" in answers[0] and answers[0]["result"]["model"] == "default", answers[0]
    assert [m["reference"] for m in answers[1]["result"]["models"]] == ["ollama:tiny:latest"], answers[1]
