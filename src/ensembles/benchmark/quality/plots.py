"""The figure of ``ensembles-bench --quality --plot``.

One row of panels per task, model and E, drawn by the task's kind
(:mod:`~ensembles.benchmark.quality.kinds`). A classification task: accuracy,
then NLL and ECE recalibrated and as trained, against shift severity. A
regression task: NLL, CRPS and 90% coverage (recalibrated, and the
split-conformal intervals' as trained) against severity, the PIT
reliability diagram in distribution, and, for a task of one input, a second
row with every method's predictive: its mean and 90% band over the whole
input range, the training points, and where the shifted and OOD inputs lie
(:mod:`~ensembles.benchmark.quality.regression.plots`).
Position 0 of a severity axis is the in-distribution test set; error bars
are standard deviations over seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ensembles.benchmark.quality.kinds import kind_of_entry
from ensembles.benchmark.quality.report import summary_of
from ensembles.benchmark.quality.tables import groups_of, title

__all__ = ["write_quality_plot"]


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
    kinds = [kind_of_entry(group[0]) for group in groups]
    heights = [
        kind.plot_height(group) for kind, group in zip(kinds, groups, strict=True)
    ]
    width = max(5, max(len(group) for group in groups))
    figure = Figure(figsize=(4 * width, 3.9 * sum(heights)), layout="constrained")
    rows = figure.subfigures(len(groups), 1, squeeze=False, height_ratios=heights)[:, 0]
    for row, kind, group in zip(rows, kinds, groups, strict=True):
        row.suptitle(title(group), fontsize=10)
        kind.plot_row(row, group, width)
    figure.savefig(path, dpi=110)
