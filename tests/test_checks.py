"""Options take any real scalar Flax takes: numpy and JAX scalars included.

``prior_stddev=np.float32(0.1)`` was refused ("must be a float") where Flax
accepts such scalars (``nnx.Dropout(np.float32(0.1))``). Every option that asks
for a number or an int is tried with numpy and 0-d JAX values and must give
what the Python value gives; bools, strings, complex numbers and arrays stay
refused.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from ensembles import initializers
from ensembles._checks import check_positive_int, check_real
from ensembles.experimental.pallas import BlockSizes
from ensembles.ops import batch_ensemble_dense_general
from tests.models import MLP

REALS = [0.25, np.float32(0.25), np.float64(0.25), jnp.float32(0.25), np.array(0.25)]
INTS = [3, np.int64(3), np.int32(3), np.uint8(3), jnp.array(3)]


@pytest.mark.parametrize("value", REALS, ids=lambda v: type(v).__name__)
def test_check_real_accepts_real_scalars(value):
    assert check_real(value, "x") == 0.25
    assert type(check_real(value, "x")) is float
    assert check_real(np.int16(2), "x") == 2.0


@pytest.mark.parametrize(
    "value",
    [True, np.bool_(True), "0.1", 1j, np.array([0.1, 0.2]), None, jnp.array(True)],
    ids=repr,
)
def test_check_real_refuses_what_is_not_one_real_number(value):
    with pytest.raises(TypeError, match=r"`x` must be a real number.*got"):
        check_real(value, "x")


def test_check_real_refuses_a_traced_value():
    with pytest.raises(TypeError, match=r"`x` must be a concrete number"):
        jax.jit(lambda v: check_real(v, "x"))(jnp.float32(0.1))


@pytest.mark.parametrize("value", INTS, ids=lambda v: type(v).__name__)
def test_check_positive_int_accepts_integer_scalars(value):
    assert check_positive_int(value, "n") == 3
    assert type(check_positive_int(value, "n")) is int


@pytest.mark.parametrize("value", REALS[1:], ids=lambda v: type(v).__name__)
def test_prior_stddev_takes_numpy_and_jax_scalars(value):
    layer = ensembles.BatchEnsembleLinear(
        3, 2, num_members=2, posterior="gaussian", prior_stddev=value, rngs=nnx.Rngs(0)
    )
    python = ensembles.BatchEnsembleLinear(
        3, 2, num_members=2, posterior="gaussian", prior_stddev=0.25, rngs=nnx.Rngs(0)
    )
    assert layer.prior_stddev == 0.25 and type(layer.prior_stddev) is float
    assert float(ensembles.kl_divergence(layer)) == float(
        ensembles.kl_divergence(python)
    )
    model = ensembles.to_batch_ensemble(
        MLP(nnx.Rngs(0)),
        num_members=2,
        posterior="cauchy",
        prior_stddev=value,
        rngs=nnx.Rngs(1),
    )
    assert model.inp.prior_stddev == 0.25


@pytest.mark.parametrize(
    "make",
    [
        lambda v: initializers.normal(v, v),
        lambda v: initializers.random_sign(v),
        lambda v: initializers.unconstrained_stddev(v, jitter=v),
    ],
    ids=["normal", "random_sign", "unconstrained_stddev"],
)
def test_initializers_take_numpy_and_jax_scalars(make):
    key = jax.random.key(0)
    expected = make(0.25)(key, (3, 4))
    for value in REALS[1:]:
        np.testing.assert_array_equal(make(value)(key, (3, 4)), expected)
    with pytest.raises(TypeError, match=r"must be a real number"):
        make("0.25")


def test_integer_options_take_numpy_and_jax_ints():
    x = ensembles.tile(jnp.ones((2, 8, 8, 3)), 2)
    python = ensembles.BatchEnsembleConv(
        3, 4, (3, 3), strides=2, num_members=2, rngs=nnx.Rngs(0)
    )
    for n in INTS[1:]:
        layer = ensembles.BatchEnsembleConv(
            3, 4, (n, n), strides=n - 1, num_members=n - 1, rngs=nnx.Rngs(0)
        )
        np.testing.assert_array_equal(layer(x), python(x))
        one = ensembles.BatchEnsembleConv(
            3, 4, n, num_members=2, rngs=nnx.Rngs(0)
        )  # a 1-D kernel of size n
        assert one.kernel_size == (3,)
    assert BlockSizes(block_b=np.int64(64)).block_b == 64
    assert type(BlockSizes(block_b=np.int64(64)).block_b) is int
    inputs = jnp.ones((4, 2, 3))
    y = batch_ensemble_dense_general(
        inputs,
        jnp.ones((2, 3, 5)),
        jnp.ones((2, 3)),
        jnp.ones((2, 5)),
        num_members=2,
        axis=-1,
        num_batch_axes=np.int64(1),
    )
    assert y.shape == (4, 2, 5)


def test_deterministic_takes_a_numpy_bool():
    layer = ensembles.BatchEnsembleLinear(
        3, 2, num_members=2, posterior="gaussian", rngs=nnx.Rngs(0)
    )
    x = jnp.ones((4, 3))
    np.testing.assert_array_equal(
        layer(x, deterministic=np.True_), layer(x, deterministic=True)
    )
    assert nnx.view(layer, deterministic=np.True_).deterministic is True
