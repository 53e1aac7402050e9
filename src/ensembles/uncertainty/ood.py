"""Ranking scores for out-of-distribution detection: AUROC, AUPR, FPR at a TPR.

Each takes 1-D scores of in-distribution examples (the negatives) and of
out-of-distribution examples (the positives, expected to score higher): any
per-example uncertainty of either kind, a classifier's
:func:`~ensembles.uncertainty.mutual_information` or a regressor's
:func:`~ensembles.uncertainty.epistemic_variance`. Each computes with sorts
and binary searches, ``O(n log n)``, at thresholds at the distinct score
values, as scikit-learn puts them: :func:`auroc` is its ``roc_auc_score``,
:func:`aupr` its ``average_precision_score`` and :func:`fpr_at_tpr` reads its
``roc_curve``. Each is NaN if any score is NaN or infinite. Known scores are
compared exactly, in their own dtype, as scikit-learn compares them; under
:func:`jax.jit`, in the dtype JAX holds them in (see :func:`auroc`'s note).
See :mod:`ensembles.uncertainty`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import dtypes

from ensembles._checks import check_real
from ensembles.uncertainty._common import check_scores


def _joint_ranks(
    in_scores: jax.Array | np.ndarray, out_scores: jax.Array | np.ndarray
) -> tuple[jax.Array, jax.Array, jax.Array, np.dtype]:
    """Both sets of scores as int32 ranks in their joint order, exactly.

    A score's rank is the number of scores (of either set) strictly below it,
    so equal scores share a rank and any two scores compare as their ranks
    do: the OOD metrics count with the ranks. Known scores are ranked by
    numpy in the dtype numpy concatenates them to (as scikit-learn compares
    them): integers as integers, float64 as float64, whatever
    ``jax_enable_x64`` says. Traced scores (under :func:`jax.jit`) are ranked
    in the dtype JAX promotes the two arrays to, which is where the two can
    differ: JAX holds 64-bit inputs as 32-bit without x64, and compares int32
    with float32 scores in float32.

    Returns:
      ``(in_ranks, out_ranks, unranked, dtype)``: ``unranked`` is True if some
      score is NaN or infinite; ``dtype`` is the metrics' float dtype (float64
      for float64 scores under x64, else float32).
    """
    dtype = jnp.promote_types(
        jnp.promote_types(
            dtypes.canonicalize_dtype(in_scores.dtype),
            dtypes.canonicalize_dtype(out_scores.dtype),
        ),
        jnp.float32,
    )
    num_in = in_scores.shape[0]
    try:
        parts = [np.asarray(in_scores), np.asarray(out_scores)]
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        parts = None
    if parts is not None:
        # bfloat16 and narrower floats are exact in float32, which numpy sorts.
        parts = [
            p
            if p.dtype == np.bool_ or np.issubdtype(p.dtype, np.number)
            else p.astype(np.float32)
            for p in parts
        ]
        joint = np.concatenate(parts)
        ranks = np.searchsorted(np.sort(joint), joint, side="left").astype(np.int32)
        unranked = not np.isfinite(joint).all()
        return (
            jnp.asarray(ranks[:num_in]),
            jnp.asarray(ranks[num_in:]),
            jnp.asarray(unranked),
            dtype,
        )
    common = jnp.promote_types(in_scores.dtype, out_scores.dtype)
    if common == jnp.bool_:
        common = jnp.int32
    joint = jnp.concatenate([in_scores.astype(common), out_scores.astype(common)])
    ranks = jnp.searchsorted(jnp.sort(joint), joint, side="left").astype(jnp.int32)
    unranked = ~jnp.all(jnp.isfinite(joint))
    return ranks[:num_in], ranks[num_in:], unranked, dtype


@functools.partial(jax.jit, static_argnames="dtype")
def _auroc(
    in_ranks: jax.Array, out_ranks: jax.Array, unranked: jax.Array, dtype: jnp.dtype
) -> jax.Array:
    sorted_in = jnp.sort(in_ranks)
    # For each positive: #negatives below it, and #below-or-equal; their mean
    # counts ties as half.
    below = jnp.searchsorted(sorted_in, out_ranks, side="left")
    below_or_equal = jnp.searchsorted(sorted_in, out_ranks, side="right")
    wins = (below + below_or_equal).astype(dtype) / (2 * in_ranks.shape[0])
    # NaN has no rank: the AUROC of unranked scores is undefined. An infinite
    # score is an overflow upstream more often than a real extreme; both
    # poison the result.
    return jnp.where(unranked, jnp.nan, jnp.mean(wins))


def auroc(in_scores: jax.Array, out_scores: jax.Array) -> jax.Array:
    """Area under the ROC curve for telling out-of-distribution examples apart.

    Out-of-distribution examples are the positive class and should score
    higher (use an uncertainty such as :func:`mutual_information` or
    :func:`total_entropy`). The AUROC is the probability that a random
    out-of-distribution example outscores a random in-distribution one, ties
    counted as half (the Mann-Whitney U statistic over ``n_in * n_out``),
    computed with one sort and two binary searches: ``O(n log n)``. It equals
    scikit-learn's ``roc_auc_score``: scores are compared exactly, in their
    own dtype (see the note below).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> uncertainty.auroc(jnp.array([0.1, 0.4]), jnp.array([0.3, 0.9]))  # 3 of 4
    Array(0.75, dtype=float32)
    >>> uncertainty.auroc(jnp.array([0.5]), jnp.array([0.5]))  # a tie: chance
    Array(0.5, dtype=float32)
    >>> uncertainty.auroc(jnp.array([0.1, jnp.nan]), jnp.array([0.9]))  # unranked
    Array(nan, dtype=float32)

    Args:
      in_scores: ``[N_in]`` scores of in-distribution examples (the negatives).
      out_scores: ``[N_out]`` scores of out-of-distribution examples (the
        positives).

    Returns:
      The AUROC in ``[0, 1]``, a scalar: 1 separates perfectly, 0.5 is chance.
      NaN if any score is NaN or infinite (eagerly and under :func:`jax.jit`):
      such scores have no rank, and an example scored NaN by
      :func:`mutual_information` is one whose logits were invalid. Drop those
      examples, or clip deliberate infinities, before ranking.

    Raises:
      ValueError: if either array is not 1-D or is empty.
      TypeError: if either array is not a real-valued array (e.g. ``None``).

    Note:
      Known scores (a numpy or JAX array, outside :func:`jax.jit`) are ranked
      exactly as scikit-learn ranks them, in the dtype numpy concatenates
      them to: int64 scores above ``2**24`` or float64 scores closer than
      float32's spacing stay distinct, with or without ``jax_enable_x64``.
      Under :func:`jax.jit` the scores are what JAX holds (without x64, 64-bit
      inputs become 32-bit as they enter) and are compared in the dtype JAX
      promotes the two arrays to (int32 against float32 scores: float32).
    """
    in_scores = check_scores(in_scores, "in_scores")
    out_scores = check_scores(out_scores, "out_scores")
    in_ranks, out_ranks, unranked, dtype = _joint_ranks(in_scores, out_scores)
    return _auroc(in_ranks, out_ranks, unranked, dtype=dtype)


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
    in_scores = check_scores(in_scores, "in_scores")
    out_scores = check_scores(out_scores, "out_scores")
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
    in_scores = check_scores(in_scores, "in_scores")
    out_scores = check_scores(out_scores, "out_scores")
    needed = _positives_needed(tpr, out_scores.shape[0])
    in_ranks, out_ranks, unranked, dtype = _joint_ranks(in_scores, out_scores)
    return _fpr_at_tpr(in_ranks, out_ranks, unranked, jnp.int32(needed), dtype=dtype)
