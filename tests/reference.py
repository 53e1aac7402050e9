"""Reference implementations the library is tested against.

They are written the slow, obvious way: one member at a time, with the member's
explicit effective weight ``W * outer(r_k, s_k)``.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax


def numpy_normal(stddev=1.0, mean=0.0):
    """A normal initializer that draws with numpy, seeded by its key.

    ``jax.random.normal`` compiles anew for every shape it draws (most of what
    a small layer test costs on a CPU); tests that only need some random
    weights, not the library's or Flax's initializers, take these instead. Two
    keys still give two draws.
    """

    def init(key, shape, dtype=jnp.float32):
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        rng = np.random.default_rng(np.asarray(key, np.uint32).ravel().tolist())
        return jnp.asarray(mean + stddev * rng.standard_normal(shape), dtype)

    return init


def effective_kernel(kernel, r, s, k):
    return kernel * jnp.outer(r[k], s[k])


@partial(jax.jit, static_argnums=5)
def dense_reference(inputs, kernel, r, s, bias, num_members):
    """Per-member loop over explicit weights, computed in float32."""
    batch = inputs.shape[0] // num_members
    outputs = []
    for k in range(num_members):
        rows = inputs[k * batch : (k + 1) * batch].astype(jnp.float32)
        weight = effective_kernel(
            kernel.astype(jnp.float32), r.astype(jnp.float32), s.astype(jnp.float32), k
        )
        y = jnp.matmul(rows, weight, precision=lax.Precision.HIGHEST)
        if bias is not None:
            y = y + bias[k].astype(jnp.float32).reshape((1,) * (y.ndim - 1) + (-1,))
        outputs.append(y)
    return jnp.concatenate(outputs)


def make_args(
    seed, num_members, batch, middle, in_features, out_features, dtype, use_bias=True
):
    """Random inputs, kernel, fast weights around 1 and bias, drawn with numpy."""
    rng = np.random.default_rng(seed)

    def draw(shape, mean=0.0, scale=1.0):
        return jnp.asarray(mean + scale * rng.standard_normal(shape), dtype)

    x = draw((num_members * batch, *middle, in_features))
    kernel = draw((in_features, out_features))
    r = draw((num_members, in_features), 1.0, 0.5)
    s = draw((num_members, out_features), 1.0, 0.5)
    bias = draw((num_members, out_features)) if use_bias else None
    return x, kernel, r, s, bias


def conv_effective_kernel(
    kernel, r, s, k, feature_group_count=1, transpose_kernel=False
):
    """Member k's conv kernel, index by index in Flax's kernel layout.

    ``[*kernel_size, in/G, out]``: entry ``[..., j, o]`` is scaled by
    ``r[k, g*in/G + j] * s[k, o]`` with ``g = o // (out/G)``, the group of ``o``.
    With ``transpose_kernel`` the layout is ``[*kernel_size, out, in]``.
    """
    if transpose_kernel:
        scale = jnp.outer(s[k], r[k])
    else:
        in_per_group, out_features = kernel.shape[-2:]
        out_per_group = out_features // feature_group_count
        group = np.arange(out_features) // out_per_group
        index = group[None, :] * in_per_group + np.arange(in_per_group)[:, None]
        scale = r[k][index] * s[k][None, :]
    return kernel * scale.reshape((1,) * (kernel.ndim - 2) + scale.shape)


def flax_member_outputs(
    make_flax_layer,
    inputs,
    kernel,
    r,
    s,
    bias,
    num_members,
    feature_group_count=1,
    transpose_kernel=False,
):
    """Each member's rows through a Flax layer holding its effective weights.

    ``make_flax_layer(kernel, bias)`` builds the original Flax layer (e.g.
    ``nnx.Conv``) with the given kernel and bias (``None``: no bias). Everything
    is computed in float32.
    """
    f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
    inputs, kernel, r, s, bias = map(f32, (inputs, kernel, r, s, bias))
    batch = inputs.shape[0] // num_members
    outputs = []
    for k in range(num_members):
        weight = conv_effective_kernel(
            kernel, r, s, k, feature_group_count, transpose_kernel
        )
        layer = make_flax_layer(weight, None if bias is None else bias[k])
        outputs.append(layer(inputs[k * batch : (k + 1) * batch]))
    return jnp.concatenate(outputs)


def general_effective_kernel(kernel, r, s, k, num_batch_axes=0):
    """Member k's ``nnx.LinearGeneral`` kernel ``[*batch, *in, *out]``.

    ``r[k]`` (shape ``in_features``) scales the input feature axes and ``s[k]``
    (shape ``out_features``) the output feature axes; both are shared across the
    leading kernel batch axes.
    """
    num_in, num_out = r.ndim - 1, s.ndim - 1
    r_k = r[k].reshape((1,) * num_batch_axes + r.shape[1:] + (1,) * num_out)
    s_k = s[k].reshape((1,) * (num_batch_axes + num_in) + s.shape[1:])
    return kernel * r_k * s_k


def flax_rows_reference(template, member_state, inputs, num_members, **call_kwargs):
    """Each member's rows through the Flax module ``template`` holding its state.

    ``member_state(k)`` returns ``{name: Variable}``, member k's complete state
    for ``template`` (e.g. ``{"kernel": nnx.Param(...), "bias": ...}``). The
    modules are built with ``nnx.merge``, so the reference is a pure function of
    those values and works under ``jax.grad`` and ``jax.jit``.
    """
    graphdef, _ = nnx.split(template)
    batch = inputs.shape[0] // num_members
    outputs = []
    for k in range(num_members):
        module = nnx.merge(graphdef, nnx.State(member_state(k)))
        outputs.append(module(inputs[k * batch : (k + 1) * batch], **call_kwargs))
    return jnp.concatenate(outputs)


def random_cotangent(shape):
    """A fixed float32 output cotangent of ``shape``."""
    return jnp.asarray(np.random.default_rng(17).standard_normal(shape), jnp.float32)


def cotangent_loss(fn, cotangent):
    """``(sum(fn(*a) * cotangent), fn(*a))``: its gradient is ``fn``'s VJP."""

    def loss(*a):
        y = fn(*a)
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    return loss


def snapshot(*nodes):
    """Every Variable value of ``nodes`` (models, Rngs), as numpy arrays."""
    leaves = []
    for node in nodes:
        for leaf in jax.tree.leaves(nnx.state(node)):
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            leaves.append(np.array(leaf))
    return leaves


def assert_same(before, after):
    assert len(before) == len(after)
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(old, new)


def assert_trees_equal(expected, actual):
    """Equal leaves of equal trees, and at least one leaf compared.

    (Mapping ``np.testing.assert_array_equal`` over two trees passes when both
    are empty, so a test comparing nothing would pass.)
    """
    expected_leaves, expected_def = jax.tree.flatten(expected)
    actual_leaves, actual_def = jax.tree.flatten(actual)
    assert expected_leaves, "nothing compared: the expected tree is empty"
    assert expected_def == actual_def, (expected_def, actual_def)
    for old, new in zip(expected_leaves, actual_leaves, strict=True):
        np.testing.assert_array_equal(old, new)
