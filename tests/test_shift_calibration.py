"""Calibration for shift and the members' diversity, against numpy references.

``fit_member_temperatures`` / ``scale_member_temperatures`` and
``fit_member_std_scales`` / ``scale_member_stds`` (calibrate, then pool),
``noisy_copies`` (a held-out set with perturbed copies) and the diversity
measures ``pairwise_disagreement``, ``pairwise_kl``, ``pairwise_gaussian_kl``.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from ensembles import uncertainty

RNG = np.random.default_rng(0)
LOGITS = jnp.asarray(2 * RNG.standard_normal((3, 50, 4)), jnp.float32)
# Labels the members predict three times in four: every fit inside its bounds.
LABELS = jnp.asarray(
    np.where(
        RNG.random(50) < 0.75,
        np.argmax(np.asarray(LOGITS).mean(axis=0), axis=-1),
        RNG.integers(0, 4, 50),
    ),
    jnp.int32,
)
MEANS = jnp.asarray(RNG.standard_normal((3, 40, 2)), jnp.float32)
STDS = jnp.asarray(np.exp(0.3 * RNG.standard_normal((3, 40, 2))), jnp.float32)
TARGETS = jnp.asarray(RNG.standard_normal((40, 2)), jnp.float32)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - special.logsumexp(x, axis=-1, keepdims=True)


# --- calibrate, then pool -----------------------------------------------------


def test_each_member_s_temperature_is_its_own_fit():
    temperatures = uncertainty.fit_member_temperatures(LOGITS, LABELS)
    assert temperatures.shape == (3,)
    for k in range(3):
        alone = uncertainty.fit_temperature(LOGITS[k : k + 1], LABELS)
        np.testing.assert_allclose(temperatures[k], alone, rtol=1e-5)


def test_member_temperatures_rescale_each_member():
    temperatures = jnp.array([0.5, 1.0, 3.0])
    scaled = uncertainty.scale_member_temperatures(LOGITS, temperatures)
    expected = _log_softmax(
        _log_softmax(LOGITS) / np.float64(temperatures)[:, None, None]
    )
    np.testing.assert_allclose(scaled, expected, rtol=1e-5, atol=1e-6)
    # The rescaled members pool as member logits: the NLL the fit minimises
    # is lowest at the fitted temperatures, member by member.
    fitted = uncertainty.fit_member_temperatures(LOGITS, LABELS)
    for k in range(3):

        def member_nll(t, k=k):
            return uncertainty.nll(
                uncertainty.scale_member_temperatures(LOGITS[k : k + 1], t[None]),
                LABELS,
            )

        best = member_nll(fitted[k])
        assert best <= member_nll(fitted[k] * 1.05) and best <= member_nll(
            fitted[k] / 1.05
        )


def test_member_temperatures_keep_the_members_disagreement():
    scaled = uncertainty.scale_member_temperatures(LOGITS, jnp.ones(3))
    np.testing.assert_allclose(
        uncertainty.mutual_information(scaled),
        uncertainty.mutual_information(LOGITS),
        rtol=1e-5,
        atol=1e-6,
    )


def test_member_std_scales_are_the_closed_form():
    scales = uncertainty.fit_member_std_scales(MEANS, STDS, TARGETS)
    z = (np.asarray(TARGETS)[None] - np.asarray(MEANS)) / np.asarray(STDS)
    np.testing.assert_allclose(scales, np.sqrt(np.mean(z**2, axis=(1, 2))), rtol=1e-5)
    means, stds = uncertainty.scale_member_stds(MEANS, STDS, scales)
    np.testing.assert_array_equal(means, MEANS)
    np.testing.assert_allclose(stds, STDS * scales[:, None, None], rtol=1e-6)
    # Each member's own Gaussian NLL is least at its scale (one-member fits).
    for k in range(3):
        alone = uncertainty.fit_std_scale(MEANS[k : k + 1], STDS[k : k + 1], TARGETS)
        np.testing.assert_allclose(scales[k], alone, rtol=1e-4)


def test_per_member_fits_clip_to_their_bounds():
    scales = uncertainty.fit_member_std_scales(
        MEANS, STDS * 1e-3, TARGETS, bounds=(0.5, 2.0)
    )
    np.testing.assert_allclose(scales, [2.0, 2.0, 2.0])


def test_invalid_entries_give_nan_eager_and_jit():
    bad_logits = LOGITS.at[1, 3, 0].set(jnp.nan)
    for fn in (
        uncertainty.fit_member_temperatures,
        jax.jit(uncertainty.fit_member_temperatures),
    ):
        assert np.all(np.isnan(np.asarray(fn(bad_logits, LABELS))))
    scaled = uncertainty.scale_member_temperatures(bad_logits, jnp.ones(3))
    assert (
        np.all(np.isnan(np.asarray(scaled[:, 3]))) and not np.isnan(scaled[:, 2]).any()
    )
    bad_stds = STDS.at[0, 5, 1].set(0.0)
    assert np.all(np.isnan(np.asarray(
        uncertainty.fit_member_std_scales(MEANS, bad_stds, TARGETS)
    )))  # fmt: skip


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: uncertainty.scale_member_temperatures(LOGITS, jnp.ones(2)), ValueError,
         r"`temperatures` must have shape \[E\] = \(3,\)"),
        (lambda: uncertainty.scale_member_temperatures(LOGITS, jnp.array([1, 0, 1.0])),
         ValueError, "positive and finite"),
        (lambda: uncertainty.scale_member_temperatures(LOGITS, jnp.array([True] * 3)),
         TypeError, "real numbers"),
        (lambda: uncertainty.scale_member_stds(MEANS, STDS, jnp.ones(4)), ValueError,
         r"`scales` must have shape \[E\] = \(3,\)"),
        (lambda: uncertainty.scale_member_stds(MEANS, STDS, jnp.array([1.0, -1, 1])),
         ValueError, "positive and finite"),
        (lambda: uncertainty.fit_member_std_scales(MEANS, None, TARGETS), ValueError,
         "`stds` must be given"),
        (lambda: uncertainty.fit_member_temperatures(LOGITS, LABELS, bounds=(2, 1)),
         ValueError, "`bounds` must satisfy"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- noisy copies ----------------------------------------------------------------


def test_noisy_copies_add_noise_of_the_training_data_s_scale():
    x = jnp.zeros((2000, 2))
    y = jnp.arange(2000) % 3
    feature_std = jnp.array([1.0, 10.0])
    inputs, targets = uncertainty.noisy_copies(
        x, y, feature_std=feature_std, strengths=(0.1, 0.5), key=jax.random.key(0)
    )
    assert inputs.shape == (6000, 2) and inputs.dtype == jnp.float32
    np.testing.assert_array_equal(targets, np.tile(np.asarray(y), 3))
    np.testing.assert_array_equal(inputs[:2000], x)
    for i, strength in enumerate((0.1, 0.5), start=1):
        block = np.asarray(inputs[2000 * i : 2000 * (i + 1)])
        np.testing.assert_allclose(
            block.std(axis=0), strength * np.asarray(feature_std), rtol=0.05
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"targets": jnp.zeros(3)}, "same number of rows"),
        ({"feature_std": jnp.ones(5)}, "must broadcast against one example"),
        ({"feature_std": -1.0}, "finite and non-negative"),
        ({"strengths": ()}, "one or more positive"),
        ({"strengths": (0.1, 0.0)}, "one or more positive"),
    ],
)
def test_noisy_copies_refuse_bad_arguments(kwargs, match):
    arguments = {
        "inputs": jnp.zeros((4, 2)),
        "targets": jnp.zeros(4),
        "feature_std": 1.0,
        "strengths": (0.1,),
        "key": jax.random.key(0),
        **kwargs,
    }
    with pytest.raises(ValueError, match=match):
        uncertainty.noisy_copies(
            arguments.pop("inputs"), arguments.pop("targets"), **arguments
        )


# --- diversity --------------------------------------------------------------------


def test_pairwise_disagreement_counts_pairs():
    classes = np.argmax(np.asarray(LOGITS), axis=-1)  # [E, B]
    pairs = list(itertools.combinations(range(3), 2))
    expected = np.mean([classes[k] != classes[j] for k, j in pairs], axis=0)
    np.testing.assert_allclose(uncertainty.pairwise_disagreement(LOGITS), expected)
    assert np.all(np.asarray(uncertainty.pairwise_disagreement(LOGITS[:1])) == 0)


def test_pairwise_kl_is_the_mean_kl_over_ordered_pairs():
    probs = np.exp(_log_softmax(LOGITS))
    pairs = [(k, j) for k in range(3) for j in range(3) if k != j]
    expected = np.mean(
        [special.rel_entr(probs[k], probs[j]).sum(axis=-1) for k, j in pairs], axis=0
    )
    np.testing.assert_allclose(uncertainty.pairwise_kl(LOGITS), expected, rtol=1e-4)
    np.testing.assert_allclose(
        jax.jit(uncertainty.pairwise_kl)(LOGITS), expected, rtol=1e-4
    )
    assert np.all(np.asarray(uncertainty.pairwise_kl(LOGITS[:1])) == 0)


def test_pairwise_gaussian_kl_is_the_closed_form():
    m, s = np.asarray(MEANS, np.float64), np.asarray(STDS, np.float64)
    pairs = [(k, j) for k in range(3) for j in range(3) if k != j]
    expected = np.mean(
        [
            (np.log(s[j] / s[k]) + (s[k] ** 2 + (m[k] - m[j]) ** 2) / (2 * s[j] ** 2)
             - 0.5).sum(axis=-1)
            for k, j in pairs
        ],
        axis=0,
    )  # fmt: skip
    np.testing.assert_allclose(
        uncertainty.pairwise_gaussian_kl(MEANS, STDS), expected, rtol=1e-4
    )
    # Invalid examples are NaN, the others unaffected.
    bad = uncertainty.pairwise_gaussian_kl(MEANS.at[0, 2, 0].set(jnp.inf), STDS)
    assert np.isnan(bad[2]) and np.allclose(bad[3], expected[3], rtol=1e-4)
    with pytest.raises(ValueError, match="`stds` must be given"):
        uncertainty.pairwise_gaussian_kl(MEANS, None)


def _measure_on(x, y, predict, regression):
    """A calibration's ``measure`` for the benchmark's calibrate_* (its NLL)."""

    def measure(transform):
        if regression:
            means, stds = transform(*predict(x))
            nll = uncertainty.mixture_nll(means, stds, y)
        else:
            nll = uncertainty.nll(transform(predict(x)), y)
        value = {"nll": float(nll)}
        return {"in_distribution": value, "shift_mean": value}

    return measure


@pytest.mark.slow
def test_the_benchmark_s_two_stage_calibration_is_members_then_one_level():
    # members_noisy_pooled: each member's temperature from the noisy copies,
    # then one temperature of the pooled, rescaled predictive from the clean
    # held-out examples; a regressor's the same with std scales.
    from ensembles.benchmark.quality.calibration import (
        calibrate_classifier,
        calibrate_regressor,
        noisy_validation,
    )

    rng = np.random.default_rng(0)
    x_train = rng.standard_normal((50, 3)).astype(np.float32)
    x_valid = rng.standard_normal((40, 3)).astype(np.float32)
    y_valid = rng.integers(0, 3, 40)
    weights = jnp.asarray(rng.standard_normal((2, 3, 3)), jnp.float32) * 3

    def predict(x):  # two overconfident members, [E, N, C]
        return jnp.einsum("nf,efc->enc", jnp.asarray(x), weights)

    bounds = (0.05, 20.0)
    found = calibrate_classifier(
        predict,
        _measure_on(x_valid, y_valid, predict, False),
        x_train,
        x_valid,
        y_valid,
        bounds,
    )["members_noisy_pooled"]
    x_noisy, y_noisy = noisy_validation(x_train, x_valid, y_valid)
    member_t = uncertainty.fit_member_temperatures(
        predict(x_noisy), y_noisy, bounds=bounds
    )
    rescaled = uncertainty.scale_member_temperatures(predict(x_valid), member_t)
    level = uncertainty.fit_temperature(rescaled, y_valid, bounds=bounds)
    expected = uncertainty.nll(uncertainty.scale_temperature(rescaled, level), y_valid)
    assert found["in_distribution"]["nll"] == pytest.approx(float(expected), rel=1e-5)
    assert found["temperature"] == pytest.approx(float(jnp.mean(member_t) * level))
    # The level is fitted on the clean set: no other level does better there.
    for other in (0.8 * level, 1.25 * level):
        worse = uncertainty.nll(uncertainty.scale_temperature(rescaled, other), y_valid)
        assert float(worse) >= float(expected) - 1e-6

    targets = rng.standard_normal(40).astype(np.float32)

    def predict_gaussian(x):  # two members, [E, N] means and stds
        means = jnp.stack([jnp.asarray(x)[:, 0], jnp.asarray(x)[:, 1]])
        return means, jnp.full_like(means, 0.3)

    found = calibrate_regressor(
        predict_gaussian,
        _measure_on(x_valid, targets, predict_gaussian, True),
        x_train,
        x_valid,
        targets,
        (0.05, 20.0),
    )["members_noisy_pooled"]
    x_noisy, t_noisy = noisy_validation(x_train, x_valid, targets)
    member_s = uncertainty.fit_member_std_scales(
        *predict_gaussian(x_noisy), t_noisy, bounds=(0.05, 20.0)
    )
    rescaled = uncertainty.scale_member_stds(*predict_gaussian(x_valid), member_s)
    level = uncertainty.fit_std_scale(*rescaled, targets, bounds=(0.05, 20.0))
    expected = uncertainty.mixture_nll(
        *uncertainty.scale_std(*rescaled, level), targets
    )
    assert found["in_distribution"]["nll"] == pytest.approx(float(expected), rel=1e-5)
    assert found["std_scale"] == pytest.approx(float(jnp.mean(member_s) * level))
