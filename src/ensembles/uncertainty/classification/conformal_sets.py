"""Split-conformal prediction sets of a classifier, from its members' logits.

A prediction set holds the classes a nonconformity score does not rule out:
fitted on ``n`` held-out examples exchangeable with the test examples, it
holds the true class of at least ``level`` of them, whatever the model
(Vovk et al., 2005; Angelopoulos & Bates, 2023); a shift breaks the
guarantee. :func:`fit_conformal_threshold` finds the threshold, the
``ceil((n + 1) level)``-th smallest score of the held-out labels;
:func:`conformal_sets` gives the sets of new inputs; :func:`set_size` and
:func:`set_coverage` measure them. The scores, of the ensemble's predictive
``p`` (or of each member's softmax, ``members=True``):

* ``"lac"`` (least ambiguous classifiers, Sadinle et al., 2019): ``1 - p_y``.
  The smallest sets on average; a set holds every class of probability at
  least ``1 - threshold``.
* ``"aps"`` (adaptive prediction sets, Romano et al., 2020): ``sum_{j: p_j >
  p_y} p_j + u p_y``, the mass of the classes ranked above ``y`` and a share
  ``u`` of its own. Sets grow where the predictive is spread: closer to
  the level at every confidence, larger on average.
* ``"raps"`` (regularised APS, Angelopoulos et al., 2021): APS plus
  ``penalty * max(rank_y - free_ranks, 0)``, ``rank_y`` the class's rank
  (1 for the most probable): fewer unlikely classes in the sets.

Classes of equal probability share a rank and enter a set together, so no
set depends on the order of the classes. Deterministic APS and RAPS fit
with ``u = 1`` and build sets with ``u = 0``: a set holds the class whose
mass crosses the threshold (the most probable class always, unless RAPS
penalises the first rank), and covers at least ``level``, often more.
Given a ``key`` they are randomised, one ``u = jax.random.uniform(key,
(B,))`` per example (every member alike), in the fit and in the sets: a
set may then be empty, and the coverage is the level's. Without ties among
the scores, LAC and the randomised scores cover between ``level`` and
``level + 1 / (n + 1)`` on average over held-out draws.

Sets are float arrays ``[B, C]`` (``[E, B, C]`` per member), 1.0 where a
class is in, 0.0 where not, so that an example with invalid logits (see
:mod:`ensembles.uncertainty`) can have a NaN row; ``sets == 1`` is the
boolean mask. Fit and sets must be given the same ``score``, ``penalty``
and ``free_ranks``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import (
    as_array,
    check_bool,
    check_choice,
    check_labels,
    check_real,
)
from ensembles.uncertainty._common import (
    check_level,
    conformal_quantile,
    poison_all,
)
from ensembles.uncertainty.classification._common import (
    _check_labels,
    _check_logits,
    _probabilities,
    _split_invalid,
    _split_invalid_labeled,
)

#: The nonconformity scores of the sets (see the module).
SET_SCORES: tuple[str, ...] = ("lac", "aps", "raps")


# ---------------------------------------------------------------------- scores


def _mass_and_rank_above(probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per class of ``[..., C]`` probabilities: the mass and count strictly above.

    By a sort per row, ``O(C log C)``: the classes of higher probability are
    the last of the ascending order, and their mass is a prefix sum of the
    descending one.
    """
    num_classes = probs.shape[-1]

    def row(p):
        ascending = jnp.sort(p)
        above = num_classes - jnp.searchsorted(ascending, p, side="right")
        prefix = jnp.concatenate([jnp.zeros(1, p.dtype), jnp.cumsum(ascending[::-1])])
        return prefix[above], above

    mass, above = jax.vmap(row)(probs.reshape(-1, num_classes))
    return mass.reshape(probs.shape), above.reshape(probs.shape)


def _class_scores(probs, score, share, penalty, free_ranks) -> jax.Array:
    """The nonconformity of every class, ``[..., B, C]`` of ``[..., B, C]`` probs.

    ``share`` is APS's and RAPS's ``u``: ``[B]`` uniforms, or a number (1 in
    a deterministic fit, 0 in deterministic sets).
    """
    if score == "lac":
        return 1 - probs
    mass, above = _mass_and_rank_above(probs)
    share = jnp.asarray(share, probs.dtype)
    if share.ndim:  # [B] uniforms, over the classes (and members)
        share = share.reshape((1,) * (probs.ndim - 2) + (-1, 1))
    scores = mass + share * probs
    if score == "raps":
        excess = jnp.maximum(above + 1 - free_ranks, 0).astype(probs.dtype)
        scores = scores + penalty * excess
    return scores


