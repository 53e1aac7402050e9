"""Regression at its edges: no finite wrong number (issue 58).

Each case is a user's call that gave a wrong number, reproduced, against a
float64 reference (scipy) or the documented behaviour: a target of 3e9 held
as int64, a far upper tail, a scale beyond float32, a zero spread with an
unbounded interval, a NaN level under ``jax.jit``, the gradient of a
quantile, NaN PIT values, a tiny spread's CRPS gradient.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize, stats

from ensembles import training, uncertainty
from ensembles.benchmark import QualityData
from ensembles.benchmark.quality.methods import Trained
from ensembles.benchmark.quality.regression.scores import (
    PIT_LEVELS,
    TargetScale,
    evaluate_regression,
)
from ensembles.benchmark.quality.report import summarize
from ensembles.benchmark.quality.tables import gap_lines

BIG = np.array([3_000_000_000, 5], np.int64)  # beyond int32: wrapped without x64
BIG_MEANS = jnp.array([[3e9, 5.0]])

# --- 1. 64-bit integer targets --------------------------------------------------


@pytest.mark.parametrize(
    "score, expected",
    [
        (lambda t: uncertainty.rmse(BIG_MEANS, None, t), 0.0),
        (lambda t: uncertainty.mae(BIG_MEANS, None, t), 0.0),
        (lambda t: uncertainty.crps(BIG_MEANS, jnp.ones((1, 2)), t), 0.2336949),
        (lambda t: uncertainty.mixture_cdf(BIG_MEANS, jnp.ones((1, 2)), t), 0.5),
        (lambda t: uncertainty.mixture_nll(BIG_MEANS, jnp.ones((1, 2)), t), 0.9189385),
        (lambda t: uncertainty.interval_coverage(BIG_MEANS, jnp.ones((1, 2)), t), 1),
        (lambda t: training.mse(BIG_MEANS, t, num_members=1), 0.0),
        (
            lambda t: training.gaussian_nll(
                BIG_MEANS, jnp.ones((1, 2)), t, num_members=1
            ),
            0.9189385,
        ),
    ],
    ids=["rmse", "mae", "crps", "cdf", "nll", "coverage", "mse", "gaussian_nll"],
)
def test_int64_targets_are_not_wrapped(score, expected):
    np.testing.assert_allclose(score(BIG), expected, rtol=1e-6, atol=1e-6)
    # The same as the float64 targets they are.
    np.testing.assert_allclose(score(BIG), score(BIG.astype(np.float64)), rtol=1e-6)


@pytest.mark.slow
def test_the_benchmark_scores_int64_targets_as_their_values():
    """A predictor within about 30 of targets near 3e9: the same figures
    whether the targets come as int64 or float64."""
    rng = np.random.default_rng(0)
    n = 400
    targets = 3_000_000_000 + np.round(30 * rng.standard_normal(n)).astype(np.int64)
    scale = TargetScale(targets)
    x = scale.standardise(targets)[:, None]
    x_noisy = x + 0.5 * rng.standard_normal(x.shape).astype(np.float32)

    def predict(x):
        means = jnp.stack([x[:, 0] + 0.01 * k for k in range(2)])
        return jnp.stack([means, jnp.zeros_like(means)], axis=-1)  # raw spread 0

    trained = Trained("batchensemble", predict, params=1, train_s=0.0)

    def evaluate(y):
        data = QualityData(
            x_noisy, y, x_noisy, y, shifted={1: {"noise": (x_noisy, y)}},
            ood={}, regression=True,
        )  # fmt: skip
        return evaluate_regression(trained, data, x_valid=x_noisy, y_valid=y,
                                   scale=scale)  # fmt: skip

    as_int, as_float = evaluate(targets), evaluate(targets.astype(np.float64))
    for metric in ("rmse", "coverage90", "nll", "crps"):
        np.testing.assert_allclose(
            as_int["in_distribution"][metric],
            as_float["in_distribution"][metric],
            rtol=1e-5,
            err_msg=metric,
        )
    assert as_int["in_distribution"]["rmse"] < 200


# --- 2. the mixture's far tails ---------------------------------------------------

MEANS = jnp.array([[-1.0], [0.5], [2.0]])
STDS = jnp.array([[1.0], [0.5], [2.0]])


def _reference_quantile(level):
    """The float64 quantile of the mixture, by the tail's own function."""
    means, stds = np.float64([-1.0, 0.5, 2.0]), np.float64([1.0, 0.5, 2.0])
    if level > 0.5:
        equation = lambda y: np.mean(stats.norm.sf((y - means) / stds)) - (1 - level)  # noqa: E731
    else:
        equation = lambda y: np.mean(stats.norm.cdf((y - means) / stds)) - level  # noqa: E731
    return optimize.brentq(equation, -100, 100, xtol=1e-15, rtol=1e-15)


