"""Choosing the next token: greedy, or sampled with transformers' logits processors.

The processors run in the order ``generate()`` uses (repetition penalty, then
temperature, top-k, top-p, min-p), and sampling draws from a private,
seeded ``torch.Generator``: the same seed gives the same tokens in any process,
whatever other requests do to the global RNG.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import cast

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from protocol.methods import GenerateParams


class Sampler:
    def __init__(self, params: GenerateParams, device: str) -> None:
        self.greedy = params.temperature == 0
        processors = LogitsProcessorList()
        if params.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
        if not self.greedy:
            processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                processors.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                processors.append(TopPLogitsWarper(params.top_p))
            if params.min_p > 0.0:
                processors.append(MinPLogitsWarper(params.min_p))
        self._processors = processors
        self._generator = None
        if not self.greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self._generator = torch.Generator(device=device).manual_seed(seed)

    def next_token(self, sequence: Sequence[int], logits: torch.Tensor, highest_at: int | None = None) -> int:
        """``sequence``: prompt and tokens so far; ``logits``: shape (1, vocab); ``highest_at``: the
        index of their highest, where the pass that computed them found it (``highest``'s choice)."""
        if self.greedy and not self._processors and highest_at is not None:
            return highest_at
        if self._processors:
            # torch types every tensor as Tensor; transformers' processors ask for the LongTensor this is
            ids = cast(torch.LongTensor, torch.tensor([list(sequence)], dtype=torch.long, device=logits.device))
            scores = self._processors(ids, logits.float())
        else:
            scores = logits
        if self.greedy:
            return highest(scores)
        probabilities = torch.softmax(scores, dim=-1)
        if not torch.isfinite(probabilities).all():
            # A temperature or penalty so small that the scores overflow (1e-45, say): in the limit,
            # sampling chooses among the highest-scoring tokens alone.
            best = torch.nan_to_num(scores, nan=float("-inf"))
            if torch.isneginf(best.max()):
                return highest(logits)
            probabilities = (best == best.max()).float()
        return int(torch.multinomial(probabilities, 1, generator=self._generator))


def highest(scores: torch.Tensor) -> int:
    """The index of the highest of ``scores`` (one row): the first of equal ones, a NaN above
    any number, as torch's argmax has it. numpy's on the CPU, which is several times faster
    than torch's on a vocabulary's row (bench/README.md, "Figures behind constants")."""
    if scores.device.type == "cpu" and scores.dtype == torch.float32:
        return int(scores.numpy().argmax())
    return int(scores.argmax())
