"""The convolution cases the ``"xla"`` conv tests share: operands, references.

A :class:`Case` is one convolution (shapes, options, dtype); :func:`check`
runs :func:`~ensembles.ops.conv.conv_rows` on it and compares its forward
and the gradients w.r.t. the differentiated operands with a per-member loop
that runs ``lax.conv_general_dilated`` with each member's explicit effective
kernel (:func:`tests.reference.conv_effective_kernel`),
differentiated in float32 on upcast operands.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ensembles.ops import batch_ensemble_conv
from ensembles.ops.conv import conv_rows
from tests.jaxprs import equations
from tests.reference import conv_effective_kernel, cotangent_loss, random_cotangent
from tests.tolerances import assert_close, assert_close_to_scale

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
NAMES = ("inputs", "kernel", "r", "s", "bias")

# argnums into (inputs, kernel, r, s); conv_rows is run without a bias.
NEEDS = {
    "first_layer": (1, 2, 3),
    "inputs": (0,),
    "all": (0, 1, 2, 3),
    "r": (2,),
    "s": (3,),
    "kernel": (1,),
}


class Case(NamedTuple):
    """One convolution: shapes, options, dtype (hashable, for the caches).

    ``padding`` is either what ``lax`` takes or one of the padding modes that
    copy values (``CIRCULAR``, ``REFLECT``, ``CAUSAL``).
    """

    num_members: int = 2
    batch: int = 3
    spatial: tuple[int, ...] = (7, 5)
    kernel_size: tuple[int, ...] = (3, 2)
    in_features: int = 3
    out_features: int = 5
    groups: int = 1
    strides: tuple[int, ...] = (1, 1)
    padding: Any = "SAME"
    input_dilation: tuple[int, ...] = (1, 1)
    kernel_dilation: tuple[int, ...] = (1, 1)
    dtype: str = "f32"
    seed: int = 0


DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def one_d(**kwargs):
    base = {
        "spatial": (5,),
        "kernel_size": (3,),
        "strides": (1,),
        "input_dilation": (1,),
        "kernel_dilation": (1,),
    }
    return Case(**{**base, **kwargs})


@functools.cache
def case_args(case: Case):
    """``(x, kernel, r, s, bias)``; r and s around 1, drawn with numpy."""
    rng = np.random.default_rng(case.seed)
    dtype = DTYPES[case.dtype]

    def draw(shape, mean=0.0, scale=1.0):
        return jnp.asarray(mean + scale * rng.standard_normal(shape), dtype)

    e, i, o = case.num_members, case.in_features, case.out_features
    x = draw((e * case.batch, *case.spatial, i))
    kernel = draw((*case.kernel_size, i // case.groups, o))
    r = draw((e, i), 1.0, 0.5)
    s = draw((e, o), 1.0, 0.5)
    bias = draw((e, o))
    return x, kernel, r, s, bias


def conv_op(case: Case):
    """``(x, kernel, r, s) -> y``: the op without a bias."""

    def op(x, kernel, r, s):
        return conv_rows(
            x,
            kernel,
            r,
            s,
            None,
            num_members=case.num_members,
            strides=case.strides,
            padding=case.padding,
            input_dilation=case.input_dilation,
            kernel_dilation=case.kernel_dilation,
            feature_group_count=case.groups,
            precision=None,
            preferred_element_type=None,
        )

    return op


def dimension_numbers(ndim):
    """``[N, *spatial, C]`` inputs and outputs, ``[*spatial, in, out]`` kernels."""
    spatial = tuple(range(1, ndim - 1))
    lhs = (0, ndim - 1, *spatial)
    return lax.ConvDimensionNumbers(lhs, (ndim - 1, ndim - 2, *range(ndim - 2)), lhs)


def pad_like_the_op(x, case: Case):
    """The op's value-copying padding, then ``"VALID"`` (as ``nnx.Conv``)."""
    rank = len(case.kernel_size)
    dilated = [
        (k - 1) * d + 1
        for k, d in zip(case.kernel_size, case.kernel_dilation, strict=True)
    ]
    if case.padding == "CAUSAL":
        return jnp.pad(x, [(0, 0), (dilated[0] - 1, 0), (0, 0)]), "VALID"
    if case.padding in ("CIRCULAR", "REFLECT"):
        pads = [((k - 1) // 2, k // 2) for k in dilated]
        mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[case.padding]
        return jnp.pad(x, [(0, 0), *pads, (0, 0)], mode=mode), "VALID"
    assert rank == x.ndim - 2
    return x, case.padding


def reference_fn(case: Case):
    """Per-member loop over explicit effective kernels, in float32."""

    def ref(x, kernel, r, s, bias):
        x, padding = pad_like_the_op(x, case)
        batch = x.shape[0] // case.num_members
        outputs = []
        for k in range(case.num_members):
            weight = conv_effective_kernel(kernel, r, s, k, case.groups)
            y = lax.conv_general_dilated(
                x[k * batch : (k + 1) * batch],
                weight,
                case.strides,
                padding,
                lhs_dilation=case.input_dilation,
                rhs_dilation=case.kernel_dilation,
                dimension_numbers=dimension_numbers(x.ndim),
                feature_group_count=case.groups,
                precision=lax.Precision.HIGHEST,
            )
            outputs.append(y + bias[k].reshape((1,) * (y.ndim - 1) + (-1,)))
        return jnp.concatenate(outputs)

    return ref


@functools.cache
def reference(case: Case, with_bias: bool):
    """Output and gradients w.r.t. all operands, in float32 (cached).

    Without ``with_bias`` the bias is zero and gets no gradient (the cases of
    :func:`conv_op`).
    """
    x, kernel, r, s, bias = (a.astype(jnp.float32) for a in case_args(case))
    if not with_bias:
        bias = jnp.zeros_like(bias)
    ref = reference_fn(case)
    y = jax.jit(ref)(x, kernel, r, s, bias)
    cotangent = random_cotangent(y.shape)
    argnums = tuple(range(5 if with_bias else 4))
    fn = jax.value_and_grad(
        cotangent_loss(ref, cotangent), argnums=argnums, has_aux=True
    )
    (_, y), grads = jax.jit(fn)(x, kernel, r, s, bias)
    return y, grads


def compare(case, args, argnums, y, grads, primal_outputs=()):
    y_ref, grads_ref = reference(case, len(args) == 5)
    dtype = F32 if case.dtype == "f32" else BF16
    promoted = jnp.result_type(*args)
    for name, out in [("forward (vjp)", y), *primal_outputs]:
        assert out.shape == y_ref.shape, (name, out.shape, y_ref.shape)
        assert out.dtype == promoted, (name, out.dtype, promoted)
        assert_close(out, y_ref, dtype, scale=4, err_msg=name)
    assert len(grads) == len(argnums)
    for i, g in zip(argnums, grads, strict=True):
        name = NAMES[i]
        assert g.shape == args[i].shape, name
        assert g.dtype == args[i].dtype, (name, g.dtype, args[i].dtype)
        assert_close_to_scale(g, grads_ref[i], dtype, scale=4, err_msg=name)


def check(case: Case, argnums, jit=True, primal=False):
    """Forward value and gradients w.r.t. ``argnums`` against the reference.

    ``primal``: also check the forward called outside differentiation.
    """
    args = case_args(case)[:4]
    y_ref, _ = reference(case, False)
    op = conv_op(case)
    grad_op = jax.value_and_grad(
        cotangent_loss(op, random_cotangent(y_ref.shape)), argnums=argnums, has_aux=True
    )
    if jit:
        grad_op, op = jax.jit(grad_op), jax.jit(op)
    (_, y), grads = grad_op(*args)
    primal_outputs = [("forward (primal)", op(*args))] if primal else []
    compare(case, args, argnums, y, grads, primal_outputs)


def public_op(case: Case):
    """``(x, kernel, r, s, bias) -> y``: :func:`batch_ensemble_conv` on the case."""

    def op(*a):
        return batch_ensemble_conv(
            *a,
            num_members=case.num_members,
            strides=case.strides,
            padding=case.padding,
            input_dilation=case.input_dilation,
            kernel_dilation=case.kernel_dilation,
            feature_group_count=case.groups,
            impl="xla",
        )

    return op


def check_public(case: Case, argnums):
    """As :func:`check`, through the public op, with the bias (jitted)."""
    args = case_args(case)
    y_ref, _ = reference(case, True)
    fn = jax.value_and_grad(
        cotangent_loss(public_op(case), random_cotangent(y_ref.shape)),
        argnums=argnums,
        has_aux=True,
    )
    (_, y), grads = jax.jit(fn)(*args)
    compare(case, args, argnums, y, grads)


def convs(closed_jaxpr):
    """Output shapes of every ``conv_general_dilated``, recursively."""
    eqns = equations(closed_jaxpr, "conv_general_dilated")
    return [
        tuple(eqn.outvars[0].aval.shape) for eqn, times in eqns for _ in range(times)
    ]
