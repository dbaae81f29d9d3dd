"""The models other tools keep on this machine: ``load``'s references to them, and ``models/list``.

A person who runs local models already has some, kept where the tool that fetched them put
them. The worker finds them there, offline (nothing is ever downloaded), in the layouts
those tools write:

- Ollama: ``manifests/<registry>/<namespace>/<name>/<tag>`` (JSON) under its models directory
  (``OLLAMA_MODELS``, else ``~/.ollama/models``); the layer of media type
  ``application/vnd.ollama.image.model`` names the gguf, ``blobs/sha256-<hex>``. Referenced as
  ``ollama:NAME[:TAG]`` (``latest`` without a tag), ``ollama:NAMESPACE/NAME:TAG`` outside
  ``library``, ``ollama:HOST/NAMESPACE/NAME:TAG`` outside Ollama's registry.
- The Hugging Face cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``): ``models--<org>--<name>/refs/<revision>`` holds a commit,
  ``snapshots/<commit>/`` the files (links to ``blobs/``). Referenced as
  ``hf:ORG/NAME[@REVISION]``, and in a repository of gguf files ``hf:ORG/NAME:QUANT`` or
  ``hf:ORG/NAME/FILE.gguf``.
- node-llama-cpp's folder (``~/.node-llama-cpp/models``) and each ``--models-dir``: plain
  gguf files (and model directories), referenced by their name (``NAME`` for ``NAME.gguf``).

What this module reads belongs to other programs and may hold anything (a FIFO under a
model's name, a directory of ten thousand entries, a link loop): files are read through
worker.files (regular files only, opened without waiting, bounded), a gguf's header through
worker.gguf.reader (its bounds), and every directory walk stops after a fixed number of
entries. ``models/list`` reads headers, manifests and configurations only, never weights.
Torch-free.
"""

from __future__ import annotations

import os
import re
import secrets
import struct
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from protocol.errors import ErrorKind, RpcError
from protocol.methods import ModelEntry, ModelsListResult, SearchedPlace
from worker import tool_calls
from worker.files import NotRegularFile, open_regular, read_small
from worker.gguf import types as gguf_types

Source = Literal["ollama", "huggingface", "node-llama-cpp", "models-dir"]

# Bounds: a directory another program (or anyone) filled must not hold models/list or a load
# for long, nor fill the answer.
MAX_DIRECTORY_ENTRIES = 4096  # entries looked at in one searched place
MAX_MODELS = 1024  # models in one answer
MAX_DEPTH = 3  # folders below a models directory (or a snapshot) walked into
MAX_MANIFEST_BYTES = 1 << 20
MAX_CONFIG_BYTES = 4 << 20  # config.json
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20  # tokenizer_config.json (added tokens, a chat template)
MAX_SAFETENSORS_HEADER = 16 << 20
MAX_CANDIDATES = 8  # named in an ambiguous reference's error
MAX_SHOWN = 200  # characters of a reference a message repeats (a host may send 100 KB of one)
MAX_SHAPE = 8  # dimensions of a safetensors tensor counted (more: its parameters are not counted)
MAX_PARAMETERS = (1 << 63) - 1  # a count past this is no model's: not counted

OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_NAMESPACE = "library"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"

# What the transformers backend computes on a gguf's own blocks (its gguf_model.ARCHITECTURES and
# gguf_weights.LAYOUTS, which import torch; tests/test_model_refs.py holds these equal to them).
MAPPED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
KERNEL_TYPES = frozenset(
    {gguf_types.F32, gguf_types.F16, gguf_types.BF16, gguf_types.Q4_0, gguf_types.Q4_1, gguf_types.Q5_0,
     gguf_types.Q5_1, gguf_types.Q8_0, gguf_types.Q4_K, gguf_types.Q5_K, gguf_types.Q6_K}
)
# llama.cpp's general.file_type numbers (llama_ftype): how a file was quantized, as its name says it.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4_MOE",
}

_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_OLLAMA = re.compile(rf"^(?P<path>(?:{_SEGMENT}(?::[0-9]{{1,5}})?/)?(?:{_SEGMENT}/)?{_SEGMENT})(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9._-]{{0,127}}))?$(?!\n)")
_HF = re.compile(
    rf"^(?P<repo>{_SEGMENT}(?:/{_SEGMENT})?)(?:@(?P<revision>[A-Za-z0-9_][A-Za-z0-9._-]{{0,127}}))?"
    rf"(?::(?P<quant>[A-Za-z0-9_]{{1,32}})|/(?P<file>(?:{_SEGMENT}/){{0,{MAX_DEPTH}}}{_SEGMENT}))?$(?!\n)"
)
_REVISION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$(?!\n)")  # a ref's name, as a reference spells it
_COMMIT = re.compile(r"^[0-9a-f]{40}$(?!\n)")
_DIGEST = re.compile(r"^sha256:(?P<hex>[0-9a-f]{64})$(?!\n)")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}$(?!\n)")  # llama.cpp's split files: NAME-00001-of-00003.gguf
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")


