"""The tables of a classifier's toolbox measurements (calibrators, sets, scores).

What :mod:`~ensembles.benchmark.quality.classification.toolbox` measured,
one table each: the calibrators beside one temperature (NLL, then ECE), the
conformal sets at 90% (mean size / coverage), out-of-distribution detection
by every score (AUROC, then FPR at 95% TPR), and selective prediction by
every score (AURC). Results of an older run, without these measurements,
get none of them.
"""

from __future__ import annotations

from typing import Any

from ensembles.benchmark.quality.classification.toolbox import SET_LEVEL
from ensembles.benchmark.quality.tables import best_row, cell, mean_cell
from ensembles.benchmark.report import render_table

__all__ = ["toolbox_tables"]

# (header, where the figures are): "" as trained, "recalibrated" one pooled
# temperature, "calibrations/<name>" and "calibrators/<name>" the others.
_CALIBRATOR_COLUMNS: tuple[tuple[str, str], ...] = (
    ("as trained", ""),
    ("T", "recalibrated"),
    ("vector", "calibrators/vector"),
    ("Dirichlet", "calibrators/dirichlet"),
    ("isotonic", "calibrators/isotonic"),
    ("members: T", "calibrations/members"),
    ("members: vector", "calibrators/vector_members"),
    ("members: Dirichlet", "calibrators/dirichlet_members"),
    ("members: isotonic", "calibrators/isotonic_members"),
)
_SET_COLUMNS: tuple[tuple[str, str], ...] = (
    ("LAC", "lac"),
    ("APS", "aps"),
    ("RAPS", "raps"),
    ("APS randomised", "aps_randomised"),
    ("members: LAC", "lac_members"),
)
_OOD_COLUMNS: tuple[tuple[str, str], ...] = (
    ("H", "entropy"),
    ("MI", "mi"),
    ("MSP", "max_probability"),
    ("margin", "margin"),
    ("max logit", "max_logit"),
    ("energy", "energy"),
)
_SELECTIVE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("confidence", "confidence"),
    ("margin", "margin"),
    ("max logit", "max_logit"),
    ("energy", "energy"),
    ("entropy", "entropy"),
    ("MI", "mutual_information"),
)


def _figures(entry: dict[str, Any], where: str) -> dict[str, Any] | None:
    if not where:
        return entry
    if "/" not in where:
        return entry.get(where)
    part, name = where.split("/")
    return (entry.get(part) or {}).get(name)


def _in_and_shift(figures: dict[str, Any] | None, metric: str) -> str:
    if figures is None:
        return "n/a"
    return " / ".join(
        mean_cell(figures[part].get(metric))
        for part in ("in_distribution", "shift_mean")
    )


def _calibrator_tables(group, markdown: bool) -> list[str]:
    header = ["method", *(name for name, _ in _CALIBRATOR_COLUMNS)]

    def rows(metric):
        return [
            [
                entry["method"],
                *(
                    _in_and_shift(_figures(entry, where), metric)
                    for _, where in _CALIBRATOR_COLUMNS
                ),
            ]
            for entry in group
        ]

    lines = []
    for metric, label in (("nll", "NLL"), ("ece", "ECE")):
        lines += [
            "",
            f"{label} in distribution / under shift, one temperature beside the "
            "calibrators that go beyond it, each fitted on the held-out examples "
            "(pooled, then members: calibrated one by one, then pooled):",
            "",
            render_table(header, rows(metric), markdown=markdown, left=0),
        ]
    return lines


def _set_tables(group, markdown: bool) -> list[str]:
    header = ["method", *(name for name, _ in _SET_COLUMNS)]
    lines = []
    for part, label in (
        ("in_distribution", "in distribution"),
        ("shift_mean", "under shift"),
    ):
        rows = [
            [
                entry["method"],
                *(
                    " / ".join(
                        mean_cell(entry["sets"][part].get(f"{kind}_{name}"))
                        for kind in ("size", "coverage")
                    )
                    for _, name in _SET_COLUMNS
                ),
            ]
            for entry in group
        ]
        lines += [
            "",
            f"Conformal sets at {SET_LEVEL:.0%}, fitted on the held-out examples "
            f"(as trained), {label}: mean size / coverage:",
            "",
            render_table(header, rows, markdown=markdown, left=0),
        ]
    return lines


def _ood_figure(entry, name: str, key: str):
    """An OOD figure: entropy's and MI's in ``ood``, the others' in ``ood_scores``."""
    where = "ood" if key.endswith(("_entropy", "_mi")) else "ood_scores"
    return entry[where][name].get(key)


def _ood_tables(group, markdown: bool) -> list[str]:
    ood_sets = list(group[0].get("ood", {}))
    if not ood_sets or not all("ood_scores" in entry for entry in group):
        return []
    lines = []
    for prefix, label, higher in (
        ("auroc", "AUROC", True),
        ("fpr95", "FPR at 95% TPR", False),
    ):
        header, columns = ["method"], []
        for name in ood_sets:
            header += [f"{name} {short}" for short, _ in _OOD_COLUMNS]
            columns += [
                (
                    lambda e, name=name, key=f"{prefix}_{key}": _ood_figure(
                        e, name, key
                    ),
                    higher,
                )
                for _, key in _OOD_COLUMNS
            ]
        rows = [
            [
                entry["method"],
                *(cell(stats_of(entry), entry["seeds"]) for stats_of, _ in columns),
            ]
            for entry in group
        ]
        lines += [
            "",
            f"Out-of-distribution detection by score, {label} (as trained; H: "
            "total entropy, MI: mutual information, MSP: max probability):",
            "",
            render_table(
                header,
                [*rows, ["best", *best_row(group, columns)]],
                markdown=markdown,
                left=0,
            ),
        ]
    return lines


def _selective_table(group, markdown: bool) -> list[str]:
    header = ["method", *(name for name, _ in _SELECTIVE_COLUMNS)]
    rows = [
        [
            entry["method"],
            *(
                " / ".join(
                    mean_cell(entry["selective"][part].get(key))
                    for part in ("in_distribution", "shift_mean")
                )
                for _, key in _SELECTIVE_COLUMNS
            ),
        ]
        for entry in group
    ]
    return [
        "",
        "Selective prediction by score, AURC in distribution / under shift (as "
        "trained; the least uncertain answered first; confidence: the "
        "predictive's largest probability):",
        "",
        render_table(header, rows, markdown=markdown, left=0),
    ]


def toolbox_tables(group: list[dict[str, Any]], *, markdown: bool) -> list[str]:
    """The toolbox's tables of one task, model and E: text lines.

    Args:
      group: the summary entries of one task, model and E.
      markdown: Markdown tables instead of aligned text.

    Returns:
      The lines, each table after a blank line and its caption; none for the
      measurements an entry does not have.
    """
    lines = []
    if all("calibrators" in entry for entry in group):
        lines += _calibrator_tables(group, markdown)
    if all("sets" in entry for entry in group):
        lines += _set_tables(group, markdown)
    lines += _ood_tables(group, markdown)
    if all("selective" in entry for entry in group):
        lines += _selective_table(group, markdown)
    return lines
