"""MNIST-1D, generated offline, with shifted and out-of-distribution sets.

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
so a shifted set is shifted in shape, not in overall scale. The harsh variant
(:func:`load_mnist1d_harsh_data`) draws from other seeds and shifts harder
(:data:`HARSH_SHIFTS`).
"""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np

from ensembles._checks import check_positive_int
from ensembles.benchmark.quality.data import SEVERITIES, QualityData

__all__ = [
    "HARSH_SHIFTS",
    "SHIFTS",
    "load_mnist1d_harsh_data",
    "load_quality_data",
    "mnist1d_sets",
]

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

#: The harsh MNIST-1D's shifts: :data:`SHIFTS`' families and arguments, each
#: severity-1 value at the standard severity 3, severity 5 beyond the
#: standard 5. Except translation: mnist1d shifts the
#: padded 72-point sequence cyclically by ``k < max_translation``, so 72
#: already places the digit anywhere (and a larger value would only add
#: unshifted digits); it grows to 72 here. Scale stays <= 2 so that the factor
#: ``1 + scale_coeff * (u - 0.5)`` never flips the digit's sign.
HARSH_SHIFTS: dict[str, tuple[str, tuple[float, ...]]] = {
    "correlated_noise": ("corr_noise_scale", (0.4, 0.5, 0.6, 0.7, 0.8)),
    "iid_noise": ("iid_noise_scale", (0.06, 0.08, 0.1, 0.13, 0.16)),
    "shear": ("shear_scale", (1.5, 2.0, 2.5, 3.0, 3.5)),
    "scale": ("scale_coeff", (1.0, 1.25, 1.5, 1.75, 2.0)),
    "translation": ("max_translation", (60, 63, 66, 69, 72)),
}

_DATA_SEED = 42  # mnist1d's own default seed (our sets are larger than its 5,000)
_INSTALL_HINT = "pip install 'flax-ensembles[bench]' (or pip install mnist1d)"


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

    >>> from ensembles.benchmark.quality.classification.mnist1d import load_quality_data
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
    (:func:`load_mnist1d_harsh_data`) share:
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


@functools.lru_cache(maxsize=4)
def load_mnist1d_harsh_data(
    *, num_train: int = 8000, num_test: int = 2000, num_shifted: int = 1000
) -> QualityData:
    """MNIST-1D from other seeds, shifted harder: kept aside to check defaults.

    As :func:`load_quality_data` (the same sizes, families and
    out-of-distribution sets), but the train and test examples come from seed
    4242 (not 42), each shifted set from seed ``5000 + 10 * severity + family
    index`` (not 1000 + ...), the shuffled sequences from 4999 and the noise
    from 4998, and the shifts are :data:`HARSH_SHIFTS`.
    Cached per size (the arrays are shared: do not write to them).

    >>> from ensembles.benchmark.quality.classification.mnist1d import (
    ...     load_mnist1d_harsh_data)
    >>> data = load_mnist1d_harsh_data(num_train=100, num_test=50, num_shifted=20)
    >>> data.name, data.x_train.shape, data.shifted[5]["shear"][0].shape
    ('mnist1d_harsh', (100, 40), (20, 40))

    Args:
      num_train: training examples, a multiple of 10.
      num_test: test examples and examples per out-of-distribution set, a
        multiple of 10.
      num_shifted: examples per shift family and severity, a multiple of 10.

    Returns:
      The :class:`~ensembles.benchmark.quality.data.QualityData`.
    """
    return mnist1d_sets(
        num_train,
        num_test,
        num_shifted,
        shifts=HARSH_SHIFTS,
        seeds=(4242, 5000, 4999, 4998),
        name="mnist1d_harsh",
    )
