"""The regression predictive, its scores and recalibration against references.

The references are independent of the library's formulas: scipy's Gaussian
(log-pdf, CDF, quantile function), a float64 loop over members, scipy's
root finding for the mixture's quantiles, numerical integration of the
CRPS's definition and of the PIT curve, ``scipy.stats.spearmanr``, and
scipy's scalar minimisation of the scaled mixture's NLL.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate, optimize, stats

from ensembles import uncertainty

# --------------------------------------------------------------------------------
# float64 references, one example and output at a time.


def members(seed, num_members=4, shape=(6,), spread=1.0):
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, spread, (num_members, *shape))
    stds = rng.uniform(0.3, 1.5, (num_members, *shape))
    targets = rng.normal(0.0, 1.5, shape)
    return means, stds, targets


def ref_cdf(mu, sigma, y):
    """The mixture's CDF at y for one entry: mu, sigma of shape [E]."""
    return float(np.mean(stats.norm.cdf(y, mu, sigma)))


def ref_quantile(mu, sigma, q):
    low, high = (mu - 12 * sigma).min(), (mu + 12 * sigma).max()
    return optimize.brentq(
        lambda y: ref_cdf(mu, sigma, y) - q, low, high, xtol=1e-13, rtol=1e-13
    )


def ref_crps(mu, sigma, y):
    """CRPS by integrating its definition, (F(t) - 1{y <= t})^2, numerically."""
    low, high = min(y, (mu - 12 * sigma).min()), max(y, (mu + 12 * sigma).max())
    below, _ = integrate.quad(
        lambda t: ref_cdf(mu, sigma, t) ** 2,
        low,
        y,
        epsabs=1e-13,
        epsrel=1e-12,
        limit=400,
    )
    above, _ = integrate.quad(
        lambda t: (1 - ref_cdf(mu, sigma, t)) ** 2,
        y,
        high,
        epsabs=1e-13,
        epsrel=1e-12,
        limit=400,
    )
    return below + above


def entries(means, stds, targets):
    """(mu [E], sigma [E], y) per entry, over B (and D)."""
    flat_means = means.reshape(means.shape[0], -1)
    flat_stds = stds.reshape(stds.shape[0], -1)
    for i, y in enumerate(targets.reshape(-1)):
        yield flat_means[:, i], flat_stds[:, i], float(y)


def ref_log_density(means, stds, targets):
    """[B]: log of the mixture's (joint, for D outputs) density."""
    member = stats.norm.logpdf(targets[None], means, stds)
    if member.ndim == 3:
        member = member.sum(axis=-1)
    top = member.max(axis=0)
    return top + np.log(np.exp(member - top).mean(axis=0))


# --------------------------------------------------------------------------------
# The predictive


@pytest.mark.parametrize("shape", [(5,), (3, 2)])
def test_moments_follow_the_law_of_total_variance(shape):
    means, stds, _ = members(0, shape=shape)
    assert np.allclose(uncertainty.mixture_mean(means, stds), means.mean(0), atol=1e-6)
    aleatoric = (stds**2).mean(0)
    epistemic = means.var(0)
    assert np.allclose(
        uncertainty.aleatoric_variance(means, stds), aleatoric, rtol=1e-5
    )
    assert np.allclose(
        uncertainty.epistemic_variance(means, stds), epistemic, rtol=1e-5
    )
    # The variance of the mixture, from its definition E[y^2] - E[y]^2 in float64.
    second = (stds**2 + means**2).mean(0)
    total = second - means.mean(0) ** 2
    assert np.allclose(uncertainty.mixture_variance(means, stds), total, rtol=1e-5)
    assert np.allclose(uncertainty.mixture_variance(means), epistemic, rtol=1e-5)
    assert np.allclose(uncertainty.aleatoric_variance(means), 0.0)


def test_moments_do_not_cancel_far_from_zero():
    means = np.array([[1e4 + 1.0], [1e4 - 1.0]], np.float32)
    assert float(uncertainty.epistemic_variance(means)[0]) == 1.0


