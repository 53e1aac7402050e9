"""Per-member normalization ops on a member-major ``[E*B, ...]`` batch.

Member ``k`` normalizes its rows ``[k*B, (k+1)*B)`` exactly as the Flax norm
would on those rows alone, with its own scale ``scale[k]`` and bias ``bias[k]``
(and, for batch norm, its own statistics): no statistic ever mixes members.

The ops view the batch as ``[E, B, ...]`` and shift every axis the Flax norm
would use by one, so the statistics are computed as Flax computes them (in at
least float32, with the same fast-variance formula and ``pmean`` over
``axis_name``) on each member separately; the normalization itself is applied
to the flat ``[E*B, ...]`` batch with per-row statistics and parameters on the
CPU, in the view on GPUs and TPUs.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ensembles._checks import (
    as_array,
    check_bool,
    check_member_batch,
    check_num_members,
)
from ensembles.ops import platform

__all__ = [
    "ensemble_batch_norm",
    "ensemble_batch_statistics",
    "ensemble_layer_norm",
    "ensemble_rms_norm",
]

Axes = int | Sequence[int]


def _axes(axes: Axes, ndim: int, name: str) -> tuple[int, ...]:
    """Sorted, deduplicated non-negative axes of the per-member rows."""
    values = (axes,) if not isinstance(axes, Sequence) else tuple(axes)
    out = set()
    for a in values:
        if isinstance(a, bool):
            raise TypeError(f"`{name}` must hold ints, got {a!r} in {axes!r}.")
        try:
            a = operator.index(a)
        except TypeError:
            raise TypeError(
                f"`{name}` must hold ints, got {a!r} in {axes!r}."
            ) from None
        if not -ndim <= a < ndim:
            raise ValueError(
                f"`{name}` (={axes!r}) holds {a}, out of range for inputs of rank "
                f"{ndim}: axes must be in [-{ndim}, {ndim})."
            )
        out.add(a % ndim)
    return tuple(sorted(out))


def _members_view(inputs, num_members: int):
    """``[E*B, ...]`` -> ``[E, B, ...]``, after checking the batch."""
    inputs = as_array(inputs, "inputs")
    if inputs.ndim < 1:
        raise ValueError(
            f"`inputs` must have shape [E*B, ...] (at least 1 dimension), got "
            f"shape {inputs.shape}."
        )
    check_member_batch(inputs.shape[0], num_members)
    return inputs.reshape(num_members, -1, *inputs.shape[1:])


def _members_mask(mask, inputs, num_members):
    if mask is None:
        return None
    mask = jnp.broadcast_to(as_array(mask, "mask"), inputs.shape)
    return mask.reshape(num_members, -1, *inputs.shape[1:])


def _abs_sq(x):
    if jnp.iscomplexobj(x):
        return lax.square(lax.real(x)) + lax.square(lax.imag(x))
    return lax.square(x)


def _statistics(
    members,
    axes,
    dtype,
    axis_name,
    axis_index_groups,
    use_mean,
    use_fast_variance,
    mask,
):
    """Flax's ``_compute_stats`` over ``axes`` of the ``[E, B, ...]`` view."""
    if dtype is None:
        dtype = jnp.result_type(members)
    # Statistics in at least float32, as Flax computes them.
    dtype = jnp.promote_types(dtype, jnp.float32)
    x = jnp.asarray(members, dtype)

    def mean(*xs):
        mus = tuple(v.mean(axes, where=mask) for v in xs)
        if axis_name is None:
            return mus
        # Stacked so that one collective carries every statistic.
        reduced = lax.pmean(
            jnp.stack(mus), axis_name, axis_index_groups=axis_index_groups
        )
        return tuple(reduced[i] for i in range(len(xs)))

    if use_mean:
        if use_fast_variance:
            mu, mu2 = mean(x, _abs_sq(x))
            var = jnp.maximum(0.0, mu2 - _abs_sq(mu))
        else:
            (mu,) = mean(x)
            (var,) = mean(_abs_sq(x - jnp.expand_dims(mu, axes)))
    else:
        (var,) = mean(_abs_sq(x))
        mu = jnp.zeros_like(var)
    return mu, var


def _result_dtype(*args, dtype):
    """Flax's ``canonicalize_dtype``: ``dtype``, else the inexact result type."""
    if dtype is None:
        dtype = jnp.result_type(*(jnp.asarray(a) for a in args if a is not None))
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    return dtype


