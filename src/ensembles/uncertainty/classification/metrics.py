"""Metrics of a classifier ensemble against labels, one scalar each.

Each takes member logits ``[E, B, C]`` and integer labels ``[B]``:
:func:`nll`, :func:`accuracy` and :func:`brier` score the ensemble
predictive; :func:`ece`, :func:`adaptive_ece` and :func:`mce` its
calibration; :func:`aurc` and :func:`augrc` its selective prediction, where
a classifier that may abstain answers the ``k`` examples it is most sure of
(the predictive's largest probability, or the lowest of any per-example
uncertainty given as ``scores=``, :func:`mutual_information`,
:func:`energy_score`, ...; its answers stay the predictive's argmax): the
risk-coverage curve is their error rate against the coverage ``k / B``.
See :mod:`ensembles.uncertainty`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import check_positive_int
from ensembles.uncertainty._common import check_scores, poison_all
from ensembles.uncertainty.classification._common import (
    _at_least_float32,
    _check_labels,
    _check_logits,
    _member_log_probs,
    _predictive_log_probs,
    _probabilities,
    _split_invalid_labeled,
)


def _confidence_and_correct(
    logits: jax.Array, labels: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns ``[B]`` confidences, ``[B]`` int32 correctness, ``[B]`` invalid.

    The confidence is the predictive's largest probability, correct where its
    argmax is the label; the mask is :func:`_split_invalid_labeled`'s.
    """
    logits, labels, invalid = _split_invalid_labeled(logits, labels)
    probs = _probabilities(logits, members=False)
    correct = (jnp.argmax(probs, axis=-1) == labels).astype(jnp.int32)
    return jnp.max(probs, axis=-1), correct, invalid


def _tie_averaged_cumsum(
    sorted_keys: jax.Array, counts: jax.Array, dtype: jnp.dtype
) -> jax.Array:
    """Running sum of ``counts`` along ascending ``sorted_keys``, ties averaged.

    Entry ``i`` is the mean, over every order of the examples whose keys tie,
    of ``sum(counts[:i + 1])``: the exact integer sum up to the start of
    ``i``'s tie group plus a linear share of the group's total. It depends on
    the keys and on each group's total only, never on the order within a tie.
    """
    num = sorted_keys.shape[0]
    start = jnp.searchsorted(sorted_keys, sorted_keys, side="left")
    end = jnp.searchsorted(sorted_keys, sorted_keys, side="right")
    through = jnp.concatenate([jnp.zeros(1, counts.dtype), jnp.cumsum(counts)])
    before, group_total = through[start], through[end] - through[start]
    taken = jnp.arange(1, num + 1) - start  # of the group, up to and with i
    share = taken.astype(dtype) * group_total.astype(dtype) / (end - start)
    return before.astype(dtype) + share


@jax.jit
def _nll(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits, labels, invalid = _split_invalid_labeled(logits, labels)
    log_probs = _predictive_log_probs(_member_log_probs(logits))
    picked = jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]
    return poison_all(-jnp.mean(picked), invalid)


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
    probs = _probabilities(logits, members=False)
    predicted = jnp.argmax(probs, axis=-1)
    return poison_all(jnp.mean((predicted == labels).astype(probs.dtype)), invalid)


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
    probs = _probabilities(logits, members=False)
    targets = jax.nn.one_hot(labels, probs.shape[-1], dtype=probs.dtype)
    return poison_all(jnp.mean(jnp.sum(jnp.square(probs - targets), axis=-1)), invalid)


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
    return poison_all(jnp.sum(jnp.abs(gaps)) / labels.shape[0], invalid)


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
    return poison_all(jnp.sum(gaps) / num_examples, invalid)


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
    return poison_all(jnp.max(per_bin), invalid)


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


# ------------------------------------------------------------ selective prediction


