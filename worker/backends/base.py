"""The typed boundary between the worker and a backend.

A backend is registered by name and turns ``load`` params into a
:class:`Model`. The worker does everything else (prompt resolution, streaming,
incremental detokenization, stop strings, counts, the scheduling of concurrent
requests) on top of these few calls, so a new backend only has to tokenize and
produce token ids.

A generation is a :class:`Decoding`: the worker's scheduler feeds its prompt in
chunks of the size it chooses, then advances it one token per ``Model.step``,
together with the other requests decoding at the same time. A backend that can
compute several sequences in one pass does so in ``step``; one that cannot steps
them one after another, and the requests still take turns, step by step.

What a backend may do beyond that is a capability of its own, a ``runtime_checkable``
Protocol the worker tests with ``isinstance``: :class:`CachingModel` (KV caches the
worker stores and reuses), :class:`DraftingModel` (``draft``), :class:`EngineModel`
(another program computes the model), :class:`SideThreadModel`, :class:`CheckingBackend`
and :class:`LocalModelBackend` (``model`` names files on this machine).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar, runtime_checkable

import msgspec

from protocol.errors import RpcError
from protocol.methods import ChatMessage, GenerateParams, LoadParams, ModelInfo, Tool, ToolCall
from worker.grammar import GrammarTokenizer, OutputConstraint

# The scheduler feeds a prompt in chunks of at most this many tokens, so that a cancel is
# seen within one chunk.
PREFILL_CHUNK_TOKENS = 256

if TYPE_CHECKING:  # the container is imported only where caches are used
    from worker.kvcache.container import Header, Identity, LoadedCache, TensorEntry
    from worker.kvcache.store import StorableCache

# A caching model's own cache type: what its cache methods take and its decodings extend.
CacheT = TypeVar("CacheT", bound="StorableCache")
CacheT_co = TypeVar("CacheT_co", bound="StorableCache", covariant=True)


class Model(Protocol):
    """A loaded model. Only the model lane's thread starts, feeds and steps decodings;
    ``tokenize``, ``detokenize`` and ``render`` may be called from the reader and text lanes
    at the same time and must be safe for that."""

    info: ModelInfo
    eos_token_ids: frozenset[int]
    chunks_in_step: bool  # whether ``step`` can feed prompt chunks in the same pass
    # The vocabulary for grammars that constrain output; None: this model's output cannot be
    # constrained (and ``start`` is never given a constraint).
    grammar_tokenizer: GrammarTokenizer | None

    def tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def detokenize(self, tokens: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Raises ``ValueError`` naming the first id outside the vocabulary."""
        ...

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Tool],
        add_generation_prompt: bool,
    ) -> tuple[str, list[int]]:
        """The chat template applied: prompt text and its tokens (BOS exactly once). ``tools`` is
        empty unless ``info.tool_calls.template_takes_tools``. Raises ``RpcError`` (unsupported)
        when the model has no chat template."""
        ...

    def start(
        self, prompt: Sequence[int], params: GenerateParams | None, *, constraint: OutputConstraint | None = None
    ) -> Decoding:
        """A generation of ``params`` continuing ``prompt``; nothing is computed yet. ``constraint``:
        the tokens each choice may take (only for a model with a ``grammar_tokenizer``)."""
        ...

    def step(self, decodings: Sequence[Decoding], chunks: Sequence[tuple[Decoding, int]] = ()) -> None:
        """Feed each decoding's last token (all of them have taken one with ``next_token``).
        A model whose ``chunks_in_step`` is true may also be given ``chunks``: decodings whose
        prompts are being fed, each with a number of tokens, fed in the same pass as by ``feed``
        (``decodings`` may then be empty: prompts fed together)."""
        ...

    def close(self) -> None: ...