def _check_params(members, feature_axes, params):
    """Checks each ``[E, features]`` parameter against the feature axes."""
    num_members = members.shape[0]
    features = 1
    for a in feature_axes:
        features *= members.shape[a]
    axes = tuple(a - 1 for a in feature_axes)
    for name, value in params.items():
        if value is None:
            continue
        if value.ndim != 2 or value.shape != (num_members, features):
            raise ValueError(
                f"The feature axes {axes} of `inputs` hold {features} features "
                f"per row (each member's rows have shape {members.shape[1:]}), so "
                f"`{name}` must have shape [num_members, features] = "
                f"{(num_members, features)}; got {tuple(value.shape)}. Check the "
                f"inputs' feature size against the norm's `num_features`."
            )


def _rows(a, members):
    """A statistic or parameter of the ``[E, B, ...]`` view, per row.

    ``a`` broadcasts against the view with its member axis whole and its row
    axis 1 (or ``B``); it comes back broadcasting against the flat ``[E*B,
    ...]`` batch, each row holding its member's values: the normalization is
    applied in the batch's own layout, never through the ``[E, B, ...]`` view
    (which XLA's CPU backend copies around a convolution; ``docs/cost.md``).
    """
    num_members, batch = members.shape[:2]
    if a.shape[1] != batch:
        a = jnp.repeat(a, batch, axis=1, total_repeat_length=batch)
    return a.reshape(num_members * batch, *a.shape[2:])


def _normalize(
    members, mean, var, scale, bias, reduction_axes, feature_axes, dtype, epsilon
):
    """Flax's ``_normalize`` per member.

    Applied in the flat ``[E*B, ...]`` batch's own layout with per-row
    statistics and parameters on the CPU, in the ``[E, B, ...]`` view on GPUs
    and TPUs (:func:`ensembles.ops.platform.by_platform`), where per-row
    copies would be arrays of their own (a TPU makes them in slices, and
    their transposes in the backward are scatters).
    """
    stats_shape = list(members.shape)
    for a in reduction_axes:
        stats_shape[a] = 1
    feature_shape = [1] * members.ndim
    feature_shape[0] = members.shape[0]
    for a in feature_axes:
        feature_shape[a] = members.shape[a]
    shapes = (tuple(stats_shape), tuple(feature_shape))

    def formula(members, mean, var, scale, bias, *, per_row):
        if per_row:
            x = members.reshape(-1, *members.shape[2:])
            fit = functools.partial(_rows, members=members)
        else:
            x, fit = members, lambda a: a
        mul = lax.rsqrt(fit(var.reshape(shapes[0])) + epsilon)
        y = x - fit(mean.reshape(shapes[0]))
        if scale is not None:
            mul = mul * fit(scale.reshape(shapes[1]))
        y = y * mul
        if bias is not None:
            y = y + fit(bias.reshape(shapes[1]))
        return y.reshape(-1, *members.shape[2:])

    y = platform.by_platform(
        members,
        mean,
        var,
        scale,
        bias,
        cpu=functools.partial(formula, per_row=True),
        accelerator=functools.partial(formula, per_row=False),
    )
    args = [a for a in (members, scale, bias) if a is not None]
    return jnp.asarray(y, _result_dtype(*args, dtype=dtype))


def _per_sample_norm(
    inputs,
    scale,
    bias,
    *,
    num_members,
    epsilon,
    dtype,
    reduction_axes,
    feature_axes,
    axis_name,
    axis_index_groups,
    use_mean,
    use_fast_variance,
    mask,
):
    num_members = check_num_members(num_members)
    use_fast_variance = check_bool(use_fast_variance, "use_fast_variance")
    inputs = as_array(inputs, "inputs")
    scale = None if scale is None else as_array(scale, "scale")
    bias = None if bias is None else as_array(bias, "bias")
    members = _members_view(inputs, num_members)
    ndim = members.ndim - 1
    reduction = tuple(a + 1 for a in _axes(reduction_axes, ndim, "reduction_axes"))
    features = tuple(a + 1 for a in _axes(feature_axes, ndim, "feature_axes"))
    _check_params(members, features, {"scale": scale, "bias": bias})
    mask = _members_mask(mask, inputs, num_members)
    mean, var = _statistics(
        members,
        reduction,
        dtype,
        axis_name,
        axis_index_groups,
        use_mean,
        use_fast_variance,
        mask,
    )
    return _normalize(
        members, mean, var, scale, bias, reduction, features, dtype, epsilon
    )