@pytest.mark.parametrize("shape", [(5,), (3, 2)])
def test_log_density_matches_scipy(shape):
    means, stds, targets = members(1, shape=shape)
    got = uncertainty.mixture_log_density(means, stds, targets)
    assert got.shape == shape[:1]
    np.testing.assert_allclose(got, ref_log_density(means, stds, targets), rtol=1e-5)


def test_log_density_is_finite_where_each_member_underflows():
    means = np.array([[-40.0], [40.0]], np.float32)
    stds = np.ones((2, 1), np.float32)
    got = float(uncertainty.mixture_log_density(means, stds, np.array([45.0]))[0])
    expected = stats.norm.logpdf(45.0, 40.0, 1.0) - math.log(2)
    assert got == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("shape", [(5,), (3, 2)])
def test_cdf_and_quantiles_match_scipy(shape):
    means, stds, targets = members(2, shape=shape)
    cdf = np.asarray(uncertainty.mixture_cdf(means, stds, targets)).reshape(-1)
    levels = np.array([0.01, 0.05, 0.5, 0.9, 0.975])
    quantiles = np.asarray(uncertainty.mixture_quantile(means, stds, levels))
    assert quantiles.shape == (5, *shape)
    quantiles = quantiles.reshape(5, -1)
    for i, (mu, sigma, y) in enumerate(entries(means, stds, targets)):
        assert cdf[i] == pytest.approx(ref_cdf(mu, sigma, y), abs=2e-6)
        for j, q in enumerate(levels):
            expected = ref_quantile(mu, sigma, q)
            assert quantiles[j, i] == pytest.approx(
                expected, abs=2e-5 * max(1, abs(expected))
            )


def test_quantiles_in_float64_are_float64_accurate(x64):
    means, stds, _ = members(3)
    levels = np.array([0.001, 0.3, 0.999])
    quantiles = np.asarray(uncertainty.mixture_quantile(means, stds, levels))
    assert quantiles.dtype == np.float64
    for i, (mu, sigma, _) in enumerate(entries(means, stds, np.zeros(6))):
        for j, q in enumerate(levels):
            assert quantiles[j, i] == pytest.approx(
                ref_quantile(mu, sigma, q), abs=1e-10
            )


def test_point_members_are_their_empirical_distribution():
    means = np.array([[3.0, 0.0], [1.0, 0.0], [2.0, 5.0], [4.0, 5.0]], np.float32)
    targets = np.array([2.0, 1.0], np.float32)
    np.testing.assert_array_equal(
        uncertainty.mixture_cdf(means, None, targets), [0.5, 0.5]
    )
    quantiles = uncertainty.mixture_quantile(
        means, None, np.array([0.1, 0.25, 0.26, 0.9])
    )
    # inf {y : share of members <= y >= q}: the ceil(q E)-th smallest mean.
    np.testing.assert_array_equal(quantiles, [[1, 0], [1, 0], [2, 0], [4, 5]])
    lower, upper = uncertainty.mixture_interval(means, None, level=0.5)
    np.testing.assert_array_equal(lower, [1.0, 0.0])
    np.testing.assert_array_equal(upper, [3.0, 5.0])


def test_interval_is_the_central_quantiles():
    means, stds, _ = members(4)
    lower, upper = uncertainty.mixture_interval(means, stds, level=0.8)
    np.testing.assert_allclose(
        lower, uncertainty.mixture_quantile(means, stds, 0.1), rtol=1e-6
    )
    np.testing.assert_allclose(
        upper, uncertainty.mixture_quantile(means, stds, 0.9), rtol=1e-6
    )


# --------------------------------------------------------------------------------
# Scores


