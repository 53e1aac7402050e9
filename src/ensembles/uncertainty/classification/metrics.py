"""Aggregate metrics of an ensemble against labels, and the AUROC of scores.

:func:`nll`, :func:`accuracy`, :func:`brier` and the calibration errors
:func:`ece`, :func:`adaptive_ece` and :func:`mce` take member logits
``[E, B, C]`` and integer labels ``[B]`` and return a scalar for the ensemble
predictive; :func:`auroc` ranks per-example scores for out-of-distribution
detection. See :mod:`ensembles.uncertainty`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import check_positive_int
from ensembles.uncertainty._common import (
    _check_labels,
    _check_logits,
    _check_scores,
    _confidence_and_correct,
    _joint_ranks,
    _member_log_probs,
    _poison_all,
    _predictive_log_probs,
    _predictive_probs_unchecked,
    _split_invalid_labeled,
    _tie_averaged_cumsum,
)

__all__ = ["accuracy", "adaptive_ece", "auroc", "brier", "ece", "mce", "nll"]


@jax.jit
def _nll(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits, labels, invalid = _split_invalid_labeled(logits, labels)
    log_probs = _predictive_log_probs(_member_log_probs(logits))
    picked = jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]
    return _poison_all(-jnp.mean(picked), invalid)


def nll(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Negative log-likelihood of the labels under the ensemble predictive.

    ``-1/B sum_b log p(labels[b] | x_b)`` with ``log p`` the ``logsumexp`` of the
    member log-softmaxes minus ``log E`` (never ``log(mean(softmax))``, which
    gives ``inf`` where every member is confidently wrong).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1]], [[0.5, 0.5]]]))  # predictive .7/.3
    >>> uncertainty.nll(logits, jnp.array([0]))  # -log 0.7
    Array(0.35667..., dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.
      labels: integer class indices of shape ``[B]``, in ``[0, C)``.

    Returns:
      The mean NLL over examples, a scalar, in nats (``inf`` where every
      member masks the label out with ``-inf``);
      NaN if any example has invalid logits (see the module docs) or, under
      :func:`jax.jit`, a label outside ``[0, C)``.

    Raises:
      ValueError: if the shapes do not match ``[E, B, C]`` and ``[B]``, or (when
        not traced) a label lies outside ``[0, C)``.
      TypeError: if ``logits`` is not floating-point or ``labels`` not integer.
    """
    logits = _check_logits(logits)
    return _nll(logits, _check_labels(labels, logits))