@pytest.mark.parametrize("level", [1e-7, 1e-3, 0.3, 0.7, 0.999, 1 - 1e-6, 1 - 1e-7])
def test_quantiles_of_both_tails_to_float32_precision(level):
    level = float(np.float32(level))  # the level float32 holds
    quantile = float(uncertainty.mixture_quantile(MEANS, STDS, level)[0])
    reference = _reference_quantile(level)
    assert abs(quantile - reference) <= 4e-7 * abs(reference), (quantile, reference)


def test_quantiles_in_float64_reach_far_upper_tails(x64):
    """The upper quantile at ``1 - t`` equals the mirrored mixture's lower one
    at the same tail (``1 - (1 - t)``: exact in floating point)."""
    means, stds = MEANS.astype(jnp.float64), STDS.astype(jnp.float64)
    for level in (1 - 1e-12, 1 - 1e-9):
        upper = float(uncertainty.mixture_quantile(means, stds, level)[0])
        mirrored = -float(uncertainty.mixture_quantile(-means, stds, 1 - level)[0])
        assert abs(upper - mirrored) <= 1e-14 * abs(mirrored), (level, upper, mirrored)


def test_a_symmetric_mixture_s_interval_is_symmetric():
    means, stds = jnp.array([[-1.0], [1.0]]), jnp.ones((2, 1))
    for level in (0.9, 0.99999, 1 - 1e-9):
        lower, upper = uncertainty.mixture_interval(means, stds, level)
        assert float(lower[0]) == -float(upper[0]), (level, lower, upper)
    # interval_width agrees, finite: both tails resolved.
    width = uncertainty.interval_width(means, stds, level=1 - 1e-9)
    np.testing.assert_allclose(width, float(upper[0] - lower[0]), rtol=1e-6)


# --- 3. a fit whose NLL overflows ----------------------------------------------


def test_fit_std_scale_when_every_z_squared_overflows():
    """Stds of 1e-30 against errors of 1: the NLL overflows float32 at every
    scale, and grows without bound as the scale shrinks; the minimiser is the
    upper bound, which the fit returns (and warns of)."""
    with pytest.warns(UserWarning, match="upper bound 20"):
        scale = uncertainty.fit_std_scale(
            jnp.zeros((2, 3)), jnp.full((2, 3), 1e-30), jnp.ones(3)
        )
    assert float(scale) == pytest.approx(20.0, rel=1e-6)


