"""The uncertainty functions at their edges, round two (issue 67).

Each case is a user's call that raised or gave a wrong number, reproduced
against an independent reference (numpy in float64, a closed form, the
docs' own contracts):

* every regression and calibration function gives under ``jax.jit`` what
  it gives eagerly, for a scalar given as a Python float, a numpy scalar or
  a concrete array, and for invalid entries (NaN both ways);
* the quality benchmark reports NaN figures for a method whose predictions
  are NaN on some inputs (the noisy copies, some test examples);
* ``noisy_copies`` keeps 64-bit integer targets as they are;
* a root of a mean of squares in float32 neither overflows nor underflows
  (``fit_member_std_scales``, ``fit_std_scale``'s one-member closed form,
  ``rmse``, the mixture's standard deviation of the conformal intervals);
* numpy bfloat16 arrays are arrays; divergences are never negative; a
  boolean scale is refused; one strength is a strength.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ensembles import uncertainty
from ensembles.benchmark import QualityData
from ensembles.benchmark.quality.calibration import REGRESSOR_CALIBRATIONS
from ensembles.benchmark.quality.classification.scores import evaluate
from ensembles.benchmark.quality.methods import Trained
from ensembles.benchmark.quality.regression.scores import (
    TargetScale,
    evaluate_regression,
)
from ensembles.uncertainty import classification, regression
from ensembles.uncertainty.classification import calibration
from ensembles.uncertainty.regression import calibration as regression_calibration
from ensembles.uncertainty.regression import conformal, metrics, mixture

# --- 1. jit equals eager -------------------------------------------------------------

_KEYS = jax.random.split(jax.random.key(67), 4)
ARRAYS = {
    "means": jax.random.normal(_KEYS[0], (3, 6)),
    "stds": 0.5 + jax.random.uniform(_KEYS[1], (3, 6)),
    "targets": jax.random.normal(_KEYS[2], (6,)),
    "logits": 2.0 * jax.random.normal(_KEYS[3], (3, 6, 4)),
    "labels": jnp.array([0, 1, 2, 3, 0, 1]),
}

#: name -> (the arrays it takes, in order, and the scalar option after them,
#: or None). The arrays are traced under jit; the option is closed over, as
#: a user writes it (``scale_std(means, stds, 1.7)`` inside a jitted step).
CASES = {
    "aleatoric_variance": (("means", "stds"), None),
    "epistemic_variance": (("means", "stds"), None),
    "mixture_mean": (("means", "stds"), None),
    "mixture_variance": (("means", "stds"), None),
    "pairwise_gaussian_kl": (("means", "stds"), None),
    "mixture_log_density": (("means", "stds", "targets"), None),
    "mixture_cdf": (("means", "stds", "targets"), None),
    "mixture_quantile": (("means", "stds"), 0.3),
    "mixture_interval": (("means", "stds"), 0.8),
    "crps": (("means", "stds", "targets"), None),
    "mae": (("means", "stds", "targets"), None),
    "rmse": (("means", "stds", "targets"), None),
    "mixture_nll": (("means", "stds", "targets"), None),
    "moment_matched_nll": (("means", "stds", "targets"), None),
    "pit_calibration_error": (("means", "stds", "targets"), None),
    "spread_error_correlation": (("means", "stds", "targets"), None),
    "interval_coverage": (("means", "stds", "targets"), 0.8),
    "interval_score": (("means", "stds", "targets"), 0.8),
    "interval_width": (("means", "stds"), 0.8),
    "fit_std_scale": (("means", "stds", "targets"), None),
    "fit_member_std_scales": (("means", "stds", "targets"), None),
    "scale_std": (("means", "stds"), 1.7),
    "scale_member_stds": (("means", "stds"), [0.5, 1.0, 2.0]),
    "fit_conformal_quantile": (("means", "stds", "targets"), 0.8),
    "conformal_interval": (("means", "stds"), 1.3),
    "fit_conformal_margin": (("means", "stds", "targets"), 0.8),
    "conformal_mixture_interval": (("means", "stds"), 0.3),
    "fit_temperature": (("logits", "labels"), None),
    "fit_member_temperatures": (("logits", "labels"), None),
    "scale_temperature": (("logits",), 1.7),
    "scale_member_temperatures": (("logits",), [0.5, 1.0, 2.0]),
}

#: The options that may be traced too (a parameter fitted in the same step);
#: the others (a level) are static, as documented.
TRACEABLE = {
    "mixture_quantile",
    "scale_std",
    "scale_member_stds",
    "conformal_interval",
    "conformal_mixture_interval",
    "scale_temperature",
    "scale_member_temperatures",
}

SCALAR_FORMS = {
    "python": lambda v: v,
    "numpy": lambda v: np.asarray(v, np.float32)[()],
    "concrete": jnp.asarray,
}


def test_the_table_covers_every_regression_and_calibration_function():
    modules = (mixture, metrics, regression_calibration, conformal, calibration)
    names = {
        name
        for kind in (classification, regression)
        for name in kind.__all__
        if getattr(kind, name).__module__ in {module.__name__ for module in modules}
    }
    assert names == set(CASES), names ^ set(CASES)


def _poisoned(arrays):
    """One invalid entry: a NaN mean of example 2, a NaN logit of example 2."""
    return {
        **arrays,
        "means": arrays["means"].at[1, 2].set(jnp.nan),
        "logits": arrays["logits"].at[0, 2, 1].set(jnp.nan),
    }


def _assert_same(eager, jitted):
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, equal_nan=True
        )
        assert np.array_equal(np.isnan(np.asarray(a)), np.isnan(np.asarray(b)))


@pytest.mark.parametrize(
    "name, form",
    [
        (name, form)
        for name, (_, option) in CASES.items()
        for form in (SCALAR_FORMS if option is not None else ["python"])
    ],
)
def test_jit_equals_eager(name, form):
    """Valid inputs, then one invalid entry (NaN both ways), one program."""
    function = getattr(uncertainty, name)
    names, option = CASES[name]
    extra = () if option is None else (SCALAR_FORMS[form](option),)
    jitted = jax.jit(lambda *a: function(*a, *extra))
    traced = jax.jit(function) if name in TRACEABLE and form == "concrete" else None
    for arrays in (ARRAYS, _poisoned(ARRAYS)):
        args = [arrays[n] for n in names]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "fit_std_scale ended at")
            eager = function(*args, *extra)
            _assert_same(eager, jitted(*args))
            if traced is not None:
                _assert_same(eager, traced(*args, *extra))
    assert np.isnan(np.asarray(jax.tree.leaves(eager)[0])).any(), name


#: A known bad option under jit: the error of the eager call, at trace time.
BAD_OPTIONS = {
    "scale nan": (lambda m, s: uncertainty.scale_std(m, s, math.nan), "`scale`"),
    "scale -1": (lambda m, s: uncertainty.scale_std(m, s, -1.0), "`scale`"),
    "scale 1e39": (lambda m, s: uncertainty.scale_std(m, s, 1e39), "`scale`"),
    "scales": (
        lambda m, s: uncertainty.scale_member_stds(m, s, [1.0, 0.0, 2.0]),
        "`scales`",
    ),
    "level": (lambda m, s: uncertainty.mixture_quantile(m, s, 1.5), "`levels`"),
    "levels": (
        lambda m, s: uncertainty.mixture_quantile(m, s, np.array([0.2, 1.5])),
        "`levels`",
    ),
    "quantile": (lambda m, s: uncertainty.conformal_interval(m, s, -1.0), "`quantile`"),
    "temperature": (
        lambda m, s: uncertainty.scale_temperature(ARRAYS["logits"], 0.0),
        "`temperature`",
    ),
    "temperatures": (
        lambda m, s: uncertainty.scale_member_temperatures(
            ARRAYS["logits"], np.array([1.0, 0.0, 1.0])
        ),
        "`temperatures`",
    ),
}


@pytest.mark.parametrize("call, name", BAD_OPTIONS.values(), ids=BAD_OPTIONS)
def test_a_known_bad_option_under_jit_raises_as_eagerly(call, name):
    means, stds = ARRAYS["means"], ARRAYS["stds"]
    with pytest.raises(ValueError, match=name) as eager:
        call(means, stds)
    with pytest.raises(ValueError, match=name) as jitted:
        jax.jit(call)(means, stds)
    assert str(jitted.value) == str(eager.value)


def test_a_traced_bad_scale_gives_nan():
    """Its value unknown when traced: NaN, as documented."""
    with np.errstate(over="ignore"):  # 1e39 is inf in float32
        scales = [jnp.float32(v) for v in (math.nan, -1.0, 1e39)]
    for scale in scales:
        scaled = jax.jit(uncertainty.scale_std)(ARRAYS["means"], ARRAYS["stds"], scale)
        assert np.isnan(np.asarray(scaled[0])).all()


# --- 2. NaN predictions in the quality benchmark -------------------------------------


def _evaluate(test_shift):
    """A regressor whose predictions are NaN off a grid of quarters: finite on
    the validation inputs (on the grid), NaN on their noisy copies, and, with
    ``test_shift``, on every test input."""
    rng = np.random.default_rng(1)
    y = rng.standard_normal(40)
    scale = TargetScale(y)
    x = np.round(scale.standardise(y)[:, None] * 4) / 4
    x_test = x + test_shift

    def predict(x):
        x = jnp.asarray(x)
        means = jnp.stack([x[:, 0], x[:, 0] + 0.1])
        off_grid = 4 * x[:, 0] != jnp.round(4 * x[:, 0])
        means = jnp.where(off_grid[None], jnp.nan, means)
        return jnp.stack([means, jnp.zeros_like(means)], axis=-1)

    data = QualityData(x, y, x_test, y, shifted={1: {"noise": (x_test, y)}},
                       ood={}, regression=True)  # fmt: skip
    trained = Trained("batchensemble", predict, params=1, train_s=0.0)
    return evaluate_regression(trained, data, x_valid=x, y_valid=y, scale=scale)


def test_nan_predictions_on_the_noisy_copies_give_nan_figures():
    result = _evaluate(test_shift=0.0)
    assert not result["diverged"] and math.isfinite(result["std_scale"])
    assert math.isfinite(result["in_distribution"]["nll"])
    for name in ("pooled_noisy", "members_noisy", "members_noisy_pooled", "spread"):
        calibrated = result["calibrations"][name]
        assert math.isnan(calibrated["std_scale"]), name
        assert all(math.isnan(v) for v in calibrated["in_distribution"].values())
    members = result["calibrations"]["members"]  # fitted on the clean split
    assert math.isfinite(members["std_scale"])
    assert math.isfinite(members["in_distribution"]["crps"])
    assert set(result["calibrations"]) == set(REGRESSOR_CALIBRATIONS)


def test_nan_predictions_on_the_test_inputs_give_nan_figures():
    result = _evaluate(test_shift=0.01)
    assert all(math.isnan(v) for v in result["in_distribution"].values())
    assert all(math.isnan(v) for v in result["pit_curve"])  # never "above all"
    assert all(math.isnan(v) for v in result["recalibrated"]["pit_curve"])
    for calibrated in result["calibrations"].values():
        assert all(math.isnan(v) for v in calibrated["in_distribution"].values())


@pytest.mark.slow  # a classifier's whole evaluation: about 8 CPU-seconds
def test_a_classifier_nan_on_the_noisy_copies_gets_nan_calibrations():
    """The classifier's calibrations alike: NaN logits off the grid."""
    x = (np.arange(40) % 8 / 4).astype(np.float32)[:, None]
    y = np.arange(40) % 2

    def predict(x):
        x = jnp.asarray(x)
        logits = jnp.stack([x, -x], axis=-1)  # [N, 1, 2]
        logits = jnp.stack([logits[:, 0], 0.5 * logits[:, 0]])  # [E, N, C]
        off_grid = 4 * x[:, 0] != jnp.round(4 * x[:, 0])
        return jnp.where(off_grid[None, :, None], jnp.nan, logits)

    data = QualityData(x, y, x, y, shifted={1: {"noise": (x, y)}}, ood={})
    trained = Trained("batchensemble", predict, params=1, train_s=0.0)
    result = evaluate(trained, data, x_valid=x, y_valid=y)
    assert not result["diverged"] and math.isfinite(result["temperature"])
    for name in ("pooled_noisy", "members_noisy", "members_noisy_pooled"):
        calibrated = result["calibrations"][name]
        assert math.isnan(calibrated["temperature"]), name
        assert all(math.isnan(v) for v in calibrated["in_distribution"].values())
    assert math.isfinite(result["calibrations"]["members"]["temperature"])


