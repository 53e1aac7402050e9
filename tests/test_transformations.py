"""Every layer under JAX's transformations, against its members as Flax layers.

The reference for a layer is the original Flax layer holding each member's
effective weights (``extract_member(k)``, itself tested against explicit
weights in the layer tests) applied to that member's rows: JAX's own rules
differentiate it. Both are functions of the layer's state and the inputs, so
tangents and cotangents flow to every parameter. float64 keeps the
comparison tight (1e-10); ``impl`` is the default.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles

E, B = 2, 2


def _init():
    return {
        "bias_init": nnx.initializers.normal(1.0),
        "rngs": nnx.Rngs(0),
    }


LAYERS = {
    "linear": (
        lambda: ensembles.BatchEnsembleLinear(5, 3, num_members=E, **_init()),
        (E * B, 2, 5),
    ),
    "linear_general": (
        lambda: ensembles.BatchEnsembleLinearGeneral(
            5, (2, 3), num_members=E, **_init()
        ),
        (E * B, 2, 5),
    ),
    "einsum": (
        lambda: ensembles.BatchEnsembleEinsum(
            "BTD,NDH->BTNH", (2, 5, 3), (2, 3), num_members=E, **_init()
        ),
        (E * B, 2, 5),
    ),
    "conv": (
        lambda: ensembles.BatchEnsembleConv(
            4, 3, (3, 3), num_members=E, padding="same", **_init()
        ),
        (E * B, 3, 3, 4),
    ),
    "conv_transpose": (
        lambda: ensembles.BatchEnsembleConvTranspose(
            4, 3, (3, 3), 2, num_members=E, **_init()
        ),
        (E * B, 3, 3, 4),
    ),
    "layer_norm": (
        lambda: ensembles.EnsembleLayerNorm(
            5,
            num_members=E,
            scale_init=nnx.initializers.normal(1.0),
            **_init(),
        ),
        (E * B, 2, 5),
    ),
    "rms_norm": (
        lambda: ensembles.EnsembleRMSNorm(
            5,
            num_members=E,
            scale_init=nnx.initializers.normal(1.0),
            rngs=nnx.Rngs(0),
        ),
        (E * B, 2, 5),
    ),
    "batch_norm": (
        lambda: ensembles.EnsembleBatchNorm(
            5,
            num_members=E,
            use_running_average=True,
            scale_init=nnx.initializers.normal(1.0),
            **_init(),
        ),
        (E * B, 2, 5),
    ),
}
WEIGHT_LAYERS = ["linear", "linear_general", "einsum", "conv", "conv_transpose"]


def _setup(name):
    """``(layer_fn, reference_fn, params, x)``; the functions take ``(params, x)``."""
    make, shape = LAYERS[name]
    layer = make()
    rng = np.random.default_rng(3)
    # float64 state with random fast weights around 1 (and running averages).
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    params = jax.tree.map(
        lambda a: jnp.asarray(
            np.asarray(a) + 0.3 * rng.standard_normal(a.shape), jnp.float64
        ),
        params,
    )
    rest = jax.tree.map(lambda a: jnp.asarray(np.abs(a) + 0.5, jnp.float64), rest)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float64)

    def layer_fn(params, x):
        return nnx.merge(graphdef, params, rest)(x)

    def reference_fn(params, x):
        module = nnx.merge(graphdef, params, rest)
        return jnp.concatenate(
            [module.extract_member(k)(x[k * B : (k + 1) * B]) for k in range(E)]
        )

    return layer_fn, reference_fn, params, x


def _close(actual, expected, rtol=1e-10, err_msg=""):
    leaves = jax.tree.leaves(expected)
    assert leaves, "nothing compared"
    assert jax.tree.structure(actual) == jax.tree.structure(expected), err_msg
    for a, b in zip(jax.tree.leaves(actual), leaves, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (err_msg, a, b)
        a, b = np.asarray(a), np.asarray(b)
        scale = max(np.max(np.abs(b), initial=0.0), 1e-30)
        assert np.max(np.abs(a - b), initial=0.0) <= rtol * scale, err_msg


def _tangents(tree, seed=5):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), tree
    )


# The quick tier runs a dense and a transposed-convolution layer; the slow
# tier every layer (the ops' own jvp tests run in the quick tier too).
@pytest.mark.parametrize(
    "name",
    [
        name
        if name in ("linear", "conv_transpose")
        else pytest.param(name, marks=pytest.mark.slow)
        for name in sorted(LAYERS)
    ],
)
def test_jvp_linearize_and_vjp(x64, name):
    layer_fn, reference_fn, params, x = _setup(name)
    tangents = _tangents((params, x))
    expected = jax.jit(jax.jvp, static_argnums=0)(reference_fn, (params, x), tangents)
    _close(jax.jvp(layer_fn, (params, x), tangents), expected, err_msg="jvp")
    _close(
        jax.jit(jax.jvp, static_argnums=0)(layer_fn, (params, x), tangents),
        expected,
        err_msg="jit(jvp)",
    )
    y, linear = jax.linearize(layer_fn, params, x)
    _close((y, jax.jit(linear)(*tangents)), expected, err_msg="linearize")
    cotangent = _tangents(y, seed=6)

    def vjp(fn):
        return jax.jit(lambda c: jax.vjp(fn, params, x)[1](c))(cotangent)

    _close(vjp(layer_fn), vjp(reference_fn), err_msg="vjp")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_jacfwd_and_hessian(x64, name):
    layer_fn, reference_fn, params, x = _setup(name)
    _close(
        jax.jit(jax.jacfwd(layer_fn, argnums=1))(params, x),
        jax.jit(jax.jacfwd(reference_fn, argnums=1))(params, x),
        err_msg="jacfwd",
    )

    def scalar(fn):
        return lambda x: jnp.sum(jnp.sin(fn(params, x)))

    _close(
        jax.jit(jax.hessian(scalar(layer_fn)))(x),
        jax.jit(jax.hessian(scalar(reference_fn)))(x),
        rtol=1e-9,
        err_msg="hessian",
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", WEIGHT_LAYERS)
def test_linear_transpose(x64, name):
    layer_fn, reference_fn, params, x = _setup(name)

    def linear_part(fn):
        # The layer is affine in x: its linear part has no bias.
        return lambda x: fn(params, x) - fn(params, jnp.zeros_like(x))

    cotangent = _tangents(layer_fn(params, x), seed=7)
    _close(
        jax.linear_transpose(linear_part(layer_fn), x)(cotangent),
        jax.linear_transpose(linear_part(reference_fn), x)(cotangent),
        err_msg="linear_transpose",
    )
