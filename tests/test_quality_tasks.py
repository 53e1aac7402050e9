"""Tests of the quality benchmark's extra tasks (digits, tabular, harsh MNIST-1D)."""

import dataclasses
import random

import jax
import numpy as np
import pytest

from ensembles.benchmark.quality.classification.mnist1d import (
    HARSH_SHIFTS,
    SHIFTS,
    load_mnist1d_harsh_data,
    load_quality_data,
)
from ensembles.benchmark.quality.classification.real_tasks import (
    REAL_CLASSIFICATION_TASKS,
)
from ensembles.benchmark.quality.classification.tasks import (
    DIGITS_SHIFTS,
    TABULAR_SHIFTS,
    load_digits_data,
    load_tabular_data,
)
from ensembles.benchmark.quality.data import SEVERITIES
from ensembles.benchmark.quality.regression.tasks import REGRESSION_TASKS
from ensembles.benchmark.quality.tasks import TASKS, load_task

pytest.importorskip("sklearn")

SMALL = {"num_train": 200, "num_test": 100, "num_shifted": 30}

# name: (loader, families, example shape, classes, sizes (train, test, shifted,
# ood), ood names)
SKLEARN_TASKS = {
    "digits": (
        load_digits_data,
        DIGITS_SHIFTS,
        (8, 8),
        10,
        (1197, 600, 600, 600),
        {"inverted", "noise", "rectangles"},
    ),
    "tabular": (
        load_tabular_data,
        TABULAR_SHIFTS,
        (20,),
        5,
        (6000, 2000, 1000, 2000),
        {"other_generator", "uniform"},
    ),
}


def _arrays(data):
    leaves = jax.tree.leaves(dataclasses.asdict(data))
    return [leaf for leaf in leaves if isinstance(leaf, np.ndarray)]  # not name


def _flat(x):
    return x.reshape(len(x), -1)


@pytest.fixture(scope="module")
def classifiers():
    """A LogisticRegression per scikit-learn task, fitted on its train set."""
    from sklearn.linear_model import LogisticRegression

    fitted = {}
    for name, (loader, *_) in SKLEARN_TASKS.items():
        data = loader()
        fitted[name] = LogisticRegression(max_iter=1000).fit(
            _flat(data.x_train), data.y_train
        )
    return fitted


@pytest.mark.parametrize("name", sorted(SKLEARN_TASKS))
def test_shapes_dtypes_labels_and_sets(name):
    loader, families, shape, classes, sizes, ood_names = SKLEARN_TASKS[name]
    num_train, num_test, num_shifted, num_ood = sizes
    data = loader()
    assert data.name == name
    assert data.x_train.shape == (num_train, *shape)
    assert data.x_test.shape == (num_test, *shape)
    assert data.y_train.shape == (num_train,) and data.y_test.shape == (num_test,)
    assert set(np.unique(data.y_train)) == set(range(classes))
    assert set(np.unique(data.y_test)) == set(range(classes))
    assert sorted(data.shifted) == list(SEVERITIES)
    for level in data.shifted.values():
        assert list(level) == list(families)
        for x, y in level.values():
            assert x.shape == (num_shifted, *shape) and y.shape == (num_shifted,)
            assert x.dtype == np.float32 and y.dtype == np.int32
            assert y.min() >= 0 and y.max() < classes
    assert set(data.ood) == ood_names
    for x in data.ood.values():
        assert x.shape == (num_ood, *shape)
    for array in _arrays(data):
        if array.dtype.kind == "f":
            assert array.dtype == np.float32 and np.isfinite(array).all()
        else:
            assert array.dtype == np.int32
    for x in (data.x_train, data.x_test):
        assert x.dtype == np.float32 and data.y_train.dtype == np.int32


def test_digits_are_images_in_the_unit_interval_with_clean_shift_labels():
    data = load_digits_data()
    for array in _arrays(data):
        if array.dtype.kind == "f":
            assert array.min() >= 0.0 and array.max() <= 1.0
    for level in data.shifted.values():  # the test images, corrupted
        for _, y in level.values():
            np.testing.assert_array_equal(y, data.y_test)
    np.testing.assert_array_equal(data.ood["inverted"], 1.0 - data.x_test)


