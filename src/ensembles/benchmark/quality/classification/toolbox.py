"""A classifier measured with the rest of the toolbox: calibrators, sets, scores.

Beside one temperature (:mod:`~ensembles.benchmark.quality.calibration`),
every trained classifier is measured with what
:mod:`ensembles.uncertainty` offers beyond it, all fitted on the held-out
examples (never the test set) and all from the logits as trained:

* the calibrators of :data:`CALIBRATORS`, pooled and per member (vector
  scaling, Dirichlet scaling with its default ODIR penalties, isotonic),
  measured on the test set and under shift as the calibrations are;
* split-conformal prediction sets at :data:`SET_LEVEL` (:data:`SET_VARIANTS`):
  their mean size and their coverage, in distribution (where the level is
  guaranteed) and under shift (where it is not);
* the out-of-distribution scores of :data:`OOD_SCORES` (AUROC and FPR at 95%
  TPR against the test set) beside entropy and mutual information;
* selective prediction ranked by each score of :data:`SELECTIVE_SCORES`
  (the AURC of answering the least uncertain first).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ensembles import uncertainty
from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.measures import detection, over_shifts

__all__ = [
    "CALIBRATORS",
    "OOD_SCORES",
    "SELECTIVE_SCORES",
    "SET_LEVEL",
    "SET_VARIANTS",
    "calibrate_beyond_temperature",
    "measure_sets",
    "nan_sets",
    "ood_by_score",
    "selective_by_score",
    "selective_measured",
]

#: The calibrators: ``name -> (fit, apply, members)``.
CALIBRATORS: dict[str, tuple[Callable, Callable, bool]] = {
    "vector": (uncertainty.fit_vector_scaling, uncertainty.apply_vector_scaling, False),
    "dirichlet": (
        uncertainty.fit_dirichlet_scaling,
        uncertainty.apply_dirichlet_scaling,
        False,
    ),
    "isotonic": (uncertainty.fit_isotonic, uncertainty.apply_isotonic, False),
    "vector_members": (
        uncertainty.fit_vector_scaling,
        uncertainty.apply_vector_scaling,
        True,
    ),
    "dirichlet_members": (
        uncertainty.fit_dirichlet_scaling,
        uncertainty.apply_dirichlet_scaling,
        True,
    ),
    "isotonic_members": (uncertainty.fit_isotonic, uncertainty.apply_isotonic, True),
}

#: The level of the conformal sets.
SET_LEVEL: float = 0.9

#: The sets measured: ``name -> (score, randomised, members)``; a per-member
#: variant's size and coverage are the means over members.
SET_VARIANTS: dict[str, tuple[str, bool, bool]] = {
    "lac": ("lac", False, False),
    "aps": ("aps", False, False),
    "raps": ("raps", False, False),
    "aps_randomised": ("aps", True, False),
    "lac_members": ("lac", False, True),
}

#: The out-of-distribution scores beside entropy and mutual information.
OOD_SCORES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "max_probability": uncertainty.max_probability_score,
    "margin": uncertainty.margin_score,
    "max_logit": uncertainty.max_logit_score,
    "energy": uncertainty.energy_score,
}

#: The orders selective prediction is measured in (``confidence``: the
#: predictive's largest probability, :func:`ensembles.uncertainty.aurc`'s own).
SELECTIVE_SCORES: dict[str, Callable[[jax.Array], jax.Array] | None] = {
    "confidence": None,
    "margin": uncertainty.margin_score,
    "max_logit": uncertainty.max_logit_score,
    "energy": uncertainty.energy_score,
    "entropy": uncertainty.total_entropy,
    "mutual_information": uncertainty.mutual_information,
}

_SET_SEED = 20261129  # the randomised sets' uniforms, the same for every method


def calibrate_beyond_temperature(
    predict: Callable[[Any], jax.Array],
    measure: Callable[[Callable[[jax.Array], jax.Array]], dict[str, Any]],
    x_valid: np.ndarray,
    y_valid: np.ndarray,
) -> dict[str, Any]:
    """Every calibrator of :data:`CALIBRATORS`, fitted on the held-out examples.

    Args:
      predict: examples to member logits ``[E, N, C]`` (cached by the caller).
      measure: ``measure(transform)`` gives ``{"in_distribution": ...,
        "shift_mean": ...}`` of the logits ``transform(predict(x))``.
      x_valid: the held-out examples.
      y_valid: their labels.

    Returns:
      ``{name: {"in_distribution": ..., "shift_mean": ...}}``.
    """
    logits, labels = predict(x_valid), np.asarray(y_valid)
    results = {}
    for name, (fit, apply, members) in CALIBRATORS.items():
        fitted = fit(logits, labels, members=members)

        def transform(z, fitted=fitted, apply=apply):
            return apply(z, *fitted)

        results[name] = measure(transform)
    return results


def _set_measures(logits, labels, thresholds) -> dict[str, float]:
    measured = {}
    for name, (score, randomised, _) in SET_VARIANTS.items():
        key = jax.random.key(_SET_SEED + 1) if randomised else None
        threshold = thresholds[name]
        sets = uncertainty.conformal_sets(logits, threshold, score=score, key=key)
        measured[f"size_{name}"] = float(np.mean(uncertainty.set_size(sets)))
        measured[f"coverage_{name}"] = float(
            np.mean(uncertainty.set_coverage(sets, labels))
        )
    return measured


def measure_sets(
    predict: Callable[[Any], jax.Array],
    data: QualityData,
    x_valid: np.ndarray,
    y_valid: np.ndarray,
) -> dict[str, Any]:
    """The sets of :data:`SET_VARIANTS` at :data:`SET_LEVEL`, sizes and coverages.

    Returns:
      ``{"in_distribution": {"size_<name>": s, "coverage_<name>": c, ...},
      "shift_mean": {...}}`` (the mean over severities of each severity's
      mean over families).
    """
    logits = predict(x_valid)
    thresholds = {
        name: uncertainty.fit_conformal_threshold(
            logits,
            np.asarray(y_valid),
            SET_LEVEL,
            score=score,
            key=jax.random.key(_SET_SEED) if randomised else None,
            members=members,
        )
        for name, (score, randomised, members) in SET_VARIANTS.items()
    }
    result = {
        "in_distribution": _set_measures(predict(data.x_test), data.y_test, thresholds)
    }
    _, result["shift_mean"] = over_shifts(
        lambda x, y: _set_measures(predict(x), y, thresholds), data.shifted
    )
    return result


def nan_sets() -> dict[str, Any]:
    """:func:`measure_sets`'s figures of a diverged method: every one NaN."""
    names = [f"{kind}_{name}" for name in SET_VARIANTS for kind in ("size", "coverage")]
    nan = {name: math.nan for name in names}
    return {"in_distribution": dict(nan), "shift_mean": dict(nan)}


