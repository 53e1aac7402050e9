"""The panels only a regression task's figure has (``--quality --plot``).

Beside the severity panels every task's figure has
(:mod:`~ensembles.benchmark.quality.plots`), a regression task's row has the
PIT reliability diagram in distribution (:func:`reliability_panel`) and, for
a task of one input, a second row with every method's predictive: its mean
and 90% band over the whole input range and the training points
(:func:`band_panels`).
"""

from __future__ import annotations

import math
from typing import Any

from ensembles.benchmark.quality.regression.scores import PIT_LEVELS
from ensembles.benchmark.quality.tables import mean_and_std, method_label

__all__ = ["band_panels", "reliability_panel"]


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
