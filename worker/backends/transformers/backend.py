"""The transformers backend: causal language models on PyTorch.

Generation is lm-worker's own decode loop over the model's forward with a
DynamicCache and transformers' logits processors, not ``generate()``: the
worker's scheduler feeds prompts in chunks and steps the requests decoding at
the same time together (batched, for the models decode_step supports), a
cancel is seen between steps and chunks, counts are exact, and the cache stays
under lm-worker's control.
Greedy output equals ``model.generate(do_sample=False)`` token for token.

This module imports nothing heavy itself; ``load`` imports torch.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from protocol.errors import ErrorKind, RpcError
from protocol.methods import LoadParams
from worker.files import is_regular
from worker.backends.transformers.local_model import LocalModel, context_length, eos_ids
from worker.backends.transformers.torch_threads import CoreShare

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from worker.kvcache.container import Identity, LoadedCache, TensorEntry
    from worker.backends.transformers.torch_adapter import TorchCache

_DEFAULT_DTYPES = {"cpu": "float32", "cuda": "bfloat16", "mps": "float16"}
log = logging.getLogger(__name__)


class TransformersBackend:
    name = "transformers"
    description = "Hugging Face transformers on PyTorch: a local model directory or .gguf file."

    def unavailable_reason(self) -> str | None:
        missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
        if missing:
            return f"{' and '.join(missing)} not installed; run `make setup` (or pip install lm-worker)"
        return None

    def own_model_names(self) -> tuple[str, ...]:
        from worker.backends.transformers.shipped import SHIPPED

        return SHIPPED

    def check(self, params: LoadParams, *, data_dir: Path) -> None:
        """The mistakes found without loading anything: the worker makes these checks before
        it unloads the model it has, so a typo leaves that model working."""
        if params.token_delay_ms:
            raise RpcError(
                ErrorKind.INVALID_PARAMS,
                "token_delay_ms is for the echo backend; omit it for transformers.",
                field="params.token_delay_ms",
            )
        for field in ("base_url", "api_key_env"):
            if getattr(params, field) is not None:
                raise RpcError(
                    ErrorKind.INVALID_PARAMS,
                    f"{field} is for the openai backend (a model on a server); load with \"backend\": \"openai\", "
                    f"or leave {field} out.",
                    field=f"params.{field}",
                )
        if params.quantization in ("int4", "int8", "gguf") and params.device.split(":")[0] != "cpu":
            raise RpcError(
                ErrorKind.INVALID_PARAMS,
                f"quantization {params.quantization!r} runs on the CPU only; use 'none' (or 'auto') on {params.device!r}.",
                field="params.quantization",
            )
        _check_device(params.device)
        from worker.backends.transformers.shipped import SHIPPED

        if params.model not in SHIPPED:
            _local_model_path(params.model)

    def load(self, params: LoadParams, *, data_dir: Path) -> LocalModel:
        """A .gguf file the native pass computes alone is loaded without torch (native_model);
        any other model with torch (``load_with_torch``)."""
        self.check(params, data_dir=data_dir)
        started = time.perf_counter()
        native = _load_native(params, data_dir, started)
        return native if native is not None else self.load_with_torch(params, data_dir=data_dir, started=started)

    def load_with_torch(self, params: LoadParams, *, data_dir: Path, started: float | None = None) -> TransformersModel:
        """The model computed with PyTorch (``load`` takes a gguf that native_model computes
        without it; tests compare the two)."""
        started = time.perf_counter() if started is None else started
        from worker.backends.transformers import hf_compat  # before transformers: it keeps the hub offline

        device = _check_device(params.device)  # the CPU's one name: the worker's CPU rules compare it
        dtype, quantization = resolve_weights(params)
        # Quantized products give each row the numbers it gets alone; exact attention makes
        # the rest of a position's arithmetic as independent of the chunk it is in.
        # (Built before a shipped model is converted: a load's stages come in one order.)
        attention = hf_compat.ATTENTION if quantization == "none" else _exact_attention(data_dir)
        if quantization != "none":
            _int8_kernel(data_dir)
            _native_forward(data_dir)
        path = _model_path(params.model, data_dir)
        mapped = _mappable_gguf(params, path, dtype, data_dir)
        kept: _KeptInt8 | None = None
        if mapped is not None:
            quantization = "gguf"
            model, tokenizer = _load_mapped(mapped, attention, data_dir)
        else:
            kept = _kept_int8(params, path, dtype, device, quantization, attention, data_dir)
            model = kept.read() if kept is not None else None
            if kept is None or model is None:
                model, tokenizer = _load_pretrained(path, dtype, device, params.trust_remote_code, attention)
            else:
                tokenizer = kept.tokenizer
        blocks = _gguf_blocks(model, _gguf_source(params.model, path), data_dir) if quantization == "gguf" and mapped is None else {}
        if quantization == "gguf" and mapped is None and not blocks:
            quantization = "int8"  # nothing of the file's own to keep: the rule for the other linears
        from worker.backends.transformers.native_forward import llama_cpp_arithmetic

        llama_cpp = llama_cpp_arithmetic(model.config, quantization, mapped=mapped is not None)
        if kept is not None and kept.served:
            identity = kept.identity
        else:
            identity = _identity(path, model.config, tokenizer, dtype, quantization, device, data_dir / "digests", llama_cpp)
        if quantization != "none" and mapped is None and not (kept is not None and kept.served):
            from worker.backends.transformers.fast_weights import quantize

            quantize(model, "int8" if quantization == "gguf" else quantization, blocks)
            if kept is not None:
                kept.write(model)
        loaded = TransformersModel(params, path, model, tokenizer, identity, device, dtype, quantization, started, llama_cpp)
        if kept is not None:
            kept.note(loaded)
        return loaded


class _KeptInt8:
    """Where a model directory's int8 weights are kept (int8_store), with the configuration and
    tokenizer read to find the file."""

    def __init__(self, directory: Path, path: Path, key: str, config, tokenizer, identity: Identity) -> None:
        self.directory, self.path, self.key, self.config, self.tokenizer = directory, path, key, config, tokenizer
        self.identity = identity  # the model's, as the load that made the file computed it
        self.served = False

    def read(self):
        """The model of the kept file; None where there is none yet, or one that cannot serve
        (the log says why: the load quantizes again and writes it over)."""
        from worker.backends.transformers import hf_compat, int8_store

        try:
            model = int8_store.read(self.path, self.key, self.config)
        except FileNotFoundError:
            return None
        except int8_store.StoreError as exc:
            log.warning("the kept int8 weights are not used, and are made again: %s", exc)
            return None
        try:
            model.generation_config = hf_compat.generation_config(self.directory)
        except Exception as exc:  # as from_pretrained would have failed on it
            raise RpcError(
                ErrorKind.MODEL_LOAD_FAILED,
                f"Could not load the model at {str(self.directory)!r}: {type(exc).__name__}: {exc}",
                field="params.model",
            ) from exc
        self.served = True
        return model

    def write(self, model) -> None:
        from worker.backends.transformers import int8_store

        try:
            int8_store.write(self.path, self.key, model)
        except (OSError, ValueError) as exc:
            log.warning("the int8 weights are not kept in %s (%s): they are made again at each load", self.path, exc)

    def note(self, loaded: TransformersModel) -> None:
        """Note what a later load needs to map the kept weights without torch (int8_store.keep_note)."""
        from worker.backends.transformers import int8_store

        if not self.path.is_file():
            return  # not kept
        try:
            int8_store.keep_note(self.path.parent.parent, self.directory, self.key, loaded)
        except OSError as exc:
            log.warning("no note of the kept int8 weights in %s (%s): later loads import torch", self.path.parent, exc)


def _kept_int8(params: LoadParams, path: Path, dtype: str, device: str, quantization: str, attention: str,
               data_dir: Path) -> _KeptInt8 | None:
    """Where a model directory's int8 weights are kept: int8 weights on the CPU in float32, no
    remote code, an architecture int8_store keeps; else None."""
    if quantization != "int8" or device != "cpu" or dtype != "float32" or not path.is_dir() or params.trust_remote_code:
        return None
    from transformers import AutoTokenizer

    from worker.backends.transformers import int8_store, shell_model
    from worker.backends.transformers.hf_compat import LOADING

    try:
        config = shell_model.pretrained_configuration(path)
    except Exception:  # a directory transformers' loader reports on, as it always does
        return None
    config._attn_implementation = attention
    if not int8_store.applies(config):
        return None
    from worker.kvcache import checksum

    try:  # the file's CRC-32C at the processor's speed (the native pass needs a compiler too)
        checksum.load_kernel(data_dir / "kernels")
    except checksum.KernelUnavailable as exc:
        log.warning("int8 weights are not kept (no CRC-32C kernel to check them with): %s", exc)
        return None
    try:
        with LOADING:
            tokenizer = AutoTokenizer.from_pretrained(path, config=config)  # read once, and without Llama's heavy module
    except Exception:
        return None
    identity = _identity(path, config, tokenizer, dtype, quantization, device, data_dir / "digests")
    key = int8_store.key_of(identity.weights_sha256, identity.config_sha256)
    return _KeptInt8(path, int8_store.path_of(data_dir, key), key, config, tokenizer, identity)


def _load_native(params: LoadParams, data_dir: Path, started: float) -> LocalModel | None:
    """The model computed without torch, or None where that path does not take it: a .gguf
    file's (native_model), a model directory's whose int8 weights are kept (int8_model). A
    shipped model not converted yet is converted by the torch path's load, in its order of stages."""
    from worker.backends.transformers import int8_model, native_model
    from worker.backends.transformers.shipped import QWEN_CODER, SHIPPED, converted_directory

    if params.model in SHIPPED and params.model != QWEN_CODER:
        path = converted_directory(data_dir, params.model)
        return int8_model.load(params, path, data_dir, started) if (path / "config.json").is_file() else None
    path = _model_path(params.model, data_dir)
    if path.is_dir():
        return int8_model.load(params, path, data_dir, started)
    return native_model.load(params, path, data_dir, started)


