"""Choosing the next token from a row of logits, greedy or sampled, with numpy alone.

The scores pass through the processors transformers' ``generate()`` applies, in its order
and by its rules, in float32: the repetition penalty, then (when sampling) temperature,
top-k, top-p and min-p. A sampled token is drawn with one uniform number from a numpy
Generator of the request's own, seeded with its seed: the same seed gives the same tokens
in any process, whatever other requests draw.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from protocol.methods import GenerateParams

Scores = NDArray[np.float32]

_REMOVED = np.float32(-np.inf)


class Sampler:
    """One request's choice of each next token, and its random numbers."""

    def __init__(self, params: GenerateParams) -> None:
        self.greedy = params.temperature == 0
        self._penalty = params.repetition_penalty
        self._temperature = params.temperature
        self._top_k = params.top_k
        self._top_p = params.top_p
        self._min_p = params.min_p
        self._random: np.random.Generator | None = None
        if not self.greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(64)
            # numpy takes no negative seed: a signed one as its two's complement, one stream each
            self._random = np.random.default_rng(seed & (2**64 - 1))

    def next_token(self, sequence: Sequence[int], logits: Scores, highest_at: int | None = None) -> int:
        """``sequence``: prompt and tokens so far; ``logits``: one row, shape (1, vocab) or (vocab,),
        never written to; ``highest_at``: the index of their highest, where the pass that computed
        them found it (``highest``'s choice)."""
        row = logits.reshape(-1)
        if self.greedy and self._penalty == 1.0:
            return highest_at if highest_at is not None else highest(row)
        penalized, scores = self._processed(sequence, row)
        if self.greedy:
            return highest(scores)
        top = scores.max()
        if np.isfinite(top):
            return self._draw(np.exp(scores - top))
        # A temperature or penalty so small that the scores overflow (1e-45, say): in the limit,
        # the token is one of the highest-scoring alone, ties among those that overflowed broken
        # by the scores before temperature, then by the logits.
        candidates = np.arange(row.size)
        for level in (scores, penalized, row):
            values = np.where(np.isnan(level[candidates]), _REMOVED, level[candidates])
            candidates = candidates[values == values.max()]
        if not row[candidates[0]] > _REMOVED:  # no logit above minus infinity: as greedy
            return highest(row)
        return int(candidates[self._draw(np.ones(candidates.size, dtype=np.float32))])

    def scores(self, sequence: Sequence[int], logits: Scores) -> Scores:
        """The scores a sampled token is drawn from (by their softmax; minus infinity: removed), or
        the greedy choice is the highest of."""
        return self._processed(sequence, logits.reshape(-1))[1]

    def _processed(self, sequence: Sequence[int], row: Scores) -> tuple[Scores, Scores]:
        """The scores after the repetition penalty, and after the warpers too (the same when greedy);
        scores that overflow are no error."""
        with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
            penalized = self._penalized(sequence, row)
            return penalized, penalized if self.greedy else self._warped(penalized)

    def _penalized(self, sequence: Sequence[int], row: Scores) -> Scores:
        """transformers' RepetitionPenaltyLogitsProcessor: each token of ``sequence`` once, its score
        times the penalty when negative, else divided by it; ids past the row are no token of it."""
        if self._penalty == 1.0:
            return row
        ids = np.asarray(sequence, dtype=np.int64)
        ids = ids[ids < row.size]
        seen = row[ids]
        penalty = np.float32(self._penalty)
        penalized = row.copy()
        penalized[ids] = np.where(seen < 0, seen * penalty, seen / penalty)
        return penalized

    def _warped(self, scores: Scores) -> Scores:
        scores = scores / np.float32(self._temperature)
        if self._top_k:
            scores = top_k(scores, self._top_k)
        if self._top_p < 1.0:
            scores = top_p(scores, self._top_p)
        if self._min_p > 0.0:
            scores = min_p(scores, self._min_p)
        return scores

    def _draw(self, weights: NDArray[np.float32]) -> int:
        """An index drawn with probability proportional to its weight, from one uniform number."""
        assert self._random is not None
        sums = _RunningSums(weights)
        # the first running sum above a number below the total: never a zero weight's, but where
        # rounding leaves the number past the sums of its block, the last weighted index before
        index = sums.count_at_most(self._random.random() * sums.total)
        if index == weights.size or not weights[index] > 0:
            index = int(np.flatnonzero(weights[:index])[-1])
        return index


