"""A model directory's int8 weights, made once and kept in the data directory; later loads map them.

Loading a model directory with the int8 default reads every float weight from its safetensors
files and quantizes each linear to 8-bit blocks (fast_weights.Int8Linear) at every load: the
shipped default's took seconds on a quiet machine and many more with a core busy, and held the
float weights meanwhile. Where the native pass computes the model (Llama, Qwen2, Qwen3, Gemma 3:
shell_model's architectures), the quantized model is written here once, and a later load maps
this file into shell_model's modules: no float copy of a linear at any moment, no quantization,
and nothing of transformers' modeling code imported.

The file, ``DATA_DIR/int8/<key>.lmw8`` (``key``: the weights' digest, the configuration's, the
int8 kernel's and this format's; another model or kernel has another file):

    b"LMW8", format (u32), header length (u64), the header (UTF-8 JSON), zeros to a multiple
    of 64, the tensors' bytes (each at a multiple of 64 from the data's start)

The header: ``{"key": ..., "crc32c": CRC-32C of the data, "tensors": {name: [dtype, shape,
offset, bytes]}}``; a linear's tensors are ``<module>.packed`` (uint8), ``<module>.scale``
(float16) and ``<module>.bias`` (float32, where it has one), every other parameter (the
embedding, the norms) ``<parameter name>`` in float32. A file is written beside its place and
renamed into it, so a worker never maps half of one, as cache files are (kvcache/write.py): a
temporary a killed writer left is removed by the next writer. Before it is used, the whole file is
checked: its key, every tensor's place, dtype and shape against the model's, and the
checksum. A file that fails (damaged, hostile, of another version) is not used: the load
quantizes the weights again and writes the file again over it, and the log says why.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from worker.backends.transformers import fast_weights, shell_model
# the file's format, read without torch (path_of and StoreError are this module's callers' too)
from worker.backends.transformers.int8_file import ALIGN, FORMAT, MAGIC, PREFIX, SUFFIX, StoreError, path_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

_DTYPES = {"uint8": torch.uint8, "float16": torch.float16, "float32": torch.float32}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def key_of(weights_sha256: str, config_sha256: str) -> str:
    """The file's name: the weights' and the configuration's digests (the identity's), the int8
    kernel's products and this format."""
    import hashlib

    described = f"{weights_sha256}\0{config_sha256}\0{fast_weights.int8_products()}\0{FORMAT}"
    return hashlib.sha256(described.encode()).hexdigest()


def applies(config: PretrainedConfig) -> bool:
    """Whether a model of this configuration (loaded with int8 weights on the CPU in float32) has
    its int8 weights kept: an architecture the shell makes, computed by the native pass."""
    from worker.backends.transformers import native_forward

    return config.model_type in shell_model.MODEL_TYPES and native_forward.applies(config, "float32", "int8")


def write(path: Path, key: str, model: torch.nn.Module) -> None:
    """Keep ``model``'s int8 weights (every linear an Int8Linear: fast_weights.quantize) in
    ``path``, written beside it and renamed into place."""
    from worker.kvcache.checksum import crc32c
    from worker.kvcache.write import atomic_file, remove_stale_temporaries

    tensors = _tensors_of(model)
    table: dict[str, list[Any]] = {}
    end = 0
    for name, tensor in tensors.items():
        offset = -(-end // ALIGN) * ALIGN
        table[name] = [_NAMES[tensor.dtype], list(tensor.shape), offset, tensor.numel() * tensor.element_size()]
        end = offset + table[name][3]
    pieces: list[bytes | memoryview] = []
    for name, tensor in tensors.items():
        written = sum(len(piece) for piece in pieces)
        pieces += [bytes(table[name][2] - written), _bytes(tensor)]
    checksum = 0
    for piece in pieces:
        checksum = crc32c(piece, checksum)
    header = json.dumps({"key": key, "crc32c": checksum, "tensors": table}).encode()
    prefix = PREFIX.pack(MAGIC, FORMAT, len(header)) + header
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent, SUFFIX)  # what writers killed mid-write left
    with atomic_file(path) as out:
        out.write(prefix + bytes(-len(prefix) % ALIGN))
        for piece in pieces:
            out.write(piece)