def test_fit_std_scale_warns_at_a_bound_and_not_inside():
    keys = jax.random.split(jax.random.key(0), 2)
    targets = 100.0 * jax.random.normal(keys[0], (500,))
    with pytest.warns(UserWarning, match="upper bound 20"):
        uncertainty.fit_std_scale(jnp.zeros((2, 500)), jnp.ones((2, 500)), targets)
    with pytest.warns(UserWarning, match="lower bound 0.05"):
        uncertainty.fit_std_scale(
            jnp.zeros((2, 500)), jnp.ones((2, 500)), 1e-4 * targets
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scale = uncertainty.fit_std_scale(
            jnp.zeros((2, 500)), jnp.ones((2, 500)), targets / 50
        )
        assert 1.5 < float(scale) < 2.5
        jax.jit(uncertainty.fit_std_scale)(  # traced: nothing to warn of
            jnp.zeros((2, 500)), jnp.ones((2, 500)), targets
        )


# --- 4. an unbounded conformal interval ----------------------------------------


def test_an_infinite_conformal_quantile_is_unbounded_for_agreeing_members():
    means = jnp.array([[1.0, 2.0], [1.0, 3.0]])  # agree on example 0: sd 0
    quantile = uncertainty.fit_conformal_quantile(
        means, None, jnp.array([1.0, 2.5]), level=0.9
    )
    assert float(quantile) == math.inf  # too few points for the level
    lower, upper = uncertainty.conformal_interval(means, None, quantile)
    assert np.all(np.asarray(lower) == -np.inf) and np.all(np.asarray(upper) == np.inf)


# --- 5. a NaN level under jit ----------------------------------------------------


@pytest.mark.parametrize("stds", [None, jnp.ones((3, 2))], ids=["point", "gaussian"])
def test_a_nan_level_under_jit_is_nan(stds):
    means = jnp.array([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])
    quantile = jax.jit(uncertainty.mixture_quantile)(means, stds, jnp.nan)
    assert np.all(np.isnan(np.asarray(quantile))), quantile
    with pytest.raises(ValueError, match="`levels` must lie strictly between"):
        uncertainty.mixture_quantile(means, stds, math.nan)


# --- 6. the gradient of a quantile ------------------------------------------------


def test_the_gradient_of_a_quantile_is_the_implicit_function_s():
    """``dq/dmu_k = pdf_k(q) / sum pdf``, ``dq/dsigma_k = pdf_k(q) z_k / sum
    pdf``, ``dq/dlevel = 1 / f(q)``, against a float64 reference."""
    level = 0.7
    q = _reference_quantile(level)
    means, stds = np.float64([-1.0, 0.5, 2.0]), np.float64([1.0, 0.5, 2.0])
    z = (q - means) / stds
    pdf = stats.norm.pdf(z) / stds
    d_means = jax.grad(lambda m: uncertainty.mixture_quantile(m, STDS, level)[0])(MEANS)
    np.testing.assert_allclose(d_means[:, 0], pdf / pdf.sum(), rtol=1e-5)
    d_stds = jax.grad(lambda s: uncertainty.mixture_quantile(MEANS, s, level)[0])(STDS)
    np.testing.assert_allclose(d_stds[:, 0], pdf * z / pdf.sum(), rtol=1e-5)
    d_level = jax.grad(
        lambda t: uncertainty.mixture_quantile(MEANS, STDS, jnp.array([t]))[0, 0]
    )(jnp.float32(level))
    np.testing.assert_allclose(d_level, 1 / np.mean(pdf), rtol=1e-5)
    # Through the interval and its scores too.
    d_width = jax.grad(lambda m: uncertainty.interval_width(m, STDS, level=0.5))(MEANS)
    assert np.all(np.isfinite(np.asarray(d_width)))
    np.testing.assert_allclose(float(jnp.sum(d_width)), 0.0, atol=1e-5)  # a shift


def test_quantile_gradients_in_a_far_tail_keep_their_proportions():
    level = 1e-7
    grads = jax.grad(lambda m: uncertainty.mixture_quantile(m, STDS, level)[0])(MEANS)
    assert np.all(np.isfinite(np.asarray(grads)))
    np.testing.assert_allclose(float(jnp.sum(grads)), 1.0, rtol=1e-5)


# --- 7. NaN PIT values in the benchmark ---------------------------------------------


def _pit_curve(predict_nan_share):
    rng = np.random.default_rng(1)
    y = rng.standard_normal(40)
    scale = TargetScale(y)
    x = scale.standardise(y)[:, None]

    def predict(x):
        means = jnp.stack([x[:, 0], x[:, 0] + 0.1])
        bad = jnp.arange(x.shape[0]) < int(predict_nan_share * x.shape[0])
        means = jnp.where(bad[None], jnp.nan, means)
        return jnp.stack([means, jnp.zeros_like(means)], axis=-1)

    data = QualityData(x, y, x, y, shifted={1: {"noise": (x, y)}}, ood={},
                       regression=True)  # fmt: skip
    trained = Trained("batchensemble", predict, params=1, train_s=0.0)
    return evaluate_regression(trained, data, x_valid=x, y_valid=y, scale=scale)


def test_nan_pit_values_make_a_nan_curve():
    curve = _pit_curve(0.25)["pit_curve"]
    assert len(curve) == len(PIT_LEVELS)
    assert all(math.isnan(value) for value in curve), curve
    finite = _pit_curve(0.0)["pit_curve"]
    assert all(0 <= value <= 1 for value in finite)
    assert finite == sorted(finite)  # a CDF


# --- 8. the lesser ones ------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e39, 1e-46])
def test_a_scale_float32_cannot_hold_is_refused(scale):
    with pytest.raises(
        ValueError, match=r"`scale` \(=.*\) must be positive and finite"
    ):
        uncertainty.scale_std(jnp.zeros((2, 2)), jnp.ones((2, 2)), scale)


def test_the_crps_gradient_of_a_tiny_valid_spread(x64):
    means = jnp.array([[0.0, 1.0], [0.5, 0.2]])
    targets = jnp.array([0.1, 0.5])

    def grad(dtype, sd):
        stds = jnp.full((2, 2), sd, dtype)
        return jax.grad(lambda s: uncertainty.crps(means.astype(dtype), s, targets))(
            stds
        )

    # 1e-23 squared is below float32's smallest subnormal: 0 on every backend.
    for sd in (1e-23, 1e-20, 0.3):
        np.testing.assert_allclose(
            grad(jnp.float32, sd), grad(jnp.float64, sd), rtol=1e-5, atol=1e-7
        )


@pytest.mark.parametrize("min_std", [math.inf, math.nan, -1.0])
def test_gaussian_head_refuses_a_floor_that_is_not_finite(min_std):
    with pytest.raises(ValueError, match="`min_std` must be finite and >= 0"):
        training.gaussian_head(jnp.zeros((2, 2)), min_std=min_std)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_float_labels_get_the_cast_hint_and_the_regression_pointer(dtype):
    logits = jnp.zeros((1, 2, 3))
    with pytest.raises(TypeError, match=r"labels.astype\(jnp.int32\)"):
        uncertainty.nll(logits, jnp.array([0, 1], dtype))
    with pytest.raises(TypeError, match="regression problem"):
        uncertainty.nll(logits, jnp.array([0.5, 1.25], dtype))


def test_a_member_axis_error_says_what_the_axes_should_be():
    with pytest.raises(ValueError, match=r"have no axis after B") as info:
        training.mse(jnp.zeros((3, 4)), jnp.zeros(4), num_members=2)
    assert "no output axes" not in str(info.value)


def _rows(seeds):
    """Rows of a regression run: one model far from a deep ensemble."""
    rows = []
    for seed in range(seeds):
        for method, nll in (
            ("single", 3.0),
            ("batchensemble", 2.5),
            ("deep_ensemble", 2.0),
        ):
            sets = {
                "in_distribution": {"nll": nll + 0.01 * seed, "crps": nll},
                "shift_mean": {"nll": nll + 0.01 * seed, "crps": nll},
            }
            rows.append(
                {"task": "cubic", "model": "mlp", "members": 4, "method": method,
                 "seed": seed, "regression": True, **sets,
                 "recalibrated": sets}
            )  # fmt: skip
    return rows


def test_gap_closed_needs_seeds_that_tell_a_gap_from_noise():
    one = summarize(_rows(1))
    assert not any("gap_closed" in entry for entry in one)
    assert "at least two seeds" in gap_lines(one, "nll")
    two = summarize(_rows(2))
    closed = next(e for e in two if e["method"] == "batchensemble")["gap_closed"]
    assert closed["in_distribution"] == pytest.approx(0.5, abs=0.02)
