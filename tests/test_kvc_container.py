"""The KVC1 container: what is written reads back bit for bit, and any damage is refused."""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import pytest

from worker.kvcache.container import (
    ALIGNMENT,
    CacheFormatError,
    Identity,
    IdentityMismatch,
    TensorSpec,
    load,
    read_header,
    write,
)

IDENTITY = Identity(
    model_id="tiny",
    weights_fingerprint="sha256:abc",
    tokenizer_sha256="def",
    rope_theta=10000.0,
    layers=2,
    kv_heads=2,
    head_dim=4,
    dtype="float32",
    cache_class="DynamicCache",
    attention_type="full",
)
TOKENS = [1, 5, 9, 200, 7]


def tensors(seed: int = 0) -> list[tuple[TensorSpec, bytes]]:
    rng = random.Random(seed)
    out = []
    for layer in range(IDENTITY.layers):
        for kind in ("key", "value"):
            shape = (1, IDENTITY.kv_heads, len(TOKENS), IDENTITY.head_dim)
            data = rng.randbytes(4 * 1 * 2 * len(TOKENS) * 4)
            out.append((TensorSpec(name=f"layers.{layer}.{kind}", kind=kind, layer=layer, shape=shape, dtype="float32"), data))
    return out


@pytest.fixture
def cache_file(tmp_path: Path) -> Path:
    path = tmp_path / "prefix.kvc"
    write(path, identity=IDENTITY, tokens=TOKENS, tensors=[(s, memoryview(d)) for s, d in tensors()],
          prefix_offsets=[2], prefix_hashes=["h1"])
    return path


def test_a_written_cache_reads_back_bit_for_bit(cache_file: Path):
    loaded = load(cache_file, IDENTITY)
    assert [bytes(t) for t in loaded.tensors] == [d for _, d in tensors()]
    header = loaded.header
    assert (header.tokens, header.sequence_length, header.sequence_start) == (TOKENS, 5, 0)
    assert (header.prefix_offsets, header.prefix_hashes) == ([2], ["h1"])
    assert all(entry.offset % ALIGNMENT == 0 for entry in header.tensors)
    assert header.tensors[0].strides == [2 * 5 * 4 * 4, 5 * 4 * 4, 4 * 4, 4]


def test_loaded_tensors_are_views_of_the_mapped_file_not_copies(cache_file: Path):
    loaded = load(cache_file)
    assert all(isinstance(t.obj, mmap.mmap) for t in loaded.tensors)


def test_the_header_is_read_without_the_tensors(cache_file: Path):
    assert read_header(cache_file).identity == IDENTITY


@pytest.mark.parametrize("field", ["model_id", "tokenizer_sha256", "layers", "dtype", "rope_theta"])
def test_a_cache_of_another_model_is_refused_naming_the_field(cache_file: Path, field: str):
    value = getattr(IDENTITY, field)
    other = {"layers": 3, "rope_theta": 500000.0}.get(field, f"{value}-other")
    expected = Identity(**{**{f: getattr(IDENTITY, f) for f in IDENTITY.__struct_fields__}, field: other})
    with pytest.raises(IdentityMismatch) as caught:
        load(cache_file, expected)
    assert (caught.value.field, caught.value.found, caught.value.expected) == (field, value, other)


def test_a_flipped_byte_anywhere_is_caught(cache_file: Path, tmp_path: Path):
    original = cache_file.read_bytes()
    damaged = tmp_path / "damaged.kvc"
    for position in range(len(original)):  # every byte: prefix, header, padding, payload
        data = bytearray(original)
        data[position] ^= 1 << (position % 8)
        damaged.write_bytes(data)
        with pytest.raises(CacheFormatError):
            load(damaged, IDENTITY)


def test_of_several_damaged_tensors_the_first_in_the_file_is_named(cache_file: Path):
    data = bytearray(cache_file.read_bytes())
    for entry in load(cache_file).header.tensors[1:]:  # every tensor but the first
        data[entry.offset] ^= 0xFF
    cache_file.write_bytes(data)
    with pytest.raises(CacheFormatError, match="tensor layers.0.value: checksum mismatch"):
        load(cache_file)


def test_a_truncated_file_is_caught_at_every_length(cache_file: Path, tmp_path: Path):
    original = cache_file.read_bytes()
    short = tmp_path / "short.kvc"
    for length in range(0, len(original), 7):
        short.write_bytes(original[:length])
        with pytest.raises(CacheFormatError):
            load(short, IDENTITY)


def test_bytes_after_the_last_tensor_are_caught(cache_file: Path):
    cache_file.write_bytes(cache_file.read_bytes() + b"\0")
    with pytest.raises(CacheFormatError, match="unexpected bytes"):
        load(cache_file)


@pytest.mark.parametrize("content", [b"", b"{}", b"PK\x03\x04" + bytes(100), os.urandom(4096)])
def test_a_foreign_file_is_not_a_cache(tmp_path: Path, content: bytes):
    path = tmp_path / "foreign.kvc"
    path.write_bytes(content)
    with pytest.raises(CacheFormatError):
        load(path)
    with pytest.raises(CacheFormatError):
        read_header(path)


def test_a_missing_file_is_a_format_error_saying_it_cannot_be_read(tmp_path: Path):
    with pytest.raises(CacheFormatError, match="cannot be read"):
        load(tmp_path / "missing.kvc")


def test_a_failed_write_leaves_neither_the_file_nor_a_temporary(tmp_path: Path):
    spec, data = tensors()[0]
    with pytest.raises(ValueError):
        write(tmp_path / "bad.kvc", identity=IDENTITY, tokens=TOKENS, tensors=[(spec, memoryview(data[:-1]))])
    assert list(tmp_path.iterdir()) == []


def test_rewriting_a_cache_replaces_it_whole(cache_file: Path):
    write(cache_file, identity=IDENTITY, tokens=TOKENS, tensors=[(s, memoryview(d)) for s, d in tensors(seed=1)])
    assert [bytes(t) for t in load(cache_file).tensors] == [d for _, d in tensors(seed=1)]
    assert [p.name for p in cache_file.parent.iterdir()] == [cache_file.name]
