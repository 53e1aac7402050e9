"""Private helpers both kinds of :mod:`ensembles.uncertainty` share.

The checks of scores to rank (:func:`check_scores`), a fit's bounds
(:func:`check_bounds`) and a level (:func:`check_level`); NaN for an aggregate
over invalid examples (:func:`poison_all`); the split-conformal order
statistic of the classifiers' sets and the regressors' intervals
(:func:`conformal_rank`, :func:`conformal_quantile`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import check_array, check_real


def check_scores(scores: jax.Array, name: str) -> jax.Array | np.ndarray:
    """Returns ``scores`` as a non-empty real 1-D array, in their own dtype.

    A numpy array (or list) stays numpy: ``jnp.asarray`` would truncate
    64-bit scores without x64, and ``ood._joint_ranks`` ranks known scores
    with numpy.
    """
    scores = check_array(scores, name)
    if hasattr(scores, "__jax_array__"):
        scores = jnp.asarray(scores)
    elif not isinstance(scores, jax.Array):
        scores = np.asarray(scores)
    if not (
        jnp.issubdtype(scores.dtype, jnp.floating)
        or jnp.issubdtype(scores.dtype, jnp.integer)
        or jnp.issubdtype(scores.dtype, jnp.bool_)
    ):
        raise TypeError(
            f"`{name}` must hold real-valued scores, got dtype {scores.dtype}."
        )
    if len(scores.shape) != 1:
        raise ValueError(
            f"`{name}` must be a 1-D array of per-example scores, got shape "
            f"{tuple(scores.shape)}: flatten it with `{name}.reshape(-1)`."
        )
    if scores.shape[0] == 0:
        raise ValueError(
            f"`{name}` must hold at least one score, got an empty array: ranking "
            "needs both in-distribution and out-of-distribution examples."
        )
    return scores


def poison_all(value: jax.Array, invalid: jax.Array) -> jax.Array:
    """``value`` (an aggregate), or NaN if any example (entry) is invalid."""
    return jnp.where(jnp.any(invalid), jnp.nan, value)


def check_bounds(bounds: Any, what: str) -> tuple[float, float]:
    """``bounds``: two ``what`` ``(low, high)``, ``1e-30 <= low < high <= 1e30``."""
    if not isinstance(bounds, tuple | list) or len(bounds) != 2:
        raise ValueError(
            f"`bounds` must be two {what} (low, high), got {bounds!r}: e.g. "
            f"bounds=(0.05, 20.0)."
        )
    low, high = (check_real(b, "bounds") for b in bounds)
    if not 1e-30 <= low < high <= 1e30:
        raise ValueError(
            f"`bounds` must satisfy 1e-30 <= low < high <= 1e30, got "
            f"{tuple(bounds)!r}: e.g. bounds=(0.05, 20.0)."
        )
    return low, high


def check_level(level: Any, share: str) -> float:
    """Returns ``level`` as a float in ``(0, 1)``, the share of ``share``."""
    value = check_real(level, "level")
    if not 0.0 < value < 1.0:
        raise ValueError(
            f"`level` must lie strictly between 0 and 1 (the share of {share}), "
            f"got {level!r}: e.g. level=0.9."
        )
    return value


def conformal_rank(count: int, level: float) -> int:
    """The split-conformal order statistic: ``ceil((count + 1) level)``.

    The product is rounded to 9 decimals first, so that a level meant
    exactly (``0.7`` of ``count + 1 = 10`` is 7, where float64 gives
    ``7.000000000000001``) is not one example more conservative.
    """
    return math.ceil(round((count + 1) * level, 9))


def conformal_quantile(scores: jax.Array, level: float) -> jax.Array:
    """The split-conformal quantile of ``scores`` ``[..., n]`` along the last axis.

    Their :func:`conformal_rank`-th smallest, ``inf`` where ``n`` is too
    small for the level (``(n + 1) level > n``).
    """
    count = scores.shape[-1]
    rank = conformal_rank(count, level)
    if rank > count:
        return jnp.full(scores.shape[:-1], jnp.inf, scores.dtype)
    return jnp.sort(scores, axis=-1)[..., rank - 1]
