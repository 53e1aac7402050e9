"""The BatchEnsemble convolution op: its checks, the ``jnp`` formula, its derivative.

Member ``k`` of :func:`batch_ensemble_conv` maps its rows ``[k*B, (k+1)*B)`` of
a member-major, channels-last batch as a convolution with kernel ``kernel *
(r[k] (x) s[k])`` would (per feature group, :func:`effective_kernel`). Because
``r`` scales input channels and ``s`` output channels, that is computed without
forming per-member kernels::

    y = conv(x * r_rows, W) * s_rows + bias_rows

with one ``lax.conv_general_dilated`` over the flat ``[E*B, ...]`` batch, each
per-member vector applied as a per-row vector ``[E*B, 1, ..., C]``
(:func:`ensembles.members.per_row`) in the convolution's own layout. (Viewing
the activations as ``[E, B, ..., C]`` instead made XLA's CPU backend copy them
around every convolution: a BE CNN's forward at 3x one model's; see
``docs/cost.md``.) Padding that copies input values (``CIRCULAR``,
``REFLECT``) commutes with the per-channel scaling by ``r``.

The forward is that formula. Its derivative is written member by member
(:func:`_member_tangent`, a ``jax.custom_jvp``) wherever a parameter is
differentiated: reverse mode then forms each member's kernel gradient ``M_k``
with one kernel-gradient convolution of its ``B`` rows and reads ``dW``,
``dr_k`` and ``ds_k`` off it, and the input gradient (a hidden layer's) with
one input-gradient convolution of ``B`` rows per member against its own
kernel, with no scaling passes: on XLA's CPU backend E convolutions of ``B``
rows train faster than one of ``E*B`` rows with the scalings around it
(``docs/cost.md``). Grouped convolutions, and calls that differentiate the
inputs alone, are differentiated by JAX as written.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ensembles._checks import (
    as_operands,
    check_choice,
    check_num_members,
    check_positive_int,
)
from ensembles.members import by_member_view, by_row, per_row
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

__all__ = ["batch_ensemble_conv", "conv_rows", "effective_kernel"]


def _conv(x, kernel, options):
    """The plain convolution of channels-last ``x`` with ``kernel``."""
    strides, padding, input_dilation, kernel_dilation, groups, precision, pet = options
    spatial = tuple(range(1, x.ndim - 1))
    lhs = (0, x.ndim - 1, *spatial)
    rhs = (x.ndim - 1, x.ndim - 2, *range(x.ndim - 2))
    return lax.conv_general_dilated(
        x,
        kernel,
        strides,
        padding,
        lhs_dilation=input_dilation,
        rhs_dilation=kernel_dilation,
        dimension_numbers=lax.ConvDimensionNumbers(lhs, rhs, lhs),
        feature_group_count=groups,
        precision=precision,
        preferred_element_type=pet,
    )


def _scaled_conv_formula(x, kernel, r, s, options):
    """``conv(x * r_rows, W) * s_rows`` on the flat member-major batch."""
    z = _conv(x * per_row(r, x.shape[0], x.ndim), kernel, options)
    return z * per_row(s, z.shape[0], z.ndim)


_scaled_conv = jax.custom_jvp(_scaled_conv_formula, nondiff_argnums=(4,))


def _member_tangent(x, kernel, r, s, tangents, options):
    """The tangent member by member: its transpose is the per-member backward.

    ``dy_k = conv(dx_k, W_k) + conv(x_k, T_k)`` for member ``k``'s rows, with
    ``W_k`` its effective kernel and ``T_k`` the tangent of ``W * (r_k (x)
    s_k)``; transposed, each member's kernel gradient ``M_k`` comes from one
    kernel-gradient convolution of its ``B`` rows and ``dW``, ``dr_k``,
    ``ds_k`` are reductions of it, and ``dx_k`` one input-gradient convolution
    of ``B`` rows against ``W_k``. The kernels are small: unrolled, all E
    ``M_k`` fit where the activations would not.
    """
    dx, dkernel, dr, ds = tangents
    precision, pet = options[-2:]
    num_members = r.shape[0]
    rows = x.shape[0] // num_members
    ones = (1,) * (kernel.ndim - 2)
    scaled_dtype = jnp.result_type(x, r)

    def outer(a, b):  # [in], [out] -> [1, ..., in, out] as a matmul
        product = lax.dot_general(
            a[:, None],
            b[None, :],
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=pet,
        )
        return product.reshape(*ones, *product.shape)

    outputs = []
    for k in range(num_members):
        r_k, s_k = r[k].reshape(*ones, -1, 1), s[k].reshape(*ones, 1, -1)
        tangent = []
        if dkernel is not None:
            tangent.append((dkernel * r_k) * s_k)
        if dr is not None:
            tangent.append(kernel * outer(dr[k], s[k]))
        if ds is not None:
            tangent.append(kernel * outer(r[k], ds[k]))
        # The operands in the forward convolution's dtypes: x * r's, W's.
        x_k = x[k * rows : (k + 1) * rows].astype(scaled_dtype)
        y_k = _conv(x_k, sum(tangent).astype(kernel.dtype), options)
        if dx is not None:
            member_kernel = ((kernel * r_k) * s_k).astype(kernel.dtype)
            dx_k = dx[k * rows : (k + 1) * rows].astype(scaled_dtype)
            y_k = y_k + _conv(dx_k, member_kernel, options)
        outputs.append(y_k)
    return jnp.concatenate(outputs)


def _scaled_conv_jvp(options, primals, tangents):
    live = [type(t) is not SymbolicZero for t in tangents]
    if any(live[1:]):
        y = _scaled_conv_formula(*primals, options)
        tangents = [t if on else None for t, on in zip(tangents, live, strict=True)]
        dy = _member_tangent(*primals, tangents, options)
        return y, dy.astype(y.dtype)
    return jax.jvp(
        lambda x: _scaled_conv_formula(x, *primals[1:], options),
        primals[:1],
        tangents[:1],
    )


_scaled_conv.defjvp(_scaled_conv_jvp, symbolic_zeros=True)


def effective_kernel(
    kernel: jax.Array,
    r: jax.Array,
    s: jax.Array,
    *,
    feature_group_count: int = 1,
    transpose_kernel: bool = False,
) -> jax.Array:
    """Returns one member's effective kernel ``kernel * (r (x) s)``.

    For a grouped convolution (kernel ``[*kernel_size, in/G, out]``) output
    channel ``o`` sees the input channels of its group only, so ``r`` is read
    per group. For a transposed convolution with ``transpose_kernel=True`` the
    kernel is ``[*kernel_size, out, in]``.

    >>> import jax.numpy as jnp
    >>> kernel = jnp.ones((1, 2, 4))            # kernel_size 1, in/G = 2, out = 4
    >>> r = jnp.array([1.0, 2.0, 3.0, 4.0])     # in = 4
    >>> s = jnp.ones(4)
    >>> effective_kernel(kernel, r, s, feature_group_count=2)[0]
    Array([[1., 1., 3., 3.],
           [2., 2., 4., 4.]], dtype=float32)

    Args:
      kernel: the shared kernel, in Flax's layout.
      r: ``[in_features]`` input fast weights of the member.
      s: ``[out_features]`` output fast weights of the member.
      feature_group_count: the number of feature groups G (convolution only).
      transpose_kernel: whether ``kernel`` is ``[*kernel_size, out, in]``.

    Returns:
      An array of ``kernel``'s shape and dtype.
    """
    if transpose_kernel:
        scale = jnp.outer(s, r)
    else:
        groups = feature_group_count
        in_per_group = r.shape[0] // groups
        out_per_group = s.shape[0] // groups
        # [in/G, out]: column o holds r over the input channels of o's group.
        r_columns = jnp.repeat(r.reshape(groups, in_per_group).T, out_per_group, 1)
        scale = r_columns * s[None, :]
    scale = scale.astype(kernel.dtype).reshape((1,) * (kernel.ndim - 2) + scale.shape)
    return kernel * scale


def _pad(x, padding, kernel_size, kernel_dilation):
    """Applies Flax's padding modes that copy values; lax's ``padding`` for the rest."""
    if padding in ("CIRCULAR", "REFLECT"):
        # As nnx.Conv: pad by the dilated kernel's half-widths, then VALID.
        dilated = [
            (k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation, strict=True)
        ]
        pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
        spatial = x.shape[1:-1]
        if any(k > 1 > n for n, k in zip(spatial, dilated, strict=True)):
            # nnx.Conv's jnp.pad refuses too ("Cannot apply 'wrap' padding to
            # empty axis"), naming no argument.
            raise ValueError(
                f"`inputs` has an empty spatial axis (spatial shape {spatial}) "
                f"that padding={padding!r} must pad with values of its own, and "
                f"it has none. Give every spatial axis at least one value, or "
                f"pad with 'SAME' or 'VALID'."
            )
        mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding]
        return jnp.pad(x, pads, mode=mode), "VALID"
    if padding == "CAUSAL":
        left = kernel_dilation[0] * (kernel_size[0] - 1)
        return jnp.pad(x, [(0, 0), (left, 0), (0, 0)]), "VALID"
    return x, padding


def conv_rows(
    inputs,
    kernel,
    r,
    s,
    bias,
    *,
    num_members: int,
    strides: tuple[int, ...],
    padding: Any,
    input_dilation: tuple[int, ...],
    kernel_dilation: tuple[int, ...],
    feature_group_count: int,
    precision: Any,
    preferred_element_type: Any,
) -> jax.Array:
    """The convolution, its options already checked; the arrays' shapes checked.

    What :func:`batch_ensemble_conv` runs after checking its options, and what
    the layers call with the options they checked at construction.

    Args:
      inputs: ``[E*B, ..., *spatial, in]`` member-major, channels-last.
      kernel: ``[*kernel_size, in/G, out]``.
      r: ``[E, in]``.
      s: ``[E, out]``.
      bias: ``[E, out]`` or ``None``.
      num_members: the ensemble size E (1 in a member view).
      strides: one int per spatial dimension.
      padding: in canonical form (:func:`~ensembles.ops.conv_options.check_padding`).
      input_dilation: one int per spatial dimension.
      kernel_dilation: one int per spatial dimension.
      feature_group_count: G.
      precision: of every convolution, forward and backward.
      preferred_element_type: of every convolution, forward and backward.

    Returns:
      ``[E*B, ..., *out_spatial, out]``.

    Raises:
      ValueError: if a shape does not fit the others (the message says which).
    """
    rank = check_shapes(
        inputs,
        kernel,
        r,
        s,
        bias,
        num_members,
        feature_group_count=feature_group_count,
    )
    batch_shape = inputs.shape[: -rank - 1]
    x, padding = _pad(
        flatten_batch(inputs, rank), padding, kernel.shape[:rank], kernel_dilation
    )
    if isinstance(precision, list):  # a custom_jvp's static argument must hash
        precision = tuple(precision)
    options = (
        strides,
        padding,
        input_dilation,
        kernel_dilation,
        feature_group_count,
        precision,
        preferred_element_type,
    )
    shards = groups.row_shards(x)
    if shards is not None:
        # Rows the program may shard: the accelerators' formulation on every
        # platform, over groups each device holds whole (ops/groups.py).
        num_groups = groups.member_groups(
            num_rows=x.shape[0], num_members=num_members, shards=shards
        )
        r = groups.group_weights(r, num_groups, x)
        s = groups.group_weights(s, num_groups, x)
        bias = None if bias is None else groups.group_weights(bias, num_groups, x)
        y = _accelerator_formula(x, kernel, r, s, bias, options=options)
    else:
        y = platform.by_platform(
            x,
            kernel,
            r,
            s,
            bias,
            cpu=functools.partial(_cpu_formula, options=options),
            accelerator=functools.partial(_accelerator_formula, options=options),
        )
    return y.reshape(*batch_shape, *y.shape[1:])


def _cpu_formula(x, kernel, r, s, bias, *, options):
    """The CPU's: per-row vectors, the per-member derivative (:func:`_scaled_conv`)."""
    if options[4] == 1:
        y = _scaled_conv(x, kernel, r, s, options)
    else:  # a grouped kernel's in axis holds in/G channels: JAX differentiates
        y = _scaled_conv_formula(x, kernel, r, s, options)
    if bias is not None:
        y = by_row(y, bias, operator.add)
    return y


