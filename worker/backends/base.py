"""The typed boundary between the worker and a backend.

A backend is registered by name and turns ``load`` params into a
:class:`Model`. The worker does everything else (prompt resolution, streaming,
incremental detokenization, stop strings, counts) on top of these few calls,
so a new backend only has to tokenize and produce token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from protocol.methods import ChatMessage, GenerateParams, LoadParams, ModelInfo
if TYPE_CHECKING:  # the container is imported only where caches are used
    from worker.kvcache.container import Identity, LoadedCache


class Model(Protocol):
    """A loaded model. Only the model thread calls ``generate``; ``tokenize``,
    ``detokenize`` and ``render`` may be called from the dispatcher at the same
    time and must be safe for that."""

    info: ModelInfo
    eos_token_ids: frozenset[int]

    def tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def detokenize(self, tokens: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Raises ``ValueError`` naming the first id outside the vocabulary."""
        ...

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> tuple[str, list[int]]:
        """The chat template applied: prompt text and its tokens (BOS exactly once).
        Raises ``RpcError`` (unsupported) when the model has no chat template."""
        ...

    def generate(
        self, prompt: Sequence[int], params: GenerateParams, should_stop: Callable[[], bool]
    ) -> Iterator[int]:
        """Yield generated token ids, one per decode step, until closed.

        ``should_stop`` turns true when the request is cancelled; a backend with
        a long prompt phase checks it between chunks of work and then returns."""
        ...

    def close(self) -> None: ...


class CachingModel(Model, Protocol):
    """A model whose KV cache lm-worker can store and reuse (``supports_cache = True``)."""

    supports_cache: bool

    def cache_identity(self) -> Identity:
        """Everything a stored cache must match to be valid for this model."""
        ...

    def new_cache(self) -> Any: ...

    def extend_cache(
        self,
        tokens: Sequence[int],
        cache: Any,
        should_stop: Callable[[], bool],
        progress: Callable[[int], None] | None = None,
    ) -> bool:
        """Compute ``tokens`` past what ``cache`` covers, in place; False if cancelled.
        ``progress`` is told how many tokens the cache covers after each chunk of work."""
        ...

    def cached_tokens(self, cache: Any) -> int:
        """How many positions ``cache`` covers."""
        ...

    def reusable_tokens(self, cache: Any, tokens: int) -> int:
        """The longest prefix, of at most ``tokens`` positions, that ``cache`` can be cut back to
        (a cache of recurrent state can be cut back only to the positions it kept it at)."""
        ...

    def crop_cache(self, cache: Any, keep_tokens: int) -> None:
        """Keep the first ``keep_tokens`` positions: a length that ``reusable_tokens`` gave."""
        ...

    def load_cache(self, loaded: LoadedCache) -> Any:
        """A cache object of a verified, mapped KVC1 file."""
        ...

    def generate(
        self, prompt: Sequence[int], params: GenerateParams, should_stop: Callable[[], bool], cache: Any = None
    ) -> Iterator[int]:
        """As Model.generate; ``cache`` covers a prefix of ``prompt`` shorter than the whole of it."""
        ...


class Backend(Protocol):
    name: str
    description: str

    def unavailable_reason(self) -> str | None:
        """None when the backend can load models here; else why not and how to fix it.
        Must be cheap: capabilities calls it, before any heavy import."""
        ...

    def check(self, params: LoadParams, *, data_dir: Path) -> None:
        """Raises ``RpcError`` for load params that cannot work, found cheaply (a model path
        that does not exist, an unknown device). The worker calls it before it unloads the
        model it has; a backend without this method is not checked first."""
        ...

    def load(self, params: LoadParams, *, data_dir: Path) -> Model:
        """Raises ``RpcError`` with a precise kind when the model cannot be loaded.
        ``data_dir`` is where the worker keeps converted models and other state."""
        ...
