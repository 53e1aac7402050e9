"""The dense op's formulations: its forward, tangent and backward, as ``jnp``.

Member ``k`` of a BatchEnsemble dense layer computes, on its rows ``x_k``::

    y_k = ((x_k * r_k) @ W) * s_k  =  x_k @ (W * outer(r_k, s_k))

(the bias is added by the caller). Two forward formulations compute that:

* ``"scale"``: scale the activations, one 2-D matmul over all ``E*B`` rows,
  scale again. Extra work: two passes over the activations.
* ``"fold"``: materialise the member kernels ``W_k = W * outer(r_k, s_k)`` and
  run one batched matmul. Extra work: one pass over ``E x in x out``.

For the gradients write ``M_k = x_k^T g_k`` for member ``k``'s block of the
kernel gradient before any scaling (``g_k`` its output cotangent). Then::

    dW   = sum_k M_k * outer(r_k, s_k)
    dr_k = sum_j (M_k * W)[:, j] s_k[j]
    ds_k = sum_i (M_k * W)[i, :] r_k[i]

so the gradients of the parameters can be formed in two ways:

* ``"scaled_activations"``: ``dW = (x * r)^T (g * s)`` (one 2-D matmul),
  ``dr_k = sum_b x_k * ((g_k * s_k) @ W^T)`` (needs the input-gradient matmul
  ``u = (g * s) @ W^T``, which ``dx = u * r`` shares), ``ds_k = sum_b g_k * z_k``
  with ``z = (x * r) @ W`` saved by the ``"scale"`` forward.
* ``"member_kernels"``: one batched matmul forms every ``M_k``; ``dW``, ``dr``
  and ``ds`` are reductions over ``E x in x out``. No input-gradient matmul: a
  layer whose inputs need no gradient (a first layer) does exactly the matmuls
  of a plain dense layer, and ``dx`` (when it is needed) is
  ``((g * s) @ W^T) * r``.

The rows of one member are a contiguous ``[B, in]`` block of the member-major
batch, so the ``[E, B, in]`` view these functions take is free (a reshape of
the row axis, no copy), and every matmul stays 2-D over the flat rows, what
XLA's CPU backend compiles best. Which formulation runs is decided in
:mod:`ensembles.ops.dense` (:func:`~ensembles.ops.dense.choose_dense`), which
also makes these functions the rules of its primitive
(:mod:`ensembles.ops.autodiff`). Every matmul runs at the op's ``precision``
and ``preferred_element_type``; the reductions into ``dr`` and ``ds``
accumulate in at least float32 (float64 stays float64). The per-member loop of
``tests/reference.py`` is the reference every formulation is tested against.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ensembles.ops.autodiff import Formulation, Needs, accumulation_dtype

__all__ = [
    "DenseConfig",
    "backward",
    "dense_by_row",
    "forward",
    "keeps_product",
    "tangent",
]


@dataclasses.dataclass(frozen=True)
class DenseConfig:
    """The static options of one call (parameters of the op primitives).

    Attributes:
      precision: of every matmul, forward and backward.
      preferred_element_type: of every matmul, forward and backward.
      formulation: a forced :class:`~ensembles.ops.autodiff.Formulation`
        (tests, benchmarks); ``None``: the op's rule decides.
    """

    precision: Any
    preferred_element_type: Any
    formulation: Formulation | None

    def dot(self, lhs, rhs, dimension_numbers, preferred_element_type=None):
        """``lax.dot_general`` at the op's precision and accumulation dtype."""
        return lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision=self.precision,
            preferred_element_type=preferred_element_type
            or self.preferred_element_type,
        )

    def sum_dtype(self, *operands):
        """The dtype a reduction of ``operands`` into ``dr``/``ds`` runs in."""
        return accumulation_dtype(
            *operands, preferred_element_type=self.preferred_element_type
        )


_FLAT = (((1,), (0,)), ((), ()))  # [rows, in] @ [in, out]
_BATCHED = (((2,), (1,)), ((0,), (0,)))  # [E, B, in] @ [E, in, out]


def _matmul(x3, kernel, config: DenseConfig):
    """``[E, B, in] @ [in, out]`` as one 2-D matmul over the flat rows."""
    num_members, _, in_features = x3.shape
    y = config.dot(x3.reshape(-1, in_features), kernel, _FLAT)
    return y.reshape(num_members, -1, kernel.shape[1])


def _effective_kernels(kernel, r, s):
    """``[E, in, out]``: ``kernel * outer(r_k, s_k)`` for every member."""
    return kernel[None] * (r[:, :, None] * s[:, None, :])


