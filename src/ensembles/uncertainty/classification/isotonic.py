"""Isotonic calibration: a non-parametric, monotone map of each class's probability.

For every class ``c``, isotonic regression (Zadrozny & Elkan, 2002) fits the
non-decreasing function of the predicted ``p_c`` closest, in squared error,
to the held-out indicator ``[y = c]`` (pool adjacent violators; examples of
equal ``p_c`` pooled first), read between held-out points by linear
interpolation and clipped at the ends; the classes' calibrated values are
then divided by their sum (one over ``C`` each where all are 0). That is
scikit-learn's ``CalibratedClassifierCV(method="isotonic")`` one-vs-rest map,
``IsotonicRegression(out_of_bounds="clip")`` per class, for every ``C >= 2``
(scikit-learn calibrates only the positive class of two).

No form is assumed, so it can fix any monotone miscalibration, but it needs
many held-out examples per class, and it gives probability 0 to a class at
confidences where the held-out set never saw it: the NLL of a test example
there is infinite, while its ECE is usually the lowest of all calibrators.
``members=False`` calibrates the pooled predictive, ``members=True`` each
member's softmax (then pooled by every metric), as the parametric
calibrators of :mod:`~ensembles.uncertainty.classification.calibrators` do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import as_array, check_bool
from ensembles.uncertainty.classification._common import (
    _check_labels,
    _check_logits,
    _split_invalid,
    _split_invalid_labeled,
)
from ensembles.uncertainty.classification.calibrators import (
    calibration_inputs,
    check_fitted,
)


def _pool_adjacent_violators(x: jax.Array, y: jax.Array) -> jax.Array:
    """The non-decreasing least-squares fit of ``y`` on ascending ``x``, ``[N]``.

    A stack of blocks (their sums and counts): each point enters as a block
    of its own, joins the previous block where its ``x`` ties the previous
    point's, and once its tie group is complete, blocks merge while the one
    below has a mean at least the top's (compared as ``sum_a n_b >= sum_b
    n_a``, exact for counts and sums of 0s and 1s below ``2**24``).
    """
    num = x.shape[0]

    def merge(state):
        sums, counts, top = state
        sums = sums.at[top - 1].add(sums[top])
        counts = counts.at[top - 1].add(counts[top])
        return sums, counts, top - 1

    def violated(state):
        sums, counts, top = state
        below = jnp.maximum(top - 1, 0)
        return (top > 0) & (sums[below] * counts[top] >= sums[top] * counts[below])

    def push(i, state):
        sums, counts, top = state
        top = top + 1
        state = (sums.at[top].set(y[i]), counts.at[top].set(1.0), top)
        tie = (i > 0) & (x[i] == x[jnp.maximum(i - 1, 0)])
        state = jax.lax.cond(tie, merge, lambda s: s, state)
        # A tie group is settled whole: merging part of it with the blocks
        # below, on its part's mean, could not be undone.
        last = (i == num - 1) | (x[jnp.minimum(i + 1, num - 1)] != x[i])
        return jax.lax.while_loop(lambda s: last & violated(s), merge, state)

    empty = jnp.zeros(num, y.dtype)
    sums, counts, top = jax.lax.fori_loop(
        0, num, push, (empty, empty, jnp.asarray(-1, jnp.int32))
    )
    kept = jnp.arange(num) <= top
    ends = jnp.cumsum(jnp.where(kept, counts, 0.0))
    block = jnp.searchsorted(ends, jnp.arange(num, dtype=ends.dtype), side="right")
    block = jnp.minimum(block, num - 1)
    return sums[block] / counts[block]


@functools.partial(jax.jit, static_argnames="members")
def _fit_isotonic(logits, labels, members):
    logits, labels, invalid = _split_invalid_labeled(logits, labels)
    probs = jnp.exp(calibration_inputs(logits, members))  # [M, B, C]
    num_classes = probs.shape[-1]
    targets = (labels[:, None] == jnp.arange(num_classes)[None]).astype(probs.dtype)

    def fit_class(p, target):  # [B], [B]
        order = jnp.argsort(p, stable=True)
        knots = p[order]
        return knots, _pool_adjacent_violators(knots, target[order])

    # [M, B, C] -> per member and class: [M, C, B]
    knots, values = jax.vmap(jax.vmap(fit_class, in_axes=(1, 1)), in_axes=(0, None))(
        probs, targets
    )
    knots = jnp.where(jnp.any(invalid), jnp.nan, knots)
    values = jnp.where(jnp.any(invalid), jnp.nan, values)
    return (knots, values) if members else (knots[0], values[0])


def fit_isotonic(
    logits: jax.Array, labels: jax.Array, *, members: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Isotonic calibration's ``(knots, values)``, fitted on held-out examples.

    For each class, the held-out examples' probabilities in ascending order
    (``knots``) and the isotonic fit of their one-vs-rest labels there
    (``values``); :func:`apply_isotonic` interpolates between them. See
    :mod:`~ensembles.uncertainty.classification.isotonic`.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> keys = jax.random.split(jax.random.key(0), 2)
    >>> logits = 3 * jax.random.normal(keys[0], (4, 500, 3))  # E=4, B=500, C=3
    >>> labels = jax.random.categorical(keys[1], logits.mean(0) / 3)
    >>> knots, values = uncertainty.fit_isotonic(logits, labels)
    >>> knots.shape, values.shape  # [C, B]
    ((3, 500), (3, 500))
    >>> bool(jnp.all(jnp.diff(values, axis=-1) >= 0))  # monotone
    True
    >>> calibrated = uncertainty.apply_isotonic(logits, knots, values)
    >>> bool(uncertainty.ece(calibrated, labels) < uncertainty.ece(logits, labels))
    True

    Args:
      logits: held-out member logits ``[E, B, C]``.
      labels: their integer classes ``[B]``, in ``[0, C)``.
      members: one map per member and class, of the member's own softmax
        (static under :func:`jax.jit`).

    Returns:
      ``(knots, values)``, each ``[C, B]`` (``[E, C, B]`` with ``members``),
      ``knots`` ascending along the last axis and ``values`` non-decreasing in
      ``[0, 1]``; all NaN if a held-out example has invalid logits or, under
      :func:`jax.jit`, a label outside ``[0, C)``.

    Raises:
      ValueError: if the shapes do not match ``[E, B, C]`` and ``[B]``, or a
        known label lies outside ``[0, C)``.
      TypeError: if ``logits`` is not floating-point, ``labels`` not integer
        or ``members`` not a bool.
    """
    logits = _check_logits(logits)
    labels = _check_labels(labels, logits)
    return _fit_isotonic(logits, labels, check_bool(members, "members"))


