"""The quality benchmark's driver: train every method, measure it, one row each.

:func:`run_quality` goes in named steps: check every model and method
against the data (:func:`~ensembles.benchmark.quality.checks.check_run`),
hold a validation split out of the training set (:func:`split_validation`)
and let the task's kind (:mod:`~ensembles.benchmark.quality.kinds`) say what
the methods train on (:class:`Task`), then train every method of the table
(:mod:`~ensembles.benchmark.quality.methods`) for every model, E and seed
and measure it with the kind's scores (:func:`train_and_measure`), one row
each (:func:`quality_row`).

Your own classifier and data: a factory ``rngs -> nnx.Module`` (rows are
named after it) and a :class:`QualityData` of your arrays, with whatever
severities and shift families they have:

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
...                    methods=["single"])
>>> [(row["model"], row["method"], row["steps"]) for row in rows]
[('tiny', 'single', 4)]
>>> [(row["members"], row["seed"]) for row in rows]
[(2, 0)]
>>> sorted(rows[0]["in_distribution"])
['accuracy', 'aurc', 'brier', 'ece', 'nll']
>>> [level["severity"] for level in rows[0]["recalibrated"]["shift"]]
[0.5, 1.0, 2.0]
>>> rows[0]["temperature"] > 0, rows[0]["validation_examples"]  # half of 150
(True, 75)
>>> print(format_quality(rows))  # doctest: +ELLIPSIS
tiny on ..., E=2, 1 seed...
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ensembles.benchmark.quality.checks import check_run
from ensembles.benchmark.quality.classification.kind import MIN_VALIDATION
from ensembles.benchmark.quality.classification.mnist1d import load_quality_data
from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.kinds import TaskKind, kind_for, kind_of
from ensembles.benchmark.quality.methods import (
    METHOD_TABLE,
    QUALITY_METHODS,
    STEPS,
    QualityMethod,
    resolve_method,
    train_method,
)
from ensembles.benchmark.quality.models import ModelSpec
from ensembles.benchmark.quality.regression.kind import MIN_REGRESSION_VALIDATION
from ensembles.benchmark.quality.training import Targets, Trained
from ensembles.benchmark.report import model_name

__all__ = [
    "MIN_REGRESSION_VALIDATION",
    "MIN_VALIDATION",
    "VALIDATION_FRACTION",
    "Task",
    "prepare_task",
    "quality_row",
    "run_quality",
    "run_task",
    "split_validation",
    "train_and_measure",
    "validation_size",
]

#: The share of the training set held out (when the data has no validation
#: set of its own) to fit every method's temperature on; no method trains on
#: it. At least the task kind's least (:data:`MIN_VALIDATION`,
#: :data:`MIN_REGRESSION_VALIDATION`) are held out (at most half the set).
VALIDATION_FRACTION: float = 0.1

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
    return _held_out(count, fraction, kind_for(regression))


def _held_out(count: int, fraction: float, kind: TaskKind) -> int:
    return min(max(round(fraction * count), kind.min_validation), count // 2)


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
    held = _held_out(count, fraction, kind_of(data))
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
    kept = dataclasses.replace(
        data,
        x_train=x_train[train],
        y_train=y_train[train],
        x_valid=x_train[valid],
        y_valid=y_train[valid],
    )
    return kept, x_train[valid], y_train[valid]


@dataclasses.dataclass(frozen=True)
class Task:
    """What every training and measurement of one task shares.

    Attributes:
      data: the task's data (its test, shifted and OOD sets are measured).
      kind: its :class:`~ensembles.benchmark.quality.kinds.TaskKind`.
      train: the data the methods train on (:func:`split_validation`'s).
      x_valid: the held-out examples every method calibrates on.
      y_valid: their labels or targets.
      targets: what the methods train on, as the kind says.
      steps: every method's training steps (a method's share of them).
      show: the progress callback.
      trained_once: the ``one_model`` methods trained so far, by method,
        model and seed: their trained model and measurements.
    """

    data: QualityData
    kind: TaskKind
    train: QualityData
    x_valid: np.ndarray
    y_valid: np.ndarray
    targets: Targets
    steps: int
    show: Callable[[str], None]
    trained_once: dict[tuple, tuple[Trained, dict[str, Any]]] = dataclasses.field(
        default_factory=dict
    )

    def describe(self, note: str = "") -> str:
        """Its training examples (and ``note`` on them), those held out, its steps."""
        held = "more held out" if self.data.x_valid is not None else "of them held out"
        return (
            f"{len(self.data.x_train):,} training examples{note}, "
            f"{len(self.x_valid):,} {held} to fit {self.kind.fitted}; "
            f"{self.steps} training steps per method"
        )


def prepare_task(
    data: QualityData, steps: int, show: Callable[[str], None] = print
) -> Task:
    """The task of ``data``: its validation split and what its kind trains on."""
    kind = kind_of(data)
    train, x_valid, y_valid = split_validation(data)
    targets = kind.targets(train, x_valid, y_valid)
    return Task(data, kind, train, x_valid, y_valid, targets, steps, show)


def run_quality(
    *,
    models: Sequence[ModelSpec] = ("cnn",),
    members: Sequence[int] = (4,),
    seeds: Sequence[int] = (0,),
    methods: Sequence[str | QualityMethod] = QUALITY_METHODS,
    steps: int = STEPS,
    data: QualityData | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Trains and measures every method for every model, E and seed.

    Every method trains on the training set less a validation split
    (:func:`split_validation`), on which each fits its temperature (a
    regressor: its scale of the spread); the module shows a run on data of
    your own. :func:`~ensembles.benchmark.quality.report.summarize` gives the
    rows' means and standard deviations over seeds, and
    :func:`~ensembles.benchmark.quality.report.format_quality` their tables.

    Args:
      models: names from
        :data:`~ensembles.benchmark.quality.models.QUALITY_MODELS`, or
        factories ``rngs -> nnx.Module`` of models of ``data``'s examples
        (``mc_dropout`` calls them with a ``dropout`` keyword too).
      members: ensemble sizes E.
      seeds: seeds of parameters, batches and dropout (the data are fixed).
      methods: names from
        :data:`~ensembles.benchmark.quality.methods.QUALITY_METHODS`, or
        :class:`~ensembles.benchmark.quality.methods.QualityMethod` s of
        your own.
      steps: training steps of every method; ``finetuned`` fine-tunes the
        ``single`` model of the same seed (trained once, in ``methods`` or
        not) for ``FINETUNE_FRACTION`` of them, and its row counts those.
      data: the data; ``None`` generates the standard MNIST-1D sets
        (:func:`~ensembles.benchmark.quality.classification.mnist1d.load_quality_data`).
      progress: called with a status line before each training, and with
        ``""`` at the end.

    Returns:
      One row (a dict) per model, E, seed and method (:func:`quality_row`):
      what ran, and the measurements of the kind's scores
      (:func:`~ensembles.benchmark.evaluate`,
      :func:`~ensembles.benchmark.evaluate_regression`: a regressor trains on
      standardised targets, keeps its best of 40 checks of the validation
      split's NLL, ``best_step``, and is scored in the targets' units). A
      method whose training diverged has ``diverged`` True and NaN figures;
      the others' rows stand.

    Raises:
      ValueError: if a method, a model or the data cannot run (an unknown
        name, ``mc_dropout`` asked of a factory without a ``dropout``
        keyword, a model whose outputs do not fit the data): every check
        runs before anything trains.
      TypeError: if ``data`` is not a :class:`QualityData` or a model is
        neither a name nor a factory.
    """
    show = progress or (lambda message: None)
    data = load_quality_data() if data is None else data
    check_run(models, methods, data)  # refuse now, not after an hour of training
    task = prepare_task(data, steps, show)
    rows = run_task(task, models, members, seeds, methods)
    show("")
    return rows