def ood_by_score(logits_in: jax.Array, logits_out: jax.Array) -> dict[str, float]:
    """AUROC and FPR at 95% TPR of each of :data:`OOD_SCORES`."""
    measured = {}
    for name, score in OOD_SCORES.items():
        auroc, fpr = detection(score(logits_in), score(logits_out))
        measured[f"auroc_{name}"], measured[f"fpr95_{name}"] = auroc, fpr
    return measured


def selective_by_score(logits: jax.Array, labels: np.ndarray) -> dict[str, float]:
    """The AURC answering by each of :data:`SELECTIVE_SCORES`, least first.

    Mutual information is left out where there is one member (0 for every
    example: no order).
    """
    measured = {}
    for name, score in SELECTIVE_SCORES.items():
        if name == "mutual_information" and logits.shape[0] == 1:
            continue
        scores = None if score is None else score(logits)
        measured[name] = float(uncertainty.aurc(logits, labels, scores=scores))
    return measured


def selective_measured(
    predict: Callable[[Any], jax.Array], data: QualityData
) -> dict[str, Any]:
    """:func:`selective_by_score` on the test set and under shift.

    Returns:
      ``{"in_distribution": {score: AURC}, "shift_mean": {score: mean over
      severities}}``; a score left out (one member's mutual information) is
      ``None``.
    """
    result = {"in_distribution": selective_by_score(predict(data.x_test), data.y_test)}
    _, result["shift_mean"] = over_shifts(
        lambda x, y: selective_by_score(predict(x), y), data.shifted
    )
    for part in result.values():
        for name in SELECTIVE_SCORES:
            part.setdefault(name, None)
    return result