def _mappable_gguf(params: LoadParams, path: Path, dtype: str, data_dir: Path):
    """The gguf file mapped where the model is computed on its own blocks: a .gguf path on the
    CPU in float32, ``quantization`` auto or gguf, an architecture gguf_model builds, and the
    gguf kernel built; else None (transformers' loader takes the file, and the log says why).
    Every .gguf path's header is read first, by the worker's bounded reader: a file it refuses,
    or one whose metadata transformers' loader cannot take (_for_transformers), is a load error
    naming what is wrong."""
    from worker.backends.transformers import exact_attention, gguf_model, gguf_weights
    from worker.gguf.reader import GgufError, read

    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    try:
        file = read(path)
    except GgufError as exc:
        raise RpcError(ErrorKind.MODEL_LOAD_FAILED, f"Could not load the model: {exc}",
                       field="params.model") from exc
    if params.quantization not in ("auto", "gguf") or params.device.split(":")[0] != "cpu" or dtype != "float32":
        return _for_transformers(file)
    arch = gguf_model.architecture(file)
    if arch is None:
        log.warning("%s: a %r model is loaded by transformers' gguf loader (every tensor dequantized, then int8): "
                    "lm-worker computes on a gguf's own blocks for %s", path, file.get("general.architecture", str, "?"),
                    ", ".join(gguf_model.ARCHITECTURES))
        return _for_transformers(file)
    try:
        gguf_weights.load_kernel(data_dir)
    except exact_attention.KernelUnavailable as exc:
        log.warning("%s is dequantized by transformers' loader (the gguf kernel cannot be built): %s", path, exc)
        return _for_transformers(file)
    return file