# --- 3. targets that no conversion may wrap ------------------------------------------


@pytest.mark.parametrize(
    "targets",
    [
        np.array([3_000_000_000, 5, -4_000_000_000], np.int64),
        np.array([2**40, 7, 2**63 + 5], np.uint64),
        np.array([1e300, -2.5, 3.0]),
    ],
    ids=["int64", "uint64", "float64"],
)
def test_noisy_copies_keep_targets_as_they_are(targets):
    _, copied = uncertainty.noisy_copies(
        np.zeros((3, 2), np.float32),
        targets,
        feature_std=1.0,
        strengths=(0.1, 0.2),
        key=jax.random.key(0),
    )
    assert copied.dtype == targets.dtype  # "unchanged in dtype", as documented
    np.testing.assert_array_equal(np.asarray(copied), np.tile(targets, 3))


def test_noisy_copies_of_jax_targets_stay_jax_arrays():
    labels = jnp.array([0, 1, 2])
    _, copied = uncertainty.noisy_copies(
        jnp.zeros((3, 2)), labels, feature_std=1.0, key=jax.random.key(0)
    )
    assert isinstance(copied, jax.Array) and copied.dtype == labels.dtype
    np.testing.assert_array_equal(copied, np.tile(labels, 4))


def test_a_noisy_calibration_of_int64_targets_fits_their_values():
    """Targets near 3e9 given as int64, members at 3e9 with spreads of 1000:
    the scale fitted on the noisy set is the one of the same targets as
    float64, near 1 (wrapped, it was at its bound, 20)."""
    rng = np.random.default_rng(0)
    targets = 3_000_000_000 + np.round(1000 * rng.standard_normal(200)).astype(np.int64)
    _, copied = uncertainty.noisy_copies(
        np.zeros((200, 1), np.float32), targets, feature_std=1.0,
        strengths=(0.05,), key=jax.random.key(1),
    )  # fmt: skip
    means, stds = jnp.full((2, 400), 3e9), jnp.full((2, 400), 1000.0)
    as_int = uncertainty.fit_std_scale(means, stds, copied)
    as_float = uncertainty.fit_std_scale(means, stds, copied.astype(np.float64))
    np.testing.assert_allclose(as_int, as_float, rtol=1e-5)
    reference = np.sqrt(np.mean(((targets - 3e9) / 1000.0) ** 2))  # one Gaussian
    np.testing.assert_allclose(float(as_int), reference, rtol=1e-2)


