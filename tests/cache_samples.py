"""Small, sound KVC3 (and KVC2) files for tests of the container and the store, made without a model."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import msgspec

from worker.kvcache import container

IDENTITY = container.Identity(
    model_id="tiny", weights_sha256="w" * 64, tokenizer_sha256="t" * 64, rope_theta=10000.0,
    config_sha256="c" * 64, layers=2, kv_heads=2, head_dim=4, dtype="float32", cache_class="DynamicCache",
    attention_type="full",
)
TOKENS = [1, 5, 9, 200, 7]


def full_attention_tensors(
    tokens: list[int] = TOKENS, identity: container.Identity = IDENTITY, seed: int = 0
) -> list[tuple[container.TensorSpec, bytes]]:
    """Random keys and values, layer by layer, for a model of full-attention layers."""
    rng = random.Random(seed)
    shape = (1, identity.kv_heads, len(tokens), identity.head_dim)
    return [
        (container.TensorSpec(name=f"layers.{layer}.{kind}", kind=kind, layer=layer, shape=shape, dtype="float32"),
         rng.randbytes(4 * identity.kv_heads * len(tokens) * identity.head_dim))
        for layer in range(identity.layers)
        for kind in ("key", "value")
    ]


def contents(tokens: list[int] = TOKENS, identity: container.Identity = IDENTITY, **extra) -> container.Contents:
    layers = [container.LayerEntry(index=i, kind="full") for i in range(identity.layers)]
    return container.Contents(identity=identity, tokens=tokens, layers=layers, **extra)


def write_small_cache(path: Path, tokens: list[int] = TOKENS, seed: int = 0, format: str | None = None, **extra) -> int:
    """``format``: KVC3 (CRC-32C) or KVC2 (CRC-32); None: what a writer here writes."""
    tensors = [(spec, memoryview(data)) for spec, data in full_attention_tensors(tokens, seed=seed)]
    return container.write(path, contents(tokens, **extra), tensors, format=format)


def write_kvc1_file(path: Path, tokens: list[int], model_id: str = "tiny") -> None:
    """A cache as the previous format (KVC1) wrote it: a sound header, here without tensors."""
    header = msgspec.json.encode({
        "format": "KVC1", "identity": {"model_id": model_id, "weights_fingerprint": "x", "rope_theta": 0.0},
        "sequence_start": 0, "sequence_length": len(tokens), "tokens": tokens, "prefix_offsets": [],
        "prefix_hashes": [], "tensors": [], "created_by": "lm-worker 0.1.0",
    })
    path.write_bytes(b"KVC1\r\n\x1a\n" + len(header).to_bytes(8, "little") + hashlib.sha256(header).digest() + header)


def forge(path: Path, edit) -> None:
    """Rewrite a cache's header through ``edit`` (a function of the decoded header) with a valid SHA-256."""
    data = path.read_bytes()
    header = msgspec.json.decode(data[48 : 48 + int.from_bytes(data[8:16], "little")])
    data_start = header["tensors"][0]["offset"]
    edit(header)
    encoded = msgspec.json.encode(header)
    assert 48 + len(encoded) <= data_start  # the tensors stay where the header says they are
    prefix = data[:8] + len(encoded).to_bytes(8, "little") + hashlib.sha256(encoded).digest()
    path.write_bytes(prefix + encoded + bytes(data_start - 48 - len(encoded)) + data[data_start:])


def header_edit(*path_and_value):
    """An edit for ``forge`` that sets the field at a path of keys and indices: ("tensors", 0, "dtype", "int8")."""
    *path, value = path_and_value

    def edit(header):
        target = header
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit
