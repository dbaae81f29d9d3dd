"""Prompt lookup: drafting the next tokens of a sequence from the sequence itself.

Output that repeats its prompt (an edited file, a quoted passage, a renamed symbol, a
list written again) continues as it did before: after the last few tokens, the tokens
that followed their latest earlier occurrence are a good guess at what comes next.
The model checks such a draft in one pass over all its positions (the decode step
computes each position exactly as it would one at a time), and the generation takes
the drafted tokens it would have chosen anyway, so the output is the same as without
a draft, only sooner.
"""

from __future__ import annotations

from collections.abc import Sequence


def draft(tokens: Sequence[int], *, draft_tokens: int, ngram_max: int, ngram_min: int) -> list[int]:
    """At most ``draft_tokens`` tokens that followed the latest earlier occurrence of the
    sequence's last n tokens, for the longest n from ``ngram_max`` down to ``ngram_min``
    that occurred before; none when none did."""
    if draft_tokens <= 0:
        return []
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        tail = list(tokens[length - n :])
        # the latest occurrence that ends before the tail does, scanning backwards
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == tail[0] and list(tokens[start : start + n]) == tail:
                return list(tokens[start + n : start + n + draft_tokens])
    return []