def test_one_strength_is_a_strength():
    x, _ = uncertainty.noisy_copies(
        jnp.zeros((2, 3)), jnp.zeros(2), feature_std=1.0, strengths=0.1,
        key=jax.random.key(0),
    )  # fmt: skip
    assert x.shape == (4, 3)
    for bad in (True, "0.1", None):
        with pytest.raises(TypeError, match="`strengths`"):
            uncertainty.noisy_copies(
                jnp.zeros((2, 3)), jnp.zeros(2), feature_std=1.0, strengths=bad,
                key=jax.random.key(0),
            )  # fmt: skip


# --- 4. roots of means of squares ----------------------------------------------------

SIGNS = jnp.array([1.0, -1.0, 1.0, -1.0])


@pytest.mark.parametrize(
    "stds, errors", [(1e-25, 1.25), (1.0, 1.25e-25), (1e20, 1.25e20), (1.0, 3e-20)]
)
def test_member_std_scales_do_not_over_or_underflow(stds, errors):
    means = jnp.zeros((2, 4))
    member_stds = jnp.full((2, 4), stds)
    targets = errors * SIGNS
    exact = errors / stds  # sqrt(mean(z^2)) of |z| all equal
    scales = uncertainty.fit_member_std_scales(
        means, member_stds, targets, bounds=(1e-30, 1e30)
    )
    np.testing.assert_allclose(scales, [exact, exact], rtol=1e-5)


