"""A model built from a gguf file's own blocks, the file mapped: no float copy of a weight matrix,
no conversion at each load.

transformers' own gguf loader dequantizes every tensor to float32 (a 1.5B model peaked at
10.9 GB) and the worker then quantized it again to int8; each load did all of it again. Here
the file is mapped read-only (worker.gguf.reader, its header checked with bounds) and:

- the configuration comes from the file's metadata (the keys transformers maps, hf_compat),
- the tokenizer too, built once by transformers' gguf converter and kept in the data
  directory under the file's digest (``DATA_DIR/gguf/<digest>/``), so later loads read it,
- the model is made on PyTorch's meta device (no memory), and each linear becomes a
  GgufLinear over the file's blocks as they lie in the mapping (Llama's q and k rows,
  which the file keeps permuted for llama.cpp's rotary embedding, are the one copy), the
  embedding a GgufEmbedding that widens only the rows a pass looks up, and the norms and
  biases (vectors) float32 copies.

Every tensor the architecture needs must be in the file with its shape, and the file must
hold no tensor the model does not use (GgufError names it): a missing weight is never made
up, so two workers loading a file always compute the same model.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from worker.backends.transformers import gguf_config, gguf_pass, gguf_weights, hf_compat
from worker.files import is_regular
from worker.gguf.reader import GgufError, GgufFile

if TYPE_CHECKING:
    import numpy as np
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

# gguf's general.architecture: transformers' model_type, for the architectures built here
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text", "phi3": "phi3"}
# The bounds gguf_config checks the metadata against (PROTOCOL.md §13 states them).
MAX_LAYERS, MAX_DIMENSION = gguf_config.MAX_LAYERS, gguf_config.MAX_DIMENSION


def architecture(file: GgufFile) -> str | None:
    """transformers' model_type for the file's architecture where this module builds it."""
    return ARCHITECTURES.get(file.get("general.architecture", str, "") or "")


def config_of(file: GgufFile) -> PretrainedConfig:
    """The model's configuration from the file's metadata, checked against its tensors
    (gguf_config.metadata_values) and by transformers' configuration class."""
    from worker.backends.transformers import shell_model

    arch = file.architecture
    model_type = ARCHITECTURES[arch]
    values: dict[str, Any] = gguf_config.metadata_values(file, hf_compat.gguf_config_keys(arch))
    vocab = values["vocab_size"]
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id")):
        token = file.get(f"tokenizer.ggml.{key}", int)  # the file's, not the architecture's defaults (Phi-3's 32000)
        values[name] = token if token is not None and 0 <= token < vocab else None
    if model_type == "llama" and "mistral" in str(file.get("general.name", str, "")).lower():
        model_type = "mistral"
    if model_type == "gemma3_text":
        values.setdefault("head_dim", file.get("gemma3.attention.key_length", int))
    from huggingface_hub.errors import StrictDataclassError

    try:
        return shell_model.configuration(model_type, {k: v for k, v in values.items() if v is not None or k.endswith("token_id")})
    except (ValueError, TypeError, StrictDataclassError) as exc:  # transformers' own checks of the values (a hidden size its heads do not divide)
        raise GgufError(f"{file.path}: the metadata does not make a {arch} configuration: {exc}") from exc


def tokenizer_of(file: GgufFile, kept: Path):
    """The file's tokenizer: the one kept in ``kept`` (a directory the data directory holds), else
    built from the metadata and kept there (written beside and renamed into place)."""
    from transformers import AutoTokenizer

    from worker.tokenizer import settings_problem

    if is_regular(kept / "tokenizer_config.json"):
        try:
            tokenizer = AutoTokenizer.from_pretrained(kept)
            problem = settings_problem(tokenizer)
            if problem is not None:
                raise ValueError(f"it gives {problem}")
        except Exception as exc:  # a damaged copy: build it again over it
            log.warning("the kept tokenizer in %s does not load (%s: %s): built again", kept, type(exc).__name__, exc)
        else:
            try:
                _keep_added_tokens(kept, tokenizer)  # a copy kept before they were written there
            except OSError as exc:
                log.warning("the added tokens of the tokenizer kept in %s are not written there (%s)", kept, exc)
            return tokenizer
    tokenizer = hf_compat.gguf_tokenizer(file)
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=kept.parent))
        tokenizer.save_pretrained(staging)
        _keep_added_tokens(staging, tokenizer)
        _put_in_place(staging, kept)
    except OSError as exc:
        log.warning("the tokenizer of %s is not kept in %s (%s): it is built again at each load", file.path, kept, exc)
    return tokenizer


