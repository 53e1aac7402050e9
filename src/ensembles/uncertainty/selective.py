"""Selective prediction: the risk of predicting only where the ensemble is sure.

A classifier that may abstain answers the examples it is most confident about
and defers the rest. Sorting the examples by confidence (the ensemble
predictive's largest probability, as :func:`predictive_probs` gives it),
descending, and answering the ``k`` most confident traces the risk-coverage
curve: coverage ``k / B`` against the error rate of those ``k``.
:func:`aurc` is the area under it, :func:`augrc` the area under the
generalized risk-coverage curve, which counts errors among all ``B`` examples.
Both take member logits ``[E, B, C]`` and integer labels ``[B]``; lower is
better. Another order can be asked for with ``scores=``: any per-example
uncertainty, answered from the lowest (:func:`mutual_information`,
:func:`energy_score`, :func:`margin_score`, ...), while the answers and
errors stay the predictive's argmax. See :mod:`ensembles.uncertainty`.

Ties: examples of equal confidence cannot be told apart by the abstaining
classifier, so the curves are averaged over every order of each tie (the value
a random tie-break gives on average). The result then depends only on the
examples, never on their order in the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ensembles.uncertainty._common import (
    _at_least_float32,
    _check_labels,
    _check_logits,
    _check_scores,
    _confidence_and_correct,
    _poison_all,
    _tie_averaged_cumsum,
)

__all__ = ["augrc", "aurc"]


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


def _check_order(scores, logits: jax.Array) -> jax.Array | None:
    """``scores`` (``None``: rank by confidence) as a ``[B]`` array."""
    if scores is None:
        return None
    scores = jnp.asarray(_check_scores(scores, "scores"))
    if scores.shape[0] != logits.shape[1]:
        raise ValueError(
            f"`scores` must hold one uncertainty per example, shape [B] = "
            f"({logits.shape[1]},) for `logits` of shape {tuple(logits.shape)}, "
            f"got shape {tuple(scores.shape)}."
        )
    return scores


@jax.jit
def _aurc(logits: jax.Array, labels: jax.Array, scores: jax.Array | None):
    errors, invalid = _errors_among_most_confident(logits, labels, scores)
    covered = jnp.arange(1, errors.shape[0] + 1, dtype=errors.dtype)
    return _poison_all(jnp.mean(errors / covered), invalid)


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
    confidences tie, so the result does not depend on their order in the
    batch (see :mod:`ensembles.uncertainty.selective`).

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
    logits = _check_logits(logits)
    labels = _check_labels(labels, logits)
    return _aurc(logits, labels, _check_order(scores, logits))


@jax.jit
def _augrc(logits: jax.Array, labels: jax.Array, scores: jax.Array | None):
    errors, invalid = _errors_among_most_confident(logits, labels, scores)
    return _poison_all(jnp.mean(errors) / errors.shape[0], invalid)


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
    logits = _check_logits(logits)
    labels = _check_labels(labels, logits)
    return _augrc(logits, labels, _check_order(scores, logits))