# transformers' gguf loader reads the metadata with gguf-py's reader, which makes Python objects
# of every array item (about a kilobyte each): at most this many in all (a vocabulary of 262,144
# tokens has about 800,000 in its tokens, scores, types and merges).
MAX_TRANSFORMERS_GGUF_ITEMS = 1 << 21


def _for_transformers(file) -> None:
    """Close ``file``, checked for transformers' gguf loader: -32002 where its metadata arrays
    hold more than MAX_TRANSFORMERS_GGUF_ITEMS items (20,000,000 took 9 GB), or where its
    weights dequantized to float32 (which that loader makes of every tensor) would take more
    memory than the machine has available (a 7B file took 20 GB and was killed)."""
    from worker.gguf.reader import Strings

    weights = sum(tensor.count for tensor in file.tensors.values())
    available = _available_memory()
    if available is not None and 4 * weights > available:
        file.close()
        raise RpcError(
            ErrorKind.MODEL_LOAD_FAILED,
            f"Could not load the model: with quantization, device or dtype other than the mapped defaults, "
            f"transformers' gguf loader dequantizes {file.path}'s {weights:,} weights to float32, "
            f"{4 * weights / 1e9:.1f} GB, more than the {available / 1e9:.1f} GB this machine has available; "
            "load it with quantization 'auto' (or 'gguf') on the CPU in float32, which computes on the file's own "
            "blocks, mapped (architectures llama, qwen2, qwen3, gemma3 and phi3).",
            field="params.model",
        )

    def items(value) -> int:
        if isinstance(value, Strings):
            return value.count
        return len(value) + sum(items(item) for item in value if isinstance(item, list)) if isinstance(value, list) else 0

    held = sum(items(value) for value in file.metadata.values())
    file.close()
    if held > MAX_TRANSFORMERS_GGUF_ITEMS:
        raise RpcError(
            ErrorKind.MODEL_LOAD_FAILED,
            f"Could not load the model: {file.path}'s metadata arrays hold {held} items, more than the "
            f"{MAX_TRANSFORMERS_GGUF_ITEMS} transformers' gguf loader is given (it makes a Python object of each); "
            "load it with quantization 'auto' or 'gguf' on the CPU if its architecture is one lm-worker maps.",
            field="params.model",
        )
    return None


