"""The figure of ``ensembles-bench --quality --plot``.

One row of panels per task, model and E. A classification task: accuracy,
then NLL and ECE recalibrated and as trained, against shift severity. A
regression task: NLL, CRPS and 90% coverage (recalibrated, and the
split-conformal intervals' as trained) against severity, the PIT
reliability diagram in distribution, and, for a task of one input, a second
row with every method's predictive: its mean and 90% band over the whole
input range, the training points, and where the shifted and OOD inputs lie
(those two: :mod:`~ensembles.benchmark.quality.regression.plots`).
Position 0 of a severity axis is the in-distribution test set; error bars
are standard deviations over seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ensembles.benchmark.quality.regression.plots import band_panels, reliability_panel
from ensembles.benchmark.quality.report import summary_of
from ensembles.benchmark.quality.tables import (
    groups_of,
    mean_and_std,
    method_label,
    title,
)

__all__ = ["write_quality_plot"]

_CLASSIFICATION_PANELS = (
    (None, "accuracy", "accuracy"),
    ("recalibrated", "nll", "NLL, recalibrated"),
    ("recalibrated", "ece", "ECE, recalibrated"),
    (None, "nll", "NLL, as trained"),
    (None, "ece", "ECE, as trained"),
)
_REGRESSION_PANELS = (
    ("recalibrated", "nll", "NLL, recalibrated"),
    ("recalibrated", "crps", "CRPS, recalibrated"),
    ("recalibrated", "coverage90", "90% coverage, recalibrated"),
    (None, "nll", "NLL, as trained"),
)


def _severity_panel(ax, group, part, metric, label) -> None:
    severities = [level["severity"] for level in group[0]["shift"]]
    positions = list(range(len(severities) + 1))
    for entry in group:
        measured = entry if part is None else entry[part]
        stats = [measured["in_distribution"][metric]] + [
            level[metric] for level in measured["shift"]
        ]
        means, stds = zip(*(mean_and_std(s) for s in stats), strict=True)
        line = ax.errorbar(
            positions,
            means,
            yerr=stds,
            marker="o",
            capsize=3,
            label=method_label(entry),
        )
        if (
            metric == "coverage90"
            and "coverage90_conformal" in entry["in_distribution"]
        ):
            conformal = [entry["in_distribution"]["coverage90_conformal"]] + [
                level["coverage90_conformal"] for level in entry["shift"]
            ]
            ax.plot(
                positions,
                [mean_and_std(s)[0] for s in conformal],
                linestyle="--",
                color=line[0].get_color(),
            )
    if metric == "coverage90":
        ax.axhline(0.9, color="black", linewidth=0.8)
        label += "\n(dashed: split-conformal)"
    ax.set_xticks(positions)
    ax.set_xticklabels(["test", *map(str, severities)])
    ax.set_xlabel("shift severity")
    ax.set_ylabel(label.split("\n")[0])
    ax.grid(alpha=0.3)
    ax.set_title(label, fontsize=9)


def write_quality_plot(results: Sequence[dict[str, Any]], path: str) -> None:
    """Plots every task's figures against shift severity, per method.

    See the module docs for the panels.

    Args:
      results: rows from :func:`~ensembles.benchmark.quality.run.run_quality`, or
        their summary.
      path: the PNG to write.
    """
    from matplotlib.figure import Figure

    groups = list(groups_of(summary_of(results)).values())
    heights = [
        2 if group[0].get("regression") and "bands" in group[0]["recalibrated"] else 1
        for group in groups
    ]
    width = max(5, max(len(group) for group in groups))
    figure = Figure(figsize=(4 * width, 3.9 * sum(heights)), layout="constrained")
    rows = figure.subfigures(len(groups), 1, squeeze=False, height_ratios=heights)[:, 0]
    for row, group in zip(rows, groups, strict=True):
        row.suptitle(title(group), fontsize=10)
        if not group[0].get("regression"):
            axes = row.subplots(1, 5)
            for ax, panel in zip(axes, _CLASSIFICATION_PANELS, strict=True):
                _severity_panel(ax, group, *panel)
            axes[1].legend(fontsize=8)
            continue
        grid = row.subplots(
            2 if "bands" in group[0]["recalibrated"] else 1, width, squeeze=False
        )
        for ax, panel in zip(grid[0], _REGRESSION_PANELS, strict=False):
            _severity_panel(ax, group, *panel)
        reliability_panel(grid[0][len(_REGRESSION_PANELS)], group)
        for ax in grid[0][len(_REGRESSION_PANELS) + 1 :]:
            ax.set_visible(False)
        grid[0][0].legend(fontsize=8)
        if len(grid) > 1:
            band_panels(grid[1], group)
    figure.savefig(path, dpi=110)
