"""The BatchEnsemble convolution op, and what both convolution ops share.

Member ``k`` of :func:`batch_ensemble_conv` maps its rows ``[k*B, (k+1)*B)`` of a
member-major, channels-last batch as a convolution with kernel
``kernel * (r[k] (x) s[k])`` over the channel axes would. Because ``r`` scales
input channels and ``s`` output channels, that is computed without forming
per-member kernels::

    y = conv(x * r[k], kernel) * s[k] + bias[k]

with one ``lax.conv_general_dilated`` shared by all members over the flat
``[E*B, ...]`` batch (:mod:`ensembles.ops.conv_xla` runs and differentiates
it). Padding that copies input values (``CIRCULAR``, ``REFLECT``) commutes
with the per-channel scaling by ``r``.

With ``feature_group_count = G`` the kernel is ``[*kernel_size, in/G, out]`` and
output channel ``o`` reads input channels of group ``o // (out/G)`` only, so the
effective kernel of member ``k`` is ``kernel[..., j, o] * r[k, g*in/G + j] *
s[k, o]`` with ``g = o // (out/G)`` (see :func:`effective_kernel`).

The padding conventions are Flax's own (``canonicalize_padding``, a pure
function of its arguments; no module is involved), so every padding form means
exactly what it means for ``nnx.Conv`` / ``nnx.ConvTranspose``; the layout is
channels-last, ``[N, *spatial, C]`` inputs and ``[*kernel_size, in, out]``
kernels, as Flax's. The shape and padding checks and the batch reshapes here
serve :mod:`ensembles.ops.conv_transpose` too.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.nnx.nn.linear import canonicalize_padding
from jax import lax

from ensembles._checks import (
    check_member_shapes,
    check_num_members,
    check_positive_int,
)
from ensembles.ops.autodiff import static_precision
from ensembles.ops.conv_xla import ConvConfig, conv_by_member, effective_kernel
from ensembles.ops.plan import CONV_IMPLS, check_impl

__all__ = [
    "batch_ensemble_conv",
    "check_kernel_size",
    "check_mask",
    "check_padding",
    "check_shapes",
    "effective_kernel",
    "flatten_batch",
    "from_members",
    "spatial_tuple",
]

IntOrSequence = int | Sequence[int] | None
PaddingLike = str | int | Sequence[int | tuple[int, int]]


def spatial_tuple(value: IntOrSequence, name: str, rank: int) -> tuple[int, ...]:
    """Broadcasts ``value`` to ``rank`` positive ints, as Flax's layers do."""
    if value is None:  # Flax's sentinel for 1.
        value = 1
    if _is_int(value):
        values = (value,) * rank
    else:
        try:
            values = tuple(value)
        except TypeError:
            raise TypeError(
                f"`{name}` must be an int or a sequence of {rank} ints, got {value!r}."
            ) from None
        if len(values) != rank:
            raise ValueError(
                f"`{name}` must be an int or a sequence of {rank} ints (one per "
                f"spatial dimension of the {rank}-D kernel), got {value!r}."
            )
    return tuple(check_positive_int(v, name) for v in values)


def _is_int(value: Any) -> bool:
    """Whether ``value`` is one integer (Python, numpy or 0-d JAX), not a bool."""
    if isinstance(value, bool | np.bool_):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


#: The padding strings lax reads in any case; Flax's own modes it does not.
_LAX_PADDINGS = ("SAME", "SAME_LOWER", "VALID")
_FLAX_PADDINGS = {"conv": ("CIRCULAR", "REFLECT", "CAUSAL"), "transpose": ("CIRCULAR",)}


