"""llguidance's side of constrained output: a model's vocabulary, and one request's grammar
advanced token by token. A backend sees only these (worker/backends/base.py); which grammar a
request asks for is worker/constraints.py's."""

from __future__ import annotations

import threading
from typing import Any

from protocol.errors import ErrorKind, RpcError
from worker.tokenizer import Tokenizer


class GrammarTokenizer:
    """A model's vocabulary as llguidance sees it; made once per model, on first use (about half
    a second for a 49,152-token vocabulary). The tokenizer is worker.tokenizer's (made from its
    tokenizer.json, without transformers) or a transformers fast tokenizer."""

    def __init__(self, tokenizer: Tokenizer | Any, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        self._made: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        with self._lock:
            if self._made is None:
                self._made = self._make()
            return self._made

    def _make(self) -> Any:
        if isinstance(self._tokenizer, Tokenizer):
            from llguidance import LLTokenizer

            return LLTokenizer(self._tokenizer.serialized(), eos_token=self._eos)
        import llguidance.hf

        return llguidance.hf.from_tokenizer(self._tokenizer, eos_token=self._eos)


class GrammarError(Exception):
    """What a grammar cannot do, in one short line."""


def short(problem: str) -> str:
    """llguidance's errors can carry the whole grammar (megabytes): the first line, cut short."""
    line = problem.strip().split("\n", 1)[0]
    return line if len(line) <= 300 else line[:300] + "…"


class OutputConstraint:
    """One request's grammar, advanced token by token (only the model thread touches it)."""

    def __init__(self, tokenizer: Any, grammar: str, field: str) -> None:
        """Raises GrammarError for a grammar llguidance refuses, or one that fails at once."""
        from llguidance import LLMatcher

        problem = LLMatcher.validate_grammar(grammar, tokenizer)
        if problem:
            raise GrammarError(short(problem))
        self._matcher = LLMatcher(tokenizer, grammar)
        self._vocab = tokenizer.vocab_size
        self._field = field
        self._taken = 0
        self._matcher.compute_bitmask()  # the first mask: where most such grammars fail
        if self._matcher.is_error():
            raise GrammarError(short(self._matcher.get_error()))

    def allowed(self, vocab_size: int) -> Any:
        """A boolean numpy array of ``vocab_size``: True for the tokens that may come next."""
        import numpy as np

        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        self._check()
        allowed = np.zeros(vocab_size, dtype=bool)
        n = min(vocab_size, self._vocab, bits.size)
        allowed[:n] = bits[:n].astype(bool)
        return allowed

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)
        self._taken += 1
        self._check()

    def _check(self) -> None:
        """A grammar can also fail later, when its parser reaches a limit (a schema that can only
        recurse forever, a pattern too large, too many alternatives): the request fails then."""
        if self._matcher.is_error():
            raise RpcError(
                ErrorKind.INVALID_PARAMS,
                f"The output cannot be constrained to this: {short(self._matcher.get_error())} "
                f"(after {self._taken} tokens). Remove or rewrite that part.",
                field=self._field,
            )
