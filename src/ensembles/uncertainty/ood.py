"""Out-of-distribution detection metrics beyond :func:`auroc`.

Like :func:`auroc`, each takes 1-D scores of in-distribution examples (the
negatives) and of out-of-distribution examples (the positives, expected to
score higher) and computes with sorts and binary searches, ``O(n log n)``.
Thresholds lie at the distinct score values, as scikit-learn puts them:
:func:`aupr` is its ``average_precision_score`` and :func:`fpr_at_tpr` reads
its ``roc_curve``. Either is NaN if any score is NaN or infinite. Known scores
are compared exactly, in their own dtype, as scikit-learn compares them; under
:func:`jax.jit`, in the dtype JAX holds them in (see :func:`auroc`'s note). See
:mod:`ensembles.uncertainty`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ensembles._checks import check_real
from ensembles.uncertainty._common import _check_scores, _joint_ranks

__all__ = ["aupr", "fpr_at_tpr"]


def _at_or_above(sorted_scores: jax.Array, thresholds: jax.Array) -> jax.Array:
    """How many of ``sorted_scores`` (ascending) are >= each threshold."""
    below = jnp.searchsorted(sorted_scores, thresholds, side="left")
    return sorted_scores.shape[0] - below


@functools.partial(jax.jit, static_argnames="dtype")
def _aupr(
    in_ranks: jax.Array, out_ranks: jax.Array, unranked: jax.Array, dtype: jnp.dtype
) -> jax.Array:
    sorted_in, sorted_out = jnp.sort(in_ranks), jnp.sort(out_ranks)
    # sum over thresholds t of (recall(t) - recall(next t above)) * precision(t)
    # = the mean over positives of the precision at their own score: a tie
    # group of positives raises recall at one threshold, its precision's.
    true_pos = _at_or_above(sorted_out, sorted_out)
    false_pos = _at_or_above(sorted_in, sorted_out)
    precision = true_pos.astype(dtype) / (true_pos + false_pos)
    return jnp.where(unranked, jnp.nan, jnp.mean(precision))


def aupr(in_scores: jax.Array, out_scores: jax.Array) -> jax.Array:
    """Area under the precision-recall curve, out-of-distribution as positive.

    The average precision ``sum_n (R_n - R_{n-1}) P_n`` over thresholds at the
    distinct score values, descending, exactly as scikit-learn's
    ``average_precision_score(y_true, scores)`` with ``y_true = 1`` for the
    out-of-distribution scores: step-wise, no interpolation. At each threshold
    every example scoring at least it counts as flagged, so tied scores enter
    together. Equivalently, the mean over out-of-distribution examples of the
    precision at their own score. Chance is the share of out-of-distribution
    examples, ``N_out / (N_in + N_out)``.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> # Flagged from the top: .9 (out), .4 (in), .3 (out): (1 + 2/3) / 2.
    >>> uncertainty.aupr(jnp.array([0.1, 0.4]), jnp.array([0.3, 0.9])).round(4)
    Array(0.8333, dtype=float32)
    >>> uncertainty.aupr(jnp.array([0.5]), jnp.array([0.5]))  # a tie: 1 of 2
    Array(0.5, dtype=float32)

    Args:
      in_scores: ``[N_in]`` scores of in-distribution examples (the negatives).
      out_scores: ``[N_out]`` scores of out-of-distribution examples (the
        positives).

    Returns:
      The average precision in ``(0, 1]``, a scalar: 1 separates perfectly.
      NaN if any score is NaN or infinite (eagerly and under :func:`jax.jit`),
      as for :func:`auroc`.

    Raises:
      ValueError: if either array is not 1-D or is empty.
      TypeError: if either array is not a real-valued array (e.g. ``None``).
    """
    in_scores = _check_scores(in_scores, "in_scores")
    out_scores = _check_scores(out_scores, "out_scores")
    in_ranks, out_ranks, unranked, dtype = _joint_ranks(in_scores, out_scores)
    return _aupr(in_ranks, out_ranks, unranked, dtype=dtype)


def _positives_needed(tpr: float, num_out: int) -> int:
    """The least ``k`` in ``[1, num_out]`` with ``k / num_out >= tpr`` in float64.

    Python divides floats as numpy does (correctly rounded float64), so this
    is the first point of scikit-learn's ``tps / tps[-1] >= tpr``.
    """
    k = min(max(math.ceil(tpr * num_out), 1), num_out)
    while k > 1 and (k - 1) / num_out >= tpr:
        k -= 1
    while k < num_out and k / num_out < tpr:
        k += 1
    return k


@functools.partial(jax.jit, static_argnames="dtype")
def _fpr_at_tpr(
    in_ranks: jax.Array,
    out_ranks: jax.Array,
    unranked: jax.Array,
    needed: jax.Array,
    dtype: jnp.dtype,
) -> jax.Array:
    sorted_in, sorted_out = jnp.sort(in_ranks), jnp.sort(out_ranks)
    # The first threshold (descending) flagging `needed` positives is the
    # needed-th largest positive score; every negative at or above it is a
    # false positive. (`needed` is an argument, not static: one compilation
    # serves every tpr.)
    threshold = sorted_out[sorted_out.shape[0] - needed]
    false_pos = _at_or_above(sorted_in, threshold[None])[0]
    fpr = false_pos.astype(dtype) / sorted_in.shape[0]
    return jnp.where(unranked, jnp.nan, fpr)


def fpr_at_tpr(
    in_scores: jax.Array, out_scores: jax.Array, tpr: float = 0.95
) -> jax.Array:
    """False-positive rate at the first threshold reaching a true-positive rate.

    Thresholds run down the distinct score values, and at each one every
    example scoring at least it is flagged out-of-distribution (the positive
    class). The result is the share of in-distribution examples flagged at the
    first threshold whose true-positive rate is ``>= tpr``: exactly
    ``fpr[np.searchsorted(tpr_curve, tpr, side="left")]`` for scikit-learn's
    ``fpr, tpr_curve, _ = roc_curve(y_true, scores, drop_intermediate=False)``,
    with ``y_true = 1`` for the out-of-distribution scores. The usual report is
    FPR at 95% TPR (lower is better).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> in_scores, out_scores = jnp.array([0.1, 0.4]), jnp.array([0.3, 0.9])
    >>> uncertainty.fpr_at_tpr(in_scores, out_scores)  # both out: cut at .3
    Array(0.5, dtype=float32)
    >>> uncertainty.fpr_at_tpr(in_scores, out_scores, tpr=0.5)  # cut at .9
    Array(0., dtype=float32)

    Args:
      in_scores: ``[N_in]`` scores of in-distribution examples (the negatives).
      out_scores: ``[N_out]`` scores of out-of-distribution examples (the
        positives).
      tpr: the true-positive rate to reach, a real number in ``(0, 1]``; a
        Python or numpy scalar (static under :func:`jax.jit`).

    Returns:
      The false-positive rate in ``[0, 1]``, a scalar: 0 separates perfectly.
      NaN if any score is NaN or infinite (eagerly and under :func:`jax.jit`),
      as for :func:`auroc`.

    Raises:
      ValueError: if either array is not 1-D or is empty, or ``tpr`` lies
        outside ``(0, 1]``.
      TypeError: if either array is not a real-valued array (e.g. ``None``),
        or ``tpr`` is not a concrete real number.
    """
    tpr = check_real(tpr, "tpr")
    if not 0.0 < tpr <= 1.0:
        raise ValueError(f"`tpr` must lie in (0, 1], got {tpr}.")
    in_scores = _check_scores(in_scores, "in_scores")
    out_scores = _check_scores(out_scores, "out_scores")
    needed = _positives_needed(tpr, out_scores.shape[0])
    in_ranks, out_ranks, unranked, dtype = _joint_ranks(in_scores, out_scores)
    return _fpr_at_tpr(in_ranks, out_ranks, unranked, jnp.int32(needed), dtype=dtype)
