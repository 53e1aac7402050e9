"""Predictive statistics and metrics of an ensemble, from its members' logits.

Every function takes the members' logits as one ``[E, B, C]`` array (members,
examples, classes), the layout :func:`ensembles.untile` gives a model's
member-major ``[E*B, C]`` outputs. The ensemble's prediction is the mean of the
member softmaxes, the predictive ``p(y | x) = 1/E sum_k p_k(y | x)``.

Its uncertainty splits into two parts::

    total_entropy       =  expected_entropy  +  mutual_information
    H[1/E sum_k p_k]    =  1/E sum_k H[p_k]  +  I(y; member)
    (total)                (aleatoric)           (epistemic)

``expected_entropy`` is the noise every member sees in the data (high where the
classes overlap); ``mutual_information`` is how much the members disagree, the
part more data or more training would remove. It is non-negative (entropy is
concave) and is the usual score for out-of-distribution detection, ranked by
:func:`auroc`.

Everything is computed in log space (``log_softmax``, ``logsumexp`` over members
minus ``log E``) in at least float32, so bf16 logits and logits of +-1e4 give
finite, accurate results, and ``0 * log 0`` counts as 0. All functions can be
wrapped in :func:`jax.jit`; ``num_bins`` of :func:`ece` is then static.

Bad input never gives a finite answer. An example's logits are *invalid* when
some member's row holds a NaN or a ``+inf``, or is ``-inf`` for every class (no
distribution at all); ``-inf`` for some classes is a valid mask and gives those
classes probability 0. Per-example scores are NaN for exactly the examples with
invalid logits (the other examples are computed as if those were absent); every
metric that aggregates over examples is NaN if any of them is invalid.
Out-of-range labels raise a ``ValueError`` when their values are known and make
the metric NaN under :func:`jax.jit`; :func:`auroc` is NaN if any score is NaN
or infinite. Eager or jitted, the result is the same NaN, never a finite number
that looks like a confident answer.

>>> import jax.numpy as jnp
>>> from ensembles import uncertainty
>>> sure_and_agreeing = jnp.array([[[9.0, 0.0]], [[9.0, 0.0]]])
>>> sure_and_disagreeing = jnp.array([[[9.0, 0.0]], [[0.0, 9.0]]])
>>> logits = jnp.concatenate([sure_and_agreeing, sure_and_disagreeing], axis=1)
>>> logits.shape  # [E, B, C]
(2, 2, 2)
>>> uncertainty.mutual_information(logits).round(2)
Array([0.  , 0.69], dtype=float32)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import check_positive_int

__all__ = [
    "accuracy",
    "auroc",
    "brier",
    "disagreement",
    "ece",
    "expected_entropy",
    "mutual_information",
    "nll",
    "predictive_probs",
    "total_entropy",
    "variance",
]


# --------------------------------------------------------------------------- checks


def _check_logits(logits: jax.Array) -> jax.Array:
    """Returns ``logits`` as an array after checking it is floating ``[E, B, C]``."""
    logits = jnp.asarray(logits)
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(
            f"`logits` must be a floating-point array, got dtype {logits.dtype}: "
            "pass the model's raw outputs, or cast them with "
            "`logits.astype(jnp.float32)`."
        )
    shape = tuple(logits.shape)
    if len(shape) != 3:
        if len(shape) == 2:
            fix = (
                "If these are a model's member-major [E*B, C] outputs, split them "
                "with `ensembles.untile(logits, E)`."
            )
        elif len(shape) > 3:
            fix = (
                "Fold the extra axes into the batch axis: "
                f"`logits.reshape({shape[0]}, -1, {shape[-1]})`."
            )
        else:
            fix = "Give one row of class logits per member and example."
        raise ValueError(
            "`logits` must have shape [E, B, C] (members, examples, classes), "
            f"got shape {shape} ({len(shape)}-D). {fix}"
        )
    if 0 in shape:
        raise ValueError(
            "`logits` must have at least one member, example and class, "
            f"got shape {shape} (E={shape[0]}, B={shape[1]}, C={shape[2]})."
        )
    return logits


def _check_labels(labels: jax.Array, logits: jax.Array) -> jax.Array:
    """Returns ``labels`` as an int ``[B]`` array matching ``[E, B, C]`` logits."""
    labels = jnp.asarray(labels)
    num_examples, num_classes = logits.shape[1], logits.shape[2]
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"`labels` must be integer class indices, got dtype {labels.dtype}: "
            "for one-hot labels pass `labels.argmax(-1)`, for integral floats "
            "`labels.astype(jnp.int32)`."
        )
    if tuple(labels.shape) != (num_examples,):
        raise ValueError(
            f"`labels` must have shape [B] = ({num_examples},) to match `logits` "
            f"of shape {tuple(logits.shape)} ([E, B, C]), got shape "
            f"{tuple(labels.shape)}."
        )
    # Out-of-range labels would be silently clipped or filled by the gathers
    # below; check them whenever their values are known (not under jit).
    try:
        values = np.asarray(labels)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        values = None
    if values is not None:
        bad = (values < 0) | (values >= num_classes)
        if bad.any():
            index = int(np.argmax(bad))
            raise ValueError(
                f"`labels` must lie in [0, C) = [0, {num_classes}), got "
                f"labels[{index}] = {int(values[index])}."
            )
    return labels


def _check_scores(scores: jax.Array, name: str) -> jax.Array:
    """Returns ``scores`` as a non-empty real 1-D array."""
    scores = jnp.asarray(scores)
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
            f"`{name}` must hold at least one score, got an empty array: AUROC "
            "needs both in-distribution and out-of-distribution examples."
        )
    return scores


# ------------------------------------------------------------------------- helpers

# Each public function validates in Python (shapes, and label values when they
# are known) and then makes one call to a jitted private twin: an eager call
# compiles once per shape instead of dispatching a dozen ops, and under an outer
# jit the twin simply inlines.


def _at_least_float32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _member_log_probs(logits: jax.Array) -> jax.Array:
    """``[E, B, C]`` log-softmax of each member, in at least float32."""
    return jax.nn.log_softmax(_at_least_float32(logits), axis=-1)


def _member_probs(logits: jax.Array) -> jax.Array:
    """``[E, B, C]`` softmax of each member, in at least float32."""
    return jax.nn.softmax(_at_least_float32(logits), axis=-1)


def _predictive_log_probs(member_log_probs: jax.Array) -> jax.Array:
    """``[B, C]`` log of the mean member softmax, never leaving log space."""
    num_members = member_log_probs.shape[0]
    # A class every member rules out (-inf, e.g. a masked logit) is -inf; the
    # where keeps logsumexp's 0/0 out of the gradient for it.
    ruled_out = jnp.all(member_log_probs == -jnp.inf, axis=0)
    safe = jnp.where(ruled_out[None], 0.0, member_log_probs)
    log_probs = jax.nn.logsumexp(safe, axis=0) - math.log(num_members)
    return jnp.where(ruled_out, -jnp.inf, log_probs)


def _invalid_examples(logits: jax.Array) -> jax.Array:
    """``[B]`` booleans: True where some member's logits give no distribution.

    That is a NaN or ``+inf`` anywhere in the member's row (softmax would
    return NaN, or ``exp`` overflow would pick a class by accident), or a row
    that is ``-inf`` for every class. A ``-inf`` next to finite logits is a
    masked class and stays valid.
    """
    broken = jnp.isnan(logits) | (logits == jnp.inf)
    rules_out_all = jnp.all(logits == -jnp.inf, axis=-1)
    return jnp.any(jnp.any(broken, axis=-1) | rules_out_all, axis=0)


def _split_invalid(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns ``(logits with invalid examples zeroed, [B] invalid mask)``.

    Zeroing them keeps NaN out of the valid examples' values and gradients; the
    caller then poisons the invalid examples' results with :func:`_poison`.
    """
    invalid = _invalid_examples(logits)
    return jnp.where(invalid[None, :, None], 0.0, logits), invalid


