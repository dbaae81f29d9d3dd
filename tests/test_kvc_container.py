"""The KVC3 container (and KVC2, the format before, which still reads): what is written reads
back bit for bit, and any damage is refused."""

from __future__ import annotations

import mmap
import os
import re
import zlib
from pathlib import Path

import msgspec
import pytest

from tests.cache_samples import (
    IDENTITY, TOKENS, contents, forge, full_attention_tensors, header_edit, write_kvc1_file, write_small_cache,
)
from worker.kvcache import checksum, container, memory
from worker.kvcache.container import (
    ALIGNMENT,
    CacheFormatError,
    Identity,
    IdentityMismatch,
    OutdatedCache,
    load,
    read_header,
    write,
)


def tensors(seed: int = 0):
    return full_attention_tensors(seed=seed)


@pytest.fixture(params=["KVC3", "KVC2"])
def cache_file(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A small cache of each format: KVC3 (CRC-32C) and KVC2 (CRC-32) are held to the same checks."""
    path = tmp_path / "prefix.kvc"
    write_small_cache(path, format=request.param, prefix_offsets=[2], prefix_hashes=["h1"])
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


@pytest.mark.parametrize(
    "field", ["model_id", "weights_sha256", "tokenizer_sha256", "config_sha256", "layers", "dtype", "rope_theta"]
)
def test_a_cache_of_another_model_is_refused_naming_the_field(cache_file: Path, field: str):
    value = getattr(IDENTITY, field)
    other = {"layers": 3, "rope_theta": 500000.0}.get(field, f"{value}-other")
    expected = Identity(**{**{f: getattr(IDENTITY, f) for f in IDENTITY.__struct_fields__}, field: other})
    with pytest.raises(IdentityMismatch) as caught:
        load(cache_file, expected)
    assert (caught.value.field, caught.value.found, caught.value.expected) == (field, value, other)


def test_tensor_checksums_are_crc32c_in_kvc3_and_zlibs_crc32_in_kvc2(cache_file: Path):
    """The format's CRC, whichever code computes it."""
    data = cache_file.read_bytes()
    header = load(cache_file).header
    crc = {"KVC3": checksum.crc32c_numpy, "KVC2": zlib.crc32}[header.format]
    assert data[:8] == header.format.encode() + b"\r\n\x1a\n"
    for entry in header.tensors:
        assert entry.crc32 == crc(data[entry.offset : entry.offset + entry.nbytes])


def heads_of(view, shape, positions: int) -> list[bytes]:
    """The bytes of each head's first ``positions`` positions in a tensor laid out as ``shape``."""
    _, heads, held, dim = shape
    return [bytes(view[h * held * dim * 4 :][: positions * dim * 4]) for h in range(heads)]


def test_key_and_value_tensors_read_with_room_hold_each_heads_positions_then_the_room(cache_file: Path):
    loaded = load(cache_file, IDENTITY, room=lambda entry: 3 + entry.layer)
    for entry, view, shape, (_, data) in zip(loaded.header.tensors, loaded.tensors, loaded.shapes, tensors()):
        _, heads, positions, dim = entry.shape
        assert shape == (1, heads, positions + 3 + entry.layer, dim)
        assert view.nbytes == heads * (positions + 3 + entry.layer) * dim * 4
        assert heads_of(view, shape, positions) == heads_of(memoryview(data), entry.shape, positions)


def test_reads_the_system_cuts_short_still_fill_every_tensor(cache_file: Path, monkeypatch):
    """preadv may read fewer bytes than asked (a signal, a network filesystem)."""
    preadv = os.preadv

    def five_bytes_at_most(fd, buffers, offset):
        return preadv(fd, [memoryview(buffers[0])[:5]], offset)

    monkeypatch.setattr(os, "preadv", five_bytes_at_most)
    loaded = load(cache_file, IDENTITY, room=lambda entry: 2)
    for entry, view, shape, (_, data) in zip(loaded.header.tensors, loaded.tensors, loaded.shapes, tensors()):
        assert heads_of(view, shape, entry.shape[2]) == heads_of(memoryview(data), entry.shape, entry.shape[2])


@pytest.mark.parametrize("room", [None, lambda entry: 2], ids=["as-stored", "with-room"])
def test_a_flipped_byte_anywhere_is_caught(cache_file: Path, tmp_path: Path, room):
    original = cache_file.read_bytes()
    damaged = tmp_path / "damaged.kvc"
    for position in range(len(original)):  # every byte: prefix, header, padding, payload
        data = bytearray(original)
        data[position] ^= 1 << (position % 8)
        damaged.write_bytes(data)
        with pytest.raises(CacheFormatError):
            load(damaged, IDENTITY, room=room)


def test_of_several_damaged_tensors_the_first_in_the_file_is_named(cache_file: Path):
    data = bytearray(cache_file.read_bytes())
    for entry in load(cache_file).header.tensors[1:]:  # every tensor but the first
        data[entry.offset] ^= 0xFF
    cache_file.write_bytes(data)
    with pytest.raises(CacheFormatError, match="tensor layers.0.value: checksum mismatch"):
        load(cache_file)


@pytest.mark.parametrize("room", [None, lambda entry: 2], ids=["as-stored", "with-room"])
def test_a_truncated_file_is_caught_at_every_length(cache_file: Path, tmp_path: Path, room):
    original = cache_file.read_bytes()
    short = tmp_path / "short.kvc"
    for length in range(0, len(original), 7):
        short.write_bytes(original[:length])
        with pytest.raises(CacheFormatError):
            load(short, IDENTITY, room=room)


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
        write(tmp_path / "bad.kvc", contents(), [(spec, memoryview(data[:-1]))])
    assert list(tmp_path.iterdir()) == []


def test_rewriting_a_cache_replaces_it_whole(cache_file: Path):
    write_small_cache(cache_file, seed=1)
    assert [bytes(t) for t in load(cache_file).tensors] == [d for _, d in tensors(seed=1)]
    assert [p.name for p in cache_file.parent.iterdir()] == [cache_file.name]


def test_a_cache_lacking_a_layers_tensors_is_refused_when_written(tmp_path: Path):
    with pytest.raises(ValueError, match="layer 1 .full. lacks its keys or values"):
        write(tmp_path / "x.kvc", contents(), [(s, memoryview(d)) for s, d in tensors()[:2]])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (header_edit("tensors", 0, "shape", [1, 2, 5, 5]), "is not 160 bytes"),
        (header_edit("tensors", 0, "dtype", "int8"), "unknown dtype 'int8'"),
        (header_edit("tensors", 0, "layer", 99), "there is no layer 99"),
        (header_edit("tensors", 1, "kind", "key"), "a second key tensor of layer 0"),
        (header_edit("tensors", 1, "name", "layers.0.key"), "is listed twice"),
        (header_edit("tensors", 0, "shape", [1, 2, 1 << 40, 4]), "is not 160 bytes"),
        (header_edit("tensors", 0, "strides", [4, 4, 4, 4]), "strides"),
        (header_edit("layers", 1, "kind", "linear"), "has no state at the end of the sequence"),
        (header_edit("layers", 1, "kind", "none"), "keeps no keys and values"),
        (header_edit("layers", 0, "sliding_window", 4), "a sliding window goes with sliding layers"),
        (header_edit("identity", "layers", 3), "not layers 0 to 2"),
        (header_edit("tokens", 0, -1), "token id is out of range"),
        (header_edit("states", [{"layer": 0, "state": 0, "position": 3, "has_previous_state": True}]),
         "keeps no linear-attention state"),
    ],
)
def test_a_header_with_a_sound_checksum_but_inconsistent_fields_is_refused_before_any_tensor(
    cache_file: Path, edit, reason: str
):
    forge(cache_file, edit)
    for read in (load, read_header):
        with pytest.raises(CacheFormatError, match=re.escape(reason)):
            read(cache_file)


