"""The quality benchmark's data; MNIST-1D generated offline, with shifted sets.

MNIST-1D (Greydanus & Kobak, 2024) draws each example procedurally: one of ten
1-D digit templates, padded, scaled, translated, with correlated and iid noise
added and sheared, sampled to 40 points. The ``mnist1d`` package builds it with
``mnist1d.data.make_dataset(args)``, which never touches the network (its
``get_dataset`` downloads; it is never called here). Every set below is drawn
from a fixed seed, so the data are the same on every run and machine.

- **in distribution**: the standard arguments (``get_dataset_args()``), a train
  and a test split;
- **shift**: five corruption families, each at five severities like
  CIFAR-10-C's: one argument of the generator turned up (correlated noise, iid
  noise, shear, scale, translation; :data:`SHIFTS`);
- **out of distribution**: ``shuffled`` (MNIST-1D's own ``shuffle_seq``: one
  fixed permutation of the 40 positions, the same for every sequence, which no
  model was trained on) and ``noise`` (standard-normal sequences).

``make_dataset`` standardises each set by its own mean and standard deviation,
so a shifted set is shifted in shape, not in overall scale.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any

import numpy as np

from ensembles._checks import check_positive_int

__all__ = ["SEVERITIES", "SHIFTS", "QualityData", "load_quality_data"]

#: The corrupted argument of ``mnist1d``'s generator per shift family, and its
#: value at severities 1-5 (the standard values: corr_noise_scale 0.25,
#: iid_noise_scale 0.02, shear_scale 0.75, scale_coeff 0.4, max_translation 48).
SHIFTS: dict[str, tuple[str, tuple[float, ...]]] = {
    "correlated_noise": ("corr_noise_scale", (0.3, 0.35, 0.4, 0.45, 0.5)),
    "iid_noise": ("iid_noise_scale", (0.03, 0.045, 0.06, 0.08, 0.1)),
    "shear": ("shear_scale", (1.0, 1.25, 1.5, 1.75, 2.0)),
    "scale": ("scale_coeff", (0.6, 0.8, 1.0, 1.2, 1.4)),
    "translation": ("max_translation", (52, 56, 60, 64, 72)),
}

#: Shift severities, 1 (mild) to 5 (strong).
SEVERITIES: tuple[int, ...] = (1, 2, 3, 4, 5)

_DATA_SEED = 42  # mnist1d's own default seed (our sets are larger than its 5,000)
_INSTALL_HINT = "pip install 'ensembles[bench]' (or pip install mnist1d)"


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
        sets; the tasks of :mod:`~ensembles.benchmark.quality_tasks` name
        theirs).
      x_valid: ``[M, ...]`` held-out examples to fit each method's
        temperature on, or ``None``: the benchmark then holds out
        :data:`~ensembles.benchmark.quality.VALIDATION_FRACTION` of the
        training set (:func:`~ensembles.benchmark.quality.split_validation`).
        Never the test set.
      y_valid: their labels (given with ``x_valid``, or ``None``).
      regression: the targets are real numbers, not class labels: the
        benchmark trains Gaussian-head regressors (``docs/regression.md``).
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
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
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
    if y.dtype == np.bool_ or not (
        np.issubdtype(y.dtype, np.floating) or np.issubdtype(y.dtype, np.integer)
    ):
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


def _mnist1d() -> Any:
    try:
        import mnist1d.data
        import mnist1d.utils
    except ImportError:
        raise ImportError(
            f"the quality benchmark generates MNIST-1D with the `mnist1d` package, "
            f"which is not installed: {_INSTALL_HINT}"
        ) from None
    return mnist1d


def _generate(
    num_samples: int,
    seed: int,
    train_split: float,
    template: dict | None = None,
    **changes: Any,
) -> dict[str, np.ndarray]:
    mnist1d = _mnist1d()
    args = mnist1d.data.get_dataset_args(as_dict=True)
    unknown = set(changes) - set(args)
    if unknown:  # a typo would otherwise silently add an unused field
        raise ValueError(f"unknown mnist1d arguments {sorted(unknown)}")
    args.update(num_samples=num_samples, seed=seed, train_split=train_split)
    args.update(changes)
    # make_dataset seeds numpy's and Python's global generators; put them back
    # so that generating data never changes a caller's random state.
    numpy_state = np.random.get_state()  # noqa: NPY002 (mnist1d's global RNG)
    python_state = random.getstate()
    try:
        return mnist1d.data.make_dataset(mnist1d.utils.ObjectView(args), template)
    finally:
        np.random.set_state(numpy_state)  # noqa: NPY002
        random.setstate(python_state)


def _as_arrays(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(x, np.float32), np.asarray(y, np.int32)


@functools.lru_cache(maxsize=4)
def load_quality_data(
    *, num_train: int = 8000, num_test: int = 2000, num_shifted: int = 1000
) -> QualityData:
    """Generates the benchmark's MNIST-1D sets; deterministic and offline.

    Results are cached per size (the arrays are shared: do not write to them).

    >>> from ensembles.benchmark.quality_data import load_quality_data
    >>> data = load_quality_data(num_train=100, num_test=50, num_shifted=20)
    >>> data.x_train.shape, data.x_test.shape, sorted(data.ood)
    ((100, 40), (50, 40), ['noise', 'shuffled'])
    >>> x, y = data.shifted[5]["shear"]
    >>> x.shape, y.shape
    ((20, 40), (20,))

    Args:
      num_train: training examples (the standard MNIST-1D has 4,000; the
        benchmark uses 8,000).
      num_test: in-distribution test examples, and examples of each
        out-of-distribution set.
      num_shifted: examples per shift family and severity.

    Returns:
      The :class:`QualityData`.
    """
    return mnist1d_sets(
        num_train,
        num_test,
        num_shifted,
        shifts=SHIFTS,
        seeds=(_DATA_SEED, 1000, 999, 998),
        name="mnist1d",
    )


def mnist1d_sets(
    num_train: int,
    num_test: int,
    num_shifted: int,
    *,
    shifts: dict[str, tuple[str, tuple[float, ...]]],
    seeds: tuple[int, int, int, int],
    name: str,
) -> QualityData:
    """MNIST-1D's train, test, shifted and OOD sets from the given seeds.

    What :func:`load_quality_data` and the harsh variant
    (:func:`~ensembles.benchmark.quality_tasks.load_mnist1d_harsh_data`) share:
    ``seeds`` are those of the train/test draw, of the shifted sets (plus ``10
    * severity + family index``), of the shuffled and of the noise OOD sets;
    ``shifts`` the families' generator arguments and their levels.

    Args:
      num_train: training examples, a multiple of 10.
      num_test: test examples and examples per OOD set, a multiple of 10.
      num_shifted: examples per family and severity, a multiple of 10.
      shifts: family -> (generator argument, levels at severities 1-5).
      seeds: (train/test, shifted base, shuffled, noise).
      name: the data's name.

    Returns:
      The :class:`QualityData`.

    Raises:
      ValueError: if a size is not a positive multiple of 10.
    """
    for label, value in (
        ("num_train", num_train),
        ("num_test", num_test),
        ("num_shifted", num_shifted),
    ):
        if check_positive_int(value, label) % 10:
            raise ValueError(
                f"`{label}` must be a multiple of 10 (MNIST-1D draws the same "
                f"number of examples of each of its 10 classes), got {value}."
            )
    main_seed, shift_seed, shuffled_seed, noise_seed = seeds
    # One draw for train and test: disjoint examples of the standard process
    # (shuffled across classes by make_dataset).
    main = _generate(num_train + num_test, main_seed, 1.0)
    x_train, y_train = _as_arrays(main["x"][:num_train], main["y"][:num_train])
    x_test, y_test = _as_arrays(main["x"][num_train:], main["y"][num_train:])
    shifted: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for level, severity in enumerate(SEVERITIES):
        shifted[severity] = {}
        for index, (family, (argument, values)) in enumerate(shifts.items()):
            seed = shift_seed + 10 * severity + index
            drawn = _generate(num_shifted, seed, 0.0, **{argument: values[level]})
            shifted[severity][family] = _as_arrays(drawn["x_test"], drawn["y_test"])
    shuffled = _generate(num_test, shuffled_seed, 0.0, shuffle_seq=True)["x_test"]
    noise = np.random.default_rng(noise_seed).standard_normal(shuffled.shape)
    ood = {
        "shuffled": np.asarray(shuffled, np.float32),
        "noise": np.asarray(noise, np.float32),
    }
    return QualityData(x_train, y_train, x_test, y_test, shifted, ood, name=name)