@pytest.mark.parametrize("shape", [(5,), (2, 3)])
def test_nlls_match_scipy(shape):
    means, stds, targets = members(5, shape=shape)
    expected = -ref_log_density(means, stds, targets).mean()
    assert float(uncertainty.mixture_nll(means, stds, targets)) == pytest.approx(
        expected, rel=1e-5
    )
    mean, variance = means.mean(0), (stds**2 + means**2).mean(0) - means.mean(0) ** 2
    matched = -stats.norm.logpdf(targets, mean, np.sqrt(variance))
    matched = matched if matched.ndim == 1 else matched.sum(-1)
    assert float(uncertainty.moment_matched_nll(means, stds, targets)) == pytest.approx(
        matched.mean(), rel=1e-5
    )


def test_crps_of_four_members_matches_numerical_integration(x64):
    means, stds, targets = members(6, shape=(5,))
    got = float(uncertainty.crps(means, stds, targets))
    expected = np.mean(
        [ref_crps(mu, sigma, y) for mu, sigma, y in entries(means, stds, targets)]
    )
    assert got == pytest.approx(expected, rel=1e-5)


def test_crps_in_float32_and_of_one_gaussian():
    means, stds, targets = members(7, shape=(2, 2))
    expected = np.mean(
        [ref_crps(mu, sigma, y) for mu, sigma, y in entries(means, stds, targets)]
    )
    assert float(uncertainty.crps(means, stds, targets)) == pytest.approx(
        expected, rel=2e-5
    )
    # One Gaussian: Gneiting et al. (2005)'s closed form.
    mu, sigma, y = 0.3, 1.7, -1.1
    z = (y - mu) / sigma
    gaussian = sigma * (
        z * (2 * stats.norm.cdf(z) - 1) + 2 * stats.norm.pdf(z) - 1 / math.sqrt(math.pi)
    )
    got = uncertainty.crps(np.array([[mu]]), np.array([[sigma]]), np.array([y]))
    assert float(got) == pytest.approx(gaussian, rel=1e-5)


def test_crps_of_point_members_is_that_of_their_empirical_distribution():
    means = np.array([[0.0], [1.0], [3.0]])
    y = 2.0
    # E|X - y| - 1/2 E|X - X'| over the three atoms.
    expected = np.mean(np.abs(means - y)) - 0.5 * np.mean(np.abs(means - means.T))
    assert float(uncertainty.crps(means, None, np.array([y]))) == pytest.approx(
        expected, rel=1e-6
    )
    # ... the limit of Gaussian members whose spread vanishes.
    tiny = uncertainty.crps(means, np.full_like(means, 1e-4), np.array([y]))
    assert float(tiny) == pytest.approx(expected, abs=1e-4)


def test_rmse_and_mae_of_the_mixture_mean():
    means, stds, targets = members(8, shape=(3, 2))
    error = targets - means.mean(0)
    assert float(uncertainty.rmse(means, stds, targets)) == pytest.approx(
        np.sqrt(np.mean(error**2)), rel=1e-6
    )
    assert float(uncertainty.mae(means, None, targets)) == pytest.approx(
        np.mean(np.abs(error)), rel=1e-6
    )


def test_pit_calibration_error_integrates_the_pit_curve():
    means, stds, targets = members(9, shape=(40,))
    pit = np.array(
        [ref_cdf(mu, sigma, y) for mu, sigma, y in entries(means, stds, targets)]
    )
    grid = np.linspace(0.0, 1.0, 400_001)
    observed = np.searchsorted(np.sort(pit), grid, side="right") / len(pit)
    expected = integrate.trapezoid(np.abs(observed - grid), grid)
    got = float(uncertainty.pit_calibration_error(means, stds, targets))
    assert got == pytest.approx(expected, abs=2e-5)


def test_pit_calibration_error_extremes():
    rng = np.random.default_rng(10)
    targets = rng.normal(size=20_000)
    ones = np.ones((1, 20_000))
    calibrated = float(uncertainty.pit_calibration_error(0 * ones, ones, targets))
    assert calibrated < 0.005
    # Every target far above its predictive: all PIT values 1, area 1/2.
    assert float(
        uncertainty.pit_calibration_error(-100 * ones, ones, targets)
    ) == pytest.approx(0.5)