def _put_in_place(staging: Path, kept: Path) -> None:
    """``staging`` renamed to ``kept``; whatever is there (a damaged copy, a file, a copy another
    worker kept a moment before) moved aside first and removed, so the next load reads this one."""
    import shutil

    try:
        os.replace(staging, kept)
        return
    except OSError:
        pass
    aside = Path(tempfile.mkdtemp(prefix=".tokenizer-old-", dir=kept.parent))
    try:
        os.replace(kept, aside / "kept")
        os.replace(staging, kept)
    finally:
        shutil.rmtree(aside, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)


def _keep_added_tokens(directory: Path, tokenizer) -> None:
    """The tokenizer's added tokens written into its tokenizer_config.json in ``directory`` (beside
    it and renamed into place), where they are not yet: without them transformers finds them by
    parsing the whole tokenizer.json in Python at every load, a vocabulary's megabytes."""
    import json

    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict) or "added_tokens_decoder" in config:
        return
    config["added_tokens_decoder"] = {str(i): token.__getstate__() for i, token in tokenizer.added_tokens_decoder.items()}
    handle, partial = tempfile.mkstemp(dir=directory, prefix=".tokenizer_config-", suffix=".json")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(config, out, indent=2, ensure_ascii=False)
        os.replace(partial, path)
    except BaseException:
        os.unlink(partial)
        raise


class GgufEmbedding(torch.nn.Module):
    """An embedding whose rows are gguf blocks: a lookup widens the rows it takes, times
    ``scale`` where the model scales them (Gemma: √hidden, rounded as transformers rounds it)."""

    def __init__(self, kind: int, blocks: torch.Tensor, hidden: int, scale: float | None = None) -> None:
        super().__init__()
        self.kind, self.embedding_dim, self.scale = kind, hidden, scale
        self.num_embeddings = blocks.shape[0]
        self.blocks = blocks  # a view of the mapping: never written, never saved

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = gguf_weights.dequantized(self.kind, self.blocks[ids.reshape(-1)])
        rows = rows.reshape(*ids.shape, self.embedding_dim)
        return rows if self.scale is None else rows * torch.tensor(self.scale, dtype=rows.dtype)


def build(file: GgufFile, config: PretrainedConfig, attention: str) -> PreTrainedModel:
    """The model of ``config`` with the file's tensors in place; GgufError for a tensor missing,
    left over, misshapen or of a type no kernel here multiplies."""
    import gguf

    arch = file.architecture
    config._attn_implementation = attention  # pyright: ignore[reportAttributeAccessIssue]
    model = _modules(config, attention)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    used: set[str] = set()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for module_name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear):
            source = "token_embd.weight" if tied and module_name == "lm_head" else _gguf_name(names, module_name, ".weight")
            bias = None
            if module.bias is not None:
                bias_name = _gguf_name(names, module_name, ".bias")
                bias = _vector(file, bias_name, module.out_features)
                used.add(bias_name)
            _set_module(model, module_name, _linear(file, source, module, config, arch, bias))
            used.add(source)
        elif isinstance(module, torch.nn.Embedding):
            scale = None
            if getattr(module, "embed_scale", None) is not None:  # Gemma's scaled embedding: √hidden in the model's dtype
                scale = float(torch.tensor(math.sqrt(config.hidden_size), dtype=torch.float32))
            _set_module(model, module_name, _embedding(file, "token_embd.weight", module, scale))
            used.add("token_embd.weight")
    for parameter_name, parameter in list(model.named_parameters()):
        if not parameter.is_meta:
            continue
        module_name, _, kind = parameter_name.rpartition(".")
        source = _gguf_name(names, module_name, f".{kind}")
        vector = _vector(file, source, parameter.numel())
        if arch == "gemma3" and kind == "weight" and "norm" in module_name:
            vector = vector - 1  # the file keeps Gemma's norm scales as 1 + weight
        _set_parameter(model, parameter_name, vector.reshape(parameter.shape))
        used.add(source)
    _rotary_on_cpu(model, config, file, used)
    gguf_pass.check_all_used(file, arch, used)
    return model.eval()


