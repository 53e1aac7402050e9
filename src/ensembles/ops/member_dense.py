"""E independent dense layers on one member-major batch: a kernel per member.

Member ``k`` maps its rows ``[k*B, (k+1)*B)`` as ``x @ kernel[k] + bias[k]``:
one matmul batched over the members of the ``[E, B, in]`` view against the
stacked ``[E, in, out]`` kernels. Nothing is shared: it is a deep ensemble's
layer on a BatchEnsemble's rows (TabM's independent heads), for the layers
whose members should differ most, such as the output layer. Differentiated by
JAX.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ensembles._checks import (
    add_batch_axis_fix,
    as_array,
    check_member_batch,
    check_num_members,
)

__all__ = ["ensemble_dense", "ensemble_dense_rows"]

_BATCHED = (((2,), (1,)), ((0,), (0,)))  # [E, B, in] x [E, in, out]


def ensemble_dense_rows(
    inputs: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """The op on checked operands (what :class:`ensembles.EnsembleLinear` runs).

    Args:
      inputs: ``[E*B, ..., in]``.
      kernel: ``[E, in, out]``; E is read from it.
      bias: ``[E, out]`` or ``None``.
      precision: of the matmul.
      preferred_element_type: of the matmul.

    Returns:
      ``[E*B, ..., out]``.
    """
    num_members, in_features, out_features = kernel.shape
    # Each member's rows and middle axes, flat (not -1: an empty axis would
    # leave it open).
    rows = math.prod(inputs.shape[:-1]) // num_members
    x3 = inputs.reshape(num_members, rows, in_features)
    y = lax.dot_general(
        x3,
        kernel,
        _BATCHED,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    if bias is not None:
        y = y + bias[:, None, :]
    return y.reshape(*inputs.shape[:-1], out_features)


def check_shapes(inputs, kernel, bias, num_members: int) -> None:
    """Checks the op's array shapes (the message names the argument).

    Raises:
      ValueError: if a shape does not fit the others.
    """
    if inputs.ndim < 2:
        raise ValueError(
            f"`inputs` must have shape [E*B, ..., in_features] (at least 2 "
            f"dimensions), got shape {inputs.shape}. " + add_batch_axis_fix(num_members)
        )
    if kernel.ndim != 3 or kernel.shape[0] != num_members:
        raise ValueError(
            f"`kernel` must have shape [E, in_features, out_features] with E = "
            f"num_members = {num_members}, got shape {kernel.shape}."
        )
    if inputs.shape[-1] != kernel.shape[1]:
        raise ValueError(
            f"`inputs.shape[-1]` (={inputs.shape[-1]}) must equal in_features "
            f"(`kernel.shape[1]`={kernel.shape[1]}); got inputs of shape "
            f"{inputs.shape}."
        )
    check_member_batch(inputs.shape[0], num_members)
    if bias is not None and bias.shape != (num_members, kernel.shape[2]):
        raise ValueError(
            f"`bias` must have shape [E, out_features] = "
            f"{(num_members, kernel.shape[2])}, got shape {bias.shape}."
        )


def ensemble_dense(
    inputs: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    num_members: int,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
) -> jax.Array:
    """Applies E independent dense layers to a member-major batch.

    Rows ``[k*B, (k+1)*B)`` of ``inputs`` belong to member ``k``, which maps
    them as ``x @ kernel[k] + bias[k]``.

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import ensemble_dense
    >>> x = jnp.ones((2 * 3, 4))                      # E=2 members, B=3 rows each
    >>> kernel = jnp.stack([jnp.ones((4, 5)), 2 * jnp.ones((4, 5))])  # [E, in, out]
    >>> ensemble_dense(x, kernel, num_members=2)[:, 0]
    Array([4., 4., 4., 8., 8., 8.], dtype=float32)

    Args:
      inputs: ``[E*B, ..., in_features]`` member-major batch.
      kernel: ``[E, in_features, out_features]``, one kernel per member.
      bias: ``[E, out_features]`` or ``None``.
      num_members: the ensemble size E.
      precision: the matmul's precision, as for ``jax.lax.dot_general``.
      preferred_element_type: its accumulation/output dtype.

    Returns:
      The ``[E*B, ..., out_features]`` outputs.

    Raises:
      ValueError: if a shape or ``num_members`` is invalid (the message names
        the argument).
      TypeError: if ``num_members`` is not an int or an array argument is not
        an array.
    """
    num_members = check_num_members(num_members)
    inputs = as_array(inputs, "inputs")
    kernel = as_array(kernel, "kernel")
    bias = None if bias is None else as_array(bias, "bias")
    check_shapes(inputs, kernel, bias, num_members)
    return ensemble_dense_rows(
        inputs,
        kernel,
        bias,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
