"""Per-example uncertainty scores of an ensemble, from its members' logits.

Each takes member logits ``[E, B, C]`` and returns one value per example, ``[B]``
(:func:`predictive_probs` returns ``[B, C]``). See :mod:`ensembles.uncertainty`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ensembles.uncertainty.classification._common import (
    _check_logits,
    _entropy,
    _member_log_probs,
    _member_probs,
    _poison,
    _predictive_log_probs,
    _probabilities,
    _split_invalid,
)


@jax.jit
def _predictive_probs(logits: jax.Array) -> jax.Array:
    logits, invalid = _split_invalid(logits)
    return _poison(_probabilities(logits, members=False), invalid)


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
def _pairwise_disagreement(logits: jax.Array) -> jax.Array:
    logits, invalid = _split_invalid(logits)
    member_class = jnp.argmax(_member_probs(logits), axis=-1)  # [E, B]
    num_members = logits.shape[0]
    differs = member_class[:, None] != member_class[None, :]  # [E, E, B]
    pairs = max(num_members * (num_members - 1), 1)
    share = jnp.sum(differs.astype(jnp.float32), axis=(0, 1)) / pairs
    return _poison(share.astype(_member_probs(logits).dtype), invalid)


def pairwise_disagreement(logits: jax.Array) -> jax.Array:
    """Share of member pairs whose predicted classes differ: members' diversity.

    Over the ``E (E - 1) / 2`` pairs of members, the share that rank a
    different class first (ties to the lower index); unlike
    :func:`disagreement`, no ensemble prediction takes part.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.array([[[2.0, 0.0]], [[3.0, 0.0]], [[0.0, 1.0]]])  # E=3, B=1
    >>> uncertainty.pairwise_disagreement(logits)  # 2 of the 3 pairs differ
    Array([0.6666667], dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.

    Returns:
      ``[B]`` shares in ``[0, 1]`` (0 for one member); NaN for an example
      with invalid logits.

    Raises:
      ValueError: if ``logits`` is not 3-D or has an empty axis.
      TypeError: if ``logits`` is not floating-point.
    """
    return _pairwise_disagreement(_check_logits(logits))


@jax.jit
def _pairwise_kl(logits: jax.Array) -> jax.Array:
    logits, invalid = _split_invalid(logits)
    log_probs = _member_log_probs(logits)  # [E, B, C]
    probs = jnp.exp(log_probs)
    num_members = logits.shape[0]
    # KL(p_k || p_l) = sum_c p_k (log p_k - log p_l); 0 log 0 counts as 0.
    # The difference of logs is taken first: exactly 0 for identical members
    # (a difference of the products p_k log p_k - p_k log p_l, each rounded,
    # was not); what rounding leaves below 0 of a divergence is clipped.
    # Both logs are 0 where p_k is 0, keeping -inf out of the gradient too.
    possible = (probs > 0)[:, None]  # [E, 1, B, C]: p_k > 0
    own = jnp.where(possible, log_probs[:, None], 0.0)
    gap = own - jnp.where(possible, log_probs[None, :], 0.0)  # [E, E, B, C]
    terms = jnp.where(possible, probs[:, None] * gap, 0.0)
    kl = jnp.maximum(jnp.sum(terms, axis=-1), 0.0)  # [E, E, B]
    pairs = max(num_members * (num_members - 1), 1)
    return _poison(jnp.sum(kl, axis=(0, 1)) / pairs, invalid)


def pairwise_kl(logits: jax.Array) -> jax.Array:
    """Mean KL divergence between members' predictions: their diversity in nats.

    ``1 / (E (E - 1)) sum_{k != l} KL(p_k || p_l)`` over the ordered pairs
    of members. Infinite where a member gives probability to a class another
    rules out.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.5, 0.5]], [[0.9, 0.1]]]))
    >>> uncertainty.pairwise_kl(logits).round(3)  # (KL(a||b) + KL(b||a)) / 2
    Array([0.439], dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.

    Returns:
      ``[B]`` non-negative divergences in nats (0 for one member); NaN for an
      example with invalid logits.

    Raises:
      ValueError: if ``logits`` is not 3-D or has an empty axis.
      TypeError: if ``logits`` is not floating-point.
    """
    return _pairwise_kl(_check_logits(logits))


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