class Decoding(Protocol):
    """One sequence on its way through the model (only the model lane's thread touches it)."""

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not fed yet."""
        ...

    def feed(self, chunk_tokens: int) -> None:
        """Feed the next at most ``chunk_tokens`` (at least one) prompt tokens. A backend may
        feed fewer, to stop at a position where its cache can be cut back later."""
        ...

    def next_token(self) -> int:
        """Choose the next token, once the whole prompt is fed and after each step."""
        ...


@runtime_checkable
class DraftingModel(Model, Protocol):
    """A model whose generations can draft tokens and check them in a step (``params.draft``).
    Optional: the worker refuses ``draft`` for a model that is not one."""

    def drafting(self) -> str | None:
        """None when a generation may draft tokens; else why it may not."""
        ...

    def start(
        self, prompt: Sequence[int], params: GenerateParams | None, *, constraint: OutputConstraint | None = None
    ) -> DraftingDecoding: ...


@runtime_checkable
class DraftingDecoding(Decoding, Protocol):
    """A decoding of a ``DraftingModel`` whose params have a ``draft``: ``next_token`` may be
    called again while ``has_next``."""

    drafted_tokens: int  # drafted tokens checked so far
    accepted_tokens: int  # of those, the ones chosen

    def has_next(self) -> bool:
        """Whether another token can be chosen before the next step: a step that checked
        drafted tokens gives one more for each one the previous choice took."""
        ...


class Markers(NamedTuple):
    """What a reasoning model's thinking goes between, as its chat template declares them."""

    start: str
    end: str


@runtime_checkable
class ReasoningModel(Model, Protocol):
    """A model whose chat template declares the markers its thinking goes between. Optional:
    the worker splits a generation's text into ``content`` and ``reasoning`` for a model with
    ``reasoning_markers`` that are not None (worker/reasoning.py)."""

    reasoning_markers: Markers | None


@runtime_checkable
class CachingModel(Model, Protocol[CacheT]):
    """A model whose KV cache lm-worker can store and reuse; its caches are ``CacheT``s, which
    the cache store can write (StorableCache). Optional: a model that is not one refuses
    ``cache`` refs and prefill, and auto reuses nothing with it."""

    def cache_identity(self) -> Identity:
        """Everything a stored cache must match to be valid for this model."""
        ...

    def new_cache(self) -> CacheT: ...

    def extend_cache(self, tokens: Sequence[int], cache: CacheT) -> None:
        """Compute ``tokens`` past what ``cache`` covers, in place, all at once."""
        ...

    def cached_tokens(self, cache: CacheT) -> int:
        """How many positions ``cache`` covers."""
        ...

    def reusable_tokens(self, cache: CacheT, tokens: int) -> int:
        """The longest prefix, of at most ``tokens`` positions, that ``cache`` can be cut back to
        (a cache of recurrent state can be cut back only to the positions it kept it at)."""
        ...

    def crop_cache(self, cache: CacheT, keep_tokens: int) -> None:
        """Keep the first ``keep_tokens`` positions: a length that ``reusable_tokens`` gave."""
        ...

    def cache_room(self, entry: TensorEntry, max_positions: int, /) -> int:
        """Positions of room to grow to leave after a stored key or value tensor's positions
        when its file is read (container.load), for a request whose cache will hold at most
        ``max_positions``: a restored cache is always fed further."""
        ...

    def cache_problem(self, header: Header) -> str | None:
        """What makes a sound cache header of this model's identity other than what the model
        computes (container.layout_problem), or None; asked before its tensors are read."""
        ...

    def load_cache(self, loaded: LoadedCache) -> CacheT:
        """A cache object of a verified KVC2 file read into memory (with the room that
        ``cache_room`` asked for)."""
        ...

    def start(
        self, prompt: Sequence[int], params: GenerateParams | None, cache: CacheT | None = None, *,
        constraint: OutputConstraint | None = None,
    ) -> CachingDecoding[CacheT]:
        """As Model.start; ``cache`` (a fresh one if None) covers a prefix of ``prompt`` shorter
        than the whole of it, and the decoding extends it in place (``decoding.cache``).
        ``params`` None: a prefill, which only feeds the prompt."""
        ...


class CachingDecoding(Decoding, Protocol[CacheT_co]):
    """A decoding of a ``CachingModel``: the cache it extends."""

    @property
    def cache(self) -> CacheT_co: ...


