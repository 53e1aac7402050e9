"""Cells, rows and titles the quality tables and plots share (both kinds of task).

Every cell is a mean over seeds, followed by the standard deviation over
seeds when there are several; ``n/a`` where a figure does not exist (one
member's mutual information, say); ``nan`` where a method diverged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ensembles.benchmark.quality.calibration import NOISE_STRENGTHS, RECOMMENDED
from ensembles.benchmark.report import render_table

__all__ = [
    "GAP",
    "best_row",
    "calibration_tables",
    "cell",
    "gap_lines",
    "groups_of",
    "mean_and_std",
    "mean_cell",
    "method_label",
    "recommended",
    "severity_table",
    "title",
]

#: The gap the report measures every other method against: from one model
#: (the first) to the deep ensemble (the second), by their names in the
#: method table (:data:`~ensembles.benchmark.quality.methods.METHOD_TABLE`).
#:
#: >>> from ensembles.benchmark.quality.methods import QUALITY_METHODS
#: >>> set(GAP) <= set(QUALITY_METHODS)
#: True
GAP: tuple[str, str] = ("single", "deep_ensemble")

#: How a task is named in titles.
TASK_NAMES = {
    "mnist1d": "MNIST-1D",
    "digits": "digits (8x8)",
    "tabular": "tabular",
    "mnist1d_harsh": "MNIST-1D (harsh shifts)",
    "cubic": "cubic (y = x^3 + noise)",
    "hetero_sine_gap": "heteroscedastic sine with a gap",
    "friedman1_hetero": "Friedman #1, heteroscedastic",
    "concrete": "UCI Concrete",
}


def cell(stats: dict[str, float | None] | None, seeds: int) -> str:
    """``mean ± std`` of a summary's ``{"mean", "std"}`` (``n/a`` if none)."""
    if stats is None or stats["mean"] is None:
        return "n/a"
    text = f"{stats['mean']:.3f}"
    return f"{text} ± {stats['std']:.3f}" if seeds > 1 else text


def mean_cell(stats: dict[str, float | None] | None) -> str:
    """The mean of a summary's ``{"mean", "std"}`` alone (``n/a`` if none)."""
    if stats is None or stats.get("mean") is None:
        return "n/a"
    return f"{stats['mean']:.3f}"


def mean_and_std(stats: Any) -> tuple[float, float]:
    """A summary's ``{"mean", "std"}`` as a pair; a row's number, with 0."""
    if isinstance(stats, dict):
        return stats["mean"], stats["std"]
    return stats, 0.0