@pytest.mark.parametrize("stds, errors", [(1e-25, 1.25), (1.0, 1.25e-25)])
def test_the_one_member_closed_form_at_tiny_scales(stds, errors):
    """``s^2 = mean(((y - mu) / sigma)^2)`` to float precision, as documented."""
    rng = np.random.default_rng(2)
    magnitudes = errors * (0.5 + rng.random(8))
    targets = magnitudes * np.tile([1.0, -1.0], 4)
    exact = math.sqrt(np.mean((magnitudes / stds) ** 2))
    scale = uncertainty.fit_std_scale(
        jnp.zeros((1, 8)),
        jnp.full((1, 8), stds),
        jnp.asarray(targets, jnp.float32),
        bounds=(1e-30, 1e30),
    )
    np.testing.assert_allclose(float(scale), exact, rtol=1e-4)


@pytest.mark.parametrize("size", [1e-25, 1e25])
def test_rmse_of_tiny_and_huge_errors(size):
    targets = jnp.array([3.0, -4.0]) * size
    np.testing.assert_allclose(
        uncertainty.rmse(jnp.zeros((2, 2)), None, targets),
        math.sqrt(12.5) * size,
        rtol=1e-6,
    )


def test_conformal_intervals_of_tiny_spreads():
    """The mixture's standard deviation of stds 1e-25: 1e-25 (its variance,
    1e-50, is below float32's range), so the normalised errors are finite."""
    means = jnp.zeros((2, 50))
    stds = jnp.full((2, 50), 1e-25)
    targets = 1e-25 * jax.random.normal(jax.random.key(0), (50,))
    quantile = uncertainty.fit_conformal_quantile(means, stds, targets, level=0.9)
    reference = np.sort(np.abs(np.asarray(targets, np.float64)) / 1e-25)[45]
    np.testing.assert_allclose(float(quantile), reference, rtol=1e-5)
    lower, upper = uncertainty.conformal_interval(means, stds, quantile)
    np.testing.assert_allclose(upper, np.full(50, reference * 1e-25), rtol=1e-5)
    np.testing.assert_allclose(lower, -np.asarray(upper), rtol=1e-6)


