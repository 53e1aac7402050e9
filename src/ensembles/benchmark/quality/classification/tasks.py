"""Classification tasks of the quality benchmark, with shifts and OOD sets, offline.

More tasks than MNIST-1D, so that defaults are chosen across tasks. Each
loader returns a :class:`~ensembles.benchmark.quality.data.QualityData`
(float32 inputs, int32 labels, five shift severities, out-of-distribution sets)
built offline and deterministically: every random draw comes from a numpy
``Generator`` or scikit-learn ``random_state`` seeded here, and no loader reads
or changes numpy's or Python's global random state.
:data:`CLASSIFICATION_TASKS` names them:

- ``mnist1d``:
  :func:`~ensembles.benchmark.quality.classification.mnist1d.load_quality_data`;
- ``digits``: scikit-learn's bundled 8x8 handwritten digits, 1,197 train / 600
  test images ``[N, 8, 8]`` in ``[0, 1]`` (a seeded stratified split of the
  1,797), 10 classes. Shifts (:data:`DIGITS_SHIFTS`) corrupt the 600 test
  images: ``noise`` (additive Gaussian of std sigma, clipped to [0, 1]),
  ``blur`` (Gaussian blur of std sigma pixels), ``rotation`` (by the angle in
  degrees, random sign per image; rotated at 4x resolution, then averaged back
  to 8x8, so a small angle does not also blur), ``occlusion`` (a zeroed square
  of that side at a random position). OOD, 600 images each: ``inverted``
  (``1 - x`` of the test images), ``noise`` (pixels drawn independently from
  the training pixels' values), ``rectangles`` (unions of 1-3 random bright
  rectangles);
- ``tabular``: ``sklearn.datasets.make_classification``, 20 features (10
  informative, 4 redundant), 5 classes of two Gaussian clusters each (not
  linearly separable), ``class_sep=1.0``, ``flip_y=0.01``; 6,000 train / 2,000
  test, standardised with the train mean and std. Train, test and every
  shifted set come from ONE draw (so from the same class centroids), split.
  Shifts (:data:`TABULAR_SHIFTS`), 1,000 fresh examples per family and
  severity, in standardised units: ``scale`` (feature ``f`` times
  ``exp(s * z_f)``, ``z`` a fixed standard-normal vector), ``translation`` (an
  offset of length ``s`` along a fixed random unit direction), ``noise``
  (additive Gaussian of std ``s``), ``dropout`` (each feature set to 0, the
  train mean, with probability ``s``). OOD, 2,000 examples each:
  ``other_generator`` (``make_classification`` with another ``random_state``,
  standardised with the train statistics) and ``uniform`` (in ``[-4, 4]^20``);
- ``mnist1d_harsh``: MNIST-1D as ``mnist1d`` but drawn from other seeds and
  shifted harder
  (:data:`~ensembles.benchmark.quality.classification.mnist1d.HARSH_SHIFTS`).
  It is kept aside to check defaults
  chosen on the other tasks, never to choose them.

Accuracy per family at severities 1-5, measured while choosing the levels
(2026-11-25) with a scikit-learn LogisticRegression (LR) or MLPClassifier
(MLP, early stopping) fitted on the task's train set:

- digits, LR (clean 0.972): noise .947 .912 .822 .667 .547; blur .963 .933
  .895 .768 .547; rotation .955 .910 .825 .655 .377; occlusion .962 .903 .733
  .538 .395;
- tabular, LR (clean 0.621): scale .609 .550 .523 .484 .405; translation .597
  .596 .557 .525 .487; noise .583 .537 .524 .486 .373; dropout .569 .540 .526
  .466 .416. MLP (128, 128) (clean 0.859): scale .809 .741 .630 .548 .417;
  translation .826 .728 .656 .560 .432; noise .817 .713 .566 .524 .418;
  dropout .826 .748 .680 .586 .418;
- mnist1d_harsh, MLP (256, 256) (clean 0.713): correlated_noise .493 .359 .260
  .232 .193; iid_noise .667 .593 .555 .428 .371; shear .615 .487 .372 .279
  .206; scale .651 .606 .615 .572 .550; translation .636 .591 .551 .537 .516
  (at the standard severity 5, an MLP trained on ``mnist1d``: .361-.592).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ensembles.benchmark.quality.classification.mnist1d import (
    load_mnist1d_harsh_data,
    load_quality_data,
)
from ensembles.benchmark.quality.classification.real_tasks import (
    REAL_CLASSIFICATION_TASKS,
)
from ensembles.benchmark.quality.data import SEVERITIES, QualityData

__all__ = [
    "CLASSIFICATION_TASKS",
    "DIGITS_SHIFTS",
    "TABULAR_SHIFTS",
    "load_digits_data",
    "load_tabular_data",
]

#: Digits shift families and their levels at severities 1-5: the noise's std,
#: the blur's std (pixels), the rotation angle (degrees), the patch side (pixels).
DIGITS_SHIFTS: dict[str, tuple[float, ...]] = {
    "noise": (0.15, 0.25, 0.35, 0.5, 0.65),
    "blur": (0.5, 0.6, 0.7, 0.85, 1.0),
    "rotation": (5, 10, 15, 20, 30),
    "occlusion": (1, 2, 3, 4, 5),
}

#: Tabular shift families and their levels at severities 1-5, in standardised
#: units: the log-scale factors' std, the offset's length, the noise's std, the
#: probability that a feature is dropped.
TABULAR_SHIFTS: dict[str, tuple[float, ...]] = {
    "scale": (0.25, 0.5, 0.75, 1.0, 1.5),
    "translation": (1.0, 2.0, 3.0, 4.0, 6.0),
    "noise": (0.25, 0.5, 0.75, 1.0, 1.5),
    "dropout": (0.05, 0.15, 0.25, 0.4, 0.6),
}

_INSTALL_HINT = "pip install 'flax-ensembles[bench]' (or pip install scikit-learn)"
_DIGITS_TEST = 600
_TABULAR_SIZES = (6000, 2000, 1000)  # train, test (and each OOD set), shifted
_TABULAR_ARGS = {
    "n_features": 20,
    "n_informative": 10,
    "n_redundant": 4,
    "n_classes": 5,
    "n_clusters_per_class": 2,
    "class_sep": 1.0,
    "flip_y": 0.01,
}


def _sklearn_datasets() -> Any:
    try:
        import sklearn.datasets
    except ImportError:
        raise ImportError(
            f"the digits and tabular tasks are built with scikit-learn, which is "
            f"not installed: {_INSTALL_HINT}"
        ) from None
    return sklearn.datasets


def _rng(*keys: int) -> np.random.Generator:
    """A generator of its own for every (seed, family, severity) combination."""
    return np.random.default_rng(list(keys))


def _pair(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(x, np.float32), np.asarray(y, np.int32)


# ---------------------------------------------------------------- digits


def _stratified_split(
    y: np.ndarray, num_test: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Indices of a train and a test split with the classes' proportions."""
    shuffled = rng.permutation(len(y))
    grouped = shuffled[np.argsort(y[shuffled], kind="stable")]  # class by class
    # num_test positions evenly spaced along the grouped list: each class gets
    # its share of the test set, to within one example.
    marks = np.arange(len(y) + 1) * num_test // len(y)
    is_test = np.diff(marks) > 0
    return rng.permutation(grouped[~is_test]), rng.permutation(grouped[is_test])