@jax.jit
def _accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits, labels, invalid = _split_invalid_labeled(logits, labels)
    probs = _predictive_probs_unchecked(logits)
    predicted = jnp.argmax(probs, axis=-1)
    return _poison_all(jnp.mean((predicted == labels).astype(probs.dtype)), invalid)


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Share of examples whose label is the argmax of the ensemble predictive.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.array([[[2.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [3.0, 0.0]]])
    >>> uncertainty.accuracy(logits, jnp.array([0, 1]))  # 2nd example: class 0
    Array(0.5, dtype=float32)
    >>> uncertainty.accuracy(logits.at[1, 0, 0].set(jnp.inf), jnp.array([0, 1]))
    Array(nan, dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.
      labels: integer class indices of shape ``[B]``, in ``[0, C)``.

    Returns:
      The accuracy in ``[0, 1]``, a scalar;
      NaN if any example has invalid logits (see the module docs) or, under
      :func:`jax.jit`, a label outside ``[0, C)``.

    Raises:
      ValueError: if the shapes do not match ``[E, B, C]`` and ``[B]``, or (when
        not traced) a label lies outside ``[0, C)``.
      TypeError: if ``logits`` is not floating-point or ``labels`` not integer.
    """
    logits = _check_logits(logits)
    return _accuracy(logits, _check_labels(labels, logits))


@jax.jit
def _brier(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits, labels, invalid = _split_invalid_labeled(logits, labels)
    probs = _predictive_probs_unchecked(logits)
    targets = jax.nn.one_hot(labels, probs.shape[-1], dtype=probs.dtype)
    return _poison_all(jnp.mean(jnp.sum(jnp.square(probs - targets), axis=-1)), invalid)


def brier(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Brier score of the ensemble predictive: squared error to the one-hot label.

    ``1/B sum_b sum_c (p_b[c] - onehot(labels[b])[c])**2``, in ``[0, 2]`` (lower
    is better).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1]], [[0.5, 0.5]]]))  # predictive .7/.3
    >>> uncertainty.brier(logits, jnp.array([0]))  # 0.3**2 + 0.3**2
    Array(0.18, dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.
      labels: integer class indices of shape ``[B]``, in ``[0, C)``.

    Returns:
      The mean Brier score over examples, a scalar;
      NaN if any example has invalid logits (see the module docs) or, under
      :func:`jax.jit`, a label outside ``[0, C)``.

    Raises:
      ValueError: if the shapes do not match ``[E, B, C]`` and ``[B]``, or (when
        not traced) a label lies outside ``[0, C)``.
      TypeError: if ``logits`` is not floating-point or ``labels`` not integer.
    """
    logits = _check_logits(logits)
    return _brier(logits, _check_labels(labels, logits))


def _equal_width_gaps(
    logits: jax.Array, labels: jax.Array, num_bins: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns per-bin ``sum(correct - confidence)``, per-bin counts, invalid.

    Bin ``i`` of ``M`` holds the confidences in ``(i/M, (i+1)/M]``; the last
    value is the ``[B]`` invalid mask.
    """
    confidence, correct, invalid = _confidence_and_correct(logits, labels)
    # Bin i holds confidences in (edges[i], edges[i+1]]; a side="left" search
    # puts a confidence equal to an edge into the bin below it.
    edges = jnp.linspace(0.0, 1.0, num_bins + 1, dtype=confidence.dtype)
    bins = jnp.clip(
        jnp.searchsorted(edges, confidence, side="left") - 1, 0, num_bins - 1
    )
    gaps = jnp.zeros(num_bins, confidence.dtype).at[bins].add(correct - confidence)
    counts = jnp.zeros(num_bins, jnp.int32).at[bins].add(1)
    return gaps, counts, invalid


@functools.partial(jax.jit, static_argnames=("num_bins",))
def _ece(logits: jax.Array, labels: jax.Array, num_bins: int) -> jax.Array:
    gaps, _, invalid = _equal_width_gaps(logits, labels, num_bins)
    # sum_bins n_i/B * |acc_i - conf_i| = sum_bins |sum_i (correct - conf)| / B.
    return _poison_all(jnp.sum(jnp.abs(gaps)) / labels.shape[0], invalid)


def ece(logits: jax.Array, labels: jax.Array, num_bins: int = 15) -> jax.Array:
    """Expected calibration error of the ensemble predictive.

    Examples are binned by confidence (the predictive's largest probability)
    into ``num_bins`` equal-width bins ``(i/M, (i+1)/M]``; the ECE is the
    average over bins of ``|accuracy - mean confidence|``, weighted by the
    share of examples in the bin (Guo et al., 2017).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1], [0.8, 0.2]]]))  # E=1, B=2
    >>> # Two bins: right at confidence .9, wrong at .8: (0.1 + 0.8) / 2.
    >>> uncertainty.ece(logits, jnp.array([0, 1]), num_bins=10).round(4)
    Array(0.45, dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.
      labels: integer class indices of shape ``[B]``, in ``[0, C)``.
      num_bins: the number of confidence bins M, an int >= 1 (static under
        :func:`jax.jit`).

    Returns:
      The ECE in ``[0, 1]``, a scalar;
      NaN if any example has invalid logits (see the module docs) or, under
      :func:`jax.jit`, a label outside ``[0, C)``.

    Raises:
      ValueError: if the shapes do not match ``[E, B, C]`` and ``[B]``, if
        ``num_bins < 1``, or (when not traced) a label lies outside ``[0, C)``.
      TypeError: if ``logits`` is not floating-point, ``labels`` not integer or
        ``num_bins`` not an int.
    """
    num_bins = check_positive_int(num_bins, "num_bins")
    logits = _check_logits(logits)
    return _ece(logits, _check_labels(labels, logits), num_bins=num_bins)


def _equal_mass_bins(num_examples: int, num_bins: int) -> np.ndarray:
    """``[B]`` bin of each position, as :func:`numpy.array_split` splits B items."""
    size, extra = divmod(num_examples, num_bins)
    sizes = [size + 1] * extra + [size] * (num_bins - extra)
    return np.repeat(np.arange(num_bins, dtype=np.int32), sizes)


@functools.partial(jax.jit, static_argnames=("num_bins",))
def _adaptive_ece(logits: jax.Array, labels: jax.Array, num_bins: int) -> jax.Array:
    confidence, correct, invalid = _confidence_and_correct(logits, labels)
    dtype, num_examples = confidence.dtype, confidence.shape[0]
    confidence, correct = jax.lax.sort((confidence, correct), num_keys=1)
    # Tied examples share their correctness: the running count of correct
    # examples is averaged over the orders of each tie, so a tie that straddles
    # a bin edge splits its accuracy over both bins in proportion.
    running = _tie_averaged_cumsum(confidence, correct, dtype)
    through = jnp.concatenate([jnp.zeros(1, dtype), running])
    bins = _equal_mass_bins(num_examples, num_bins)
    ends = np.searchsorted(bins, np.arange(num_bins), side="right")
    starts = np.concatenate([[0], ends[:-1]])
    correct_per_bin = through[ends] - through[starts]  # 0 for an empty bin
    confidence_per_bin = jnp.zeros(num_bins, dtype).at[bins].add(confidence)
    gaps = jnp.abs(correct_per_bin - confidence_per_bin)
    return _poison_all(jnp.sum(gaps) / num_examples, invalid)


def adaptive_ece(logits: jax.Array, labels: jax.Array, num_bins: int = 15) -> jax.Array:
    """Adaptive (equal-mass) expected calibration error of the ensemble predictive.

    Examples are sorted by confidence (the predictive's largest probability),
    ascending, and split into ``num_bins`` bins of equal count as
    :func:`numpy.array_split` splits them (the first ``B % M`` bins one larger;
    with ``M > B`` the last bins are empty and count for nothing). The ECE is
    ``sum_bins n_i/B * |accuracy_i - mean confidence_i|`` (Nixon et al., 2019).

    Ties: examples of equal confidence share their correctness, so the result
    does not depend on their order. Where a tie straddles a bin edge, each of
    its examples counts as the tie's mean accuracy (the expected bin accuracy
    over every order of the tie).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1], [0.8, 0.2], [0.6, 0.4]]]))
    >>> # Bins {.6, .8} (one of two right) and {.9} (right): (2 * .2 + .1) / 3.
    >>> ece = uncertainty.adaptive_ece(logits, jnp.array([0, 1, 0]), num_bins=2)
    >>> round(float(ece), 4)
    0.1667

    Args:
      logits: member logits of shape ``[E, B, C]``.
      labels: integer class indices of shape ``[B]``, in ``[0, C)``.
      num_bins: the number of bins M, an int >= 1 (static under
        :func:`jax.jit`).

    Returns:
      The adaptive ECE in ``[0, 1]``, a scalar;
      NaN if any example has invalid logits (see the module docs) or, under
      :func:`jax.jit`, a label outside ``[0, C)``.

    Raises:
      ValueError: if the shapes do not match ``[E, B, C]`` and ``[B]``, if
        ``num_bins < 1``, or (when not traced) a label lies outside ``[0, C)``.
      TypeError: if ``logits`` is not floating-point, ``labels`` not integer or
        ``num_bins`` not an int.
    """
    num_bins = check_positive_int(num_bins, "num_bins")
    logits = _check_logits(logits)
    return _adaptive_ece(logits, _check_labels(labels, logits), num_bins=num_bins)


@functools.partial(jax.jit, static_argnames=("num_bins",))
def _mce(logits: jax.Array, labels: jax.Array, num_bins: int) -> jax.Array:
    gaps, counts, invalid = _equal_width_gaps(logits, labels, num_bins)
    per_bin = jnp.abs(gaps) / jnp.maximum(counts, 1)  # 0 for an empty bin
    return _poison_all(jnp.max(per_bin), invalid)


def mce(logits: jax.Array, labels: jax.Array, num_bins: int = 15) -> jax.Array:
    """Maximum calibration error of the ensemble predictive.

    Over the equal-width confidence bins ``(i/M, (i+1)/M]`` of :func:`ece`, the
    largest ``|accuracy - mean confidence|`` of a non-empty bin, however few
    examples it holds (Naeini et al., 2015).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1], [0.8, 0.2]]]))  # E=1, B=2
    >>> # Right at confidence .9 (gap .1), wrong at .8 (gap .8).
    >>> round(float(uncertainty.mce(logits, jnp.array([0, 1]), num_bins=10)), 4)
    0.8

    Args:
      logits: member logits of shape ``[E, B, C]``.
      labels: integer class indices of shape ``[B]``, in ``[0, C)``.
      num_bins: the number of confidence bins M, an int >= 1 (static under
        :func:`jax.jit`).

    Returns:
      The MCE in ``[0, 1]``, a scalar;
      NaN if any example has invalid logits (see the module docs) or, under
      :func:`jax.jit`, a label outside ``[0, C)``.

    Raises:
      ValueError: if the shapes do not match ``[E, B, C]`` and ``[B]``, if
        ``num_bins < 1``, or (when not traced) a label lies outside ``[0, C)``.
      TypeError: if ``logits`` is not floating-point, ``labels`` not integer or
        ``num_bins`` not an int.
    """
    num_bins = check_positive_int(num_bins, "num_bins")
    logits = _check_logits(logits)
    return _mce(logits, _check_labels(labels, logits), num_bins=num_bins)


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
    in_scores = _check_scores(in_scores, "in_scores")
    out_scores = _check_scores(out_scores, "out_scores")
    in_ranks, out_ranks, unranked, dtype = _joint_ranks(in_scores, out_scores)
    return _auroc(in_ranks, out_ranks, unranked, dtype=dtype)