class ModelPlaces(msgspec.Struct, frozen=True):
    """Where models of other tools are looked for: from the environment, and ``--models-dir``."""

    ollama: Path
    huggingface: Path
    node_llama_cpp: Path
    models_dirs: tuple[Path, ...] = ()

    @classmethod
    def from_environment(cls, models_dirs: Collection[Path] = (), environ: Mapping[str, str] = os.environ) -> ModelPlaces:
        home = Path(environ.get("HOME") or os.path.expanduser("~"))
        ollama = environ.get("OLLAMA_MODELS")
        hub = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE")
        if not hub:
            hf_home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME") or home / ".cache", "huggingface")
            hub = os.path.join(hf_home, "hub")

        def absolute(path: str | Path) -> Path:  # a relative one: from the directory the worker started in
            return Path(os.path.abspath(os.path.expanduser(path)))

        return cls(
            ollama=absolute(ollama) if ollama else absolute(home / ".ollama" / "models"),
            huggingface=absolute(hub),
            node_llama_cpp=absolute(home / ".node-llama-cpp" / "models"),
            models_dirs=tuple(absolute(d) for d in models_dirs),
        )

    def local(self) -> list[tuple[Source, Path]]:
        """The folders searched for plain gguf files by name, in order."""
        return [("node-llama-cpp", self.node_llama_cpp), *(("models-dir", d) for d in self.models_dirs)]


class Resolved(msgspec.Struct, frozen=True):
    """A reference resolved: the path the backend is given, and the model's own file or
    directory, which load reports (an Ollama blob is given through a link named .gguf)."""

    reference: str
    path: Path
    file: Path


def resolve(model: str, places: ModelPlaces, data_dir: Path, own_names: Collection[str] = ()) -> Resolved | None:
    """The path ``model`` names where it is a reference to another tool's model; None where it
    is none (a path, or a name the backend knows itself), for the backend to take as it is.
    -32002 ``model_not_found`` for a reference that matches nothing (naming where it looked),
    or several things (naming them); ``model_load_failed`` for a manifest or cache entry that
    cannot be read."""
    if model.startswith("ollama:"):
        return _resolve_ollama(model, places.ollama, data_dir)
    if model.startswith("hf:"):
        return _resolve_hf(model, places.huggingface)
    if model in own_names or not _bare_name(model) or os.path.lexists(os.path.expanduser(model)):
        return None
    return _resolve_name(model, places, own_names)


def _not_found(message: str) -> RpcError:
    return RpcError(ErrorKind.MODEL_NOT_FOUND, message, field="params.model")


def _failed(message: str) -> RpcError:
    return RpcError(ErrorKind.MODEL_LOAD_FAILED, message, field="params.model")


def _listed(names: list[str]) -> str:
    shown = ", ".join(_shown(n) for n in names[:MAX_CANDIDATES])
    return shown + (f" and {len(names) - MAX_CANDIDATES} more" if len(names) > MAX_CANDIDATES else "")


def _shown(text: str) -> str:
    """``text`` quoted for a message: its first MAX_SHOWN characters, control characters and
    lone surrogates escaped (repr), so that a host's 100 KB or NUL-laden reference comes back
    short and encodable."""
    return repr(text[:MAX_SHOWN]) + (f" (… {len(text)} characters)" if len(text) > MAX_SHOWN else "")


def _decode_json(data: bytes, type: Any = Any) -> Any:
    """JSON another program wrote: msgspec.DecodeError also for JSON nested too deeply (msgspec
    raises RecursionError at a depth of about a thousand, which no manifest or configuration has)."""
    try:
        return msgspec.json.decode(data, type=type)
    except RecursionError:
        raise msgspec.DecodeError("JSON nested too deeply") from None


def _inside(path: Path, root: Path) -> bool:
    """Whether ``path``, its links followed, lies in ``root`` (its links followed too: a models
    directory may itself be a link to another disk)."""
    try:
        real, top = os.path.realpath(path), os.path.realpath(root)
        return os.path.commonpath([real, top]) == top
    except (OSError, ValueError):
        return False


def _outside(what: str, path: Path, root: Path) -> RpcError:
    return _failed(f"{what} ({str(path)!r}) is a link to {os.path.realpath(path)!r}, outside {str(root)!r}: "
                   "lm-worker reads only what lies in the directories that tool keeps.")


