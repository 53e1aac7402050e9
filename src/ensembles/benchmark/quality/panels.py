"""The panel every task's figure has: a figure of each method against shift severity.

:func:`severity_panel` draws one metric of every method of a task, model
and E, at the test set (position 0) and at each severity of shift, with the
standard deviations over seeds as error bars; each kind's row of the figure
(:mod:`~ensembles.benchmark.quality.plots`) is made of such panels and its
own.
"""

from __future__ import annotations

from typing import Any

from ensembles.benchmark.quality.tables import mean_and_std, method_label

__all__ = ["severity_panel"]


def severity_panel(
    ax: Any, group: list[dict[str, Any]], part: str | None, metric: str, label: str
) -> None:
    """One metric of every method of ``group`` against shift severity.

    Args:
      ax: the matplotlib axes to draw on.
      group: the summary entries of one task, model and E.
      part: ``"recalibrated"``, or ``None`` for the figures as trained.
      metric: the figure drawn (``"coverage90"`` adds the split-conformal
        intervals' coverage, dashed, and the 90% line).
      label: the panel's title.
    """
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
