"""The convolutions' options and shapes, checked once where they enter.

``nnx.Conv``'s and ``nnx.ConvTranspose``'s arguments (kernel size, strides,
dilations, padding, mask) are checked here by the layers' constructors and by
the functional ops, with Flax's own conventions: the padding forms are those
of Flax's ``canonicalize_padding`` (a pure function of its arguments; no module
is involved), so every padding means exactly what it means for ``nnx.Conv`` /
``nnx.ConvTranspose``; the layout is channels-last, ``[N, *spatial, C]``
inputs and ``[*kernel_size, in, out]`` kernels, as Flax's.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax.nnx.nn.linear import canonicalize_padding

from ensembles._checks import (
    add_batch_axis_fix,
    check_member_shapes,
    check_positive_int,
)

__all__ = [
    "check_kernel_size",
    "check_mask",
    "check_padding",
    "check_shapes",
    "flatten_batch",
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
    inputs,
    kernel,
    r,
    s,
    bias,
    num_members: int,
    *,
    feature_group_count: int = 1,
    transpose_kernel: bool = False,
) -> int:
    """Checks a convolution op's array shapes; returns the number of spatial dims.

    The kernel is ``[*kernel_size, in/G, out]`` (``[*kernel_size, out, in]``
    for a transposed convolution with ``transpose_kernel``); ``r`` must be
    ``[E, in]``, ``s`` and ``bias`` ``[E, out]``.
    """
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
    in_features, out_features = kernel.shape[-2:]
    if transpose_kernel:
        in_features, out_features = out_features, in_features
        source = "`kernel.shape[-1]` with `transpose_kernel=True`"
    elif feature_group_count != 1:
        in_features *= feature_group_count
        source = (
            f"`kernel.shape[-2]` times `feature_group_count` (={feature_group_count})"
        )
    else:
        source = "`kernel.shape[-2]`"
    rank = kernel.ndim - 2
    if inputs.ndim < rank + 2:
        raise ValueError(
            f"`inputs` must have shape [E*B, *spatial ({rank} dims), "
            f"in_features] (at least {rank + 2} dimensions) for a {rank}-D "
            f"kernel, got shape {inputs.shape}. " + add_batch_axis_fix(num_members)
        )
    if inputs.shape[-1] != in_features:
        raise ValueError(
            f"`inputs.shape[-1]` (={inputs.shape[-1]}) must equal in_features "
            f"(={in_features}: {source}, `kernel.shape`={kernel.shape}); got "
            f"inputs of shape {inputs.shape}."
        )
    if out_features % feature_group_count:
        raise ValueError(
            f"`feature_group_count` (={feature_group_count}) must divide "
            f"out_features (={out_features}, `kernel.shape[-1]`)."
        )
    check_member_shapes(
        inputs.shape[0], r, s, bias, num_members, in_features, out_features
    )
    return rank


def flatten_batch(inputs, rank):
    """``[E*B, ..., *spatial, C]`` -> ``[E*B*..., *spatial, C]``."""
    # The rows are counted, not left to reshape's -1: an empty spatial axis
    # leaves nothing to infer them from (reshape divides by zero).
    rows = int(np.prod(inputs.shape[: -rank - 1], dtype=np.int64))
    return inputs.reshape(rows, *inputs.shape[-rank - 1 :])