def _share(key, num_examples: int, dtype, deterministic: float) -> jax.Array:
    """APS's ``u``: ``[B]`` uniforms from ``key``, else ``deterministic``."""
    if key is None:
        return jnp.asarray(deterministic, dtype)
    return jax.random.uniform(key, (num_examples,), dtype)


# ------------------------------------------------------------------------ checks


def _check_key(key: Any, score: str) -> Any:
    """``key`` (``None``: deterministic) after checking it is a JAX random key."""
    if key is None:
        return None
    if score == "lac":
        raise ValueError(
            "`key` randomises the 'aps' and 'raps' scores; the 'lac' score has "
            "nothing to randomise: drop `key`, or pick score='aps'."
        )
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == jnp.uint32 and tuple(np.shape(key)) == (2,)
    if not (typed and np.shape(key) == ()) and not raw:
        raise TypeError(
            f"`key` must be one JAX random key, e.g. `jax.random.key(0)`, got "
            f"{key!r}: pass None for the deterministic sets."
        )
    return key


def _check_options(score, penalty, free_ranks) -> tuple[str, float, int]:
    score = check_choice(score, "score", SET_SCORES)
    penalty = check_real(penalty, "penalty")
    if not (penalty >= 0 and math.isfinite(penalty)):
        raise ValueError(
            f"`penalty` (RAPS's lambda) must be a finite number >= 0, got "
            f"{penalty}: e.g. penalty=0.01."
        )
    if isinstance(free_ranks, bool | np.bool_) or not isinstance(
        free_ranks, int | np.integer
    ):
        raise TypeError(
            f"`free_ranks` (RAPS's k_reg) must be an int >= 0, got {free_ranks!r}."
        )
    if free_ranks < 0:
        raise ValueError(
            f"`free_ranks` (RAPS's k_reg) must be an int >= 0, got {free_ranks}."
        )
    return score, penalty, int(free_ranks)


# ------------------------------------------------------------------- threshold


@functools.partial(jax.jit, static_argnames=("level", "score", "members"))
def _fit_threshold(logits, labels, key, penalty, free_ranks, level, score, members):
    logits, labels, invalid = _split_invalid_labeled(logits, labels)
    probs = _probabilities(logits, members)
    share = _share(key, logits.shape[1], probs.dtype, deterministic=1.0)
    scores = _class_scores(probs, score, share, penalty, free_ranks)
    index = jnp.broadcast_to(labels[:, None], (*scores.shape[:-1], 1))
    label_scores = jnp.take_along_axis(scores, index, axis=-1)[..., 0]
    return poison_all(conformal_quantile(label_scores, level), invalid)


def fit_conformal_threshold(
    logits: jax.Array,
    labels: jax.Array,
    level: float = 0.9,
    *,
    score: str = "lac",
    key: jax.Array | None = None,
    penalty: float = 0.01,
    free_ranks: int = 1,
    members: bool = False,
) -> jax.Array:
    """The split-conformal threshold of a score, fitted on held-out examples.

    The ``ceil((n + 1) level)``-th smallest score of the ``n`` held-out
    examples' labels (``inf`` where ``(n + 1) level > n``): the sets of
    :func:`conformal_sets` at this threshold hold the true class of at least
    ``level`` of new examples exchangeable with these. Fit on a validation
    split, never the test set you report. See
    :mod:`~ensembles.uncertainty.classification.conformal_sets` for the scores.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> keys = jax.random.split(jax.random.key(0), 2)
    >>> logits = 2 * jax.random.normal(keys[0], (4, 999, 10))  # E=4, B=999
    >>> labels = jax.random.categorical(keys[1], logits[0])  # member 0 is right
    >>> threshold = uncertainty.fit_conformal_threshold(logits, labels, 0.9)
    >>> sets = uncertainty.conformal_sets(logits, threshold)  # [B, C]
    >>> sets.shape, float(uncertainty.set_coverage(sets, labels)) >= 0.9
    ((999, 10), True)

    Args:
      logits: held-out member logits ``[E, B, C]``.
      labels: their integer classes ``[B]``, in ``[0, C)``.
      level: the share of true classes the sets must hold, in ``(0, 1)``.
      score: ``"lac"``, ``"aps"`` or ``"raps"`` (static under
        :func:`jax.jit`).
      key: a JAX random key to randomise ``"aps"`` and ``"raps"``; ``None``
        for the deterministic scores.
      penalty: RAPS's ``lambda``, added per rank beyond ``free_ranks``.
      free_ranks: RAPS's ``k_reg``, the ranks that carry no penalty.
      members: one threshold per member, each of its own softmax (static).

    Returns:
      The threshold, a scalar (``[E]`` with ``members``) in at least
      float32; NaN if any example has invalid logits or, under
      :func:`jax.jit`, a label outside ``[0, C)``.

    Raises:
      ValueError: if the shapes do not match ``[E, B, C]`` and ``[B]``, a known
        label lies outside ``[0, C)``, ``level`` is not in ``(0, 1)``, ``score``
        is unknown, ``penalty`` is negative, or a ``key`` is given for
        ``"lac"``.
      TypeError: if ``logits`` is not floating-point, ``labels`` not integer,
        ``key`` not a random key or ``members`` not a bool.
    """
    level = check_level(level, "true classes the sets must hold")
    score, penalty, free_ranks = _check_options(score, penalty, free_ranks)
    key = _check_key(key, score)
    members = check_bool(members, "members")
    logits = _check_logits(logits)
    labels = _check_labels(labels, logits)
    return _fit_threshold(
        logits, labels, key, penalty, free_ranks, level, score, members
    )