def _modules(config: PretrainedConfig, attention: str) -> Any:
    """The model's modules, their weights on the meta device: the shell (shell_model) where the native pass
    computes every pass, else transformers' own classes (Phi-3, and any model when the native
    pass cannot be built here)."""
    from worker.backends.transformers import native_forward, shell_model

    if config.model_type in shell_model.MODEL_TYPES and native_forward.applies(config, "float32", "gguf"):
        return shell_model.ShellModel(config)
    from transformers import AutoModelForCausalLM

    hf_compat.register_attention()
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(shell_model.transformers_configuration(config), attn_implementation=attention)


def _gguf_name(names, module_name: str, suffix: str) -> str:
    found = names.get_name(module_name + suffix, try_suffixes=(suffix,))
    if found is None:
        raise GgufError(f"no gguf name for the model's {module_name}{suffix}")
    return found


def _linear(file: GgufFile, name: str, module: torch.nn.Linear, config, arch: str, bias: torch.Tensor | None) -> torch.nn.Module:
    rows = gguf_pass.rows_of(file, name, module.out_features, module.in_features)
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config.num_attention_heads if name.endswith("attn_q.weight") else config.num_key_value_heads
        # numpy's gather (a copy of each row) where torch's indexing of bytes took milliseconds a matrix
        rows = rows[gguf_pass.unpermuted_rows(module.out_features, heads)]
    return gguf_weights.GgufLinear(file.tensors[name].type, _tensor(rows), module.in_features, bias)


def _embedding(file: GgufFile, name: str, module: torch.nn.Embedding, scale: float | None) -> GgufEmbedding:
    rows = gguf_pass.rows_of(file, name, module.num_embeddings, module.embedding_dim, embedding=True)
    return GgufEmbedding(file.tensors[name].type, _tensor(rows), module.embedding_dim, scale)


def _vector(file: GgufFile, name: str, count: int) -> torch.Tensor:
    """A norm's scales or a bias as float32 (a copy: they are small)."""
    return torch.from_numpy(gguf_pass.vector_of(file, name, count))


def _tensor(rows: np.ndarray) -> torch.Tensor:
    """A tensor of the same memory as ``rows`` (a view of the mapping, or a copy of its rows)."""
    import warnings

    with warnings.catch_warnings():  # the mapping is read-only, and nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(rows)


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _set_parameter(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, torch.nn.Parameter(value, requires_grad=False))


def _rotary_on_cpu(model: torch.nn.Module, config, file: GgufFile, used: set[str]) -> None:
    """The rotary embeddings made again off the meta device (their frequencies are computed, not
    read), divided by the file's frequency factors where it has them (Llama 3.1's scaling)."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            rebuilt: Any = type(module)(config=config)
            if gguf_pass.ROPE_FREQUENCIES in file.tensors:
                factors = _vector(file, gguf_pass.ROPE_FREQUENCIES, rebuilt.inv_freq.numel())
                rebuilt.inv_freq = rebuilt.inv_freq / factors
                rebuilt.original_inv_freq = rebuilt.inv_freq
                used.add(gguf_pass.ROPE_FREQUENCIES)
            _set_module(model, name, rebuilt)
    for name, buffer in model.named_buffers():
        if buffer.is_meta:
            raise GgufError(f"{file.path}: the model's {name} has no value (an architecture this loader does not build)")
