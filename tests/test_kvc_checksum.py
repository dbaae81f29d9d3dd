"""CRC-32C, the checksum of KVC3 cache files: the kernel's ways and numpy's agree on every
buffer, and a file is held to the checksum its format names, old files still reading."""

from __future__ import annotations

import hashlib
import os
import platform
import random
import time
import zlib
from pathlib import Path

import msgspec
import pytest

from tests.cache_samples import IDENTITY, TOKENS, forge, full_attention_tensors, header_edit, write_small_cache
from tests.conftest import processor_flags
from worker.kvcache import checksum, container, read
from worker.kvcache.container import CacheFormatError, load

KVC2_MAGIC = b"KVC2\r\n\x1a\n"

# RFC 3720 (iSCSI), B.4, and the usual check value.
KNOWN = [
    (b"123456789", 0xE3069283),
    (b"", 0),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


@pytest.mark.parametrize(("data", "expected"), KNOWN)
def test_crc32c_of_the_known_vectors_by_every_way_to_it(data: bytes, expected: int):
    assert checksum.crc32c(data) == expected
    assert checksum.crc32c_numpy(data) == expected
    assert set(checksum.crc32c_kernels(data).values()) == {expected}


def test_the_kernel_is_built_here_and_uses_the_processors_crc_instructions_where_it_has_them():
    assert checksum.path() != "numpy", "a C compiler is there: the kernel builds"
    if platform.machine() in ("x86_64", "AMD64"):
        flags = processor_flags()
        if "avx512f" in flags and "vpclmulqdq" in flags:
            assert checksum.path() == "avx512 vpclmulqdq"
        elif "sse4_2" in flags:
            assert checksum.path() == "sse4.2 crc32"


def test_the_fast_and_the_fallback_paths_agree_on_random_buffers_of_odd_lengths_and_alignments():
    rng = random.Random(45)
    block = os.urandom(200_000)
    # Lengths around the kernel's steps: 8-byte words, 3 x 256 and 3 x 8192 byte streams, 256-byte folds.
    lengths = [0, 1, 7, 8, 9, 63, 64, 65, 255, 256, 257, 767, 768, 769, 24575, 24576, 24577, 100_003]
    lengths += [rng.randrange(0, 3000) for _ in range(40)] + [rng.randrange(3000, 150_000) for _ in range(10)]
    for length in lengths:
        offset = rng.randrange(0, 64)
        value = rng.getrandbits(32)
        data = memoryview(block)[offset : offset + length]
        expected = checksum.crc32c_numpy(data, value)
        assert checksum.crc32c(data, value) == expected, (offset, length)
        assert set(checksum.crc32c_kernels(data, value).values()) == {expected}, (offset, length)


def test_a_crc_continued_over_pieces_is_the_crc_of_the_whole():
    data = os.urandom(70_001)
    for crc in (checksum.crc32c, checksum.crc32c_numpy):
        value = 0
        for start in range(0, len(data), 9_999):
            value = crc(data[start : start + 9_999], value)
        assert value == checksum.crc32c(data)


def test_without_a_compiler_crc32c_is_computed_by_numpy_and_a_writer_writes_kvc2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    kvc3 = tmp_path / "new.kvc"
    write_small_cache(kvc3, format="KVC3")
    monkeypatch.setattr(checksum, "_kernel", None)
    monkeypatch.setattr(checksum, "_tried", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("LM_WORKER_DATA_DIR", str(tmp_path / "data"))
    with pytest.raises(checksum.KernelUnavailable, match="no C compiler"):
        checksum.load_kernel(tmp_path / "kernels")
    assert checksum.path() == "numpy" and not checksum.writes_crc32c()
    assert checksum.crc32c(b"123456789") == 0xE3069283
    written = tmp_path / "written.kvc"
    write_small_cache(written)
    assert written.read_bytes()[:8] == KVC2_MAGIC and load(written, IDENTITY).header.format == "KVC2"
    assert [bytes(t) for t in load(kvc3, IDENTITY).tensors] == [d for _, d in full_attention_tensors()]
    damaged = bytearray(kvc3.read_bytes())
    damaged[load(kvc3).header.tensors[1].offset + 3] ^= 4
    kvc3.write_bytes(damaged)
    with pytest.raises(CacheFormatError, match="tensor layers.0.value: checksum mismatch"):
        load(kvc3, IDENTITY)


def test_a_cache_is_written_with_crc32c_where_the_kernel_computes_it(tmp_path: Path):
    path = tmp_path / "new.kvc"
    write_small_cache(path)
    assert path.read_bytes()[:8] == container.MAGIC == b"KVC3\r\n\x1a\n"
    assert load(path, IDENTITY).header.format == "KVC3"


def test_a_cache_written_with_crc32c_is_refused_when_one_byte_changes(tmp_path: Path):
    path = tmp_path / "new.kvc"
    write_small_cache(path, format="KVC3")
    header = load(path).header
    original = path.read_bytes()
    for entry in header.tensors:
        for position in (entry.offset, entry.offset + entry.nbytes // 2, entry.offset + entry.nbytes - 1):
            data = bytearray(original)
            data[position] ^= 0x10
            path.write_bytes(data)
            with pytest.raises(CacheFormatError, match=f"tensor {entry.name}: checksum mismatch, the data is damaged"):
                load(path, IDENTITY, room=lambda entry: 2)


def test_a_cache_file_of_the_previous_format_still_restores(tmp_path: Path):
    path = tmp_path / "old.kvc"
    write_small_cache(path, format="KVC2")
    assert path.read_bytes()[:8] == KVC2_MAGIC
    loaded = load(path, IDENTITY)
    assert loaded.header.format == "KVC2" and loaded.header.tokens == TOKENS
    assert [bytes(t) for t in loaded.tensors] == [d for _, d in full_attention_tensors()]
    data = path.read_bytes()
    for entry in loaded.header.tensors:  # zlib's CRC-32, as KVC2 always had
        assert entry.crc32 == zlib.crc32(data[entry.offset : entry.offset + entry.nbytes])


def relabel(path: Path, format: str) -> None:
    """The file under another format's magic and header field, its header's SHA-256 made sound again."""
    forge(path, header_edit("format", format))
    data = bytearray(path.read_bytes())
    data[:8] = format.encode() + b"\r\n\x1a\n"
    path.write_bytes(data)


@pytest.mark.parametrize(("written", "claimed"), [("KVC2", "KVC3"), ("KVC3", "KVC2")])
def test_a_file_claiming_another_format_than_its_checksums_is_refused_as_damaged(
    tmp_path: Path, written: str, claimed: str
):
    """A KVC2 file relabelled KVC3 (sound header, CRC-32s where CRC-32Cs belong), and the
    other way round: the first tensor's checksum does not match."""
    path = tmp_path / "relabelled.kvc"
    write_small_cache(path, format=written)
    relabel(path, claimed)
    assert container.read_header(path).format == claimed
    with pytest.raises(CacheFormatError, match="tensor layers.0.key: checksum mismatch, the data is damaged"):
        load(path, IDENTITY)


def test_a_header_naming_another_format_than_the_magic_is_refused(tmp_path: Path):
    path = tmp_path / "mixed.kvc"
    write_small_cache(path, format="KVC3")
    forge(path, header_edit("format", "KVC2"))
    with pytest.raises(CacheFormatError, match="unsupported format 'KVC2'"):
        load(path, IDENTITY)


def test_a_file_of_an_unknown_later_format_is_not_a_cache(tmp_path: Path):
    path = tmp_path / "later.kvc"
    header = msgspec.json.encode({"format": "KVC4"})
    path.write_bytes(b"KVC4\r\n\x1a\n" + len(header).to_bytes(8, "little") + hashlib.sha256(header).digest() + header)
    with pytest.raises(CacheFormatError, match="wrong magic bytes"):
        load(path)


def test_a_format_no_reader_knows_is_not_written(tmp_path: Path):
    with pytest.raises(ValueError, match="cannot write format 'KVC1'"):
        write_small_cache(tmp_path / "x.kvc", format="KVC1")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("format", ["KVC3", "KVC2"])
def test_tensors_read_in_small_pieces_on_several_threads_are_whole_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, format: str
):
    """However the reader cuts the file (runs of tensors per thread, pieces within a tensor),
    every byte arrives and is checked, and the first damage in file order is named."""
    monkeypatch.setattr(read, "READ_PIECE", 24)
    monkeypatch.setattr(read, "CHECK_THREADS", 3)
    path = tmp_path / "small.kvc"
    write_small_cache(path, format=format)
    loaded = load(path, IDENTITY, room=lambda entry: 1)
    for entry, view, shape, (_, data) in zip(loaded.header.tensors, loaded.tensors, loaded.shapes,
                                             full_attention_tensors()):
        _, heads, positions, dim = entry.shape
        stride = (positions + 1) * dim * 4
        assert b"".join(bytes(view[h * stride : h * stride + positions * dim * 4]) for h in range(heads)) == data
    data = bytearray(path.read_bytes())
    for entry in loaded.header.tensors[1:]:
        data[entry.offset + entry.nbytes - 1] ^= 1
    path.write_bytes(data)
    with pytest.raises(CacheFormatError, match="tensor layers.0.value: checksum mismatch"):
        load(path, IDENTITY)


def test_the_kernels_read_fills_the_buffer_and_checks_what_it_read_piece_by_piece(tmp_path: Path):
    data = os.urandom(100_003)
    path = tmp_path / "bytes"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        into = bytearray(90_000)
        assert checksum.read_crc32c(fd, 7, memoryview(into), 0, 4096) == (90_000, checksum.crc32c(data[7:90_007]))
        assert into == data[7:90_007]
        head = checksum.crc32c(data[:7])
        assert checksum.read_crc32c(fd, 7, memoryview(into), head, 1000) == (90_000, checksum.crc32c(data[:90_007]))
        # The file ends before the buffer is full: what was read, and its CRC.
        assert checksum.read_crc32c(fd, 50_000, memoryview(into), 0, 4096) == (50_003, checksum.crc32c(data[50_000:]))
    finally:
        os.close(fd)
    directory = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(OSError):  # EISDIR: a read that fails says so
            checksum.read_crc32c(directory, 0, memoryview(bytearray(10)), 0, 4096)
    finally:
        os.close(directory)


def test_a_compiler_that_hangs_is_given_up_on_and_crc32c_is_computed_by_numpy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    compiler = tmp_path / "hung-cc"
    compiler.write_text("#!/bin/sh\nsleep 1000 &\nsleep 1000\n")
    compiler.chmod(0o755)
    monkeypatch.setattr(checksum, "_kernel", None)
    monkeypatch.setattr(checksum, "_tried", None)
    monkeypatch.setattr(checksum, "FIRST_USE_TIMEOUT_S", 1.0)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("LM_WORKER_DATA_DIR", str(tmp_path / "data"))
    started = time.perf_counter()
    assert checksum.crc32c(b"123456789") == 0xE3069283
    assert time.perf_counter() - started < 5
    assert checksum.path() == "numpy" and not checksum.writes_crc32c()
    assert list((tmp_path / "data" / "kernels").iterdir()) == []  # no half-built library left behind
