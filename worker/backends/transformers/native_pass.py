"""native_forward.c's pass as both its callers make it, torch-free: the structs it reads, its
library (and the addresses of the attention and gguf kernels it calls), and one pass's call.

native_forward.NativeForward computes a torch model's passes (its weights in int8 rows or gguf
blocks, its cache cache_layers' torch layers); gguf_pass.GgufPass computes a mapped gguf's
without torch (its cache kv_buffers' numpy layers). Each describes its model as a ``Model``
(``Layer``s of ``Product``s: where the weights are and the kernel that multiplies them) and
hands ``Runner`` its embedding, its RoPE tables and its caches' layers; ``Runner`` gathers
where each sequence's layers keep their keys and values (``Places``, a step's kept while they
serve), calls lmw_forward once, and has the layers hold what it wrote.
"""

from __future__ import annotations

import array
import ctypes
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import numpy as np

from worker.c_build import address, built_function

if TYPE_CHECKING:
    from worker.c_build import CFunction

SOURCE = Path(__file__).with_name("native_forward.c")
ATTENTION_SOURCE = Path(__file__).with_name("exact_attention.c")
GGUF_SOURCE = Path(__file__).with_name("gguf_kernel.c")
INT8_SOURCE = Path(__file__).with_name("int8_kernel.c")
OWN, LLAMA_CPP = 0, 1  # native_forward.c's enum arithmetic
# What the cache identity calls this arithmetic, and llama.cpp's. Its RoPE tables are
# rope_tables' ("lm_worker_native" named those of PyTorch's rotary embedding).
FORWARD = "lm_worker_native_rope64"
FORWARD_LLAMA_CPP = "lm_worker_native_llama_cpp"
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # native_forward.c's enum activation
MOST_GROUPS = 64  # query heads per key/value head exact_attention.c takes (MOST_GROUPS there)

_I64, _PTR, _FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class Product(ctypes.Structure):
    _fields_ = [("function", _PTR), ("type", _I64), ("weights", _PTR), ("scale", _PTR), ("outputs", _I64), ("inputs", _I64)]