def _errors_among_most_confident(
    logits: jax.Array, labels: jax.Array, scores: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Returns ``[B]`` errors among the ``k = 1..B`` most confident, invalid.

    Most confident: the highest predictive confidence, or the lowest
    ``scores``. The errors are averaged over the orders of tied keys.
    """
    confidence, correct, invalid = _confidence_and_correct(logits, labels)
    if scores is None:
        # Descending confidence is ascending -confidence (negation is exact).
        keys = -confidence
    else:
        keys = _at_least_float32(scores)
        invalid = invalid | jnp.isnan(keys)
        keys = jnp.where(jnp.isnan(keys), 0.0, keys)
    keys, wrong = jax.lax.sort((keys, 1 - correct), num_keys=1)
    return _tie_averaged_cumsum(keys, wrong, confidence.dtype), invalid


def _checked(logits, labels, scores) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The logits, labels and ``scores`` (``None``: rank by confidence) checked."""
    logits = _check_logits(logits)
    labels = _check_labels(labels, logits)
    if scores is None:
        return logits, labels, None
    scores = jnp.asarray(check_scores(scores, "scores"))
    if scores.shape[0] != logits.shape[1]:
        raise ValueError(
            f"`scores` must hold one uncertainty per example, shape [B] = "
            f"({logits.shape[1]},) for `logits` of shape {tuple(logits.shape)}, "
            f"got shape {tuple(scores.shape)}."
        )
    return logits, labels, scores


@jax.jit
def _aurc(logits: jax.Array, labels: jax.Array, scores: jax.Array | None):
    errors, invalid = _errors_among_most_confident(logits, labels, scores)
    covered = jnp.arange(1, errors.shape[0] + 1, dtype=errors.dtype)
    return poison_all(jnp.mean(errors / covered), invalid)


def aurc(
    logits: jax.Array, labels: jax.Array, *, scores: jax.Array | None = None
) -> jax.Array:
    """Area under the risk-coverage curve of the ensemble predictive.

    Sort the examples by confidence (the predictive's largest probability),
    most confident first; the AURC is the mean over ``k = 1..B`` of the error
    rate (argmax not the label) among the first ``k`` (Geifman et al., 2018).
    It is 0 when every example is right and 1 when every one is wrong; a good
    ranking puts the errors last and lowers it.

    Ties: the risk is averaged over every order of the examples whose
    confidences tie (the value a random tie-break gives on average), so the
    result does not depend on their order in the batch.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1], [0.8, 0.2], [0.6, 0.4]]]))
    >>> # Right, wrong, right by confidence: risks 0, 1/2, 1/3.
    >>> uncertainty.aurc(logits, jnp.array([0, 1, 0])).round(4)
    Array(0.2778, dtype=float32)
    >>> # Ranked by another uncertainty: the wrong example answered first.
    >>> order = jnp.array([0.5, 0.1, 0.9])
    >>> round(float(uncertainty.aurc(logits, jnp.array([0, 1, 0]), scores=order)), 4)
    0.6111

    Args:
      logits: member logits of shape ``[E, B, C]``.
      labels: integer class indices of shape ``[B]``, in ``[0, C)``.
      scores: ``[B]`` uncertainties to answer by, lowest first (e.g.
        :func:`mutual_information` or :func:`energy_score` of the logits);
        ``None`` ranks by the predictive's confidence.

    Returns:
      The AURC in ``[0, 1]``, a scalar;
      NaN if any example has invalid logits (see the module docs), a NaN
      score or, under :func:`jax.jit`, a label outside ``[0, C)``.

    Raises:
      ValueError: if the shapes do not match ``[E, B, C]`` and ``[B]``, or (when
        not traced) a label lies outside ``[0, C)``.
      TypeError: if ``logits`` is not floating-point, ``labels`` not integer or
        ``scores`` not real numbers.
    """
    return _aurc(*_checked(logits, labels, scores))


@jax.jit
def _augrc(logits: jax.Array, labels: jax.Array, scores: jax.Array | None):
    errors, invalid = _errors_among_most_confident(logits, labels, scores)
    return poison_all(jnp.mean(errors) / errors.shape[0], invalid)


def augrc(
    logits: jax.Array, labels: jax.Array, *, scores: jax.Array | None = None
) -> jax.Array:
    """Area under the generalized risk-coverage curve of the ensemble predictive.

    Sort the examples by confidence, most confident first; the AUGRC is the
    mean over ``k = 1..B`` of the number of errors among the first ``k``,
    divided by ``B`` (the joint probability of being answered and wrong;
    Traub et al., 2024). Unlike :func:`aurc` it does not weigh the few most
    confident examples heavily. It is 0 when every example is right and
    ``(B + 1) / (2B)`` when every one is wrong.

    Ties: averaged over every order of the examples whose confidences tie, as
    in :func:`aurc`.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1], [0.8, 0.2], [0.6, 0.4]]]))
    >>> # Right, wrong, right by confidence: errors 0, 1, 1 out of 3.
    >>> round(float(uncertainty.augrc(logits, jnp.array([0, 1, 0]))), 4)
    0.2222

    Args:
      logits: member logits of shape ``[E, B, C]``.
      labels: integer class indices of shape ``[B]``, in ``[0, C)``.
      scores: ``[B]`` uncertainties to answer by, lowest first, as for
        :func:`aurc`; ``None`` ranks by the predictive's confidence.

    Returns:
      The AUGRC in ``[0, 1]``, a scalar;
      NaN if any example has invalid logits (see the module docs), a NaN
      score or, under :func:`jax.jit`, a label outside ``[0, C)``.

    Raises:
      ValueError: if the shapes do not match ``[E, B, C]`` and ``[B]``, or (when
        not traced) a label lies outside ``[0, C)``.
      TypeError: if ``logits`` is not floating-point, ``labels`` not integer or
        ``scores`` not real numbers.
    """
    return _augrc(*_checked(logits, labels, scores))