def check_kernel_size(kernel_size: int | Sequence[int]) -> tuple[int, ...]:
    """Checks a convolution's ``kernel_size`` and returns it as a tuple.

    Args:
      kernel_size: an int (a 1-D kernel) or one positive int per spatial
        dimension, 1 to 3 of them.

    Returns:
      The spatial shape of the kernel, a tuple of 1 to 3 ints.

    Raises:
      TypeError: if an entry is not an int.
      ValueError: if an entry is below 1, or there are not 1, 2 or 3 entries.
    """
    if _is_int(kernel_size):
        kernel_size = (kernel_size,)
    elif not isinstance(kernel_size, Sequence | np.ndarray):
        raise TypeError(
            f"`kernel_size` must be an int or a sequence of 1 to 3 ints, got "
            f"{kernel_size!r} of type {type(kernel_size).__name__}."
        )
    kernel_size = tuple(check_positive_int(k, "kernel_size") for k in kernel_size)
    if not 1 <= len(kernel_size) <= 3:
        raise ValueError(
            f"`kernel_size` must have 1, 2 or 3 entries (1-D, 2-D or 3-D "
            f"convolution), got {kernel_size}."
        )
    return kernel_size


def check_mask(mask: jax.Array | None, kernel_shape: tuple[int, ...]) -> None:
    """Checks that a convolution's ``mask`` (if any) has the kernel's shape.

    Args:
      mask: the layer's ``mask`` argument, or ``None``.
      kernel_shape: the shape of the layer's shared kernel.

    Raises:
      ValueError: if ``mask`` has another shape.
    """
    if mask is not None and tuple(mask.shape) != kernel_shape:
        raise ValueError(
            f"`mask` must have the kernel's shape {kernel_shape}, got "
            f"{tuple(mask.shape)}."
        )


def check_padding(
    padding: Any,
    rank: int,
    *,
    transpose: bool = False,
    input_dilation: tuple[int, ...] | None = None,
) -> Any:
    """Checks a convolution's ``padding`` as Flax and lax accept it; canonical form.

    ``'SAME'``, ``'SAME_LOWER'`` and ``'VALID'`` are read in any case, as
    ``jax.lax`` reads them (``nnx.Conv(padding="same")`` works); Flax's own
    modes ``'CIRCULAR'``, ``'REFLECT'`` and ``'CAUSAL'`` (1-D only) only in
    upper case, as ``nnx.Conv`` recognises them (it passes ``'circular'`` on to
    lax, which fails at call time). Transposed convolutions take
    ``'CIRCULAR'`` but not ``'REFLECT'`` or ``'CAUSAL'``, as
    ``nnx.ConvTranspose``. Ints and sequences are Flax's
    ``canonicalize_padding`` forms.

    >>> check_padding("same", 2)
    'SAME'
    >>> check_padding(1, 2)
    ((1, 1), (1, 1))

    A padding string with an ``input_dilation`` above 1 is refused: lax does
    not define it (``lax.conv_general_dilated`` raises at call time, in
    ``nnx.Conv`` too); explicit ``(low, high)`` pairs work.

    Args:
      padding: the padding as given to the layer or op.
      rank: the number of spatial dimensions.
      transpose: whether the convolution is transposed.
      input_dilation: the convolution's input dilation, one int per spatial
        dimension (``None``: 1).

    Returns:
      A padding string (upper case, except a transposed convolution's lax
      names, which ``lax.conv_transpose`` reads case by case: only upper-case
      ``'SAME'``/``'VALID'`` mean the transposed convolution's padding, other
      spellings the padding of the dilated convolution it runs, in
      ``nnx.ConvTranspose`` too) or a tuple of one ``(low, high)`` pair per
      spatial dimension.

    Raises:
      ValueError: if ``padding`` is not a padding these convolutions accept;
        the message says which are.
    """
    own = _FLAX_PADDINGS["transpose" if transpose else "conv"]
    names = [*_LAX_PADDINGS, *own]
    if isinstance(padding, str) and any(d > 1 for d in input_dilation or ()):
        raise ValueError(
            f"`padding={padding!r}` is not defined with `input_dilation` (="
            f"{tuple(input_dilation)}) above 1: `jax.lax.conv_general_dilated` "
            f"(and so `nnx.Conv`) refuses string paddings there. Pass one (low, "
            f"high) pair per spatial dimension, e.g. padding=0 for 'VALID', or "
            f"use BatchEnsembleConvTranspose to upsample."
        )
    if isinstance(padding, str):
        if padding.upper() in _LAX_PADDINGS:
            # lax.conv_transpose gives only upper-case 'SAME' and 'VALID' the
            # transposed convolution's padding; other spellings reach the
            # dilated convolution underneath as they are, and so they do in
            # nnx.ConvTranspose: a transposed layer passes them on unchanged.
            return padding if transpose else padding.upper()
        if padding in own:
            if padding == "CAUSAL" and rank != 1:
                raise ValueError(
                    f"`padding='CAUSAL'` is only defined for 1-D convolutions (as "
                    f"in `nnx.Conv`), got a {rank}-D kernel."
                )
            return padding
        if padding in ("REFLECT", "CAUSAL"):  # transposed
            raise ValueError(
                f"`padding={padding!r}` is not defined for transposed convolutions "
                f"(`nnx.ConvTranspose` does not implement it either): use 'SAME', "
                f"'VALID', 'CIRCULAR' or explicit (low, high) pairs."
            )
        if padding.upper() in own:
            raise ValueError(
                f"`padding` must be one of {names} (the first three in any case), "
                f"an int, or a sequence of {rank} ints or (low, high) pairs, got "
                f"{padding!r}: Flax recognises its own modes in upper case only "
                f"(`nnx.Conv(padding={padding!r})` fails when called); write "
                f"{padding.upper()!r}."
            )
    try:
        canonical = canonicalize_padding(padding, rank)
    except (ValueError, TypeError):
        canonical = None
    if canonical is None or isinstance(canonical, str):
        raise ValueError(
            f"`padding` must be one of {names} (the first three in any case), an "
            f"int, or a sequence of {rank} ints or (low, high) pairs, got "
            f"{padding!r}."
        )
    return tuple(tuple(pair) for pair in canonical)