# ------------------------------------------------------------------------- sets


@functools.partial(jax.jit, static_argnames=("score",))
def _conformal_sets(logits, threshold, key, penalty, free_ranks, score):
    logits, invalid = _split_invalid(logits)
    members = threshold.ndim == 1
    probs = _probabilities(logits, members)
    share = _share(key, logits.shape[1], probs.dtype, deterministic=0.0)
    scores = _class_scores(probs, score, share, penalty, free_ranks)
    threshold = threshold.astype(scores.dtype)
    if members:
        threshold = threshold[:, None, None]
    inside = (scores <= threshold).astype(scores.dtype)
    invalid = invalid.reshape((1,) * (inside.ndim - 2) + (-1, 1))
    inside = jnp.where(invalid, jnp.nan, inside)
    return jnp.where(jnp.isnan(threshold), jnp.nan, inside)


def conformal_sets(
    logits: jax.Array,
    threshold: float | jax.Array,
    *,
    score: str = "lac",
    key: jax.Array | None = None,
    penalty: float = 0.01,
    free_ranks: int = 1,
) -> jax.Array:
    """The prediction sets of new inputs at a fitted threshold.

    A class is in an example's set where its score is at most ``threshold``
    (from :func:`fit_conformal_threshold`, with the same ``score``,
    ``penalty`` and ``free_ranks``; a fresh ``key`` for the randomised
    scores). A ``[E]`` threshold (fitted with ``members=True``) gives each
    member's own sets.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]]]))
    >>> uncertainty.conformal_sets(logits, 0.6)  # p >= 0.4 is in
    Array([[1., 0., 0.],
           [1., 0., 0.]], dtype=float32)
    >>> # APS: classes while the mass above them is at most 0.6, so a
    >>> # spread predictive gets a larger set.
    >>> uncertainty.conformal_sets(logits, 0.6, score="aps")
    Array([[1., 1., 0.],
           [1., 0., 0.]], dtype=float32)

    Args:
      logits: member logits ``[E, B, C]``.
      threshold: a scalar, or ``[E]`` for each member's sets; ``inf`` puts
        every class in.
      score: ``"lac"``, ``"aps"`` or ``"raps"``, as fitted (static under
        :func:`jax.jit`).
      key: a JAX random key for the randomised ``"aps"`` and ``"raps"``
        (one uniform per example); ``None`` for the deterministic scores.
      penalty: RAPS's ``lambda``, as fitted.
      free_ranks: RAPS's ``k_reg``, as fitted.

    Returns:
      ``[B, C]`` (``[E, B, C]`` for a ``[E]`` threshold): 1.0 where the
      class is in the set, 0.0 where not, in at least float32. A NaN row for
      an example with invalid logits; all NaN for a NaN threshold under
      :func:`jax.jit`.

    Raises:
      ValueError: if ``logits`` is not ``[E, B, C]``, ``threshold`` is
        neither a scalar nor ``[E]`` or (when known) NaN, or the options are
        bad (as for :func:`fit_conformal_threshold`).
      TypeError: if ``logits`` is not floating-point, ``threshold`` not real
        numbers or ``key`` not a random key.
    """
    score, penalty, free_ranks = _check_options(score, penalty, free_ranks)
    key = _check_key(key, score)
    logits = _check_logits(logits)
    threshold = as_array(threshold, "threshold", what="a number or [E] numbers")
    if threshold.dtype == jnp.bool_ or not (
        jnp.issubdtype(threshold.dtype, jnp.floating)
        or jnp.issubdtype(threshold.dtype, jnp.integer)
    ):
        raise TypeError(
            f"`threshold` must be real numbers, got dtype {threshold.dtype}."
        )
    if threshold.shape not in ((), (logits.shape[0],)):
        raise ValueError(
            f"`threshold` must be a scalar, or [E] = ({logits.shape[0]},) for "
            f"each member's sets, got shape {tuple(threshold.shape)}: fit it "
            f"with `uncertainty.fit_conformal_threshold`."
        )
    try:
        values = np.asarray(threshold, np.float64)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        values = None
    if values is not None and np.isnan(values).any():
        raise ValueError(
            f"`threshold` must not be NaN, got {values.tolist()}: the fit saw "
            f"invalid logits or labels."
        )
    return _conformal_sets(logits, threshold, key, penalty, free_ranks, score)