class Piece(msgspec.Struct, frozen=True):
    """Tokens with their text, as a generation takes them: a token a local model chose, or what
    an engine's stream received at once."""

    tokens: list[int]  # empty where the engine does not return token ids
    text: str
    calls: list[ToolCall] = []  # tool calls the engine's parser completed with it
    counted: int = 1  # tokens this piece counts for: len(tokens), or 1 where ids are not returned
    eos: bool = False  # a local model's end-of-sequence token (an engine's end is its StreamEnd)


class StreamEnd(msgspec.Struct, frozen=True):
    """How an engine's stream ended."""

    reason: str  # the engine's finish_reason ("stop", "length", "tool_calls", ...) or "error"
    stop: str | None = None  # the engine's stop string, where one ended it
    error: BaseException | None = None  # for "error": what broke the request (an RpcError, or a bug's exception)


class StreamedDecoding(Decoding, Protocol):
    """A request running on an engine (another program computes it): its prompt is never fed
    (``prompt_left`` is 0, ``feed`` and ``next_token`` are never called), and what it produces
    arrives as pieces, any number per step."""

    prompt_tokens: int  # as the engine counted them, once its stream has said
    cached_tokens: int | None  # prompt tokens the engine's prefix cache supplied; None until said
    exact: bool  # whether every delta so far came with its token ids
    end: StreamEnd | None  # set once the stream has ended; pieces may still be queued

    def has_next(self) -> bool: ...

    def next_piece(self) -> Piece: ...

    def close(self) -> None:
        """Stop the request on the engine (closes its connection); idempotent, any thread."""
        ...


@runtime_checkable
class EngineModel(Model, Protocol):
    """A model another program serves (the openai backend): it takes a generate request whole,
    its prompt as given, and the engine resolves the prompt, samples, and keeps its own cache.
    ``Model.step`` waits until some of the decodings has received something, or ``wake``."""

    def submit(self, params: GenerateParams, *, add_generation_prompt: bool = True) -> StreamedDecoding:
        """Send the request (at once, without waiting for the engine's answer); a refusal or a
        fault ends the decoding's stream with its ``RpcError`` (``StreamEnd.error``).
        ``add_generation_prompt`` False: ``messages`` end without the assistant's turn begun (a prefill)."""
        ...

    def wake(self) -> None:
        """Make a ``step`` that waits return now: the model lane has something else to look at
        (a new request, a cancel, an ack). Any thread."""
        ...


@runtime_checkable
class SideThreadModel(Protocol):
    """A model whose work on the worker's threads other than the model thread (making and
    finishing tasks on the cache I/O thread) needs that thread prepared first. Optional."""

    def prepare_side_thread(self) -> None:
        """Called on such a thread before each piece of the model's work there; cheap."""
        ...


class Backend(Protocol):
    name: str
    description: str

    def unavailable_reason(self) -> str | None:
        """None when the backend can load models here; else why not and how to fix it.
        Must be cheap: capabilities calls it, before any heavy import."""
        ...

    def load(self, params: LoadParams, *, data_dir: Path) -> Model:
        """Raises ``RpcError`` with a precise kind when the model cannot be loaded.
        ``data_dir`` is where the worker keeps converted models and other state."""
        ...


@runtime_checkable
class CheckingBackend(Backend, Protocol):
    """A backend that can tell cheaply that load params cannot work. Optional: a backend that
    is not one is not checked before the loaded model is unloaded."""

    def check(self, params: LoadParams, *, data_dir: Path) -> None:
        """Raises ``RpcError`` for load params that cannot work, found cheaply (a model path
        that does not exist, an unknown device). The worker calls it before it unloads the
        model it has, so that a typo leaves that model working."""
        ...


@runtime_checkable
class LocalModelBackend(Backend, Protocol):
    """A backend whose ``model`` names files on this machine. The worker resolves the references
    of models other tools keep (``ollama:NAME``, ``hf:ORG/NAME``, a gguf's name in the models
    directories: worker/model_refs.py) to a path before ``check`` and ``load`` see ``model``;
    anything else reaches the backend as the host wrote it."""

    def own_model_names(self) -> Collection[str]:
        """The names ``model`` takes that are no path (shipped models): never looked up as
        references, whatever the models directories hold. Cheap: no heavy import."""
        ...