def _utf8(text: str) -> bool:
    """Whether ``text`` is valid Unicode (a file name of bytes that are not UTF-8 reads as lone
    surrogates, which no JSON answer can carry and no reference can name)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


# --- Ollama ------------------------------------------------------------------------------------


class _OllamaLayer(msgspec.Struct, frozen=True):
    mediaType: str  # noqa: N815  # the manifest's own key
    digest: str
    size: int = 0


class _OllamaManifest(msgspec.Struct, frozen=True):
    layers: list[_OllamaLayer] = []


def _ollama_name(model: str) -> tuple[str, str, str, str]:
    """registry, namespace, name and tag of an ``ollama:`` reference (-32602-like errors as -32002)."""
    match = _OLLAMA.match(model.removeprefix("ollama:"))
    if match is None or ".." in match["path"].split("/"):
        raise _not_found(
            f"{_shown(model)} is not an Ollama reference: write ollama:NAME[:TAG] (ollama:qwen2.5-coder:0.5b), "
            "ollama:NAMESPACE/NAME:TAG outside the library, or ollama:HOST/NAMESPACE/NAME:TAG."
        )
    parts = match["path"].split("/")
    registry, namespace = OLLAMA_REGISTRY, OLLAMA_NAMESPACE
    if len(parts) == 3:
        registry, namespace = parts[0], parts[1]
    elif len(parts) == 2:
        namespace = parts[0]
    return registry, namespace, parts[-1], match["tag"] or "latest"


def ollama_reference(registry: str, namespace: str, name: str, tag: str) -> str:
    """The shortest reference of a manifest, as Ollama itself names the model."""
    if registry != OLLAMA_REGISTRY:
        return f"ollama:{registry}/{namespace}/{name}:{tag}"
    return f"ollama:{name}:{tag}" if namespace == OLLAMA_NAMESPACE else f"ollama:{namespace}/{name}:{tag}"


def _ollama_blob(manifest_path: Path, root: Path) -> Path:
    """The model layer's blob a manifest names (-32002 for a manifest that cannot be read or
    has no model layer, or where the manifest or the blob is a link out of the models directory:
    Ollama writes both as files, and a blob as blobs/sha256-<hex> itself)."""
    if not _inside(manifest_path, root):
        raise _outside("The Ollama manifest", manifest_path, root)
    try:
        manifest = _decode_json(read_small(manifest_path, MAX_MANIFEST_BYTES), _OllamaManifest)
    except (OSError, msgspec.DecodeError) as exc:
        raise _failed(f"Cannot read the Ollama manifest {str(manifest_path)!r}: {_why(exc)}.") from exc
    layers = [layer for layer in manifest.layers if layer.mediaType == OLLAMA_MODEL_LAYER]
    if not layers:
        raise _failed(f"The Ollama manifest {str(manifest_path)!r} has no layer of type {OLLAMA_MODEL_LAYER} "
                      "(a model's weights): nothing there to load.")
    digest = _DIGEST.match(layers[0].digest)
    if digest is None:
        raise _failed(f"The Ollama manifest {str(manifest_path)!r} names its model layer {layers[0].digest[:80]!r}, "
                      "not sha256:<64 hex digits>.")
    blob = root / "blobs" / f"sha256-{digest['hex']}"
    if os.path.realpath(blob) != os.path.join(os.path.realpath(root / "blobs"), blob.name):
        raise _outside(f"The blob the Ollama manifest {str(manifest_path)!r} names", blob, root / "blobs")
    return blob


def _resolve_ollama(model: str, root: Path, data_dir: Path) -> Resolved:
    registry, namespace, name, tag = _ollama_name(model)
    folder = root / "manifests" / registry / namespace / name
    manifest = folder / tag
    if not os.path.lexists(manifest):
        tags = sorted(_names(folder))
        there = (f"; its tags there: {_listed(tags)}" if tags else
                 f"; Ollama's models directory is {str(root)!r} (OLLAMA_MODELS, else ~/.ollama/models)")
        raise _not_found(f"No Ollama model {_shown(model)}: no manifest at {str(manifest)!r}{there}. "
                         f"Pull it with `ollama pull {model.removeprefix('ollama:')}`, or see models/list.")
    blob = _ollama_blob(manifest, root)
    _regular_or_fail(blob, f"The blob of {_shown(model)}")
    return Resolved(reference=model, path=_gguf_link(blob, data_dir), file=blob)


def _gguf_link(blob: Path, data_dir: Path) -> Path:
    """A link named .gguf to an Ollama blob (named sha256-<hex>), in the data directory: the
    backend knows a gguf by its name. Named after the blob, so every tag of one model keeps the
    same name, and with it its caches; made beside and renamed into place (workers loading at
    once never see half a link)."""
    folder = data_dir / "links" / "ollama"
    link = folder / f"{blob.name}.gguf"
    blob = Path(os.path.abspath(blob))  # a link's relative target is read from the link's folder
    try:
        if os.readlink(link) == str(blob) and _links_to(link, blob):
            return link
    except OSError:
        pass
    temporary = folder / f".{link.name}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.symlink(blob, temporary)
        os.replace(temporary, link)
    except OSError as exc:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise _failed(f"Cannot link the Ollama blob {str(blob)!r} into {str(folder)!r}: {_why(exc)}. "
                      "Check that the data directory is writable (--data-dir).") from exc
    if not _links_to(link, blob):  # a folder of the data directory that is itself a link, changed meanwhile
        raise _failed(f"The link {str(link)!r} made to the Ollama blob {str(blob)!r} leads to "
                      f"{os.path.realpath(link)!r} instead: check what else writes in the data directory.")
    return link


def _links_to(link: Path, blob: Path) -> bool:
    """Whether opening ``link`` opens ``blob`` (both followed to the end)."""
    return os.path.realpath(link) == os.path.realpath(blob)


# --- the Hugging Face cache ----------------------------------------------------------------------


def hf_folder(repo: str) -> str:
    """The cache's folder of a model repository: models--ORG--NAME."""
    return "models--" + repo.replace("/", "--")