class _RunningSums:
    """The running sums of weights, in order and in float64, found block by block: the sum of each
    block first, then the running sums within the one block a bound falls in."""

    _BLOCK = 512

    def __init__(self, weights: NDArray[np.float32]) -> None:
        self._weights = weights
        whole = weights.size - weights.size % self._BLOCK
        blocks = np.add.reduce(weights[:whole].reshape(-1, self._BLOCK), axis=1, dtype=np.float64)
        if whole < weights.size:
            blocks = np.append(blocks, weights[whole:].sum(dtype=np.float64))
        self._ends = np.cumsum(blocks)  # the running sum at each block's last weight
        self.total = float(self._ends[-1])

    def count_at_most(self, bound: float | np.floating, dtype: type[np.floating] = np.float64) -> int:
        """How many of the running sums, rounded to ``dtype``, are at most ``bound``."""
        block = int(np.searchsorted(self._ends.astype(dtype), bound, side="right"))
        if block == self._ends.size:
            return self._weights.size
        first = block * self._BLOCK
        start = self._ends[block - 1] if block else 0.0
        sums = start + np.cumsum(self._weights[first : first + self._BLOCK], dtype=np.float64)
        return first + int(np.searchsorted(sums.astype(dtype), bound, side="right"))


def top_k(scores: Scores, k: int) -> Scores:
    """transformers' TopKLogitsWarper: the scores below the k-th highest removed (all those equal to
    it kept)."""
    k = min(k, scores.size)
    kth = np.partition(scores, scores.size - k)[scores.size - k]
    return np.where(scores < kth, _REMOVED, scores)


def top_p(scores: Scores, p: float) -> Scores:
    """transformers' TopPLogitsWarper: in ascending order of score, the tokens whose cumulative
    probability is at most 1 - p removed, never the last; equal scores in the order of their ids
    (torch's sort leaves their order unspecified)."""
    top = scores.max()
    if not np.isfinite(top):  # a softmax of NaNs: the rule removes none
        return scores
    ascending = np.sort(scores)
    weights = np.exp(ascending - top)
    # float32 probabilities, summed in float64 as torch's cumsum does on the CPU
    cumulative = _RunningSums(weights * (np.float32(1) / weights.sum()))
    removed = min(cumulative.count_at_most(np.float32(1 - p), np.float32), scores.size - 1)
    lowest_kept = ascending[removed]
    kept = np.where(scores < lowest_kept, _REMOVED, scores)
    equal_removed = removed - int(np.searchsorted(ascending, lowest_kept, side="left"))
    if equal_removed:
        kept[np.flatnonzero(scores == lowest_kept)[:equal_removed]] = _REMOVED
    return kept


def min_p(scores: Scores, p: float) -> Scores:
    """transformers' MinPLogitsWarper: the tokens whose probability is below p times the highest
    probability removed (never the highest itself: p is at most 1)."""
    top = scores.max()
    if not np.isfinite(top):  # a softmax of NaNs: the rule removes none
        return scores
    weights = np.exp(scores - top)
    probabilities = weights * (np.float32(1) / weights.sum())
    return np.where(probabilities < np.float32(p) * probabilities.max(), _REMOVED, scores)


def highest(scores: NDArray[np.floating]) -> int:
    """The index of the highest of ``scores`` (one row): the first of equal ones, a NaN above any
    number, as torch's argmax has it."""
    return int(np.argmax(scores))
