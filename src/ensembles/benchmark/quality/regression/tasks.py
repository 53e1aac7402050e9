"""Regression tasks of the quality benchmark, with shifts and OOD sets, offline.

Each loader returns a :class:`~ensembles.benchmark.quality.data.QualityData`
with ``regression=True``: float32 inputs standardised with the training
set's mean and standard deviation, float32 targets ``[N]`` in their own units
(the benchmark standardises them for training and reports every score in
these units), shifted sets at named severities and out-of-distribution sets.
Every random draw comes from a numpy ``Generator`` seeded here; nothing is
downloaded. :data:`REGRESSION_TASKS` names them:

- ``cubic``: the toy of the deep ensembles paper (Lakshminarayanan et al.,
  2017, after Hernandez-Lobato & Adams, 2015): 20 training points ``x ~
  U[-4, 4]``, ``y = x^3 + N(0, 3^2)``, a validation set of 20 more, 1,000
  test points. Shift: ``extrapolation`` to ``|x|`` in ``(4 + 0.4 (k - 1), 4 +
  0.4 k]`` at severity ``k`` (the paper plots up to 6); OOD ``|x|`` in ``[8,
  10]``. The true noise (3) is known.
- ``hetero_sine_gap``: ``y = x sin x + 0.3 e1 + 0.3 x e2`` (Detlefsen et
  al., 2019; the beta-NLL paper's toy), noise of standard deviation ``0.3
  sqrt(1 + x^2)``, known; 2,000 training and 2,000 test points ``x ~ U[0,
  10]`` outside the gap ``(4, 6)``. Shifts: ``gap`` (``x`` in the gap, at
  distance ``(0.2 (k - 1), 0.2 k]`` from its edges: "in-between"
  uncertainty, Foong et al., 2019) and ``extrapolation`` (``x`` in ``(10 +
  0.5 (k - 1), 10 + 0.5 k]``); OOD ``x`` in ``[15, 20]``.
- ``friedman1_hetero``: ``make_friedman1``'s function of ``x ~ U[0, 1]^10``
  (five inputs used) with heteroscedastic noise ``(0.5 + 2 x5) e``; 5,000
  training and 2,000 test points. Shifts (:data:`FRIEDMAN_SHIFTS`), 1,000
  points per family and severity: ``translation`` (``x1, x2`` moved out of
  the cube), ``scale`` (the cube stretched about its centre), ``input_noise``
  (the inputs observed with Gaussian noise; the targets are the clean
  inputs'). OOD: ``far_cube`` (``U[2, 3]^10``).
- ``concrete``: the UCI Concrete Compressive Strength data (Yeh, 1998;
  1,030 mixtures, 8 inputs, strength in MPa), bundled with the package
  (``benchmark/data/concrete.csv``, licence in ``benchmark/data/README.md``).
  In distribution: mixtures tested at an age of at most 28 days with at most
  376 kg/m^3 of cement (the 80th percentile), a seeded 75/25 train/test
  split. Natural shifts: ``age`` (tested at 56, 90-100, >= 120 days) and
  ``cement`` (cement in (376, 425], (425, 480], > 480 kg/m^3); ``log(age)`` is
  the age input. OOD: ``far`` (standardised inputs of magnitude 4-6, random
  signs).
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Callable

import numpy as np

from ensembles.benchmark.quality.data import SEVERITIES, QualityData
from ensembles.benchmark.quality.regression.real_tasks import REAL_REGRESSION_TASKS

__all__ = [
    "FRIEDMAN_SHIFTS",
    "REGRESSION_TASKS",
    "load_concrete",
    "load_concrete_data",
    "load_cubic_data",
    "load_friedman1_hetero_data",
    "load_hetero_sine_gap_data",
]

#: ``friedman1_hetero``'s shift families and their levels at severities 1-5:
#: the offset added to ``x1`` and ``x2``, the stretch ``s`` of ``x <- 0.5 +
#: (x - 0.5)(1 + s)``, the input noise's standard deviation.
FRIEDMAN_SHIFTS: dict[str, tuple[float, ...]] = {
    "translation": (0.05, 0.1, 0.25, 0.5, 1.0),
    "scale": (0.1, 0.2, 0.4, 0.7, 1.0),
    "input_noise": (0.02, 0.05, 0.1, 0.2, 0.3),
}

_Sets = dict[int | str, dict[str, tuple[np.ndarray, np.ndarray]]]


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([20261126, *keys])


def _data(
    x_train, y_train, x_test, y_test, shifted: _Sets, ood, *, name, **extra
) -> QualityData:
    """Standardises every input with the training set's statistics."""
    x_train = np.asarray(x_train, np.float64)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)

    def scale(x):
        return np.asarray((np.asarray(x, np.float64) - mean) / std, np.float32)

    def targets(y):
        return np.asarray(y, np.float32)

    valid = {}
    if "x_valid" in extra:
        valid = {
            "x_valid": scale(extra.pop("x_valid")),
            "y_valid": targets(extra.pop("y_valid")),
        }
    return QualityData(
        scale(x_train),
        targets(y_train),
        scale(x_test),
        targets(y_test),
        {
            severity: {f: (scale(x), targets(y)) for f, (x, y) in families.items()}
            for severity, families in shifted.items()
        },
        {set_name: scale(x) for set_name, x in ood.items()},
        name=name,
        regression=True,
        **valid,
        **{k: np.asarray(v, np.float32) for k, v in extra.items()},
    )


