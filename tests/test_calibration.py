"""Temperature scaling (uncertainty/classification/calibration.py) against float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ensembles import uncertainty


def _log_predictive(logits):
    """float64 numpy: log of the mean member softmax, [B, C]."""
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):  # log 0 = -inf for a ruled-out class
        return np.log(probs.mean(0))


def _nll_at(logits, labels, temperature):
    z = _log_predictive(logits) / temperature
    z = z - z.max(-1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.mean(log_probs[np.arange(len(labels)), labels])


def _reference_temperature(logits, labels, low=0.05, high=20.0):
    """float64 numpy: a dense log grid, then golden-section search around its best."""
    grid = np.exp(np.linspace(np.log(low), np.log(high), 4001))
    values = [_nll_at(logits, labels, t) for t in grid]
    best = int(np.argmin(values))
    a, b = np.log(grid[max(best - 1, 0)]), np.log(grid[min(best + 1, len(grid) - 1)])
    ratio = (np.sqrt(5) - 1) / 2
    for _ in range(100):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if _nll_at(logits, labels, np.exp(c)) < _nll_at(logits, labels, np.exp(d)):
            b = d
        else:
            a = c
    return float(np.exp((a + b) / 2))


def _disagreeing_ensemble(seed=0, members=4, examples=300, classes=5):
    """Members that are each confident and often disagree: underconfident pool."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, examples)
    truth = np.eye(classes)[labels] * 3.0
    logits = truth[None] + rng.normal(0.0, 2.5, (members, examples, classes))
    return jnp.asarray(logits, jnp.float32), jnp.asarray(labels)


