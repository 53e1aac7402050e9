"""The quality benchmark's driver: train every method, measure it, one row each.

:func:`run_quality` checks every model and method against the data
(:mod:`~ensembles.benchmark.quality.checks`), holds a validation split out
of the training set (:func:`split_validation`), trains every method
(:mod:`~ensembles.benchmark.quality.methods`) and measures it with its
kind's scores: a classifier's by
:func:`~ensembles.benchmark.quality.classification.scores.evaluate`, a
regressor's (trained on standardised targets) by
:func:`~ensembles.benchmark.quality.regression.scores.evaluate_regression`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ensembles.benchmark.quality.checks import check_run
from ensembles.benchmark.quality.classification.mnist1d import load_quality_data
from ensembles.benchmark.quality.classification.scores import evaluate
from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.methods import (
    FINETUNE_FRACTION,
    QUALITY_METHODS,
    STEPS,
    Trained,
    train_method,
)
from ensembles.benchmark.quality.models import ModelSpec
from ensembles.benchmark.quality.regression.scores import (
    TargetScale,
    evaluate_regression,
)
from ensembles.benchmark.report import model_name

__all__ = [
    "MIN_REGRESSION_VALIDATION",
    "MIN_VALIDATION",
    "VALIDATION_FRACTION",
    "run_quality",
    "split_validation",
    "validation_size",
]

#: The share of the training set held out (when the data has no validation
#: set of its own) to fit every method's temperature on; no method trains on
#: it. At least :data:`MIN_VALIDATION` examples are held out (at most half the
#: set).
VALIDATION_FRACTION: float = 0.1

#: The fewest examples held out: a temperature is only identified by a
#: validation set with errors on it. On one without (a 98%-accurate digits
#: model has none in 120 examples one time in ten) the NLL falls as T -> 0 and
#: the fit ends at its lower bound (the benchmark flags such a fit:
#: ``temperature_at_bound``).
MIN_VALIDATION: int = 300

#: The fewest examples held out of a regression task's training set: every
#: example informs one scale of the spread, so far fewer identify it.
MIN_REGRESSION_VALIDATION: int = 50

_SPLIT_SEED = 20261126  # the validation split is the same for every seed


def validation_size(
    count: int, fraction: float = VALIDATION_FRACTION, *, regression: bool = False
) -> int:
    """How many of ``count`` training examples :func:`split_validation` holds out.

    >>> from ensembles.benchmark.quality.run import validation_size
    >>> validation_size(8000), validation_size(1197), validation_size(100)
    (800, 300, 50)
    >>> validation_size(458, regression=True), validation_size(5000, regression=True)
    (50, 500)
    """
    least = MIN_REGRESSION_VALIDATION if regression else MIN_VALIDATION
    return min(max(round(fraction * count), least), count // 2)


def split_validation(
    data: QualityData, fraction: float = VALIDATION_FRACTION
) -> tuple[QualityData, np.ndarray, np.ndarray]:
    """The data to train on and the validation set to fit temperatures on.

    A :class:`QualityData` with a validation set of its own (``x_valid``)
    keeps it and trains on all of ``x_train``; otherwise ``fraction`` of the
    training examples, but at least :data:`MIN_VALIDATION` and at most half
    of them (a fixed, seeded choice, the same for every method and seed), are
    held out and the rest train (regression: at least
    :data:`MIN_REGRESSION_VALIDATION`). The test and shifted sets are never
    touched.

    >>> import numpy as np
    >>> from ensembles.benchmark.quality.run import split_validation
    >>> from ensembles.benchmark import load_quality_data
    >>> data = load_quality_data(num_train=100, num_test=50, num_shifted=20)
    >>> train, x_valid, y_valid = split_validation(data)
    >>> train.x_train.shape, x_valid.shape          # half: fewer than 600
    ((50, 40), (50, 40))

    Args:
      data: the task's data.
      fraction: the share of ``x_train`` held out (within the bounds above).

    Returns:
      ``(data to train on, x_valid, y_valid)``.

    Raises:
      ValueError: if ``fraction`` leaves no example on either side.
    """
    if data.x_valid is not None:
        return data, np.asarray(data.x_valid), np.asarray(data.y_valid)
    count = len(data.x_train)
    held = validation_size(count, fraction, regression=data.regression)
    if not 0 < held < count:
        raise ValueError(
            f"a validation fraction of {fraction} of {count} training examples "
            f"holds out {held}: at least one must be held out and one left to "
            f"train on. Give a larger training set, or a validation set of your "
            f"own (`QualityData(..., x_valid=..., y_valid=...)`)."
        )
    order = np.random.default_rng(_SPLIT_SEED).permutation(count)
    valid, train = np.sort(order[:held]), np.sort(order[held:])
    x_train, y_train = np.asarray(data.x_train), np.asarray(data.y_train)
    kept = QualityData(
        x_train[train],
        y_train[train],
        data.x_test,
        data.y_test,
        data.shifted,
        data.ood,
        name=data.name,
        x_valid=x_train[valid],
        y_valid=y_train[valid],
        regression=data.regression,
        noise_std=data.noise_std,
    )
    return kept, x_train[valid], y_train[valid]


def run_quality(
    *,
    models: Sequence[ModelSpec] = ("cnn",),
    members: Sequence[int] = (4,),
    seeds: Sequence[int] = (0,),
    methods: Sequence[str] = QUALITY_METHODS,
    steps: int = STEPS,
    data: QualityData | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Trains and measures every method for every model, E and seed.

    Every method trains on the training set less a validation split
    (:func:`split_validation`), on which each fits its temperature. The rows
    are per seed; :func:`~ensembles.benchmark.quality.report.summarize`
    gives means and standard deviations, and
    :func:`~ensembles.benchmark.quality.report.format_quality` the tables
    (of rows or of a summary).

    Without ``data`` it runs the built-in MNIST-1D task
    (:func:`~ensembles.benchmark.quality.classification.mnist1d.load_quality_data`;
    ``models`` names from ``QUALITY_MODELS``). Your own classifier and data: a factory
    ``rngs -> nnx.Module`` (rows are named after it) and a
    :class:`QualityData` of your arrays, with whatever severities and shift
    families they have:

    >>> import numpy as np
    >>> from flax import nnx
    >>> from ensembles.benchmark import QualityData, format_quality, run_quality
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((200, 6)).astype(np.float32)
    >>> y = (x[:, 0] > 0).astype(np.int32)
    >>> shifted = {s: {"noise": (x + s * rng.standard_normal(x.shape), y)}
    ...            for s in (0.5, 1.0, 2.0)}
    >>> mine = QualityData(x[:150], y[:150], x[150:], y[150:], shifted, ood={})
    >>> def tiny(rngs):
    ...     return nnx.Sequential(nnx.Linear(6, 2, rngs=rngs))
    >>> rows = run_quality(models=[tiny], members=[2], steps=4, data=mine,
    ...                    methods=["single", "finetuned"])
    >>> [(row["model"], row["method"], row["steps"]) for row in rows]
    [('tiny', 'single', 4), ('tiny', 'finetuned', 1)]
    >>> [(row["members"], row["seed"]) for row in rows]
    [(2, 0), (2, 0)]
    >>> sorted(rows[0]["in_distribution"])
    ['accuracy', 'aurc', 'brier', 'ece', 'nll']
    >>> [level["severity"] for level in rows[0]["recalibrated"]["shift"]]
    [0.5, 1.0, 2.0]
    >>> rows[0]["temperature"] > 0, rows[0]["validation_examples"]  # half of 150
    (True, 75)
    >>> print(format_quality(rows))  # doctest: +ELLIPSIS
    tiny on ..., E=2, 1 seed...

    Args:
      models: names from
        :data:`~ensembles.benchmark.quality.models.QUALITY_MODELS`, or
        factories ``rngs -> nnx.Module`` of classifiers of ``data``'s
        examples (``mc_dropout`` calls them with a ``dropout`` keyword too).
      members: ensemble sizes E.
      seeds: seeds of parameters, batches and dropout (the data are fixed).
      methods: names from
        :data:`~ensembles.benchmark.quality.methods.QUALITY_METHODS`.
      steps: training steps of every method; ``finetuned`` fine-tunes the
        trained ``single`` model of the same seed (trained once, whether or
        not ``single`` is in ``methods``) for ``FINETUNE_FRACTION`` of them,
        and its row's ``steps`` counts only those.
      data: the data; ``None`` generates the standard MNIST-1D sets
        (:func:`~ensembles.benchmark.quality.classification.mnist1d.load_quality_data`).
      progress: called with a status line before each training, and with
        ``""`` at the end.

    Returns:
      One row (a dict) per model, E, seed and method: ``task``,
      ``regression``, ``method``, ``model``, ``members``, ``seed``,
      ``steps``, ``train_examples``, ``validation_examples``, ``params``,
      ``train_s`` and the measurements of :func:`evaluate` (regression: of
      :func:`~ensembles.benchmark.quality.regression.scores.evaluate_regression`;
      the methods train on targets standardised with the training split's
      mean and standard deviation, keep the parameters of their best of 40
      checks of the validation split's NLL, ``best_step``, and are scored in
      the targets' units). A
      method whose training diverged has ``diverged`` True and NaN figures;
      the others' rows stand.

    Raises:
      ValueError: if a method, a model or the data cannot run (an unknown
        name, ``mc_dropout`` asked of a factory without a ``dropout``
        keyword, a model whose outputs do not fit the data's classes): every
        check runs before anything trains.
      TypeError: if ``data`` is not a :class:`QualityData` or a model is
        neither a name nor a factory.
    """
    show = progress or (lambda message: None)
    data = load_quality_data() if data is None else data
    check_run(models, methods, data)  # refuse now, not after an hour of training
    train_data, x_valid, y_valid = split_validation(data)
    y_train, num_classes, scale, stopping = train_data.y_train, None, None, None
    if data.regression:  # trained on standardised targets, scored in theirs
        scale = TargetScale(train_data.y_train)
        y_train = scale.standardise(train_data.y_train)
        stopping = (x_valid, scale.standardise(y_valid))
    else:
        num_classes = data.num_classes
    finetune_steps = max(1, int(steps * FINETUNE_FRACTION))
    rows: list[dict[str, Any]] = []
    total = len(models) * len(members) * len(seeds) * len(methods)
    index = 0

    def train(method, model, num_members, method_steps, seed, start=None):
        return train_method(
            method,
            model,
            train_data.x_train,
            y_train,
            num_members=num_members,
            steps=method_steps,
            seed=seed,
            start=start,
            num_classes=num_classes,
            regression=data.regression,
            early_stopping=stopping,
        )

    def measure(trained: Trained) -> dict[str, Any]:
        if data.regression:
            measured = evaluate_regression(
                trained, data, x_valid=x_valid, y_valid=y_valid, scale=scale
            )
        else:
            measured = evaluate(trained, data, x_valid=x_valid, y_valid=y_valid)
        if measured["diverged"]:
            show(f"{trained.method} diverged: its figures are NaN")
        return {
            "params": trained.params,
            "train_s": trained.train_s,
            "best_step": trained.best_step,
            **measured,
        }

    # `single` does not depend on E: trained once per model and seed, its row
    # repeated for every E, and its model the start of `finetuned`.
    singles: dict[tuple[int, int], tuple[Trained, dict[str, Any]]] = {}

    def single_of(model: ModelSpec, seed: int, where: str) -> tuple[Trained, dict]:
        key = (id(model), seed)
        if key not in singles:
            show(f"{where}: training single ({steps} steps)")
            trained = train("single", model, 1, steps, seed)
            singles[key] = (trained, measure(trained))
        return singles[key]

    for model in models:
        name = model_name(model)
        for num_members in members:
            for seed in seeds:
                for method in methods:
                    index += 1
                    where = f"[{index}/{total}] {name} E={num_members} seed {seed}"
                    method_steps = steps
                    if method == "single":
                        measured = single_of(model, seed, where)[1]
                    else:
                        start = None
                        if method == "finetuned":
                            start = single_of(model, seed, where)[0].model
                            method_steps = finetune_steps
                        show(f"{where}: training {method} ({method_steps} steps)")
                        trained = train(
                            method, model, num_members, method_steps, seed, start
                        )
                        measured = measure(trained)
                    rows.append(
                        {
                            "task": data.name,
                            "regression": data.regression,
                            "method": method,
                            "model": name,
                            "members": num_members,
                            "seed": seed,
                            "steps": method_steps,
                            "train_examples": len(train_data.x_train),
                            "validation_examples": len(x_valid),
                            **measured,
                        }
                    )
    show("")
    return rows