def check_shapes(
    inputs, kernel, r, s, bias, num_members, in_features, out_features, source
) -> int:
    """Checks the conv op's array shapes; returns the number of spatial dims."""
    if kernel.ndim < 3:
        raise ValueError(
            f"`kernel` must have shape [*kernel_size, in, out] with at least one "
            f"spatial dimension, got shape {kernel.shape}."
        )
    if 0 in kernel.shape:
        raise ValueError(
            f"`kernel` must have no zero-size axis (at least one tap, input and "
            f"output channel), got shape {kernel.shape}."
        )
    rank = kernel.ndim - 2
    if inputs.ndim < rank + 2:
        raise ValueError(
            f"`inputs` must have shape [E*B, *spatial ({rank} dims), "
            f"in_features] (at least {rank + 2} dimensions) for a {rank}-D "
            f"kernel, got shape {inputs.shape}. Add a batch axis, e.g. "
            f"`inputs[None]`, and tile it with `ensembles.tile`."
        )
    if inputs.shape[-1] != in_features:
        raise ValueError(
            f"`inputs.shape[-1]` (={inputs.shape[-1]}) must equal in_features "
            f"(={in_features}: {source}, `kernel.shape`={kernel.shape}); got "
            f"inputs of shape {inputs.shape}."
        )
    check_member_shapes(
        inputs.shape[0], r, s, bias, num_members, in_features, out_features
    )
    return rank


def flatten_batch(inputs, rank):
    """``[E*B, ..., *spatial, C]`` -> ``[E*B*..., *spatial, C]``."""
    return inputs.reshape(-1, *inputs.shape[-rank - 1 :])


def from_members(y, s, bias, batch_shape):
    """Scales by ``s``, adds ``bias`` (each if given), restores the batch axes."""
    present = [w for w in (s, bias) if w is not None]
    if not present:
        return y.reshape(*batch_shape, *y.shape[1:])
    num_members, out_features = present[0].shape
    per_member = y.reshape(num_members, -1, *y.shape[1:])
    weights_shape = (num_members, *(1,) * (y.ndim - 1), out_features)
    if s is not None:
        per_member = per_member * s.reshape(weights_shape)
    if bias is not None:
        per_member = per_member + bias.reshape(weights_shape)
    return per_member.reshape(*batch_shape, *y.shape[1:])