def _resolve_hf(model: str, hub: Path) -> Resolved:
    match = _HF.match(model.removeprefix("hf:"))
    if match is None or ".." in (match["file"] or "").split("/"):
        raise _not_found(
            f"{_shown(model)} is not a Hugging Face reference: write hf:ORG/NAME, with @REVISION if not main, "
            "and for a repository of gguf files :QUANT (hf:ORG/NAME:Q4_K_M) or /FILE.gguf."
        )
    repo, revision = match["repo"], match["revision"]
    folder = hub / hf_folder(repo)
    if not folder.is_dir():
        raise _not_found(f"No Hugging Face model {_shown(model)}: no {str(folder)!r} in the cache "
                         "(HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub). "
                         f"Download it (`hf download {repo}`), or see models/list.")
    snapshot = _snapshot(folder, revision, model)
    base = f"hf:{repo}" + (f"@{revision}" if revision else "")
    if match["file"]:
        file = snapshot / match["file"]
        if not os.path.lexists(file):
            ggufs = [f"{base}/{p.relative_to(snapshot)}" for p in _ggufs_in(snapshot)]
            raise _not_found(f"No file {match['file']!r} in {str(snapshot)!r} ({_shown(model)})"
                             + (f"; its gguf files: {_listed(ggufs)}." if ggufs else "."))
        _contained_or_fail(file, folder, _shown(model))
        _regular_or_fail(file, f"{_shown(model)} ({str(file)!r})")
        return Resolved(reference=model, path=file, file=file)
    ggufs = _ggufs_in(snapshot)
    if match["quant"]:
        chosen = [p for p in ggufs if _has_quant(p, match["quant"])]
        if not chosen:
            names = [f"{base}/{p.relative_to(snapshot)}" for p in ggufs]
            raise _not_found(f"No {match['quant']} gguf file in {str(snapshot)!r} ({_shown(model)})"
                             + (f"; its gguf files: {_listed(names)}." if names else ": it holds no gguf file."))
    elif (snapshot / "config.json").exists():
        for path, _ in _walk(snapshot, MAX_DEPTH, [0]):  # every file transformers may read in it
            _contained_or_fail(path, folder, _shown(model))
        return Resolved(reference=model, path=snapshot, file=snapshot)
    else:
        chosen = ggufs
        if not chosen:
            raise _failed(f"{str(snapshot)!r} ({_shown(model)}) holds neither config.json nor a gguf file: "
                          "nothing there to load (an incomplete download?).")
    if len(chosen) > 1:
        names = [f"{base}/{p.relative_to(snapshot)}" for p in chosen]
        raise _not_found(f"{_shown(model)} is ambiguous: {len(chosen)} gguf files match: {_listed(names)}; load one of them.")
    _contained_or_fail(chosen[0], folder, _shown(model))
    _regular_or_fail(chosen[0], f"{_shown(model)} ({str(chosen[0])!r})")
    return Resolved(reference=model, path=chosen[0], file=chosen[0])


def _snapshot(folder: Path, revision: str | None, model: str) -> Path:
    """The snapshot a revision names (one in ``folder``, its links followed: -32002
    model_load_failed for a link out of it)."""
    snapshot = _named_snapshot(folder, revision, model)
    _contained_or_fail(snapshot, folder, _shown(model))
    return snapshot


