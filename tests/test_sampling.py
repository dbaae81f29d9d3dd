"""The greedy choice (sampling.highest): torch's argmax, by another route on the CPU."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(
    "scores",
    [
        [1.0, 3.0, 3.0, 2.0],  # the first of equals
        [math.nan, 1.0, math.nan],  # a NaN above any number
        [1.0, math.nan, 5.0],
        [1.0, math.inf, math.nan],
        [-math.inf] * 4,
        [math.inf, 1.0, math.inf],
        [-0.0, 0.0],
        [0.0, -0.0],
    ],
)
def test_the_greedy_choice_is_torchs_argmax_on_ties_nans_and_infinities(scores):
    from worker.backends.transformers.sampling import highest

    row = torch.tensor([scores])
    assert highest(row) == int(row.argmax(dim=-1))
    assert highest(row.double()) == int(row.argmax(dim=-1))  # another dtype goes through torch


def test_the_greedy_choice_is_torchs_argmax_on_a_vocabulary_of_scores_and_a_row_of_a_batch():
    from worker.backends.transformers.sampling import highest

    generator = torch.Generator().manual_seed(7)
    batch = torch.randn(4, 49152, generator=generator).round(decimals=1)  # many equal scores
    for i in range(4):
        assert highest(batch[i : i + 1]) == int(batch[i : i + 1].argmax(dim=-1))
    assert highest(batch[:, 7]) == int(batch[:, 7].argmax())  # a row whose scores are not side by side