def _available_memory() -> int | None:
    """The memory the machine has available (Linux's MemAvailable), in bytes; None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _load_mapped(file, attention: str, data_dir: Path):
    """The model and tokenizer of a mapped gguf file (gguf_model); a file whose tensors do not
    make the model its metadata describes is a load error naming the tensor."""
    from worker.backends.transformers import gguf_model
    from worker.backends.transformers.hf_compat import LOADING
    from worker.fingerprint import digests
    from worker.gguf.reader import GgufError

    try:
        config = gguf_model.config_of(file)
        digest = digests([file.path], data_dir / "digests")[file.path]
        with LOADING:  # from_config swaps process-wide state as from_pretrained does
            tokenizer = gguf_model.tokenizer_of(file, data_dir / "gguf" / digest)
            model = gguf_model.build(file, config, attention)
    except GgufError as exc:
        file.close()
        raise RpcError(ErrorKind.MODEL_LOAD_FAILED, f"Could not load the model: {exc}",
                       field="params.model") from exc
    return model, tokenizer


def _gguf_source(model: str, path: Path) -> Path | None:
    """The gguf file the model's weights come from, where there is one: the shipped default's,
    or a .gguf file given by path (the shipped Gemma's parts are joined only to convert them)."""
    if model == "default":
        from worker.backends.transformers.shipped import gguf_path

        return gguf_path()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _gguf_blocks(model, gguf_file: Path | None, data_dir: Path) -> dict:
    """The gguf blocks the model's linears keep (gguf_weights), or none where there is no
    gguf file, the architecture is not one the kernel's loader knows, or the kernel cannot
    be built (then the linears get int8 rows, and the log says why)."""
    from worker.backends.transformers import exact_attention, gguf_weights

    if gguf_file is None:
        return {}
    try:
        gguf_weights.load_kernel(data_dir)
    except exact_attention.KernelUnavailable as exc:
        log.warning("int8 weights instead of the gguf's own: %s", exc)
        return {}
    try:
        return gguf_weights.blocks_of(model, gguf_file)
    except (OSError, ValueError) as exc:  # transformers read it a moment ago; a file changed since, say
        log.warning("int8 weights instead of the gguf's own: cannot read %s: %s", gguf_file, exc)
        return {}


def _int8_kernel(data_dir: Path) -> None:
    """Build (on first use) the kernel that multiplies int8 rows; where it cannot be built,
    PyTorch's int8 kernel takes them (fast_weights.TorchInt8Linear), and the log says why."""
    from worker.backends.transformers import exact_attention, fast_weights

    try:
        fast_weights.load_int8_kernel(data_dir)
    except exact_attention.KernelUnavailable as exc:
        log.warning("int8 rows multiplied by PyTorch's kernel from bfloat16 inputs (about half as fast): %s", exc)


def _native_forward(data_dir: Path) -> None:
    """Build (on first use) the kernel that computes a Llama or Gemma 3 model's whole pass; where
    it cannot be built, the layers' PyTorch operations do (decode_step), and the log says why."""
    from worker.backends.transformers import exact_attention, native_forward

    try:
        native_forward.load_kernel(data_dir)
    except exact_attention.KernelUnavailable as exc:
        log.warning("a pass through the layers' PyTorch operations (slower): %s", exc)


def _exact_attention(data_dir: Path) -> str:
    """The attention for quantized weights: exact_attention's kernel (built on first use), or
    float64 attention where it cannot be built (slower, as independent of chunking)."""
    from worker.backends.transformers import exact_attention, hf_compat

    try:
        exact_attention.kernel(data_dir)
    except exact_attention.KernelUnavailable as exc:
        log.warning("attention in float64 (about 3 times slower): %s", exc)
        return hf_compat.WIDE_ATTENTION
    return hf_compat.EXACT_ATTENTION


def resolve_weights(params: LoadParams) -> tuple[str, str]:
    """The dtype and quantization that ``auto`` stands for: the device's usual dtype; on the
    CPU, 8-bit weights (a decode step reads a quarter of the bytes, and with them every
    position's numbers are independent of the chunk it is computed in: fast_weights). A
    gguf's own blocks (``gguf``) are not the default yet: greedy output on them still parts
    from llama.cpp's (tests/test_gguf_weights.py)."""
    kind = params.device.split(":")[0]
    dtype = _DEFAULT_DTYPES[kind] if params.dtype == "auto" else params.dtype
    if params.quantization != "auto":
        return dtype, params.quantization
    return dtype, "int8" if kind == "cpu" else "none"


class TransformersModel(LocalModel["TorchCache"]):
    """A model computed with PyTorch: transformers' forward, decode_step's operations, or the
    native pass over a torch model (native_forward)."""

    def __init__(
        self, params: LoadParams, path: Path, model: PreTrainedModel, tokenizer, identity: Identity, device: str,
        dtype: str, quantization: str, started: float, llama_cpp: bool = False,
    ):
        """``llama_cpp``: the native pass in llama.cpp's arithmetic (native_forward.llama_cpp_arithmetic)."""
        import torch

        from worker.backends.transformers import decode_step, native_forward

        self._model: PreTrainedModel | None = model  # None once closed
        config = model.config
        self._model_type = config.model_type
        passes: decode_step.Passes | None = None
        if native_forward.applies(config, dtype, quantization):
            passes = native_forward.NativeForward(model, quantization, llama_cpp)
        elif decode_step.supports(config):
            passes = decode_step.DecodeStep(model)
        # Only the native pass's numbers are the same on any thread count (torch_threads).
        cores = CoreShare() if isinstance(passes, native_forward.NativeForward) else None
        if cores is None and device == "cpu":
            log.info("model threads: %d, kept (this model's passes multiply through PyTorch's libraries, "
                     "whose last bits follow the thread count)", torch.get_num_threads())
        _check_tokenizer_settings(tokenizer, path)
        vocab_size = max(len(tokenizer), config.vocab_size)
        sources = [(getattr(model, "generation_config", None), "generation_config.json"), (config, "config.json"),
                   (tokenizer, "the tokenizer")]
        super().__init__(
            params, path, tokenizer, identity, device=device, dtype=dtype, quantization=quantization, started=started,
            vocab_size=vocab_size, eos_token_ids=frozenset(eos_ids(sources, path, vocab_size)),
            context_length=context_length(getattr(config, "max_position_embeddings", None), tokenizer, path),
            passes=passes,
            # A prompt chunk fed alone goes through the step too where a position's numbers do not
            # depend on the pass it is in (quantized weights): the native pass, or decode_step's
            # operations (transformers' forward's numbers bit for bit, fewer operations a layer),
            # so a prompt and the steps after it are one arithmetic.
            chunk_passes=passes if quantization != "none" else None,
            cores=cores,
        )
        self._cache_kinds: Sequence[str] | None = None

    @property
    def _open_model(self) -> PreTrainedModel:
        assert self._model is not None, "the model is closed"
        return self._model

    def computing(self):
        import torch

        return torch.inference_mode()

    def _numpy(self, logits):
        return logits.float().cpu().numpy()  # no copy of CPU float32 logits

    def _feed(self, cache: TorchCache, tokens: list[int]):
        import torch

        return self._numpy(cache.feed(self._open_model, torch.tensor([tokens], dtype=torch.long, device=self._device)))

    def _step_each(self, decodings) -> None:
        for decoding in decodings:
            decoding.logits = self._feed(decoding.cache, decoding.tokens[-1:])

    def prepare_side_thread(self) -> None:
        from worker.backends.transformers.torch_threads import keep_to_one_thread

        keep_to_one_thread()

    def new_cache(self) -> TorchCache:
        from worker.backends.transformers.torch_adapter import TorchCache

        return TorchCache(self._open_model.config)

    def cache_room(self, entry: TensorEntry, max_positions: int) -> int:
        from worker.backends.transformers.torch_adapter import room_to_grow

        if self._cache_kinds is None:
            self._cache_kinds = self.new_cache().kinds
        return room_to_grow(self._cache_kinds, self._device, entry, max_positions)

    def load_cache(self, loaded: LoadedCache) -> TorchCache:
        from worker.backends.transformers.torch_adapter import TorchCache

        return TorchCache.from_file(loaded, self._open_model.config, self._device)

    def close(self) -> None:
        self._model = None


# The files a tokenizer is made of, beside those named tokenizer*; a model directory's other
# files (weights, configuration, read-me) are not the tokenizer's.
_TOKENIZER_FILES = frozenset(
    {"special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json",
     "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model"}
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def _identity(
    path: Path, config, tokenizer, dtype: str, quantization: str, device: str, memo_dir: Path, llama_cpp: bool = False
) -> Identity:
    """Everything that decides what the model computes for a token: every byte of the
    weights and tokenizer files (a .gguf file holds both), the chat template, and the
    whole configuration. Digests of big files are remembered (worker.fingerprint)."""
    from worker.backends.transformers import fast_weights, hf_compat, native_forward
    from worker.fingerprint import combined_sha256, digests
    from worker.kvcache.container import Identity
    from worker.backends.transformers.torch_adapter import TorchCache

    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    weights = [p for p in files if p.suffix in _WEIGHT_SUFFIXES]
    tokenizer_files = [p for p in files if p.name.startswith("tokenizer") or p.name in _TOKENIZER_FILES]
    template = getattr(tokenizer, "chat_template", None)
    kinds = set(TorchCache(config).kinds) - {"none"}
    heads = getattr(config, "num_attention_heads", None) or 0  # a model of linear layers alone has none
    known = digests([*weights, *tokenizer_files], memo_dir)  # one "hashing" stage of a load
    return Identity(
        model_id=path.name,  # the directory or file name: a copied model keeps its caches
        weights_sha256=combined_sha256(weights, known),
        tokenizer_sha256=combined_sha256(
            tokenizer_files, known, extra=f"{type(tokenizer).__name__}\0{template if isinstance(template, str) else ''}"
        ),
        rope_theta=hf_compat.rope_theta(config),
        config_sha256=hf_compat.config_digest(
            config,
            fast_weights.int8_products() if quantization != "none" else None,
            native_forward.forward_name(config, dtype, quantization, llama_cpp),
            _arithmetic_device(device, native=native_forward.applies(config, dtype, quantization)),
        ),
        layers=config.num_hidden_layers,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0),
        dtype=dtype,
        quantization=quantization,
        cache_class="DynamicCache",
        attention_type=kinds.pop() if len(kinds) == 1 else "hybrid",
    )


def _arithmetic_device(device: str, *, native: bool) -> str | None:
    """The processor that computes a cache's numbers where its kernels decide their last bits:
    a GPU's (and which kernels its libraries pick for its architecture), or on the CPU, for a
    pass other than the ``native`` one, the library products' thread count and processor
    (torch_threads.library_arithmetic). The native pass's numbers are the same on every
    processor and thread count: its caches keep the identity they always had."""
    import torch

    from worker.backends.transformers.torch_threads import library_arithmetic

    kind = device.split(":")[0]
    if kind == "cuda":
        return f"cuda {torch.cuda.get_device_name(torch.device(device))}"
    if kind == "cpu":
        return None if native else f"cpu {library_arithmetic()}"
    return kind


def _check_device(device: str) -> str:
    """The device's name as the worker uses it (``cpu``, ``mps``, ``cuda``, ``cuda:N``); a name
    of another form is -32602, a device this machine lacks -32002. Only a device other than the
    CPU imports torch, to ask it."""
    form = re.fullmatch(r"(cpu|mps|cuda)(?::([0-9]+))?", device, flags=re.ASCII)
    if form is None:
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            f"Unknown device {device!r}; use 'cpu', 'cuda' (or 'cuda:N') or 'mps'.",
            field="params.device",
        )
    kind, index = form[1], form[2]
    if kind == "cpu":
        # torch takes "cpu:0" for the one CPU; the worker's rules for the CPU compare the plain name
        return kind
    import torch

    available = {
        "cuda": torch.cuda.is_available() and (index is None or int(index) < torch.cuda.device_count()),
        "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
    }
    if not available[kind]:
        count = torch.cuda.device_count() if kind == "cuda" and torch.cuda.is_available() else 0
        numbers = "'cuda:0'" if count == 1 else f"'cuda:0' to 'cuda:{count - 1}'"
        use = f"'cuda' or {numbers}" if count else "'cpu'"
        raise RpcError(
            ErrorKind.MODEL_LOAD_FAILED,
            f"Device {device!r} is not available on this machine (torch {torch.__version__}); use {use}.",
            field="params.device",
        )
    return device if kind == "cuda" else kind  # torch takes "mps:0" for "mps" too


