"""What ``run_quality`` checks before anything trains: names, models, outputs.

A wrong method name, a factory without a ``dropout`` keyword or a model
whose outputs cannot fit the data's classes (or a regressor's two outputs
per target) should surface in seconds, not after an hour of training.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.kinds import kind_of
from ensembles.benchmark.quality.methods import (
    QUALITY_METHODS,
    QualityMethod,
    resolve_method,
)
from ensembles.benchmark.quality.models import ModelSpec, build_model, check_model
from ensembles.benchmark.report import model_name

__all__ = ["check_run", "model_outputs"]


def check_run(
    models: Sequence[ModelSpec],
    methods: Sequence[str | QualityMethod],
    data: QualityData,
) -> None:
    """Raises unless every model can run every method on ``data``.

    What :func:`~ensembles.benchmark.quality.run.run_quality` checks before
    anything trains (the command checks every task's this way before the
    first trains): the methods' names, each model's name or factory, and one
    abstract forward pass of each model (no computation) on the data's
    examples, at each dropout rate a method builds it with, whose outputs
    must be ``[N, C']`` with ``C'`` what the task's kind wants (at least the
    data's classes; a regressor: a mean and a raw spread per target,
    :func:`model_outputs`).

    Args:
      models: names or factories, as for ``run_quality``.
      methods: names of methods, or methods of your own.
      data: the data.

    Raises:
      ValueError: naming the method or model that cannot run, and why.
      TypeError: if ``data`` is not a :class:`QualityData`, a method is
        neither a name nor a method, or a model neither a name nor a factory.
    """
    if not isinstance(data, QualityData):
        raise TypeError(
            f"`data` must be an `ensembles.benchmark.QualityData` (or None for "
            f"the standard MNIST-1D sets), got {type(data).__name__}."
        )
    unknown = [m for m in methods if isinstance(m, str) and m not in QUALITY_METHODS]
    if unknown:
        raise ValueError(
            f"`methods` must be names from {list(QUALITY_METHODS)}, got {unknown!r}."
        )
    methods = [resolve_method(method) for method in methods]
    dropouts = [method for method in methods if method.dropout]
    rates = (0.0, *sorted({method.dropout for method in dropouts}))
    for model in models:
        check_model(model, [method.name for method in dropouts])
        _check_outputs(model, data, rates)


def model_outputs(data: QualityData) -> int:
    """How many outputs a model of ``data`` gives: C, or 2 per target (``2 D``)."""
    return kind_of(data).outputs(data)


def _check_outputs(model: ModelSpec, data: QualityData, rates: Sequence[float]):
    """One abstract forward pass per dropout rate: outputs the task's kind takes."""
    kind = kind_of(data)
    outputs = kind.outputs(data)
    example = tuple(np.shape(data.x_train)[1:])
    x = jax.ShapeDtypeStruct((2, *example), np.float32)
    for dropout in rates:

        def forward(x, dropout=dropout):
            net = build_model(
                model,
                input_shape=example,
                num_classes=outputs,
                dropout=dropout,
                rngs=nnx.Rngs(0),
            )
            return net(x)

        try:
            out = jax.eval_shape(forward, x)
        except Exception as error:
            raise ValueError(
                f"the model {model_name(model)!r} fails on a batch of the data's "
                f"examples (shape {x.shape}): {type(error).__name__}: {error}"
            ) from error
        shape = getattr(out, "shape", None)
        if shape is None or len(shape) != 2 or shape[0] != 2:
            raise ValueError(
                f"the model {model_name(model)!r} must map a batch [N, "
                f"{', '.join(map(str, example))}] of the data's examples to "
                f"{kind.outputs_named}; on N = 2 it gave "
                f"{shape if shape is not None else type(out).__name__}."
            )
        kind.check_width(model_name(model), shape[1], data)
