"""A model directory whose int8 weights are kept (int8_store) loaded without torch or transformers.

The kept file's name is a digest of the configuration as transformers resolves it (the
identity's config_sha256: every field of its configuration class, defaults and all, by the
installed transformers' rules), which nothing but transformers computes. So the torch path, once
it has loaded a model from its kept file or written it, notes beside it what a later load needs
and only it knew (``Note``): the file's key, the model's identity (caches made by either load
are one), the numbers its native pass computed with (int8_pass.Int8Config), its vocabulary
size, EOS ids and context length. The note's name is a torch-free digest of what those came
from (``locator``): every file of the directory, its name, the installed transformers' version
and the native pass's kernels; a change to any of them finds no note, and the torch path loads
the model and notes it again.

The model is then int8_pass's passes over int8_file's views of the kept file (checked whole),
native_model's caches, and the directory's tokenizer read by worker.tokenizer: logits and
greedy output those of the torch path bit for bit. Where anything is missing or refused (no
note, a file that fails its checks, a tokenizer worker.tokenizer does not answer for, a kernel
not built) ``load`` gives None and the torch path loads the model, as it did before.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from protocol.methods import LoadParams
from worker.backends.transformers import int8_file, native_pass
from worker.backends.transformers.int8_pass import Int8Config, Int8Pass
from worker.backends.transformers.native_model import ArrayModel, NativeCache
from worker.kvcache.format import Identity

log = logging.getLogger(__name__)

NOTE_SUFFIX = ".note"
_NOTE_BYTES = 4 << 20  # a note is a few kilobytes: its RoPE frequencies the most of it
# The sources of the kernels the pass computes with, and of the rules that make the torch path's
# key, configuration and identity: another version of any is another note.
_SOURCES = (
    native_pass.SOURCE, native_pass.ATTENTION_SOURCE, native_pass.INT8_SOURCE,
    *(Path(__file__).with_name(name) for name in ("backend.py", "hf_compat.py", "int8_store.py", "shell_model.py")),
)


class Note(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a load of the kept weights needs that only the torch path computed (module docstring)."""

    key: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]  # the kept file's (int8_store.key_of)
    identity: Identity
    config: Int8Config
    vocab_size: int
    eos_token_ids: list[int]
    context_length: int


def load(params: LoadParams, path: Path, data_dir: Path, started: float) -> Int8Model | None:
    """The model of a directory ``path`` computed without torch from its kept int8 weights, or
    None where this path does not take it (the torch path then loads it)."""
    from worker.c_build import KernelUnavailable
    from worker.kvcache import checksum

    if not (params.device.split(":")[0] == "cpu" and params.dtype in ("auto", "float32")
            and params.quantization in ("auto", "int8") and not params.trust_remote_code and path.is_dir()):
        return None
    note = read_note(data_dir, path)
    if note is None:
        return None
    tokenizer = _tokenizer(path)
    if tokenizer is None:
        return None
    try:
        checksum.load_kernel(data_dir / "kernels")
        _, tensors = int8_file.read(int8_file.path_of(data_dir, note.key), note.key)
        passes = Int8Pass(tensors, note.config, data_dir)
    except FileNotFoundError:
        return None
    except int8_file.StoreError as exc:  # the torch path checks the file again, and notes it again
        log.warning("%s is loaded through torch: %s", path, exc)
        return None
    except KernelUnavailable as exc:
        log.info("%s is loaded through torch: %s", path, exc)
        return None
    return Int8Model(params, path, passes, tokenizer, note, started)


def locator(directory: Path, data_dir: Path, *, hashing: bool) -> str | None:
    """The digest a note is found by: every regular file of ``directory`` (worker.fingerprint's
    digests, remembered), its name, the installed transformers' version and _SOURCES; None where
    transformers is not installed (no torch path made a note), or, unless ``hashing``, where a
    file's digest is not remembered (the load that noted it remembered all of them: a load with no
    note hashes nothing here, and the torch path's stages keep their order)."""
    from importlib import metadata

    from worker.files import is_regular
    from worker.fingerprint import combined_sha256, file_sha256, remembered

    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None
    files = sorted(path for path in directory.iterdir() if is_regular(path))
    memo = data_dir / "digests"
    # the weights' and tokenizer's are remembered by the identity by then: no "hashing" stage for the few others
    known = {path: file_sha256(path, memo) for path in files} if hashing else remembered(files, memo)
    if known is None:
        return None
    sources = "\0".join(hashlib.sha256(source.read_bytes()).hexdigest() for source in _SOURCES)
    described = f"{directory.name}\0{version}\0{int8_file.FORMAT}\0{native_pass.FORWARD}\0{sources}"
    return combined_sha256(files, known, extra=described)


def note_path(data_dir: Path, found: str) -> Path:
    return data_dir / "int8" / f"{found}{NOTE_SUFFIX}"


def read_note(data_dir: Path, directory: Path) -> Note | None:
    """The note of ``directory``'s kept weights; None where there is none or it cannot serve (the
    log says why)."""
    from worker.files import read_small

    found = locator(directory, data_dir, hashing=False)
    if found is None:
        return None
    try:
        return msgspec.json.decode(read_small(note_path(data_dir, found), _NOTE_BYTES), type=Note)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as exc:
        log.warning("the note of %s's kept int8 weights is not used: %s", directory, exc)
        return None


def write_note(data_dir: Path, directory: Path, note: Note) -> None:
    """Keep ``note`` for ``directory`` (written beside its place and renamed into it)."""
    from worker.kvcache.write import atomic_file, remove_stale_temporaries

    found = locator(directory, data_dir, hashing=True)
    if found is None:
        return
    path = note_path(data_dir, found)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent, NOTE_SUFFIX)
    with atomic_file(path) as out:
        out.write(msgspec.json.encode(note))


def _tokenizer(directory: Path) -> Any:
    """The directory's tokenizer read by worker.tokenizer; None where it does not answer for it
    exactly, or its settings are refused (the torch path reads it, and says why)."""
    from worker.tokenizer import Tokenizer, settings_problem

    try:
        tokenizer = Tokenizer.read(directory)
    except Exception as exc:  # TokenizerUnsupported, or files transformers' reader reports on
        log.info("the tokenizer of %s is read by transformers: %s", directory, exc)
        return None
    return tokenizer if settings_problem(tokenizer) is None else None


class Int8Model(ArrayModel):
    """A kept int8 model computed by int8_pass, torch-free (module docstring)."""

    def __init__(self, params: LoadParams, path: Path, passes: Int8Pass, tokenizer: Any, note: Note, started: float) -> None:
        config = passes.config
        self._model_type = config.model_type
        super().__init__(
            passes, [window or None for window in config.windows],
            params=params, path=path, tokenizer=tokenizer, identity=note.identity, device="cpu", dtype="float32",
            quantization="int8", started=started, vocab_size=note.vocab_size,
            eos_token_ids=frozenset(note.eos_token_ids), context_length=note.context_length,
        )


if TYPE_CHECKING:  # hold the class to the boundary
    from worker.backends.base import CachingModel, DraftingModel, ReasoningModel

    _caching: type[CachingModel[NativeCache]] = Int8Model
    _drafting: type[DraftingModel] = Int8Model
    _reasoning: type[ReasoningModel] = Int8Model
