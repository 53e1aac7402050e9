"""The report of ``ensembles-bench --quality``: the rows summarised, as tables.

:func:`summarize` gives every task, model, E and method its means and
standard deviations over seeds, and the share of the gap from one model to
the deep ensemble that each BatchEnsemble method closes; :func:`format_quality`
prints a block of tables per task, model and E, a classification task's
(:mod:`~ensembles.benchmark.quality.classification.report`) or a regression
task's (:mod:`~ensembles.benchmark.quality.regression.report`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from ensembles.benchmark.quality.kinds import kind_of_entry
from ensembles.benchmark.quality.methods import closes_gap
from ensembles.benchmark.quality.tables import GAP, groups_of, recommended

__all__ = [
    "MIN_GAP",
    "MIN_GAP_STANDARD_ERRORS",
    "format_quality",
    "summarize",
    "summary_of",
]

#: "Gap closed" is only defined where the deep ensemble's NLL is lower than
#: one model's by at least this share of one model's NLL, and by more than
#: :data:`MIN_GAP_STANDARD_ERRORS` standard errors of the difference of the two
#: means over seeds: over a smaller gap the ratio is noise (a 0.001 gap makes
#: 125% or -1200% of nothing; a gap of one standard error, 150%).
MIN_GAP: float = 0.02

#: See :data:`MIN_GAP`: the standard error of the difference of the two mean
#: NLLs is ``sqrt(std_single**2 / n_single + std_deep**2 / n_deep)`` from the
#: seeds' sample standard deviations (zero for one seed).
MIN_GAP_STANDARD_ERRORS: float = 2.0


def _mean_std(values: list[float | None]) -> dict[str, float | None]:
    if any(value is None for value in values):
        return {"mean": None, "std": None}
    if any(math.isnan(value) for value in values):
        # A diverged seed: no mean to give (statistics.stdev raises on NaN).
        return {"mean": math.nan, "std": math.nan}
    if any(math.isinf(value) for value in values):
        # An infinite figure (an NLL where a calibrator gave the label
        # probability 0): the mean is infinite (NaN if of both signs), the
        # spread undefined (statistics.stdev raises on infinities).
        return {"mean": statistics.fmean(values), "std": math.nan}
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def _aggregate(values: list[Any]) -> Any:
    """Means and stds over seeds of a measurement tree (dicts, lists, numbers).

    A ``"severity"`` entry is a label, kept as it is.
    """
    first = values[0]
    if isinstance(first, dict):
        return {
            key: (
                first[key]
                if key == "severity"
                else _aggregate([value[key] for value in values])
            )
            for key in first
        }
    if isinstance(first, list):
        return [_aggregate([value[i] for value in values]) for i in range(len(first))]
    return _mean_std(values)


_IDENTITY = ("task", "regression", "method", "model", "members", "seed", "steps")
_COUNTS = ("params", "train_examples", "validation_examples")


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Means and standard deviations over seeds, per task, model, E and method.

    >>> from ensembles.benchmark.quality.report import summarize
    >>> row = {"method": "single", "model": "mlp", "members": 4, "params": 10,
    ...        "train_s": 1.0, "in_distribution": {"nll": 0.5},
    ...        "shift": [{"severity": 1, "nll": 0.7}], "shift_mean": {"nll": 0.7},
    ...        "ood": {"noise": {"auroc_entropy": 0.6, "auroc_mi": None}}}
    >>> other = {**row, "in_distribution": {"nll": 0.7}}
    >>> summary = summarize([row, other])[0]
    >>> round(summary["in_distribution"]["nll"]["mean"], 6)
    0.6
    >>> summary["seeds"], summary["ood"]["noise"]["auroc_mi"]
    (2, {'mean': None, 'std': None})

    Args:
      rows: from :func:`~ensembles.benchmark.quality.run.run_quality`.

    Returns:
      One dict per (task, model, E, method), in first-seen order, with
      ``seeds`` (how many), ``params`` and, for ``train_s``, the temperature
      and every measurement (as trained and ``recalibrated``), ``{"mean": m,
      "std": s}`` (sample standard deviation; 0 for one seed). A
      ``gap_closed`` entry on ``batchensemble``, ``rank1`` and ``finetuned``
      rows with a single model and a deep ensemble beside them gives the
      fraction of the NLL gap from one model to the deep ensemble that it
      closes, in distribution and under shift (mean over severities),
      at the recommended calibration (``gap_closed_recommended``:
      :data:`~ensembles.benchmark.quality.calibration.RECOMMENDED`),
      recalibrated (``gap_closed``) and as trained
      (``gap_closed_as_trained``); ``None`` where the deep ensemble is no
      better than one model by more than noise (at least :data:`MIN_GAP` of
      its NLL and more than :data:`MIN_GAP_STANDARD_ERRORS` standard errors).
      With fewer than two seeds of one model or of the deep ensemble there is
      no noise rule, and no ``gap_closed`` entry (one seed once printed 911%
      and -444% of gaps the seeds could not tell from noise).
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = (row.get("task", "mnist1d"), row["model"], row["members"], row["method"])
        groups.setdefault(key, []).append(row)
    summary = []
    for (task, model, members, method), group in groups.items():
        measured = {
            key: value
            for key, value in group[0].items()
            if key not in _IDENTITY and key not in _COUNTS
        }
        entry: dict[str, Any] = {
            "task": task,
            "method": method,
            "model": model,
            "members": members,
            "seeds": len(group),
            "regression": kind_of_entry(group[0]).regression,
            **{key: group[0][key] for key in _COUNTS if key in group[0]},
            **{key: _aggregate([row[key] for row in group]) for key in measured},
        }
        summary.append(entry)
    by_key = {(e["task"], e["model"], e["members"], e["method"]): e for e in summary}
    for entry in summary:
        if not closes_gap(entry["method"]):
            continue
        where = (entry["task"], entry["model"], entry["members"])
        single, deep = (by_key.get((*where, end)) for end in GAP)
        if single is None or deep is None:
            continue
        if min(single["seeds"], deep["seeds"]) < 2:
            continue  # one seed has no spread: no noise rule, no ratio
        for metric in kind_of_entry(entry).gap_metrics:
            suffix = "" if metric == "nll" else f"_{metric}"
            for name, pick in (
                (f"gap_closed{suffix}_recommended", recommended),
                (f"gap_closed{suffix}", lambda e: e.get("recalibrated")),
                (f"gap_closed{suffix}_as_trained", lambda e: e),
            ):
                if any(pick(e) is None for e in (single, entry, deep)):
                    continue
                entry[name] = {
                    part: _gap_closed(
                        pick(single)[part],
                        pick(entry)[part],
                        pick(deep)[part],
                        seeds=(single["seeds"], deep["seeds"]),
                        metric=metric,
                    )
                    for part in ("in_distribution", "shift_mean")
                    if metric in pick(entry).get(part, {})
                }
    return summary


def _gap_closed(
    single: dict, ensemble: dict, deep: dict, seeds: tuple[int, int], metric: str
) -> float | None:
    means = [e[metric]["mean"] for e in (single, ensemble, deep)]
    if any(mean is None or not math.isfinite(mean) for mean in means):
        return None  # a diverged method or an infinite NLL: no ratio to give
    gap = means[0] - means[2]
    standard_error = math.sqrt(
        single[metric]["std"] ** 2 / seeds[0] + deep[metric]["std"] ** 2 / seeds[1]
    )
    noise = max(MIN_GAP * abs(means[0]), MIN_GAP_STANDARD_ERRORS * standard_error)
    if not math.isfinite(standard_error) or gap <= noise:
        return None  # no gap to close that the seeds can tell from noise
    return (means[0] - means[1]) / gap


def summary_of(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``results`` as a summary: rows of ``run_quality`` are summarised."""
    results = list(results)
    if results and "seeds" not in results[0]:
        return summarize(results)
    return results


