"""Tables and plot of ``ensembles-bench --quality``.

Every cell is a mean over seeds, followed by the standard deviation over seeds
when there are several. The first table of a task, model and E is the fair
comparison: every method after its own temperature, fitted on held-out
training data; the second gives the figures as trained.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from ensembles.benchmark.report import render_table

__all__ = [
    "MIN_GAP",
    "MIN_GAP_STANDARD_ERRORS",
    "format_quality",
    "summarize",
    "write_quality_plot",
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

#: How a task is named in titles.
_TASK_NAMES = {
    "mnist1d": "MNIST-1D",
    "digits": "digits (8x8)",
    "tabular": "tabular",
    "mnist1d_harsh": "MNIST-1D (harsh shifts)",
}


def _mean_std(values: list[float | None]) -> dict[str, float | None]:
    if any(value is None for value in values):
        return {"mean": None, "std": None}
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


_IDENTITY = ("task", "method", "model", "members", "seed", "steps")
_COUNTS = ("params", "train_examples", "validation_examples")


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Means and standard deviations over seeds, per task, model, E and method.

    >>> from ensembles.benchmark.quality_report import summarize
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
      rows: from :func:`~ensembles.benchmark.quality.run_quality`.

    Returns:
      One dict per (task, model, E, method), in first-seen order, with
      ``seeds`` (how many), ``params`` and, for ``train_s``, the temperature
      and every measurement (as trained and ``recalibrated``), ``{"mean": m,
      "std": s}`` (sample standard deviation; 0 for one seed). A
      ``gap_closed`` entry on ``batchensemble``, ``rank1`` and ``finetuned``
      rows with a single model and a deep ensemble beside them gives the
      fraction of the NLL gap from one model to the deep ensemble that it
      closes, in distribution and under shift (mean over severities),
      recalibrated (``gap_closed``) and as trained
      (``gap_closed_as_trained``); ``None`` where the deep ensemble is no
      better than one model by more than noise (at least :data:`MIN_GAP` of
      its NLL and more than :data:`MIN_GAP_STANDARD_ERRORS` standard errors).
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
            **{key: group[0][key] for key in _COUNTS if key in group[0]},
            **{key: _aggregate([row[key] for row in group]) for key in measured},
        }
        summary.append(entry)
    by_key = {(e["task"], e["model"], e["members"], e["method"]): e for e in summary}
    for entry in summary:
        if entry["method"] not in ("batchensemble", "rank1", "finetuned"):
            continue
        where = (entry["task"], entry["model"], entry["members"])
        single = by_key.get((*where, "single"))
        deep = by_key.get((*where, "deep_ensemble"))
        if single is None or deep is None:
            continue
        for name, pick in (
            ("gap_closed", lambda e: e.get("recalibrated")),
            ("gap_closed_as_trained", lambda e: e),
        ):
            if any(pick(e) is None for e in (single, entry, deep)):
                continue
            entry[name] = {
                part: _gap_closed(
                    pick(single)[part],
                    pick(entry)[part],
                    pick(deep)[part],
                    seeds=(single["seeds"], deep["seeds"]),
                )
                for part in ("in_distribution", "shift_mean")
                if "nll" in pick(entry).get(part, {})
            }
    return summary


def _gap_closed(
    single: dict, ensemble: dict, deep: dict, seeds: tuple[int, int]
) -> float | None:
    gap = single["nll"]["mean"] - deep["nll"]["mean"]
    standard_error = math.sqrt(
        single["nll"]["std"] ** 2 / seeds[0] + deep["nll"]["std"] ** 2 / seeds[1]
    )
    if gap <= max(
        MIN_GAP * abs(single["nll"]["mean"]),
        MIN_GAP_STANDARD_ERRORS * standard_error,
    ):
        return None  # no gap to close that the seeds can tell from noise
    return (single["nll"]["mean"] - ensemble["nll"]["mean"]) / gap


def _cell(stats: dict[str, float | None] | None, seeds: int) -> str:
    if stats is None or stats["mean"] is None:
        return "n/a"
    text = f"{stats['mean']:.3f}"
    return f"{text} ± {stats['std']:.3f}" if seeds > 1 else text


def _groups(summary: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for entry in summary:
        key = (entry.get("task", "mnist1d"), entry["model"], entry["members"])
        groups.setdefault(key, []).append(entry)
    return groups


def _best_row(group, columns) -> list[str]:
    """The best method of each column: ``columns`` are ``(stats_of, higher)``."""
    cells = []
    for stats_of, higher in columns:
        scored = [
            (stats["mean"], entry["method"])
            for entry in group
            if (stats := stats_of(entry)) is not None and stats["mean"] is not None
        ]
        if len(scored) < 2:
            cells.append("")
            continue
        best = (max if higher else min)(value for value, _ in scored)
        winners = [method for value, method in scored if value == best]
        cells.append("(tie)" if len(winners) == len(scored) else ", ".join(winners))
    return cells


def _recalibrated_table(group) -> tuple[list[str], list[list[str]]]:
    header = ["method", "params", "train s", "T", *(c[0] for c in _RECALIBRATED)]
    columns = [
        (
            lambda e, where=where, metric=metric: e["recalibrated"][where].get(metric),
            high,
        )
        for _, where, metric, high in _RECALIBRATED
    ]
    rows = [
        [
            entry["method"],
            f"{entry['params']:,}",
            f"{entry['train_s']['mean']:.1f}",
            _cell(entry["temperature"], entry["seeds"]) + _at_bound(entry),
            *(_cell(stats_of(entry), entry["seeds"]) for stats_of, _ in columns),
        ]
        for entry in group
    ]
    return header, [*rows, ["best", "", "", "", *_best_row(group, columns)]]


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
            entry["method"],
            *(_cell(stats_of(entry), entry["seeds"]) for stats_of, _ in columns),
        ]
        for entry in group
    ]
    return header, [*rows, ["best", *_best_row(group, columns)]]


def _severity_table(group, part: str | None) -> tuple[list[str], list[list[str]]]:
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
                entry["method"],
                *(f"{_mean(lv, 'nll')} / {_mean(lv, 'ece')}" for lv in levels),
            ]
        )
    return header, rows


def _mean(level: dict[str, Any], metric: str) -> str:
    stats = level.get(metric)
    return "n/a" if stats is None or stats["mean"] is None else f"{stats['mean']:.3f}"


def _title(group: list[dict[str, Any]]) -> str:
    first = group[0]
    task = first.get("task", "mnist1d")
    seeds = first["seeds"]
    return (
        f"{first['model']} on {_TASK_NAMES.get(task, task)}, E={first['members']}, "
        f"{'mean ± std over ' + str(seeds) + ' seeds' if seeds > 1 else '1 seed'}"
    )


def _gap_lines(group: list[dict[str, Any]]) -> str:
    lines = []
    for entry in group:
        for key, label in (
            ("gap_closed", "recalibrated"),
            ("gap_closed_as_trained", "as trained"),
        ):
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
                f"{entry['method']} closes this much of the {label} NLL gap from "
                "single to deep_ensemble: " + ", ".join(parts) + "."
            )
    return "\n".join(lines)


def _summary_of(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``results`` as a summary: rows of ``run_quality`` are summarised."""
    results = list(results)
    if results and "seeds" not in results[0]:
        return summarize(results)
    return results