class Layer(ctypes.Structure):
    _fields_ = [
        ("norm_in", _PTR), ("norm_mid", _PTR), ("norm_q", _PTR), ("norm_k", _PTR), ("norm_attended", _PTR),
        ("norm_out", _PTR), ("qkv_bias", _PTR), ("window", _I64), ("rope", _I64), ("qkv", Product * 3), ("out", Product),
        ("gate_up", Product * 2), ("down", Product),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        ("layers", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("dim", _I64), ("intermediate", _I64),
        ("vocab", _I64), ("activation", _I64), ("epsilon", _FLOAT), ("scaling", _FLOAT), ("share_from", _I64), ("norm", _PTR),
        ("head", Product), ("layer", ctypes.POINTER(Layer)), ("attention", _PTR), ("step", _PTR), ("arithmetic", _I64),
    ]


class Pass(ctypes.Structure):
    _fields_ = [
        ("sequences", _I64), ("rows", _PTR), ("lengths", _PTR), ("kb", _PTR), ("vb", _PTR), ("kh", _PTR), ("vh", _PTR),
        ("tb", _PTR), ("th", _PTR), ("tc", _PTR), ("hidden", _PTR), ("cos", _PTR), ("sin", _PTR), ("wanted", _PTR),
        ("wanted_count", _I64), ("logits", _PTR), ("best", _PTR), ("threads", ctypes.c_int),
    ]


_forward: CFunction | None = None
_rope: CFunction | None = None
_highest: CFunction | None = None


def load_kernel(data_dir: Path) -> None:
    """Build (on first use) and load native_forward.c; raises c_build.KernelUnavailable."""
    global _forward, _rope, _highest
    if _forward is None:
        kernels = data_dir / "kernels"
        function = built_function(kernels, SOURCE, "lmw_forward")
        function.argtypes, function.restype = [ctypes.POINTER(Model), ctypes.POINTER(Pass)], ctypes.c_int
        rope = built_function(kernels, SOURCE, "lmw_llama_cpp_rope")
        rope.argtypes, rope.restype = [_I64, _I64, _I64, _FLOAT, _PTR, _PTR], ctypes.c_int
        highest = built_function(kernels, SOURCE, "lmw_highest")
        highest.argtypes, highest.restype = [_PTR, _I64, _I64, _PTR, ctypes.c_int], ctypes.c_int
        _forward, _rope, _highest = function, rope, highest


def loaded() -> bool:
    """Whether load_kernel has loaded the pass."""
    return _forward is not None


def kernel_addresses(data_dir: Path) -> tuple[int, int, int]:
    """Where exact_attention.c's lmw_attention and lmw_step_attention and gguf_kernel.c's
    lmw_gguf_matmul are (built on first use, as exact_attention and gguf_weights build them),
    for a pass made without torch; raises c_build.KernelUnavailable."""
    return (*attention_addresses(data_dir), address(built_function(data_dir / "kernels", GGUF_SOURCE, "lmw_gguf_matmul")))


def attention_addresses(data_dir: Path) -> tuple[int, int]:
    """Where exact_attention.c's lmw_attention and lmw_step_attention are (kernel_addresses)."""
    kernels = data_dir / "kernels"
    return (
        address(built_function(kernels, ATTENTION_SOURCE, "lmw_attention")),
        address(built_function(kernels, ATTENTION_SOURCE, "lmw_step_attention")),
    )


def int8_address(data_dir: Path) -> int:
    """Where int8_kernel.c's lmw_int8_matmul is (built on first use, as fast_weights builds it);
    raises c_build.KernelUnavailable."""
    return address(built_function(data_dir / "kernels", INT8_SOURCE, "lmw_int8_matmul"))


def takes_heads(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether exact attention takes query and key/value heads of these numbers and size."""
    return dim % 16 == 0 and heads % kv_heads == 0 and heads // kv_heads <= MOST_GROUPS


def highest(rows: np.ndarray, threads: int) -> list[int]:
    """The index of each row's highest number (a float32 matrix), as the pass finds it for
    greedy choices: the first of equal ones, the first NaN where there is one."""
    assert _highest is not None, "load_kernel() first"
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    best = array.array("q", bytes(8 * rows.shape[0]))
    if _highest(rows.ctypes.data, rows.shape[0], rows.shape[1], best.buffer_info()[0], threads) != 0:
        raise MemoryError("native forward: no memory to find the highest logits")
    return best.tolist()


def llama_cpp_rope(first: int, count: int, dim: int, base: float, cos: int, sin: int) -> None:
    """llama.cpp's (cos, signed sin) rows of positions ``first`` to ``first + count - 1``,
    written at the addresses ``cos`` and ``sin`` (float32, ``dim`` a row)."""
    assert _rope is not None, "load_kernel() first"
    _rope(first, count, dim, base, cos, sin)


class PassLayer(Protocol):
    """What a pass reads and writes of one layer of a sequence's cache."""

    @property
    def length(self) -> int:
        """The positions it holds."""
        ...

    @property
    def capacity(self) -> int:
        """The positions its buffers have room for."""
        ...

    def place(self, total: int, transposed: bool) -> tuple[int, ...]:
        """Room made for ``total`` positions: its Pass columns (kb, vb, kh, vh, and tb, th, tc
        where ``transposed``, a step's: zeros otherwise)."""
        ...

    def placed(self) -> tuple[object, object]:
        """What those columns stay valid with: its buffers and transposed keys."""
        ...

    def hold(self, total: int) -> None: ...

    def keep_first(self, keep: int) -> None: ...


class SequenceCache(Protocol):
    length: int  # the positions it covers


class Places:
    """What native_forward.c reads of one sequence's layers (its pass's columns kb, vb, kh, vh,
    and for a step tb, th, tc: a number for each layer), gathered with room made for ``total``
    positions. Gathered layer by layer at every step this cost more than a tenth of a
    four-sequence step; a step's are kept while the layers keep their buffers and transposed
    keys (``serves``), which they replace whenever they move or drop them."""

    COLUMNS = ("kb", "vb", "kh", "vh", "tb", "th", "tc")
    __slots__ = ("owner", "layers", "marks", "capacity", "columns")

    def __init__(self, owner: object, layers: Sequence[PassLayer], total: int, transposed: bool) -> None:
        self.owner = owner  # what holds the layers: places of another are not these
        self.layers = layers
        self.columns = tuple(array.array("q") for _ in self.COLUMNS)
        for layer in layers:
            for column, number in zip(self.columns, layer.place(total, transposed)):
                column.append(number)
        self.marks = [layer.placed() for layer in layers]
        self.capacity = min(layer.capacity for layer in layers)

    def serves(self, owner: object, total: int) -> bool:
        """Whether these are still the places of ``owner``'s layers, with room for ``total``."""
        return (
            self.owner is owner
            and total <= self.capacity
            and all(
                all(now is then for now, then in zip(layer.placed(), marks))
                for layer, marks in zip(self.layers, self.marks)
            )
        )


C = TypeVar("C", bound=SequenceCache)


class Runner(Generic[C]):
    """One model's passes through lmw_forward: the new tokens of several sequences, each after
    what its cache holds (a decode step's one, a prompt chunk's many, a draft's few).

    ``embed`` gives the rows of the tokens' embeddings (float32, contiguous: the call
    overwrites them) and what holds them; ``ropes`` the (cos, signed sin) rows of positions, of
    each kind of rotary embedding, (kinds, positions, dim) float32 each; ``owner_of`` what holds
    a cache's layers (places are kept while it does) and ``layers_of`` the layers.
    ``transposed_steps``: a step's sequences keep their keys transposed (not in llama.cpp's
    arithmetic, which attends a step's row as any other)."""

    def __init__(
        self, model: Model, kept: Sequence[object], *, embed: Callable[[list[int]], tuple[int, object]],
        ropes: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], owner_of: Callable[[C], object],
        layers_of: Callable[[C], Sequence[PassLayer]], transposed_steps: bool,
    ) -> None:
        assert _forward is not None, "load_kernel() first"
        self.model = model  # what the pass computes (a kept int8 model's note reads it: int8_store)
        self._kept = kept  # what the model's addresses point into that nothing else holds
        self._embed, self._ropes = embed, ropes
        self._owner_of, self._layers_of = owner_of, layers_of
        self._transposed_steps = transposed_steps
        self._steps: weakref.WeakKeyDictionary[C, Places] = weakref.WeakKeyDictionary()

    def _places_of(self, cache: C, total: int, step: bool) -> Places:
        """Where a pass finds the sequence's layers, with room for ``total`` positions; a step's
        (which keeps the keys transposed) are kept for the next one while they still serve, and
        dropped at any other pass (which may move the buffers: the old ones are not kept alive)."""
        if not step:
            self._steps.pop(cache, None)
            return Places(self._owner_of(cache), self._layers_of(cache), total, transposed=False)
        owner = self._owner_of(cache)
        places = self._steps.get(cache)
        if places is None or not places.serves(owner, total):
            places = self._steps[cache] = Places(owner, self._layers_of(cache), total, transposed=True)
        return places

    def forward_highest(
        self, sequences: Sequence[Sequence[int]], caches: Sequence[C], last: Sequence[int] | None, threads: int
    ) -> tuple[np.ndarray, list[int]]:
        """Logits of the last ``last[i]`` (default 1) new positions of each sequence, in order,
        (sum(last), vocab) float32, and the index of each row's highest, found by the threads
        that computed its parts, in their cores' caches: read by another thread, a row of a
        vocabulary's logits first has to come across from the other core's cache (bench/README.md,
        "Figures behind constants"). Each cache then covers its new tokens too."""
        rows = [len(sequence) for sequence in sequences]
        lengths = [cache.length for cache in caches]
        hidden, held_hidden = self._embed([token for sequence in sequences for token in sequence])
        positions = np.array([length + i for length, n in zip(lengths, rows) for i in range(n)], dtype=np.int64)
        cos, sin = self._ropes(positions)
        columns = [array.array("q") for _ in Places.COLUMNS]  # [b * layers + layer]
        held = []
        for cache, length, n in zip(caches, lengths, rows):
            places = self._places_of(cache, length + n, n == 1 and self._transposed_steps)
            for column, own in zip(columns, places.columns):
                column.extend(own)
            held.append((places.layers, length + n))
        ends, wanted = 0, array.array("q")
        for n, keep in zip(rows, [1] * len(rows) if last is None else last):
            ends += n
            wanted.extend(range(ends - keep, ends))
        logits = np.empty((len(wanted), self.model.vocab), np.float32)
        best = array.array("q", bytes(8 * len(wanted)))
        counts, starts = array.array("q", rows), array.array("q", lengths)
        call = Pass(
            len(rows), counts.buffer_info()[0], starts.buffer_info()[0], *(column.buffer_info()[0] for column in columns),
            hidden, cos.ctypes.data, sin.ctypes.data, wanted.buffer_info()[0], len(wanted), logits.ctypes.data,
            best.buffer_info()[0], threads,
        )
        assert _forward is not None
        status = _forward(ctypes.byref(self.model), ctypes.byref(call))
        del held_hidden  # the call is over
        if status != 0:
            for layers, _ in held:  # what the layers before the failure wrote past their positions is not theirs
                for layer in layers:
                    layer.keep_first(layer.length)
            raise MemoryError("native forward: no memory for a pass's scratch space")
        for layers, total in held:
            for layer in layers:
                layer.hold(total)
        for cache, n in zip(caches, rows):
            cache.length += n
        return logits, best.tolist()