def _overconfident_model(seed=1, examples=300, classes=5):
    """One member whose logits are five times too large: overconfident."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, examples)
    logits = np.eye(classes)[labels] * 1.0 + rng.normal(0.0, 1.0, (examples, classes))
    return jnp.asarray(5.0 * logits[None], jnp.float32), jnp.asarray(labels)


@pytest.mark.parametrize(
    "make, side", [(_disagreeing_ensemble, "below"), (_overconfident_model, "above")]
)
def test_fit_temperature_matches_float64_numpy(make, side):
    logits, labels = make()
    fitted = float(uncertainty.fit_temperature(logits, labels))
    reference = _reference_temperature(np.asarray(logits), np.asarray(labels))
    assert fitted == pytest.approx(reference, rel=2e-3)
    assert (fitted < 1.0) if side == "below" else (fitted > 1.0)
    # It minimises the NLL: no lower at the reference, or a little either side.
    nll = _nll_at(np.asarray(logits), np.asarray(labels), fitted)
    for other in (reference, fitted * 0.97, fitted * 1.03):
        assert nll <= _nll_at(np.asarray(logits), np.asarray(labels), other) + 1e-6


def test_fit_temperature_eager_equals_jit_and_takes_any_integer_labels():
    logits, labels = _disagreeing_ensemble()
    eager = uncertainty.fit_temperature(logits, labels)
    jitted = jax.jit(uncertainty.fit_temperature)(logits, labels)
    assert eager.dtype == jnp.float32
    np.testing.assert_allclose(eager, jitted, rtol=1e-6)
    np.testing.assert_allclose(
        uncertainty.fit_temperature(logits, labels.astype(jnp.uint8)), eager, rtol=1e-6
    )


def test_fit_temperature_of_bfloat16_logits_is_computed_in_float32():
    logits, labels = _disagreeing_ensemble()
    low = logits.astype(jnp.bfloat16)
    np.testing.assert_allclose(
        uncertainty.fit_temperature(low, labels),
        uncertainty.fit_temperature(low.astype(jnp.float32), labels),
        rtol=1e-6,
    )


def test_fit_temperature_is_clipped_to_its_bounds():
    # Always right with a 0.55 / 0.45 predictive: the NLL falls as T -> 0.
    logits = jnp.log(jnp.array([[[0.9, 0.1]] * 4, [[0.2, 0.8]] * 4]))
    labels = jnp.zeros(4, jnp.int32)
    np.testing.assert_allclose(
        uncertainty.fit_temperature(logits, labels, bounds=(0.1, 10.0)), 0.1, rtol=1e-5
    )
    # Right half the time with a confident predictive: T -> the upper bound.
    sure = jnp.log(jnp.array([[[0.99, 0.01]] * 4]))
    np.testing.assert_allclose(
        uncertainty.fit_temperature(sure, jnp.array([0, 1, 0, 1]), bounds=(0.1, 10.0)),
        10.0,
        rtol=1e-5,
    )


def test_fit_temperature_is_nan_for_bad_examples_never_a_number():
    logits, labels = _disagreeing_ensemble()
    broken = logits.at[2, 7, 1].set(jnp.nan)
    assert np.isnan(uncertainty.fit_temperature(broken, labels))
    # A label every member rules out: the NLL is infinite at every temperature.
    masked = logits.at[:, 3, labels[3]].set(-jnp.inf)
    assert np.isnan(uncertainty.fit_temperature(masked, labels))
    # A masked class that is not the label is fine.
    other = (int(labels[3]) + 1) % logits.shape[-1]
    assert np.isfinite(
        uncertainty.fit_temperature(logits.at[:, 3, other].set(-jnp.inf), labels)
    )
    # An out-of-range label: raised eagerly, NaN under jit.
    bad = labels.at[0].set(logits.shape[-1])
    with pytest.raises(ValueError, match="labels"):
        uncertainty.fit_temperature(logits, bad)
    assert np.isnan(jax.jit(uncertainty.fit_temperature)(logits, bad))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"bounds": (0.0, 1.0)}, ValueError, "1e-30 <= low < high <= 1e30"),
        ({"bounds": (2.0, 1.0)}, ValueError, "1e-30 <= low < high <= 1e30"),
        ({"bounds": (1.0, float("inf"))}, ValueError, "1e-30 <= low < high"),
        ({"bounds": (1e-40, 1.0)}, ValueError, "1e-30 <= low < high"),
        ({"bounds": (1.0, 1e39)}, ValueError, "1e-30 <= low < high"),
        ({"bounds": (1.0,)}, ValueError, "two temperatures"),
        ({"bounds": 1.0}, ValueError, "two temperatures"),
        ({"bounds": ("a", 2.0)}, TypeError, "`bounds` must be a real number"),
        ({"iterations": 0}, ValueError, "iterations"),
    ],
)
def test_fit_temperature_bad_options(kwargs, error, message):
    logits, labels = _disagreeing_ensemble()
    with pytest.raises(error, match=message):
        uncertainty.fit_temperature(logits, labels, **kwargs)


def test_fit_temperature_bad_inputs():
    logits, labels = _disagreeing_ensemble()
    with pytest.raises(ValueError, match=r"\[E, B, C\]"):
        uncertainty.fit_temperature(logits[0], labels)
    with pytest.raises(TypeError, match="integer"):
        uncertainty.fit_temperature(logits, labels.astype(jnp.float32))


def test_scale_temperature_is_the_rescaled_pooled_predictive():
    logits, labels = _disagreeing_ensemble()
    for temperature in (0.3, 1.0, 2.5):
        scaled = uncertainty.scale_temperature(logits, temperature)
        assert scaled.shape == (1, *logits.shape[1:])
        z = _log_predictive(logits) / temperature
        expected = z - np.log(
            np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)
        )
        expected -= z.max(-1, keepdims=True)
        np.testing.assert_allclose(scaled[0], expected, rtol=1e-5, atol=1e-5)
        # Every metric reads it as a one-member ensemble.
        np.testing.assert_allclose(
            uncertainty.nll(scaled, labels),
            _nll_at(np.asarray(logits), np.asarray(labels), temperature),
            rtol=1e-5,
        )
    # At T = 1 it is the ensemble itself: the same NLL, ECE and accuracy.
    same = uncertainty.scale_temperature(logits, 1.0)
    for metric in (uncertainty.nll, uncertainty.ece, uncertainty.accuracy):
        np.testing.assert_allclose(
            metric(same, labels), metric(logits, labels), rtol=1e-5
        )


def test_a_fitted_temperature_lowers_the_nll_and_the_ece_it_was_fitted_on():
    logits, labels = _disagreeing_ensemble()
    scaled = uncertainty.scale_temperature(
        logits, uncertainty.fit_temperature(logits, labels)
    )
    assert uncertainty.nll(scaled, labels) < uncertainty.nll(logits, labels)
    assert uncertainty.ece(scaled, labels) < uncertainty.ece(logits, labels)


def test_scale_temperature_gradient_matches_float64_differences():
    logits, labels = _disagreeing_ensemble(examples=50)

    def loss(temperature):
        return uncertainty.nll(
            uncertainty.scale_temperature(logits, temperature), labels
        )

    for temperature in (0.4, 1.7):
        step = 1e-5
        expected = (
            _nll_at(np.asarray(logits), np.asarray(labels), temperature + step)
            - _nll_at(np.asarray(logits), np.asarray(labels), temperature - step)
        ) / (2 * step)
        np.testing.assert_allclose(
            jax.grad(loss)(jnp.float32(temperature)), expected, rtol=1e-3
        )


def test_scale_temperature_bad_temperatures_and_nan_rows():
    logits, _ = _disagreeing_ensemble()
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive and finite"):
            uncertainty.scale_temperature(logits, bad)
    with pytest.raises(ValueError, match="scalar"):
        uncertainty.scale_temperature(logits, jnp.ones(2))
    # Finite, but not in float32: said so, not reported as "inf".
    with pytest.raises(ValueError, match=r"float32 \(at most 3.403e\+38\), got 1e\+39"):
        uncertainty.scale_temperature(logits, 1e39)
    with pytest.raises(TypeError, match="real number"):
        uncertainty.scale_temperature(logits, True)
    # Under jit the value is unknown: NaN, never a number.
    assert np.all(np.isnan(jax.jit(uncertainty.scale_temperature)(logits, 0.0)))
    scaled = uncertainty.scale_temperature(logits.at[1, 4, 0].set(jnp.inf), 1.5)
    assert np.all(np.isnan(scaled[0, 4])) and np.all(
        np.isfinite(np.delete(scaled[0], 4, 0))
    )


def test_the_widest_bounds_still_fit():
    logits, labels = _disagreeing_ensemble()
    np.testing.assert_allclose(
        uncertainty.fit_temperature(
            logits, labels, bounds=(1e-30, 1e30), iterations=60
        ),
        uncertainty.fit_temperature(logits, labels),
        rtol=1e-5,
    )


def test_a_flat_nll_gives_the_lower_bound():
    # One possible class per example (the other masked out by every member):
    # every temperature gives it probability 1, the fit is arbitrary.
    one_possible = jnp.zeros((2, 5, 2)).at[:, :, 1].set(-jnp.inf)
    np.testing.assert_allclose(
        uncertainty.fit_temperature(one_possible, jnp.zeros(5, jnp.int32)),
        0.05,
        rtol=1e-5,
    )


def test_scale_temperature_gradient_with_a_class_every_member_rules_out():
    logits, labels = _disagreeing_ensemble(examples=50)
    masked = logits.at[:, :, 3].set(-jnp.inf)
    labels = jnp.where(labels == 3, 0, labels)

    def loss(temperature):
        return uncertainty.nll(
            uncertainty.scale_temperature(masked, temperature), labels
        )

    step = 1e-5
    expected = (
        _nll_at(np.asarray(masked), np.asarray(labels), 1.3 + step)
        - _nll_at(np.asarray(masked), np.asarray(labels), 1.3 - step)
    ) / (2 * step)
    gradient = jax.grad(loss)(jnp.float32(1.3))
    assert np.isfinite(gradient)
    np.testing.assert_allclose(gradient, expected, rtol=1e-3)
    # The masked class keeps probability 0.
    assert np.all(np.isneginf(uncertainty.scale_temperature(masked, 1.3)[0, :, 3]))


def test_dtypes_under_x64(x64):
    logits, labels = _disagreeing_ensemble()
    assert uncertainty.fit_temperature(logits, labels).dtype == jnp.float32
    assert uncertainty.scale_temperature(logits, 0.7).dtype == jnp.float32
    wide = logits.astype(jnp.float64)
    fitted = uncertainty.fit_temperature(wide, labels, iterations=60)
    assert fitted.dtype == jnp.float64
    reference = _reference_temperature(np.asarray(wide), np.asarray(labels))
    np.testing.assert_allclose(fitted, reference, rtol=1e-7)
    scaled = uncertainty.scale_temperature(wide, 1 / 3)
    assert scaled.dtype == jnp.float64
    z = _log_predictive(np.asarray(wide)) * 3
    z = z - z.max(-1, keepdims=True)
    expected = z - np.log(np.exp(z).sum(-1, keepdims=True))
    np.testing.assert_allclose(scaled[0], expected, rtol=1e-12, atol=1e-12)
