"""The quality benchmark's data: what a task hands it, checked as it is built.

A :class:`QualityData` holds a task's labelled training and test sets, its
shifted sets at every severity and its out-of-distribution sets, for a
classifier (integer labels) or a regressor (real targets); every task of
:mod:`~ensembles.benchmark.quality.tasks` returns one, and so may a user's
own arrays. :data:`SEVERITIES` are the built-in tasks' shift severities.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["SEVERITIES", "QualityData"]

#: Shift severities, 1 (mild) to 5 (strong).
SEVERITIES: tuple[int, ...] = (1, 2, 3, 4, 5)


@dataclasses.dataclass(frozen=True)
class QualityData:
    """The benchmark's data: labelled train, test and shifted sets, OOD sets.

    Examples may have any shape, the same in every set (MNIST-1D's are
    ``[40]`` sequences, digits' ``[8, 8]`` images, the tabular task's ``[20]``
    rows), with finite values; labels are integers in ``[0, C)`` or, with
    ``regression=True``, real targets ``[N]`` (or ``[N, D]``, the same D in
    every set). The sets are checked when the data is built, so that a
    mistake surfaces before anything trains.

    >>> import numpy as np
    >>> from ensembles.benchmark import QualityData
    >>> x, y = np.zeros((30, 6), np.float32), np.arange(30) % 3
    >>> data = QualityData(x, y, x, y, shifted={"mild": {"noise": (x, y)},
    ...                    "harsh": {"noise": (x + 1, y)}}, ood={})
    >>> data.severities, data.num_classes
    (('mild', 'harsh'), 3)
    >>> QualityData(x, y, x, y, shifted={}, ood={})
    Traceback (most recent call last):
    ...
    ValueError: `shifted` must map at least one severity to ...
    >>> targets = x.sum(axis=1) + 0.5                     # a regression task
    >>> QualityData(x, targets, x, targets, shifted={"mild": {"noise": (x, targets)}},
    ...             ood={}, regression=True).target_shape
    ()

    Attributes:
      x_train: ``[N, ...]`` training examples.
      y_train: their ``[N]`` integer labels (regression: ``[N]`` or ``[N, D]``
        real targets).
      x_test: in-distribution test examples.
      y_test: their labels.
      shifted: ``{severity: {family: (x, y)}}``: one or more severities (an
        int, float or str each, in the order they should be reported, mild
        to strong), each with one or more shift families (a str each); the
        families may differ between severities.
      ood: ``{name: x}``, out-of-distribution sets (examples of no class);
        may be empty.
      name: the task the sets come from (``"mnist1d"`` for the standard
        sets; the tasks of :mod:`~ensembles.benchmark.quality.classification.tasks` name
        theirs).
      x_valid: ``[M, ...]`` held-out examples to fit each method's
        temperature on, or ``None``: the benchmark then holds out
        :data:`~ensembles.benchmark.quality.run.VALIDATION_FRACTION` of the
        training set (:func:`~ensembles.benchmark.quality.run.split_validation`).
        Never the test set.
      y_valid: their labels (given with ``x_valid``, or ``None``).
      regression: the targets are real numbers, not class labels: the
        benchmark trains Gaussian-head regressors (``docs/regression.md``).
        The task's kind is declared here
        (:mod:`~ensembles.benchmark.quality.kinds` picks it from this flag).
      noise_std: regression only, optional: the true standard deviation of
        each test target's noise ``[N_test]`` (``[N_test, D]``), known for a
        synthetic task: the benchmark then scores the members' aleatoric
        spread against it.

    Raises:
      TypeError: if a set is not an array, labels are not integers (or
        targets not real numbers), or a severity or name has the wrong type.
      ValueError: if shapes disagree (examples of another shape, labels of
        another length), an example or target is NaN or infinite, a label is
        negative, or ``shifted`` is empty.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    shifted: dict[Any, dict[str, tuple[np.ndarray, np.ndarray]]]
    ood: dict[str, np.ndarray]
    name: str = "mnist1d"
    x_valid: np.ndarray | None = None
    y_valid: np.ndarray | None = None
    regression: bool = False
    noise_std: np.ndarray | None = None

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(
                f"`name` must be a str, got {self.name!r} of type "
                f"{type(self.name).__name__}."
            )
        if not isinstance(self.regression, bool):
            raise TypeError(
                f"`regression` must be a bool, got {self.regression!r} of type "
                f"{type(self.regression).__name__}."
            )
        example = _examples(self.x_train, "x_train").shape[1:]
        targets = None
        if self.regression:
            targets = tuple(np.shape(self.y_train)[1:])
        _labelled(self.x_train, self.y_train, "x_train", "y_train", example, targets)
        _labelled(self.x_test, self.y_test, "x_test", "y_test", example, targets)
        self._check_noise_std()
        if (self.x_valid is None) != (self.y_valid is None):
            raise ValueError(
                "`x_valid` and `y_valid` go together: give both (a validation "
                "set of your own) or neither (the benchmark holds out part of "
                "the training set)."
            )
        if self.x_valid is not None:
            _labelled(
                self.x_valid, self.y_valid, "x_valid", "y_valid", example, targets
            )
        if not isinstance(self.shifted, dict) or not self.shifted:
            raise ValueError(
                f"`shifted` must map at least one severity to {{family: (x, y)}}, "
                f"got {_brief(self.shifted)}: the benchmark measures every method "
                f"under shift."
            )
        for severity, families in self.shifted.items():
            where = f"shifted[{severity!r}]"
            if isinstance(severity, bool) or not isinstance(
                severity, int | float | str
            ):
                raise TypeError(
                    f"the severities (keys of `shifted`) must be ints, floats or "
                    f"strs, got {severity!r} of type {type(severity).__name__}."
                )
            if not isinstance(families, dict) or not families:
                raise ValueError(
                    f"`{where}` must map at least one shift family to (x, y), got "
                    f"{_brief(families)}."
                )
            for family, pair in families.items():
                if not isinstance(family, str):
                    raise TypeError(
                        f"the shift families (keys of `{where}`) must be strs, "
                        f"got {family!r} of type {type(family).__name__}."
                    )
                if not isinstance(pair, tuple | list) or len(pair) != 2:
                    raise ValueError(
                        f"`{where}[{family!r}]` must be a pair (x, y), got "
                        f"{_brief(pair)}."
                    )
                name = f"{where}[{family!r}]"
                _labelled(*pair, f"{name}[0]", f"{name}[1]", example, targets)
        if not isinstance(self.ood, dict):
            raise TypeError(
                f"`ood` must be a dict {{name: x}} (possibly empty), got "
                f"{_brief(self.ood)}."
            )
        for name, x in self.ood.items():
            if not isinstance(name, str):
                raise TypeError(
                    f"the out-of-distribution sets' names (keys of `ood`) must be "
                    f"strs, got {name!r} of type {type(name).__name__}."
                )
            _examples(x, f"ood[{name!r}]", example)

    def _check_noise_std(self) -> None:
        if self.noise_std is None:
            return
        if not self.regression:
            raise ValueError(
                "`noise_std` (the test targets' true noise) is for regression "
                "data: pass regression=True, or leave noise_std out."
            )
        noise = np.asarray(self.noise_std)
        if noise.shape != np.shape(self.y_test):
            raise ValueError(
                f"`noise_std` must have the test targets' shape "
                f"{np.shape(self.y_test)}, got {noise.shape}."
            )
        if not (np.isfinite(noise) & (noise > 0)).all():
            raise ValueError("`noise_std` must hold positive, finite numbers.")

    @property
    def target_shape(self) -> tuple[int, ...]:
        """Regression: one example's targets, ``()`` or ``(D,)``."""
        if not self.regression:
            raise ValueError(
                "classification data has labels, not targets: see `num_classes`."
            )
        return tuple(np.shape(self.y_train)[1:])

    @property
    def severities(self) -> tuple[Any, ...]:
        """The severities of :attr:`shifted`, in the order they are reported."""
        return tuple(self.shifted)

    @property
    def num_classes(self) -> int:
        """C: one more than the largest label of any set (classification)."""
        if self.regression:
            raise ValueError(
                "regression data has real targets, not classes: see `target_shape`."
            )
        labelled = [self.y_train, self.y_test]
        if self.y_valid is not None:
            labelled.append(self.y_valid)
        labelled += [
            y for families in self.shifted.values() for _, y in families.values()
        ]
        return int(max(np.max(y) for y in labelled if np.size(y))) + 1


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"