def _output_dtype(x3, kernel, r, s, config: DenseConfig):
    """The output's dtype, the same for every formulation: ``z * s``'s."""
    product = config.preferred_element_type or jnp.result_type(x3, r, kernel)
    return jnp.result_type(product, s)


def _product(x3, kernel, r, config: DenseConfig):
    """``z = (x * r) @ W``, the unscaled product, ``[E, B, out]``."""
    # Scale in the [E, B, in] view, multiply in the flat [E*B, in] view: XLA
    # fuses each scaling into one loop and keeps a single 2-D dot, measurably
    # cheaper (forward and backward) than a 3-D einsum (docs/cost.md).
    return _matmul(x3 * r[:, None, :], kernel, config)


def forward(x3, kernel, r, s, config: DenseConfig, formulation: Formulation):
    """``(y, z)``: the output and, for ``"scale"``, the unscaled product ``z``."""
    dtype = _output_dtype(x3, kernel, r, s, config)
    if formulation.forward == "fold":
        y = config.dot(x3, _effective_kernels(kernel, r, s), _BATCHED)
        return y.astype(dtype), None
    z = _product(x3, kernel, r, config)
    return (z * s[:, None, :]).astype(dtype), z


def tangent(x3, kernel, r, s, z, tangents, config: DenseConfig):
    """``dy``, linear in the tangents of ``(x, kernel, r, s)`` (``None``: none).

    ``dy = (((dx * r + x * dr) @ W + (x * r) @ dW) * s + z * ds``.
    """
    dx, dkernel, dr, ds = tangents
    dscaled = None
    if dx is not None:
        dscaled = dx * r[:, None, :]
    if dr is not None:
        term = x3 * dr[:, None, :]
        dscaled = term if dscaled is None else dscaled + term
    dz = None if dscaled is None else _matmul(dscaled, kernel, config)
    if dkernel is not None:
        term = _matmul(x3 * r[:, None, :], dkernel, config)
        dz = term if dz is None else dz + term
    dy = None if dz is None else dz * s[:, None, :]
    if ds is not None:
        if z is None:
            z = _product(x3, kernel, r, config)
        term = z * ds[:, None, :]
        dy = term if dy is None else dy + term
    return dy.astype(_output_dtype(x3, kernel, r, s, config))


def _input_gradient(g, kernel, s, config: DenseConfig):
    """``u = (g * s) @ W^T``, ``[E, B, in]``: ``dx = u * r``, ``dr = sum_b u * x``."""
    num_members, _, out_features = g.shape
    scaled = (g * s[:, None, :]).reshape(-1, out_features)
    u = config.dot(scaled, kernel, (((1,), (1,)), ((), ())))
    return u.reshape(num_members, -1, kernel.shape[0])


def _sum_rows(a, b, config: DenseConfig):
    """``sum_b a * b`` per member and feature: ``[E, B, D]`` x2 -> ``[E, D]``."""
    return config.dot(a, b, (((1,), (1,)), ((0, 2), (0, 2))), config.sum_dtype(a, b))


def _scaled_activation_gradients(
    x3, kernel, r, s, z, g, config: DenseConfig, needs: Needs
):
    """Parameter (and input) gradients formed in the activations' space."""
    dx = dkernel = dr = ds = None
    if needs.inputs or needs.r:
        u = _input_gradient(g, kernel, s, config)
        if needs.inputs:
            dx = u * r[:, None, :]
        if needs.r:
            dr = _sum_rows(u, x3, config)
    if needs.kernel:
        in_features, out_features = kernel.shape
        dkernel = config.dot(
            (x3 * r[:, None, :]).reshape(-1, in_features),
            (g * s[:, None, :]).reshape(-1, out_features),
            (((0,), (0,)), ((), ())),
        )
    if needs.s:
        if z is None:
            z = _product(x3, kernel, r, config)
        ds = _sum_rows(g, z, config)
    return dx, dkernel, dr, ds


