"""The BatchEnsemble general dense op: ``nnx.LinearGeneral``'s contraction per member.

Member ``k`` of the op maps its rows ``[k*B, (k+1)*B)`` of the member-major batch
as ``nnx.LinearGeneral`` would with the effective kernel::

    kernel * r[k][(None,) * n_batch + (...,) + (None,) * n_out]
           * s[k][(None,) * (n_batch + n_in) + (...,)]

that is, ``r[k]`` (shape ``in_features``) scales the contracted input features and
``s[k]`` (shape ``out_features``) the output features; both are shared across the
kernel's batch axes, if any. The bias is per member *and* per kernel batch index,
``[E, *batch_shape, *out_features]``, because Flax's bias has the batch axes.

Without kernel batch axes the op moves the contracted axes last, flattens them
and calls :func:`ensembles.ops.batch_ensemble_dense` (so it runs whatever kernel
``impl`` selects). With batch axes there is no single shared matmul, and the op
uses its ``jnp`` formulation (one batched ``lax.dot_general``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ensembles._checks import (
    add_batch_axis_fix,
    as_operands,
    check_choice,
    check_member_batch,
    check_member_params,
    check_num_members,
)
from ensembles.ops import dense
from ensembles.ops.impls import IMPLS

__all__ = ["batch_ensemble_dense_general", "normalize_axes"]


def normalize_axes(axis: int | Sequence[int], ndim: int, name: str = "axis"):
    """Returns ``axis`` as a sorted tuple of non-negative axes of an ``ndim``-array.

    Sorted as ``nnx.LinearGeneral`` sorts them: the kernel's input feature axes
    pair with the contracted input axes in increasing order, whatever the order
    of ``axis``.

    Args:
      axis: an int or a sequence of ints, each in ``[-ndim, ndim)``.
      ndim: the rank of the array the axes index.
      name: the argument's name, for error messages.

    Returns:
      A sorted tuple of ints in ``[0, ndim)``.

    Raises:
      ValueError: if an axis is out of range or repeated.
      TypeError: if an axis is not an int.

    >>> normalize_axes((-1, -2), 4)
    (2, 3)
    """
    axes = (axis,) if not isinstance(axis, Sequence) else tuple(axis)
    out = []
    for a in axes:
        if isinstance(a, bool):
            raise TypeError(f"`{name}` must hold ints, got the bool {a!r}.")
        try:
            a = operator.index(a)
        except TypeError:
            raise TypeError(
                f"`{name}` must hold ints, got {a!r} of type {type(a).__name__}."
            ) from None
        if not -ndim <= a < ndim:
            raise ValueError(
                f"`{name}` (={axis!r}) holds {a}, out of range for inputs of rank "
                f"{ndim}: axes must be in [-{ndim}, {ndim})."
            )
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"`{name}` (={axis!r}) repeats an axis.")
    return tuple(sorted(out))


def _check_shapes(inputs, kernel, r, s, bias, num_members, axis, axes, num_batch_axes):
    in_features, out_features = r.shape[1:], s.shape[1:]
    if r.ndim < 2 or s.ndim < 2:
        raise ValueError(
            f"`r` and `s` must have shapes [num_members, *in_features] and "
            f"[num_members, *out_features], got {r.shape} and {s.shape}."
        )
    batch_shape = kernel.shape[:num_batch_axes]
    expected_kernel = (*batch_shape, *in_features, *out_features)
    if kernel.shape != expected_kernel:
        raise ValueError(
            f"`kernel` must have shape [*batch_shape, *in_features, *out_features]"
            f" = {expected_kernel} (in_features from `r`, out_features from `s`, "
            f"num_batch_axes={num_batch_axes}), got {kernel.shape}."
        )
    if len(axes) != len(in_features):
        raise ValueError(
            f"`axis` (={axes}) must name one input axis per input feature axis "
            f"(in_features={in_features}), got {len(axes)} axes."
        )
    if 0 in axes:
        raise ValueError(
            f"`axis` (={axis!r}) resolves to the axes {axes} of inputs of shape "
            f"{inputs.shape}, which include axis 0; but the first axis of "
            f"`inputs` carries the members (rows [k*B, (k+1)*B) are member k) and "
            f"is never contracted. Pass inputs with a batch axis in front of the "
            f"feature axes."
        )
    batch_axes = set(range(num_batch_axes))
    if batch_axes & set(axes):
        raise ValueError(
            f"`axis` (={axes}) must not contain the batch axes "
            f"{tuple(sorted(batch_axes))} of `batch_axis`."
        )
    for a, size in zip(axes, in_features, strict=True):
        if inputs.shape[a] != size:
            raise ValueError(
                f"`inputs.shape[{a}]` (={inputs.shape[a]}) must equal the input "
                f"features {size} contracted along axis {a} (in_features="
                f"{in_features}, axis={axes}); got inputs of shape {inputs.shape}."
            )
    rows = check_member_batch(inputs.shape[0], num_members)
    member_shape = (rows, *inputs.shape[1:])
    for a, size in enumerate(batch_shape):
        if member_shape[a] != size:
            name = "inputs.shape[0] // num_members" if a == 0 else f"inputs.shape[{a}]"
            raise ValueError(
                f"`{name}` (={member_shape[a]}) must equal the kernel batch size "
                f"batch_axis[{a}]={size}: the batch axes index each member's rows "
                f"(inputs of shape {inputs.shape}, num_members={num_members})."
            )
    check_member_params(
        r,
        s,
        bias,
        r_shape=(num_members, *in_features),
        s_shape=(num_members, *out_features),
        bias_shape=(num_members, *batch_shape, *out_features),
    )


def _via_dense(inputs, kernel, r, s, bias, *, axes, num_members, impl, **kwargs):
    num_in = r.ndim - 1
    out_features = s.shape[1:]
    moved = jnp.moveaxis(inputs, axes, tuple(range(-num_in, 0)))
    kept = moved.shape[: moved.ndim - num_in]
    in_size, out_size = math.prod(r.shape[1:]), math.prod(out_features)
    y = dense.dense_rows(
        moved.reshape(*kept, in_size),
        kernel.reshape(in_size, out_size),
        r.reshape(num_members, in_size),
        s.reshape(num_members, out_size),
        None if bias is None else bias.reshape(num_members, out_size),
        impl=impl,
        **kwargs,
    )
    return y.reshape(*kept, *out_features)


def _batched_xla(
    inputs, kernel, r, s, bias, *, axes, num_members, num_batch_axes, **kwargs
):
    num_in = r.ndim - 1
    out_features = s.shape[1:]
    moved = jnp.moveaxis(inputs, axes, tuple(range(-num_in, 0)))
    # [E, *batch_shape, *others, *in_features]: the member axis split off.
    members = moved.reshape(num_members, -1, *moved.shape[1:])
    num_others = members.ndim - 1 - num_batch_axes - num_in
    ones = (1,) * (num_batch_axes + num_others)
    members = members * r.reshape(num_members, *ones, *r.shape[1:])
    y = lax.dot_general(
        members,
        kernel,
        (
            (
                tuple(range(members.ndim - num_in, members.ndim)),
                tuple(range(num_batch_axes, num_batch_axes + num_in)),
            ),
            (tuple(range(1, 1 + num_batch_axes)), tuple(range(num_batch_axes))),
        ),
        **kwargs,
    )
    # dot_general puts the batch axes first: [*batch_shape, E, *others, *out].
    y = jnp.moveaxis(y, num_batch_axes, 0)
    y = y * s.reshape(num_members, *ones, *out_features)
    if bias is not None:
        batch_shape = kernel.shape[:num_batch_axes]
        y = y + bias.reshape(
            num_members, *batch_shape, *(1,) * num_others, *out_features
        )
    return y.reshape(-1, *y.shape[2:])


def batch_ensemble_dense_general(
    inputs: jax.Array,
    kernel: jax.Array,
    r: jax.Array,
    s: jax.Array,
    bias: jax.Array | None = None,
    *,
    num_members: int,
    axis: int | Sequence[int] = -1,
    num_batch_axes: int = 0,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    impl: str = "xla",
) -> jax.Array:
    """Applies a BatchEnsemble ``nnx.LinearGeneral`` to a member-major batch.

    Rows ``[k*B, (k+1)*B)`` of ``inputs`` belong to member ``k``, which contracts
    the ``axis`` axes with the kernel as ``nnx.LinearGeneral`` does, with its
    effective kernel ``kernel * r[k] * s[k]`` (``r[k]`` broadcast over the input
    feature axes of the kernel, ``s[k]`` over its output feature axes) and bias
    ``bias[k]``. Per-member kernels are never materialised.

    ``axis`` counts axes of ``inputs``, which has the rank of one member's
    ``[B, ...]`` rows; axis 0 carries the members and is never contracted. With
    ``num_batch_axes = n > 0`` (``nnx.LinearGeneral``'s ``batch_axis={0: B,
    1: ..., n-1: ...}``) the kernel's leading ``n`` axes pair with the leading
    ``n`` axes of each member's rows: ``B = inputs.shape[0] // num_members`` must
    equal ``kernel.shape[0]``.

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import batch_ensemble_dense_general
    >>> x = jnp.ones((2 * 3, 5, 4))                  # E=2, B=3, 5 tokens, 4 feats
    >>> kernel = jnp.ones((4, 2, 6))                  # in 4 -> out (2 heads, 6)
    >>> r = jnp.stack([jnp.ones(4), 2 * jnp.ones(4)])  # [E, *in_features]
    >>> s = jnp.ones((2, 2, 6))                       # [E, *out_features]
    >>> y = batch_ensemble_dense_general(x, kernel, r, s, num_members=2)
    >>> y.shape
    (6, 5, 2, 6)
    >>> y[:, 0, 0, 0]
    Array([4., 4., 4., 8., 8., 8.], dtype=float32)

    Args:
      inputs: ``[E*B, ...]`` member-major batch.
      kernel: the shared ``[*batch_shape, *in_features, *out_features]`` kernel.
      r: ``[E, *in_features]`` input fast weights.
      s: ``[E, *out_features]`` output fast weights.
      bias: ``[E, *batch_shape, *out_features]`` per-member bias, or ``None``.
      num_members: the ensemble size E.
      axis: the input axes contracted with the kernel's input feature axes;
        as in ``nnx.LinearGeneral`` they pair with them in increasing order.
        Never 0 nor a batch axis.
      num_batch_axes: the number of leading kernel axes that are batch axes.
      precision: matmul precision, as for ``jax.lax.dot_general``.
      preferred_element_type: accumulation/output dtype of the matmul.
      impl: the dense op implementation, see
        :func:`ensembles.ops.batch_ensemble_dense`. With batch axes the op always
        runs its ``jnp`` formulation (``impl`` is still checked).

    Returns:
      The ``[E*B, *uncontracted axes, *out_features]`` outputs, the uncontracted
      axes of ``inputs`` in their order, as ``nnx.LinearGeneral`` returns.

    Raises:
      ValueError: if a shape, an axis, ``num_members`` or ``impl`` is invalid.
      TypeError: if ``num_members`` or an axis is not an int.
    """
    num_members = check_num_members(num_members)
    impl = check_choice(impl, "impl", IMPLS)
    try:
        if isinstance(num_batch_axes, bool):
            raise TypeError
        num_batch_axes = operator.index(num_batch_axes)
    except TypeError:
        raise TypeError(
            f"`num_batch_axes` must be an int, got {num_batch_axes!r}."
        ) from None
    if num_batch_axes < 0:
        raise ValueError(f"`num_batch_axes` must be >= 0, got {num_batch_axes}.")
    inputs, kernel, r, s, bias = as_operands(inputs, kernel, r, s, bias)
    if inputs.ndim < 2:
        raise ValueError(
            f"`inputs` must have shape [E*B, ...] with at least 2 dimensions "
            f"(members plus the contracted features), got shape {inputs.shape}. "
            + add_batch_axis_fix(num_members)
        )
    axes = normalize_axes(axis, inputs.ndim)
    _check_shapes(inputs, kernel, r, s, bias, num_members, axis, axes, num_batch_axes)
    kwargs = {"precision": precision, "preferred_element_type": preferred_element_type}
    if num_batch_axes == 0:
        return _via_dense(
            inputs,
            kernel,
            r,
            s,
            bias,
            axes=axes,
            num_members=num_members,
            impl=impl,
            **kwargs,
        )
    return _batched_xla(
        inputs,
        kernel,
        r,
        s,
        bias,
        axes=axes,
        num_members=num_members,
        num_batch_axes=num_batch_axes,
        **kwargs,
    )
