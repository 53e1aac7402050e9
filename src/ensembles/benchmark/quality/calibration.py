"""The ways to calibrate a method, measured alike, and its members' diversity.

Beside "as trained" and "recalibrated" (one temperature of the pooled
predictive fitted on the clean held-out examples, or a regressor's one scale
of its spread), the quality benchmark measures every method at four more
calibrations (:data:`CALIBRATIONS`), all fitted on examples held out of the
training data, never on a test or shifted set:

* ``pooled_noisy``: the pooled temperature (scale) fitted on the held-out
  examples together with copies of them perturbed by Gaussian noise of
  :data:`NOISE_STRENGTHS` times the training inputs' standard deviation
  (:func:`ensembles.uncertainty.noisy_copies`; Tomani et al., CVPR 2021);
* ``members``: one temperature (scale) per member, then the rescaled members
  pooled (:func:`ensembles.uncertainty.fit_member_temperatures`; calibrate,
  then pool);
* ``members_noisy``: the same, fitted on the noisy set;
* ``members_noisy_pooled``: ``members_noisy``, then one temperature (scale)
  of the pooled, rescaled predictive fitted on the clean held-out examples:
  the members' ratios from the noisy set, the level from the clean one (a
  pool of calibrated members is underconfident in distribution).

A classifier has two more (:data:`CLASSIFIER_CALIBRATIONS`), a regressor one
(:data:`REGRESSOR_CALIBRATIONS`), each meant to hold in distribution and under
shift at once (issue 68):

* ``ets``: ensemble temperature scaling (Mix-n-Match; the tempered pooled
  predictive mixed with itself and the uniform), fitted on the clean
  held-out examples (:func:`ensembles.uncertainty.fit_ensemble_temperature`);
* ``adaptive``: one temperature fitted on the clean examples, one on the
  noisy copies, blended per example by the entropy of its predictive
  (:func:`ensembles.uncertainty.fit_adaptive_temperature`);
* ``spread`` (a regressor's): the members' standard deviations scaled on the
  clean examples, their disagreement on the noisy copies
  (:func:`ensembles.uncertainty.fit_spread_scales`), so that the error the
  input noise adds is not learned as the data's own noise.

Each gives its parameter (the mean over members for the per-member fits) and
the method's figures in distribution and under shift (the mean over
severities). The members' diversity as trained (mean pairwise disagreement and
KL between members; a regressor's members: the mean pairwise KL of their
Gaussians and the epistemic share of the variance) is measured in
distribution and under shift.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ensembles import uncertainty

__all__ = [
    "CALIBRATIONS",
    "CLASSIFIER_CALIBRATIONS",
    "NOISE_STRENGTHS",
    "RECOMMENDED",
    "REGRESSOR_CALIBRATIONS",
    "cached",
    "calibrate_classifier",
    "calibrate_regressor",
    "classifier_diversity",
    "diversity",
    "diversity_sets",
    "noisy_validation",
    "regressor_diversity",
]

#: The noise of the held-out copies, in units of the training inputs' std.
NOISE_STRENGTHS: tuple[float, ...] = (0.05, 0.1, 0.2)

#: The calibrations measured beside ``recalibrated`` for both kinds (see the
#: module).
CALIBRATIONS: tuple[str, ...] = (
    "pooled_noisy",
    "members",
    "members_noisy",
    "members_noisy_pooled",
)

#: The calibration the docs recommend for both kinds (docs/training.md), what
#: each kind's first table shows every method at: one temperature (a
#: regressor's std scale) per member, fitted on the clean held-out examples,
#: then the members pooled. Chosen by ``benchmarks/recipe_rule.py``, the rule
#: registered before the results, on 8 of 9 classification and 6 of 8
#: regression folds of the task pool, each fold leaving one task out.
RECOMMENDED: str = "members"

#: Every calibration a classifier is measured at beside ``recalibrated``.
CLASSIFIER_CALIBRATIONS: tuple[str, ...] = (*CALIBRATIONS, "ets", "adaptive")

#: Every calibration a regressor is measured at beside ``recalibrated``.
REGRESSOR_CALIBRATIONS: tuple[str, ...] = (*CALIBRATIONS, "spread")

_NOISE_SEED = 20261128  # the same noisy copies for every method and seed


def cached(predict: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``predict`` computed once per array (every calibration reuses it)."""
    memo: dict[int, tuple[Any, Any]] = {}

    def predict_once(x):
        if id(x) not in memo:
            memo[id(x)] = (x, predict(x))  # x kept: its id stays its own
        return memo[id(x)][1]

    return predict_once


def _fitted(parameter: Any) -> bool:
    """Whether a fit gave a parameter: NaN says a prediction it saw was NaN."""
    return bool(np.isfinite(np.asarray(parameter)).all())


