"""The out-of-distribution scores people compare, of a member and of the ensemble.

Beside :func:`total_entropy` and :func:`mutual_information`, the scores of the
out-of-distribution literature, each from member logits ``[E, B, C]``:

* :func:`max_probability_score`: minus the largest class probability (the
  baseline of Hendrycks & Gimpel, 2017);
* :func:`margin_score`: minus the gap between the two largest probabilities;
* :func:`max_logit_score`: minus the largest raw logit (Hendrycks et al.,
  2022);
* :func:`energy_score`: minus the log-sum-exp of the raw logits, the energy
  of Liu et al. (2020).

Every one is oriented as an *uncertainty*: higher means less sure, as the
entropies are, so :func:`auroc`, :func:`aupr` and :func:`fpr_at_tpr` (which
expect out-of-distribution examples to score higher) take it as it is, and
:func:`aurc` ranks by it with ``scores=``. The confidences are negated for
that, as torch-uncertainty's criteria negate them.

``members=False`` (the default) scores the ensemble, ``[B]``;
``members=True`` scores each member alone, ``[E, B]``. The ensemble's
probability scores are those of its predictive ``1/E sum_k p_k``; its logit
scores are the mean of the members' (the predictive, a mixture of softmaxes,
has no logits of its own, and the raw logits' scale is what these scores
read). Invalid logits (a NaN or ``+inf``, or a member ruling out every
class; see :mod:`ensembles.uncertainty`) make an example's scores NaN, for
every member too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ensembles._checks import check_bool
from ensembles.uncertainty.classification._common import (
    _at_least_float32,
    _check_logits,
    _poison,
    _probabilities,
    _split_invalid,
)


def _per_example(values: jax.Array, invalid: jax.Array) -> jax.Array:
    """``values`` (``[B]`` or ``[E, B]``) NaN for the invalid examples."""
    return _poison(values, jnp.broadcast_to(invalid, values.shape))


@functools.partial(jax.jit, static_argnames="members")
def _max_probability_score(logits: jax.Array, members: bool) -> jax.Array:
    logits, invalid = _split_invalid(logits)
    top = jnp.max(_probabilities(logits, members), axis=-1)
    return _per_example(-top, invalid)


@functools.partial(jax.jit, static_argnames="members")
def _margin_score(logits: jax.Array, members: bool) -> jax.Array:
    logits, invalid = _split_invalid(logits)
    top_two = jax.lax.top_k(_probabilities(logits, members), 2)[0]
    return _per_example(top_two[..., 1] - top_two[..., 0], invalid)


@functools.partial(jax.jit, static_argnames="members")
def _max_logit_score(logits: jax.Array, members: bool) -> jax.Array:
    logits, invalid = _split_invalid(logits)
    scores = -jnp.max(_at_least_float32(logits), axis=-1)  # [E, B]
    return _per_example(scores if members else jnp.mean(scores, axis=0), invalid)


@functools.partial(jax.jit, static_argnames="members")
def _energy_score(logits: jax.Array, members: bool) -> jax.Array:
    logits, invalid = _split_invalid(logits)
    scores = -jax.nn.logsumexp(_at_least_float32(logits), axis=-1)  # [E, B]
    return _per_example(scores if members else jnp.mean(scores, axis=0), invalid)


def _checked(logits, members) -> tuple[jax.Array, bool]:
    return _check_logits(logits), check_bool(members, "members")


def max_probability_score(logits: jax.Array, *, members: bool = False) -> jax.Array:
    """Minus the largest class probability: the baseline out-of-distribution score.

    ``-max_c p_c`` with ``p`` the ensemble's predictive (``members=False``)
    or each member's own softmax (``members=True``); higher is less sure
    (Hendrycks & Gimpel, 2017, rank by the probability itself).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1]], [[0.5, 0.5]]]))  # E=2, B=1
    >>> uncertainty.max_probability_score(logits)  # the predictive is .7 / .3
    Array([-0.7], dtype=float32)
    >>> uncertainty.max_probability_score(logits, members=True)
    Array([[-0.9],
           [-0.5]], dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.
      members: score each member alone, ``[E, B]``, instead of the ensemble.

    Returns:
      ``[B]`` (or ``[E, B]``) scores in ``[-1, -1/C]``, in at least float32;
      NaN for an example with invalid logits (see :mod:`ensembles.uncertainty`).

    Raises:
      ValueError: if ``logits`` is not ``[E, B, C]`` with ``C >= 2``.
      TypeError: if ``logits`` is not floating-point or ``members`` not a bool.
    """
    return _max_probability_score(*_checked(logits, members))


def margin_score(logits: jax.Array, *, members: bool = False) -> jax.Array:
    """Minus the margin between the two most probable classes.

    ``-(p_(1) - p_(2))``, the largest probability less the second largest,
    of the ensemble's predictive or (``members=True``) of each member; higher
    is less sure, 0 where two classes tie for the top.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.6, 0.3, 0.1]], [[0.2, 0.6, 0.2]]]))
    >>> uncertainty.margin_score(logits).round(3)  # predictive .4 / .45 / .15
    Array([-0.05], dtype=float32)
    >>> uncertainty.margin_score(logits, members=True).round(3)
    Array([[-0.3],
           [-0.4]], dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.
      members: score each member alone, ``[E, B]``, instead of the ensemble.

    Returns:
      ``[B]`` (or ``[E, B]``) scores in ``[-1, 0]``, in at least float32;
      NaN for an example with invalid logits.

    Raises:
      ValueError: if ``logits`` is not ``[E, B, C]`` with ``C >= 2``.
      TypeError: if ``logits`` is not floating-point or ``members`` not a bool.
    """
    return _margin_score(*_checked(logits, members))


def max_logit_score(logits: jax.Array, *, members: bool = False) -> jax.Array:
    """Minus the largest raw logit (MaxLogit, Hendrycks et al., 2022).

    ``-max_c z_c`` of each member's raw logits; the ensemble's score is the
    mean of its members' (``members=False``). Unlike the probability scores
    it reads the logits' scale, which a softmax forgets: a member that sees
    little evidence for any class has small logits everywhere.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.array([[[4.0, 1.0]], [[2.0, 3.0]]])  # E=2, B=1
    >>> uncertainty.max_logit_score(logits)  # -(4 + 3) / 2
    Array([-3.5], dtype=float32)
    >>> uncertainty.max_logit_score(logits, members=True)
    Array([[-4.],
           [-3.]], dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.
      members: score each member alone, ``[E, B]``, instead of the ensemble.

    Returns:
      ``[B]`` (or ``[E, B]``) scores in at least float32; NaN for an example
      with invalid logits.

    Raises:
      ValueError: if ``logits`` is not ``[E, B, C]`` with ``C >= 2``.
      TypeError: if ``logits`` is not floating-point or ``members`` not a bool.
    """
    return _max_logit_score(*_checked(logits, members))


def energy_score(logits: jax.Array, *, members: bool = False) -> jax.Array:
    """The energy ``-logsumexp_c z_c`` of the raw logits (Liu et al., 2020).

    Each member's energy; the ensemble's is the mean of its members'
    (``members=False``). Higher is less sure: in-distribution inputs tend to
    have large logits, so low energy. Like :func:`max_logit_score` it reads
    the logits' scale, and it is a smooth version of it: ``-max_c z_c - log
    C <= energy <= -max_c z_c``.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.array([[[0.0, 0.0]], [[2.0, 2.0]]])  # E=2, B=1
    >>> uncertainty.energy_score(logits).round(4)  # -(log 2 + 2 + log 2) / 2
    Array([-1.6931], dtype=float32)
    >>> uncertainty.energy_score(logits, members=True).round(4)
    Array([[-0.6931],
           [-2.6931]], dtype=float32)

    Args:
      logits: member logits of shape ``[E, B, C]``.
      members: score each member alone, ``[E, B]``, instead of the ensemble.

    Returns:
      ``[B]`` (or ``[E, B]``) scores in at least float32; NaN for an example
      with invalid logits.

    Raises:
      ValueError: if ``logits`` is not ``[E, B, C]`` with ``C >= 2``.
      TypeError: if ``logits`` is not floating-point or ``members`` not a bool.
    """
    return _energy_score(*_checked(logits, members))
