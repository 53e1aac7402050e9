"""Ensemble temperature scaling and the adaptive temperature, against numpy/scipy."""

import jax
import numpy as np
import pytest
import scipy.optimize
import scipy.special

from ensembles import uncertainty


def _data(seed, num_members=3, batch=200, classes=4, scale=2.0):
    rng = np.random.default_rng(seed)
    logits = scale * rng.standard_normal((num_members, batch, classes))
    labels = rng.integers(0, classes, batch)
    # Make the labels agree with the pooled predictive more often than chance.
    pooled = scipy.special.softmax(logits, -1).mean(0)
    labels = np.where(rng.random(batch) < 0.6, pooled.argmax(-1), labels)
    return logits.astype(np.float32), labels


def _pooled_log(logits):
    return np.log(scipy.special.softmax(np.float64(logits), -1).mean(0))


def _tempered(log_p, temperature):
    return scipy.special.log_softmax(log_p / temperature, -1)


def _reference_temperature(log_p, labels):
    def nll(log_t):
        z = _tempered(log_p, np.exp(log_t))
        return -z[np.arange(len(labels)), labels].mean()

    found = scipy.optimize.minimize_scalar(nll, bounds=(np.log(0.05), np.log(20)))
    return np.exp(found.x)


def _mixture(log_p, temperature, weights):
    classes = log_p.shape[-1]
    return np.log(
        weights[0] * np.exp(_tempered(log_p, temperature))
        + weights[1] * np.exp(log_p)
        + weights[2] / classes
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ensemble_temperature_matches_scipy(seed):
    logits, labels = _data(seed)
    params = np.asarray(uncertainty.fit_ensemble_temperature(logits, labels))
    log_p = _pooled_log(logits)
    temperature = _reference_temperature(log_p, labels)
    np.testing.assert_allclose(params[0], temperature, rtol=2e-3)

    def nll(free):
        mixed = _mixture(log_p, params[0], scipy.special.softmax(free))
        return -mixed[np.arange(len(labels)), labels].mean()

    options = {"xatol": 1e-8, "fatol": 1e-12}
    reference = scipy.optimize.minimize(
        nll, np.zeros(3), method="Nelder-Mead", options=options
    )
    assert params[1:].sum() == pytest.approx(1.0, abs=1e-5)
    assert np.all(params[1:] >= 0)
    # The same minimum of a flat objective: the NLLs agree, not each weight.
    assert nll(np.log(np.maximum(params[1:], 1e-30))) == pytest.approx(
        reference.fun, abs=2e-5
    )
    scaled = np.asarray(uncertainty.scale_ensemble_temperature(logits, params))[0]
    np.testing.assert_allclose(
        scaled, _mixture(log_p, params[0], params[1:]), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_adaptive_temperature_matches_numpy(seed):
    # Hard examples: flatter logits, a higher entropy than the clean ones.
    clean, clean_labels = _data(seed, scale=3.0)
    hard, hard_labels = _data(seed + 10, scale=0.7)
    params = np.asarray(
        uncertainty.fit_adaptive_temperature(clean, clean_labels, hard, hard_labels)
    )
    for at, (logits, labels) in enumerate(((clean, clean_labels), (hard, hard_labels))):
        log_p = _pooled_log(logits)
        np.testing.assert_allclose(
            params[at], _reference_temperature(log_p, labels), rtol=2e-3
        )
        entropy = -(np.exp(log_p) * log_p).sum(-1)
        np.testing.assert_allclose(params[2 + at], np.median(entropy), rtol=1e-5)
    assert params[3] > params[2]
    mixed, _ = _data(seed + 20, scale=1.5)
    scaled = np.asarray(uncertainty.scale_adaptive_temperature(mixed, params))[0]
    log_p = _pooled_log(mixed)
    entropy = -(np.exp(log_p) * log_p).sum(-1)
    blend = np.clip((entropy - params[2]) / (params[3] - params[2]), 0, 1)
    temperature = params[0] ** (1 - blend) * params[1] ** blend
    expected = scipy.special.log_softmax(log_p / temperature[:, None], -1)
    np.testing.assert_allclose(scaled, expected, rtol=1e-5, atol=1e-5)
    assert blend.min() == 0 and blend.max() == 1 and ((blend > 0) & (blend < 1)).any()


def test_a_hard_set_no_harder_than_the_clean_one_keeps_the_clean_temperature():
    logits, labels = _data(3)
    params = uncertainty.fit_adaptive_temperature(logits, labels, logits, labels)
    scaled = uncertainty.scale_adaptive_temperature(logits, params)
    expected = uncertainty.scale_temperature(logits, params[0])
    np.testing.assert_allclose(scaled, expected, rtol=1e-5, atol=1e-6)


def test_jit_equals_eager():
    logits, labels = _data(4)
    hard, hard_labels = _data(5, scale=4.0)
    for fit, args in (
        (uncertainty.fit_ensemble_temperature, (logits, labels)),
        (uncertainty.fit_adaptive_temperature, (logits, labels, hard, hard_labels)),
    ):
        np.testing.assert_allclose(jax.jit(fit)(*args), fit(*args), rtol=1e-6)
    ets = uncertainty.fit_ensemble_temperature(logits, labels)
    ada = uncertainty.fit_adaptive_temperature(logits, labels, hard, hard_labels)
    for scale, params in (
        (uncertainty.scale_ensemble_temperature, ets),
        (uncertainty.scale_adaptive_temperature, ada),
    ):
        np.testing.assert_allclose(
            jax.jit(scale)(logits, params), scale(logits, params), rtol=1e-6
        )


def test_nan_in_nan_out():
    logits, labels = _data(6)
    bad = logits.copy()
    bad[1, 7, 2] = np.nan
    assert np.isnan(uncertainty.fit_ensemble_temperature(bad, labels)).all()
    assert np.isnan(
        uncertainty.fit_adaptive_temperature(logits, labels, bad, labels)
    ).all()
    params = uncertainty.fit_ensemble_temperature(logits, labels)
    out = np.asarray(uncertainty.scale_ensemble_temperature(bad, params))[0]
    assert np.isnan(out[7]).all() and np.isfinite(np.delete(out, 7, 0)).all()
    ada = uncertainty.fit_adaptive_temperature(logits, labels, logits, labels)
    out = np.asarray(uncertainty.scale_adaptive_temperature(bad, ada))[0]
    assert np.isnan(out[7]).all() and np.isfinite(np.delete(out, 7, 0)).all()


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (np.ones(3, np.float32), r"`params` must be the \[4\] floats"),
        (np.array([1.0, 0.5, 0.5, np.nan], np.float32), "must be finite"),
        (np.array([-1.0, 0.5, 0.5, 0.0], np.float32), "positive temperature"),
        (np.array([1.0, 0.5, 0.6, 0.0], np.float32), "summing to 1"),
    ],
)
def test_bad_ensemble_temperature_params_are_refused(params, match):
    logits, _ = _data(7)
    before = params.copy()
    with pytest.raises(ValueError, match=match):
        uncertainty.scale_ensemble_temperature(logits, params)
    np.testing.assert_array_equal(params, before)


def test_bad_adaptive_inputs_are_refused():
    logits, labels = _data(8)
    with pytest.raises(ValueError, match="two positive temperatures"):
        uncertainty.scale_adaptive_temperature(
            logits, np.array([0.0, 1.0, 0.1, 0.5], np.float32)
        )
    other = np.zeros((3, 10, 5), np.float32)
    with pytest.raises(ValueError, match="`hard_logits` must have the classes"):
        uncertainty.fit_adaptive_temperature(logits, labels, other, np.zeros(10, int))
    with pytest.raises(TypeError):
        uncertainty.fit_ensemble_temperature(logits, labels.astype(np.float32))