@pytest.mark.parametrize("level", [0.5, 0.9])
def test_interval_scores_match_scipy_quantiles(level):
    means, stds, targets = members(11, shape=(30,))
    lowers, uppers = [], []
    for mu, sigma, _ in entries(means, stds, targets):
        lowers.append(ref_quantile(mu, sigma, (1 - level) / 2))
        uppers.append(ref_quantile(mu, sigma, (1 + level) / 2))
    lower, upper = np.array(lowers), np.array(uppers)
    covered = np.mean((targets >= lower) & (targets <= upper))
    alpha = 1 - level
    winkler = (upper - lower) + 2 / alpha * (
        np.maximum(lower - targets, 0) + np.maximum(targets - upper, 0)
    )
    assert float(
        uncertainty.interval_coverage(means, stds, targets, level)
    ) == pytest.approx(covered)
    assert float(uncertainty.interval_width(means, stds, level)) == pytest.approx(
        np.mean(upper - lower), rel=1e-5
    )
    assert float(
        uncertainty.interval_score(means, stds, targets, level)
    ) == pytest.approx(winkler.mean(), rel=1e-5)


def test_spread_error_correlation_matches_scipy_spearman():
    means, stds, targets = members(12, shape=(50,))
    stds[:, :10] = 1.0  # ties in the spread
    means[:, :10] = 0.0
    sd = np.sqrt((stds**2 + means**2).mean(0) - means.mean(0) ** 2)
    expected = stats.spearmanr(sd, np.abs(targets - means.mean(0))).statistic
    got = float(uncertainty.spread_error_correlation(means, stds, targets))
    assert got == pytest.approx(expected, abs=1e-5)


# --------------------------------------------------------------------------------
# Recalibration


def test_fit_std_scale_of_one_gaussian_is_the_closed_form():
    means, stds, targets = members(13, num_members=1, shape=(200, 2))
    closed = np.sqrt(np.mean(((targets - means[0]) / stds[0]) ** 2))
    assert float(uncertainty.fit_std_scale(means, stds, targets)) == pytest.approx(
        closed, rel=1e-5
    )


def test_fit_std_scale_of_a_mixture_minimises_its_nll():
    means, stds, targets = members(14, shape=(300,), spread=2.0)
    center = means.mean(0)

    def nll(log_scale):
        scale = np.exp(log_scale)
        scaled = center + scale * (means - center)
        return -ref_log_density(scaled, scale * stds, targets).mean()

    expected = np.exp(
        optimize.minimize_scalar(
            nll, bounds=(-3, 3), method="bounded", options={"xatol": 1e-9}
        ).x
    )
    got = float(uncertainty.fit_std_scale(means, stds, targets))
    assert got == pytest.approx(expected, rel=1e-4)
    scaled_means, scaled_stds = uncertainty.scale_std(means, stds, got)
    assert float(
        uncertainty.mixture_nll(scaled_means, scaled_stds, targets)
    ) == pytest.approx(nll(np.log(got)), rel=1e-5)
    assert float(uncertainty.mixture_nll(scaled_means, scaled_stds, targets)) <= float(
        uncertainty.mixture_nll(means, stds, targets)
    )


def test_scale_std_scales_both_parts_of_the_variance():
    means, stds, _ = members(15)
    scaled_means, scaled_stds = uncertainty.scale_std(means, stds, 3.0)
    np.testing.assert_allclose(
        uncertainty.mixture_mean(scaled_means, scaled_stds), means.mean(0), atol=1e-5
    )
    for part in ("aleatoric_variance", "epistemic_variance"):
        np.testing.assert_allclose(
            getattr(uncertainty, part)(scaled_means, scaled_stds),
            9 * getattr(uncertainty, part)(means, stds),
            rtol=1e-5,
        )
    point_means, point_stds = uncertainty.scale_std(means, None, 2.0)
    assert point_stds is None
    np.testing.assert_allclose(
        uncertainty.epistemic_variance(point_means), 4 * means.var(0), rtol=1e-5
    )