def _accelerator_formula(x, kernel, r, s, bias, *, options):
    """GPUs' and TPUs': the ``[E, B, ...]`` view, one convolution per gradient.

    The scalings broadcast over each member's rows in the view (a TPU makes
    per-row vectors in slices: the CPU's formulation moved 12x a plain CNN's
    bytes in a v5e's forward), and JAX differentiates the formula: every
    gradient one convolution of all ``E*B`` rows, as a plain layer's.
    """
    y = by_member_view(
        _conv(by_member_view(x, r, operator.mul), kernel, options), s, operator.mul
    )
    if bias is not None:
        y = by_member_view(y, bias, operator.add)
    return y


def batch_ensemble_conv(
    inputs: jax.Array,
    kernel: jax.Array,
    r: jax.Array,
    s: jax.Array,
    bias: jax.Array | None = None,
    *,
    num_members: int,
    strides: IntOrSequence = 1,
    padding: PaddingLike = "SAME",
    input_dilation: IntOrSequence = 1,
    kernel_dilation: IntOrSequence = 1,
    feature_group_count: int = 1,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    impl: str = "xla",
) -> jax.Array:
    """Applies a BatchEnsemble convolution to a member-major, channels-last batch.

    Rows ``[k*B, (k+1)*B)`` of ``inputs`` belong to member ``k``, which
    convolves them as ``nnx.Conv`` with kernel ``effective_kernel(kernel, r[k],
    s[k], feature_group_count=G)`` and bias ``bias[k]`` would. The op scales
    the input channels by ``r``, runs one convolution shared by all members and
    scales the output channels by ``s``. Every argument after ``num_members``
    means what it means for ``nnx.Conv``.

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import batch_ensemble_conv
    >>> x = jnp.ones((2 * 3, 8, 8, 4))               # E=2, B=3, 8x8 pixels, 4 channels
    >>> kernel = jnp.ones((3, 3, 4, 5))              # 3x3, in=4, out=5
    >>> r = jnp.stack([jnp.ones(4), 2 * jnp.ones(4)])  # [E, in]
    >>> s = jnp.ones((2, 5))                           # [E, out]
    >>> y = batch_ensemble_conv(x, kernel, r, s, num_members=2, padding="VALID")
    >>> y.shape
    (6, 6, 6, 5)
    >>> y[:, 0, 0, 0]
    Array([36., 36., 36., 72., 72., 72.], dtype=float32)

    Args:
      inputs: ``[E*B, ..., *spatial, in_features]`` member-major batch; extra
        batch axes after the first are flattened, as ``nnx.Conv`` does.
      kernel: the shared ``[*kernel_size, in_features/G, out_features]`` kernel
        (1, 2 or 3 spatial dimensions).
      r: ``[E, in_features]`` input fast weights.
      s: ``[E, out_features]`` output fast weights.
      bias: ``[E, out_features]`` per-member bias, or ``None``.
      num_members: the ensemble size E.
      strides: an int or one int per spatial dimension.
      padding: ``'SAME'``, ``'SAME_LOWER'``, ``'VALID'`` (any case),
        ``'CIRCULAR'``, ``'REFLECT'``, ``'CAUSAL'`` (1-D only), an int, or one
        int or ``(low, high)`` pair per spatial dimension
        (:func:`~ensembles.ops.conv_options.check_padding`).
      input_dilation: an int or one int per spatial dimension.
      kernel_dilation: an int or one int per spatial dimension.
      feature_group_count: the number of feature groups G; it must divide
        ``in_features`` and ``out_features``.
      precision: convolution precision, as for ``jax.lax.conv_general_dilated``.
      preferred_element_type: accumulation/output dtype of the convolution.
      impl: ``"xla"``, the one implementation.

    Returns:
      The ``[E*B, ..., *out_spatial, out_features]`` outputs.

    Raises:
      ValueError: if a shape, ``num_members``, an option or ``impl`` is
        invalid, or ``'CIRCULAR'`` or ``'REFLECT'`` padding must pad an empty
        spatial axis (``nnx.Conv`` cannot either; other paddings give an empty
        output axis, as Flax does); the message names the argument and the fix.
      TypeError: if ``num_members`` or an option has the wrong type.
    """
    num_members = check_num_members(num_members)
    check_choice(impl, "impl", CONV_IMPLS)
    groups = check_positive_int(feature_group_count, "feature_group_count")
    inputs, kernel, r, s, bias = as_operands(inputs, kernel, r, s, bias)
    if kernel.ndim < 3:
        raise ValueError(
            f"`kernel` must have shape [*kernel_size, in, out] with at least one "
            f"spatial dimension, got shape {kernel.shape}."
        )
    rank = kernel.ndim - 2
    input_dilation = spatial_tuple(input_dilation, "input_dilation", rank)
    return conv_rows(
        inputs,
        kernel,
        r,
        s,
        bias,
        num_members=num_members,
        strides=spatial_tuple(strides, "strides", rank),
        padding=check_padding(padding, rank, input_dilation=input_dilation),
        input_dilation=input_dilation,
        kernel_dilation=spatial_tuple(kernel_dilation, "kernel_dilation", rank),
        feature_group_count=groups,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