def _model_path(model: str, data_dir: Path) -> Path:
    from worker.backends.transformers.shipped import SHIPPED

    if model in SHIPPED:
        from worker.backends.transformers.shipped import QWEN_CODER, assembled_qwen_coder, converted_path

        try:
            return assembled_qwen_coder(data_dir) if model == QWEN_CODER else converted_path(data_dir, model)
        except RpcError:
            raise
        except Exception as exc:
            raise RpcError(
                ErrorKind.MODEL_LOAD_FAILED,
                f"Could not prepare the model {model!r} in {str(data_dir)!r}: {type(exc).__name__}: {exc}. "
                "Check that the data directory is writable (--data-dir).",
                field="params.model",
            ) from exc
    return _local_model_path(model)


def _local_model_path(model: str) -> Path:
    path = Path(model).expanduser()
    if not path.exists():
        raise RpcError(
            ErrorKind.MODEL_NOT_FOUND,
            f"No model at {model!r}: no such file or directory. Give a local model directory or .gguf file "
            "(model hubs are not used), or a shipped model: 'default', 'gemma3-270m' or 'qwen2.5-coder-0.5b'.",
            field="params.model",
        )
    if not path.is_dir() and not is_regular(path):
        raise RpcError(
            ErrorKind.MODEL_LOAD_FAILED,
            f"{model!r} is neither a regular file nor a directory (a FIFO, device or socket); give a .gguf "
            "file or a model directory.",
            field="params.model",
        )
    if path.is_dir() and not (path / "config.json").exists():
        raise RpcError(
            ErrorKind.MODEL_LOAD_FAILED,
            f"{model!r} is a directory but not a model: it has no config.json. Give a directory saved with "
            "save_pretrained(), or a .gguf file.",
            field="params.model",
        )
    if path.is_dir() and (irregular := _irregular_files(path)):
        # the loader opens them by name: a FIFO would block it for good, /dev/zero never end
        raise RpcError(
            ErrorKind.MODEL_LOAD_FAILED,
            f"{model!r} holds {', '.join(repr(name) for name in irregular[:5])}, which "
            f"{'is' if len(irregular) == 1 else 'are'} not a regular file (a FIFO, device or socket); a model "
            "directory holds regular files (or links to them) and folders.",
            field="params.model",
        )
    if path.is_file() and path.suffix != ".gguf":
        raise RpcError(
            ErrorKind.MODEL_LOAD_FAILED,
            f"{model!r} is a file but not a .gguf file; give a .gguf file or a model directory.",
            field="params.model",
        )
    resolved = path.resolve()
    # a link named .gguf to a file named otherwise (a Hugging Face snapshot's link to its blob, the
    # worker's link to an Ollama blob) keeps its own name: the name says the file is a gguf
    return resolved if resolved.suffix == path.suffix or path.is_dir() else path.absolute()


