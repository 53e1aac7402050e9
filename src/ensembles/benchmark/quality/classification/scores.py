"""A trained classifier, measured: accuracy, NLL, ECE, Brier, AURC, OOD, T.

:func:`evaluate` measures, with :mod:`ensembles.uncertainty`, a method's
member logits ``[E, N, C]`` on a task's test set, at every severity of shift
(the mean over its families, as CIFAR-10-C results average over
corruptions) and on its out-of-distribution sets (how well total entropy and
mutual information tell them from the test set). Every method is measured
twice: **as trained**, and **recalibrated**, with one temperature of its own
(:func:`ensembles.uncertainty.fit_temperature`, pool then calibrate) fitted
on a validation split held out of the training data, never the test set;
then at the other calibrations of
:mod:`~ensembles.benchmark.quality.calibration`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ensembles import uncertainty
from ensembles.benchmark.quality.calibration import (
    CLASSIFIER_CALIBRATIONS,
    cached,
    calibrate_classifier,
    classifier_diversity,
    diversity,
    diversity_sets,
)
from ensembles.benchmark.quality.classification.toolbox import (
    CALIBRATORS,
    calibrate_beyond_temperature,
    measure_sets,
    nan_sets,
    ood_by_score,
    selective_measured,
)
from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.measures import (
    at_bound,
    detection,
    nan_like,
    over_shifts,
)
from ensembles.benchmark.quality.training import Trained

__all__ = ["METRICS", "TEMPERATURE_BOUNDS", "evaluate"]

#: The metrics of a labelled set, each from :mod:`ensembles.uncertainty`
#: (``aurc``: the area under the risk-coverage curve, selective prediction).
METRICS: tuple[str, ...] = ("accuracy", "nll", "ece", "brier", "aurc")

#: The temperatures :func:`evaluate` fits within (those of
#: :func:`ensembles.uncertainty.fit_temperature`).
TEMPERATURE_BOUNDS: tuple[float, float] = (0.05, 20.0)

_MEASURED = ("in_distribution", "shift", "shift_mean", "ood")


@jax.jit
def _metric_values(logits: jax.Array, labels: jax.Array) -> dict[str, jax.Array]:
    # One compiled program per set's shape instead of every metric's ops one
    # by one (labels were checked when the data were built).
    return {name: getattr(uncertainty, name)(logits, labels) for name in METRICS}


def _metrics(logits: jax.Array, labels: np.ndarray) -> dict[str, float]:
    values = _metric_values(logits, jnp.asarray(labels))
    return {name: float(values[name]) for name in METRICS}


def _ood(score: Callable, logits_in: jax.Array, logits_out: jax.Array) -> tuple:
    """AUROC and FPR at 95% TPR of ``score`` telling out- from in-distribution."""
    return detection(score(logits_in), score(logits_out))


def _measure_sets(predict: Callable, data: QualityData, mutual_information: bool):
    """Every set's metrics for one predictor of ``[E, N, C]`` logits."""
    logits_in = predict(data.x_test)
    result: dict[str, Any] = {"in_distribution": _metrics(logits_in, data.y_test)}
    result["shift"], result["shift_mean"] = over_shifts(
        lambda x, y: _metrics(predict(x), y), data.shifted
    )
    ood, by_score = {}, {}
    for name, x in data.ood.items():
        logits_out = predict(x)
        auroc_h, fpr_h = _ood(uncertainty.total_entropy, logits_in, logits_out)
        scores = {"auroc_entropy": auroc_h, "fpr95_entropy": fpr_h}
        if mutual_information:
            if logits_in.shape[0] == 1:  # one member: mutual information is 0
                auroc_mi = fpr_mi = None
            else:
                auroc_mi, fpr_mi = _ood(
                    uncertainty.mutual_information, logits_in, logits_out
                )
            scores.update(auroc_mi=auroc_mi, fpr95_mi=fpr_mi)
            by_score[name] = ood_by_score(logits_in, logits_out)  # as trained
        ood[name] = scores
    result["ood"] = ood
    if mutual_information:  # as trained: the logits every score reads
        result["ood_scores"] = by_score
        result["selective"] = selective_measured(predict, data)
    return result


