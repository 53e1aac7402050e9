"""The BatchEnsemble transposed convolution op: validation and jnp formulation.

Member ``k`` of :func:`batch_ensemble_conv_transpose` maps its rows
``[k*B, (k+1)*B)`` of a member-major, channels-last batch as
``nnx.ConvTranspose`` with kernel ``kernel * (r[k] (x) s[k])`` would: one
shared ``lax.conv_transpose`` between the scalings by ``r`` and ``s``. The
wrap-around sums of a circular transposed convolution commute with the
per-channel scaling by ``s``. Plain ``jnp``, differentiated by JAX's own rules.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax

from ensembles._checks import (
    as_operands,
    check_bool,
    check_choice,
    check_num_members,
)
from ensembles.members import by_member_view, by_row
from ensembles.ops import groups, platform
from ensembles.ops.conv_options import (
    IntOrSequence,
    PaddingLike,
    check_padding,
    check_shapes,
    flatten_batch,
    spatial_tuple,
)
from ensembles.ops.impls import CONV_IMPLS

__all__ = ["batch_ensemble_conv_transpose", "conv_transpose_rows"]


def conv_transpose_rows(
    inputs,
    kernel,
    r,
    s,
    bias,
    *,
    num_members,
    strides,
    padding,
    kernel_dilation,
    transpose_kernel,
    precision,
    preferred_element_type,
):
    """The transposed convolution of already-checked operands and options.

    What :func:`batch_ensemble_conv_transpose` runs after its checks, and what
    the layer calls with the options it checked at construction: ``r`` and
    ``s`` (and the bias) applied around one ``lax.conv_transpose``, as per-row
    vectors on the CPU and in the ``[E, B, ...]`` view on GPUs and TPUs
    (:func:`ensembles.ops.platform.by_platform`). Plain differentiation gives
    its gradients. The arrays' shapes are checked
    here (a ``ValueError`` says which does not fit).
    """
    rank = check_shapes(
        inputs, kernel, r, s, bias, num_members, transpose_kernel=transpose_kernel
    )
    batch_shape = inputs.shape[: -rank - 1]
    options = (strides, padding, kernel_dilation, transpose_kernel, precision,
               preferred_element_type)  # fmt: skip
    x = flatten_batch(inputs, rank)
    shards = groups.row_shards(x)
    if shards is not None:
        # Rows the program may shard: the member view's formula on every
        # platform, over groups each device holds whole (ops/groups.py).
        num_groups = groups.member_groups(
            num_rows=x.shape[0], num_members=num_members, shards=shards
        )
        r = groups.group_weights(r, num_groups, x)
        s = groups.group_weights(s, num_groups, x)
        bias = None if bias is None else groups.group_weights(bias, num_groups, x)
        y = _formula(x, kernel, r, s, bias, options=options, apply=by_member_view)
    else:
        y = platform.by_platform(
            x,
            kernel,
            r,
            s,
            bias,
            cpu=functools.partial(_formula, options=options, apply=by_row),
            accelerator=functools.partial(
                _formula, options=options, apply=by_member_view
            ),
        )
    return y.reshape(*batch_shape, *y.shape[1:])


def _formula(x, kernel, r, s, bias, *, options, apply):
    """The formula, each per-member vector applied by ``apply``.

    ``apply`` is the CPU's :func:`~ensembles.members.by_row` or the
    accelerators' :func:`~ensembles.members.by_member_view`.
    """
    strides, padding, kernel_dilation, transpose_kernel, precision, pet = options
    x = apply(x, r, operator.mul)
    y = lax.conv_transpose(
        x,
        kernel,
        strides,
        "VALID" if padding == "CIRCULAR" else padding,
        rhs_dilation=kernel_dilation,
        transpose_kernel=transpose_kernel,
        precision=precision,
        preferred_element_type=pet,
    )
    if padding == "CIRCULAR":
        # nnx.ConvTranspose's circular padding: pad each spatial axis to whole
        # periods (input size times stride) and sum the periods.
        periods = [n * stride for n, stride in zip(x.shape[1:-1], strides, strict=True)]
        size_diffs = [
            -(m - p) % (2 * p) if p else 0
            for m, p in zip(y.shape[1:-1], periods, strict=True)
        ]
        if transpose_kernel:
            pads = [(d // 2, (d + 1) // 2) for d in size_diffs]
        else:
            pads = [((d + 1) // 2, d // 2) for d in size_diffs]
        y = jnp.pad(y, [(0, 0), *pads, (0, 0)])
        for axis, period in enumerate(periods, start=1):
            if not period:
                # An empty input axis gives an empty output axis (its size
                # times the stride, as for every other padding); nnx.ConvTranspose
                # divides by the zero period here.
                y = lax.slice_in_dim(y, 0, 0, axis=axis)
                continue
            y = y.reshape(*y.shape[:axis], -1, period, *y.shape[axis + 1 :])
            y = y.sum(axis=axis)
    y = apply(y, s, operator.mul)
    if bias is not None:
        y = apply(y, bias, operator.add)
    return y


def batch_ensemble_conv_transpose(
    inputs: jax.Array,
    kernel: jax.Array,
    r: jax.Array,
    s: jax.Array,
    bias: jax.Array | None = None,
    *,
    num_members: int,
    strides: IntOrSequence = None,
    padding: PaddingLike = "SAME",
    kernel_dilation: IntOrSequence = None,
    transpose_kernel: bool = False,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    impl: str = "xla",
) -> jax.Array:
    """Applies a BatchEnsemble transposed convolution to a member-major batch.

    Rows ``[k*B, (k+1)*B)`` of ``inputs`` belong to member ``k``, which maps
    them as ``nnx.ConvTranspose`` with kernel ``effective_kernel(kernel, r[k],
    s[k], transpose_kernel=transpose_kernel)`` and bias ``bias[k]`` would: one
    shared ``lax.conv_transpose`` between the scalings by ``r`` and ``s``.
    Every argument after ``num_members`` means what it means for
    ``nnx.ConvTranspose``.

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import batch_ensemble_conv_transpose
    >>> x = jnp.ones((2 * 3, 4, 4))                  # E=2, B=3, length 4, 4 channels
    >>> kernel = jnp.ones((3, 4, 5))                 # kernel 3, in=4, out=5
    >>> r = jnp.ones((2, 4))
    >>> s = jnp.stack([jnp.ones(5), -jnp.ones(5)])   # [E, out]
    >>> y = batch_ensemble_conv_transpose(x, kernel, r, s, num_members=2,
    ...                                   strides=2)
    >>> y.shape
    (6, 8, 5)
    >>> y[:, 2, 0]
    Array([ 8.,  8.,  8., -8., -8., -8.], dtype=float32)

    Args:
      inputs: ``[E*B, ..., *spatial, in_features]`` member-major batch; extra
        batch axes after the first are flattened, as ``nnx.ConvTranspose`` does.
      kernel: the shared ``[*kernel_size, in_features, out_features]`` kernel
        (``[*kernel_size, out_features, in_features]`` with
        ``transpose_kernel=True``).
      r: ``[E, in_features]`` input fast weights.
      s: ``[E, out_features]`` output fast weights.
      bias: ``[E, out_features]`` per-member bias, or ``None``.
      num_members: the ensemble size E.
      strides: an int or one int per spatial dimension (``None``: 1).
      padding: ``'SAME'``, ``'SAME_LOWER'``, ``'VALID'`` (any case),
        ``'CIRCULAR'``, an int, or one int or ``(low, high)`` pair per spatial
        dimension. ``'CAUSAL'`` and ``'REFLECT'`` are rejected:
        ``nnx.ConvTranspose`` does not implement them either.
      kernel_dilation: an int or one int per spatial dimension (``None``: 1).
      transpose_kernel: if True, flip the spatial axes and swap the channel
        axes of the kernel, as ``jax.lax.conv_transpose`` does.
      precision: convolution precision, as for ``jax.lax.conv_transpose``.
      preferred_element_type: accumulation/output dtype of the convolution.
      impl: ``"xla"``, the one implementation.

    Returns:
      The ``[E*B, ..., *out_spatial, out_features]`` outputs. An empty spatial
      axis gives what ``nnx.ConvTranspose`` gives (with ``'CIRCULAR'``, where
      Flax divides by its zero period, an empty axis: its size times the
      stride).

    Raises:
      ValueError: if a shape, ``num_members``, an option or ``impl`` is
        invalid; the message names the argument and the fix.
      TypeError: if ``num_members`` or an option has the wrong type.
    """
    num_members = check_num_members(num_members)
    check_choice(impl, "impl", CONV_IMPLS)
    transpose_kernel = check_bool(transpose_kernel, "transpose_kernel")
    inputs, kernel, r, s, bias = as_operands(inputs, kernel, r, s, bias)
    if kernel.ndim < 3:
        raise ValueError(
            f"`kernel` must have shape [*kernel_size, in, out] with at least one "
            f"spatial dimension, got shape {kernel.shape}."
        )
    rank = kernel.ndim - 2
    return conv_transpose_rows(
        inputs,
        kernel,
        r,
        s,
        bias,
        num_members=num_members,
        strides=spatial_tuple(strides, "strides", rank),
        padding=check_padding(padding, rank, transpose=True),
        kernel_dilation=spatial_tuple(kernel_dilation, "kernel_dilation", rank),
        transpose_kernel=bool(transpose_kernel),
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