def test_moment_matched_nll_of_tiny_spreads():
    """N(0, 1e-50) at 0: log(sqrt(2 pi) 1e-25), finite, where the variance
    underflows float32."""
    nll = uncertainty.moment_matched_nll(
        jnp.zeros((2, 3)), jnp.full((2, 3), 1e-25), jnp.zeros(3)
    )
    np.testing.assert_allclose(
        float(nll), 0.5 * math.log(2 * math.pi) + math.log(1e-25), rtol=1e-6
    )


# --- 5. the lesser ones --------------------------------------------------------------


def _bf16(array):
    return np.asarray(array, np.float32).astype(ml_dtypes.bfloat16)


def test_numpy_bfloat16_arrays_are_arrays():
    logits = _bf16(ARRAYS["logits"])
    labels = np.asarray(ARRAYS["labels"])
    as_jax = jnp.asarray(logits)
    for name in ("pairwise_kl", "pairwise_disagreement", "mutual_information"):
        function = getattr(uncertainty, name)
        np.testing.assert_array_equal(function(logits), function(as_jax))
    np.testing.assert_array_equal(
        uncertainty.fit_member_temperatures(logits, labels),
        uncertainty.fit_member_temperatures(as_jax, labels),
    )
    np.testing.assert_array_equal(
        uncertainty.scale_member_temperatures(logits, _bf16([1.0, 2.0, 0.5])),
        uncertainty.scale_member_temperatures(as_jax, jnp.array([1.0, 2.0, 0.5])),
    )
    np.testing.assert_array_equal(
        uncertainty.scale_temperature(logits, _bf16(2.0)[()]),
        uncertainty.scale_temperature(as_jax, 2.0),
    )
    x, _ = uncertainty.noisy_copies(
        _bf16(np.ones((2, 3))), labels[:2], feature_std=_bf16(1.0),
        key=jax.random.key(0),
    )  # fmt: skip
    assert x.dtype == jnp.float32 and x.shape == (8, 3)
    means, stds = _bf16(ARRAYS["means"]), _bf16(ARRAYS["stds"])
    np.testing.assert_array_equal(
        uncertainty.crps(means, stds, _bf16(ARRAYS["targets"])),
        uncertainty.crps(
            jnp.asarray(means), jnp.asarray(stds), jnp.asarray(_bf16(ARRAYS["targets"]))
        ),
    )


def test_pairwise_kl_of_identical_members_is_zero_and_never_negative():
    row = jax.random.normal(jax.random.key(3), (1, 64, 10)) * 1.7
    identical = jnp.concatenate([row, row, row])
    np.testing.assert_array_equal(uncertainty.pairwise_kl(identical), 0.0)
    near = identical + 1e-6 * jax.random.normal(jax.random.key(4), identical.shape)
    assert float(jnp.min(uncertainty.pairwise_kl(near))) >= 0.0
    means = jnp.ones((3, 64)) + 1e-7 * jax.random.normal(jax.random.key(5), (3, 64))
    kl = uncertainty.pairwise_gaussian_kl(means, jnp.full((3, 64), 1.3))
    assert float(jnp.min(kl)) >= 0.0


def test_boolean_scales_are_refused_as_boolean_temperatures_are():
    means, stds = ARRAYS["means"], ARRAYS["stds"]
    with pytest.raises(TypeError, match="`scales` must be real numbers"):
        uncertainty.scale_member_stds(means, stds, jnp.array([True, True, True]))
    with pytest.raises(TypeError, match="`temperatures` must be real numbers"):
        uncertainty.scale_member_temperatures(
            ARRAYS["logits"], jnp.array([True, True, True])
        )
    with pytest.raises(TypeError, match="`scale` must be a real number"):
        uncertainty.scale_std(means, stds, True)


def test_the_quality_benchmark_takes_bfloat16_sets():
    x = _bf16(np.linspace(-1, 1, 30).reshape(10, 3))
    y = np.arange(10) % 2
    data = QualityData(x, y, x, y, shifted={1: {"noise": (x, y)}}, ood={"far": x})
    assert data.num_classes == 2
    targets = _bf16(np.linspace(0, 1, 10))
    data = QualityData(x, targets, x, targets, shifted={1: {"noise": (x, targets)}},
                       ood={}, regression=True)  # fmt: skip
    assert data.target_shape == ()