def run_task(
    task: Task,
    models: Sequence[ModelSpec],
    members: Sequence[int],
    seeds: Sequence[int],
    methods: Sequence[str | QualityMethod],
) -> list[dict[str, Any]]:
    """Every method of a checked task trained and measured: one row each."""
    methods = [resolve_method(method) for method in methods]
    runs = list(itertools.product(models, members, seeds, methods))
    rows = []
    for index, (model, num_members, seed, method) in enumerate(runs, 1):
        where = f"[{index}/{len(runs)}] {model_name(model)} E={num_members} seed {seed}"
        _, measured = train_and_measure(task, method, model, num_members, seed, where)
        rows.append(quality_row(task, method, model, num_members, seed, measured))
    return rows


def train_and_measure(
    task: Task,
    method: QualityMethod,
    model: ModelSpec,
    num_members: int,
    seed: int,
    where: str,
) -> tuple[Trained, dict[str, Any]]:
    """One method trained and measured: the trained method and its figures.

    A ``one_model`` method (``single``) does not depend on E: it is trained
    once per model and seed (as one model), its figures repeated for every E
    and its model the start of a method that ``starts_from`` it
    (``finetuned``), trained first where it was not yet.
    """
    key = (method.name, id(model), seed)
    if method.one_model and key in task.trained_once:
        return task.trained_once[key]
    start = None
    if method.starts_from is not None:
        start = train_and_measure(task, method.starts_from, model, 1, seed, where)
        start = start[0].model
    steps = method.steps(task.steps)
    task.show(f"{where}: training {method.name} ({steps} steps)")
    trained = train_method(
        # The table's methods by name, as a user names them; others as they are.
        method.name if method in METHOD_TABLE else method,
        model,
        task.train.x_train,
        task.targets.y_train,
        num_members=1 if method.one_model else num_members,
        steps=steps,
        seed=seed,
        start=start,
        **task.targets.options,
    )
    measured = task.kind.evaluate(
        trained, task.data, task.x_valid, task.y_valid, task.targets
    )
    if measured["diverged"]:
        task.show(f"{trained.method} diverged: its figures are NaN")
    result = (
        trained,
        {
            "params": trained.params,
            "train_s": trained.train_s,
            "best_step": trained.best_step,
            **measured,
        },
    )
    if method.one_model:
        task.trained_once[key] = result
    return result


def quality_row(
    task: Task,
    method: QualityMethod,
    model: ModelSpec,
    num_members: int,
    seed: int,
    measured: dict[str, Any],
) -> dict[str, Any]:
    """One row: what ran (task, kind, method, model, E, seed, steps), measured."""
    return {
        "task": task.data.name,
        "regression": task.kind.regression,
        "method": method.name,
        "model": model_name(model),
        "members": num_members,
        "seed": seed,
        "steps": method.steps(task.steps),
        "train_examples": len(task.train.x_train),
        "validation_examples": len(task.x_valid),
        **measured,
    }
