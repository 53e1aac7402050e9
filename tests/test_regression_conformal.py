"""Conformalised mixture intervals (CQR) against scipy, and both conformal
intervals' guarantee over 1,000 random splits (one vmapped program each)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from ensembles import uncertainty
from ensembles.uncertainty._common import conformal_rank


def ref_mixture_quantile(means, stds, level):
    """One entry's mixture quantile by root-finding its float64 CDF."""
    means, stds = np.asarray(means, np.float64), np.asarray(stds, np.float64)

    def cdf(y):
        return np.mean(norm.cdf((y - means) / stds)) - level

    low = (means - 12 * stds).min()
    high = (means + 12 * stds).max()
    return brentq(cdf, low, high, xtol=1e-13, rtol=1e-14)


def ref_margin(means, stds, targets, level):
    means, stds = np.asarray(means, np.float64), np.asarray(stds, np.float64)
    scores = []
    for b in range(means.shape[1]):
        lower = ref_mixture_quantile(means[:, b], stds[:, b], (1 - level) / 2)
        upper = ref_mixture_quantile(means[:, b], stds[:, b], (1 + level) / 2)
        scores.append(max(lower - targets[b], targets[b] - upper))
    rank = math.ceil((len(scores) + 1) * level - 1e-9)
    return np.inf if rank > len(scores) else np.sort(scores)[rank - 1]


def skewed(num_examples, seed=0, num_members=3):
    """Members that disagree one way, with a noise that varies by example."""
    rng = np.random.default_rng(seed)
    noise = np.exp(rng.standard_normal(num_examples))
    means = (
        rng.standard_normal(num_examples)
        + np.array([[0.0], [0.3], [2.0]])[:num_members] * noise
    )
    stds = np.broadcast_to(0.8 * noise, (num_members, num_examples))
    targets = means[0] + noise * rng.standard_normal(num_examples)
    return (
        means.astype(np.float32),
        np.ascontiguousarray(stds, np.float32),
        targets.astype(np.float32),
    )


@pytest.mark.parametrize("level", [0.5, 0.9])
def test_margin_and_interval_equal_scipys(level):
    means, stds, targets = skewed(60, seed=1)
    margin = uncertainty.fit_conformal_margin(means, stds, targets, level)
    np.testing.assert_allclose(
        margin, ref_margin(means, stds, targets, level), rtol=2e-5, atol=2e-5
    )
    lower, upper = uncertainty.conformal_mixture_interval(
        means[:, :5], stds[:, :5], margin, level
    )
    for b in range(5):
        expected_lower = ref_mixture_quantile(means[:, b], stds[:, b], (1 - level) / 2)
        expected_upper = ref_mixture_quantile(means[:, b], stds[:, b], (1 + level) / 2)
        np.testing.assert_allclose(lower[b], expected_lower - float(margin), atol=3e-5)
        np.testing.assert_allclose(upper[b], expected_upper + float(margin), atol=3e-5)
    jitted = jax.jit(uncertainty.fit_conformal_margin, static_argnums=3)
    np.testing.assert_allclose(jitted(means, stds, targets, level), margin, rtol=1e-6)
    jitted_interval = jax.jit(uncertainty.conformal_mixture_interval, static_argnums=3)
    np.testing.assert_allclose(
        jitted_interval(means[:, :5], stds[:, :5], margin, level)[0], lower, rtol=1e-6
    )


def test_point_members_and_several_outputs():
    rng = np.random.default_rng(2)
    means = rng.standard_normal((5, 40, 2)).astype(np.float32)
    targets = rng.standard_normal((40, 2)).astype(np.float32)
    margin = uncertainty.fit_conformal_margin(means, None, targets, 0.8)
    # Point members: the mixture's quantiles are order statistics of the means.
    lower, upper = uncertainty.mixture_interval(means, None, 0.8)
    scores = np.maximum(np.asarray(lower) - targets, targets - np.asarray(upper))
    rank = conformal_rank(scores.size, 0.8)
    assert float(margin) == np.sort(scores.reshape(-1))[rank - 1]
    got = uncertainty.conformal_mixture_interval(means, None, margin, 0.8)
    np.testing.assert_allclose(got[0], np.asarray(lower) - float(margin))
    assert got[1].shape == (40, 2)