def ensemble_layer_norm(
    inputs: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    *,
    num_members: int,
    epsilon: float = 1e-6,
    dtype: Any = None,
    reduction_axes: Axes = -1,
    feature_axes: Axes = -1,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    use_fast_variance: bool = True,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Layer norm of a member-major batch with per-member scale and bias.

    Member ``k``'s rows ``[k*B, (k+1)*B)`` are normalized as ``nnx.LayerNorm``
    normalizes them, with scale ``scale[k]`` and bias ``bias[k]``. The axes
    count the axes of one member's ``[B, ...]`` rows (the batch has the same
    rank); a reduction over axis 0 reduces over the member's own rows only.

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import ensemble_layer_norm
    >>> x = jnp.array([[1., 3.], [1., 3.]])             # E=2 members, B=1
    >>> scale = jnp.array([[1., 1.], [2., 2.]])         # [E, features]
    >>> bias = jnp.zeros((2, 2))
    >>> ensemble_layer_norm(x, scale, bias, num_members=2, epsilon=0.0)
    Array([[-1.,  1.],
           [-2.,  2.]], dtype=float32)

    Args:
      inputs: ``[E*B, ...]`` member-major batch.
      scale: ``[E, features]`` per-member scale, or ``None``.
      bias: ``[E, features]`` per-member bias, or ``None``.
      num_members: the ensemble size E.
      epsilon: added to the variance to avoid dividing by zero.
      dtype: the result dtype (default: inferred from inputs and parameters).
      reduction_axes: the axes the statistics are computed over.
      feature_axes: the axes the scale and bias index (``features`` is the
        product of their sizes).
      axis_name: a mapped axis to average the statistics over (``pmean``).
      axis_index_groups: groups of indices within ``axis_name``.
      use_fast_variance: compute the variance as ``E[x^2] - E[x]^2``.
      mask: booleans broadcastable to ``inputs``: the entries the statistics
        count.

    Returns:
      The normalized ``[E*B, ...]`` batch.

    Raises:
      ValueError: if the batch is not a multiple of ``num_members``, an axis is
        out of range, or ``scale``/``bias`` have the wrong shape.
      TypeError: if ``num_members`` or an axis is not an int.
    """
    # Every argument, as given: the public signature stays explicit.
    return _per_sample_norm(**locals(), use_mean=True)


def ensemble_rms_norm(
    inputs: jax.Array,
    scale: jax.Array | None,
    *,
    num_members: int,
    epsilon: float = 1e-6,
    dtype: Any = None,
    reduction_axes: Axes = -1,
    feature_axes: Axes = -1,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    use_fast_variance: bool = True,
    mask: jax.Array | None = None,
) -> jax.Array:
    """RMS norm of a member-major batch with a per-member scale.

    Member ``k``'s rows are normalized as ``nnx.RMSNorm`` normalizes them
    (divided by their root mean square, not re-centred), with scale
    ``scale[k]``.

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import ensemble_rms_norm
    >>> x = jnp.array([[3., 4.], [3., 4.]])             # E=2 members, B=1
    >>> scale = jnp.array([[1., 1.], [2., 2.]])         # [E, features]
    >>> y = ensemble_rms_norm(x, scale, num_members=2, epsilon=0.0)
    >>> jnp.round(y * jnp.sqrt(12.5), 4)
    Array([[3., 4.],
           [6., 8.]], dtype=float32)

    Args:
      inputs: ``[E*B, ...]`` member-major batch.
      scale: ``[E, features]`` per-member scale, or ``None``.
      num_members: the ensemble size E.
      epsilon: added to the mean square to avoid dividing by zero.
      dtype: the result dtype (default: inferred from inputs and scale).
      reduction_axes: the axes the statistics are computed over.
      feature_axes: the axes the scale indexes.
      axis_name: a mapped axis to average the statistics over (``pmean``).
      axis_index_groups: groups of indices within ``axis_name``.
      use_fast_variance: accepted for parity with Flax (no mean is taken).
      mask: booleans broadcastable to ``inputs``: the entries the statistics
        count.

    Returns:
      The normalized ``[E*B, ...]`` batch.

    Raises:
      ValueError: as :func:`ensemble_layer_norm`.
      TypeError: as :func:`ensemble_layer_norm`.
    """
    return _per_sample_norm(**locals(), bias=None, use_mean=False)


def _batch_axes(members, axis):
    ndim = members.ndim - 1
    features = tuple(a + 1 for a in _axes(axis, ndim, "axis"))
    reduction = tuple(a for a in range(1, members.ndim) if a not in features)
    return reduction, features


def ensemble_batch_statistics(
    inputs: jax.Array,
    *,
    num_members: int,
    axis: Axes = -1,
    dtype: Any = None,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    use_fast_variance: bool = True,
    mask: jax.Array | None = None,
    num_features: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-member batch mean and variance of a member-major batch.

    Member ``k``'s statistics are those ``nnx.BatchNorm`` computes on its rows
    ``[k*B, (k+1)*B)`` alone: over every axis but the feature ``axis``, in at
    least float32.

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import ensemble_batch_statistics
    >>> x = jnp.array([[0.], [2.], [10.], [14.]])       # E=2 members, B=2
    >>> mean, var = ensemble_batch_statistics(x, num_members=2)
    >>> mean, var
    (Array([[ 1.],
           [12.]], dtype=float32), Array([[1.],
           [4.]], dtype=float32))

    Args:
      inputs: ``[E*B, ...]`` member-major batch.
      num_members: the ensemble size E.
      axis: the feature axis (or axes) of each member's rows; never reduced.
      dtype: the minimal dtype of the statistics (always at least float32).
      axis_name: a mapped axis to average the statistics over (``pmean``).
      axis_index_groups: groups of indices within ``axis_name``.
      use_fast_variance: compute the variance as ``E[x^2] - E[x]^2``.
      mask: booleans broadcastable to ``inputs``: the entries the statistics
        count.
      num_features: if given, the number of features the feature axes must
        hold (the size of the running averages they will update).

    Returns:
      ``(mean, var)``, each ``[E, features]``.

    Raises:
      ValueError: if the batch is not a multiple of ``num_members``, ``axis``
        is out of range or the features are not ``num_features``.
      TypeError: if ``num_members`` or an axis is not an int.
    """
    num_members = check_num_members(num_members)
    use_fast_variance = check_bool(use_fast_variance, "use_fast_variance")
    inputs = as_array(inputs, "inputs")
    members = _members_view(inputs, num_members)
    reduction, features = _batch_axes(members, axis)
    if num_features is not None:
        # Checked against a placeholder of the expected shape, for the message.
        placeholder = jax.ShapeDtypeStruct((num_members, num_features), jnp.float32)
        _check_params(members, features, {"mean": placeholder})
    mask = _members_mask(mask, inputs, num_members)
    mean, var = _statistics(
        members,
        reduction,
        dtype,
        axis_name,
        axis_index_groups,
        True,
        use_fast_variance,
        mask,
    )
    return mean.reshape(num_members, -1), var.reshape(num_members, -1)


