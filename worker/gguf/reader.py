"""A gguf file's header, read with every count and size checked against the file before it is
used, and its tensors as read-only views of the mapped file (never copied).

A gguf file is anyone's download: a count of 20 million metadata items in a 20 MB file, a
string length of 2^63, tensors overlapping or past the end must be refused at once with a
message naming what is wrong (GgufError), not followed into memory exhaustion or a read past
the mapping. What is read: the metadata (numbers, strings and arrays of them; arrays of
strings, a tokenizer's vocabulary, are walked and read only when asked for), and the tensor
table (name, type, shape, where its data lies). Torch-free.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any, Union

import msgspec

from worker.files import open_regular
from worker.gguf.types import TYPES, row_bytes, type_name

MAGIC = b"GGUF"
VERSIONS = (2, 3)
# Bounds on what a header may ask the reader to hold (PROTOCOL.md §13 states them).
MAX_KEYS = 65_536  # metadata entries
MAX_TENSORS = 1_048_576
MAX_STRING = 64 << 20  # bytes of one string (a tokenizer's whole JSON fits)
MAX_ARRAY = 1 << 24  # items of one array of numbers
MAX_STRINGS = 1 << 22  # strings of one array (a vocabulary of 262,144 tokens, its merges), each a Python object when read
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32

_LENGTH = struct.Struct("<Q")
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    """The file is not a gguf this reader can take; the message says what and where."""


class Strings(msgspec.Struct, frozen=True):
    """An array of strings, walked and left in the file: ``GgufFile.strings`` reads it."""

    count: int
    offset: int  # of its first string's length


Value = Union[int, float, bool, str, list, Strings]


class TensorInfo(msgspec.Struct, frozen=True):
    name: str
    type: int  # ggml's type number
    shape: tuple[int, ...]  # as gguf lists it: the fastest-moving (a row's inputs) first
    offset: int  # of its data, from the file's start
    size: int  # bytes

    @property
    def count(self) -> int:
        total = 1
        for extent in self.shape:
            total *= extent
        return total


class GgufFile:
    """A gguf file mapped read-only: its metadata, its tensor table, views of its tensors."""

    def __init__(self, path: Path, data: mmap.mmap, version: int, metadata: dict[str, Value],
                 tensors: dict[str, TensorInfo]) -> None:
        self.path, self.version, self.metadata, self.tensors = path, version, metadata, tensors
        self._data = data

    @property
    def size(self) -> int:
        return len(self._data)

    @property
    def architecture(self) -> str:
        """general.architecture (GgufError where the file does not say)."""
        value = self.get("general.architecture", str)
        if value is None:
            raise GgufError(f"{self.path}: the metadata has no general.architecture")
        return value

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        """The value under ``key`` if it is of ``kind`` (bool counts only as bool), else
        ``default`` where it is absent; a value of another kind is a GgufError naming it."""
        if key not in self.metadata:
            return default
        value = self.metadata[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            ok = False
        else:
            ok = isinstance(value, kinds) or (float in kinds and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise GgufError(f"metadata {key} is {_described(value)}, not {' or '.join(k.__name__ for k in kinds)}")
        return value

    def strings(self, key: str) -> list[str] | None:
        """The array of strings under ``key`` (None where absent); a GgufError where it is not one."""
        value = self.metadata.get(key)
        if value is None:
            return None
        if not isinstance(value, Strings):
            raise GgufError(f"metadata {key} is {_described(value)}, not an array of strings")
        out, position = [], value.offset
        data = self._data
        for _ in range(value.count):
            (length,) = struct.unpack_from("<Q", data, position)
            position += 8
            out.append(bytes(data[position:position + length]).decode("utf-8", "replace"))
            position += length
        return out

    def view(self, tensor: TensorInfo) -> memoryview:
        """The tensor's bytes, a view of the mapping (read-only; no copy)."""
        return memoryview(self._data)[tensor.offset:tensor.offset + tensor.size]

    def close(self) -> None:
        """Unmaps the file, unless views of it are still alive (then it goes with the last)."""
        try:
            self._data.close()
        except BufferError:
            pass


def _described(value: Value) -> str:
    if isinstance(value, Strings):
        return f"an array of {value.count} strings"
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    return f"{type(value).__name__} {str(value)[:40]!r}"


def read(path: str | os.PathLike[str]) -> GgufFile:
    """Map and read the file's header; raises GgufError for a file that is not a readable gguf
    (with what is wrong and where), OSError as opening it does (a FIFO is refused, not waited on)."""
    path = Path(path)
    descriptor = open_regular(path)
    try:
        if os.fstat(descriptor).st_size == 0:
            raise GgufError(f"{path} is empty")
        data = mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(descriptor)
    try:
        return _Header(data, path).read()
    except GgufError:
        data.close()
        raise


