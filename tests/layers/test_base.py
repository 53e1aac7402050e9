"""What every weight layer shares (layers/base.py): promote_dtype and views.

* A custom ``promote_dtype`` written to Flax's contract (it takes and returns
  ``(inputs, kernel, bias)``) works after conversion, in every weight layer,
  and gives what the Flax layer gives.
* ``nnx.view(model, impl=...)`` on a model mixing dense and conv layers sets
  the implementation where a layer has it and leaves the rest; a name no op
  knows raises.
* A member view takes one example without a batch axis wherever the Flax layer
  does (``[in]`` for Linear, ``[*spatial, in]`` for Conv...), and gives what
  the Flax layer holding the member's weights gives; what no Flax layer takes
  is refused with "add a batch axis", never with ``ensembles.tile``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from tests.models import ONES, random_input
from tests.tolerances import assert_close

CALLS = []


def promote_to_bfloat16(args, /, *, dtype=None, inexact=True):
    """A promote_dtype of Flax's contract that computes in bfloat16."""
    _inputs, _kernel, _bias = args  # fails on anything but the 3-tuple
    CALLS.append(dtype)
    return tuple(None if a is None else jnp.asarray(a, jnp.bfloat16) for a in args)


def _layers(rngs):
    kw = {"promote_dtype": promote_to_bfloat16, "rngs": rngs}
    return {
        "linear": (nnx.Linear(4, 3, **kw), (6, 4)),
        "linear_general": (nnx.LinearGeneral(4, (2, 3), **kw), (6, 4)),
        "conv": (nnx.Conv(4, 3, (3,), **kw), (6, 5, 4)),
        "conv_transpose": (nnx.ConvTranspose(4, 3, (3,), **kw), (6, 5, 4)),
        "einsum": (nnx.Einsum("bd,dh->bh", (4, 3), (3,), **kw), (6, 4)),
    }


@pytest.mark.parametrize(
    "name", ["linear", "linear_general", "conv", "conv_transpose", "einsum"]
)
def test_a_flax_contract_promote_dtype_survives_conversion(name):
    flax_layer, shape = _layers(nnx.Rngs(0))[name]
    model = nnx.Sequential(flax_layer)
    ensemble = ensembles.to_batch_ensemble(
        model, num_members=2, rngs=nnx.Rngs(1), **ONES
    )
    converted = ensemble.layers[0]
    assert converted.promote_dtype is promote_to_bfloat16
    x = random_input(0, shape)
    CALLS.clear()
    y = ensemble(ensembles.tile(x, 2))
    assert CALLS == [None]
    assert y.dtype == jnp.bfloat16
    expected = flax_layer(x)
    assert expected.dtype == jnp.bfloat16
    for k in range(2):
        assert_close(y[k * 6 : (k + 1) * 6], expected, dtype=jnp.bfloat16)
    # ... and member views and the extracted member too.
    assert_close(nnx.view(ensemble, member=1)(x), expected, dtype=jnp.bfloat16)
    assert_close(ensembles.extract_member(ensemble, 1)(x), expected, jnp.bfloat16)


def test_promote_dtype_casts_the_fast_weights_to_the_kernel_dtype():
    layer = ensembles.BatchEnsembleLinear(
        4, 3, num_members=2, promote_dtype=promote_to_bfloat16, rngs=nnx.Rngs(0)
    )
    x = random_input(0, (4, 4))
    kernel = np.asarray(layer.kernel[...].astype(jnp.bfloat16), np.float32)
    r = np.asarray(layer.r[...].astype(jnp.bfloat16), np.float32)
    s = np.asarray(layer.s[...].astype(jnp.bfloat16), np.float32)
    xb = np.asarray(x.astype(jnp.bfloat16), np.float32)
    expected = np.concatenate(
        [xb[2 * k : 2 * k + 2] @ (kernel * np.outer(r[k], s[k])) for k in range(2)]
    )
    y = layer(x)
    assert y.dtype == jnp.bfloat16
    assert_close(y, expected, dtype=jnp.bfloat16)


