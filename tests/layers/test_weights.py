"""What the five weight layers share (``ensembles.layers.weights``), tested once.

Each case builds one weight layer through its own constructor or ``from_*``,
so what is tested is the shared construction as every layer calls it: the
options' checks, the parameters' types, shapes and draws, the posterior's
scales and stream, and the conversion's kernel, bias and dtypes.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from ensembles.variables import FastWeight

E = 3

# name -> (BE layer factory, Flax layer factory, converter, r shape, s shape).
LAYERS = {
    "linear": (
        lambda **kw: ensembles.BatchEnsembleLinear(4, 2, **{"num_members": E, **kw}),
        lambda rngs: nnx.Linear(4, 2, rngs=rngs),
        "from_linear",
        (E, 4),
        (E, 2),
    ),
    "linear_general": (
        lambda **kw: ensembles.BatchEnsembleLinearGeneral(
            4, (2, 3), **{"num_members": E, **kw}
        ),
        lambda rngs: nnx.LinearGeneral(4, (2, 3), rngs=rngs),
        "from_linear_general",
        (E, 4),
        (E, 2, 3),
    ),
    "einsum": (
        lambda **kw: ensembles.BatchEnsembleEinsum(
            "bi,io->bo", (4, 2), (2,), **{"num_members": E, **kw}
        ),
        lambda rngs: nnx.Einsum("bi,io->bo", (4, 2), (2,), rngs=rngs),
        "from_einsum",
        (E, 4),
        (E, 2),
    ),
    "conv": (
        lambda **kw: ensembles.BatchEnsembleConv(
            4, 2, (3,), **{"num_members": E, **kw}
        ),
        lambda rngs: nnx.Conv(4, 2, (3,), rngs=rngs),
        "from_conv",
        (E, 4),
        (E, 2),
    ),
    "conv_transpose": (
        lambda **kw: ensembles.BatchEnsembleConvTranspose(
            4, 2, (3,), **{"num_members": E, **kw}
        ),
        lambda rngs: nnx.ConvTranspose(4, 2, (3,), rngs=rngs),
        "from_conv_transpose",
        (E, 4),
        (E, 2),
    ),
}
NAMES = pytest.mark.parametrize("name", list(LAYERS))


def _params_count(rngs):
    return int(rngs.params.count[...])


@NAMES
@pytest.mark.parametrize("posterior", [None, "gaussian"])
def test_parameters_types_shapes_and_draws(name, posterior):
    make, _, _, r_shape, s_shape = LAYERS[name]
    rngs = nnx.Rngs(0)
    layer = make(rngs=rngs, posterior=posterior)
    assert type(layer.kernel) is nnx.Param
    assert type(layer.r) is FastWeight and layer.r.shape == r_shape
    assert type(layer.s) is FastWeight and layer.s.shape == s_shape
    assert type(layer.bias) is nnx.Param and layer.bias.shape[0] == E
    # kernel, r, s, bias; with a posterior two scales more, and a fork of
    # the (here: default) stream.
    assert _params_count(rngs) == (7 if posterior else 4)
    if posterior is None:
        for attribute in ("r_unconstrained_stddev", "s_unconstrained_stddev", "rngs"):
            assert getattr(layer, attribute) is None
        return
    assert type(layer.r_unconstrained_stddev) is FastWeight
    assert layer.r_unconstrained_stddev.shape == r_shape
    assert layer.s_unconstrained_stddev.shape == s_shape
    assert isinstance(layer.rngs, nnx.RngStream)


@NAMES
def test_a_failed_constructor_draws_nothing(name):
    make = LAYERS[name][0]
    rngs = nnx.Rngs(0)

    def wrong_shape(key, shape, dtype):
        return jnp.ones((1,), dtype)

    with pytest.raises(ValueError, match=r"`s_init` returned an array of shape"):
        make(rngs=rngs, s_init=wrong_shape)
    assert _params_count(rngs) == 0
    # And a retry draws what a first try would.
    np.testing.assert_array_equal(
        make(rngs=rngs).kernel[...], make(rngs=nnx.Rngs(0)).kernel[...]
    )


@NAMES
@pytest.mark.parametrize(
    "option, value, error, match",
    [
        ("num_members", 0, ValueError, r"`num_members` must be an int >= 1"),
        ("impl", "auto", ValueError, r"`impl` must be one of"),
        ("posterior", "laplace", ValueError, r"`posterior` must be None"),
        ("prior_stddev", -1.0, ValueError, r"`prior_stddev` must be a finite"),
        ("deterministic", "yes", TypeError, r"`deterministic` must be a bool"),
        ("rng_collection", "", ValueError, r"`rng_collection` must name"),
    ],
)
def test_every_common_option_is_checked_and_named(name, option, value, error, match):
    make = LAYERS[name][0]
    rngs = nnx.Rngs(0)
    with pytest.raises(error, match=match):
        make(rngs=rngs, **{option: value})
    assert _params_count(rngs) == 0


@NAMES
@pytest.mark.parametrize("share_kernel", [False, True])
def test_from_flax_layer_keeps_kernel_bias_and_dtypes(name, share_kernel):
    _, make_flax, method, _, _ = LAYERS[name]
    flax_layer = make_flax(nnx.Rngs(0))
    # A model cast after it was built keeps a stale param_dtype: the layer
    # takes the dtype its parameters are held in.
    flax_layer.kernel = nnx.Param(flax_layer.kernel[...].astype(jnp.bfloat16))
    flax_layer.bias = nnx.Param(flax_layer.bias[...] + 1.0)
    convert = getattr(type(LAYERS[name][0](rngs=nnx.Rngs(0))), method)
    layer = convert(
        flax_layer, num_members=E, rngs=nnx.Rngs(1), share_kernel=share_kernel
    )
    assert (layer.kernel is flax_layer.kernel) is share_kernel
    np.testing.assert_array_equal(layer.kernel[...], flax_layer.kernel[...])
    assert layer.param_dtype == jnp.bfloat16 and layer.r.dtype == jnp.bfloat16
    for k in range(E):
        np.testing.assert_array_equal(
            layer.bias[k].reshape(-1), flax_layer.bias[...].reshape(-1)
        )
    assert layer.promote_dtype is flax_layer.promote_dtype
    assert layer.preferred_element_type == flax_layer.preferred_element_type