# ------------------------------------------------------------------ cubic


def _cubic(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return x**3 + 3.0 * rng.standard_normal(x.shape)


def _symmetric_band(low: float, high: float, count: int, rng) -> np.ndarray:
    """``count`` points with ``|x|`` uniform in ``(low, high]``, either sign."""
    return rng.uniform(low, high, count) * rng.choice([-1.0, 1.0], count)


@functools.lru_cache(maxsize=4)
def load_cubic_data(*, seed: int = 0) -> QualityData:
    """The deep ensembles paper's toy, ``y = x^3 + N(0, 3^2)``, 20 points.

    >>> from ensembles.benchmark.quality.regression.tasks import load_cubic_data
    >>> data = load_cubic_data()
    >>> data.x_train.shape, data.x_valid.shape, data.x_test.shape, data.regression
    ((20, 1), (20, 1), (1000, 1), True)
    >>> list(data.severities), sorted(data.ood)
    ([1, 2, 3, 4, 5], ['far'])

    Args:
      seed: the seed of every draw.

    Returns:
      The :class:`~ensembles.benchmark.quality.data.QualityData` (cached per
      seed: the arrays are shared, do not write to them).
    """
    x_train, x_valid, x_test = (
        _rng(seed, i).uniform(-4.0, 4.0, size) for i, size in enumerate((20, 20, 1000))
    )
    shifted: _Sets = {}
    for k in SEVERITIES:
        rng = _rng(seed, 10, k)
        x = _symmetric_band(4 + 0.4 * (k - 1), 4 + 0.4 * k, 1000, rng)
        shifted[k] = {"extrapolation": (x[:, None], _cubic(x, rng))}
    return _data(
        x_train[:, None],
        _cubic(x_train, _rng(seed, 3)),
        x_test[:, None],
        _cubic(x_test, _rng(seed, 4)),
        shifted,
        {"far": _symmetric_band(8.0, 10.0, 1000, _rng(seed, 5))[:, None]},
        name="cubic",
        x_valid=x_valid[:, None],
        y_valid=_cubic(x_valid, _rng(seed, 6)),
        noise_std=np.full(1000, 3.0),
    )


# -------------------------------------------------------- hetero sine gap


def _sine_noise_std(x: np.ndarray) -> np.ndarray:
    return 0.3 * np.sqrt(1 + x**2)


def _sine(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    noise = 0.3 * rng.standard_normal(x.shape) + 0.3 * x * rng.standard_normal(x.shape)
    return x * np.sin(x) + noise


def _outside_gap(count: int, rng: np.random.Generator) -> np.ndarray:
    """``x ~ U[0, 10]`` conditioned on lying outside ``(4, 6)``: U on 8 units."""
    u = rng.uniform(0.0, 8.0, count)
    return np.where(u < 4.0, u, u + 2.0)


@functools.lru_cache(maxsize=4)
def load_hetero_sine_gap_data(*, seed: int = 0) -> QualityData:
    """``y = x sin x`` with noise growing in ``x``, a gap in the training inputs.

    >>> from ensembles.benchmark.quality.regression.tasks import (
    ...     load_hetero_sine_gap_data)
    >>> data = load_hetero_sine_gap_data()
    >>> data.x_train.shape, sorted(data.shifted[1]), data.noise_std.shape
    ((2000, 1), ['extrapolation', 'gap'], (2000,))

    Args:
      seed: the seed of every draw.

    Returns:
      The :class:`~ensembles.benchmark.quality.data.QualityData` (cached).
    """
    x_train, x_test = (_outside_gap(2000, _rng(seed, i)) for i in (0, 1))
    shifted: _Sets = {}
    for k in SEVERITIES:
        rng = _rng(seed, 10, k)
        depth = rng.uniform(0.2 * (k - 1), 0.2 * k, 1000)  # from the gap's edges
        gap = np.where(rng.random(1000) < 0.5, 4.0 + depth, 6.0 - depth)
        far = rng.uniform(10 + 0.5 * (k - 1), 10 + 0.5 * k, 1000)
        shifted[k] = {
            "gap": (gap[:, None], _sine(gap, rng)),
            "extrapolation": (far[:, None], _sine(far, rng)),
        }
    return _data(
        x_train[:, None],
        _sine(x_train, _rng(seed, 2)),
        x_test[:, None],
        _sine(x_test, _rng(seed, 3)),
        shifted,
        {"far": _rng(seed, 4).uniform(15.0, 20.0, (1000, 1))},
        name="hetero_sine_gap",
        noise_std=_sine_noise_std(x_test),
    )


# ------------------------------------------------------- Friedman #1


def _friedman(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    mean = (
        10 * np.sin(np.pi * x[:, 0] * x[:, 1])
        + 20 * (x[:, 2] - 0.5) ** 2
        + 10 * x[:, 3]
        + 5 * x[:, 4]
    )
    return mean + (0.5 + 2 * x[:, 4]) * rng.standard_normal(len(x))


def _shift_friedman(family: str, level: float, rng: np.random.Generator):
    x = rng.uniform(0.0, 1.0, (1000, 10))
    if family == "translation":
        x = x.copy()
        x[:, :2] += level
        return x, _friedman(x, rng)
    if family == "scale":
        x = 0.5 + (x - 0.5) * (1 + level)
        return x, _friedman(x, rng)
    y = _friedman(x, rng)  # input_noise: the targets of the clean inputs
    return x + level * rng.standard_normal(x.shape), y


@functools.lru_cache(maxsize=4)
def load_friedman1_hetero_data(*, seed: int = 0) -> QualityData:
    """Friedman #1 with heteroscedastic noise and covariate shifts.

    >>> from ensembles.benchmark.quality.regression.tasks import (
    ...     load_friedman1_hetero_data)
    >>> data = load_friedman1_hetero_data()
    >>> data.x_train.shape, data.x_test.shape, sorted(data.shifted[3])
    ((5000, 10), (2000, 10), ['input_noise', 'scale', 'translation'])

    Args:
      seed: the seed of every draw.

    Returns:
      The :class:`~ensembles.benchmark.quality.data.QualityData` (cached).
    """
    x_train, x_test = (
        _rng(seed, i).uniform(0.0, 1.0, (n, 10)) for i, n in ((0, 5000), (1, 2000))
    )
    shifted: _Sets = {}
    for k in SEVERITIES:
        shifted[k] = {
            family: _shift_friedman(family, levels[k - 1], _rng(seed, 10, i, k))
            for i, (family, levels) in enumerate(FRIEDMAN_SHIFTS.items())
        }
    return _data(
        x_train,
        _friedman(x_train, _rng(seed, 2)),
        x_test,
        _friedman(x_test, _rng(seed, 3)),
        shifted,
        {"far_cube": _rng(seed, 4).uniform(2.0, 3.0, (2000, 10))},
        name="friedman1_hetero",
        noise_std=0.5 + 2 * x_test[:, 4],
    )


# ---------------------------------------------------------------- concrete


@functools.lru_cache(maxsize=1)
def load_concrete() -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """The bundled UCI Concrete data: ``(x [1030, 8], strength [1030], names)``.

    The raw values (kg per m^3 of mixture, age in days; strength in MPa), in
    the file's order. See ``benchmark/data/README.md`` for its source and
    licence.

    >>> from ensembles.benchmark.quality.regression.tasks import load_concrete
    >>> x, y, names = load_concrete()
    >>> x.shape, y.shape, names[-1]
    ((1030, 8), (1030,), 'age')
    """
    path = importlib.resources.files("ensembles.benchmark") / "data" / "concrete.csv"
    with path.open() as handle:
        names = tuple(handle.readline().strip().split(","))
        table = np.loadtxt(handle, delimiter=",")
    return table[:, :-1], table[:, -1], names[:-1]


def _concrete_inputs(x: np.ndarray) -> np.ndarray:
    """``log(age)`` for the age: strength grows with it roughly logarithmically."""
    return np.concatenate([x[:, :-1], np.log(x[:, -1:])], axis=1)


@functools.lru_cache(maxsize=4)
def load_concrete_data(*, seed: int = 0) -> QualityData:
    """UCI Concrete, trained on young, low-cement mixtures, shifted by nature.

    >>> from ensembles.benchmark.quality.regression.tasks import load_concrete_data
    >>> data = load_concrete_data()
    >>> data.x_train.shape, data.x_test.shape, list(data.severities)
    ((458, 8), (153, 8), [1, 2, 3])
    >>> {k: {f: len(x) for f, (x, _) in v.items()} for k, v in data.shifted.items()}
    {1: {'age': 68, 'cement': 69}, 2: {'age': 105, 'cement': 33}, 3: {'age': 44, 'cement': 36}}

    Args:
      seed: the train/test split's and the OOD set's seed.

    Returns:
      The :class:`~ensembles.benchmark.quality.data.QualityData` (cached).
    """  # noqa: E501
    x, y, _ = load_concrete()
    cement, age = x[:, 0], x[:, -1]
    low_cement = cement <= 376.0  # the 80th percentile of the 1,030
    inside = np.flatnonzero(low_cement & (age <= 28))
    order = _rng(seed, 0).permutation(inside)
    num_test = round(0.25 * len(inside))
    test, train = np.sort(order[:num_test]), np.sort(order[num_test:])
    inputs = _concrete_inputs(x)
    age_bands = ((age == 56), (age >= 90) & (age <= 100), (age >= 120))
    cement_bands = (
        (cement > 376.0) & (cement <= 425.0),
        (cement > 425.0) & (cement <= 480.0),
        cement > 480.0,
    )
    shifted: _Sets = {}
    for k, (old, rich) in enumerate(zip(age_bands, cement_bands, strict=True), 1):
        aged = np.flatnonzero(low_cement & old)
        rich = np.flatnonzero(rich & (age <= 28))
        shifted[k] = {"age": (inputs[aged], y[aged]), "cement": (inputs[rich], y[rich])}
    mean, std = inputs[train].mean(axis=0), inputs[train].std(axis=0)
    rng = _rng(seed, 1)
    far = rng.uniform(4.0, 6.0, (1000, 8)) * rng.choice([-1.0, 1.0], (1000, 8))
    return _data(
        inputs[train],
        y[train],
        inputs[test],
        y[test],
        shifted,
        {"far": mean + far * std},  # standardised by _data to magnitude 4-6
        name="concrete",
    )


#: The regression tasks by name, each a cached loader: the four above, then
#: the real tables with a natural shift
#: (:mod:`~ensembles.benchmark.quality.regression.real_tasks`).
REGRESSION_TASKS: dict[str, Callable[..., QualityData]] = {
    "cubic": load_cubic_data,
    "hetero_sine_gap": load_hetero_sine_gap_data,
    "friedman1_hetero": load_friedman1_hetero_data,
    "concrete": load_concrete_data,
    **REAL_REGRESSION_TASKS,
}