@functools.partial(jax.jit, static_argnames="members")
def _apply_isotonic(logits, knots, values, members):
    logits, invalid = _split_invalid(logits)
    probs = jnp.exp(calibration_inputs(logits, members))  # [M, B, C]
    if not members:
        knots, values = knots[None], values[None]
    num_classes = probs.shape[-1]

    def member(p, member_knots, member_values):  # [B, C], [C, N], [C, N]
        def one_class(column, class_knots, class_values):
            return jnp.interp(column, class_knots, class_values)

        return jax.vmap(one_class, in_axes=(1, 0, 0), out_axes=1)(
            p, member_knots, member_values
        )

    calibrated = jax.vmap(member)(probs, knots, values)  # [M, B, C]
    total = jnp.sum(calibrated, axis=-1, keepdims=True)
    calibrated = jnp.where(
        total > 0, calibrated / jnp.where(total > 0, total, 1.0), 1.0 / num_classes
    )
    broken = ~(jnp.all(jnp.isfinite(knots)) & jnp.all(jnp.isfinite(values)))
    return jnp.where(broken | invalid[None, :, None], jnp.nan, jnp.log(calibrated))


def apply_isotonic(logits: jax.Array, knots: jax.Array, values: jax.Array) -> jax.Array:
    """The log-probabilities of a fitted isotonic calibration.

    Each class's probability (the pooled predictive's, or each member's for a
    fit with ``members=True``, told by the shapes) mapped through its
    isotonic fit (linear between knots, clipped outside them), then divided
    by the sum over classes (``1 / C`` each where every class maps to 0).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.8, 0.2], [0.6, 0.4]]]))  # E=1, B=2, C=2
    >>> knots = jnp.array([[0.5, 1.0], [0.0, 0.5]])  # per class
    >>> values = jnp.array([[0.5, 0.7], [0.3, 0.5]])
    >>> probs = jnp.exp(uncertainty.apply_isotonic(logits, knots, values))
    >>> [[round(p, 3) for p in row] for row in probs[0].tolist()]
    [[0.62, 0.38], [0.54, 0.46]]

    Args:
      logits: member logits ``[E, B, C]``.
      knots: ``[C, N]`` from :func:`fit_isotonic` (``[E, C, N]`` per member),
        ascending along the last axis.
      values: ``[C, N]`` (``[E, C, N]``), non-decreasing, in ``[0, 1]``.

    Returns:
      ``[1, B, C]`` log-probabilities of the calibrated predictive (``[E, B,
      C]`` for a per-member fit), in at least float32 (``-inf`` for a class
      mapped to 0); NaN rows for invalid examples, all NaN for a non-finite
      knot or value under :func:`jax.jit`.

    Raises:
      ValueError: if the shapes do not fit ``[E, B, C]`` logits, or (when
        known) the knots are not finite and ascending or the values not in
        ``[0, 1]`` and non-decreasing.
      TypeError: if ``logits`` is not floating-point or ``knots`` or
        ``values`` not real numbers.
    """
    logits = _check_logits(logits)
    shape = tuple(as_array(knots, "knots", what="what `fit_isotonic` returns").shape)
    count = shape[-1] if shape else 0
    num_classes = logits.shape[-1]
    if count == 0:
        raise ValueError(
            f"`knots` must have shape [C, N] (or [E, C, N]) with N >= 1, got "
            f"shape {shape}: pass what `fit_isotonic` returns."
        )
    (knots, values), members = check_fitted(
        logits,
        (
            (knots, "knots", (num_classes, count)),
            (values, "values", (num_classes, count)),
        ),
        "fit_isotonic",
    )
    try:
        known = np.asarray(knots, np.float64), np.asarray(values, np.float64)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        known = None
    if known is not None:
        if (np.diff(known[0], axis=-1) < 0).any():
            raise ValueError(
                "`knots` must ascend along their last axis: pass what "
                "`fit_isotonic` returns."
            )
        if (np.diff(known[1], axis=-1) < 0).any() or not (
            (known[1] >= 0) & (known[1] <= 1)
        ).all():
            raise ValueError(
                "`values` must be non-decreasing along their last axis and lie "
                "in [0, 1]: pass what `fit_isotonic` returns."
            )
    return _apply_isotonic(logits, knots, values, members)
