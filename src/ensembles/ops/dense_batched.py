"""The dense op on GPUs and TPUs: the members as the batch dimension of one matmul.

Member ``k`` maps its rows as ``y_k = ((x_k * r[k]) @ kernel) * s[k]``. Here
that is one batched matmul of the ``[E, B, in]`` view against the kernel
broadcast to ``[E, in, out]`` (:func:`member_matmul`). A GPU's and a TPU's
compilers then fuse the scalings by ``r`` and ``s`` (and the bias, and the
layer's neighbours) into the matmul, since each member's vectors are indexed
by the batch coordinate of a tile, and read the broadcast kernel without
writing it: on an H100 the forward is one kernel moving the bytes of a plain
layer's. (The CPU's formulation, one 2-D matmul over the flat rows, leaves
``x * r`` and the broadcasts of ``s`` and the bias as kernels of their own
there: three times the bytes; ``docs/cost.md``.)

Its derivative is a ``jax.custom_jvp`` whose tangent is written so that its
transpose, reverse mode, runs a plain layer's matmuls, and no other:

* the inputs differentiated (a hidden layer): the input gradient ``(g * s) @
  kernel^T`` as one batched matmul, ``dx`` and ``dr`` read off it; ``dW`` one
  matmul over all rows, ``(x * r)^T (g * s)``; ``ds`` a reduction of ``g``
  against the unscaled product;
* the inputs not differentiated and ``r`` differentiated (a first layer):
  ``dr`` would need that input-gradient matmul, which a plain first layer
  never runs (1.5x its flops). Instead the tangent of the kernel and of ``r``
  is written member by member, ``dy_k = x_k @ T_k``, as one batched matmul of
  ``x`` against the stacked ``[E, in, out]`` tangent kernels: its transpose
  forms every member's kernel gradient ``M_k = x_k^T g_k`` in one batched
  matmul (the flops of the plain layer's kernel gradient), and ``dW`` and
  ``dr`` are reductions of ``M``. That ``[E, in, out]`` array is the price,
  in memory traffic (``docs/cost.md`` has the figures per chip).

Forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``),
``jax.linear_transpose`` and ``jax.vmap`` go through the same rule, every
matmul at the op's ``precision`` and ``preferred_element_type``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ensembles.ops import groups

__all__ = ["member_matmul"]


def _batched(lhs, stacked, precision, pet):
    """``[E, ..., in] x [E, in, out] -> [E, ..., out]``: the members are the batch."""
    dimensions = (((lhs.ndim - 1,), (1,)), ((0,), (0,)))
    return lax.dot_general(
        lhs, stacked, dimensions, precision=precision, preferred_element_type=pet
    )


def _shared(lhs, kernel, precision, pet):
    """``[E, ..., in] x [in, out] -> [E, ..., out]``: the shared kernel, no batch."""
    dimensions = (((lhs.ndim - 1,), (0,)), ((), ()))
    return lax.dot_general(
        lhs, kernel, dimensions, precision=precision, preferred_element_type=pet
    )


def _member(vectors, like):
    """``[E, F]`` -> ``[E, 1, ..., F]``, broadcasting against ``like``."""
    return vectors.reshape(vectors.shape[0], *(1,) * (like.ndim - 2), -1)


def _stack(kernel, like):
    """``kernel`` broadcast to ``[E, in, out]``: read per member, never written.

    Placed as ``like``'s members (or groups) under an explicit mesh.
    """
    stacked = jnp.broadcast_to(kernel, (like.shape[0], *kernel.shape))
    return groups.place_as_groups(stacked, like)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def member_matmul(x3, kernel, r, s, precision, preferred_element_type):
    """``((x * r) @ kernel) * s`` on the ``[E, B, ..., in]`` view: one batched matmul.

    >>> import jax.numpy as jnp
    >>> x3 = jnp.ones((2, 3, 4))                    # E=2, B=3, in=4
    >>> r = jnp.stack([jnp.ones(4), 2 * jnp.ones(4)])
    >>> member_matmul(x3, jnp.ones((4, 5)), r, jnp.ones((2, 5)), None, None)[:, 0, 0]
    Array([4., 8.], dtype=float32)

    Args:
      x3: ``[E, B, ..., in]`` inputs, member ``k``'s rows in ``x3[k]`` (or
        ``[G, R, ..., in]``, with ``r`` and ``s`` per group:
        :mod:`ensembles.ops.groups`).
      kernel: ``[in, out]``.
      r: ``[E, in]``.
      s: ``[E, out]``.
      precision: of every matmul, forward and backward.
      preferred_element_type: of every matmul, forward and backward.

    Returns:
      ``[E, B, ..., out]``.
    """
    z = _batched(
        x3 * _member(r, x3),
        _stack(kernel, x3),
        precision,
        preferred_element_type,
    )
    return z * _member(s, z)


def _member_matmul_jvp(precision, pet, primals, tangents):
    x3, kernel, r, s = primals
    dx, dkernel, dr, ds = (None if type(t) is SymbolicZero else t for t in tangents)
    stacked = _stack(kernel, x3)
    scaled = x3 * _member(r, x3)
    z = _batched(scaled, stacked, precision, pet)
    s_rows = _member(s, z)
    y = z * s_rows
    terms = []
    if dx is None and dr is not None:
        # A first layer: the stacked tangent kernels T_k; transposed, every
        # member's kernel gradient from one batched matmul, dW and dr its
        # reductions. Each factor saved for that is a vector or the kernel.
        tangent = kernel[None] * (dr[:, :, None] * s[:, None, :])
        if dkernel is not None:
            tangent = tangent + dkernel[None] * (r[:, :, None] * s[:, None, :])
        terms.append(_batched(x3, tangent.astype(kernel.dtype), precision, pet))
    else:
        scaled_tangent = []
        if dx is not None:
            scaled_tangent.append(dx * _member(r, x3))
        if dr is not None:
            scaled_tangent.append(x3 * _member(dr, x3))
        if scaled_tangent:
            product = _batched(sum(scaled_tangent), stacked, precision, pet)
            terms.append(product * s_rows)
        if dkernel is not None:
            terms.append(_shared(scaled, dkernel, precision, pet) * s_rows)
    if ds is not None:
        terms.append(z * _member(ds, z))
    if not terms:  # nothing differentiated (jax.jvp with zero tangents)
        return y, jnp.zeros_like(y)
    return y, sum(terms).astype(y.dtype)


member_matmul.defjvp(_member_matmul_jvp, symbolic_zeros=True)