def _member_kernel_gradients(x3, kernel, r, s, z, g, config: DenseConfig, needs: Needs):
    """Parameter gradients from the per-member kernel gradients ``M_k``."""
    dx = dkernel = dr = ds = None
    if needs.inputs:
        dx = _input_gradient(g, kernel, s, config) * r[:, None, :]
    if needs.params:
        # M_k = x_k^T g_k, [E, in, out]: one batched matmul, the FLOPs of dW.
        m = config.dot(x3, g, (((1,), (1,)), ((0,), (0,))))
        if needs.kernel:
            # A sum over the leading axis of [E, in, out] is a slow strided
            # reduction on XLA's CPU backend; E slices added in one fused loop
            # are not.
            dkernel = sum(
                m[k] * (r[k][:, None] * s[k][None, :]) for k in range(m.shape[0])
            )
        if needs.r:
            # A reduction over the minor axis of the 2-D [E*in, out] view: over
            # a middle axis (or as a batched matrix-vector product) it runs
            # 2-10x slower on XLA's CPU backend, and over the minor axis of the
            # 3-D [E, in, out] array 1.2-1.4x slower, at E=1 6x (measured).
            in_features, out_features = kernel.shape
            dr = jnp.sum(
                (m * (kernel[None] * s[:, None, :])).reshape(-1, out_features),
                axis=1,
                dtype=config.sum_dtype(m, kernel, s),
            ).reshape(-1, in_features)
        if needs.s:
            if z is not None:  # the "scale" forward kept z, [E, B, out]
                ds = _sum_rows(g, z, config)
            else:
                ds = config.dot(
                    m * kernel[None],
                    r,
                    (((1,), (1,)), ((0,), (0,))),
                    config.sum_dtype(m, kernel, r),
                )
    return dx, dkernel, dr, ds


def keeps_product(formulation: Formulation, needs: Needs) -> bool:
    """Whether the forward's unscaled product ``z`` is kept for the backward.

    ``ds`` reads it where the ``"scale"`` forward computed it.
    """
    return needs.s and formulation.forward == "scale"


def backward(x3, kernel, r, s, z, g, config, formulation: Formulation, needs):
    """The cotangents of ``(x, kernel, r, s)`` (``None`` for those not needed)."""
    gradients = {
        "member_kernels": _member_kernel_gradients,
        "scaled_activations": _scaled_activation_gradients,
    }[formulation.backward]
    return gradients(x3, kernel, r, s, z, g, config, needs)


# ------------------------------------------------------ sharded rows


def _explicit_sharding(array) -> jax.sharding.NamedSharding | None:
    """``array``'s sharding if it is placed on an explicit mesh, else ``None``."""
    sharding = getattr(jax.typeof(array), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not mesh.explicit_axes:
        return None
    return sharding


def _row_members(inputs, num_members: int) -> jax.Array:
    """The member index of every row of ``inputs``, sharded as its rows are."""
    num_rows = inputs.shape[0]
    member = lax.broadcasted_iota(jnp.int32, (num_rows,), 0) // (
        num_rows // num_members
    )
    sharding = _explicit_sharding(inputs)
    if sharding is not None and sharding.spec and sharding.spec[0] is not None:
        member = jax.sharding.reshard(
            member, jax.sharding.NamedSharding(sharding.mesh, P(sharding.spec[0]))
        )
    return member


def _per_row(array, member, like) -> jax.Array:
    """``[E, features]`` -> ``[E*B, 1, ..., features]``: each row's member's slice.

    The result is placed as ``like``, the activation it scales, is placed
    (rows and features). Under an automatic mesh the partitioner infers that;
    under an explicit mesh it is spelled out, since a replicated result would
    make every device gather, and differentiate, the whole batch's fast weights.
    """
    sharding = _explicit_sharding(like)
    if sharding is None:
        rows = jnp.take(array, member, axis=0, mode="clip", indices_are_sorted=True)
    else:
        spec = (*sharding.spec, *(None,) * like.ndim)[: like.ndim]
        rows = array.at[member].get(
            mode="clip",
            indices_are_sorted=True,
            out_sharding=jax.sharding.NamedSharding(
                sharding.mesh, P(spec[0], spec[-1])
            ),
        )
    return rows.reshape(member.shape[0], *(1,) * (like.ndim - 2), array.shape[1])


def dense_by_row(inputs, kernel, r, s, bias, *, precision, preferred_element_type):
    """The sharding-friendly path: the row axis is never reshaped.

    Each row takes its member's ``r``, ``s`` and bias with a gather by a member
    index computed from an iota, and the matmul contracts the feature axis of
    the inputs as they are. The partitioner then keeps every activation sharded
    however its rows (data parallelism, any E), middle axes (sequence
    parallelism) or the kernel's output features (model parallelism) are split,
    where the reshape to ``[E, rows, in]`` would all-gather rows that do not
    split along member boundaries (and is rejected outright under an explicit
    mesh).
    """
    member = _row_members(inputs, r.shape[0])
    y = lax.dot_general(
        inputs * _per_row(r, member, inputs),
        kernel,
        (((inputs.ndim - 1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    y = y * _per_row(s, member, y)
    if bias is not None:
        y = y + _per_row(bias, member, y)
    return y
