"""Every op under every JAX transformation, in the precision the user asked for.

Each op (default ``impl``) is compared with a per-member loop over explicit
effective kernels written in plain ``jnp``/``lax`` in the operands' own dtype,
so JAX's own rules differentiate the reference: float64 gradients at 1e-12,
forward mode (``jvp``, ``linearize``, ``jacfwd``, ``hessian``), transposition
(``linear_transpose``, also of a linearized op), ``vmap`` of gradients, and
that every matmul and convolution of the forward and of every gradient runs at
the requested ``precision`` and ``preferred_element_type`` (read off the
lowered StableHLO).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from ensembles.ops import (
    batch_ensemble_conv,
    batch_ensemble_conv_transpose,
    batch_ensemble_dense,
    batch_ensemble_dense_general,
    batch_ensemble_einsum,
)
from tests.reference import conv_effective_kernel
from tests.tolerances import assert_close_to_scale

# Every test here runs each formulation of the ops (tests/formulations.py):
# the platforms' and the sharded one.
pytestmark = pytest.mark.usefixtures("every_formulation")

E, B = 2, 3
HIGHEST = lax.Precision.HIGHEST


def _member_loop(member_fn):
    """``(x, kernel, r, s, bias) -> concat_k member_fn(x_k, kernel_k, bias_k)``."""

    def reference(x, kernel, r, s, bias, effective):
        rows = x.shape[0] // E
        outs = []
        for k in range(E):
            y = member_fn(x[k * rows : (k + 1) * rows], effective(kernel, r, s, k))
            if bias is not None:
                y = y + bias[k].reshape((1,) * (y.ndim - bias[k].ndim) + bias[k].shape)
            outs.append(y)
        return jnp.concatenate(outs)

    return reference


def _dense_member(x, kernel):
    return jnp.matmul(x, kernel, precision=HIGHEST)


def _general_member(x, kernel):
    return jnp.tensordot(x, kernel, axes=1, precision=HIGHEST)


def _einsum_member(einsum_str):
    return lambda x, kernel: jnp.einsum(einsum_str, x, kernel, precision=HIGHEST)


def _conv_member(groups):
    def conv(x, kernel):
        return lax.conv_general_dilated(
            x,
            kernel,
            (1, 1),
            "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=groups,
            precision=HIGHEST,
        )

    return conv


def _conv_transpose_member(x, kernel):
    return lax.conv_transpose(
        x, kernel, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=HIGHEST,
    )  # fmt: skip


def _outer_kernel(kernel, r, s, k):
    return kernel * jnp.outer(r[k], s[k])


def _general_kernel(kernel, r, s, k):  # [in, H, D]; r [E, in], s [E, H, D]
    return kernel * r[k][:, None, None] * s[k][None]


def _einsum_kernel(kernel, r, s, k):  # "NDH": r over D, s over (N, H)
    return kernel * r[k][None, :, None] * s[k][:, None, :]


def _batch_letter_kernel(kernel, r, s, k):  # "TDH": r over D, s over (T, H)
    return kernel * r[k][None, :, None] * s[k][:, None, :]


def _grouped_kernel(kernel, r, s, k):
    return conv_effective_kernel(kernel, r, s, k, feature_group_count=2)


# name -> (op(x, kernel, r, s, bias, **options), reference, shapes of
# (x, kernel, r, s, bias)).
OPS = {
    "dense": (
        lambda *a, **o: batch_ensemble_dense(*a, num_members=E, **o),
        functools.partial(_member_loop(_dense_member), effective=_outer_kernel),
        ((E * B, 2, 5), (5, 3), (E, 5), (E, 3), (E, 3)),
    ),
    "dense_general": (
        lambda *a, **o: batch_ensemble_dense_general(*a, num_members=E, **o),
        functools.partial(_member_loop(_general_member), effective=_general_kernel),
        ((E * B, 2, 5), (5, 2, 3), (E, 5), (E, 2, 3), (E, 2, 3)),
    ),
    "einsum": (
        lambda *a, **o: batch_ensemble_einsum(
            *a, einsum_str="BTD,NDH->BTNH", num_members=E, **o
        ),
        functools.partial(
            _member_loop(_einsum_member("BTD,NDH->BTNH")), effective=_einsum_kernel
        ),
        ((E * B, 2, 5), (2, 5, 3), (E, 5), (E, 2, 3), (E, 2, 3)),
    ),
    "einsum_batch_letter": (
        lambda *a, **o: batch_ensemble_einsum(
            *a, einsum_str="BTD,TDH->BTH", num_members=E, **o
        ),
        functools.partial(
            _member_loop(_einsum_member("BTD,TDH->BTH")),
            effective=_batch_letter_kernel,
        ),
        ((E * B, 2, 5), (2, 5, 3), (E, 5), (E, 2, 3), (E, 2, 3)),
    ),
    "conv": (
        lambda *a, **o: batch_ensemble_conv(*a, num_members=E, **o),
        functools.partial(
            _member_loop(_conv_member(1)), effective=conv_effective_kernel
        ),
        ((E * B, 5, 4, 4), (3, 3, 4, 3), (E, 4), (E, 3), (E, 3)),
    ),
    "conv_grouped": (
        lambda *a, **o: batch_ensemble_conv(
            *a, num_members=E, feature_group_count=2, **o
        ),
        functools.partial(_member_loop(_conv_member(2)), effective=_grouped_kernel),
        ((E * B, 5, 4, 4), (3, 3, 2, 6), (E, 4), (E, 6), (E, 6)),
    ),
    "conv_transpose": (
        lambda *a, **o: batch_ensemble_conv_transpose(
            *a, num_members=E, strides=2, **o
        ),
        functools.partial(
            _member_loop(_conv_transpose_member), effective=conv_effective_kernel
        ),
        ((E * B, 3, 4, 4), (3, 3, 4, 3), (E, 4), (E, 3), (E, 3)),
    ),
}


def _operands(name, dtype, seed=0):
    rng = np.random.default_rng(seed)
    shapes = OPS[name][2]
    means = (0.0, 0.0, 1.0, 1.0, 0.0)
    scales = (1.0, 0.5, 0.5, 0.5, 1.0)
    return tuple(
        jnp.asarray(mean + scale * rng.standard_normal(shape), dtype)
        for shape, mean, scale in zip(shapes, means, scales, strict=True)
    )


def _tangents(operands, seed=1):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in operands)


def _close(actual, expected, rtol, err_msg=""):
    """``max|actual - expected| <= rtol * max|expected|``, shapes and dtypes equal."""
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (err_msg, a, b)
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        scale = max(np.max(np.abs(b), initial=0.0), 1e-30)
        error = np.max(np.abs(a - b), initial=0.0)
        assert error <= rtol * scale, (err_msg, error / scale)
    assert jax.tree.leaves(expected), "nothing compared"


ALL = (0, 1, 2, 3, 4)
FIRST_LAYER = (1, 2, 3, 4)


# --- float64 ----------------------------------------------------------------


@pytest.mark.parametrize("argnums", [ALL, FIRST_LAYER, (2,), (3,)])
@pytest.mark.parametrize("name", sorted(OPS))
def test_float64_gradients_are_float64_accurate(x64, name, argnums):
    op, reference, _ = OPS[name]
    operands = _operands(name, jnp.float64)
    cotangent = _tangents(operands)[0]

    def loss(fn):
        def f(*a):
            y = fn(*a)
            return jnp.sum(jnp.sin(y) * cotangent.sum() / cotangent.size)

        return f

    grads = jax.jit(jax.grad(loss(op), argnums=argnums))(*operands)
    expected = jax.grad(loss(reference), argnums=argnums)(*operands)
    for i, g in zip(argnums, grads, strict=True):
        assert g.dtype == jnp.float64, (i, g.dtype)
    _close(grads, expected, 1e-12, name)


# --- forward mode -------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_jvp_and_linearize_float64(x64, name, jit):
    op, reference, _ = OPS[name]
    operands = _operands(name, jnp.float64)
    tangents = _tangents(operands)
    jvp = jax.jit(jax.jvp, static_argnums=0) if jit else jax.jvp
    y, dy = jvp(op, operands, tangents)
    y_ref, dy_ref = jax.jvp(reference, operands, tangents)
    _close((y, dy), (y_ref, dy_ref), 1e-12, name)
    y_lin, linear = jax.linearize(op, *operands)
    _close((y_lin, linear(*tangents)), (y_ref, dy_ref), 1e-12, name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", ["dense", "conv", "einsum"])
def test_jvp_in_float32_and_bfloat16(name, dtype):
    op, reference, _ = OPS[name]
    operands = _operands(name, dtype)
    tangents = _tangents(operands)
    y, dy = jax.jit(jax.jvp, static_argnums=0)(op, operands, tangents)
    assert y.dtype == dy.dtype == dtype
    upcast = [tuple(a.astype(jnp.float32) for a in t) for t in (operands, tangents)]
    y_ref, dy_ref = jax.jvp(reference, *upcast)
    assert_close_to_scale(y, y_ref, dtype, scale=4, err_msg="y")
    assert_close_to_scale(dy, dy_ref, dtype, scale=4, err_msg="dy")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPS))
def test_jacfwd_and_hessian(x64, name):
    op, reference, _ = OPS[name]
    operands = _operands(name, jnp.float64)

    def jacobians(fn):
        return jax.jit(jax.jacfwd(fn, argnums=(0, 2)))(*operands)

    _close(jacobians(op), jacobians(reference), 1e-12, "jacfwd")

    def scalar(fn):
        return lambda r, s: jnp.sum(jnp.sin(fn(operands[0], operands[1], r, s, None)))

    hessians = jax.jit(jax.hessian(scalar(op), argnums=(0, 1)))(*operands[2:4])
    expected = jax.jit(jax.hessian(scalar(reference), argnums=(0, 1)))(*operands[2:4])
    _close(hessians, expected, 1e-10, "hessian")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPS))
def test_linear_transpose(x64, name):
    op, reference, _ = OPS[name]
    x, kernel, r, s, _ = _operands(name, jnp.float64)
    y = op(x, kernel, r, s, None)
    cotangent = _tangents((y,))[0]
    args = [x, kernel, r, s]
    for position in range(4):  # the op is linear in each operand alone

        def linear(a, fn, position=position, args=args):
            return fn(*args[:position], a, *args[position + 1 :], None)

        actual = jax.linear_transpose(functools.partial(linear, fn=op), args[position])(
            cotangent
        )
        expected = jax.linear_transpose(
            functools.partial(linear, fn=reference), args[position]
        )(cotangent)
        _close(actual, expected, 1e-12, f"{name} operand {position}")
    # The transpose of a linearized op is its VJP.
    _, linear = jax.linearize(op, x, kernel, r, s, None)
    transposed = jax.linear_transpose(linear, x, kernel, r, s, None)(cotangent)
    _, vjp = jax.vjp(reference, x, kernel, r, s, None)
    _close(transposed[:4], vjp(cotangent)[:4], 1e-12, "transpose(linearize)")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "conv"])
def test_vmap_of_gradients_and_of_jvp(x64, name):
    op, reference, _ = OPS[name]
    x, kernel, r, s, bias = _operands(name, jnp.float64)
    xs = jnp.stack([x, 2 * x, -x])

    def per_example(fn):
        def grads(x):
            return jax.grad(
                lambda k, r: jnp.sum(fn(x, k, r, s, bias) ** 2), argnums=(0, 1)
            )(kernel, r)

        return jax.vmap(grads)(xs)

    _close(per_example(op), per_example(reference), 1e-12, "vmap(grad)")
    tangent = _tangents((x,))[0]

    def tangents(fn):
        return jax.vmap(
            lambda x: jax.jvp(lambda x: fn(x, kernel, r, s, bias), (x,), (tangent,))
        )(xs)

    _close(tangents(op), tangents(reference), 1e-12, "vmap(jvp)")


# --- precision and preferred_element_type ---------------------------------------

_OP_LINE = re.compile(r"stablehlo\.(dot_general|convolution)\b(.*)")


def _matmuls_and_convs(fn, *args):
    """``(kind, precision, operand types, result type)`` of every matmul/conv."""
    text = jax.jit(fn).lower(*args).as_text()
    found = []
    for line in text.splitlines():
        match = _OP_LINE.search(line)
        if not match:
            continue
        kind, rest = match.groups()
        precision = re.search(
            r"precision(?:_config)? = \[(?:#stablehlo<precision )?([A-Z]+)>?, "
            r"(?:#stablehlo<precision )?([A-Z]+)>?\]",
            rest,
        )
        types = re.search(
            r":\s*\((tensor<[^>]*>), (tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)", rest
        )
        assert types, line
        found.append(
            (
                kind,
                precision.groups() if precision else ("DEFAULT", "DEFAULT"),
                types.groups()[:2],
                types.group(3),
            )
        )
    return found


@pytest.mark.parametrize("mode", ["forward", "gradient", "first_layer", "jvp"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_every_matmul_runs_at_the_requested_precision(name, mode):
    op, _, _ = OPS[name]
    operands = _operands(name, jnp.float32)

    def forward(*a):
        return op(*a, precision=HIGHEST)

    fn = {
        "forward": forward,
        "gradient": jax.grad(lambda *a: jnp.sum(forward(*a) ** 2), argnums=ALL),
        "first_layer": jax.grad(
            lambda *a: jnp.sum(forward(*a) ** 2), argnums=FIRST_LAYER
        ),
        "jvp": lambda *a: jax.jvp(forward, a, a),
    }[mode]
    found = _matmuls_and_convs(fn, *operands)
    assert found, "no matmul found: the walk would pass vacuously"
    for kind, precision, operand_types, _ in found:
        assert precision == ("HIGHEST", "HIGHEST"), (kind, precision, operand_types)


@pytest.mark.parametrize("name", sorted(OPS))
def test_preferred_element_type_holds_in_forward_and_gradient(name):
    op, _, _ = OPS[name]
    operands = _operands(name, jnp.bfloat16)

    def forward(*a):
        return op(*a, preferred_element_type=jnp.float32)

    assert jax.eval_shape(forward, *operands).dtype == jnp.float32
    grad = jax.grad(lambda *a: jnp.sum(forward(*a) ** 2), argnums=ALL)
    for g, a in zip(jax.eval_shape(grad, *operands), operands, strict=True):
        assert g.dtype == a.dtype
    for fn in (forward, grad):
        found = _matmuls_and_convs(fn, *operands)
        assert found
        for kind, _, operand_types, result in found:
            # A bfloat16 product accumulates and returns float32, as asked.
            if any("bf16" in t for t in operand_types):
                assert result.endswith("xf32>"), (kind, operand_types, result)
