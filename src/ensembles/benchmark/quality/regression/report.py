"""The tables of ``ensembles-bench --quality`` for a regression task.

The first table is the headline: every method at the recommended
calibration (:data:`~ensembles.benchmark.quality.calibration.RECOMMENDED`:
a scale of each member's std, fitted on held-out training data); the second
the fair comparison by one scale of each method's whole predictive spread;
then the share
of the NLL and CRPS gaps from one model to the deep ensemble that each
method closes; then the figures as trained, with out-of-distribution
detection by the members' disagreement (epistemic variance) and by the
total variance, and split-conformal coverage; then NLL / CRPS / 90%
coverage per severity; then the 90% intervals compared (the mixture's, the
conformal ``mu +- q sd`` and the conformalised mixture interval, CQR).
Every figure is in the targets' units.
"""

from __future__ import annotations

from typing import Any

from ensembles.benchmark.quality.tables import (
    best_row,
    calibration_tables,
    cell,
    gap_lines,
    mean_cell,
    method_label,
    recommended,
    severity_table,
    title,
)
from ensembles.benchmark.report import render_table

__all__ = ["regression_block"]

# (header, where in a summary entry, metric, higher is better); coverage is
# best nearest 90%, which no column ranks: "best" leaves it out.
_RECALIBRATED: tuple[tuple[str, str, str, bool | None], ...] = (
    ("RMSE", "in_distribution", "rmse", False),
    ("NLL", "in_distribution", "nll", False),
    ("CRPS", "in_distribution", "crps", False),
    ("PIT err", "in_distribution", "pit_error", False),
    ("cov 90", "in_distribution", "coverage90", None),
    ("width 90", "in_distribution", "width90", None),
    ("shift RMSE", "shift_mean", "rmse", False),
    ("shift NLL", "shift_mean", "nll", False),
    ("shift CRPS", "shift_mean", "crps", False),
    ("shift cov 90", "shift_mean", "coverage90", None),
)
_AS_TRAINED: tuple[tuple[str, str, str, bool | None], ...] = (
    ("NLL", "in_distribution", "nll", False),
    ("NLL (Gaussian)", "in_distribution", "nll_moment_matched", False),
    ("CRPS", "in_distribution", "crps", False),
    ("PIT err", "in_distribution", "pit_error", False),
    ("cov 90", "in_distribution", "coverage90", None),
    ("conformal cov 90", "in_distribution", "coverage90_conformal", None),
    ("spread~error", "in_distribution", "spread_error", True),
    ("shift NLL", "shift_mean", "nll", False),
    ("shift CRPS", "shift_mean", "crps", False),
    ("shift cov 90", "shift_mean", "coverage90", None),
    ("shift conformal cov 90", "shift_mean", "coverage90_conformal", None),
)
# The figures of each severity's cell.
_SEVERITY_METRICS = ("nll", "crps", "coverage90")
_OOD: tuple[tuple[str, str, bool], ...] = (
    ("AUROC epistemic", "auroc_epistemic", True),
    ("AUROC total", "auroc_total", True),
)


def _columns(spec, part: str | None):
    def pick(entry, where, metric):
        measured = entry if part is None else entry[part]
        return measured[where].get(metric)

    return [
        (lambda e, where=where, metric=metric: pick(e, where, metric), high)
        for _, where, metric, high in spec
    ]


def _rows(group, columns, lead) -> list[list[str]]:
    return [
        [
            *lead(entry),
            *(cell(stats_of(entry), entry["seeds"]) for stats_of, _ in columns),
        ]
        for entry in group
    ]


def _best(group, columns) -> list[str]:
    ranked = [(stats_of, high) for stats_of, high in columns if high is not None]
    cells = iter(best_row(group, ranked))
    return [next(cells) if high is not None else "" for _, high in columns]


def _recalibrated_table(group) -> tuple[list[str], list[list[str]]]:
    """Every method with its whole predictive's spread scaled once."""

    def scale(entry):
        at_bound = entry.get("std_scale_at_bound")
        star = "*" if at_bound is not None and at_bound["mean"] else ""
        return cell(entry["std_scale"], entry["seeds"]) + star

    return _calibrated_table(
        group, "scale", _columns(_RECALIBRATED, "recalibrated"), scale
    )


def _recommended_table(group) -> tuple[list[str], list[list[str]]]:
    """Every method at the recommended calibration (mean scale over members)."""
    columns = [
        (lambda e, where=where, metric=metric: recommended(e)[where].get(metric), high)
        for _, where, metric, high in _RECALIBRATED
    ]
    return _calibrated_table(
        group,
        "mean scale",
        columns,
        lambda e: cell(recommended(e)["std_scale"], e["seeds"]),
    )