def test_conformal_quantile_and_interval():
    means, stds, targets = members(16, shape=(99,))
    mean = means.mean(0)
    sd = np.sqrt((stds**2 + means**2).mean(0) - mean**2)
    scores = np.sort(np.abs(targets - mean) / sd)
    expected = scores[math.ceil(100 * 0.9) - 1]
    q = float(uncertainty.fit_conformal_quantile(means, stds, targets, level=0.9))
    assert q == pytest.approx(expected, rel=1e-5)
    lower, upper = uncertainty.conformal_interval(means, stds, q)
    np.testing.assert_allclose(lower, mean - q * sd, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(upper, mean + q * sd, rtol=1e-5, atol=1e-5)
    inside = np.mean((targets >= lower) & (targets <= upper))
    assert inside >= 0.9
    tiny = uncertainty.fit_conformal_quantile(
        means[:, :5], stds[:, :5], targets[:5], level=0.9
    )
    assert float(tiny) == math.inf  # ceil(6 * 0.9) = 6 > 5 examples


# --------------------------------------------------------------------------------
# The contract: dtypes, jit, NaN for exactly the invalid entries, clear errors.

_PER_ENTRY = {
    "mixture_mean": lambda m, s, y: uncertainty.mixture_mean(m, s),
    "mixture_variance": lambda m, s, y: uncertainty.mixture_variance(m, s),
    "epistemic_variance": lambda m, s, y: uncertainty.epistemic_variance(m, s),
    "mixture_cdf": uncertainty.mixture_cdf,
    "mixture_log_density": uncertainty.mixture_log_density,
    "mixture_quantile": lambda m, s, y: uncertainty.mixture_quantile(m, s, 0.7),
}
_SCORES = {
    name: getattr(uncertainty, name)
    for name in (
        "mixture_nll",
        "moment_matched_nll",
        "crps",
        "rmse",
        "mae",
        "pit_calibration_error",
        "interval_coverage",
        "interval_score",
        "spread_error_correlation",
        "fit_std_scale",
        "fit_conformal_quantile",
    )
}


@pytest.mark.parametrize("name", sorted(_PER_ENTRY))
def test_invalid_entries_give_nan_there_only(name):
    means, stds, targets = (a.astype(np.float32) for a in members(17, shape=(4,)))
    clean = np.asarray(_PER_ENTRY[name](means, stds, targets))
    for where in ("mean", "std", "target"):
        m, s, y = means.copy(), stds.copy(), targets.copy()
        if where == "mean":
            m[2, 1] = np.nan
        elif where == "std":
            s[0, 1] = -1.0
        else:
            y[1] = np.inf
        got = np.asarray(_PER_ENTRY[name](m, s, y))
        if where == "target" and name not in ("mixture_cdf", "mixture_log_density"):
            np.testing.assert_allclose(got, clean, rtol=1e-6)  # takes no targets
            continue
        assert np.isnan(got[..., 1]).all(), (name, where)
        keep = [0, 2, 3]
        np.testing.assert_allclose(got[..., keep], clean[..., keep], rtol=1e-6)


@pytest.mark.parametrize("name", sorted(_SCORES))
def test_scores_are_nan_if_any_entry_is_invalid_and_jit(name):
    means, stds, targets = (a.astype(np.float32) for a in members(18, shape=(20,)))
    function = _SCORES[name]
    eager = float(function(means, stds, targets))
    assert math.isfinite(eager)
    jitted = float(
        jax.jit(function)(jnp.asarray(means), jnp.asarray(stds), jnp.asarray(targets))
    )
    assert jitted == pytest.approx(eager, rel=1e-5, abs=1e-6)
    means[1, 3] = np.nan
    assert math.isnan(float(function(means, stds, targets)))


@pytest.mark.parametrize(
    "name", ["mixture_nll", "crps", "interval_score", "mixture_variance"]
)
def test_bfloat16_and_float64_inputs(name, x64):
    means, stds, targets = members(19, shape=(8,))
    function = _SCORES.get(name) or (lambda m, s, y: uncertainty.mixture_variance(m, s))
    exact = np.asarray(function(means, stds, targets))
    assert np.asarray(exact).dtype == np.float64
    low = function(*(jnp.asarray(a, jnp.bfloat16) for a in (means, stds, targets)))
    assert low.dtype == jnp.float32  # computed in at least float32
    rounded = [
        np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)
        for a in (means, stds, targets)
    ]
    np.testing.assert_allclose(low, function(*rounded), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(low, exact, rtol=3e-2, atol=3e-2)


def test_scores_are_differentiable_as_their_formulas():
    means, stds, targets = members(20, shape=(5,))

    def reference(m, s):
        member = (
            -0.5 * ((targets[None] - m) / s) ** 2
            - jnp.log(s)
            - 0.5 * jnp.log(2 * jnp.pi)
        )
        return -jnp.mean(jax.nn.logsumexp(member, axis=0) - jnp.log(m.shape[0]))

    args = (jnp.asarray(means, jnp.float32), jnp.asarray(stds, jnp.float32))
    got = jax.grad(lambda m, s: uncertainty.mixture_nll(m, s, targets), argnums=(0, 1))(
        *args
    )
    expected = jax.grad(reference, argnums=(0, 1))(*args)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7)
    tangent = jax.jvp(
        lambda m: uncertainty.crps(m, args[1], targets),
        (args[0],),
        (jnp.ones_like(args[0]),),
    )[1]
    step = 1e-3
    numeric = (
        uncertainty.crps(args[0] + step, args[1], targets)
        - uncertainty.crps(args[0] - step, args[1], targets)
    ) / (2 * step)
    assert float(tangent) == pytest.approx(float(numeric), rel=1e-2)


