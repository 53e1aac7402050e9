"""Tables and plot of ``ensembles-bench --quality`` (from :func:`summarize`).

Every cell is a mean over seeds, followed by the standard deviation over seeds
when there are several.
"""

from __future__ import annotations

from typing import Any

from ensembles.benchmark.quality_data import SEVERITIES
from ensembles.benchmark.report import render_table

__all__ = ["format_quality", "write_quality_plot"]

# (header, where in a summary entry, metric); "shift" = mean over severities.
_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("acc", "in_distribution", "accuracy"),
    ("NLL", "in_distribution", "nll"),
    ("ECE", "in_distribution", "ece"),
    ("Brier", "in_distribution", "brier"),
    ("AURC", "in_distribution", "aurc"),
    ("shift acc", "shift_mean", "accuracy"),
    ("shift NLL", "shift_mean", "nll"),
    ("shift ECE", "shift_mean", "ece"),
)


def _cell(stats: dict[str, float | None], seeds: int) -> str:
    if stats["mean"] is None:
        return "n/a"
    text = f"{stats['mean']:.3f}"
    return f"{text} ± {stats['std']:.3f}" if seeds > 1 else text


def _groups(summary: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for entry in summary:
        key = (entry.get("task", "mnist1d"), entry["model"], entry["members"])
        groups.setdefault(key, []).append(entry)
    return groups


def _main_table(group: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    ood_sets = list(group[0]["ood"])
    header = ["method", "params", "train s", *(c[0] for c in _COLUMNS)]
    for name in ood_sets:
        header += [
            f"{name} AUROC H",
            f"{name} AUROC MI",
            f"{name} FPR95 H",
            f"{name} FPR95 MI",
        ]
    rows = []
    for entry in group:
        seeds = entry["seeds"]
        cells = [
            entry["method"],
            f"{entry['params']:,}",
            f"{entry['train_s']['mean']:.1f}",
            *(_cell(entry[where][metric], seeds) for _, where, metric in _COLUMNS),
        ]
        for name in ood_sets:
            scores = entry["ood"][name]
            cells += [
                _cell(scores[key], seeds)
                for key in ("auroc_entropy", "auroc_mi", "fpr95_entropy", "fpr95_mi")
            ]
        rows.append(cells)
    return header, rows


def _severity_table(group: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = ["method", "test", *(f"shift {s}" for s in SEVERITIES)]
    rows = []
    for entry in group:
        levels = [entry["in_distribution"], *entry["shift"]]
        rows.append(
            [
                entry["method"],
                *(
                    f"{lv['nll']['mean']:.3f} / {lv['ece']['mean']:.3f}"
                    for lv in levels
                ),
            ]
        )
    return header, rows


#: How a task is named in titles.
_TASK_NAMES = {
    "mnist1d": "MNIST-1D",
    "digits": "digits (8x8)",
    "tabular": "tabular",
    "mnist1d_harsh": "MNIST-1D (harsh shifts)",
}


def _title(group: list[dict[str, Any]]) -> str:
    first = group[0]
    task = first.get("task", "mnist1d")
    seeds = first["seeds"]
    return (
        f"{first['model']} on {_TASK_NAMES.get(task, task)}, E={first['members']}, "
        f"{'mean ± std over ' + str(seeds) + ' seeds' if seeds > 1 else '1 seed'}"
    )


def _gap_line(group: list[dict[str, Any]]) -> str:
    lines = []
    for entry in group:
        gap = entry.get("gap_closed")
        if gap:
            parts = [
                f"{label} {gap[key]:.0%}"
                if gap.get(key) is not None
                else f"{label} n/a"
                for key, label in (
                    ("in_distribution", "in distribution"),
                    ("shift_mean", "under shift"),
                )
            ]
            lines.append(
                f"{entry['method']} closes this much of the NLL gap from single "
                "to deep_ensemble: " + ", ".join(parts) + "."
            )
    return "\n".join(lines)


def format_quality(summary: list[dict[str, Any]], *, markdown: bool = False) -> str:
    """The quality tables: metrics per method, then NLL / ECE per severity.

    >>> from ensembles.benchmark.quality import summarize
    >>> from ensembles.benchmark.quality_report import format_quality
    >>> def row(method, nll):
    ...     metrics = {"accuracy": 0.9, "nll": nll, "ece": 0.02, "brier": 0.1,
    ...                "aurc": 0.05}
    ...     return {"method": method, "model": "cnn", "members": 4, "params": 10,
    ...             "train_s": 1.0, "in_distribution": metrics,
    ...             "shift": [{"severity": s, **metrics} for s in range(1, 6)],
    ...             "shift_mean": metrics,
    ...             "ood": {"noise": {"auroc_entropy": 0.7,
    ...                               "auroc_mi": None if method == "single"
    ...                               else 0.8, "fpr95_entropy": 0.5,
    ...                               "fpr95_mi": None if method == "single"
    ...                               else 0.4}}}
    >>> summary = summarize([row("single", 0.3), row("batchensemble", 0.2),
    ...                      row("deep_ensemble", 0.1)])
    >>> print(format_quality(summary, markdown=True))
    **cnn on MNIST-1D, E=4, 1 seed**
    <BLANKLINE>
    | method | params | train s | acc | NLL | ECE | Brier | AURC | shift acc | ...
    |:---|---:|---:|...
    | single | 10 | 1.0 | 0.900 | 0.300 | 0.020 | ... | 0.700 | n/a | 0.500 | n/a |
    | batchensemble | 10 | 1.0 | 0.900 | 0.200 | ... | 0.700 | 0.800 | 0.500 | 0.400 |
    | deep_ensemble | ...
    <BLANKLINE>
    batchensemble closes ... NLL gap ...: in distribution 50%, under shift 50%.
    <BLANKLINE>
    NLL / ECE by shift severity (test = in distribution):
    <BLANKLINE>
    | method | test | shift 1 | shift 2 | shift 3 | shift 4 | shift 5 |
    |:---|---:|---:|---:|---:|---:|---:|
    | single | 0.300 / 0.020 | 0.300 / 0.020 | ...
    ...

    Args:
      summary: from :func:`~ensembles.benchmark.quality.summarize`.
      markdown: Markdown tables instead of aligned text.

    Returns:
      The tables, one pair per model and E.
    """
    blocks = []
    for group in _groups(summary).values():
        title = f"**{_title(group)}**" if markdown else _title(group)
        block = [
            title,
            "",
            render_table(*_main_table(group), markdown=markdown, left=0),
        ]
        gap = _gap_line(group)
        if gap:
            block += ["", gap]
        block += [
            "",
            "NLL / ECE by shift severity (test = in distribution):",
            "",
            render_table(*_severity_table(group), markdown=markdown, left=0),
        ]
        blocks.append("\n".join(block))
    return "\n\n".join(blocks)


def write_quality_plot(summary: list[dict[str, Any]], path: str) -> None:
    """Plots accuracy, NLL and ECE against shift severity, per method.

    One row of three panels per model and E; severity 0 is the
    in-distribution test set; error bars are standard deviations over seeds.

    Args:
      summary: from :func:`~ensembles.benchmark.quality.summarize`.
      path: the PNG to write.
    """
    from matplotlib.figure import Figure

    groups = _groups(summary)
    figure = Figure(figsize=(13, 3.8 * len(groups)), layout="constrained")
    axes = figure.subplots(len(groups), 3, squeeze=False)
    levels = [0, *SEVERITIES]
    for row_axes, group in zip(axes, groups.values(), strict=True):
        for ax, (metric, label) in zip(
            row_axes,
            (("accuracy", "accuracy"), ("nll", "NLL (nats)"), ("ece", "ECE")),
            strict=True,
        ):
            for entry in group:
                stats = [entry["in_distribution"][metric]] + [
                    level[metric] for level in entry["shift"]
                ]
                ax.errorbar(
                    levels,
                    [s["mean"] for s in stats],
                    yerr=[s["std"] for s in stats],
                    marker="o",
                    capsize=3,
                    label=entry["method"],
                )
            ax.set_xticks(levels)
            ax.set_xticklabels(["test", *map(str, SEVERITIES)])
            ax.set_xlabel("shift severity")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.set_title(f"{label}\n{_title(group)}", fontsize=9)
        row_axes[1].legend(fontsize=8)
    figure.savefig(path, dpi=120)