def format_quality(results: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """The quality tables, one block per task, model and E.

    Each block gives the methods at the recommended calibration, then
    recalibrated, as trained, NLL / ECE per severity and the rest.

    Takes the rows of :func:`~ensembles.benchmark.quality.run.run_quality` (it
    summarises them) or their :func:`summarize`.
    The last row of each table names the best method of each column.

    >>> from ensembles.benchmark.quality.report import format_quality
    >>> def row(method, nll, seed):
    ...     metrics = {"accuracy": 0.9, "nll": nll, "ece": 0.02, "brier": 0.1,
    ...                "aurc": 0.05}
    ...     measured = {"in_distribution": metrics,
    ...                 "shift": [{"severity": s, **metrics} for s in (1, 2)],
    ...                 "shift_mean": metrics}
    ...     return {"method": method, "model": "cnn", "members": 4, "seed": seed,
    ...             "params": 10, "train_s": 1.0, **measured,
    ...             "ood": {"noise": {"auroc_entropy": 0.7,
    ...                               "auroc_mi": None if method == "single"
    ...                               else 0.8, "fpr95_entropy": 0.5,
    ...                               "fpr95_mi": None if method == "single"
    ...                               else 0.4}},
    ...             "temperature": 1.0, "recalibrated": measured,
    ...             "calibrations": {"members": {"temperature": 1.2, **measured}}}
    >>> rows = [row(method, nll, seed) for seed in (0, 1) for method, nll in
    ...         (("single", 0.3), ("batchensemble", 0.2), ("deep_ensemble", 0.1))]
    >>> print(format_quality(rows, markdown=True))
    **cnn on MNIST-1D, E=4, mean ± std over 2 seeds**
    <BLANKLINE>
    At the recommended calibration: every method's members at a temperature ...
    <BLANKLINE>
    | method | params | train s | mean T | acc | NLL | ECE | Brier | shift acc | ...
    |:---|---:|---:|...
    | single | 10 | 1.0 | 1.200 ± 0.000 | 0.900 ± 0.000 | 0.300 ± 0.000 | ...
    | batchensemble | 10 | 1.0 | 1.200 ± 0.000 | 0.900 ± 0.000 | 0.200 ± 0.000 | ...
    | deep_ensemble | ...
    | best | | | | (tie) | deep_ensemble | (tie) | ...
    <BLANKLINE>
    Recalibrated: every method's pooled predictive at one temperature T, ...
    <BLANKLINE>
    | method | params | train s | T | acc | NLL | ECE | Brier | shift acc | ...
    ...
    batchensemble closes ... recommended-calibration NLL gap ...: in ...
    batchensemble closes ... recalibrated NLL gap ...: in distribution 50%, ...
    batchensemble closes this much of the as trained NLL gap ...
    <BLANKLINE>
    As trained:
    ...

    Args:
      results: rows from :func:`~ensembles.benchmark.quality.run.run_quality`, or
        their summary.
      markdown: Markdown tables instead of aligned text.

    Returns:
      The tables, one set per task, model and E.
    """
    return "\n\n".join(
        kind_of_entry(group[0]).block(group, markdown=markdown)
        for group in groups_of(summary_of(results)).values()
    )