def _irregular_files(directory: Path) -> list[str]:
    """Names in a model directory that are neither folders nor (links to) regular files."""
    with os.scandir(directory) as entries:
        return sorted(e.name for e in entries if not e.is_dir() and not is_regular(e.path))


def _load_pretrained(path: Path, dtype: str, device: str, trust_remote_code: bool, attention: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.backends.transformers.hf_compat import LOADING, register_attention, report_gguf_dequantizing

    register_attention()
    location, extra = (path.parent, {"gguf_file": path.name}) if path.is_file() else (path, {})
    if extra:
        report_gguf_dequantizing()
    try:
        with LOADING:
            tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code, **extra)
            loaded = AutoModelForCausalLM.from_pretrained(
                location, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code,
                attn_implementation=attention, output_loading_info=True, **extra,
            )
        model, loading = cast("tuple[PreTrainedModel, dict]", loaded)  # a pair, with output_loading_info
    except Exception as exc:  # corrupt, truncated or foreign files: say which and why
        raise RpcError(
            ErrorKind.MODEL_LOAD_FAILED,
            f"Could not load the model at {str(path)!r}: {type(exc).__name__}: {exc}",
            field="params.model",
        ) from exc
    _check_weights(path, loading)
    try:
        model = model.to(device)  # pyright: ignore[reportArgumentType]  # transformers types to() as the unbound Module.to it wraps
    except Exception as exc:  # a device that fails
        raise RpcError(
            ErrorKind.MODEL_LOAD_FAILED,
            f"Could not load the model at {str(path)!r}: {type(exc).__name__}: {exc}",
            field="params.model",
        ) from exc
    return model.eval(), tokenizer


