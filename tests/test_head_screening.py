"""The screening bound of the output head (bench/head_screening.py, spec/reference-engine.md
"Screening the output head"): every row's exact logit lies in the interval computed from the high
bit plane, and the interval is the tightest one the plane allows (a low plane chosen against the
input reaches each end); the same for the low-rank copy's interval. Checked with numpy's exact
products on random Q8_0-shaped heads."""

from __future__ import annotations

import numpy as np
import pytest
from stdengine.bench.head_screening import (
    Head,
    LowRank,
    Screen,
    leading_directions,
    low_rank_chunk,
    screen_chunk,
)

MARGIN = Screen.MARGIN  # Screen.intervals widens each end by this much


def random_head(rng: np.random.Generator, rows: int = 64, blocks: int = 4) -> Head:
    d = rng.normal(0, 0.01, (rows, blocks))  # scales of either sign
    q = rng.integers(-128, 128, (rows, blocks, 32)).astype(np.float64)
    return Head(d, q)


@pytest.mark.parametrize("bits", [1, 2, 4, 5, 6, 7])
def test_every_exact_logit_is_inside_its_interval(bits):
    rng = np.random.default_rng(bits)
    head = random_head(rng)
    x = rng.normal(0, 3, (8, 4 * 32)) * (rng.random((8, 4 * 32)) < 0.7)  # some exact zeros
    lower, upper = Screen(head, bits).intervals(x)
    exact = x @ head.matrix.T
    assert (lower <= exact).all() and (exact <= upper).all()


def test_eight_bits_leave_no_width():
    rng = np.random.default_rng(8)
    head = random_head(rng)
    x = rng.normal(0, 3, (4, 4 * 32))
    lower, upper = Screen(head, 8).intervals(x)
    exact = x @ head.matrix.T
    np.testing.assert_allclose(lower + MARGIN, exact, atol=1e-9)
    np.testing.assert_allclose(upper - MARGIN, exact, atol=1e-9)


@pytest.mark.parametrize("bits", [3, 5])
def test_the_interval_is_tight(bits):
    """A head whose low plane is all s-1 where d*x > 0 and 0 elsewhere reaches the upper end; the
    opposite choice reaches the lower end: no narrower interval holds for every low plane."""
    rng = np.random.default_rng(100 + bits)
    s = 2 ** (8 - bits)
    head = random_head(rng, rows=16)
    x = rng.normal(0, 3, (1, 4 * 32))
    hi = np.floor(head.q / s)
    sign = np.sign(head.d[..., None] * x.reshape(1, 4, 32))  # [rows, blocks, 32]
    for want, lo in (("upper", np.where(sign > 0, s - 1, 0)), ("lower", np.where(sign < 0, s - 1, 0))):
        adversarial = Head(head.d, hi * s + lo)
        lower, upper = Screen(adversarial, bits).intervals(x)
        exact = x @ adversarial.matrix.T
        end = upper - MARGIN if want == "upper" else lower + MARGIN
        np.testing.assert_allclose(exact, end, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("schedule", [(3,), (4,), (3, 5), (2, 4, 6)])
@pytest.mark.parametrize("k", [1, 5])
def test_both_thresholds_keep_the_true_top_k(schedule, k):
    """Plane by plane, with the k-th largest lower end or with the exact logits of the k rows of
    largest lower end (the engine's threshold): every true top-k row stays a candidate, and the
    exact threshold, never below the other, leaves a subset of its candidates."""
    rng = np.random.default_rng(sum(schedule) + k)
    head = random_head(rng, rows=256)
    x = rng.normal(0, 3, (6, 4 * 32))
    logits = x @ head.matrix.T
    screens = {b: Screen(head, b) for b in schedule}
    loose, _ = screen_chunk(screens, schedule, x, k, None)
    tight, _ = screen_chunk(screens, schedule, x, k, logits)
    top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    assert np.take_along_axis(tight, top, 1).all() and np.take_along_axis(loose, top, 1).all()
    assert (tight <= loose).all() and tight.sum() < loose.sum()


@pytest.mark.parametrize("rank", [1, 16, 127, 128])
def test_low_rank_intervals_hold_every_exact_logit(rank):
    """The low-rank copy's interval holds every row's logit, at any rank; at full rank only the
    coefficients' rounding is left, so the interval is narrow."""
    rng = np.random.default_rng(rank)
    head = random_head(rng)
    x = rng.normal(0, 3, (8, 4 * 32))
    w = head.matrix
    lower, upper = LowRank(w, leading_directions(w)[:, :rank]).intervals(x)
    exact = x @ head.matrix.T
    assert (lower <= exact).all() and (exact <= upper).all()
    if rank == 128:
        full_width = 2 * np.abs(exact).max()
        assert ((upper - lower) < 0.1 * full_width).all()


@pytest.mark.parametrize("k", [1, 5])
def test_low_rank_keeps_the_true_top_k(k):
    rng = np.random.default_rng(200 + k)
    head = random_head(rng, rows=256)
    x = rng.normal(0, 3, (6, 4 * 32))
    logits = x @ head.matrix.T
    w = head.matrix
    cand, read = low_rank_chunk(LowRank(w, leading_directions(w)[:, :96]), x, k, logits)
    top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    assert np.take_along_axis(cand, top, 1).all() and cand.sum() < cand.size
    assert (read >= 256 * (96 + 12)).all()