def ensemble_batch_norm(
    inputs: jax.Array,
    mean: jax.Array,
    var: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    *,
    num_members: int,
    axis: Axes = -1,
    epsilon: float = 1e-5,
    dtype: Any = None,
) -> jax.Array:
    """Normalizes each member's rows with that member's statistics.

    Member ``k``'s rows are normalized as ``nnx.BatchNorm`` does with mean
    ``mean[k]``, variance ``var[k]``, scale ``scale[k]`` and bias ``bias[k]``:
    the statistics are the batch statistics of
    :func:`ensemble_batch_statistics` in training and the running averages in
    evaluation.

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import ensemble_batch_norm
    >>> x = jnp.array([[0.], [2.], [10.], [14.]])       # E=2 members, B=2
    >>> mean, var = jnp.array([[1.], [12.]]), jnp.array([[1.], [4.]])
    >>> ensemble_batch_norm(x, mean, var, None, None, num_members=2,
    ...                     epsilon=0.0)[:, 0]
    Array([-1.,  1., -1.,  1.], dtype=float32)

    Args:
      inputs: ``[E*B, ...]`` member-major batch.
      mean: ``[E, features]`` per-member means.
      var: ``[E, features]`` per-member variances.
      scale: ``[E, features]`` per-member scale, or ``None``.
      bias: ``[E, features]`` per-member bias, or ``None``.
      num_members: the ensemble size E.
      axis: the feature axis (or axes) of each member's rows.
      epsilon: added to the variance to avoid dividing by zero.
      dtype: the result dtype (default: inferred from inputs and parameters).

    Returns:
      The normalized ``[E*B, ...]`` batch.

    Raises:
      ValueError: if the batch is not a multiple of ``num_members``, ``axis``
        is out of range or a statistic or parameter has the wrong shape.
      TypeError: if ``num_members`` or an axis is not an int.
    """
    num_members = check_num_members(num_members)
    members = _members_view(inputs, num_members)
    reduction, features = _batch_axes(members, axis)
    mean, var = as_array(mean, "mean"), as_array(var, "var")
    scale = None if scale is None else as_array(scale, "scale")
    bias = None if bias is None else as_array(bias, "bias")
    _check_params(
        members, features, {"mean": mean, "var": var, "scale": scale, "bias": bias}
    )
    return _normalize(
        members, mean, var, scale, bias, reduction, features, dtype, epsilon
    )
