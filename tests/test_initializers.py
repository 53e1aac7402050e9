import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ensembles import initializers


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ones(dtype):
    w = initializers.ones()(jax.random.key(0), (3, 4), dtype)
    assert w.dtype == dtype
    np.testing.assert_array_equal(w, np.ones((3, 4)))


@pytest.mark.parametrize("mean, stddev", [(1.0, 0.5), (0.0, 2.0), (-3.0, 0.1)])
def test_normal_moments(mean, stddev):
    w = initializers.normal(mean, stddev)(jax.random.key(1), (200, 500))
    assert w.shape == (200, 500) and w.dtype == jnp.float32
    np.testing.assert_allclose(float(w.mean()), mean, atol=0.01 * max(stddev, 1))
    np.testing.assert_allclose(float(w.std()), stddev, rtol=0.01)


def test_normal_zero_stddev_is_constant():
    w = initializers.normal(2.0, 0.0)(jax.random.key(0), (5,))
    np.testing.assert_array_equal(w, 2.0)


def test_normal_default_is_the_layers_default():
    from ensembles.layers.parameters import default_fast_weight_init

    key = jax.random.key(3)
    expected = initializers.normal(1.0, 0.5)(key, (7,))
    np.testing.assert_array_equal(initializers.normal()(key, (7,)), expected)
    np.testing.assert_array_equal(default_fast_weight_init(key, (7,)), expected)


@pytest.mark.parametrize("p", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_random_sign(p):
    w = np.asarray(initializers.random_sign(p)(jax.random.key(2), (100_000,)))
    assert set(np.unique(w)) <= {-1.0, 1.0}
    np.testing.assert_allclose((w == 1).mean(), p, atol=0.01)


def test_random_sign_dtype():
    w = initializers.random_sign()(jax.random.key(0), (4,), jnp.bfloat16)
    assert w.dtype == jnp.bfloat16


def test_keys_matter():
    init = initializers.normal()
    assert not np.allclose(init(jax.random.key(0), (8,)), init(jax.random.key(1), (8,)))


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_random_sign_rejects_bad_probability(p):
    with pytest.raises(ValueError, match=r"`p` must be a probability in \[0, 1\]"):
        initializers.random_sign(p)


@pytest.mark.parametrize("stddev", [-1.0, float("nan")])
def test_normal_rejects_bad_stddev(stddev):
    with pytest.raises(ValueError, match=r"`stddev` must be >= 0"):
        initializers.normal(1.0, stddev)