def _real(dtype: np.dtype) -> bool:
    """Whether ``dtype`` holds floats or integers, bfloat16 included.

    numpy's own test refuses bfloat16 (its kind is "V"), the dtype of
    ``np.asarray`` of a bf16 jax.Array.
    """
    return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)


def _examples(x: Any, name: str, example: tuple[int, ...] | None = None) -> np.ndarray:
    """``x`` as a numpy array of ``[N, *example]`` real examples, or raises."""
    if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"`{name}` must be a numpy (or JAX) array of examples, got {_brief(x)}."
        )
    x = np.asarray(x)
    if x.ndim < 1 or not len(x):
        raise ValueError(
            f"`{name}` must be a non-empty [N, ...] array of examples, got shape "
            f"{x.shape}."
        )
    if not _real(x.dtype):
        raise TypeError(f"`{name}` must hold real numbers, got dtype {x.dtype}.")
    if not np.isfinite(x).all():
        index = np.unravel_index(int(np.argmax(~np.isfinite(x))), x.shape)
        raise ValueError(
            f"`{name}` must hold finite numbers, got {name}[{index[0]}] with "
            f"{x[index]} at {index[1:] or 'its only entry'}: drop or impute such "
            f"examples before the benchmark trains on or scores them."
        )
    if example is not None and x.shape[1:] != example:
        raise ValueError(
            f"`{name}` holds examples of shape {x.shape[1:]}, but the training "
            f"examples (`x_train`) have shape {example}: every set must hold "
            f"examples of one shape."
        )
    return x


