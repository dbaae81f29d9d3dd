"""Model files placed the way other tools keep them, for the tests of load's references and
models/list: Ollama's models directory (manifests and sha256-named blobs), the Hugging Face
cache (refs, snapshots of links into blobs) and node-llama-cpp's folder (plain gguf files)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

OLLAMA_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
OLLAMA_CONFIG = "application/vnd.docker.container.image.v1+json"
OLLAMA_MODEL = "application/vnd.ollama.image.model"
OLLAMA_TEMPLATE = "application/vnd.ollama.image.template"
OLLAMA_PARAMS = "application/vnd.ollama.image.params"


def _place(source: Path, target: Path) -> None:
    """A copy of ``source`` at ``target`` (a hard link where the file system allows: the real
    models are large)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ollama_blob(root: Path, data: bytes | Path) -> dict:
    """A blob stored as Ollama stores it (blobs/sha256-<hex>); its descriptor in a manifest."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    if isinstance(data, Path):
        digest, size = _sha256(data), data.stat().st_size
        if not (blobs / f"sha256-{digest}").exists():
            _place(data, blobs / f"sha256-{digest}")
    else:
        digest, size = hashlib.sha256(data).hexdigest(), len(data)
        (blobs / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": size}


def ollama_pull(root: Path, name: str, tag: str, gguf: Path, *, namespace: str = "library",
                registry: str = "registry.ollama.ai") -> Path:
    """What `ollama pull NAME:TAG` leaves in its models directory: the gguf as a blob, a
    template and params layer, the config blob, and the manifest naming them. The model blob."""
    model = ollama_blob(root, gguf)
    template = ollama_blob(root, b"{{ .Prompt }}")
    params = ollama_blob(root, json.dumps({"stop": ["<|im_end|>"]}).encode())
    config = ollama_blob(root, json.dumps({
        "model_format": "gguf", "model_family": "llama", "model_families": ["llama"], "model_type": "135M",
        "file_type": "Q8_0", "architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []},
    }).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": OLLAMA_MANIFEST,
        "config": {"mediaType": OLLAMA_CONFIG, **config},
        "layers": [
            {"mediaType": OLLAMA_MODEL, **model},
            {"mediaType": OLLAMA_TEMPLATE, **template},
            {"mediaType": OLLAMA_PARAMS, **params},
        ],
    }
    path = root / "manifests" / registry / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return root / "blobs" / model["digest"].replace(":", "-")


def _git_blob_sha1(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hf_download(hub: Path, repo: str, files: dict[str, Path], *, commit: str = "a" * 40,
                revision: str = "main") -> Path:
    """What `hf download REPO` (huggingface_hub) leaves in the cache: each file a blob named by
    its etag (the SHA-256 of a large file stored with LFS, the git blob id of a small one),
    the snapshot a tree of relative links into blobs/, refs/REVISION the commit. The snapshot."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    for name, source in files.items():
        large = source.suffix in (".gguf", ".safetensors", ".bin")
        etag = _sha256(source) if large else _git_blob_sha1(source)
        blob = folder / "blobs" / etag
        if not blob.exists():
            _place(source, blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / revision).write_text(commit)  # huggingface_hub writes no newline
    return snapshot


def hf_download_directory(hub: Path, repo: str, model_dir: Path, **kwargs) -> Path:
    """A transformers model directory's files downloaded into the cache (hf_download)."""
    files = {p.name: p for p in sorted(model_dir.iterdir()) if p.is_file()}
    return hf_download(hub, repo, files, **kwargs)


def node_llama_cpp_pull(home: Path, file_name: str, gguf: Path) -> Path:
    """What node-llama-cpp's `pull` leaves: a plain gguf file in ~/.node-llama-cpp/models."""
    target = home / ".node-llama-cpp" / "models" / file_name
    _place(gguf, target)
    return target