def format_quality(results: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """The quality tables: recalibrated, as trained, then NLL / ECE per severity.

    Takes the rows of :func:`~ensembles.benchmark.quality.run_quality` (it
    summarises them) or their :func:`summarize`.
    The last row of each table names the best method of each column.

    >>> from ensembles.benchmark.quality_report import format_quality
    >>> def row(method, nll):
    ...     metrics = {"accuracy": 0.9, "nll": nll, "ece": 0.02, "brier": 0.1,
    ...                "aurc": 0.05}
    ...     measured = {"in_distribution": metrics,
    ...                 "shift": [{"severity": s, **metrics} for s in (1, 2)],
    ...                 "shift_mean": metrics}
    ...     return {"method": method, "model": "cnn", "members": 4, "seed": 0,
    ...             "params": 10, "train_s": 1.0, **measured,
    ...             "ood": {"noise": {"auroc_entropy": 0.7,
    ...                               "auroc_mi": None if method == "single"
    ...                               else 0.8, "fpr95_entropy": 0.5,
    ...                               "fpr95_mi": None if method == "single"
    ...                               else 0.4}},
    ...             "temperature": 1.0, "recalibrated": measured}
    >>> rows = [row("single", 0.3), row("batchensemble", 0.2),
    ...         row("deep_ensemble", 0.1)]
    >>> print(format_quality(rows, markdown=True))
    **cnn on MNIST-1D, E=4, 1 seed**
    <BLANKLINE>
    Recalibrated: every method at its own temperature T, fitted on held-out ...
    <BLANKLINE>
    | method | params | train s | T | acc | NLL | ECE | Brier | shift acc | ...
    |:---|---:|---:|...
    | single | 10 | 1.0 | 1.000 | 0.900 | 0.300 | 0.020 | ...
    | batchensemble | 10 | 1.0 | 1.000 | 0.900 | 0.200 | ...
    | deep_ensemble | ...
    | best | | | | (tie) | deep_ensemble | (tie) | ...
    <BLANKLINE>
    batchensemble closes ... recalibrated NLL gap ...: in distribution 50%, ...
    batchensemble closes this much of the as trained NLL gap ...
    <BLANKLINE>
    As trained:
    ...

    Args:
      results: rows from :func:`~ensembles.benchmark.quality.run_quality`, or
        their summary.
      markdown: Markdown tables instead of aligned text.

    Returns:
      The tables, one set per task, model and E.
    """
    blocks = []
    for group in _groups(_summary_of(results)).values():
        title = f"**{_title(group)}**" if markdown else _title(group)
        held = group[0].get("validation_examples")
        block = [
            title,
            "",
            "Recalibrated: every method at its own temperature T, fitted on "
            + (f"{held:,} " if held else "")
            + "held-out training examples (never the test set):",
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
        gap = _gap_lines(group)
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
                *_severity_table(group, "recalibrated"), markdown=markdown, left=0
            ),
            "",
            "As trained, NLL / ECE by shift severity:",
            "",
            render_table(*_severity_table(group, None), markdown=markdown, left=0),
        ]
        blocks.append("\n".join(block))
    return "\n\n".join(blocks)