def test_tabular_is_standardised_with_the_train_statistics():
    data = load_tabular_data()
    np.testing.assert_allclose(data.x_train.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(data.x_train.std(axis=0), 1.0, atol=1e-4)
    assert np.abs(data.ood["uniform"]).max() <= 4.0
    # Fresh examples per shifted set, not the test examples: dropout keeps the
    # values it does not zero, and (but for float32 coincidences) none of them
    # is a test or train value.
    kept = data.shifted[1]["dropout"][0]
    kept = kept[kept != 0]
    assert kept.size > 0.9 * data.shifted[1]["dropout"][0].size
    assert np.isin(kept, data.x_test).mean() < 0.01
    assert np.isin(kept, data.x_train).mean() < 0.01


@pytest.mark.parametrize("name", sorted(SKLEARN_TASKS))
def test_deterministic_and_cached(name):
    loader = SKLEARN_TASKS[name][0]
    assert loader() is loader()  # cached
    fresh = loader.__wrapped__()  # bypasses the cache
    for a, b in zip(_arrays(loader()), _arrays(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    other = loader.__wrapped__(seed=1)
    assert not np.array_equal(other.x_test, fresh.x_test)


@pytest.mark.parametrize("name", sorted(SKLEARN_TASKS))
def test_every_family_degrades_with_severity(name, classifiers):
    data, model = SKLEARN_TASKS[name][0](), classifiers[name]
    clean = model.score(_flat(data.x_test), data.y_test)
    for family in data.shifted[1]:
        accuracy = [
            model.score(_flat(data.shifted[s][family][0]), data.shifted[s][family][1])
            for s in SEVERITIES
        ]
        assert accuracy[0] < clean + 0.02, (family, accuracy)
        assert accuracy[-1] < accuracy[0] - 0.05, (family, accuracy)
        assert accuracy[-1] < clean - 0.1, (family, accuracy)


def _moments_distance(a, b):
    """Mean absolute difference of the per-feature means and covariances."""
    a, b = _flat(a).astype(np.float64), _flat(b).astype(np.float64)
    means = np.abs(a.mean(axis=0) - b.mean(axis=0)).mean()
    return means + np.abs(np.cov(a.T) - np.cov(b.T)).mean()


@pytest.mark.parametrize("name", sorted(SKLEARN_TASKS))
def test_ood_sets_differ_from_the_test_distribution(name):
    data = SKLEARN_TASKS[name][0]()
    baseline = _moments_distance(data.x_train, data.x_test)
    for ood, x in data.ood.items():
        assert _moments_distance(data.x_test, x) > 5 * baseline, ood


def test_digits_ood_gets_less_confident_predictions(classifiers):
    data, model = load_digits_data(), classifiers["digits"]
    confidence = model.predict_proba(_flat(data.x_test)).max(axis=1).mean()
    for ood, x in data.ood.items():
        assert model.predict_proba(_flat(x)).max(axis=1).mean() < confidence - 0.1, ood


def test_harsh_levels_are_stronger_than_the_standard_ones():
    assert list(HARSH_SHIFTS) == list(SHIFTS)
    for family, (argument, levels) in HARSH_SHIFTS.items():
        standard_argument, standard = SHIFTS[family]
        assert argument == standard_argument
        assert list(levels) == sorted(levels) and len(set(levels)) == len(levels)
        assert all(h >= s for h, s in zip(levels, standard, strict=True))
        assert levels[0] >= standard[2]
        if family == "translation":  # saturates at the padded length, 72
            assert levels[-1] == standard[-1] == 72
        else:
            assert levels[-1] > standard[-1]


def test_harsh_mnist1d_uses_other_seeds():
    pytest.importorskip("mnist1d")
    harsh = load_mnist1d_harsh_data(**SMALL)
    standard = load_quality_data(**SMALL)
    assert harsh.name == "mnist1d_harsh" and standard.name == "mnist1d"
    assert harsh.x_train.shape == standard.x_train.shape == (200, 40)
    assert harsh.x_train.dtype == np.float32 and harsh.y_train.dtype == np.int32
    assert not np.array_equal(harsh.x_test, standard.x_test)
    assert not np.array_equal(harsh.ood["noise"], standard.ood["noise"])
    assert sorted(harsh.shifted) == list(SEVERITIES)
    for severity in SEVERITIES:
        assert list(harsh.shifted[severity]) == list(SHIFTS)
    fresh = load_mnist1d_harsh_data.__wrapped__(**SMALL)
    for a, b in zip(_arrays(harsh), _arrays(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="multiple of 10"):
        load_mnist1d_harsh_data(num_train=105)


def test_loading_leaves_the_global_random_state_alone():
    np.random.seed(123)  # noqa: NPY002 (the global state checked below)
    random.seed(123)
    numpy_state = np.random.get_state()  # noqa: NPY002
    python_state = random.getstate()
    load_digits_data.__wrapped__()
    load_tabular_data.__wrapped__()
    try:
        import mnist1d  # noqa: F401
    except ImportError:
        pass
    else:
        load_mnist1d_harsh_data.__wrapped__(**SMALL)
    assert random.getstate() == python_state
    restored = np.random.get_state()  # noqa: NPY002
    np.testing.assert_array_equal(restored[1], numpy_state[1])
    assert restored[2:] == numpy_state[2:]


def test_load_task():
    assert set(TASKS) == {"mnist1d", "digits", "tabular", "mnist1d_harsh"} | set(
        REAL_CLASSIFICATION_TASKS
    ) | set(REGRESSION_TASKS)
    assert not any(load_task(name).regression for name in ("digits", "tabular"))
    assert TASKS["mnist1d"] is load_quality_data
    assert load_task("digits") is load_digits_data()
    assert load_task("tabular", quick=True) is load_tabular_data()
    with pytest.raises(ValueError, match=r"unknown task 'cifar'.*cubic, digits"):
        load_task("cifar")


@pytest.mark.slow
def test_load_task_quick_mnist1d():
    pytest.importorskip("mnist1d")
    for name in ("mnist1d", "mnist1d_harsh"):
        data = load_task(name, quick=True)
        assert data.name == name
        assert data.x_train.shape == (2000, 40) and data.x_test.shape == (500, 40)
        assert data.shifted[3]["scale"][0].shape == (200, 40)