def test_rejects_bad_inputs_clearly():
    means, stds, targets = members(21)
    with pytest.raises(
        ValueError,
        match=r"`means` must have shape \[E, B\] or \[E, B, D\].*means\[None\]",
    ):
        uncertainty.mixture_mean(means[0])
    with pytest.raises(
        TypeError, match="`means` must be a floating-point array, got dtype int32"
    ):
        uncertainty.mixture_mean(np.ones((2, 3), np.int32))
    with pytest.raises(ValueError, match="`stds` must have the shape of `means`"):
        uncertainty.crps(means, stds[:, :2], targets)
    with pytest.raises(ValueError, match=r"`targets` must have shape \(6,\)"):
        uncertainty.crps(means, stds, targets[:3])
    with pytest.raises(ValueError, match=r"targets\[:, None\]"):
        uncertainty.crps(means[..., None], stds[..., None], targets)
    with pytest.raises(ValueError, match=r"point members.*moment_matched_nll"):
        uncertainty.mixture_nll(means, None, targets)
    with pytest.raises(ValueError, match="`level` must lie strictly between 0 and 1"):
        uncertainty.interval_coverage(means, stds, targets, level=90)
    with pytest.raises(ValueError, match="`levels` must lie strictly between 0 and 1"):
        uncertainty.mixture_quantile(means, stds, np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="`scale` must be positive and finite"):
        uncertainty.scale_std(means, stds, 0.0)
    with pytest.raises(TypeError, match="`targets` must be an array of real targets"):
        uncertainty.crps(means, stds, None)
    with pytest.raises(ValueError, match="`bounds` must satisfy"):
        uncertainty.fit_std_scale(means, stds, targets, bounds=(2.0, 1.0))
    with pytest.raises(ValueError, match="`quantile` must be non-negative"):
        uncertainty.conformal_interval(means, stds, -1.0)