def test_a_negative_margin_narrows_and_too_few_entries_give_inf():
    means, stds = np.zeros((2, 1), np.float32), np.ones((2, 1), np.float32)
    lower, upper = uncertainty.conformal_mixture_interval(means, stds, -0.5, 0.9)
    np.testing.assert_allclose([lower[0], upper[0]], [-1.1448536, 1.1448536], rtol=1e-5)
    margin = uncertainty.fit_conformal_margin(
        np.zeros((2, 5), np.float32), np.ones((2, 5), np.float32), np.zeros(5), 0.9
    )
    assert float(margin) == np.inf
    lower, upper = uncertainty.conformal_mixture_interval(means, stds, margin, 0.9)
    assert float(lower[0]) == -np.inf and float(upper[0]) == np.inf


@pytest.mark.parametrize(
    "kind",
    [pytest.param("mixture_interval", marks=pytest.mark.slow), "mean_plus_minus_sd"],
)
def test_coverage_over_a_thousand_random_splits(kind):
    # As for the conformal sets: (n + 1) level = 94.5, so the exact expected
    # coverage 95 / 105 lies midway in [level, level + 1 / (n + 1)].
    means, stds, targets = (jnp.asarray(a) for a in skewed(1000, seed=3))
    num_fit, level, splits = 104, 0.9, 1000

    # The mixture's own intervals do not depend on the split: computed once
    # (conformal_mixture_interval is that interval less and plus the margin,
    # as test_margin_and_interval_equal_scipys checks), the fit per split.
    mixture_lower, mixture_upper = uncertainty.mixture_interval(means, stds, level)

    def coverage(key):
        order = jax.random.permutation(key, targets.shape[0])
        fit, new = order[:num_fit], order[num_fit:]
        if kind == "mixture_interval":
            margin = uncertainty.fit_conformal_margin(
                means[:, fit], stds[:, fit], targets[fit], level
            )
            lower, upper = mixture_lower[new] - margin, mixture_upper[new] + margin
        else:
            quantile = uncertainty.fit_conformal_quantile(
                means[:, fit], stds[:, fit], targets[fit], level
            )
            lower, upper = uncertainty.conformal_interval(
                means[:, new], stds[:, new], quantile
            )
        inside = (targets[new] >= lower) & (targets[new] <= upper)
        return jnp.mean(inside.astype(jnp.float32)), jnp.mean(upper - lower)

    keys = jax.random.split(jax.random.key(4), splits)
    covered, width = jax.jit(lambda k: jax.lax.map(coverage, k, batch_size=100))(keys)
    covered = np.asarray(covered)
    mean, standard_error = covered.mean(), covered.std() / np.sqrt(splits)
    assert level <= mean <= level + 1 / (num_fit + 1), (mean, standard_error)
    exact = conformal_rank(num_fit, level) / (num_fit + 1)
    assert abs(mean - exact) < 4 * standard_error + 1e-4, mean
    assert np.isfinite(np.asarray(width)).all()


def test_nan_in_nan_out():
    means, stds, targets = skewed(30, seed=5)
    broken = targets.copy()
    broken[4] = np.nan
    assert np.isnan(float(uncertainty.fit_conformal_margin(means, stds, broken)))
    means_broken = means.copy()
    means_broken[1, 7] = np.inf
    lower, upper = uncertainty.conformal_mixture_interval(means_broken, stds, 0.1)
    assert np.isnan(lower[7]) and np.isnan(upper[7])
    assert np.isfinite(np.delete(np.asarray(lower), 7)).all()
    jitted = jax.jit(uncertainty.conformal_mixture_interval)
    assert np.isnan(np.asarray(jitted(means, stds, jnp.nan)[0])).all()
    assert np.isnan(np.asarray(jitted(means, stds, -jnp.inf)[1])).all()


def test_bad_inputs_raise_clearly():
    means, stds, targets = skewed(30, seed=6)
    with pytest.raises(ValueError, match="`level` must lie strictly between 0 and 1"):
        uncertainty.fit_conformal_margin(means, stds, targets, 1.5)
    with pytest.raises(ValueError, match=r"`targets` must have shape \(30,\)"):
        uncertainty.fit_conformal_margin(means, stds, targets[:5])
    with pytest.raises(ValueError, match="`stds` must have the shape of `means`"):
        uncertainty.fit_conformal_margin(means, stds[:, :3], targets)
    with pytest.raises(ValueError, match="`margin` must be a scalar"):
        uncertainty.conformal_mixture_interval(means, stds, np.ones(2))
    with pytest.raises(ValueError, match="`margin` must be a number or inf, got nan"):
        uncertainty.conformal_mixture_interval(means, stds, np.nan)
    with pytest.raises(TypeError, match="`margin` must be a number"):
        uncertainty.conformal_mixture_interval(means, stds, None)
    with pytest.raises(TypeError, match="`margin` must be a real number"):
        uncertainty.conformal_mixture_interval(means, stds, True)
