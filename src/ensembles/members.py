"""Moving between un-tiled ``[B, ...]`` batches and member-major ``[E*B, ...]`` ones."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ensembles._checks import as_array, check_member_batch, check_num_members

__all__ = ["by_member_view", "by_row", "per_row", "tile", "untile"]


def _check_has_batch_axis(x: jax.Array, name: str) -> None:
    if x.ndim < 1:
        raise ValueError(
            f"`{name}` must have a leading batch axis, got a scalar of shape {x.shape}."
        )


def tile(x: jax.Array, num_members: int) -> jax.Array:
    """Repeats a ``[B, ...]`` batch for every member: ``[E*B, ...]``, member-major.

    Rows ``[k*B, (k+1)*B)`` of the result are member ``k``'s copy of ``x``, so
    every member sees the same examples (the BatchEnsemble training recipe).

    >>> import jax.numpy as jnp
    >>> import ensembles
    >>> ensembles.tile(jnp.array([[1.0], [2.0]]), 3)[:, 0]
    Array([1., 2., 1., 2., 1., 2.], dtype=float32)

    Args:
      x: a ``[B, ...]`` array.
      num_members: the ensemble size E.

    Returns:
      The ``[E*B, ...]`` member-major batch.

    Raises:
      ValueError: if ``x`` is a scalar (it has no batch axis).
      TypeError: if ``x`` is not an array (e.g. ``None``).
    """
    num_members = check_num_members(num_members)
    x = as_array(x, "x")
    _check_has_batch_axis(x, "x")
    return jnp.broadcast_to(x, (num_members, *x.shape)).reshape(
        num_members * x.shape[0], *x.shape[1:]
    )


def untile(y: jax.Array, num_members: int) -> jax.Array:
    """Splits a member-major ``[E*B, ...]`` batch into ``[E, B, ...]``.

    >>> import jax.numpy as jnp
    >>> import ensembles
    >>> ensembles.untile(jnp.arange(6.0), 2)
    Array([[0., 1., 2.],
           [3., 4., 5.]], dtype=float32)

    Args:
      y: an ``[E*B, ...]`` array, e.g. the outputs of an ensemble model.
      num_members: the ensemble size E.

    Returns:
      ``y`` reshaped to ``[E, B, ...]``: entry ``k`` holds member ``k``'s rows.

    Raises:
      ValueError: if ``y.shape[0]`` is not a multiple of ``num_members``.
      TypeError: if ``y`` is not an array (e.g. ``None``).
    """
    num_members = check_num_members(num_members)
    y = as_array(y, "y")
    _check_has_batch_axis(y, "y")
    batch = check_member_batch(y.shape[0], num_members, name="y.shape[0]")
    return y.reshape(num_members, batch, *y.shape[1:])


def per_row(weights: jax.Array, rows: int, ndim: int) -> jax.Array:
    """Per-member vectors ``[E, C]`` as per-row vectors ``[E*B, 1, ..., 1, C]``.

    Row ``i`` of the result is member ``i // B``'s vector (``B = rows // E``),
    shaped to broadcast against a member-major ``[E*B, ..., C]`` array of
    ``ndim`` dimensions in that array's own layout: how the ops apply ``r``,
    ``s`` and biases. Multiplying by it is one elementwise pass XLA fuses with
    its neighbours, where viewing the activations as ``[E, B, ..., C]`` makes
    XLA's CPU backend copy them around a convolution (``docs/cost.md``).

    >>> import jax.numpy as jnp
    >>> from ensembles.members import per_row
    >>> per_row(jnp.array([[1.0, 2.0], [3.0, 4.0]]), 4, 3)[:, 0, :]
    Array([[1., 2.],
           [1., 2.],
           [3., 4.],
           [3., 4.]], dtype=float32)
    >>> per_row(jnp.ones((2, 5)), 6, 4).shape
    (6, 1, 1, 5)

    Args:
      weights: ``[E, C]`` per-member vectors.
      rows: ``E*B``, the member-major array's leading size.
      ndim: the member-major array's number of dimensions (at least 2).

    Returns:
      The ``[E*B, 1, ..., 1, C]`` per-row vectors.
    """
    weights = as_array(weights, "weights")
    num_members, channels = weights.shape
    repeated = jnp.repeat(
        weights, rows // num_members, axis=0, total_repeat_length=rows
    )
    return repeated.reshape(rows, *(1,) * (ndim - 2), channels)


def by_row(array: jax.Array, weights: jax.Array, op: Callable) -> jax.Array:
    """``op(array, w)`` with ``w`` each row's member's vector, in ``array``'s layout.

    How the CPU's formulations apply ``r``, ``s`` and biases
    (:func:`per_row`): one elementwise pass XLA's CPU backend fuses with its
    neighbours, no copy of the activations.

    >>> import operator
    >>> import jax.numpy as jnp
    >>> by_row(jnp.ones((4, 2)), jnp.array([[1.0, 2.0], [3.0, 4.0]]), operator.mul)
    Array([[1., 2.],
           [1., 2.],
           [3., 4.],
           [3., 4.]], dtype=float32)

    Args:
      array: a member-major ``[E*B, ..., C]`` array.
      weights: ``[E, C]`` per-member vectors.
      op: a binary elementwise function (``operator.mul``, ``operator.add``).

    Returns:
      An array of ``array``'s shape.
    """
    return op(array, per_row(weights, array.shape[0], array.ndim))


def by_member_view(array: jax.Array, weights: jax.Array, op: Callable) -> jax.Array:
    """``op(array, w)`` with ``w`` each row's member's vector, in the member view.

    How the accelerators' formulations apply ``r``, ``s`` and biases: the
    member axis of the ``[E, B, ...]`` view meets ``weights``' own, a
    broadcast that GPU and TPU compilers fuse into the neighbouring matmul or
    convolution, where a per-row copy of the vectors (:func:`by_row`) is an
    array of its own there (a TPU gathers it in slices).

    >>> import operator
    >>> import jax.numpy as jnp
    >>> by_member_view(jnp.ones((4, 2)), jnp.array([[1.0, 2.0], [3.0, 4.0]]),
    ...                operator.mul)[:, 1]
    Array([2., 2., 4., 4.], dtype=float32)

    Args:
      array: a member-major ``[E*B, ..., C]`` array.
      weights: ``[E, C]`` per-member vectors.
      op: a binary elementwise function.

    Returns:
      An array of ``array``'s shape.
    """
    num_members, channels = weights.shape
    rows = array.shape[0] // num_members  # not -1: an empty axis leaves it open
    view = array.reshape(num_members, rows, *array.shape[1:])
    vectors = weights.reshape(num_members, *(1,) * (view.ndim - 2), channels)
    return op(view, vectors).reshape(array.shape)