class MixedModel(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        self.transpose = nnx.ConvTranspose(4, 4, (3, 3), rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.transpose(self.conv(x)).mean(axis=(1, 2)))


def test_a_whole_model_impl_view_sets_what_each_layer_supports():
    model = ensembles.to_batch_ensemble(
        MixedModel(nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(1)
    )
    view = nnx.view(model, impl="pallas")
    assert view.head.impl == "pallas"
    assert view.conv.impl == model.conv.impl
    assert view.transpose.impl == model.transpose.impl
    xla = nnx.view(model, impl="xla")
    assert {xla.head.impl, xla.conv.impl, xla.transpose.impl} == {"xla"}
    x = ensembles.tile(random_input(0, (3, 6, 6, 3)), 2)
    np.testing.assert_array_equal(xla(x), model(x))


def test_an_impl_no_op_knows_raises_and_changes_nothing():
    model = ensembles.to_batch_ensemble(
        MixedModel(nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(1)
    )
    before = (model.head.impl, model.conv.impl)
    with pytest.raises(ValueError, match=r"`impl` must be one of .*got 'palas'"):
        nnx.view(model, impl="palas")
    assert (model.head.impl, model.conv.impl) == before


# ----------------------------------------------------- one unbatched example
# Issue 41 (4): Flax's layers take one example without a batch axis; a member
# view refused it and advised `ensembles.tile`, which a member view never needs.

E = 3


def _with_random_fast_weights(layer, seed):
    """Fast weights and bias far from 1 and 0, so a wrong member shows."""
    rng = np.random.default_rng(seed)
    for name in ["r", "s", "bias", "scale"]:
        variable = getattr(layer, name, None)
        if variable is not None:
            values = rng.uniform(0.5, 1.5, variable.shape).astype(np.float32)
            variable[...] = jnp.asarray(values)
    return layer


ONE_EXAMPLE = {
    # name: (layer, one example's shape): the Flax layer takes that shape.
    "linear": (
        lambda r: ensembles.BatchEnsembleLinear(4, 3, num_members=E, rngs=r),
        (4,),
    ),
    "linear_general": (
        lambda r: ensembles.BatchEnsembleLinearGeneral(
            4, (2, 3), num_members=E, rngs=r
        ),
        (4,),
    ),
    "linear_general_two_axes": (
        lambda r: ensembles.BatchEnsembleLinearGeneral(
            (2, 4), 3, axis=(-2, -1), num_members=E, rngs=r
        ),
        (2, 4),
    ),
    "conv_1d": (
        lambda r: ensembles.BatchEnsembleConv(4, 3, (3,), num_members=E, rngs=r),
        (7, 4),
    ),
    "conv_2d_strided": (
        lambda r: ensembles.BatchEnsembleConv(
            4, 3, (3, 3), strides=2, padding="VALID", num_members=E, rngs=r
        ),
        (7, 6, 4),
    ),
    "conv_transpose": (
        lambda r: ensembles.BatchEnsembleConvTranspose(
            4, 3, (3, 3), strides=2, num_members=E, rngs=r
        ),
        (5, 6, 4),
    ),
    "layer_norm": (
        lambda r: ensembles.EnsembleLayerNorm(4, num_members=E, rngs=r),
        (4,),
    ),
    "rms_norm": (lambda r: ensembles.EnsembleRMSNorm(4, num_members=E, rngs=r), (4,)),
    "batch_norm_eval": (
        lambda r: ensembles.EnsembleBatchNorm(
            4, num_members=E, use_running_average=True, rngs=r
        ),
        (4,),
    ),
}


@pytest.mark.parametrize("name", ONE_EXAMPLE)
def test_a_member_view_takes_one_example_as_the_flax_layer_does(name):
    make, shape = ONE_EXAMPLE[name]
    layer = _with_random_fast_weights(make(nnx.Rngs(0)), seed=1)
    if name == "batch_norm_eval":
        layer.mean[...] = jnp.asarray(np.random.default_rng(2).normal(size=(E, 4)))
    x = random_input(3, shape)
    for k in range(E):
        flax_layer = layer.extract_member(k)
        expected = flax_layer(x)  # Flax takes the example as it is
        actual = nnx.view(layer, member=k)(x)
        assert actual.shape == expected.shape, (k, actual.shape, expected.shape)
        assert_close(actual, expected, err_msg=f"member {k}")
        # ... and gives what a batch of one gives, without its batch axis.
        assert_close(actual, nnx.view(layer, member=k)(x[None])[0])


def test_a_member_view_of_one_example_under_jit_and_grad():
    layer = _with_random_fast_weights(
        ensembles.BatchEnsembleConv(4, 3, (3,), num_members=E, rngs=nnx.Rngs(0)), 1
    )
    x = random_input(3, (7, 4))
    flax_layer = layer.extract_member(2)

    @nnx.jit
    def loss(layer, x):
        return jnp.sum(nnx.view(layer, member=2)(x) ** 2)

    assert_close(loss(layer, x), jnp.sum(flax_layer(x) ** 2))
    grad = nnx.grad(loss, argnums=1)(layer, x)
    assert_close(grad, jax.grad(lambda x: jnp.sum(flax_layer(x) ** 2))(x))


def test_the_whole_ensemble_still_needs_the_member_axis():
    layer = ensembles.BatchEnsembleLinear(4, 3, num_members=E, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"tile it with `ensembles.tile\(inputs, 3\)`"):
        layer(jnp.ones(4))


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda r: ensembles.BatchEnsembleLinear(4, 3, num_members=E, rngs=r), ()),
        (
            lambda r: ensembles.BatchEnsembleConv(4, 3, (3, 3), num_members=E, rngs=r),
            (5, 4),
        ),
        (
            lambda r: ensembles.BatchEnsembleLinearGeneral(
                (2, 4), 3, axis=(1, 2), num_members=E, rngs=r
            ),
            (2, 4),
        ),
    ],
    ids=["linear-scalar", "conv_2d-one-row", "linear_general-positive-axes"],
)
def test_what_no_flax_layer_takes_is_refused_with_add_a_batch_axis_only(make, shape):
    view = nnx.view(make(nnx.Rngs(0)), member=1)
    with pytest.raises(ValueError) as error:
        view(jnp.ones(shape))
    assert "tile" not in str(error.value)


def test_einsum_takes_the_rank_its_string_names_as_nnx_einsum():
    layer = ensembles.BatchEnsembleEinsum(
        "btd,dh->bth", (4, 3), num_members=E, rngs=nnx.Rngs(0)
    )
    with pytest.raises(
        ValueError, match=r"names 3 input axes, but the inputs have 2"
    ) as error:
        nnx.view(layer, member=1)(jnp.ones((5, 4)))
    assert "tile" not in str(error.value)
    with pytest.raises(ValueError):
        layer.extract_member(1)(jnp.ones((5, 4)))  # Flax refuses it too