class _Header:
    """The parse, every read checked against the mapping's end."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.path, self.end, self.at = data, path, len(data), 0

    def fail(self, what: str) -> GgufError:
        return GgufError(f"{self.path}: {what} (at byte {self.at} of {self.end})")

    def take(self, form: str, what: str) -> Any:
        size = struct.calcsize("<" + form)
        if self.at + size > self.end:
            raise self.fail(f"the file ends inside {what}: truncated")
        values = struct.unpack_from("<" + form, self.data, self.at)
        self.at += size
        return values[0] if len(values) == 1 else values

    def length(self, what: str, most: int) -> int:
        length = self.take("Q", what)
        if length > most or self.at + length > self.end:
            raise self.too_long(what, length, most)
        return length

    def too_long(self, what: str, length: int, most: int) -> GgufError:
        return self.fail(f"{what} is {length} bytes long, more than {'the file holds' if length <= most else most}")

    def text(self, what: str) -> str:
        length = self.length(what, MAX_STRING)
        self.at += length
        return bytes(self.data[self.at - length:self.at]).decode("utf-8", "replace")

    def value(self, kind: int, key: str, depth: int = 0) -> Value:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind], f"the value of {key}")
        if kind == _STRING:
            return self.text(f"the string {key}")
        if kind != _ARRAY:
            raise self.fail(f"metadata {key} has value type {kind}, which gguf does not define")
        item, count = self.take("IQ", f"the array {key}")
        if count > MAX_ARRAY:
            raise self.fail(f"metadata {key} is an array of {count} items, more than {MAX_ARRAY}")
        if item in _SCALARS:
            size = struct.calcsize("<" + _SCALARS[item])
            if self.at + count * size > self.end:
                raise self.fail(f"metadata {key} is an array of {count} items, more than the file holds")
            values = list(struct.unpack_from(f"<{count}{_SCALARS[item]}", self.data, self.at))
            self.at += count * size
            return values
        if item == _STRING:
            if count > MAX_STRINGS:
                raise self.fail(f"metadata {key} is an array of {count} strings, more than {MAX_STRINGS}")
            start = self.at
            self.at = self.walk_strings(count, key)
            return Strings(count, start)
        if item == _ARRAY and depth == 0:
            return [self.value(_ARRAY, key, 1) for _ in range(count)]
        raise self.fail(f"metadata {key} is an array of value type {item}, which this reader does not take")

    def walk_strings(self, count: int, key: str) -> int:
        """Where ``count`` strings from here end, each length checked (read when asked for): the
        loop of a vocabulary's 300,000 strings, its steps kept few."""
        data, end, at, unpack = self.data, self.end, self.at, _LENGTH.unpack_from
        for _ in range(count):
            if at + 8 > end:
                self.at = at
                raise self.fail(f"the file ends inside a string of the array {key}: truncated")
            length = unpack(data, at)[0]
            at += 8
            if length > MAX_STRING or at + length > end:
                self.at = at
                raise self.too_long(f"a string of the array {key}", length, MAX_STRING)
            at += length
        return at

    def read(self) -> GgufFile:
        magic = bytes(self.data[:4])
        if magic != MAGIC:
            raise self.fail(f"not a gguf file (it starts with {magic!r}, not {MAGIC!r})")
        self.at = 4
        version = self.take("I", "the version")
        if version not in VERSIONS:
            raise self.fail(f"gguf version {version}; this reader takes versions {' and '.join(map(str, VERSIONS))}")
        tensor_count, key_count = self.take("QQ", "the counts")
        if key_count > MAX_KEYS:
            raise self.fail(f"the header says {key_count} metadata entries, more than {MAX_KEYS}")
        if tensor_count > MAX_TENSORS:
            raise self.fail(f"the header says {tensor_count} tensors, more than {MAX_TENSORS}")
        metadata: dict[str, Value] = {}
        for _ in range(key_count):
            key = self.text("a metadata key")
            if key in metadata:
                raise self.fail(f"metadata {key} appears twice")
            metadata[key] = self.value(self.take("I", f"the type of {key}"), key)
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment is {alignment!r}, not a power of two")
        table = [self.tensor_entry() for _ in range(tensor_count)]
        start = -(-self.at // alignment) * alignment
        tensors = self.placed(table, start, alignment)
        return GgufFile(self.path, self.data, version, metadata, tensors)

    def tensor_entry(self) -> tuple[str, int, tuple[int, ...], int]:
        name = self.text("a tensor name")
        dims = self.take("I", f"the dimensions of {name}")
        if not 1 <= dims <= MAX_DIMS:
            raise self.fail(f"tensor {name} has {dims} dimensions (1 to {MAX_DIMS} are gguf's)")
        shape = tuple(self.take("Q" * dims, f"the shape of {name}") if dims > 1 else (self.take("Q", f"the shape of {name}"),))
        kind, offset = self.take("IQ", f"the type and place of {name}")
        return name, kind, shape, offset

    def placed(self, table: list[tuple[str, int, tuple[int, ...], int]], start: int, alignment: int) -> dict[str, TensorInfo]:
        """The tensors with their absolute places, each checked: a known type, whole blocks, its
        data aligned, inside the file, and overlapping no other's."""
        tensors: dict[str, TensorInfo] = {}
        for name, kind, shape, offset in table:
            if name in tensors:
                raise self.fail(f"tensor {name} appears twice")
            layout = TYPES.get(kind)
            if layout is None:
                raise self.fail(f"tensor {name} has ggml type {kind}, which gguf does not define")
            if any(extent == 0 or extent > 1 << 40 for extent in shape):
                raise self.fail(f"tensor {name} has the shape {list(shape)}")
            if shape[0] % layout.weights:
                raise self.fail(f"tensor {name}: rows of {shape[0]} numbers are not whole {type_name(kind)} blocks of {layout.weights}")
            size = row_bytes(kind, shape[0])
            for extent in shape[1:]:
                size *= extent
            if offset % alignment or start + offset + size > self.end:
                raise self.fail(
                    f"tensor {name}'s data ({size} bytes at {offset} past the header) is "
                    + ("not aligned" if offset % alignment else "past the end of the file: truncated")
                )
            tensors[name] = TensorInfo(name, kind, shape, start + offset, size)
        ordered = sorted(tensors.values(), key=lambda t: t.offset)
        for before, after in zip(ordered, ordered[1:]):
            if before.offset + before.size > after.offset:
                raise GgufError(f"{self.path}: tensors {before.name} and {after.name} overlap")
        return tensors