def _conv_xla(
    inputs,
    kernel,
    r,
    s,
    bias,
    *,
    strides,
    padding,
    input_dilation,
    kernel_dilation,
    feature_group_count,
    precision,
    preferred_element_type,
):
    rank = kernel.ndim - 2
    batch_shape = inputs.shape[: -rank - 1]
    # conv_by_member scales by r and s (its backward needs them unapplied).
    x = flatten_batch(inputs, rank)
    if padding in ("CIRCULAR", "REFLECT"):
        # As nnx.Conv: pad by the dilated kernel's half-widths, then VALID.
        dilated = [
            (k - 1) * d + 1
            for k, d in zip(kernel.shape[:rank], kernel_dilation, strict=True)
        ]
        pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
        mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding]
        x = jnp.pad(x, pads, mode=mode)
        padding = "VALID"
    elif padding == "CAUSAL":
        left = kernel_dilation[0] * (kernel.shape[0] - 1)
        x = jnp.pad(x, [(0, 0), (left, 0), (0, 0)])
        padding = "VALID"
    spec = ConvConfig(
        strides,
        padding,
        input_dilation,
        kernel_dilation,
        feature_group_count,
        static_precision(precision),
        preferred_element_type,
    )
    y = conv_by_member(x, kernel, r, s, spec)
    return from_members(y, None, bias, batch_shape)


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
    impl: str = "auto",
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
        int or ``(low, high)`` pair per spatial dimension (see
        :func:`check_padding`).
      input_dilation: an int or one int per spatial dimension.
      kernel_dilation: an int or one int per spatial dimension.
      feature_group_count: the number of feature groups G; it must divide
        ``in_features`` and ``out_features``.
      precision: convolution precision, as for ``jax.lax.conv_general_dilated``.
      preferred_element_type: accumulation/output dtype of the convolution.
      impl: ``"xla"`` (the ``jnp`` formulation) or ``"auto"`` (``"xla"``).

    Returns:
      The ``[E*B, ..., *out_spatial, out_features]`` outputs.

    Raises:
      ValueError: if a shape, ``num_members``, an option or ``impl`` is
        invalid; the message names the argument and the fix.
      TypeError: if ``num_members`` or an option has the wrong type.
    """
    num_members = check_num_members(num_members)
    check_impl(impl, CONV_IMPLS)  # "xla" is the one implementation
    groups = check_positive_int(feature_group_count, "feature_group_count")
    inputs, kernel, r, s = (jnp.asarray(a) for a in (inputs, kernel, r, s))
    bias = None if bias is None else jnp.asarray(bias)
    if kernel.ndim >= 2:
        in_features, out_features = kernel.shape[-2] * groups, kernel.shape[-1]
    else:
        in_features = out_features = -1
    rank = check_shapes(
        inputs,
        kernel,
        r,
        s,
        bias,
        num_members,
        in_features,
        out_features,
        f"`kernel.shape[-2]` times `feature_group_count` (={groups})",
    )
    if out_features % groups:
        raise ValueError(
            f"`feature_group_count` (={groups}) must divide out_features "
            f"(={out_features}, `kernel.shape[-1]`)."
        )
    input_dilation = spatial_tuple(input_dilation, "input_dilation", rank)
    padding = check_padding(padding, rank, input_dilation=input_dilation)
    return _conv_xla(
        inputs,
        kernel,
        r,
        s,
        bias,
        strides=spatial_tuple(strides, "strides", rank),
        padding=padding,
        input_dilation=input_dilation,
        kernel_dilation=spatial_tuple(kernel_dilation, "kernel_dilation", rank),
        feature_group_count=groups,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