def _rotate(x: np.ndarray, angle: float, rng: np.random.Generator) -> np.ndarray:
    from scipy import ndimage

    signs = rng.choice(np.array([-1.0, 1.0]), size=len(x))
    fine = np.repeat(np.repeat(x, 4, axis=1), 4, axis=2)  # 8x8 -> 32x32, exact
    turned = np.stack(
        [
            ndimage.rotate(image, sign * angle, reshape=False, order=1)
            for image, sign in zip(fine, signs, strict=True)
        ]
    )
    return turned.reshape(len(x), 8, 4, 8, 4).mean(axis=(2, 4))


def _occlude(x: np.ndarray, side: int, rng: np.random.Generator) -> np.ndarray:
    size = x.shape[1]
    top = rng.integers(0, size - side + 1, size=len(x))
    left = rng.integers(0, size - side + 1, size=len(x))
    rows = np.arange(size)
    in_rows = (rows >= top[:, None]) & (rows < top[:, None] + side)
    in_cols = (rows >= left[:, None]) & (rows < left[:, None] + side)
    return np.where(in_rows[:, :, None] & in_cols[:, None, :], 0.0, x)


def _corrupt_digits(
    family: str, x: np.ndarray, level: float, rng: np.random.Generator
) -> np.ndarray:
    from scipy import ndimage

    if family == "noise":
        x = x + level * rng.standard_normal(x.shape)
    elif family == "blur":
        x = ndimage.gaussian_filter(x, sigma=(0.0, level, level), mode="constant")
    elif family == "rotation":
        x = _rotate(x, level, rng)
    else:  # occlusion
        x = _occlude(x, int(level), rng)
    return np.clip(x, 0.0, 1.0)


