"""Labels of every integer dtype mean what their values mean.

A label's dtype must never change the answer: ``uint8`` labels of a 256-class
problem once read as class 0 (``labels >= 256`` cast 256 to ``uint8``), and
``int8``/``int16`` labels of wide problems gave wrong losses and NaN metrics.
Every function that takes labels is compared with its int32 answer and with a
float64 numpy reference, eager and jitted.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ensembles
from ensembles import uncertainty

# (dtype, number of classes): the widest class count each dtype can index,
# so the largest label is the dtype's edge (255 for uint8, 127 for int8).
CASES = [
    (np.uint8, 256),
    (np.int8, 128),
    (np.int16, 30000),
    (np.uint16, 40000),
    (np.int32, 300),
    (np.uint32, 300),
    (np.int64, 300),
    (np.uint64, 300),
]
METRICS = {
    "nll": uncertainty.nll,
    "accuracy": uncertainty.accuracy,
    "brier": uncertainty.brier,
    "ece": uncertainty.ece,
}


def _labels(dtype, num_classes):
    return np.array([0, 5, num_classes - 1, 1], dtype)


def _logits(num_members, num_classes, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(num_members, 4, num_classes)).astype(np.float32)
    # Make the top class of every example its label, so accuracy is not 0.
    logits[:, [0, 1, 2, 3], [0, 5, num_classes - 1, 1]] += 8.0
    return logits


def _ref_cross_entropy(logits, labels):
    x = np.asarray(logits, np.float64)
    log_probs = x - x.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    rows = np.arange(x.shape[1])
    return -np.mean(log_probs[:, rows, labels.astype(np.int64)])


@pytest.mark.parametrize(("dtype", "num_classes"), CASES)
def test_cross_entropy_of_every_integer_dtype(dtype, num_classes):
    logits = _logits(2, num_classes)
    labels = _labels(dtype, num_classes)
    expected = _ref_cross_entropy(logits, labels)
    int32 = ensembles.training.cross_entropy(
        logits, labels.astype(np.int32), num_members=2
    )
    eager = ensembles.training.cross_entropy(logits, labels, num_members=2)
    jitted = jax.jit(
        lambda lg, y: ensembles.training.cross_entropy(lg, y, num_members=2)
    )(logits, labels)
    np.testing.assert_allclose(float(int32), expected, rtol=1e-5)
    assert float(eager) == float(int32)
    assert float(jitted) == pytest.approx(float(int32), rel=1e-6)


@pytest.mark.parametrize(("dtype", "num_classes"), CASES)
@pytest.mark.parametrize("name", sorted(METRICS))
def test_metrics_of_every_integer_dtype(name, dtype, num_classes):
    metric = METRICS[name]
    logits = _logits(3, num_classes, seed=1)
    labels = _labels(dtype, num_classes)
    int32 = float(metric(logits, labels.astype(np.int32)))
    assert np.isfinite(int32)
    assert float(metric(logits, labels)) == int32
    assert float(jax.jit(metric)(logits, labels)) == pytest.approx(int32, rel=1e-6)


def test_nll_of_uint8_labels_matches_numpy():
    logits = _logits(2, 256, seed=2)
    labels = _labels(np.uint8, 256)
    x = logits.astype(np.float64)
    probs = np.exp(x - x.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = -np.mean(np.log(probs.mean(0)[np.arange(4), labels.astype(int)]))
    np.testing.assert_allclose(
        float(uncertainty.nll(logits, labels)), expected, rtol=1e-5
    )


def test_sixty_four_bit_labels_under_x64(x64):
    logits = _logits(2, 300).astype(np.float64)
    for dtype in (np.int64, np.uint64):
        labels = _labels(dtype, 300)
        expected = _ref_cross_entropy(logits, labels)
        jitted = jax.jit(
            lambda lg, y: ensembles.training.cross_entropy(lg, y, num_members=2)
        )(jnp.asarray(logits), jnp.asarray(labels))
        np.testing.assert_allclose(float(jitted), expected, rtol=1e-12)
        # A label of 2**32 + 3 is out of range: NaN, never class 3.
        big = jnp.asarray(np.array([0, 5, 2**32 + 3, 1], dtype))
        assert np.isnan(float(jax.jit(uncertainty.nll)(jnp.asarray(logits), big)))


def test_a_label_jax_would_truncate_is_refused_not_wrapped():
    # Without x64, jnp.asarray turns int64 2**32 + 3 into 3: checked first.
    labels = np.array([0, 5, 2**32 + 3, 1], np.int64)
    with pytest.raises(ValueError, match=r"labels\[2\] = 4294967299"):
        ensembles.training.cross_entropy(_logits(2, 10), labels, num_members=2)
    with pytest.raises(ValueError, match=r"labels\[2\] = 4294967299"):
        uncertainty.accuracy(_logits(2, 10), labels)


@pytest.mark.parametrize("name", ["cross_entropy", *sorted(METRICS)])
@pytest.mark.parametrize(
    "labels", [np.array([0.0, 1.0, 2.0, 1.0]), np.array([True, False, True, True])]
)
def test_non_integer_labels_are_refused(name, labels):
    logits = _logits(2, 10)
    if name == "cross_entropy":
        call = lambda: ensembles.training.cross_entropy(  # noqa: E731
            logits, labels, num_members=2
        )
    else:
        call = lambda: METRICS[name](logits, labels)  # noqa: E731
    match = f"integer class indices, got dtype {labels.dtype}"
    with pytest.raises(TypeError, match=match):
        call()
