"""A mapped gguf computed by the native pass alone: a load that imports neither torch nor
transformers.

Importing those two costs a worker about a second and 200 MB at every spawn, more than
llama.cpp's whole load of a small model. A .gguf file of a Llama, Qwen2, Qwen3 or Gemma 3 model,
loaded on the CPU on its own blocks (quantization ``auto`` or ``gguf``, dtype ``auto`` or
``float32``), is therefore served here: its passes gguf_pass's (native_forward.c over the
mapping), its caches kv_buffers' numpy buffers (:class:`NativeCache`), its tokenizer the one kept
in the data directory read by worker.tokenizer, its tokens chosen by worker.sampling. Its
numbers are those the torch model of the same file computes with NativeForward, bit for bit.

The tokenizer is built from the file's metadata once, by transformers' converter (the first
load of a file imports it), and kept under the file's digest; a kept tokenizer
worker.tokenizer cannot answer for exactly is read by transformers instead. Where a kernel
cannot be built, or the model is one gguf_pass does not compute, ``load`` gives None and the
torch path loads the file as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from protocol.errors import ErrorKind, RpcError
from protocol.methods import LoadParams
from worker.backends.transformers.kv_buffers import Cache, growth_room
from worker.backends.transformers.local_model import LocalModel, context_length, eos_ids
from worker.backends.transformers.torch_threads import CoreShare, PassThreads

if TYPE_CHECKING:
    from worker.backends.transformers.gguf_config import GgufConfig
    from worker.backends.transformers.gguf_pass import ArrayPass, GgufPass
    from worker.gguf.reader import GgufFile
    from worker.kvcache.container import Identity, LayerEntry, LoadedCache, StateEntry, TensorEntry, TensorSpec

log = logging.getLogger(__name__)

# What the identity calls this model's cache objects (a file's layout is the torch model's).
CACHE_CLASS = "DynamicCache"
# The tokenizer's name in the identity: the answers of transformers' fast tokenizer, which
# worker.tokenizer gives, whichever of the two reads the kept copy.
TOKENIZER_NAME = "TokenizersBackend"


def load(params: LoadParams, path: Path, data_dir: Path, started: float) -> NativeModel | None:
    """The model of a .gguf ``path`` computed without torch, or None where this path does not
    take it (the torch path then loads it, and says why in its log)."""
    from worker.backends.transformers import gguf_config
    from worker.c_build import KernelUnavailable
    from worker.gguf.reader import GgufError, read

    if not (params.device.split(":")[0] == "cpu" and params.dtype in ("auto", "float32") and params.quantization in ("auto", "gguf")):
        return None
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    try:
        file = read(path)
    except GgufError as exc:
        raise RpcError(ErrorKind.MODEL_LOAD_FAILED, f"Could not load the model: {exc}", field="params.model") from exc
    if gguf_config.ARCHITECTURES.get(file.get("general.architecture", str, "") or "") is None:
        file.close()
        return None
    from worker.backends.transformers.gguf_pass import GgufPass
    from worker.fingerprint import digests

    try:
        passes = GgufPass(file, data_dir)
        digest = digests([path], data_dir / "digests")[path]
        tokenizer = _tokenizer(file, data_dir / "gguf" / digest)
    except (gguf_config.NotTaken, KernelUnavailable) as exc:
        log.info("%s is loaded through torch: %s", path, exc)
        file.close()
        return None
    except GgufError as exc:
        file.close()
        raise RpcError(ErrorKind.MODEL_LOAD_FAILED, f"Could not load the model: {exc}", field="params.model") from exc
    identity = _identity(path, passes.config, tokenizer, digest)
    return NativeModel(params, path, passes, tokenizer, identity, started)


def _tokenizer(file: GgufFile, kept: Path) -> Any:
    """The file's tokenizer kept in ``kept``, read by worker.tokenizer; built (and kept) by
    transformers' converter where it is not kept yet or its copy is damaged, and read by
    transformers where worker.tokenizer cannot answer for it exactly."""
    from worker.tokenizer import Tokenizer, TokenizerUnsupported, settings_problem

    try:
        tokenizer = Tokenizer.read(kept)
        problem = settings_problem(tokenizer)
        if problem is None and tokenizer.chat_template != file.get("tokenizer.chat_template", str):
            problem = "another chat template than the file's"  # a copy that lost its chat_template.jinja
        if problem is None:
            return tokenizer
        log.warning("the kept tokenizer in %s gives %s: built again", kept, problem)
        # transformers would read the same copy: it goes (the build puts the new one in its place)
        shutil.rmtree(kept, ignore_errors=True)
    except TokenizerUnsupported as exc:
        log.info("the tokenizer kept in %s is read by transformers: %s", kept, exc)
    except Exception as exc:  # absent, or a damaged copy the converter makes again
        log.debug("no kept tokenizer in %s (%s: %s)", kept, type(exc).__name__, exc)
    from worker.backends.transformers.gguf_model import tokenizer_of

    made = tokenizer_of(file, kept)
    try:
        return Tokenizer.read(kept)
    except Exception:  # not kept (a read-only data directory), or not one worker.tokenizer takes
        return made


def _identity(path: Path, config: GgufConfig, tokenizer: Any, digest: str) -> Identity:
    """What a cache of this model must match: the file's every byte (weights, configuration,
    tokenizer and chat template are all in it), the configuration gguf_config reads of it and
    the arithmetic that computes it (native_pass's name for it, the gguf kernel, exact attention)."""
    from worker.backends.transformers import native_pass
    from worker.kvcache.container import Identity

    template = getattr(tokenizer, "chat_template", None)
    described = {**_builtins(config), "forward": native_pass.FORWARD, "products": "gguf", "attention": "exact"}
    kinds = {"sliding" if kind == "sliding" else "full" for kind in config.layer_kinds}
    return Identity(
        model_id=path.name,
        weights_sha256=hashlib.sha256(f"{path.name}\0{digest}\0".encode()).hexdigest(),
        tokenizer_sha256=hashlib.sha256(
            f"{TOKENIZER_NAME}\0{template if isinstance(template, str) else json.dumps(template, sort_keys=True)}".encode()
        ).hexdigest(),
        rope_theta=config.rope_bases.get(None, config.rope_bases.get("full_attention")),
        config_sha256=hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest(),
        layers=config.layers,
        kv_heads=config.kv_heads,
        head_dim=config.dim,
        dtype="float32",
        quantization="gguf",
        cache_class=CACHE_CLASS,
        attention_type=kinds.pop() if len(kinds) == 1 else "hybrid",
    )


def _builtins(config: GgufConfig) -> dict[str, Any]:
    """The configuration's fields as JSON takes them (a RoPE base of every layer: the key "None")."""
    described = {name: getattr(config, name) for name in config.__struct_fields__}
    described["rope_bases"] = {str(kind): base for kind, base in config.rope_bases.items()}
    return described


def _sides(layer: Any) -> tuple[tuple[Literal["key"], np.ndarray], tuple[Literal["value"], np.ndarray]]:
    return ("key", layer.keys), ("value", layer.values)


class NativeCache(Cache):
    """kv_buffers' cache as the cache store keeps it: every layer's keys and values of every
    position (a sliding layer's too), so it is cut back anywhere and has no states."""

    def __init__(self, layers: int, kv_heads: int, dim: int, windows: list[int | None]) -> None:
        super().__init__(layers, kv_heads, dim)
        self._windows = windows  # each layer's sliding window, None for full attention
        # The views of a file read into memory that the buffers are (restore): the read memory's
        # pages leave the process when its views go, and numpy's arrays keep views of their own.
        self._read: list[memoryview] = []

    has_states = False

    @property
    def nbytes(self) -> int:
        """The bytes of the keys and values it holds (as a file holds them)."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)

    def checkpoint(self) -> None:
        """Nothing to keep: the cache is cut back anywhere."""

    def resume_points(self) -> list[int] | None:
        return None

    def copy(self) -> NativeCache:
        layers = self.layers[0] if self.layers else None
        twin = NativeCache(len(self.layers), layers.kv_heads if layers else 0, layers.dim if layers else 0, self._windows)
        if self.length:
            for mine, theirs in zip(self.layers, twin.layers):
                theirs.buffers = (mine.keys.copy(), mine.values.copy())
                theirs.length = self.length
        twin.length = self.length
        return twin

    def to_file(self) -> tuple[list[LayerEntry], list[StateEntry], list[tuple[TensorSpec, memoryview]]]:
        from worker.kvcache.container import LayerEntry, TensorSpec

        entries = [
            LayerEntry(index=i, kind="full" if window is None else "sliding", sliding_window=window)
            for i, window in enumerate(self._windows)
        ]
        tensors = []
        if self.length:
            for index, layer in enumerate(self.layers):
                for kind, held in _sides(layer):
                    data = np.ascontiguousarray(held)[None]  # (1, kv_heads, positions, dim), as torch's layers hold them
                    spec = TensorSpec(name=f"layers.{index}.{kind}", kind=kind, layer=index, shape=data.shape, dtype="float32")
                    tensors.append((spec, data.data.cast("B")))
        return entries, [], tensors

    def restore(self, loaded: LoadedCache) -> None:
        """The keys and values of a verified file read into memory (its views, with the room to
        grow ``room`` asked for, become the buffers)."""
        from worker.kvcache.container import UnsupportedCache

        header = loaded.header
        if [(entry.kind, entry.sliding_window) for entry in header.layers] != [
            ("full", None) if window is None else ("sliding", window) for window in self._windows
        ]:
            raise UnsupportedCache("the file's layers are not this model's")  # the identity rules this out
        pairs: dict[int, dict[str, np.ndarray]] = {}
        for entry, view, shape in zip(header.tensors, loaded.tensors, loaded.shapes, strict=True):
            if entry.kind not in ("key", "value") or entry.dtype != "float32":
                raise UnsupportedCache(f"the file holds a {entry.dtype} {entry.kind} tensor, which this model does not keep")
            pairs.setdefault(entry.layer, {})[entry.kind] = np.frombuffer(view, np.float32).reshape(shape)[0]
        for index, layer in enumerate(self.layers):
            pair = pairs.get(index)
            if pair is None:
                if header.sequence_length:
                    raise UnsupportedCache(f"the file holds no keys and values of layer {index}")
                continue
            keys, values = pair["key"], pair["value"]
            if keys.flags.c_contiguous and values.flags.c_contiguous:
                layer.buffers = (keys, values)
            else:
                layer.buffers = (np.ascontiguousarray(keys), np.ascontiguousarray(values))
            layer.length = header.sequence_length
        self.length = header.sequence_length
        self._read = loaded.tensors


class ArrayModel(LocalModel[NativeCache]):
    """A model whose passes a torch-free pass computes (gguf_pass.ArrayPass: a mapped gguf's, or
    kept int8 weights'), its caches NativeCache: what the two kinds share."""

    def __init__(self, passes: ArrayPass, windows: list[int | None], **model: Any) -> None:
        """``windows``: each layer's sliding window, None for full attention; ``model``: LocalModel's."""
        self._passes_of_model: ArrayPass | None = passes
        self._windows = windows
        super().__init__(passes=passes, chunk_passes=passes, cores=CoreShare(count=PassThreads(passes)), **model)

    def new_cache(self) -> NativeCache:
        return NativeCache(*self._open.cache_shape, self._windows)

    def cache_room(self, entry: TensorEntry, max_positions: int) -> int:
        return growth_room(entry.shape[2], max_positions)

    def load_cache(self, loaded: LoadedCache) -> NativeCache:
        cache = self.new_cache()
        cache.restore(loaded)
        return cache

    @property
    def _open(self) -> ArrayPass:
        assert self._passes_of_model is not None, "the model is closed"
        return self._passes_of_model

    def close(self) -> None:
        # the mapping goes with the last view of it (a cache being written may still hold one)
        self._passes_of_model = self._passes = self._chunk_passes = None


class NativeModel(ArrayModel):
    """A mapped gguf's model computed by gguf_pass, torch-free (module docstring)."""

    def __init__(
        self, params: LoadParams, path: Path, passes: GgufPass, tokenizer: Any, identity: Identity, started: float,
    ) -> None:
        config = passes.config
        self._model_type = config.architecture
        vocab_size = max(len(tokenizer), config.vocab)
        file = passes.file
        # one out of range is a load error naming it (eos_ids), not a model that never stops
        sources = [(_Named(file.get("tokenizer.ggml.eos_token_id", int)), "config.json"), (tokenizer, "the tokenizer")]
        super().__init__(
            passes, [config.window if kind == "sliding" else None for kind in config.layer_kinds],
            params=params, path=path, tokenizer=tokenizer, identity=identity, device="cpu", dtype="float32",
            quantization="gguf", started=started, vocab_size=vocab_size,
            eos_token_ids=frozenset(eos_ids(sources, path, vocab_size)),
            context_length=context_length(file.get(f"{config.architecture}.context_length", int), tokenizer, path),
        )
        _release_freed_memory()


class _Named:
    """An ``eos_token_id`` holder for eos_ids."""

    def __init__(self, eos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id


def _release_freed_memory() -> None:
    """Give the C allocator's freed pages back to the system: reading a tokenizer's JSON leaves
    tens of megabytes free in the heap, which would otherwise count as the worker's own."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


if TYPE_CHECKING:  # hold the class to the boundary
    from worker.backends.base import CachingModel, DraftingModel, ReasoningModel

    _caching: type[CachingModel[NativeCache]] = NativeModel
    _drafting: type[DraftingModel] = NativeModel
    _reasoning: type[ReasoningModel] = NativeModel