def evaluate(
    trained: Trained,
    data: QualityData,
    *,
    x_valid: np.ndarray,
    y_valid: np.ndarray,
) -> dict[str, Any]:
    """Measures a trained method on every test set, as trained and recalibrated.

    Shift metrics at a severity are the means over that severity's shift
    families of the metrics of each family's set (as CIFAR-10-C results
    average over corruptions). The recalibrated figures are those of the
    method's pooled predictive at one temperature
    (:func:`ensembles.uncertainty.scale_temperature`), fitted by
    :func:`ensembles.uncertainty.fit_temperature` on ``(x_valid, y_valid)``
    alone.

    Args:
      trained: from :func:`~ensembles.benchmark.quality.methods.train_method`.
      data: the test, shifted and out-of-distribution sets.
      x_valid: held-out examples the method was not trained on (never test
        examples), to fit the temperature on.
      y_valid: their labels.

    Returns:
      ``{"in_distribution": {metric: value}, "shift": [{"severity": s,
      metric: value, ...}, ...], "shift_mean": {metric: mean over
      severities}, "ood": {set: {"auroc_entropy": a, "auroc_mi": a,
      "fpr95_entropy": f, "fpr95_mi": f}}, "temperature": T,
      "temperature_at_bound": bool, "recalibrated": {the same but for "ood":
      entropy only}}``. ``temperature_at_bound`` says the fit ended at one of
      :data:`TEMPERATURE_BOUNDS`: the validation set did not identify T (at
      the lower bound: typically no error on it, where the NLL falls as T ->
      0), and the recalibrated figures are not to be trusted. The
      ``ood`` entries tell the set from the test set by total entropy and by
      mutual information (AUROC, and the false-positive rate at 95% true
      positives); the ``_mi`` entries are ``None`` where there is one member
      (``single``, or E = 1): its mutual information is 0 everywhere.
      Recalibration pools the members before scaling, so the members'
      disagreement, and with it the mutual information, is that of the
      method as trained: ``recalibrated["ood"]`` has the entropy scores only.
      ``diverged`` says the method's logits on the validation set hold a NaN
      or infinity (training diverged): no temperature is fitted, its
      recalibrated figures are NaN, and the other methods' rows stand.
      The rest of the toolbox
      (:mod:`~ensembles.benchmark.quality.classification.toolbox`), from the
      logits as trained: ``ood_scores`` is ``{set: {"auroc_<score>": a,
      "fpr95_<score>": f}}`` for every score of its ``OOD_SCORES``; ``selective``
      is ``{"in_distribution": {score: AURC}, "shift_mean": {...}}``;
      ``calibrators`` ``{name: {"in_distribution": ..., "shift_mean":
      ...}}`` for every calibrator of its ``CALIBRATORS``, fitted on
      ``(x_valid, y_valid)``; ``sets`` the conformal sets' sizes and
      coverages (``size_<variant>``, ``coverage_<variant>``) in
      distribution and under shift.
    """
    predict = cached(trained.predict)  # every calibration measures the same logits
    valid = predict(x_valid)
    diverged = not bool(jnp.isfinite(valid).all())
    temperature = math.nan
    if not diverged:
        temperature = float(
            uncertainty.fit_temperature(
                valid, np.asarray(y_valid), bounds=TEMPERATURE_BOUNDS
            )
        )
    result = _measure_sets(predict, data, mutual_information=True)
    result["diversity"] = diversity(
        lambda x: classifier_diversity(predict(x)), diversity_sets(data)
    )
    result["temperature"] = temperature
    # At a bound the validation set did not identify T (no errors on it, say).
    result["temperature_at_bound"] = at_bound(temperature, TEMPERATURE_BOUNDS)
    result["diverged"] = diverged
    if diverged:
        as_trained = {k: v for k, v in result.items() if k in _MEASURED}
        result["recalibrated"] = nan_like(as_trained)
        result["calibrations"] = {
            name: nan_like({"temperature": 0, **_in_and_shift(as_trained)})
            for name in CLASSIFIER_CALIBRATIONS
        }
        result["calibrators"] = {
            name: nan_like(_in_and_shift(as_trained)) for name in CALIBRATORS
        }
        result["sets"] = nan_sets()
        return result

    def recalibrated(x: np.ndarray) -> jax.Array:
        return uncertainty.scale_temperature(predict(x), temperature)

    result["recalibrated"] = _measure_sets(recalibrated, data, mutual_information=False)

    def measure(transform):
        return _in_and_shift(
            _measure_sets(
                lambda x: transform(predict(x)), data, mutual_information=False
            )
        )

    result["calibrations"] = calibrate_classifier(
        predict, measure, data.x_train, x_valid, y_valid, TEMPERATURE_BOUNDS
    )
    result["calibrators"] = calibrate_beyond_temperature(
        predict, measure, x_valid, y_valid
    )
    result["sets"] = measure_sets(predict, data, x_valid, y_valid)
    return result


def _in_and_shift(measured: dict[str, Any]) -> dict[str, Any]:
    return {key: measured[key] for key in ("in_distribution", "shift_mean")}