def test_a_cache_of_the_previous_format_is_listed_but_refused_as_another_identity(tmp_path: Path):
    path = tmp_path / "old.kvc"
    write_kvc1_file(path, [1, 2, 3])
    with pytest.raises(OutdatedCache) as outdated:
        read_header(path)
    assert outdated.value.header.tokens == [1, 2, 3] and outdated.value.header.identity.model_id == "tiny"
    with pytest.raises(IdentityMismatch) as caught:
        load(path, IDENTITY)
    assert (caught.value.field, caught.value.found, caught.value.expected) == ("format", "KVC1", container.FORMAT)


def test_a_restore_reads_into_the_memory_reserved_for_it_and_leaves_it_filled_for_the_next(cache_file: Path):
    """Memory reserved (filled) ahead is what a restore reads into; while one restore holds
    it the next reads into new memory, and once the first's tensors are gone it is free
    again, its pages kept (not given back as other memory is)."""
    try:
        assert container.reserve(1 << 20) == 1 << 20
        reserved = memory._reserve.buffer
        first = load(cache_file, IDENTITY, room=lambda entry: 2)
        assert all(tensor.obj is reserved for tensor in first.tensors)
        second = load(cache_file, IDENTITY)
        assert all(tensor.obj is not reserved for tensor in second.tensors)
        expected = [bytes(tensor) for tensor in second.tensors]
        del first
        third = load(cache_file, IDENTITY)
        assert all(tensor.obj is reserved for tensor in third.tensors)
        assert [bytes(tensor) for tensor in third.tensors] == expected
        del third
        assert container.reserve(8) == 8  # replaced: a cache restored into the old one keeps it alive
        assert load(cache_file, IDENTITY).tensors[0].obj is not reserved  # too small for it
    finally:
        container.reserve(0)


