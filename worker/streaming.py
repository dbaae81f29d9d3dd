"""Turning a stream of token ids into a stream of text that never has to be taken back.

:class:`IncrementalDetokenizer` emits text only once it is stable: a token that
ends inside a multi-byte character (decoded as U+FFFD) is held back until a
later token completes it. :class:`StopMatcher` holds back text that could be
the start of a stop string, so a stop string is never streamed and retracted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Decoding restarts this many tokens before the new one, so that tokenizers
# that drop a leading space when decoding from a word start still get it right.
# It also covers an unfinished UTF-8 character (at most 3 bytes, so 3 tokens).
_CONTEXT_TOKENS = 4
# The decoded window slides forward once it holds this many tokens.
_WINDOW_TOKENS = 16
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a window of recent tokens per step and emits what is new.

    A lossy UTF-8 decode ends in exactly one U+FFFD while the last character is
    unfinished; only that one is held back. Earlier U+FFFDs are bytes that no
    later token can complete, so they are emitted at once.
    """

    def __init__(self, detokenize: Callable[[Sequence[int]], str], context: Sequence[int] = ()) -> None:
        self._detokenize = detokenize
        self._tokens = list(context[-_CONTEXT_TOKENS:])
        self._prefix = 0  # start of the window that is decoded each step
        self._emitted = len(detokenize(self._tokens))  # characters of the window's text already emitted

    def push(self, token: int) -> str:
        self._tokens.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is still held back (an unfinished character decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        text = self._detokenize(self._tokens[self._prefix :])
        stable = len(text) - 1 if text.endswith(_REPLACEMENT) and not final else len(text)
        new = text[self._emitted : stable]
        self._emitted = max(self._emitted, stable)
        if len(self._tokens) - self._prefix > _WINDOW_TOKENS:
            held = len(text) - self._emitted
            self._prefix = len(self._tokens) - _CONTEXT_TOKENS
            self._emitted = len(self._detokenize(self._tokens[self._prefix :])) - held
        return new


class StopMatcher:
    """Finds stop strings in text given piece by piece, holding back what could begin one.

    Each stop string is followed with Knuth-Morris-Pratt: its state is the longest prefix
    of it that the text so far ends with, updated in constant time per character (amortized)
    whatever came before. So a token costs the same late in a long generation as early,
    and the text held back is never longer than the longest stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = list(stops)
        self._fallbacks = [_fallback(stop) for stop in self._stops]
        self._matched = [0] * len(self._stops)  # per stop string: the prefix of it the text ends with
        self._pending = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Returns the text safe to emit and the stop string found, if any.
        After a stop string is found, the text after it is dropped."""
        if not self._stops:
            return text, None
        pending = self._pending + text
        held = len(self._pending)
        matched = self._matched
        for offset, char in enumerate(text):
            found = None
            for i, stop in enumerate(self._stops):
                k = matched[i]
                while k and stop[k] != char:
                    k = self._fallbacks[i][k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):
                    # The one that completes first wins; of those completing here, the one begun first.
                    if found is None or len(stop) > len(found):
                        found = stop
                    k = self._fallbacks[i][k - 1]
                matched[i] = k
            if found is not None:
                self._pending, self._matched = "", [0] * len(self._stops)
                return pending[: held + offset + 1 - len(found)], found
        hold = max(matched)
        self._pending = pending[len(pending) - hold :]
        return pending[: len(pending) - hold], None

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        self._matched = [0] * len(self._stops)
        return text


def _fallback(stop: str) -> list[int]:
    """KMP's failure function: for each prefix of ``stop``, the length of its longest proper
    prefix that is also a suffix of it."""
    table, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table
