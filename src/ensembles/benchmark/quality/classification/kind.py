"""Classification as a task kind: what the quality benchmark does for a classifier.

:data:`CLASSIFICATION` answers every question the driver, the checks, the
training, the report and the figure ask of a task's kind
(:class:`~ensembles.benchmark.quality.kinds.TaskKind`) for data with integer
labels: its models give member logits ``[E, N, C]``, train on the cross
entropy, stop early on nothing, are measured by
:func:`~ensembles.benchmark.quality.classification.scores.evaluate` and
recalibrated with one temperature each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ensembles
from ensembles.benchmark.quality.classification.report import classification_block
from ensembles.benchmark.quality.classification.scores import evaluate
from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.panels import severity_panel
from ensembles.benchmark.quality.training import Recipe, Targets, Trained

__all__ = ["CLASSIFICATION", "MIN_VALIDATION", "Classification"]

#: The fewest examples held out: a temperature is only identified by a
#: validation set with errors on it. On one without (a 98%-accurate digits
#: model has none in 120 examples one time in ten) the NLL falls as T -> 0 and
#: the fit ends at its lower bound (the benchmark flags such a fit:
#: ``temperature_at_bound``).
MIN_VALIDATION: int = 300

# The figure's severity panels: (where in a summary entry, metric, title).
_PANELS = (
    (None, "accuracy", "accuracy"),
    ("recalibrated", "nll", "NLL, recalibrated"),
    ("recalibrated", "ece", "ECE, recalibrated"),
    (None, "nll", "NLL, as trained"),
    (None, "ece", "ECE, as trained"),
)


class Classification:
    """A classifier's task: labels in, member logits out, a temperature each."""

    #: The value of a row's ``"regression"`` key.
    regression = False
    #: :func:`~ensembles.benchmark.quality.run.validation_size`'s least.
    min_validation = MIN_VALIDATION
    #: What each method fits on the held-out examples (the command says so).
    fitted = "temperatures"
    #: The outputs a model must give, as an error message names them.
    outputs_named = "logits [N, classes]"
    #: The figures whose gap from one model to the deep ensemble is reported.
    gap_metrics = ("nll",)

    def outputs(self, data: QualityData) -> int:
        """How many outputs a model of ``data`` gives: its classes C."""
        return data.num_classes

    def check_width(self, name: str, width: int, data: QualityData) -> None:
        """Raises unless a model's ``width`` outputs hold ``data``'s classes."""
        classes = data.num_classes
        if width < classes:
            raise ValueError(
                f"the model {name!r} gives {width} logits per "
                f"example, but the data has {classes} classes (labels 0 to "
                f"{classes - 1}): its output layer needs at least "
                f"{classes} features."
            )

    def model_outputs(self, y_train: np.ndarray, num_classes: int | None) -> int:
        """The outputs a named model is built with: C (the largest label + 1)."""
        return int(np.max(y_train)) + 1 if num_classes is None else num_classes

    def check_recipe(self, recipe: Recipe) -> None:
        """Every recipe option applies to a classifier."""

    def objective(self, recipe: Recipe) -> Callable[[jax.Array, jax.Array, int], Any]:
        """``loss(outputs, labels, num_members)`` of member-major logits.

        :func:`ensembles.training.cross_entropy`, less ``recipe.diversity``
        times the mean squared distance of each member's softmax from the
        members' mean.
        """
        diversity = recipe.diversity

        def loss(outputs, labels, num_members):
            value = ensembles.training.cross_entropy(
                outputs, labels, num_members=num_members
            )
            if diversity:
                probs = jax.nn.softmax(ensembles.untile(outputs, num_members), -1)
                spread = jnp.sum((probs - probs.mean(axis=0)) ** 2, axis=-1)
                value = value - diversity * jnp.mean(spread)
            return value

        return loss

    def validation_loss(
        self, predict_fn: Callable, x: np.ndarray, y: np.ndarray, recipe: Recipe
    ) -> Callable[[nnx.Module], jax.Array]:
        """:func:`ensembles.uncertainty.nll` of the member logits on ``(x, y)``."""
        x, y = jnp.asarray(x), jnp.asarray(y)
        return lambda model: ensembles.uncertainty.nll(predict_fn(model, x), y)

    def targets(
        self, train: QualityData, x_valid: np.ndarray, y_valid: np.ndarray
    ) -> Targets:
        """The labels as they are, and the data's classes for a named model."""
        return Targets(train.y_train, {"num_classes": train.num_classes}, None)

    def evaluate(
        self,
        trained: Trained,
        data: QualityData,
        x_valid: np.ndarray,
        y_valid: np.ndarray,
        targets: Targets,
    ) -> dict[str, Any]:
        """:func:`~ensembles.benchmark.quality.classification.scores.evaluate`."""
        return evaluate(trained, data, x_valid=x_valid, y_valid=y_valid)

    def block(self, group: list[dict[str, Any]], *, markdown: bool) -> str:
        """The tables of one task, model and E (:func:`classification_block`)."""
        return classification_block(group, markdown=markdown)

    def plot_height(self, group: list[dict[str, Any]]) -> int:
        """The rows of panels a task's figure takes: one."""
        return 1

    def plot_row(self, figure: Any, group: list[dict[str, Any]], width: int) -> None:
        """Accuracy, then NLL and ECE recalibrated and as trained, by severity."""
        axes = figure.subplots(1, len(_PANELS))
        for ax, panel in zip(axes, _PANELS, strict=True):
            severity_panel(ax, group, *panel)
        axes[1].legend(fontsize=8)


#: The classification kind.
CLASSIFICATION = Classification()