def _rectangles(num: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """Images of unions of 1-3 axis-aligned rectangles of random brightness."""
    images = np.zeros((num, size, size))
    count = rng.integers(1, 4, size=num)
    coords = np.arange(size)
    for index in range(3):
        top, left = rng.integers(0, size - 1, size=(2, num))
        bottom = rng.integers(top + 2, size + 1)
        right = rng.integers(left + 2, size + 1)
        brightness = rng.uniform(0.5, 1.0, size=num) * (index < count)
        rows = (coords >= top[:, None]) & (coords < bottom[:, None])
        cols = (coords >= left[:, None]) & (coords < right[:, None])
        patch = rows[:, :, None] & cols[:, None, :]
        images = np.maximum(images, patch * brightness[:, None, None])
    return images


@functools.lru_cache(maxsize=4)
def load_digits_data(*, seed: int = 0) -> QualityData:
    """scikit-learn's 8x8 digits with corrupted and out-of-distribution sets.

    1,197 train and 600 test images (a stratified split drawn from ``seed``),
    600 per shift family and severity (:data:`DIGITS_SHIFTS`, the test images
    corrupted), 600 per out-of-distribution set. Cached per seed (the arrays
    are shared: do not write to them).

    >>> from ensembles.benchmark.quality.classification.tasks import load_digits_data
    >>> data = load_digits_data()
    >>> data.name, data.x_train.shape, data.x_test.shape, data.x_test.dtype
    ('digits', (1197, 8, 8), (600, 8, 8), dtype('float32'))
    >>> sorted(data.shifted[5]), sorted(data.ood)
    (['blur', 'noise', 'occlusion', 'rotation'], ['inverted', 'noise', 'rectangles'])

    Args:
      seed: the split's and the corruptions' seed.

    Returns:
      The :class:`~ensembles.benchmark.quality.data.QualityData`, images
      ``[N, 8, 8]`` (no channel axis) in ``[0, 1]``.
    """
    digits = _sklearn_datasets().load_digits()
    x = np.asarray(digits.images, np.float64) / 16.0  # pixel values 0..16
    y = np.asarray(digits.target)
    train, test = _stratified_split(y, _DIGITS_TEST, _rng(seed, 0))
    x_test, y_test = x[test], y[test]
    shifted: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for severity in SEVERITIES:
        shifted[severity] = {}
        for i, (family, levels) in enumerate(DIGITS_SHIFTS.items()):
            rng = _rng(seed, 1, i, severity)
            x_shift = _corrupt_digits(family, x_test, levels[severity - 1], rng)
            shifted[severity][family] = _pair(x_shift, y_test)
    shape = (_DIGITS_TEST, *x.shape[1:])
    ood = {
        "inverted": 1.0 - x_test,
        "noise": _rng(seed, 2).choice(x[train].ravel(), size=shape),
        "rectangles": _rectangles(_DIGITS_TEST, x.shape[1], _rng(seed, 3)),
    }
    return QualityData(
        *_pair(x[train], y[train]),
        *_pair(x_test, y_test),
        shifted,
        {name: np.asarray(v, np.float32) for name, v in ood.items()},
        name="digits",
    )


# ---------------------------------------------------------------- tabular


def _shift_tabular(
    family: str, x: np.ndarray, level: float, seed: int, index: int, severity: int
) -> np.ndarray:
    # The direction of a family's shift is fixed (drawn from the family's own
    # seed), only its size grows with the severity; the noise is drawn anew.
    fixed = _rng(seed, 5, index).standard_normal(x.shape[1])
    rng = _rng(seed, 6, index, severity)
    if family == "scale":
        return x * np.exp(level * fixed)
    if family == "translation":
        return x + level * fixed / np.linalg.norm(fixed)
    if family == "noise":
        return x + level * rng.standard_normal(x.shape)
    return np.where(rng.random(x.shape) < level, 0.0, x)  # dropout


@functools.lru_cache(maxsize=4)
def load_tabular_data(*, seed: int = 0) -> QualityData:
    """Gaussian-cluster tabular data (``make_classification``), shifted and OOD.

    6,000 train and 2,000 test examples of 20 features and 5 classes; 1,000
    fresh examples per shift family and severity (:data:`TABULAR_SHIFTS`);
    2,000 per out-of-distribution set. Everything is standardised with the
    train mean and std. Cached per seed (the arrays are shared: do not write to
    them).

    >>> from ensembles.benchmark.quality.classification.tasks import load_tabular_data
    >>> data = load_tabular_data()
    >>> data.name, data.x_train.shape, data.x_test.shape, data.y_test.dtype
    ('tabular', (6000, 20), (2000, 20), dtype('int32'))
    >>> [x.shape for x, _ in data.shifted[1].values()]
    [(1000, 20), (1000, 20), (1000, 20), (1000, 20)]
    >>> sorted(data.ood)
    ['other_generator', 'uniform']

    Args:
      seed: ``make_classification``'s ``random_state`` (the concept and the
        examples) and the shifts' seed.

    Returns:
      The :class:`~ensembles.benchmark.quality.data.QualityData`.
    """
    make = _sklearn_datasets().make_classification
    num_train, num_test, num_shifted = _TABULAR_SIZES
    num_sets = len(SEVERITIES) * len(TABULAR_SHIFTS)
    # One draw: train, test and the shifted sets share the class centroids.
    x, y = make(
        n_samples=num_train + num_test + num_sets * num_shifted,
        random_state=seed,
        **_TABULAR_ARGS,
    )
    mean, std = x[:num_train].mean(axis=0), x[:num_train].std(axis=0)
    x = (x - mean) / std
    start = num_train + num_test
    shifted: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for severity in SEVERITIES:
        shifted[severity] = {}
        for index, (family, levels) in enumerate(TABULAR_SHIFTS.items()):
            part = slice(start, start + num_shifted)
            start += num_shifted
            shift = _shift_tabular(
                family, x[part], levels[severity - 1], seed, index, severity
            )
            shifted[severity][family] = _pair(shift, y[part])
    other, _ = make(n_samples=num_test, random_state=seed + 1, **_TABULAR_ARGS)
    uniform = _rng(seed, 4).uniform(-4.0, 4.0, size=(num_test, x.shape[1]))
    ood = {"other_generator": (other - mean) / std, "uniform": uniform}
    test = slice(num_train, num_train + num_test)
    return QualityData(
        *_pair(x[:num_train], y[:num_train]),
        *_pair(x[test], y[test]),
        shifted,
        {name: np.asarray(v, np.float32) for name, v in ood.items()},
        name="tabular",
    )


#: The quality benchmark's classification tasks by name, each a cached loader:
#: the four above, then the real tables with a natural shift
#: (:mod:`~ensembles.benchmark.quality.classification.real_tasks`).
CLASSIFICATION_TASKS: dict[str, Callable[..., QualityData]] = {
    "mnist1d": load_quality_data,
    "digits": load_digits_data,
    "tabular": load_tabular_data,
    "mnist1d_harsh": load_mnist1d_harsh_data,
    **REAL_CLASSIFICATION_TASKS,
}
