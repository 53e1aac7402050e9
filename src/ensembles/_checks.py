"""Argument checks shared by ops, layers and helpers.

Every check raises before anything is computed or mutated, names the argument,
shows the offending value and says how to fix it.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np


def check_positive_int(value: Any, name: str) -> int:
    """Returns ``value`` as an ``int`` if it is an integer >= 1, else raises."""
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be an int >= 1, got the bool {value!r}.")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise TypeError(
            f"`{name}` must be an int >= 1, got {value!r} of type "
            f"{type(value).__name__}."
        ) from None
    if as_int < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {as_int}.")
    return as_int


def check_num_members(num_members: Any) -> int:
    """Checks the ensemble size ``num_members`` (E)."""
    return check_positive_int(num_members, "num_members")


def check_member_batch(
    leading: int, num_members: int, name: str = "inputs.shape[0]"
) -> int:
    """Returns the per-member batch B of a member-major ``[E*B, ...]`` axis."""
    if leading % num_members:
        raise ValueError(
            f"`{name}` (={leading}) must be a multiple of `num_members` "
            f"(={num_members}): rows [k*B, (k+1)*B) belong to member k. Tile an "
            f"un-tiled batch with `ensembles.tile(x, {num_members})`."
        )
    return leading // num_members


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    """Checks that ``value`` is one of the strings in ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")
    return value


def check_member_shapes(
    leading: int,
    r: Any,
    s: Any,
    bias: Any,
    num_members: int,
    in_features: int,
    out_features: int,
) -> int:
    """Checks a dense-like op's member batch, fast weights and bias; returns B.

    ``leading`` is the ``[E*B, ...]`` batch's size; ``r`` must be ``[E, in]``,
    ``s`` and ``bias`` (unless ``None``) ``[E, out]``.
    """
    batch = check_member_batch(leading, num_members)
    check_member_params(
        r,
        s,
        bias,
        r_shape=(num_members, in_features),
        s_shape=(num_members, out_features),
        bias_shape=(num_members, out_features),
    )
    return batch


def check_member_params(
    r: Any,
    s: Any,
    bias: Any,
    *,
    r_shape: tuple[int, ...],
    s_shape: tuple[int, ...],
    bias_shape: tuple[int, ...],
) -> None:
    """Checks the shapes of the fast weights and (unless ``None``) the bias."""
    for name, array, expected in (
        ("r", r, r_shape),
        ("s", s, s_shape),
        ("bias", bias, bias_shape),
    ):
        if array is not None and tuple(array.shape) != tuple(expected):
            raise ValueError(
                f"`{name}` must have shape [num_members, features] = "
                f"{tuple(expected)}, got {tuple(array.shape)}."
            )


def check_known_labels(labels: Any, num_classes: int) -> None:
    """Raises if integer ``labels`` whose values are known lie outside [0, C).

    Under ``jax.jit`` the values are not known and nothing is checked (the
    callers make such labels give NaN instead).
    """
    try:
        values = np.asarray(labels)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    bad = (values < 0) | (values >= num_classes)
    if bad.any():
        index = int(np.argmax(bad))
        raise ValueError(
            f"`labels` must lie in [0, C) = [0, {num_classes}), got "
            f"labels[{index}] = {int(values[index])}."
        )
