"""What measuring a trained method shares, a classifier's or a regressor's.

Both kinds' scores
(:func:`~ensembles.benchmark.quality.classification.scores.evaluate`,
:func:`~ensembles.benchmark.quality.regression.scores.evaluate_regression`)
measure every set of a task alike: each severity of shift as the mean over
its families, and the mean over severities (:func:`over_shifts`); how well a
score tells an out-of-distribution set from the test set (:func:`detection`);
whether a recalibration's fit ended at a bound (:func:`at_bound`); and a
diverged method's figures, NaN (:func:`nan_like`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ensembles import uncertainty

__all__ = ["at_bound", "detection", "nan_like", "over_shifts"]


def over_shifts(
    measure: Callable[[Any, Any], dict[str, float]],
    shifted: dict[Any, dict[str, tuple[Any, Any]]],
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every severity's figures, each the mean over its families, and their mean.

    >>> from ensembles.benchmark.quality.measures import over_shifts
    >>> shifted = {1: {"a": (1.0, 0), "b": (3.0, 0)}, 2: {"a": (6.0, 0)}}
    >>> over_shifts(lambda x, y: {"error": x}, shifted)
    ([{'severity': 1, 'error': 2.0}, {'severity': 2, 'error': 6.0}], {'error': 4.0})

    Args:
      measure: ``measure(x, y)`` gives one set's ``{metric: value}``.
      shifted: ``{severity: {family: (x, y)}}``, as ``QualityData.shifted``.

    Returns:
      ``(shift, shift_mean)``: ``[{"severity": s, metric: mean over the
      families}, ...]`` in the severities' order, and ``{metric: mean over
      the severities}``.
    """
    shift = []
    for severity, families in shifted.items():
        per_family = [measure(x, y) for x, y in families.values()]
        shift.append(
            {
                "severity": severity,
                **{
                    m: float(np.mean([f[m] for f in per_family])) for m in per_family[0]
                },
            }
        )
    shift_mean = {
        m: float(np.mean([level[m] for level in shift]))
        for m in shift[0]
        if m != "severity"
    }
    return shift, shift_mean


def detection(scores_in: Any, scores_out: Any) -> tuple[float, float]:
    """AUROC, and the FPR at 95% TPR, of scores telling out- from in-distribution."""
    return (
        float(uncertainty.auroc(scores_in, scores_out)),
        float(uncertainty.fpr_at_tpr(scores_in, scores_out, tpr=0.95)),
    )


def at_bound(value: float, bounds: tuple[float, float]) -> bool:
    """Whether a fit ended at one of its ``bounds``: the data did not identify it."""
    return any(math.isclose(value, bound, rel_tol=1e-3) for bound in bounds)


def nan_like(tree: Any) -> Any:
    """A measurement tree with every number NaN (labels and ``None`` kept).

    What a diverged method's figures are: no number that looks measured.
    """
    if isinstance(tree, dict):
        return {k: v if k == "severity" else nan_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [nan_like(v) for v in tree]
    return None if tree is None else math.nan