def write_quality_plot(results: Sequence[dict[str, Any]], path: str) -> None:
    """Plots accuracy, NLL and ECE against shift severity, per method.

    One row of five panels per task, model and E: accuracy, then NLL and ECE
    recalibrated (each method at its own temperature) and as trained;
    position 0 is the in-distribution test set, then the data's severities in
    order; error bars are standard deviations over seeds.

    Args:
      results: rows from :func:`~ensembles.benchmark.quality.run_quality`, or
        their summary.
      path: the PNG to write.
    """
    from matplotlib.figure import Figure

    groups = _groups(_summary_of(results))
    figure = Figure(figsize=(20, 3.9 * len(groups)), layout="constrained")
    axes = figure.subplots(len(groups), 5, squeeze=False)
    panels = (
        (None, "accuracy", "accuracy"),
        ("recalibrated", "nll", "NLL, recalibrated"),
        ("recalibrated", "ece", "ECE, recalibrated"),
        (None, "nll", "NLL, as trained"),
        (None, "ece", "ECE, as trained"),
    )
    for row_axes, group in zip(axes, groups.values(), strict=True):
        severities = [level["severity"] for level in group[0]["shift"]]
        positions = list(range(len(severities) + 1))
        for ax, (part, metric, label) in zip(row_axes, panels, strict=True):
            for entry in group:
                measured = entry if part is None else entry[part]
                stats = [measured["in_distribution"][metric]] + [
                    level[metric] for level in measured["shift"]
                ]
                ax.errorbar(
                    positions,
                    [s["mean"] for s in stats],
                    yerr=[s["std"] for s in stats],
                    marker="o",
                    capsize=3,
                    label=entry["method"],
                )
            ax.set_xticks(positions)
            ax.set_xticklabels(["test", *map(str, severities)])
            ax.set_xlabel("shift severity")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.set_title(f"{label}\n{_title(group)}", fontsize=9)
        row_axes[1].legend(fontsize=8)
    figure.savefig(path, dpi=110)