def groups_of(summary: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """A summary's entries by (task, model, E), one table each, in order."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for entry in summary:
        key = (entry.get("task", "mnist1d"), entry["model"], entry["members"])
        groups.setdefault(key, []).append(entry)
    return groups


def best_row(group, columns) -> list[str]:
    """The best method of each column: ``columns`` are ``(stats_of, higher)``."""
    cells = []
    for stats_of, higher in columns:
        scored = [
            (stats["mean"], entry["method"])
            for entry in group
            if (stats := stats_of(entry)) is not None
            and stats["mean"] is not None
            and not math.isnan(stats["mean"])  # a diverged method is no best
        ]
        if len(scored) < 2:
            cells.append("")
            continue
        best = (max if higher else min)(value for value, _ in scored)
        winners = [method for value, method in scored if value == best]
        cells.append("(tie)" if len(winners) == len(scored) else ", ".join(winners))
    return cells


def severity_table(
    group: list[dict[str, Any]],
    part: str | None,
    metrics: tuple[str, ...],
    name: Callable[[dict[str, Any]], str],
) -> tuple[list[str], list[list[str]]]:
    """Each method's ``metrics`` (means, ``" / "``-joined) by shift severity.

    Args:
      group: the summary entries of one task, model and E.
      part: ``"recalibrated"``, or ``None`` for the figures as trained.
      metrics: the figures of every cell.
      name: a row's first cell, from its entry.

    Returns:
      ``(header, rows)``: a column for the test set, then one per severity.
    """

    def of(entry):
        return entry if part is None else entry[part]

    header = [
        "method",
        "test",
        *(f"shift {lv['severity']}" for lv in of(group[0])["shift"]),
    ]
    rows = []
    for entry in group:
        levels = [of(entry)["in_distribution"], *of(entry)["shift"]]
        rows.append(
            [
                name(entry),
                *(" / ".join(mean_cell(lv.get(m)) for m in metrics) for lv in levels),
            ]
        )
    return header, rows


def title(group: list[dict[str, Any]]) -> str:
    """A group's title: model, task, E and seeds."""
    first = group[0]
    task = first.get("task", "mnist1d")
    seeds = first["seeds"]
    return (
        f"{first['model']} on {TASK_NAMES.get(task, task)}, E={first['members']}, "
        f"{'mean ± std over ' + str(seeds) + ' seeds' if seeds > 1 else '1 seed'}"
    )


def gap_lines(group: list[dict[str, Any]], metric: str = "nll") -> str:
    """One line per method: the share of the ``metric`` gap it closes."""
    suffix = "" if metric == "nll" else f"_{metric}"
    labelled = (
        (f"gap_closed{suffix}_recommended", "recommended-calibration"),
        (f"gap_closed{suffix}", "recalibrated"),
        (f"gap_closed{suffix}_as_trained", "as trained"),
    )
    gaps = [entry[key] for entry in group for key, _ in labelled if entry.get(key)]
    seeds = {entry["method"]: entry.get("seeds", 0) for entry in group}
    ends = [seeds.get(name) for name in GAP]
    if not gaps and None not in ends and min(ends) < 2:
        return (
            f"No {metric.upper()} gap closed is given: it needs at least two seeds "
            f"of {' and '.join(GAP)}, whose spread tells a gap from noise "
            "(--seeds 2 or more)."
        )
    if gaps and all(value is None for gap in gaps for value in gap.values()):
        return (
            f"No {metric.upper()} gap to close: the deep ensemble is not better "
            "than one model beyond noise (by a fiftieth of one model's and two "
            "standard errors), in distribution or under shift, as trained or "
            "calibrated."
        )
    lines = []
    for entry in group:
        for key, label in labelled:
            gap = entry.get(key)
            if not gap:
                continue
            parts = [
                f"{where_label} {gap[where]:.0%}"
                if gap.get(where) is not None
                else f"{where_label}: deep ensemble not better than one model "
                "beyond noise"
                for where, where_label in (
                    ("in_distribution", "in distribution"),
                    ("shift_mean", "under shift"),
                )
                if where in gap
            ]
            lines.append(
                f"{entry['method']} closes this much of the {label} "
                f"{metric.upper()} gap from {GAP[0]} to {GAP[1]}: "
                + ", ".join(parts)
                + "."
            )
    return "\n".join(lines)


def recommended(entry: dict[str, Any]) -> dict[str, Any] | None:
    """An entry's figures at the recommended calibration (``None``: not measured).

    :data:`~ensembles.benchmark.quality.calibration.RECOMMENDED`'s entry of
    its ``calibrations``; results of an older run have none.
    """
    return (entry.get("calibrations") or {}).get(RECOMMENDED)


def method_label(entry: dict[str, Any]) -> str:
    """The method's name, marked where its training diverged in some seed."""
    diverged = entry.get("diverged")
    if diverged is not None and diverged["mean"]:
        return f"{entry['method']} (diverged)"
    return entry["method"]


#: The columns of :func:`calibration_tables`: where each calibration's
#: figures are in a summary entry, and its name in the header.
_CALIBRATION_COLUMNS: tuple[tuple[str, str], ...] = (
    ("as trained", ""),
    ("pooled", "recalibrated"),
    ("pooled, noisy", "pooled_noisy"),
    ("members", "members"),
    ("members, noisy", "members_noisy"),
    ("members, noisy, then pooled", "members_noisy_pooled"),
    ("ETS", "ets"),
    ("adaptive", "adaptive"),
    ("spread apart", "spread"),
)


def _calibrated(entry: dict[str, Any], where: str) -> dict[str, Any] | None:
    if not where:
        return entry
    if where == "recalibrated":
        return entry.get("recalibrated")
    return (entry.get("calibrations") or {}).get(where)


def calibration_tables(
    group: list[dict[str, Any]], *, second: str, markdown: bool
) -> list[str]:
    """Each method at every calibration, and its members' diversity: text lines.

    The first table gives the NLL in distribution and under shift (the mean
    over severities), the second ``second`` (``"ece"``, or a regressor's
    ``"coverage90"``) likewise, for every method as trained and at each
    calibration of :mod:`~ensembles.benchmark.quality.calibration`; the last
    the members' diversity as trained. Nothing where the entries have no
    ``calibrations`` (results of an older run).
    """
    if not any("calibrations" in entry for entry in group):
        return []
    columns = _calibration_columns(group)
    header = ["method", *(name for name, _ in columns)]
    return [
        "",
        _calibration_caption(second),
        "",
        render_table(
            header,
            _calibration_rows(group, columns, "nll"),
            markdown=markdown,
            left=0,
        ),
        "",
        f"{'ECE' if second == 'ece' else '90% coverage'} in distribution / under "
        f"shift, the same calibrations:",
        "",
        render_table(
            header,
            _calibration_rows(group, columns, second),
            markdown=markdown,
            left=0,
        ),
        *_diversity_table(group, markdown=markdown),
    ]


def _calibration_columns(group: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The calibrations some entry has: a kind's own (ETS, spread) among them."""
    return [
        (name, where)
        for name, where in _CALIBRATION_COLUMNS
        if any(_calibrated(entry, where) is not None for entry in group)
    ]


def _calibration_rows(
    group: list[dict[str, Any]], columns: list[tuple[str, str]], metric: str
) -> list[list[str]]:
    """One row a method: its ``metric`` in distribution / under shift a column."""
    table = []
    for entry in group:
        cells = [entry["method"]]
        for _, where in columns:
            figures = _calibrated(entry, where)
            if figures is None:
                cells.append("n/a")
                continue
            values = [
                mean_cell(figures[part].get(metric))
                for part in ("in_distribution", "shift_mean")
            ]
            cells.append(" / ".join(values))
        table.append(cells)
    return table


def _calibration_caption(second: str) -> str:
    """The NLL table's caption: what each calibration fits, on which examples."""
    fitted = "temperature" if second == "ece" else "std scale"
    strengths = ", ".join(f"{s:g}" for s in NOISE_STRENGTHS)
    return (
        "NLL in distribution / under shift, as trained and at each calibration "
        f"(pooled: one {fitted} of the pooled predictive; members: one per "
        "member, then pooled; noisy: fitted on the held-out examples and copies "
        f"with Gaussian noise of {strengths} training-input standard deviations"
        + (
            "; ETS: ensemble temperature scaling; adaptive: the clean and the "
            "noisy temperature blended per example by its predictive's entropy"
            if second == "ece"
            else "; spread apart: the members' stds scaled on the clean "
            "examples, their disagreement on the noisy copies"
        )
        + "):"
    )


#: How the diversity table names the figures of an entry's ``diversity``.
_DIVERSITY_NAMES = {
    "pairwise_disagreement": "pairwise disagreement",
    "pairwise_kl": "pairwise KL",
    "epistemic_share": "epistemic share of the variance",
}


def _diversity_table(group: list[dict[str, Any]], *, markdown: bool) -> list[str]:
    """The members' diversity as trained: text lines (none without figures)."""
    diverse = [entry for entry in group if "diversity" in entry]
    if not diverse:
        return []
    keys = list(diverse[0]["diversity"]["in_distribution"])
    rows = [
        [
            entry["method"],
            *(
                " / ".join(
                    mean_cell(entry["diversity"][part].get(key))
                    for part in ("in_distribution", "shift_mean")
                )
                for key in keys
            ),
        ]
        for entry in diverse
    ]
    return [
        "",
        "The members' diversity as trained, in distribution / under shift:",
        "",
        render_table(
            ["method", *(_DIVERSITY_NAMES.get(key, key) for key in keys)],
            rows,
            markdown=markdown,
            left=0,
        ),
    ]