def _contained_or_fail(path: Path, folder: Path, what: str) -> None:
    """-32002 model_load_failed where ``path`` is a link out of ``folder`` (a cache's file links
    into its own blobs/; one that leads elsewhere was not written by the tool)."""
    if not _inside(path, folder):
        raise _outside(what, path, folder)


def _named_snapshot(folder: Path, revision: str | None, model: str) -> Path:
    """The snapshot a revision names: refs/<revision> holds its commit (a commit names itself);
    without a revision, refs/main, or the one snapshot where there is no refs/main."""
    snapshots = folder / "snapshots"
    if revision is not None and _COMMIT.match(revision) and (snapshots / revision).is_dir():
        return snapshots / revision
    ref = folder / "refs" / (revision or "main")
    try:
        commit = read_small(ref, 256).decode("ascii", "replace").strip()
    except FileNotFoundError:
        present = sorted(name for name in _names(snapshots) if _COMMIT.match(name))
        if revision is None and len(present) == 1:
            return snapshots / present[0]
        refs = sorted(_names(folder / "refs"))
        raise _not_found(f"No revision {revision or 'main'!r} of {_shown(model)} in {str(folder)!r}: no {str(ref)!r}"
                         + (f"; its refs: {_listed(refs)}" if refs else "") + ".") from None
    except OSError as exc:
        raise _failed(f"Cannot read {str(ref)!r} ({_shown(model)}): {_why(exc)}.") from exc
    if not _COMMIT.match(commit) or not (snapshots / commit).is_dir():
        raise _failed(f"{str(ref)!r} names {commit[:60]!r}, which is no snapshot in {str(snapshots)!r} ({_shown(model)}).")
    return snapshots / commit


def _has_quant(path: Path, quant: str) -> bool:
    return re.search(rf"(^|[._-]){re.escape(quant.upper())}($|[._-])", path.stem.upper()) is not None


def _ggufs_in(folder: Path) -> list[Path]:
    """The gguf files in a snapshot, its folders included (bounded)."""
    return sorted(p for p, is_dir in _walk(folder, MAX_DEPTH, [0]) if not is_dir and p.suffix == ".gguf")


# --- plain gguf files by name --------------------------------------------------------------------


def _bare_name(model: str) -> bool:
    """A name, not a path: looked up in the models directories."""
    return bool(model) and "/" not in model and os.sep not in model and not model.startswith((".", "~"))


def _resolve_name(model: str, places: ModelPlaces, own_names: Collection[str]) -> Resolved:
    found: list[Path] = []
    for _, folder in places.local():
        for path, is_dir in _walk(folder, MAX_DEPTH, [0]):
            if path.name in (model, f"{model}.gguf") and (path.suffix == ".gguf" and not is_dir or
                                                          is_dir and (path / "config.json").exists()):
                found.append(path)
    if len(found) == 1:
        return Resolved(reference=model, path=found[0], file=found[0])
    if found:
        raise _not_found(f"{_shown(model)} is ambiguous: {len(found)} models of that name: "
                         f"{_listed([str(p) for p in found])}; load one by its path.")
    looked = ", ".join(repr(str(folder)) for _, folder in places.local())
    shipped = f", nor a shipped model ({', '.join(repr(n) for n in own_names)})" if own_names else ""
    raise _not_found(
        f"No model {_shown(model)}: no such file or directory{shipped}, and no {_shown(model + '.gguf')} (or model "
        f"directory {_shown(model)}) in {looked} (node-llama-cpp's folder, then --models-dir). Give a path, a name there, "
        "ollama:NAME[:TAG] or hf:ORG/NAME; models/list names what there is."
    )


# --- directories and files -----------------------------------------------------------------------


def _names(folder: Path) -> list[str]:
    """The names in a folder, at most MAX_DIRECTORY_ENTRIES; none where it cannot be read."""
    out: list[str] = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if len(out) >= MAX_DIRECTORY_ENTRIES:
                    break
                out.append(entry.name)
    except OSError:
        pass
    return out


def _walk(folder: Path, depth: int, seen: list[int]) -> Iterator[tuple[Path, bool]]:
    """(path, is a directory) of the entries under ``folder`` down to ``depth`` folders, hidden
    ones left out, sorted by name within a folder; ``seen[0]`` counts the entries looked at, and
    the walk stops at MAX_DIRECTORY_ENTRIES. A link to a directory is not walked into (a loop
    would never end), though one is reported as a directory (a model folder may be one). A name
    of bytes that are not UTF-8 is passed over: no reference names it, no JSON answer holds it."""
    try:
        with os.scandir(folder) as scan:
            entries = []
            for entry in scan:
                seen[0] += 1
                if seen[0] > MAX_DIRECTORY_ENTRIES:
                    break
                if not entry.name.startswith(".") and _utf8(entry.path):
                    entries.append(entry)
    except OSError:
        return
    for entry in sorted(entries, key=lambda e: e.name):
        try:
            is_dir = entry.is_dir()  # follows a link
            real_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        yield Path(entry.path), is_dir
        if real_dir and depth > 0 and seen[0] <= MAX_DIRECTORY_ENTRIES:
            yield from _walk(Path(entry.path), depth - 1, seen)