def _nan_logits(logits: jax.Array) -> jax.Array:
    """What a calibration that could not be fitted predicts: nothing (NaN)."""
    return jnp.full_like(logits, jnp.nan)


def _nan_members(means: jax.Array, stds: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`_nan_logits` for a regressor's ``(means, stds)``."""
    return jnp.full_like(means, jnp.nan), stds


def diversity(
    measure: Callable[[Any], dict[str, float]], sets: dict[str, list[Any]]
) -> dict[str, dict[str, float]]:
    """The members' diversity as trained, per set (examples averaged).

    Args:
      measure: one set's examples to its measures (a classifier's
        :func:`classifier_diversity` of its logits, a regressor's
        :func:`regressor_diversity` of its members).
      sets: ``{"in_distribution": [x], "shift_mean": [x of every severity's
        every family]}``; a measure of ``shift_mean`` is the mean over them
        weighted by severity as the caller lists them.

    Returns:
      ``{set: {measure: value}}``.
    """
    result = {}
    for name, arrays in sets.items():
        values = [measure(x) for x in arrays]
        result[name] = {
            key: float(np.mean([v[key] for v in values])) for key in values[0]
        }
    return result


def classifier_diversity(logits: jax.Array) -> dict[str, float]:
    """Member logits' mean pairwise disagreement and KL."""
    return {
        "pairwise_disagreement": float(
            jnp.mean(uncertainty.pairwise_disagreement(logits))
        ),
        "pairwise_kl": float(jnp.mean(uncertainty.pairwise_kl(logits))),
    }


def regressor_diversity(members: tuple[jax.Array, jax.Array]) -> dict[str, float]:
    """Gaussian members' mean pairwise KL and the epistemic share of the variance."""
    means, stds = members
    total = uncertainty.mixture_variance(means, stds)
    share = uncertainty.epistemic_variance(means, stds) / total
    return {
        "pairwise_kl": float(jnp.mean(uncertainty.pairwise_gaussian_kl(means, stds))),
        "epistemic_share": float(jnp.mean(share)),
    }


def diversity_sets(data: Any) -> dict[str, list[Any]]:
    """The sets :func:`diversity` measures a task's data on: test and shifted.

    Args:
      data: a :class:`~ensembles.benchmark.quality.data.QualityData`.

    Returns:
      ``{"in_distribution": [x_test], "shift_mean": [x of every severity's
      every family]}``.
    """
    shifted = [x for families in data.shifted.values() for x, _ in families.values()]
    return {"in_distribution": [data.x_test], "shift_mean": shifted}


def noisy_validation(
    x_train: np.ndarray, x_valid: np.ndarray, y_valid: np.ndarray
) -> tuple[jax.Array, jax.Array]:
    """The held-out examples and their noisy copies, noise from the training data."""
    feature_std = np.asarray(x_train, np.float64).std(axis=0).astype(np.float32)
    return uncertainty.noisy_copies(
        np.asarray(x_valid, np.float32),
        np.asarray(y_valid),
        feature_std=feature_std,
        strengths=NOISE_STRENGTHS,
        key=jax.random.key(_NOISE_SEED),
    )


def calibrate_classifier(
    predict: Callable[[Any], jax.Array],
    measure: Callable[[Callable[[jax.Array], jax.Array]], dict[str, Any]],
    x_train: np.ndarray,
    x_valid: np.ndarray,
    y_valid: np.ndarray,
    bounds: tuple[float, float],
) -> dict[str, Any]:
    """Every calibration of :data:`CLASSIFIER_CALIBRATIONS`, measured.

    Args:
      predict: examples to member logits ``[E, N, C]`` (cached by the caller).
      measure: ``measure(transform)`` gives ``{"in_distribution": ...,
        "shift_mean": ...}`` of the logits ``transform(predict(x))``.
      x_train: the training inputs (their std scales the noise).
      x_valid: the held-out examples.
      y_valid: their labels.
      bounds: the temperatures' bounds.

    Returns:
      ``{name: {"temperature": T, "in_distribution": ..., "shift_mean":
      ...}}``, ``T`` the mean over members for the per-member fits.
    """
    clean = (predict(x_valid), np.asarray(y_valid))
    x_noisy, y_noisy = noisy_validation(x_train, x_valid, y_valid)
    noisy = (predict(x_noisy), y_noisy)
    results, fitted = {}, {}
    for name, (logits, labels) in (
        ("pooled_noisy", noisy),
        ("members", clean),
        ("members_noisy", noisy),
    ):
        if name == "pooled_noisy":
            t = uncertainty.fit_temperature(logits, labels, bounds=bounds)

            def transform(z, t=t):
                return uncertainty.scale_temperature(z, t)

        else:
            t = uncertainty.fit_member_temperatures(logits, labels, bounds=bounds)

            def transform(z, t=t):
                return uncertainty.scale_member_temperatures(z, t)

        fitted[name] = t
        if not _fitted(t):  # a NaN prediction on its set: NaN figures
            transform = _nan_logits
        results[name] = {"temperature": float(jnp.mean(t)), **measure(transform)}
    # members_noisy's temperatures, then one pooled temperature on clean data.
    member_t = fitted["members_noisy"]
    level = jnp.nan
    if _fitted(member_t):
        level = uncertainty.fit_temperature(
            uncertainty.scale_member_temperatures(clean[0], member_t),
            clean[1],
            bounds=bounds,
        )

    def two_stage(z):
        return uncertainty.scale_temperature(
            uncertainty.scale_member_temperatures(z, member_t), level
        )

    if not _fitted(level):
        two_stage = _nan_logits
    results["members_noisy_pooled"] = {
        "temperature": float(jnp.mean(member_t) * level),
        **measure(two_stage),
    }
    ets = uncertainty.fit_ensemble_temperature(*clean, bounds=bounds)

    def tempered(z):
        return uncertainty.scale_ensemble_temperature(z, ets)

    results["ets"] = {
        "temperature": float(ets[0]),
        **measure(tempered if _fitted(ets) else _nan_logits),
    }
    adaptive = uncertainty.fit_adaptive_temperature(*clean, *noisy, bounds=bounds)

    def blended(z):
        return uncertainty.scale_adaptive_temperature(z, adaptive)

    results["adaptive"] = {
        # The geometric mean of the clean and the noisy temperature.
        "temperature": float(jnp.sqrt(adaptive[0] * adaptive[1])),
        **measure(blended if _fitted(adaptive) else _nan_logits),
    }
    return results


def calibrate_regressor(
    predict: Callable[[Any], tuple[jax.Array, jax.Array]],
    measure: Callable[[Callable[..., Any]], dict[str, Any]],
    x_train: np.ndarray,
    x_valid: np.ndarray,
    y_valid: np.ndarray,
    bounds: tuple[float, float],
) -> dict[str, Any]:
    """:func:`calibrate_classifier` for a regressor: :data:`REGRESSOR_CALIBRATIONS`.

    Returns:
      ``{name: {"std_scale": s, "in_distribution": ..., "shift_mean": ...}}``
      (``spread`` adds its ``epistemic_scale``).
    """
    x_noisy, y_noisy = noisy_validation(x_train, x_valid, y_valid)
    clean = (predict(x_valid), np.asarray(y_valid))
    noisy = (predict(np.asarray(x_noisy)), np.asarray(y_noisy))
    results, fitted = {}, {}
    for name, (members, targets) in (
        ("pooled_noisy", noisy),
        ("members", clean),
        ("members_noisy", noisy),
    ):
        if name == "pooled_noisy":
            with warnings.catch_warnings():  # a fit at a bound: its value says so
                warnings.filterwarnings("ignore", "fit_std_scale ended at")
                s = uncertainty.fit_std_scale(*members, targets, bounds=bounds)

            def transform(means, stds, s=s):
                return uncertainty.scale_std(means, stds, s)

        else:
            s = uncertainty.fit_member_std_scales(*members, targets, bounds=bounds)

            def transform(means, stds, s=s):
                return uncertainty.scale_member_stds(means, stds, s)

        fitted[name] = s
        if not _fitted(s):  # a NaN prediction on its set: NaN figures
            transform = _nan_members
        results[name] = {"std_scale": float(jnp.mean(s)), **measure(transform)}
    # members_noisy's scales, then one pooled scale on the clean data.
    member_s = fitted["members_noisy"]
    level = jnp.nan
    if _fitted(member_s):
        rescaled = uncertainty.scale_member_stds(*clean[0], member_s)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "fit_std_scale ended at")
            level = uncertainty.fit_std_scale(*rescaled, clean[1], bounds=bounds)

    def two_stage(means, stds):
        return uncertainty.scale_std(
            *uncertainty.scale_member_stds(means, stds, member_s), level
        )

    if not _fitted(level):
        two_stage = _nan_members
    results["members_noisy_pooled"] = {
        "std_scale": float(jnp.mean(member_s) * level),
        **measure(two_stage),
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "fit_std_scale ended at")
        spread = uncertainty.fit_spread_scales(
            *clean[0], clean[1], *noisy[0], noisy[1], bounds=bounds
        )

    def spread_apart(means, stds):
        return uncertainty.scale_spread(means, stds, spread)

    results["spread"] = {
        "std_scale": float(spread[0]),
        "epistemic_scale": float(spread[1]),
        **measure(spread_apart if _fitted(spread) else _nan_members),
    }
    return results