# ----------------------------------------------------------------------- metrics


def _check_sets(sets: Any) -> jax.Array:
    sets = as_array(sets, "sets", what="prediction sets [B, C] or [E, B, C]")
    if not (
        sets.dtype == jnp.bool_
        or jnp.issubdtype(sets.dtype, jnp.floating)
        or jnp.issubdtype(sets.dtype, jnp.integer)
    ):
        raise TypeError(f"`sets` must hold 0s and 1s, got dtype {sets.dtype}.")
    if sets.ndim not in (2, 3) or 0 in sets.shape:
        raise ValueError(
            f"`sets` must have shape [B, C] or [E, B, C] with no empty axis, "
            f"got shape {tuple(sets.shape)}: pass what `conformal_sets` returns."
        )
    try:
        values = np.asarray(sets, np.float64)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        values = None
    if values is not None and not np.isin(values[~np.isnan(values)], (0, 1)).all():
        raise ValueError(
            "`sets` must hold 1 (in the set), 0 (not) or NaN, got other values: "
            "pass what `conformal_sets` returns (or a boolean mask)."
        )
    return sets


@jax.jit
def _set_size(sets):
    sets = sets.astype(jnp.promote_types(sets.dtype, jnp.float32))
    return jnp.mean(jnp.sum(sets, axis=-1), axis=-1)


def set_size(sets: jax.Array) -> jax.Array:
    """The mean size of prediction sets: the classes per example, averaged.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> uncertainty.set_size(jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    Array(1.5, dtype=float32)

    Args:
      sets: ``[B, C]`` sets (or ``[E, B, C]``, each member's), as
        :func:`conformal_sets` returns them, or a boolean mask.

    Returns:
      The mean size, a scalar (``[E]``); NaN if a set (of that member) holds
      a NaN.

    Raises:
      ValueError: if ``sets`` is not 2-D or 3-D or (when known) holds values
        other than 0, 1 and NaN.
      TypeError: if ``sets`` is not an array of numbers.
    """
    return _set_size(_check_sets(sets))


@jax.jit
def _set_coverage(sets, labels):
    sets = sets.astype(jnp.promote_types(sets.dtype, jnp.float32))
    bad_label = (labels < 0) | (labels >= sets.shape[-1])
    index = jnp.broadcast_to(
        jnp.where(bad_label, 0, labels)[:, None], (*sets.shape[:-1], 1)
    )
    covered = jnp.take_along_axis(sets, index, axis=-1)[..., 0]
    poisoned = jnp.any(jnp.isnan(sets), axis=(-2, -1)) | jnp.any(bad_label)
    return jnp.where(poisoned, jnp.nan, jnp.mean(covered, axis=-1))


def set_coverage(sets: jax.Array, labels: jax.Array) -> jax.Array:
    """The share of examples whose prediction set holds their label.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> sets = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    >>> uncertainty.set_coverage(sets, jnp.array([1, 2]))
    Array(0.5, dtype=float32)

    Args:
      sets: ``[B, C]`` sets (or ``[E, B, C]``), as :func:`conformal_sets`
        returns them, or a boolean mask.
      labels: integer classes ``[B]``, in ``[0, C)``.

    Returns:
      The coverage in ``[0, 1]``, a scalar (``[E]``); NaN if a set (of that
      member) holds a NaN or, under :func:`jax.jit`, a label lies outside
      ``[0, C)``.

    Raises:
      ValueError: if ``sets`` is not 2-D or 3-D, ``labels`` is not ``[B]``,
        or (when known) a label lies outside ``[0, C)`` or a set holds values
        other than 0, 1 and NaN.
      TypeError: if ``sets`` is not an array of numbers or ``labels`` not
        integers.
    """
    sets = _check_sets(sets)
    labels = check_labels(labels, sets.shape[-1])
    if tuple(labels.shape) != (sets.shape[-2],):
        raise ValueError(
            f"`labels` must have shape [B] = ({sets.shape[-2]},) to match `sets` "
            f"of shape {tuple(sets.shape)}, got shape {tuple(labels.shape)}."
        )
    return _set_coverage(sets, labels)
