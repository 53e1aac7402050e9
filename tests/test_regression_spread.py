"""The aleatoric and epistemic scales of a regressor, against scipy."""

import jax
import numpy as np
import pytest
import scipy.optimize
import scipy.special
import scipy.stats

from ensembles import uncertainty


def _members(seed, num_members=4, batch=300, disagreement=0.5, noise=2.0):
    rng = np.random.default_rng(seed)
    truth = rng.standard_normal(batch)
    means = truth + disagreement * rng.standard_normal((num_members, batch))
    stds = np.full((num_members, batch), 0.5) * np.exp(
        0.2 * rng.standard_normal((num_members, batch))
    )
    targets = truth + noise * rng.standard_normal(batch)
    return means.astype(np.float32), stds.astype(np.float32), targets.astype(np.float32)


def _nll(means, stds, targets, a, b):
    center = means.mean(0, keepdims=True)
    spread = center + b * (means - center)
    log_density = scipy.stats.norm.logpdf(targets, spread, a * stds)
    return -(scipy.special.logsumexp(log_density, axis=0) - np.log(len(means))).mean()


def _reference(clean, hard):
    def best(f):
        found = scipy.optimize.minimize_scalar(
            f, bounds=(np.log(0.05), np.log(20.0)), method="bounded",
            options={"xatol": 1e-10},
        )  # fmt: skip
        return np.exp(found.x)

    means, stds, targets = map(np.float64, clean)
    a = best(lambda t: _nll(means, stds, targets, np.exp(t), 1.0))
    means, stds, targets = map(np.float64, hard)
    b = best(lambda t: _nll(means, stds, targets, a, np.exp(t)))
    return a, b


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_scales_match_scipy(seed):
    clean = _members(seed)
    hard = _members(seed + 10, disagreement=1.5, noise=3.0)
    scales = np.asarray(uncertainty.fit_spread_scales(*clean, *hard))
    np.testing.assert_allclose(scales, _reference(clean, hard), rtol=1e-3)
    assert scales[1] > 1  # the hard set's errors ask for more disagreement


def test_scale_spread_is_the_formula():
    means, stds, _ = _members(3)
    out_means, out_stds = uncertainty.scale_spread(means, stds, np.array([1.5, 2.0]))
    center = means.mean(0, keepdims=True)
    np.testing.assert_allclose(out_means, center + 2.0 * (means - center), rtol=1e-6)
    np.testing.assert_allclose(out_stds, 1.5 * stds, rtol=1e-6)
    # The mixture mean is kept; aleatoric variance x a^2, epistemic x b^2.
    np.testing.assert_allclose(
        uncertainty.epistemic_variance(out_means, out_stds),
        4.0 * uncertainty.epistemic_variance(means, stds),
        rtol=1e-4,
    )


def test_one_member_leaves_the_epistemic_scale_at_one():
    clean = tuple(a[:1] if a.ndim == 2 else a for a in _members(4))
    hard = tuple(a[:1] if a.ndim == 2 else a for a in _members(5, noise=3.0))
    scales = np.asarray(uncertainty.fit_spread_scales(*clean, *hard))
    assert scales[1] == 1.0
    # a: the closed form of one Gaussian member, sqrt(mean(z^2)).
    means, stds, targets = clean
    z = (targets - means[0]) / stds[0]
    np.testing.assert_allclose(scales[0], np.sqrt(np.mean(z**2)), rtol=1e-4)


def test_jit_equals_eager_and_nan_in_nan_out():
    clean, hard = _members(6), _members(7, noise=3.0)
    np.testing.assert_allclose(
        jax.jit(uncertainty.fit_spread_scales)(*clean, *hard),
        uncertainty.fit_spread_scales(*clean, *hard),
        rtol=1e-6,
    )
    scales = np.array([1.2, 0.8], np.float32)
    for got, want in zip(
        jax.jit(uncertainty.scale_spread)(clean[0], clean[1], scales),
        uncertainty.scale_spread(clean[0], clean[1], scales),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    bad = clean[0].copy()
    bad[2, 5] = np.nan
    assert np.isnan(uncertainty.fit_spread_scales(bad, *clean[1:], *hard)).all()
    assert np.isnan(uncertainty.fit_spread_scales(*clean, bad, *hard[1:])).all()
    out_means, _ = uncertainty.scale_spread(bad, clean[1], scales)
    assert np.isnan(np.asarray(out_means)[:, 5]).all()
    assert np.isfinite(np.delete(np.asarray(out_means), 5, 1)).all()


@pytest.mark.parametrize(
    ("scales", "match"),
    [
        (np.array([1.0], np.float32), r"`scales` must be two positive numbers"),
        (np.array([1.0, 0.0], np.float32), "positive and finite"),
        (np.array([np.inf, 1.0], np.float32), "positive and finite"),
    ],
)
def test_bad_scales_are_refused(scales, match):
    means, stds, _ = _members(8)
    with pytest.raises(ValueError, match=match):
        uncertainty.scale_spread(means, stds, scales)


def test_mismatched_sets_are_refused():
    clean = _members(9)
    hard = _members(9, num_members=3)
    with pytest.raises(ValueError, match="`hard_means` must have the members"):
        uncertainty.fit_spread_scales(*clean, *hard)
    with pytest.raises(ValueError):
        uncertainty.fit_spread_scales(clean[0], None, clean[2], *clean)
