"""The next token's choice (worker.sampling): transformers' processors' scores, torch's argmax,
draws that follow the softmax and depend on the seed alone, all without torch."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import numpy as np
import pytest

from protocol.methods import GenerateParams
from worker.sampling import Sampler, highest


def params(**fields) -> GenerateParams:
    return GenerateParams(prompt="x", **fields)


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
    torch = pytest.importorskip("torch")

    row = torch.tensor([scores])
    assert highest(row.numpy()) == int(row.argmax(dim=-1))
    assert highest(row.double().numpy()) == int(row.argmax(dim=-1))


def test_the_greedy_choice_is_torchs_argmax_on_a_vocabulary_of_scores_and_a_row_of_a_batch():
    torch = pytest.importorskip("torch")

    generator = torch.Generator().manual_seed(7)
    batch = torch.randn(4, 49152, generator=generator).round(decimals=1)  # many equal scores
    for i in range(4):
        assert highest(batch[i : i + 1].numpy()) == int(batch[i : i + 1].argmax(dim=-1))
    assert highest(batch[:, 7].numpy()) == int(batch[:, 7].argmax())  # a row whose scores are not side by side


GRID = list(
    itertools.product(
        (0.0, 0.3, 1.0, 2.5, 1e-40),  # temperature (0: greedy, the penalty alone; 1e-40 overflows)
        (0, 1, 5, 60, 2000),  # top_k: off, one, ties at the k-th of rounded scores, past the vocabulary
        (1.0, 0.9, 0.5, 1e-6),  # top_p
        (0.0, 0.05, 0.5),  # min_p
        (1.0, 1.3, 0.7, 1e-45),  # repetition_penalty (1e-45 overflows the positive scores seen)
    )
)


def transformers_scores(request: GenerateParams, sequence: list[int], logits: np.ndarray) -> np.ndarray:
    """The scores transformers' processors give, in the order generate() applies them."""
    import torch
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if request.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(request.repetition_penalty))
    if request.temperature:
        processors.append(TemperatureLogitsWarper(request.temperature))
        if request.top_k:
            processors.append(TopKLogitsWarper(request.top_k))
        if request.top_p < 1.0:
            processors.append(TopPLogitsWarper(request.top_p))
        if request.min_p > 0.0:
            processors.append(MinPLogitsWarper(request.min_p))
    ids = torch.tensor([sequence])
    return processors(ids, torch.from_numpy(logits[None].copy()))[0].numpy()


@pytest.mark.parametrize("vocab", [7, 1000])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "rounded"])
def test_the_processors_keep_the_tokens_and_scores_transformers_processors_keep(vocab: int, ties: bool):
    """Over a grid of every parameter, on scores of both signs, a sequence that repeats ids and
    holds some past the vocabulary. Equal scores where top-p cuts are kept in the order of their
    ids, where torch's sort leaves the order unspecified: there only how many are kept, and their
    scores, are transformers'."""
    pytest.importorskip("transformers")
    random = np.random.default_rng(vocab + ties)
    for temperature, top_k, top_p, min_p, penalty in GRID:
        logits = (random.standard_normal(vocab) * 4).astype(np.float32)
        if ties:
            logits = logits.round()
        sequence = [int(i) for i in random.integers(0, vocab + 3, size=12)] * 2
        request = params(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=penalty)
        ours, theirs = Sampler(request).scores(sequence, logits), transformers_scores(request, sequence, logits)
        case = (temperature, top_k, top_p, min_p, penalty)
        assert ours.dtype == np.float32, case
        if ties and top_p < 1.0 and temperature:
            np.testing.assert_array_equal(np.sort(ours), np.sort(theirs), err_msg=str(case))
        else:
            np.testing.assert_array_equal(ours, theirs, err_msg=str(case))


def test_top_p_keeps_the_later_ids_of_equal_scores_where_it_cuts():
    sampler = Sampler(params(temperature=1.0, top_p=0.5))
    kept = sampler.scores([], np.array([1.0, 0.0, 1.0, 1.0, 0.0], dtype=np.float32))
    assert list(np.flatnonzero(np.isfinite(kept))) == [2, 3]


def draws(sampler: Sampler, logits: np.ndarray, count: int) -> list[int]:
    return [sampler.next_token([], logits) for _ in range(count)]


LOGITS = np.random.default_rng(3).standard_normal((1, 3000)).astype(np.float32) * 2


@pytest.mark.parametrize("seed", [0, 1234, -1, -(2**63), 2**63 - 1])
def test_the_same_seed_gives_the_same_tokens_from_two_samplers(seed: int):
    request = params(temperature=1.5, top_p=0.95, seed=seed)
    tokens = draws(Sampler(request), LOGITS, 50)
    assert draws(Sampler(request), LOGITS, 50) == tokens
    assert draws(Sampler(params(temperature=1.5, top_p=0.95, seed=seed ^ 1)), LOGITS, 50) != tokens


def test_a_sampler_without_a_seed_draws_tokens_of_its_own():
    request = params(temperature=1.5)
    assert draws(Sampler(request), LOGITS, 50) != draws(Sampler(request), LOGITS, 50)


