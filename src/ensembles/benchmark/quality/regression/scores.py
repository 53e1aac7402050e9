"""``ensembles-bench --quality`` for regression: what an ensemble's mixture buys.

Every method's members predict a Gaussian per example (a mean-and-spread
head trained with :func:`ensembles.training.gaussian_nll` on standardised
targets); the ensemble predicts their exact uniform mixture
(:mod:`ensembles.uncertainty`), in the targets' own units. It is measured
**as trained** and **recalibrated**: the spread of the whole predictive
scaled by one factor of its own (:func:`ensembles.uncertainty.fit_std_scale`),
fitted on the validation split (never the test set), the regression analogue
of a classifier's temperature. Split-conformal intervals fitted on the same
split are measured beside them, ``mu +- q sd``
(:func:`ensembles.uncertainty.fit_conformal_quantile`) and the mixture's own
interval widened by a conformal margin (CQR,
:func:`ensembles.uncertainty.fit_conformal_margin`): their coverage is
guaranteed in distribution, and the shifted sets show by how much it fails
out of it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ensembles import uncertainty
from ensembles._checks import as_real_array
from ensembles.benchmark.quality.calibration import (
    REGRESSOR_CALIBRATIONS,
    cached,
    calibrate_regressor,
    diversity,
    diversity_sets,
    regressor_diversity,
)
from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.measures import (
    at_bound,
    detection,
    nan_like,
    over_shifts,
)
from ensembles.benchmark.quality.regression.head import TargetScale
from ensembles.benchmark.quality.training import Trained

__all__ = [
    "PIT_LEVELS",
    "REGRESSION_METRICS",
    "SCALE_BOUNDS",
    "TargetScale",
    "evaluate_regression",
]

#: The metrics of a set with targets, each in the targets' units: the RMSE
#: of the mixture mean, the NLL of the exact mixture and of its
#: moment-matched Gaussian, the CRPS, the PIT calibration error, the
#: coverage, mean width and Winkler score of the central 90% intervals, and
#: Spearman's correlation of the predicted spread with the error.
REGRESSION_METRICS: tuple[str, ...] = (
    "rmse",
    "nll",
    "nll_moment_matched",
    "crps",
    "pit_error",
    "coverage90",
    "width90",
    "interval_score90",
    "spread_error",
)

#: The scales :func:`evaluate_regression` fits within.
SCALE_BOUNDS: tuple[float, float] = (0.05, 20.0)

#: The levels ``p`` of the in-distribution PIT curve (``pit_curve``: the
#: share of test targets whose PIT value is at most ``p``; ``p`` itself for a
#: calibrated predictive), the reliability diagram of a regressor.
PIT_LEVELS: tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(1, 20))

_BAND_POINTS = 200
_BAND_EXAMPLES = 300

_LEVEL = 0.9


@jax.jit
def _metric_values(means, stds, targets) -> dict[str, jax.Array]:
    # One compiled program per set's shape (the data were checked when built).
    u = uncertainty
    return {
        "rmse": u.rmse(means, stds, targets),
        "nll": u.mixture_nll(means, stds, targets),
        "nll_moment_matched": u.moment_matched_nll(means, stds, targets),
        "crps": u.crps(means, stds, targets),
        "pit_error": u.pit_calibration_error(means, stds, targets),
        "coverage90": u.interval_coverage(means, stds, targets, _LEVEL),
        "width90": u.interval_width(means, stds, _LEVEL),
        "interval_score90": u.interval_score(means, stds, targets, _LEVEL),
        "spread_error": u.spread_error_correlation(means, stds, targets),
    }


def _metrics(
    members: tuple, targets: np.ndarray, conformal: tuple[float, float] | None
) -> dict:
    values = {
        name: float(value)
        # Converted before the jit: its boundary would wrap int64 targets.
        for name, value in _metric_values(
            *members, as_real_array(targets, "targets")
        ).items()
    }
    if conformal is not None:  # the conformal intervals of the as-trained members
        quantile, margin = conformal
        for name, (lower, upper) in (
            ("conformal", uncertainty.conformal_interval(*members, quantile)),
            (
                "cqr",
                uncertainty.conformal_mixture_interval(*members, margin, _LEVEL),
            ),
        ):
            lower, upper = np.asarray(lower), np.asarray(upper)
            inside = (targets >= lower) & (targets <= upper)
            # A NaN bound (a NaN prediction) covers nothing and misses
            # nothing: the share is NaN, as every other aggregate of such a
            # set is.
            unknown = np.isnan(lower).any() or np.isnan(upper).any()
            values[f"coverage90_{name}"] = (
                math.nan if unknown else float(np.mean(inside))
            )
            values[f"width90_{name}"] = (
                math.nan if unknown else float(np.mean(upper - lower))
            )
    return values


def _total(variance: jax.Array) -> np.ndarray:
    """``[N]`` per-example scores: variances summed over D outputs."""
    variance = np.asarray(variance)
    return variance if variance.ndim == 1 else variance.sum(axis=-1)


def _measure_sets(
    predict: Callable,
    data: QualityData,
    conformal: tuple[float, float] | None,
    ood: bool,
) -> dict[str, Any]:
    """Every set's metrics for one predictor of ``(means, stds)``.

    ``conformal``: the split-conformal quantile and the CQR margin, whose
    intervals are measured too.
    """
    members_in = predict(data.x_test)
    result: dict[str, Any] = {
        "in_distribution": _metrics(members_in, data.y_test, conformal)
    }
    pit = np.asarray(uncertainty.mixture_cdf(*members_in, data.y_test)).reshape(-1)
    # A NaN PIT value (a diverged prediction) is no share of any level: the
    # curve is NaN, as every other aggregate of such a set is, never a curve
    # that counts it above every level.
    result["pit_curve"] = [
        math.nan if np.isnan(pit).any() else float(np.mean(pit <= level))
        for level in PIT_LEVELS
    ]
    if data.noise_std is not None:
        aleatoric = np.sqrt(np.asarray(uncertainty.aleatoric_variance(*members_in)))
        error = np.log(aleatoric) - np.log(np.asarray(data.noise_std))
        result["in_distribution"]["aleatoric_log_sd_rmse"] = float(
            np.sqrt(np.mean(error**2))
        )
    result["shift"], result["shift_mean"] = over_shifts(
        lambda x, y: _metrics(predict(x), y, conformal), data.shifted
    )
    if ood:
        result["ood"] = _ood_scores(members_in, predict, data)
    if np.shape(data.x_test)[1:] == (1,):
        result["bands"] = _bands(predict, data)
    return result


def _bands(predict: Callable, data: QualityData) -> dict[str, list[float]]:
    """A 1-D task's predictive on a grid over every set: mean, 90% interval.

    The grid spans the test, shifted and OOD inputs; ``train_x``/``train_y``
    are up to 300 training examples, for the plot's context.
    """
    inputs = [data.x_test, *data.ood.values()]
    inputs += [x for families in data.shifted.values() for x, _ in families.values()]
    low = min(float(np.min(x)) for x in inputs)
    high = max(float(np.max(x)) for x in inputs)
    grid = np.linspace(low, high, _BAND_POINTS, dtype=np.float32)[:, None]
    members = predict(grid)
    lower, upper = uncertainty.mixture_interval(*members, level=_LEVEL)
    y = np.asarray(data.y_train).reshape(len(data.y_train), -1)[:_BAND_EXAMPLES, 0]
    return {
        "x": grid[:, 0].tolist(),
        "mean": np.asarray(uncertainty.mixture_mean(*members)).reshape(-1).tolist(),
        "lower": np.asarray(lower).reshape(-1).tolist(),
        "upper": np.asarray(upper).reshape(-1).tolist(),
        "epistemic_sd": np.sqrt(np.asarray(uncertainty.epistemic_variance(*members)))
        .reshape(-1)
        .tolist(),
        "train_x": np.asarray(data.x_train)[:_BAND_EXAMPLES, 0].tolist(),
        "train_y": y.tolist(),
    }


def _ood_scores(members_in, predict: Callable, data: QualityData) -> dict:
    """AUROC / FPR95 of total and epistemic variance, per OOD set."""
    one_member = members_in[0].shape[0] == 1
    total_in = _total(uncertainty.mixture_variance(*members_in))
    epistemic_in = _total(uncertainty.epistemic_variance(*members_in))
    scores = {}
    for name, x in data.ood.items():
        members_out = predict(x)
        auroc_total, fpr_total = detection(
            total_in, _total(uncertainty.mixture_variance(*members_out))
        )
        entry = {"auroc_total": auroc_total, "fpr95_total": fpr_total}
        if one_member:  # one member: epistemic variance is 0 everywhere
            entry.update(auroc_epistemic=None, fpr95_epistemic=None)
        else:
            epistemic_out = _total(uncertainty.epistemic_variance(*members_out))
            auroc, fpr = detection(epistemic_in, epistemic_out)
            entry.update(auroc_epistemic=auroc, fpr95_epistemic=fpr)
        scores[name] = entry
    return scores


def evaluate_regression(
    trained: Trained,
    data: QualityData,
    *,
    x_valid: np.ndarray,
    y_valid: np.ndarray,
    scale: TargetScale,
) -> dict[str, Any]:
    """Measures a trained regressor on every set, as trained and recalibrated.

    Shift metrics at a severity are the means over that severity's families.
    The recalibrated figures are those of the mixture stretched about its
    mean by one factor ``s`` (:func:`ensembles.uncertainty.scale_std`), fitted
    by :func:`ensembles.uncertainty.fit_std_scale` on ``(x_valid, y_valid)``
    alone; the split-conformal quantile of the normalised errors and the CQR
    margin of the mixture's 90% interval are fitted on the same split
    (``coverage90_conformal`` and ``coverage90_cqr``: the share of targets
    their intervals hold; ``width90_conformal`` and ``width90_cqr``: their
    mean widths).

    Args:
      trained: from :func:`~ensembles.benchmark.quality.methods.train_method`
        with ``regression=True``, on targets standardised by ``scale``.
      data: the test, shifted and out-of-distribution sets (targets in their
        own units).
      x_valid: held-out examples the method was not trained on.
      y_valid: their targets, in their own units.
      scale: the training targets' :class:`TargetScale`.

    Returns:
      ``{"in_distribution": {metric: value}, "shift": [{"severity": s,
      metric: value, ...}], "shift_mean": {...}, "ood": {set:
      {"auroc_total", "fpr95_total", "auroc_epistemic", "fpr95_epistemic"}},
      "std_scale": s, "std_scale_at_bound": bool, "conformal_quantile": q,
      "conformal_margin": m, "diverged": bool, "pit_curve": [...],
      "recalibrated": {the same, without "ood"}}`` (and ``"bands"``, the
      predictive on a grid, for examples of one input: :func:`_bands`); the
      metrics are :data:`REGRESSION_METRICS`, plus the conformal intervals'
      coverages and widths and, where the data know their noise,
      ``aleatoric_log_sd_rmse`` (the RMSE of the log of the members'
      aleatoric standard deviation against the true one's). ``diverged``
      says the method predicted a NaN or infinity on the validation set:
      its figures are then NaN, and the other methods' stand.
    """

    def predict_members(x: np.ndarray) -> tuple[jax.Array, jax.Array]:
        return scale.members(trained.predict(x))

    predict = cached(predict_members)  # every calibration measures the same
    valid = predict(x_valid)
    diverged = not all(np.isfinite(np.asarray(a)).all() for a in valid)
    std_scale = conformal = margin = math.nan
    if not diverged:
        with warnings.catch_warnings():  # reported as std_scale_at_bound
            warnings.filterwarnings("ignore", "fit_std_scale ended at", UserWarning)
            std_scale = float(
                uncertainty.fit_std_scale(
                    *valid, np.asarray(y_valid), bounds=SCALE_BOUNDS
                )
            )
        conformal = float(
            uncertainty.fit_conformal_quantile(*valid, np.asarray(y_valid), _LEVEL)
        )
        margin = float(
            uncertainty.fit_conformal_margin(*valid, np.asarray(y_valid), _LEVEL)
        )
    result = _measure_sets(
        predict, data, None if diverged else (conformal, margin), ood=True
    )
    result["diversity"] = diversity(
        lambda x: regressor_diversity(predict(x)), diversity_sets(data)
    )
    result.update(
        std_scale=std_scale,
        std_scale_at_bound=at_bound(std_scale, SCALE_BOUNDS),
        conformal_quantile=conformal,
        conformal_margin=margin,
        diverged=diverged,
    )
    if diverged:
        result["recalibrated"] = nan_like(
            {k: result[k] for k in ("in_distribution", "shift", "shift_mean")}
        )
        result["calibrations"] = {
            name: nan_like(
                {
                    "std_scale": 0,
                    **{k: result[k] for k in ("in_distribution", "shift_mean")},
                }
            )
            for name in REGRESSOR_CALIBRATIONS
        }
        return result

    def recalibrated(x: np.ndarray) -> tuple[jax.Array, jax.Array]:
        return uncertainty.scale_std(*predict(x), std_scale)

    result["recalibrated"] = _measure_sets(recalibrated, data, None, ood=False)

    def measure(transform):
        def calibrated(x):
            return transform(*predict(x))

        measured = _measure_sets(calibrated, data, None, ood=False)
        return {k: measured[k] for k in ("in_distribution", "shift_mean")}

    result["calibrations"] = calibrate_regressor(
        predict, measure, data.x_train, x_valid, y_valid, SCALE_BOUNDS
    )
    return result