def read(path: Path, key: str, config: PretrainedConfig) -> Any:
    """The model kept in ``path``: shell_model's modules over the mapped file (int8_file.read, its
    tensors then held to the shell's). Raises FileNotFoundError where there is none, StoreError
    for one that cannot serve."""
    from worker.backends.transformers import int8_file

    data, arrays = int8_file.read(path, key)
    model = shell_model.ShellModel(config)
    expected = _expected(model)
    if set(arrays) != set(expected):
        missing, extra = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
        raise StoreError(f"{path} does not hold this model's tensors (missing {missing[:3]}, extra {extra[:3]})")
    views: dict[str, torch.Tensor] = {}
    for name, (dtype, shape) in expected.items():
        array = arrays[name]
        if (array.dtype.name, array.shape) != (_NAMES[dtype], shape):
            raise StoreError(f"{path}'s tensor {name} is {array.dtype.name} {list(array.shape)}, "
                             f"where the model needs {_NAMES[dtype]} {list(shape)}")
        views[name] = _tensor(array)
    _fill(model, views)
    model.mapping = data
    return model.eval()


def keep_note(data_dir: Path, directory: Path, key: str, loaded: Any) -> None:
    """Note beside the kept weights what a load without torch needs (int8_model.Note) of
    ``loaded``, the model the torch path made of them: where its passes are the native pass's own
    arithmetic over rope_tables' tables (else a later load keeps the torch path)."""
    from worker.backends.transformers import int8_model, native_forward, native_pass, rope_tables
    from worker.backends.transformers.int8_pass import Int8Config

    passes = loaded._passes
    if not isinstance(passes, native_forward.NativeForward):
        return
    described, ropes = passes.described
    if not isinstance(ropes, rope_tables.Tables) or described.arithmetic != native_pass.OWN:
        return
    layers = [described.layer[index] for index in range(described.layers)]
    config = Int8Config(
        model_type=loaded._model_type, layers=described.layers, hidden=described.hidden, heads=described.heads,
        kv_heads=described.kv_heads, dim=described.dim, intermediate=described.intermediate, vocab=described.vocab,
        activation=described.activation, epsilon=described.epsilon, scaling=described.scaling,
        windows=[layer.window for layer in layers], ropes=[layer.rope for layer in layers],
        frequencies=[frequencies.tolist() for frequencies in ropes.frequencies],
    )
    note = int8_model.Note(
        key=key, identity=loaded.cache_identity(), config=config, vocab_size=loaded._vocab_size,
        eos_token_ids=sorted(loaded.eos_token_ids), context_length=loaded.info.context_length,
    )
    int8_model.write_note(data_dir, directory, note)


def _expected(model: torch.nn.Module) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Each tensor the file must hold for this shell, with its dtype and shape, in the file's order."""
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            packed, scale = fast_weights.int8_layout(module.in_features, module.out_features)
            expected[f"{name}.packed"] = (torch.uint8, packed)
            expected[f"{name}.scale"] = (torch.float16, scale)
            if module.bias is not None:
                expected[f"{name}.bias"] = (torch.float32, (module.out_features,))
    for name, parameter in model.named_parameters():
        owner = name.rpartition(".")[0]
        if not isinstance(model.get_submodule(owner), torch.nn.Linear):
            expected[name] = (torch.float32, tuple(parameter.shape))
    return expected


def _tensors_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, fast_weights.Int8Linear):
            tensors[f"{name}.packed"], tensors[f"{name}.scale"] = module.packed, module.scale
            if module.bias is not None:
                tensors[f"{name}.bias"] = module.bias.detach().float()
    for name, parameter in model.named_parameters():
        if not isinstance(model.get_submodule(name.rpartition(".")[0]), fast_weights.Int8Linear):
            tensors[name] = parameter.detach().float()
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def _fill(model: torch.nn.Module, views: dict[str, torch.Tensor]) -> None:
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear):
            linear = fast_weights.Int8Linear(
                views[f"{name}.packed"], views[f"{name}.scale"], module.in_features, module.out_features,
                views.get(f"{name}.bias"),
            )
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, linear)
    for name, parameter in list(model.named_parameters()):
        if parameter.is_meta:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, torch.nn.Parameter(views[name], requires_grad=False))


def _tensor(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # the mapping is read-only, and nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _bytes(tensor: torch.Tensor) -> memoryview:
    return tensor.view(torch.uint8).reshape(-1).numpy().data