FRESH_PROCESS = """
import sys
import numpy as np
from protocol.methods import GenerateParams
from worker.sampling import Sampler
logits = np.random.default_rng(3).standard_normal((1, 3000)).astype(np.float32) * 2
sampler = Sampler(GenerateParams(prompt="x", temperature=1.5, top_p=0.95, seed=-77))
print([sampler.next_token([], logits) for _ in range({count})])
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def in_a_fresh_process(count: int) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS.format(count=count)], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.splitlines()


def test_the_same_seed_gives_the_same_tokens_in_a_fresh_process():
    tokens, _ = in_a_fresh_process(50)
    assert tokens == str(draws(Sampler(params(temperature=1.5, top_p=0.95, seed=-77)), LOGITS, 50))


def test_importing_the_sampler_and_sampling_a_token_import_neither_torch_nor_transformers():
    _, imported = in_a_fresh_process(1)
    assert imported == "[]"


def chi_square(counts: np.ndarray, probabilities: np.ndarray) -> float:
    expected = probabilities * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# The chi-square statistic's value that a sample passes with probability 0.001, by degrees of freedom.
CHI_SQUARE_AT_0_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


@pytest.mark.parametrize(
    "fields",
    [dict(temperature=1.0), dict(temperature=0.6, top_k=6), dict(temperature=2.0, top_p=0.8, min_p=0.1)],
    ids=["temperature", "top_k", "top_p_min_p"],
)
def test_the_draws_follow_the_softmax_of_the_scores_kept(fields):
    """20,000 draws of a fixed seed over ten tokens (a deterministic check: it cannot flake)."""
    logits = np.array([[0.5, 2.0, -1.0, 1.5, 0.0, 2.2, -0.5, 1.0, 0.8, 1.9]], dtype=np.float32)
    sampler = Sampler(params(seed=11, **fields))
    scores = sampler.scores([], logits).astype(np.float64)
    probabilities = np.exp(scores - scores.max())
    probabilities /= probabilities.sum()
    counts = np.bincount(draws(sampler, logits, 20000), minlength=10)
    kept = probabilities > 0
    assert not counts[~kept].any()
    assert chi_square(counts[kept], probabilities[kept]) < CHI_SQUARE_AT_0_001[int(kept.sum()) - 1], counts


def test_the_draws_over_a_vocabulary_follow_the_softmax_across_its_blocks():
    """Tokens drawn among 3,000, counted in ten runs of 300 consecutive ids (the draw sums the
    weights block by block)."""
    sampler = Sampler(params(temperature=3.0, seed=5))
    scores = sampler.scores([], LOGITS).astype(np.float64)
    probabilities = np.exp(scores - scores.max())
    probabilities /= probabilities.sum()
    counts = np.bincount(np.array(draws(sampler, LOGITS, 20000)) // 300, minlength=10)
    assert chi_square(counts, probabilities.reshape(10, 300).sum(axis=1)) < CHI_SQUARE_AT_0_001[9]


@pytest.mark.parametrize(
    ("logits", "chosen"),
    [([3.0, 1.0, 2.0, 5.0, 5.0], {3, 4}), ([-3.0, -1.0, -2.0, -5.0], {1}), ([-3.0, -math.inf, 4.0, -math.inf], {2})],
)
def test_a_temperature_so_small_that_every_score_overflows_draws_among_the_highest_logits(logits, chosen):
    sampler = Sampler(params(temperature=1e-45, seed=2))
    assert set(draws(sampler, np.array([logits], dtype=np.float32), 40)) == chosen


def test_a_penalty_so_small_that_the_scores_seen_overflow_draws_among_their_highest_logits():
    sampler = Sampler(params(temperature=1.0, repetition_penalty=1e-45, seed=2))
    logits = np.array([[3.0, 1.0, 2.0, 9.0, 5.0]], dtype=np.float32)
    assert {sampler.next_token([0, 1, 2], logits) for _ in range(40)} == {0}


def test_a_row_with_no_number_above_minus_infinity_gives_its_highest():
    sampler = Sampler(params(temperature=0.7, seed=2))
    assert draws(sampler, np.array([[-math.inf, math.nan, -math.inf]], dtype=np.float32), 5) == [1] * 5


def test_the_choice_leaves_the_logits_as_they_were():
    """A row of a model's logits tensor is handed over without a copy."""
    logits = LOGITS.copy()
    sampler = Sampler(params(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.3, seed=1))
    draws(sampler, logits, 3)
    Sampler(params(repetition_penalty=1.3)).next_token(list(range(3000)), logits)
    np.testing.assert_array_equal(logits, LOGITS)


def test_greedy_takes_the_highest_the_pass_found_and_the_penalty_applies_at_every_temperature():
    logits = np.array([[1.0, 4.0, 3.0]], dtype=np.float32)
    assert Sampler(params()).next_token([], logits, highest_at=1) == 1
    assert Sampler(params(repetition_penalty=2.0)).next_token([1], logits, highest_at=1) == 2
