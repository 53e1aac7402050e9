"""The quality benchmark's task kinds: classification and regression, one object each.

Everything the benchmark does differently for a classifier and a regressor
is asked of the task's kind, a :class:`TaskKind`:
:data:`~ensembles.benchmark.quality.classification.kind.CLASSIFICATION` or
:data:`~ensembles.benchmark.quality.regression.kind.REGRESSION`. The kind is
picked here once, from the data (:func:`kind_of`), from a row or summary
entry (:func:`kind_of_entry`), or from a public ``regression=`` argument
(:func:`kind_for`); training, scoring, calibration, the reports and the
command ask it and never read whether a task is a regression.

The data is where a task declares its kind, as a Flax module declares its
options: the ``regression`` flag of a
:class:`~ensembles.benchmark.quality.data.QualityData` (public API), or of a
:class:`~ensembles.benchmark.quality.real_data.RealTask`, which builds one.
Besides :func:`kind_of`, only those two read the flag, each its own:
:class:`~ensembles.benchmark.quality.data.QualityData` to check its arrays as
they enter (labels or real targets; ``num_classes`` or ``target_shape``), and
:func:`~ensembles.benchmark.quality.real_data.build_real_task` to read a
table's target column as labels or as numbers. Asking a kind there would
turn the imports around: a kind trains and scores a ``QualityData`` (this
module imports the data), while the data is built before, and without, any
of that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx

from ensembles.benchmark.quality.classification.kind import CLASSIFICATION
from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.regression.kind import REGRESSION
from ensembles.benchmark.quality.training import Recipe, Targets, Trained

__all__ = ["KINDS", "TaskKind", "kind_for", "kind_of", "kind_of_entry"]


class TaskKind(Protocol):
    """What a task's kind answers (a classifier's, a regressor's).

    Attributes:
      regression: the value of a row's ``"regression"`` key.
      min_validation: the fewest examples
        :func:`~ensembles.benchmark.quality.run.validation_size` holds out.
      fitted: what each method fits on the held-out examples ("temperatures").
      outputs_named: the outputs a model must give, as an error names them.
      gap_metrics: the figures whose gap from one model to the deep ensemble
        the report gives.
    """

    regression: bool
    min_validation: int
    fitted: str
    outputs_named: str
    gap_metrics: tuple[str, ...]

    def outputs(self, data: QualityData) -> int:
        """How many outputs a model of ``data`` gives."""

    def check_width(self, name: str, width: int, data: QualityData) -> None:
        """Raises unless a model's ``width`` outputs fit ``data``."""

    def model_outputs(self, y_train: np.ndarray, num_classes: int | None) -> int:
        """The outputs a named model is built with, from what it trains on."""

    def check_recipe(self, recipe: Recipe) -> None:
        """Raises if a recipe option does not apply to the kind."""

    def objective(self, recipe: Recipe) -> Callable[[jax.Array, jax.Array, int], Any]:
        """``loss(outputs, targets, num_members)`` of member-major outputs."""

    def validation_loss(
        self, predict_fn: Callable, x: np.ndarray, y: np.ndarray, recipe: Recipe
    ) -> Callable[[nnx.Module], jax.Array]:
        """A method's NLL on held-out examples, as it predicts (early stopping)."""

    def targets(
        self, train: QualityData, x_valid: np.ndarray, y_valid: np.ndarray
    ) -> Targets:
        """What the methods train on, and what scoring them needs."""

    def evaluate(
        self,
        trained: Trained,
        data: QualityData,
        x_valid: np.ndarray,
        y_valid: np.ndarray,
        targets: Targets,
    ) -> dict[str, Any]:
        """A trained method measured on every set, as trained and recalibrated."""

    def block(self, group: list[dict[str, Any]], *, markdown: bool) -> str:
        """The report's tables of one task, model and E."""

    def plot_height(self, group: list[dict[str, Any]]) -> int:
        """How many rows of panels a task's figure takes."""

    def plot_row(self, figure: Any, group: list[dict[str, Any]], width: int) -> None:
        """Draws a task's panels, ``width`` to a row, on a (sub)figure."""


#: Every task kind.
KINDS: tuple[TaskKind, ...] = (CLASSIFICATION, REGRESSION)


def kind_for(regression: bool) -> TaskKind:
    """The kind a public ``regression=`` argument names."""
    return REGRESSION if regression else CLASSIFICATION


def kind_of(data: QualityData) -> TaskKind:
    """The kind of a task's data (``QualityData.regression``)."""
    return kind_for(data.regression)


def kind_of_entry(entry: Mapping[str, Any]) -> TaskKind:
    """The kind of a row or summary entry (its ``"regression"`` key).

    An entry without the key (a row of an older run) is a classifier's.
    """
    return kind_for(bool(entry.get("regression", False)))