def _regular_or_fail(path: Path, what: str) -> None:
    try:
        os.close(open_regular(path))
    except FileNotFoundError as exc:
        raise _failed(f"{what} is missing: {str(path)!r} (an incomplete download or pull?).") from exc
    except OSError as exc:
        raise _failed(f"{what} cannot be read: {str(path)!r}: {_why(exc)}.") from exc


def _why(exc: BaseException) -> str:
    if isinstance(exc, NotRegularFile):
        return "not a regular file (a FIFO, device or directory)"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)[:300]


# --- models/list ---------------------------------------------------------------------------------


class _Listing:
    """The answer being built: entries up to MAX_MODELS."""

    def __init__(self) -> None:
        self.models: list[ModelEntry] = []
        self.searched: list[SearchedPlace] = []
        self.truncated = False

    def full(self) -> bool:
        if len(self.models) >= MAX_MODELS:
            self.truncated = True
        return self.truncated

    def place(self, source: Source, path: Path, before: int, seen: list[int], notes: list[str]) -> None:
        if seen[0] > MAX_DIRECTORY_ENTRIES:
            notes.append(f"stopped after {MAX_DIRECTORY_ENTRIES} entries")
        exists = path.is_dir()
        if exists and not os.access(path, os.R_OK | os.X_OK):
            notes.insert(0, "cannot be read (permission denied)")
        elif not exists and os.path.lexists(path):
            notes.insert(0, "not a directory")
        if not _utf8(str(path)):
            notes.insert(0, "its path is not UTF-8: not searched")
        self.searched.append(SearchedPlace(
            source=source, path=str(path).encode("utf-8", "backslashreplace").decode("utf-8"), exists=exists,
            models=len(self.models) - before,
            note="; ".join(notes[:MAX_CANDIDATES]) or None,
        ))


def list_models(places: ModelPlaces, own_names: Collection[str] = ()) -> ModelsListResult:
    """Every model found in the places, described from headers and manifests."""
    listing = _Listing()
    _list_ollama(places.ollama, listing)
    _list_hf(places.huggingface, listing)
    found: list[tuple[Source, Path, int, list[int], list[str], list[tuple[Path, bool]]]] = []
    for source, folder in places.local():
        seen: list[int] = [0]
        models = [(p, d) for p, d in _walk(folder, MAX_DEPTH, seen)
                  if (p.suffix == ".gguf" and not d) or (d and (p / "config.json").exists())]
        found.append((source, folder, len(listing.models), seen, [], models))
    names: dict[str, int] = {}
    for *_, models in found:
        for path, _ in models:
            stem = path.stem if path.suffix == ".gguf" else path.name
            names[stem] = names.get(stem, 0) + 1
    for source, folder, _, seen, notes, models in found:
        before = len(listing.models)
        for path, is_dir in models:
            if listing.full():
                break
            stem = path.stem if path.suffix == ".gguf" else path.name
            unique = names[stem] == 1 and stem not in own_names and not os.path.lexists(stem)
            reference = stem if unique and _bare_name(stem) else str(path)
            listing.models.append(_describe(reference, source, path, is_dir, None))
        listing.place(source, folder, before, seen, notes)
    return ModelsListResult(models=listing.models, searched=listing.searched, truncated=listing.truncated)


def _list_ollama(root: Path, listing: _Listing) -> None:
    before, seen, notes = len(listing.models), [0], []
    manifests = root / "manifests"
    for registry, _ in _walk(manifests, 0, seen):
        for namespace, _ in _walk(registry, 0, seen):
            for name, _ in _walk(namespace, 0, seen):
                for tag, is_dir in _walk(name, 0, seen):
                    if is_dir or listing.full():
                        continue
                    reference = ollama_reference(registry.name, namespace.name, name.name, tag.name)
                    if not _OLLAMA.match(reference.removeprefix("ollama:")):
                        notes.append(f"{str(tag.relative_to(manifests))!r} is no name Ollama gives: passed over")
                        continue
                    try:
                        blob = _ollama_blob(tag, root)
                    except RpcError as exc:
                        notes.append(exc.message)
                        continue
                    listing.models.append(_describe(reference, "ollama", blob, False, None))
    listing.place("ollama", root, before, seen, notes)