def test_a_reserve_replaced_while_a_restore_holds_it_is_never_handed_to_another(cache_file: Path):
    try:
        container.reserve(1 << 20)
        old = memory._reserve.buffer
        held = load(cache_file, IDENTITY)
        assert held.tensors[0].obj is old
        container.reserve(1 << 20)
        new = load(cache_file, IDENTITY)
        assert new.tensors[0].obj is memory._reserve.buffer is not old
        del held  # the old reserve's tensors going must not free the new one under `new`
        assert load(cache_file, IDENTITY).tensors[0].obj is not memory._reserve.buffer
        del new
        assert load(cache_file, IDENTITY).tensors[0].obj is memory._reserve.buffer
    finally:
        container.reserve(0)


def test_a_damaged_file_read_into_the_reserve_leaves_it_free_for_the_next_restore(cache_file: Path, tmp_path: Path):
    damaged = tmp_path / "damaged.kvc"
    data = bytearray(cache_file.read_bytes())
    data[load(cache_file).header.tensors[-1].offset] ^= 1
    damaged.write_bytes(data)
    try:
        container.reserve(1 << 20)
        with pytest.raises(CacheFormatError, match="checksum mismatch"):
            load(damaged, IDENTITY)
        assert load(cache_file, IDENTITY).tensors[0].obj is memory._reserve.buffer
    finally:
        container.reserve(0)


def test_a_forged_tensor_of_no_heads_read_with_room_is_refused_as_damaged(cache_file: Path):
    """A header with a sound checksum may describe a key tensor of zero heads; asked for room,
    the reader lays it out like any other and refuses the file for what follows it."""
    from tests.cache_samples import forge

    def no_heads(header):
        header["tensors"][0].update(shape=[1, 0, 5, 4], strides=[0, 80, 16, 4], nbytes=0, crc32=0)

    forge(cache_file, no_heads)
    with pytest.raises(CacheFormatError, match="damaged padding before tensor layers.0.value"):
        load(cache_file, IDENTITY, room=lambda entry: 2)


def test_the_readers_check_of_a_header_refuses_it_before_any_tensor_is_read(cache_file: Path):
    own = [spec for spec, _ in full_attention_tensors(tokens=[1])]  # the model's cache of one position

    def check(header):
        return container.layout_problem(header, own, max_positions=len(TOKENS))

    assert load(cache_file, IDENTITY, check=check).header.tokens == TOKENS
    with pytest.raises(CacheFormatError, match="5 positions, more than the model's context of 4"):
        load(cache_file, IDENTITY, check=lambda header: container.layout_problem(header, own, 4))
    other = [msgspec.structs.replace(spec, dtype="bfloat16") for spec in own]
    with pytest.raises(CacheFormatError, match=r"layers.0.key: float32 of shape \[1, 2, 5, 4\], where the model's is"):
        load(cache_file, IDENTITY, check=lambda header: container.layout_problem(header, other, 10))