def _check_weights(path: Path, loading: dict) -> None:
    """-32002 naming the tensors where the files' weights are not the model's: transformers makes
    up a weight the files lack (random numbers), and leaves out one the model does not use or of
    another shape. A tied output layer is not missing (transformers ties it)."""
    found = []
    for key, what in (("missing_keys", "missing"), ("unexpected_keys", "not used by the model"),
                      ("mismatched_keys", "of another shape than the model's")):
        names = sorted(str(entry[0] if isinstance(entry, tuple) else entry) for entry in loading.get(key) or ())
        if names:
            listed = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            found.append(f"{len(names)} {what} ({listed})")
    if found:
        raise RpcError(
            ErrorKind.MODEL_LOAD_FAILED,
            f"The weights at {str(path)!r} are not the model its configuration describes: tensors "
            f"{'; '.join(found)}. Fix or replace the files; nothing is made up for them.",
            field="params.model",
        )


def _check_tokenizer_settings(tokenizer, path: Path) -> None:
    """The settings of the tokenizer's files (tokenizer_config.json, a gguf's metadata, a kept copy)
    the worker reads beside the tokenizer's own (worker.tokenizer.settings_problem): a load error
    naming the value, not an internal error at the first tokenize or render."""
    from worker.tokenizer import settings_problem

    problem = settings_problem(tokenizer)
    if problem is not None:
        where = "tokenizer_config.json" if path.is_dir() else f"the tokenizer of {path.name}"
        raise RpcError(ErrorKind.MODEL_LOAD_FAILED, f"{where} gives {problem}", field="params.model")


if TYPE_CHECKING:  # the registry finds backends by import path: these hold the classes to the boundary
    from worker.backends.base import (
        CachingModel, CheckingBackend, DraftingModel, LocalModelBackend, ReasoningModel, SideThreadModel,
    )

    _backend: type[CheckingBackend] = TransformersBackend
    _local: type[LocalModelBackend] = TransformersBackend
    _caching: type[CachingModel[TorchCache]] = TransformersModel
    _drafting: type[DraftingModel] = TransformersModel
    _reasoning: type[ReasoningModel] = TransformersModel
    _side_thread: type[SideThreadModel] = TransformersModel
