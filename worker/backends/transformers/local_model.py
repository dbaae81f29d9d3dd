"""A model computed in this process, apart from what computes it: its text (tokenize,
detokenize, the chat template), its caches and the loop that feeds prompts and chooses tokens.

Two kinds of model share it. ``backend.TransformersModel`` computes with PyTorch (transformers'
forward, decode_step's operations, or the native pass over a torch model), and
``native_model.NativeModel`` computes a mapped gguf with the native pass alone, never importing
torch or transformers. Each gives this module its passes and its cache objects; everything
here works on numpy logits, so neither is imported here.

A generation is a :class:`LocalDecoding`: its prompt fed into a cache in chunks, then tokens
chosen from the logits (worker/sampling.py), drafts checked in the same steps.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import msgspec

from protocol.errors import ErrorKind, RpcError
from protocol.methods import ChatMessage, GenerateParams, LoadParams, ModelInfo, SpecialToken, Tool
from worker import chat_template, prompt_lookup, reasoning, tool_calls
from worker.backends.base import PREFILL_CHUNK_TOKENS, Decoding
from worker.grammar import GrammarTokenizer

if TYPE_CHECKING:
    import numpy as np

    from worker.backends.transformers.torch_threads import CoreShare
    from worker.grammar import OutputConstraint
    from worker.kvcache.container import Header, Identity, TensorSpec
    from worker.kvcache.store import StorableCache

    class LocalCache(StorableCache, Protocol):
        """What the decoding loop needs of a model's cache object (one sequence's)."""

        length: int  # the positions it covers

        @property
        def has_states(self) -> bool:
            """Whether it keeps linear-attention states, which are cut back only to checkpoints."""
            ...

        def checkpoint(self) -> None: ...

        def reusable(self, tokens: int) -> int: ...

        def crop(self, keep: int) -> None: ...


C = TypeVar("C", bound="LocalCache")


class Passes(Protocol):
    """Passes that compute several sequences' positions at once (decode_step.Passes, and the
    native pass of native_model)."""

    def forward_highest(self, sequences: Sequence[Sequence[int]], caches: Sequence[Any], last: Sequence[int] | None = None
                        ) -> tuple[Any, list[int] | None]:
        """The logits of each sequence's ``last`` rows (one each if None), fed after what its
        cache holds, and the index of each row's highest where the pass found it."""
        ...


# The largest context length and token id the protocol carries (a JSON integer every host reads).
MAX_INT32 = (1 << 31) - 1


