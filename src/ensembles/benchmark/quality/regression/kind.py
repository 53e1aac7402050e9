"""Regression as a task kind: what the quality benchmark does for a regressor.

:data:`REGRESSION` answers every question the driver, the checks, the
training, the report and the figure ask of a task's kind
(:class:`~ensembles.benchmark.quality.kinds.TaskKind`) for data with real
targets: its models give a mean and a raw spread per target
(:mod:`~ensembles.benchmark.quality.regression.head`), train on the
(beta-)NLL of targets standardised with the training split's mean and
standard deviation, keep their best of the validation split's checks, are
measured in the targets' units by
:func:`~ensembles.benchmark.quality.regression.scores.evaluate_regression`
and recalibrated with one scale of their spread each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ensembles
from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.regression.head import TargetScale, gaussian_pairs
from ensembles.benchmark.quality.regression.plots import regression_row, rows_of_panels
from ensembles.benchmark.quality.regression.report import regression_block
from ensembles.benchmark.quality.regression.scores import evaluate_regression
from ensembles.benchmark.quality.training import Recipe, Targets, Trained

__all__ = ["MIN_REGRESSION_VALIDATION", "REGRESSION", "Regression"]

#: The fewest examples held out of a regression task's training set: every
#: example informs one scale of the spread, so far fewer identify it.
MIN_REGRESSION_VALIDATION: int = 50


class Regression:
    """A regressor's task: real targets in, Gaussian members out, a scale each."""

    #: The value of a row's ``"regression"`` key.
    regression = True
    #: :func:`~ensembles.benchmark.quality.run.validation_size`'s least.
    min_validation = MIN_REGRESSION_VALIDATION
    #: What each method fits on the held-out examples (the command says so).
    fitted = "spread scales"
    #: The outputs a model must give, as an error message names them.
    outputs_named = "[N, 2 D] outputs"
    #: The figures whose gap from one model to the deep ensemble is reported.
    gap_metrics = ("nll", "crps")

    def outputs(self, data: QualityData) -> int:
        """How many outputs a model of ``data`` gives: 2 per target (``2 D``)."""
        return 2 * math.prod(data.target_shape)

    def check_width(self, name: str, width: int, data: QualityData) -> None:
        """Raises unless a model gives a mean and a raw spread per target."""
        outputs = self.outputs(data)
        if width != outputs:
            raise ValueError(
                f"the model {name!r} gives {width} outputs per "
                f"example, but a regressor of targets of shape "
                f"{data.target_shape or '[N]'} needs {outputs}: a mean and a raw "
                f"spread per target (its last layer `nnx.Linear(hidden, {outputs})`)."
            )

    def model_outputs(self, y_train: np.ndarray, num_classes: int | None) -> int:
        """The outputs a named model is built with: 2 per target."""
        return 2 * math.prod(np.shape(y_train)[1:])

    def check_recipe(self, recipe: Recipe) -> None:
        """Raises if the recipe asks what only a classifier has (diversity)."""
        if recipe.diversity:
            raise ValueError(
                f"`diversity` (={recipe.diversity}) pushes members' softmaxes "
                f"apart: it is for classification; leave it 0 for regression."
            )

    def objective(self, recipe: Recipe) -> Callable[[jax.Array, jax.Array, int], Any]:
        """``loss(outputs, targets, num_members)`` of member-major outputs.

        :func:`ensembles.training.gaussian_nll` (exponent ``recipe.beta``) of
        :func:`ensembles.training.gaussian_head`'s means and spreads (floor
        ``recipe.min_std``).
        """
        beta, min_std = recipe.beta, recipe.min_std

        def loss(outputs, targets, num_members):
            means, stds = ensembles.training.gaussian_head(
                gaussian_pairs(outputs, targets.shape[1:]), min_std=min_std
            )
            return ensembles.training.gaussian_nll(
                means, stds, targets, num_members=num_members, beta=beta
            )

        return loss

    def validation_loss(
        self, predict_fn: Callable, x: np.ndarray, y: np.ndarray, recipe: Recipe
    ) -> Callable[[nnx.Module], jax.Array]:
        """:func:`ensembles.uncertainty.mixture_nll` of the members' Gaussians.

        The targets ``y`` as the methods train on them, standardised.
        """
        x, y = jnp.asarray(x), jnp.asarray(y)

        def loss(model):
            means, stds = ensembles.training.gaussian_head(
                gaussian_pairs(predict_fn(model, x), y.shape[1:]),
                min_std=recipe.min_std,
            )
            return ensembles.uncertainty.mixture_nll(means, stds, y)

        return loss

    def targets(
        self, train: QualityData, x_valid: np.ndarray, y_valid: np.ndarray
    ) -> Targets:
        """Standardised targets, early stopping on the split, scored in units."""
        scale = TargetScale(train.y_train)
        stopping = (x_valid, scale.standardise(y_valid))
        return Targets(
            scale.standardise(train.y_train),
            {"regression": True, "early_stopping": stopping},
            scale,
        )

    def evaluate(
        self,
        trained: Trained,
        data: QualityData,
        x_valid: np.ndarray,
        y_valid: np.ndarray,
        targets: Targets,
    ) -> dict[str, Any]:
        """:func:`~ensembles.benchmark.quality.regression.scores.evaluate_regression`."""
        return evaluate_regression(
            trained, data, x_valid=x_valid, y_valid=y_valid, scale=targets.scale
        )

    def block(self, group: list[dict[str, Any]], *, markdown: bool) -> str:
        """The tables of one task, model and E (:func:`regression_block`)."""
        return regression_block(group, markdown=markdown)

    def plot_height(self, group: list[dict[str, Any]]) -> int:
        """The rows of panels a task's figure takes: two with bands, else one."""
        return rows_of_panels(group)

    def plot_row(self, figure: Any, group: list[dict[str, Any]], width: int) -> None:
        """:func:`~ensembles.benchmark.quality.regression.plots.regression_row`."""
        regression_row(figure, group, width)


#: The regression kind.
REGRESSION = Regression()
