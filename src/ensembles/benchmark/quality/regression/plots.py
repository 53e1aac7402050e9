"""A regression task's row of the figure (``--quality --plot``).

:func:`regression_row` draws NLL, CRPS and 90% coverage (recalibrated, and
the split-conformal intervals' as trained) and the NLL as trained against
severity (:func:`~ensembles.benchmark.quality.panels.severity_panel`), the
PIT reliability diagram in distribution (:func:`reliability_panel`) and, for
a task of one input, a second row with every method's predictive: its mean
and 90% band over the whole input range and the training points
(:func:`band_panels`).
"""

from __future__ import annotations

import math
from typing import Any

from ensembles.benchmark.quality.panels import severity_panel
from ensembles.benchmark.quality.regression.scores import PIT_LEVELS
from ensembles.benchmark.quality.tables import mean_and_std, method_label

__all__ = ["band_panels", "regression_row", "reliability_panel", "rows_of_panels"]

# The severity panels: (where in a summary entry, metric, title).
_PANELS = (
    ("recalibrated", "nll", "NLL, recalibrated"),
    ("recalibrated", "crps", "CRPS, recalibrated"),
    ("recalibrated", "coverage90", "90% coverage, recalibrated"),
    (None, "nll", "NLL, as trained"),
)


def rows_of_panels(group: list[dict[str, Any]]) -> int:
    """Two rows of panels for a task of one input (its bands), else one."""
    return 2 if "bands" in group[0]["recalibrated"] else 1


def regression_row(figure: Any, group: list[dict[str, Any]], width: int) -> None:
    """A regression task's panels, ``width`` to a row (see the module)."""
    grid = figure.subplots(rows_of_panels(group), width, squeeze=False)
    for ax, panel in zip(grid[0], _PANELS, strict=False):
        severity_panel(ax, group, *panel)
    reliability_panel(grid[0][len(_PANELS)], group)
    for ax in grid[0][len(_PANELS) + 1 :]:
        ax.set_visible(False)
    grid[0][0].legend(fontsize=8)
    if len(grid) > 1:
        band_panels(grid[1], group)


def reliability_panel(ax: Any, group: list[dict[str, Any]]) -> None:
    """The PIT curve of every method, recalibrated, against the diagonal."""
    ax.plot([0, 1], [0, 1], color="black", linewidth=0.8)
    for entry in group:
        curve = entry["recalibrated"].get("pit_curve")
        if curve is None:
            continue
        values = [mean_and_std(v)[0] for v in curve]
        label = method_label(entry)
        if any(value is None or math.isnan(value) for value in values):
            label += " (NaN: not drawn)"  # a diverged prediction has no curve
            values = [math.nan] * len(values)
        ax.plot(PIT_LEVELS, values, marker=".", label=label)
    ax.set_xlabel("level p")
    ax.set_ylabel("share of test targets with PIT <= p")
    ax.grid(alpha=0.3)
    ax.set_title("PIT reliability, recalibrated", fontsize=9)


def band_panels(axes: Any, group: list[dict[str, Any]]) -> None:
    """Every method's predictive on a grid, one panel each, recalibrated."""
    for ax, entry in zip(axes, group, strict=False):
        bands = entry["recalibrated"].get("bands")
        if bands is None:
            ax.set_visible(False)
            continue
        x = [mean_and_std(v)[0] for v in bands["x"]]
        lower = [mean_and_std(v)[0] for v in bands["lower"]]
        upper = [mean_and_std(v)[0] for v in bands["upper"]]
        ax.fill_between(x, lower, upper, alpha=0.3, label="90% interval")
        ax.plot(x, [mean_and_std(v)[0] for v in bands["mean"]], label="mean")
        ax.scatter(
            [mean_and_std(v)[0] for v in bands["train_x"]],
            [mean_and_std(v)[0] for v in bands["train_y"]],
            s=4,
            color="black",
            label="training data",
        )
        ax.set_xlabel("x (standardised)")
        ax.set_title(f"{method_label(entry)}, recalibrated", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[len(group) :]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7)
