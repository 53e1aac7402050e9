"""The tables of ``ensembles-bench --quality`` for a classification task.

The first table is the headline: every method at the recommended
calibration (:data:`~ensembles.benchmark.quality.calibration.RECOMMENDED`:
a temperature per member, fitted on held-out training data); the second
the fair comparison by one temperature of each method's pooled predictive;
then the share of the NLL gap
from one model to the deep ensemble that each method closes; then the
figures as trained, with out-of-distribution detection by total entropy and
mutual information; then NLL / ECE per severity, every method at each
calibration, and the rest of the toolbox
(:mod:`~ensembles.benchmark.quality.classification.toolbox_report`):
calibrators beyond one temperature, conformal sets, every OOD score,
selective prediction by every score.
"""

from __future__ import annotations

from typing import Any

from ensembles.benchmark.quality.classification.toolbox_report import toolbox_tables
from ensembles.benchmark.quality.tables import (
    best_row,
    calibration_tables,
    cell,
    gap_lines,
    method_label,
    recommended,
    severity_table,
    title,
)
from ensembles.benchmark.report import render_table

__all__ = ["classification_block"]

# (header, where in a summary entry, metric, higher is better);
# "shift" = mean over severities.
_RECALIBRATED: tuple[tuple[str, str, str, bool], ...] = (
    ("acc", "in_distribution", "accuracy", True),
    ("NLL", "in_distribution", "nll", False),
    ("ECE", "in_distribution", "ece", False),
    ("Brier", "in_distribution", "brier", False),
    ("shift acc", "shift_mean", "accuracy", True),
    ("shift NLL", "shift_mean", "nll", False),
    ("shift ECE", "shift_mean", "ece", False),
)
_AS_TRAINED: tuple[tuple[str, str, str, bool], ...] = (
    ("NLL", "in_distribution", "nll", False),
    ("ECE", "in_distribution", "ece", False),
    ("Brier", "in_distribution", "brier", False),
    ("AURC", "in_distribution", "aurc", False),
    ("shift NLL", "shift_mean", "nll", False),
    ("shift ECE", "shift_mean", "ece", False),
)
# (header suffix, key, higher is better) of each out-of-distribution set.
_OOD: tuple[tuple[str, str, bool], ...] = (
    ("AUROC H", "auroc_entropy", True),
    ("AUROC MI", "auroc_mi", True),
    ("FPR95 H", "fpr95_entropy", False),
    ("FPR95 MI", "fpr95_mi", False),
)


def _recalibrated_table(group) -> tuple[list[str], list[list[str]]]:
    """Every method at one temperature of its pooled predictive."""
    return _calibrated_table(
        group,
        "T",
        lambda e: e["recalibrated"],
        lambda e: cell(e["temperature"], e["seeds"]) + _at_bound(e),
    )


def _recommended_table(group) -> tuple[list[str], list[list[str]]]:
    """Every method at the recommended calibration (mean T over members)."""
    return _calibrated_table(
        group,
        "mean T",
        recommended,
        lambda e: cell(recommended(e)["temperature"], e["seeds"]),
    )


def _calibrated_table(group, parameter, figures, fitted):
    """``figures(entry)``'s columns of :data:`_RECALIBRATED`, ``fitted`` its T."""
    header = ["method", "params", "train s", parameter, *(c[0] for c in _RECALIBRATED)]
    columns = [
        (
            lambda e, where=where, metric=metric: figures(e)[where].get(metric),
            high,
        )
        for _, where, metric, high in _RECALIBRATED
    ]
    rows = [
        [
            method_label(entry),
            f"{entry['params']:,}",
            f"{entry['train_s']['mean']:.1f}",
            fitted(entry),
            *(cell(stats_of(entry), entry["seeds"]) for stats_of, _ in columns),
        ]
        for entry in group
    ]
    return header, [*rows, ["best", "", "", "", *best_row(group, columns)]]


def _at_bound(entry: dict[str, Any]) -> str:
    """``"*"`` where a seed's temperature fit ended at a bound."""
    stats = entry.get("temperature_at_bound")
    return "*" if stats is not None and stats["mean"] else ""


def _as_trained_table(group) -> tuple[list[str], list[list[str]]]:
    ood_sets = list(group[0]["ood"])
    header = ["method", *(c[0] for c in _AS_TRAINED)]
    columns = [
        (lambda e, where=where, metric=metric: e[where].get(metric), high)
        for _, where, metric, high in _AS_TRAINED
    ]
    for name in ood_sets:
        header += [f"{name} {suffix}" for suffix, _, _ in _OOD]
        columns += [
            (lambda e, name=name, key=key: e["ood"][name].get(key), high)
            for _, key, high in _OOD
        ]
    rows = [
        [
            method_label(entry),
            *(cell(stats_of(entry), entry["seeds"]) for stats_of, _ in columns),
        ]
        for entry in group
    ]
    return header, [*rows, ["best", *best_row(group, columns)]]


def _name(entry: dict[str, Any]) -> str:
    return entry["method"]


def classification_block(group: list[dict[str, Any]], *, markdown: bool = False) -> str:
    """The tables of one classification task, model and E (summarised entries).

    Args:
      group: the summary entries of one task, model and E
        (:func:`~ensembles.benchmark.quality.report.summarize`).
      markdown: Markdown tables instead of aligned text.

    Returns:
      The block of text.
    """
    heading = f"**{title(group)}**" if markdown else title(group)
    held = group[0].get("validation_examples")
    held = (f"{held:,} " if held else "") + "held-out training examples"
    block = [heading]
    if all(recommended(entry) is not None for entry in group):
        block += [
            "",
            "At the recommended calibration: every method's members at a "
            f"temperature each, fitted on {held} (never the test set), then "
            "pooled (docs/training.md):",
            "",
            render_table(*_recommended_table(group), markdown=markdown, left=0),
        ]
    block += [
        "",
        "Recalibrated: every method's pooled predictive at one temperature T, "
        f"fitted on {held} (never the test set):",
        "",
        render_table(*_recalibrated_table(group), markdown=markdown, left=0),
    ]
    if any(_at_bound(entry) for entry in group):
        block += [
            "",
            "* In some seed the temperature's fit ended at a bound: the held-out "
            "examples did not identify it (at the lower bound: no error among "
            "them), and that row's recalibrated figures are not to be trusted.",
        ]
    gap = gap_lines(group)
    if gap:
        block += ["", gap]
    block += [
        "",
        "As trained:",
        "",
        render_table(*_as_trained_table(group), markdown=markdown, left=0),
        "",
        "Recalibrated NLL / ECE by shift severity (test = in distribution):",
        "",
        render_table(
            *severity_table(group, "recalibrated", ("nll", "ece"), _name),
            markdown=markdown,
            left=0,
        ),
        "",
        "As trained, NLL / ECE by shift severity:",
        "",
        render_table(
            *severity_table(group, None, ("nll", "ece"), _name),
            markdown=markdown,
            left=0,
        ),
    ]
    block += calibration_tables(group, second="ece", markdown=markdown)
    block += toolbox_tables(group, markdown=markdown)
    return "\n".join(block)