class LocalModel(Generic[C]):
    """What a model computed in this process does beyond its passes. A subclass gives
    ``new_cache``, ``load_cache`` and ``cache_room`` (its cache objects), and where it has no
    batched ``passes``, ``_feed`` and ``_step_each``."""

    _model_type: str  # the architecture, for the reasons it refuses a draft

    def __init__(
        self, params: LoadParams, path: Path, tokenizer: Any, identity: Identity, *, device: str, dtype: str,
        quantization: str, started: float, vocab_size: int, eos_token_ids: frozenset[int], context_length: int,
        passes: Passes | None, chunk_passes: Passes | None, cores: CoreShare | None, backend: str = "transformers",
    ) -> None:
        """``passes``: batched passes, None where each sequence is fed alone; ``chunk_passes``:
        the passes a prompt chunk fed alone goes through (None: ``_feed``); ``cores``: the model
        thread's share of the cores, where the thread count changes no number."""
        self._passes = passes
        self._chunk_passes = chunk_passes
        # A step computes its sequences in one pass, a prompt chunk with them.
        self.chunks_in_step = passes is not None
        self._cores = cores
        self._tokenizer = tokenizer
        self._device = device
        # Fast tokenizers may raise "Already borrowed" when shared between threads.
        self._lock = threading.Lock()
        self._vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._bos = tokenizer.bos_token_id
        self._adds_bos = self._bos is not None and tokenizer("a").input_ids[:1] == [self._bos]
        self._identity = identity
        template = getattr(tokenizer, "chat_template", None)
        self.info = ModelInfo(
            model=params.model,
            backend=backend,
            path=str(path),
            vocab_size=vocab_size,
            context_length=context_length,
            special_tokens=special_tokens(tokenizer, eos_token_ids),
            has_chat_template=bool(template),
            device=device,
            dtype=dtype,
            quantization=quantization,
            tool_calls=tool_calls.support(template),
            load_time_ms=(time.perf_counter() - started) * 1000.0,
        )
        self.grammar_tokenizer: GrammarTokenizer | None = GrammarTokenizer(tokenizer, eos_token_ids)
        self.reasoning_markers = reasoning.markers(template)
        # What transformers' apply_chat_template passes a template beside the messages: bos_token and the like.
        self._template_variables = msgspec.to_builtins(dict(tokenizer.special_tokens_map))
        self._cache_tensors = self._one_position_cache()

    @property
    def device(self) -> str:
        return self._device

    # --- what a subclass computes ---------------------------------------------------------

    def new_cache(self) -> C:
        raise NotImplementedError

    def _feed(self, cache: C, tokens: list[int]) -> np.ndarray:
        """The logits of the last of ``tokens``, fed after what ``cache`` holds, by a model without ``chunk_passes``."""
        raise NotImplementedError

    def _step_each(self, decodings: Sequence[LocalDecoding[C]]) -> None:
        """Feed each decoding's last token on its own, for a model without batched passes."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def computing(self) -> contextlib.AbstractContextManager[Any]:
        """What a pass runs in (PyTorch's inference mode, for a model of torch's)."""
        return contextlib.nullcontext()

    def _numpy(self, logits: Any) -> np.ndarray:
        """A pass's logits as a float32 numpy array (they are, for the native pass)."""
        return logits

    # --- text ---------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]:
        with self._lock:
            ids = list(self._tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        return self._one_bos(ids)

    def detokenize(self, tokens: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        with self._lock:
            # No clean-up of spaces: it rewrites earlier text when a later token arrives.
            return self._tokenizer.decode(
                list(tokens), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Tool],
        add_generation_prompt: bool,
    ) -> tuple[str, list[int]]:
        if not self.info.has_chat_template:
            raise RpcError(
                ErrorKind.UNSUPPORTED,
                f"The model {self.info.model!r} has no chat template, so 'messages' cannot be rendered; "
                "send 'prompt' text or 'tokens' instead.",
                field="params.messages",
            )
        conversation = chat_template.as_template_data([tool_calls.template_dict(m) for m in messages])
        described = [msgspec.to_builtins(tool) for tool in tools] or None
        # Rendered in a process of its own, bounded (worker/chat_template.py), as transformers'
        # apply_chat_template renders it; the tokenizer's lock is taken only to tokenize.
        text = chat_template.render(
            self._tokenizer.get_chat_template(None, described), conversation, described,
            add_generation_prompt=add_generation_prompt, variables=self._template_variables,
            context_length=self.info.context_length,
        )
        with self._lock:
            ids = list(self._tokenizer(text, add_special_tokens=False).input_ids)
        if self._adds_bos and ids[:1] != [self._bos]:
            ids.insert(0, self._bos)
        return text, ids

    def _one_bos(self, ids: list[int]) -> list[int]:
        """BOS exactly once, also when the text itself starts with the BOS text."""
        if self._adds_bos and ids[:2] == [self._bos, self._bos]:
            del ids[0]
        return ids

    # --- caches ---------------------------------------------------------------------------

    def cache_identity(self) -> Identity:
        return self._identity

    def extend_cache(self, tokens: Sequence[int], cache: C) -> None:
        decoding = self.start(tokens, None, cache)
        while decoding.prompt_left:
            decoding.feed(PREFILL_CHUNK_TOKENS)

    def cached_tokens(self, cache: C) -> int:
        return cache.length

    def reusable_tokens(self, cache: C, tokens: int) -> int:
        return cache.reusable(tokens)

    def crop_cache(self, cache: C, keep_tokens: int) -> None:
        cache.crop(keep_tokens)

    def _one_position_cache(self) -> list[TensorSpec] | None:
        """The tensors of a cache of one position: a stored cache's must be of their shapes and dtypes."""
        from worker.kvcache.container import UnsupportedCache

        cache = self.new_cache()
        self.extend_cache([self._bos or 0], cache)
        try:
            return [spec for spec, _ in cache.to_file()[2]]
        except UnsupportedCache:  # no cache of this model is ever stored, so none is read
            return None

    def cache_problem(self, header: Header) -> str | None:
        from worker.kvcache.container import layout_problem

        return layout_problem(header, self._cache_tensors, self.info.context_length)

    # --- generation -------------------------------------------------------------------

    def forward_chunk(self, cache: C, tokens: list[int]) -> np.ndarray:
        """The logits of the last of ``tokens``, fed after what ``cache`` holds, which then holds them too."""
        if self._cores is not None:
            self._cores.adjust()
        if self._chunk_passes is not None:
            return self._numpy(self._chunk_passes.forward_highest([tokens], [cache])[0])
        return self._feed(cache, tokens)

    def start(
        self,
        prompt: Sequence[int],
        params: GenerateParams | None,
        cache: C | None = None,
        constraint: OutputConstraint | None = None,
    ) -> LocalDecoding[C]:
        return LocalDecoding(self, prompt, params, cache if cache is not None else self.new_cache(), constraint)

    def drafting(self) -> str | None:
        if self._passes is None:
            return (
                f"'draft' needs a model of the Llama or Gemma 3 architecture (this one is {self._model_type!r}): "
                "its decode step checks a draft in one pass. Leave out 'draft'."
            )
        if self.info.quantization == "none":
            return (
                "'draft' needs quantized weights (load with quantization 'auto' or 'int8' on the CPU): with them a "
                "position's numbers are the same however many positions a pass computes, so a checked draft gives "
                "exactly the output of plain decoding; with dense weights they may differ in the last bits. "
                "Leave out 'draft', or load quantized weights."
            )
        return None

    def step(self, decodings: Sequence[Decoding], chunks: Sequence[tuple[Decoding, int]] = ()) -> None:
        # The worker steps only decodings this model started.
        mine: Sequence[LocalDecoding[C]] = decodings  # pyright: ignore[reportAssignmentType]
        fed_chunks: Sequence[tuple[LocalDecoding[C], int]] = chunks  # pyright: ignore[reportAssignmentType]
        if self._cores is not None:
            self._cores.adjust()
        with self.computing():
            if self._passes is None:
                assert not fed_chunks, "this model feeds prompt chunks on their own"
                self._step_each(mine)
                return
            drafts = [d.propose() for d in mine]
            sequences = [d.tokens[-1:] + draft for d, draft in zip(mine, drafts)]
            outputs = [1 + len(draft) for draft in drafts]
            fed = [*mine, *(decoding for decoding, _ in fed_chunks)]
            sequences += [decoding.next_chunk(tokens) for decoding, tokens in fed_chunks]
            outputs += [1] * len(fed_chunks)
            logits, highest = self._passes.forward_highest(sequences, [d.cache for d in fed], outputs)
            logits = self._numpy(logits)
            first = 0
            for decoding, rows in zip(fed, outputs):
                decoding.logits = logits[first : first + rows]
                decoding.highest = None if highest is None else highest[first : first + rows]
                first += rows


class LocalDecoding(Generic[C]):
    """A prompt fed into a cache in chunks, then tokens chosen from the logits.

    With ``params.draft``, each step also feeds the tokens prompt lookup drafts after the
    last one, and its logits have a row for each position: a token chosen from a row that
    equals the draft's token there lets the next row be chosen from too (the cache already
    holds that token); at the first that differs, the cache is cut back to the tokens chosen."""

    def __init__(
        self,
        owner: LocalModel[C],
        prompt: Sequence[int],
        params: GenerateParams | None,
        cache: C,
        constraint: OutputConstraint | None,
    ):
        from worker.sampling import Sampler

        self.cache = cache
        self.tokens = list(prompt)  # the prompt and the tokens chosen so far
        self._logits: np.ndarray | None = None  # of the positions fed last: one row, or one per drafted token and one
        self.highest: list[int] | None = None  # the index of each row's highest, where the pass found it
        self._row = 0  # the row the next token is chosen from
        self._draft: list[int] = []  # the tokens drafted after tokens[-1] in the last step
        self._lookup = params.draft if params is not None else None
        self._draft_length = self._lookup.draft_tokens if self._lookup is not None else 0
        self._max_length = len(self.tokens) + (params.max_tokens if params is not None else 0)
        self.drafted_tokens = self.accepted_tokens = 0
        self._owner = owner
        self._prompt_length = len(self.tokens)
        self._sampler = Sampler(params) if params is not None else None
        self._constraint = constraint

    @property
    def prompt_left(self) -> int:
        return max(0, self._prompt_length - self.cache.length)

    @property
    def logits(self) -> np.ndarray | None:
        return self._logits

    @logits.setter
    def logits(self, logits: np.ndarray) -> None:
        self._logits, self._row, self.highest = logits, 0, None

    def propose(self) -> list[int]:
        """The tokens to feed after the last one in this step: a draft that does not reach past
        max_tokens (none without ``params.draft``).

        Each drafted token makes the step dearer, taken or not: after a draft taken
        whole the next may be twice as long (up to ``draft_tokens``); after one taken in part,
        one token longer than the part taken."""
        self._draft = []
        if self._lookup is not None:
            room = self._max_length - len(self.tokens) - 1  # the step chooses one token past the draft
            self._draft = prompt_lookup.draft(
                self.tokens, draft_tokens=min(self._draft_length, room),
                ngram_max=self._lookup.ngram_max, ngram_min=self._lookup.ngram_min,
            )
            self.drafted_tokens += len(self._draft)
        return self._draft

    def has_next(self) -> bool:
        return self._logits is not None and self._row < self._logits.shape[0]

    def _adapt_draft_length(self, *, taken: int) -> None:
        """After a draft: twice as long if it was taken whole, else one longer than the part taken."""
        assert self._lookup is not None
        longer = max(self._draft_length, 2 * taken) if taken == len(self._draft) else taken + 1
        self._draft_length = min(self._lookup.draft_tokens, longer)

    def next_chunk(self, chunk_tokens: int) -> list[int]:
        """The next at most ``chunk_tokens`` prompt tokens, for a step that feeds them beside
        decoding sequences (models without linear-attention states only: no cut to keep)."""
        assert not self.cache.has_states
        start = self.cache.length
        return self.tokens[start : min(self._prompt_length, start + max(1, chunk_tokens))]

    def feed(self, chunk_tokens: int) -> None:
        """A cache with linear-attention states keeps them at the last two positions of the
        prompt (a later request can then reuse the whole sequence, or all of it but the last
        token, which a prompt equal to this one feeds again): a chunk that holds the last
        token is fed in two parts."""
        start, end = self.cache.length, self._prompt_length
        stop = min(end, start + max(1, chunk_tokens))
        cuts = [end - 1, stop] if self.cache.has_states and start < end - 1 < stop else [stop]
        with self._owner.computing():
            for cut in cuts:
                self.logits = self._owner.forward_chunk(self.cache, self.tokens[self.cache.length : cut])
                if cut >= end - 1:
                    self.cache.checkpoint()

    def next_token(self) -> int:
        assert self._sampler is not None and self._logits is not None, "a prefill chooses no tokens"
        import numpy as np

        logits = self._logits[self._row]
        highest = self.highest[self._row] if self.highest is not None else None
        if self._constraint is not None:
            logits, highest = np.where(self._constraint.allowed(logits.size), logits, np.float32(-np.inf)), None
        token = self._sampler.next_token(self.tokens, logits, highest)
        if self._constraint is not None:
            self._constraint.accept(token)
        self.tokens.append(token)
        if self._row < len(self._draft) and token == self._draft[self._row]:
            self._row += 1
            self.accepted_tokens += 1
        else:  # the rest of the draft is not the output: its positions leave the cache
            if self._draft:
                self._adapt_draft_length(taken=self._row)
            self._row = self._logits.shape[0]
            if self.cache.length >= len(self.tokens):
                self.cache.crop(len(self.tokens) - 1)
        return token


def eos_ids(sources: Sequence[tuple[Any, str]], path: Path, vocab_size: int) -> set[int]:
    """Every EOS id the ``sources`` name (objects with ``eos_token_id``, each with the name of
    the file it comes from); one that is not a token of the vocabulary (2^40, -5, "3") is a load
    error naming the file and the value: the tokenizer cannot convert it, so every request
    failed with -32603."""
    ids: set[int] = set()
    for source, name in sources:
        value = getattr(source, "eos_token_id", None)
        for token in value if isinstance(value, (list, tuple)) else [] if value is None else [value]:
            if type(token) is not int or not 0 <= token < vocab_size:
                where = name if path.is_dir() or name == "the tokenizer" else f"the metadata of {path.name}"
                raise RpcError(
                    ErrorKind.MODEL_LOAD_FAILED,
                    f"{where} names the EOS token {token!r}, which is no token of this model (its ids are 0 to "
                    f"{vocab_size - 1}); fix eos_token_id there.",
                    field="params.model",
                )
            ids.add(token)
    return ids


def context_length(value: Any, tokenizer: Any, path: Path) -> int:
    """``max_position_embeddings`` (``value``), which must be 1 to 2^31-1 tokens (a load error
    naming the file and value otherwise: -1 was reported as the context); without it, the
    tokenizer's ``model_max_length``, at most 2^31-1 (transformers' 10^30 says there is no limit)."""
    if value is None:
        return max(1, min(int(tokenizer.model_max_length), MAX_INT32))
    if type(value) is not int or not 1 <= value <= MAX_INT32:
        where = "config.json" if path.is_dir() else f"the metadata of {path.name}"
        raise RpcError(
            ErrorKind.MODEL_LOAD_FAILED,
            f"{where} gives the context length (max_position_embeddings) as {value!r}; it must be 1 to "
            f"{MAX_INT32} tokens. Fix it there.",
            field="params.model",
        )
    return value


def special_tokens(tokenizer: Any, eos_ids: frozenset[int]) -> list[SpecialToken]:
    tokens = []
    for role in ("bos", "pad", "unk"):
        token_id = getattr(tokenizer, f"{role}_token_id", None)
        if token_id is not None:
            tokens.append(SpecialToken(role=role, id=token_id, text=tokenizer.convert_ids_to_tokens(token_id)))
    tokens += [
        SpecialToken(role="eos", id=token_id, text=tokenizer.convert_ids_to_tokens(token_id))
        for token_id in sorted(eos_ids)
    ]
    return tokens