def _poison(values: jax.Array, invalid: jax.Array) -> jax.Array:
    """NaN where ``invalid`` ([B], broadcast over trailing axes) is True."""
    invalid = invalid.reshape(invalid.shape + (1,) * (values.ndim - invalid.ndim))
    return jnp.where(invalid, jnp.nan, values)


def _poison_all(value: jax.Array, invalid: jax.Array) -> jax.Array:
    """``value`` (an aggregate over examples), or NaN if any example is invalid."""
    return jnp.where(jnp.any(invalid), jnp.nan, value)


def _split_invalid_labeled(
    logits: jax.Array, labels: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`_split_invalid`, also marking out-of-range labels invalid.

    Out-of-range labels raise eagerly (:func:`_check_labels`); under ``jit``
    their values are unknown, so they reach here and poison the metric. They
    are replaced by class 0 so that no gather clips or fills them silently.
    """
    logits, invalid = _split_invalid(logits)
    bad_label = (labels < 0) | (labels >= logits.shape[-1])
    return logits, jnp.where(bad_label, 0, labels), invalid | bad_label


def _entropy(log_probs: jax.Array) -> jax.Array:
    """Entropy over the last axis, with ``0 * log 0 = 0`` (also in gradients)."""
    probs = jnp.exp(log_probs)
    positive = probs > 0
    # The inner where keeps -inf out of the product, so that neither the value
    # nor its gradient becomes 0 * inf = nan for classes of probability zero.
    safe_log_probs = jnp.where(positive, log_probs, 0.0)
    return -jnp.sum(jnp.where(positive, probs * safe_log_probs, 0.0), axis=-1)


# ---------------------------------------------------------------- per-example


def _predictive_probs_unchecked(logits: jax.Array) -> jax.Array:
    return jnp.mean(_member_probs(logits), axis=0)


@jax.jit
def _predictive_probs(logits: jax.Array) -> jax.Array:
    logits, invalid = _split_invalid(logits)
    return _poison(_predictive_probs_unchecked(logits), invalid)


def predictive_probs(logits: jax.Array) -> jax.Array:
    """The ensemble's predictive distribution: the mean of the member softmaxes.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1]], [[0.5, 0.5]]]))  # E=2, B=1, C=2
    >>> uncertainty.predictive_probs(logits)
    Array([[0.7, 0.3]], dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.

    Returns:
      ``[B, C]`` class probabilities, in the logits' dtype promoted to at least
      float32. A row of NaN for an example with invalid logits (see the module
      docs): a NaN or ``+inf``, or a member ruling out every class; other
      examples are unaffected.

    Raises:
      ValueError: if ``logits`` is not 3-D or has an empty axis.
      TypeError: if ``logits`` is not floating-point.
    """
    return _predictive_probs(_check_logits(logits))


@jax.jit
def _total_entropy(logits: jax.Array) -> jax.Array:
    logits, invalid = _split_invalid(logits)
    return _poison(_entropy(_predictive_log_probs(_member_log_probs(logits))), invalid)


def total_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of the ensemble predictive: total uncertainty, in nats.

    ``H[1/E sum_k p_k]``, computed from ``logsumexp`` over members minus ``log E``.
    It is the sum of :func:`expected_entropy` and :func:`mutual_information`.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.array([[[5.0, 0.0]], [[0.0, 5.0]]])  # two sure, opposite members
    >>> uncertainty.total_entropy(logits)  # log 2: the predictive is 50/50
    Array([0.6931472], dtype=float32)
    >>> diverged = jnp.array([[[5.0, 0.0], [1.0, 0.0]], [[jnp.nan, 0.0], [0.0, 1.0]]])
    >>> uncertainty.total_entropy(diverged)  # only example 0 is broken
    Array([      nan, 0.6931472], dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.

    Returns:
      ``[B]`` entropies in ``[0, log C]``;
      NaN for an example with invalid logits (see the module docs): a NaN or
      ``+inf``, or a member ruling out every class; other examples unaffected.

    Raises:
      ValueError: if ``logits`` is not 3-D or has an empty axis.
      TypeError: if ``logits`` is not floating-point.
    """
    return _total_entropy(_check_logits(logits))


@jax.jit
def _expected_entropy(logits: jax.Array) -> jax.Array:
    logits, invalid = _split_invalid(logits)
    return _poison(jnp.mean(_entropy(_member_log_probs(logits)), axis=0), invalid)


def expected_entropy(logits: jax.Array) -> jax.Array:
    """Mean entropy of the members: aleatoric uncertainty, in nats.

    ``1/E sum_k H[p_k]``: high where every member finds the example ambiguous.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.array([[[5.0, 0.0]], [[0.0, 5.0]]])  # each member is sure
    >>> uncertainty.expected_entropy(logits).round(4)
    Array([0.0402], dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.

    Returns:
      ``[B]`` entropies in ``[0, log C]``;
      NaN for an example with invalid logits (see the module docs): a NaN or
      ``+inf``, or a member ruling out every class; other examples unaffected.

    Raises:
      ValueError: if ``logits`` is not 3-D or has an empty axis.
      TypeError: if ``logits`` is not floating-point.
    """
    return _expected_entropy(_check_logits(logits))


@jax.jit
def _mutual_information(logits: jax.Array) -> jax.Array:
    logits, invalid = _split_invalid(logits)
    member_log_probs = _member_log_probs(logits)
    total = _entropy(_predictive_log_probs(member_log_probs))
    expected = jnp.mean(_entropy(member_log_probs), axis=0)
    return _poison(jnp.maximum(total - expected, 0.0), invalid)


def mutual_information(logits: jax.Array) -> jax.Array:
    """Mutual information between label and member: epistemic uncertainty.

    ``total_entropy - expected_entropy`` (the BALD score), clipped at 0 where
    rounding would make it slightly negative. It is 0 when all members agree
    (and for a single member) and at most ``min(log E, log C)``.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.array([[[9.0, 0.0], [9.0, 0.0]], [[9.0, 0.0], [0.0, 9.0]]])
    >>> uncertainty.mutual_information(logits).round(2)  # agree, then disagree
    Array([0.  , 0.69], dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.

    Returns:
      ``[B]`` non-negative mutual informations, in nats;
      NaN for an example with invalid logits (see the module docs): a NaN or
      ``+inf``, or a member ruling out every class; other examples unaffected.

    Raises:
      ValueError: if ``logits`` is not 3-D or has an empty axis.
      TypeError: if ``logits`` is not floating-point.
    """
    return _mutual_information(_check_logits(logits))


@jax.jit
def _disagreement(logits: jax.Array) -> jax.Array:
    logits, invalid = _split_invalid(logits)
    member_probs = _member_probs(logits)
    # Argmax over the probabilities for both, so that a single member always
    # agrees with itself even where exp() rounds nearby logits to a tie.
    member_class = jnp.argmax(member_probs, axis=-1)
    ensemble_class = jnp.argmax(jnp.mean(member_probs, axis=0), axis=-1)
    differs = member_class != ensemble_class[None, :]
    return _poison(jnp.mean(differs.astype(member_probs.dtype), axis=0), invalid)


def disagreement(logits: jax.Array) -> jax.Array:
    """Share of members whose predicted class differs from the ensemble's.

    The ensemble's class is the argmax of :func:`predictive_probs`; each member's
    is the argmax of its own softmax (ties go to the lower class index).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.array([[[2.0, 0.0]], [[3.0, 0.0]], [[0.0, 1.0]]])  # E=3, B=1
    >>> uncertainty.disagreement(logits)  # the third member dissents
    Array([0.33333334], dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.

    Returns:
      ``[B]`` fractions in ``[0, 1]`` (0 for a single member; it can reach 1
      where the mean favours a class no member ranks first);
      NaN for an example with invalid logits (see the module docs): a NaN or
      ``+inf``, or a member ruling out every class; other examples unaffected.

    Raises:
      ValueError: if ``logits`` is not 3-D or has an empty axis.
      TypeError: if ``logits`` is not floating-point.
    """
    return _disagreement(_check_logits(logits))


@jax.jit
def _variance(logits: jax.Array) -> jax.Array:
    logits, invalid = _split_invalid(logits)
    member_probs = _member_probs(logits)
    deviations = member_probs - jnp.mean(member_probs, axis=0, keepdims=True)
    variances = jnp.sum(jnp.mean(jnp.square(deviations), axis=0), axis=-1)
    return _poison(variances, invalid)


def variance(logits: jax.Array) -> jax.Array:
    """Variance of the member probabilities over members, summed over classes.

    ``sum_c 1/E sum_k (p_k[c] - p[c])**2`` with ``p`` the predictive (the
    population variance, ``ddof=0``); 0 when all members agree.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1]], [[0.5, 0.5]]]))
    >>> uncertainty.variance(logits)  # 0.2**2 per class, for 2 classes
    Array([0.08], dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.

    Returns:
      ``[B]`` variances in ``[0, 1 - 1/E]``;
      NaN for an example with invalid logits (see the module docs): a NaN or
      ``+inf``, or a member ruling out every class; other examples unaffected.

    Raises:
      ValueError: if ``logits`` is not 3-D or has an empty axis.
      TypeError: if ``logits`` is not floating-point.
    """
    return _variance(_check_logits(logits))


# ---------------------------------------------------------------------- metrics


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
    Array(0.35667497, dtype=float32)

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


@functools.partial(jax.jit, static_argnames=("num_bins",))
def _ece(logits: jax.Array, labels: jax.Array, num_bins: int) -> jax.Array:
    logits, labels, invalid = _split_invalid_labeled(logits, labels)
    probs = _predictive_probs_unchecked(logits)
    confidence = jnp.max(probs, axis=-1)
    correct = (jnp.argmax(probs, axis=-1) == labels).astype(probs.dtype)
    # Bin i holds confidences in (edges[i], edges[i+1]]; a side="left" search
    # puts a confidence equal to an edge into the bin below it.
    edges = jnp.linspace(0.0, 1.0, num_bins + 1, dtype=probs.dtype)
    bins = jnp.clip(
        jnp.searchsorted(edges, confidence, side="left") - 1, 0, num_bins - 1
    )
    # sum_bins n_i/B * |acc_i - conf_i| = sum_bins |sum_i (correct - conf)| / B.
    gaps = jnp.zeros(num_bins, probs.dtype).at[bins].add(correct - confidence)
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


@jax.jit
def _auroc(in_scores: jax.Array, out_scores: jax.Array) -> jax.Array:
    dtype = jnp.promote_types(
        jnp.promote_types(in_scores.dtype, out_scores.dtype), jnp.float32
    )
    sorted_in = jnp.sort(in_scores.astype(dtype))
    out_scores = out_scores.astype(dtype)
    # For each positive: #negatives below it, and #below-or-equal; their mean
    # counts ties as half.
    below = jnp.searchsorted(sorted_in, out_scores, side="left")
    below_or_equal = jnp.searchsorted(sorted_in, out_scores, side="right")
    wins = (below + below_or_equal).astype(dtype) / (2 * in_scores.shape[0])
    # NaN sorts last and compares false, so it would count as a sure loss (or
    # win): the AUROC of unranked scores is undefined. An infinite score is an
    # overflow upstream more often than a real extreme; both poison the result.
    broken = ~(jnp.all(jnp.isfinite(sorted_in)) & jnp.all(jnp.isfinite(out_scores)))
    return jnp.where(broken, jnp.nan, jnp.mean(wins))


def auroc(in_scores: jax.Array, out_scores: jax.Array) -> jax.Array:
    """Area under the ROC curve for telling out-of-distribution examples apart.

    Out-of-distribution examples are the positive class and should score
    higher (use an uncertainty such as :func:`mutual_information` or
    :func:`total_entropy`). The AUROC is the probability that a random
    out-of-distribution example outscores a random in-distribution one, ties
    counted as half (the Mann-Whitney U statistic over ``n_in * n_out``),
    computed with one sort and two binary searches: ``O(n log n)``.

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
      TypeError: if either array is not real-valued.
    """
    return _auroc(
        _check_scores(in_scores, "in_scores"), _check_scores(out_scores, "out_scores")
    )