def _calibrated_table(group, parameter, columns, fitted):
    """``columns`` of :data:`_RECALIBRATED` after a calibration ``fitted`` names."""
    header = ["method", "params", "train s", parameter, *(c[0] for c in _RECALIBRATED)]

    def lead(entry):
        return [
            method_label(entry),
            f"{entry['params']:,}",
            f"{entry['train_s']['mean']:.1f}",
            fitted(entry),
        ]

    rows = _rows(group, columns, lead)
    return header, [*rows, ["best", "", "", "", *_best(group, columns)]]


def _as_trained_table(group) -> tuple[list[str], list[list[str]]]:
    columns = _columns(_AS_TRAINED, None)
    header = ["method", *(c[0] for c in _AS_TRAINED)]
    if "aleatoric_log_sd_rmse" in group[0]["in_distribution"]:
        header.append("log sd error")
        columns.append(
            (lambda e: e["in_distribution"].get("aleatoric_log_sd_rmse"), False)
        )
    for name in group[0].get("ood", {}):
        header += [f"{name} {suffix}" for suffix, _, _ in _OOD]
        columns += [
            (lambda e, name=name, key=key: e["ood"][name].get(key), high)
            for _, key, high in _OOD
        ]
    rows = _rows(group, columns, lambda entry: [method_label(entry)])
    return header, [*rows, ["best", *_best(group, columns)]]


# The 90% intervals compared: (header, the metrics' suffix).
_INTERVALS: tuple[tuple[str, str], ...] = (
    ("mixture", ""),
    ("conformal mu +- q sd", "_conformal"),
    ("conformal mixture (CQR)", "_cqr"),
)


def _interval_tables(group, markdown: bool) -> list[str]:
    """Coverage / width of the 90% intervals, in distribution and under shift."""
    if "coverage90_cqr" not in group[0]["in_distribution"]:
        return []  # results of an older run
    header = ["method", *(name for name, _ in _INTERVALS)]
    lines = []
    for part, label in (
        ("in_distribution", "in distribution"),
        ("shift_mean", "under shift"),
    ):
        rows = [
            [
                method_label(entry),
                *(
                    " / ".join(
                        mean_cell(entry[part].get(f"{metric}90{suffix}"))
                        for metric in ("coverage", "width")
                    )
                    for _, suffix in _INTERVALS
                ),
            ]
            for entry in group
        ]
        lines += [
            "",
            f"90% intervals as trained, {label}: coverage / mean width (the "
            "mixture's own; the conformal ones fitted on the held-out examples):",
            "",
            render_table(header, rows, markdown=markdown, left=0),
        ]
    return lines


def regression_block(group: list[dict[str, Any]], *, markdown: bool = False) -> str:
    """The tables of one regression task, model and E (summarised entries).

    Args:
      group: the summary entries of one task, model and E
        (:func:`~ensembles.benchmark.quality.report.summarize`).
      markdown: Markdown tables instead of aligned text.

    Returns:
      The block of text.
    """
    heading = f"**{title(group)}**" if markdown else title(group)
    held = group[0].get("validation_examples")

    def table(header_rows):
        return render_table(*header_rows, markdown=markdown, left=0)

    held = (f"{held:,} " if held else "") + "held-out training examples"
    block = [
        heading,
        "",
        "Every figure in the targets' units; cov 90: the share of targets in "
        "the central 90% interval.",
    ]
    if all(recommended(entry) is not None for entry in group):
        block += [
            "",
            "At the recommended calibration: every method's members' stds "
            f"scaled by a factor each, fitted on {held} (never the test set), "
            "then pooled (docs/training.md):",
            "",
            table(_recommended_table(group)),
        ]
    block += [
        "",
        "Recalibrated: every method's whole predictive spread scaled by one "
        f"factor, fitted on {held} (never the test set):",
        "",
        table(_recalibrated_table(group)),
    ]
    if any((e.get("std_scale_at_bound") or {}).get("mean") for e in group):
        block += [
            "",
            "* In some seed the scale's fit ended at a bound: the held-out examples "
            "did not identify it, and that row's recalibrated figures are not to be "
            "trusted.",
        ]
    gaps = "\n".join(filter(None, (gap_lines(group, m) for m in ("nll", "crps"))))
    if gaps:
        block += ["", gaps]
    block += [
        "",
        "As trained (OOD: how well the epistemic or total variance tells each "
        "set from the test set; conformal: split-conformal 90% intervals fitted "
        "on the held-out examples):",
        "",
        table(_as_trained_table(group)),
        "",
        "Recalibrated NLL / CRPS / 90% coverage by shift severity (test = in "
        "distribution):",
        "",
        table(severity_table(group, "recalibrated", _SEVERITY_METRICS, method_label)),
        "",
        "As trained, NLL / CRPS / 90% coverage by shift severity:",
        "",
        table(severity_table(group, None, _SEVERITY_METRICS, method_label)),
    ]
    block += _interval_tables(group, markdown)
    block += calibration_tables(group, second="coverage90", markdown=markdown)
    return "\n".join(block)