def _list_hf(hub: Path, listing: _Listing) -> None:
    before, seen, notes = len(listing.models), [0], []
    for folder, is_dir in _walk(hub, 0, seen):
        if not is_dir or not folder.name.startswith("models--") or listing.full():
            continue
        repo = folder.name.removeprefix("models--").replace("--", "/")
        if not re.match(rf"^{_SEGMENT}(/{_SEGMENT})?$(?!\n)", repo):
            continue
        named: dict[str, str] = {}  # snapshot commit: the reference's revision part
        for ref, ref_is_dir in _walk(folder / "refs", 0, seen):
            if ref_is_dir:
                continue
            try:
                commit = read_small(ref, 256).decode("ascii", "replace").strip()
            except OSError:
                continue
            if _COMMIT.match(commit) and _REVISION.match(ref.name) and (commit not in named or ref.name == "main"):
                named[commit] = "" if ref.name == "main" else f"@{ref.name}"
        for snapshot, snapshot_is_dir in _walk(folder / "snapshots", 0, seen):
            if not snapshot_is_dir or not _COMMIT.match(snapshot.name):
                continue
            if not _inside(snapshot, folder):
                notes.append(_outside("A snapshot", snapshot, folder).message)
                continue
            base = f"hf:{repo}" + named.get(snapshot.name, f"@{snapshot.name}")
            if (snapshot / "config.json").exists() and not listing.full():
                listing.models.append(_describe(base, "huggingface", snapshot, True, folder))
            for path, path_is_dir in _walk(snapshot, MAX_DEPTH, seen):
                if path.suffix == ".gguf" and not path_is_dir and not listing.full():
                    reference = f"{base}/{path.relative_to(snapshot)}"
                    if not _HF.match(reference.removeprefix("hf:")):  # a file name no reference spells: its path
                        reference = str(path)
                    listing.models.append(_describe(reference, "huggingface", path, False, folder))
    listing.place("huggingface", hub, before, seen, notes)


def _describe(reference: str, source: Source, path: Path, is_dir: bool, root: Path | None) -> ModelEntry:
    """A model's entry, from its header or configuration; where ``root`` is given, a file of it
    that is a link out of ``root`` is not read (the entry says so)."""
    entry = ModelEntry(
        reference=reference, source=source, path=str(path), format="transformers" if is_dir else "gguf",
        architecture=None, parameters=None, quantization=None, size_bytes=0, context_length=None,
        has_chat_template=False, tool_calls=None, loadable=False, reason=None,
    )
    if root is not None:
        files = [p for p, _ in _walk(path, MAX_DEPTH, [0])] if is_dir else [path]
        outside = [p for p in files if not _inside(p, root)]
        if outside:
            entry.reason = f"a link out of {str(root)!r}, not read: {_listed([str(p) for p in outside])}"
            return entry
    if is_dir:
        _describe_directory(entry, path)
    else:
        _describe_gguf(entry, path)
    return entry


def _with_template(entry: ModelEntry, template: str | None) -> None:
    entry.has_chat_template = bool(template)
    entry.tool_calls = tool_calls.support(template) if template else None


def _describe_gguf(entry: ModelEntry, path: Path) -> None:
    from worker.gguf.reader import GgufError, read

    try:
        file = read(path)
    except FileNotFoundError:
        entry.reason = f"{path} is missing (an incomplete download or pull?)"
        return
    except (OSError, GgufError) as exc:
        entry.reason = f"not a gguf lm-worker reads: {_why(exc)}"
        return
    try:
        entry.size_bytes = file.size
        arch = file.get("general.architecture", str)
        entry.architecture = arch
        entry.parameters = sum(tensor.count for tensor in file.tensors.values())
        file_type = file.get("general.file_type", int)
        entry.quantization = FILE_TYPES.get(file_type, f"file type {file_type}") if file_type is not None else _main_type(file)
        length = file.get(f"{arch}.context_length", int) if arch else None
        entry.context_length = length if isinstance(length, int) and length > 0 else None
        _with_template(entry, file.get("tokenizer.chat_template", str))
        entry.loadable, entry.reason = _gguf_loadable(file, arch, path)
    except GgufError as exc:
        entry.loadable, entry.reason = False, f"its metadata: {exc}"
    finally:
        file.close()


def _main_type(file: Any) -> str | None:
    """The type holding most of a file's matrix bytes, where it does not name its file type."""
    sizes: dict[int, int] = {}
    for tensor in file.tensors.values():
        if len(tensor.shape) >= 2:
            sizes[tensor.type] = sizes.get(tensor.type, 0) + tensor.size
    return gguf_types.type_name(max(sizes, key=lambda t: sizes[t])) if sizes else None