def _labelled(x: Any, y: Any, x_name: str, y_name: str, example, targets=None) -> None:
    """Checks a labelled set: ``[N, *example]`` examples and ``[N]`` labels.

    With ``targets`` (one example's target shape, regression) the labels are
    real targets ``[N, *targets]`` instead.
    """
    x = _examples(x, x_name, example)
    if y is None or not hasattr(y, "shape") or not hasattr(y, "dtype"):
        raise TypeError(f"`{y_name}` must be an array of labels, got {_brief(y)}.")
    y = np.asarray(y)
    if targets is not None:
        _regression_targets(y, y_name, len(x), targets)
        return
    if y.dtype == np.bool_ or not np.issubdtype(y.dtype, np.integer):
        raise TypeError(
            f"`{y_name}` must hold integer class indices, got dtype {y.dtype} "
            f"(one-hot labels: pass `labels.argmax(-1)`; real-valued targets "
            f"are a regression task: pass `regression=True`)."
        )
    if y.shape != (len(x),):
        raise ValueError(
            f"`{y_name}` must have shape [N] = ({len(x)},), one label per example "
            f"of `{x_name}`, got shape {y.shape}."
        )
    if (y < 0).any():
        raise ValueError(f"`{y_name}` must hold labels >= 0, got {int(y.min())}.")


def _regression_targets(
    y: np.ndarray, name: str, count: int, targets: tuple[int, ...]
) -> None:
    """Checks real targets: ``[count, *targets]``, finite, one or no output axis."""
    if y.dtype == np.bool_ or not _real(y.dtype):
        raise TypeError(f"`{name}` must hold real targets, got dtype {y.dtype}.")
    if len(targets) > 1 or y.shape != (count, *targets):
        raise ValueError(
            f"`{name}` must have shape [N] or [N, D] like `y_train` "
            f"({(count, *targets)} here), one target (row) per example, got "
            f"shape {y.shape}."
        )
    if not np.isfinite(y).all():
        raise ValueError(
            f"`{name}` must hold finite targets, got "
            f"{y.reshape(-1)[np.argmax(~np.isfinite(y.reshape(-1)))]} in it."
        )