def _gguf_loadable(file: Any, arch: str | None, path: Path) -> tuple[bool, str | None]:
    parts = file.get("split.count", int)
    if (isinstance(parts, int) and parts > 1) or _SPLIT.search(path.stem):
        return False, "a gguf split into several files; lm-worker loads a gguf of one file (llama.cpp's gguf-split --merge joins them)"
    if arch is None:
        return False, "its metadata names no general.architecture"
    if arch not in MAPPED_ARCHITECTURES:
        return True, (f"a {arch!r} gguf: lm-worker computes {', '.join(MAPPED_ARCHITECTURES)} on their own blocks; "
                      "this one goes through transformers' gguf loader (every tensor dequantized, then int8), "
                      "where transformers knows the architecture")
    for tensor in file.tensors.values():
        if len(tensor.shape) >= 2 and tensor.type not in KERNEL_TYPES:
            taken = ", ".join(gguf_types.type_name(t) for t in sorted(KERNEL_TYPES))
            return False, (f"tensor {tensor.name} is {gguf_types.type_name(tensor.type)}, which lm-worker does not "
                           f"multiply; it takes {taken}")
    return True, None


def _describe_directory(entry: ModelEntry, folder: Path) -> None:
    files = [p for p, is_dir in _walk(folder, 1, [0]) if not is_dir]
    missing = [p.name for p in files if not os.path.exists(p)]
    entry.size_bytes = sum(_size(p) for p in files)
    try:
        config = _decode_json(read_small(folder / "config.json", MAX_CONFIG_BYTES))
    except (OSError, msgspec.DecodeError) as exc:
        entry.reason = f"its config.json cannot be read: {_why(exc)}"
        return
    if not isinstance(config, dict):
        entry.reason = "its config.json is not a JSON object"
        return
    text = config.get("text_config")
    text = text if isinstance(text, dict) else {}
    model_type = config.get("model_type")
    entry.architecture = model_type if isinstance(model_type, str) else None
    length = config.get("max_position_embeddings", text.get("max_position_embeddings"))
    entry.context_length = length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
    quantized = config.get("quantization_config")
    dtype = config.get("dtype", config.get("torch_dtype"))
    if isinstance(quantized, dict) and isinstance(quantized.get("quant_method"), str):
        entry.quantization = quantized["quant_method"]
    elif isinstance(dtype, str):
        entry.quantization = dtype
    entry.parameters = _safetensors_parameters([p for p in files if p.suffix == ".safetensors"])
    _with_template(entry, _directory_template(folder))
    weights = [p for p in files if p.suffix in _WEIGHTS]
    irregular = [p.name for p in files if p.name not in missing and not _regular(p)]
    if missing:
        entry.reason = f"files missing (an incomplete download?): {_listed(sorted(missing))}"
    elif irregular:
        entry.reason = f"not a regular file (a FIFO, device or socket): {_listed(sorted(irregular))}"
    elif not weights:
        entry.reason = "no weights files (.safetensors, .bin) in it"
    else:
        entry.loadable = True


def _directory_template(folder: Path) -> str | None:
    """A model directory's chat template: chat_template.jinja, else tokenizer_config.json's."""
    try:
        return read_small(folder / "chat_template.jinja", MAX_TOKENIZER_CONFIG_BYTES).decode("utf-8", "replace")
    except OSError:
        pass
    try:
        config = _decode_json(read_small(folder / "tokenizer_config.json", MAX_TOKENIZER_CONFIG_BYTES))
    except (OSError, msgspec.DecodeError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _safetensors_parameters(files: list[Path]) -> int | None:
    """The numbers in the tensors the safetensors files' headers list (their headers alone)."""
    total = 0
    for path in files:
        try:
            fd = open_regular(path)
        except OSError:
            return None
        try:
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                return None
            (length,) = struct.unpack("<Q", head)
            if length > MAX_SAFETENSORS_HEADER:
                return None
            header = _decode_json(os.pread(fd, length, 8))
        except (OSError, msgspec.DecodeError):
            return None
        finally:
            os.close(fd)
        if not isinstance(header, dict):
            return None
        for name, tensor in header.items():
            if name == "__metadata__" or not isinstance(tensor, dict) or not isinstance(tensor.get("shape"), list):
                continue
            shape = tensor["shape"]
            if len(shape) > MAX_SHAPE or not all(type(n) is int and 0 <= n <= MAX_PARAMETERS for n in shape):
                return None  # no tensor's shape (and a product of millions of extents takes minutes)
            count = 1
            for extent in shape:
                count *= extent
            total += count
            if count > MAX_PARAMETERS or total > MAX_PARAMETERS:
                return None
    return total if files else None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _regular(path: Path) -> bool:
    try:
        os.close(open_regular(path))
        return True
    except OSError:
        return False

