"""Conformalised mixture intervals: intervals that adapt, with a guarantee.

:func:`~ensembles.uncertainty.conformal_interval` widens ``mu +- q sd``,
symmetric about the mixture mean. These conformalise the mixture's own
central interval instead, in the manner of conformalised quantile regression
(CQR; Romano, Patterson & Candès, 2019): the score of a held-out target is
how far it lies outside the mixture's ``level`` interval, ``max(lower - y, y
- upper)`` (negative inside), and :func:`fit_conformal_margin` takes its
``ceil((n + 1) level)``-th smallest over ``n`` held-out entries; the interval
of a new example is the mixture's widened by that margin on both sides
(:func:`conformal_mixture_interval`; a negative margin narrows it). The
intervals keep the mixture's shape, skewed where the members disagree one
way and wide where the noise is, and cover at least ``level`` of new entries
exchangeable with the held-out ones, whatever the model (between ``level``
and ``level + 1 / (n + 1)`` on average over held-out draws, without ties
among the scores). Entries are pooled over examples and outputs, as
:func:`~ensembles.uncertainty.fit_conformal_quantile` pools them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import check_array
from ensembles.uncertainty import _regression as reg
from ensembles.uncertainty._common import conformal_rank

__all__ = ["conformal_mixture_interval", "fit_conformal_margin"]


@functools.partial(jax.jit, static_argnames="level")
def _fit_conformal_margin(means, stds, targets, level):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    lower, upper = reg.central_interval(means, stds, level)
    score = jnp.maximum(lower - targets, targets - upper).reshape(-1)
    count = score.shape[0]
    rank = conformal_rank(count, level)
    if rank > count:  # too few held-out entries for the level
        margin = jnp.asarray(jnp.inf, score.dtype)
    else:
        margin = jnp.sort(score)[rank - 1]
    return reg.poison_all(margin, invalid)


def fit_conformal_margin(
    means: jax.Array, stds: jax.Array | None, targets: jax.Array, level: float = 0.9
) -> jax.Array:
    """The conformal margin of the mixture's central ``level`` interval (CQR).

    On ``n`` held-out entries (``B`` examples times ``D`` outputs, pooled),
    the ``ceil((n + 1) level)``-th smallest of ``max(lower - y, y - upper)``,
    ``(lower, upper)`` the mixture's central interval holding ``level`` of
    its mass (:func:`~ensembles.uncertainty.mixture_interval`); ``inf``
    where ``(n + 1) level > n``. Fit on a validation split, never the test
    set; :func:`conformal_mixture_interval` applies it.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> keys = jax.random.split(jax.random.key(0), 2)
    >>> noise = jnp.exp(jax.random.normal(keys[0], (9999,)))  # it varies
    >>> targets = noise * jax.random.normal(keys[1], (9999,))
    >>> means, stds = jnp.zeros((2, 9999)), jnp.stack([noise, noise]) / 2
    >>> margin = uncertainty.fit_conformal_margin(means, stds, targets, 0.9)
    >>> lower, upper = uncertainty.conformal_mixture_interval(
    ...     means, stds, margin, 0.9)
    >>> inside = (targets >= lower) & (targets <= upper)
    >>> round(float(jnp.mean(inside)), 2)  # the stds were half the noise's
    0.9

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      targets: ``[B]`` or ``[B, D]``.
      level: the coverage to guarantee, and the mixture interval's share of
        its mass, in ``(0, 1)``.

    Returns:
      The margin, a scalar in at least float32 (negative where the mixture's
      intervals are too wide; ``inf`` as above); NaN if any entry is invalid.

    Raises:
      ValueError: if the shapes do not match or ``level`` is not in ``(0, 1)``.
      TypeError: if an argument is not a real array.
    """
    level = reg.check_level(level)
    means = reg.check_means(means)
    stds = reg.check_stds(stds, means)
    targets = reg.check_targets(targets, means)
    return _fit_conformal_margin(means, stds, targets, level)


@functools.partial(jax.jit, static_argnames="level")
def _conformal_mixture_interval(means, stds, margin, level):
    means, stds, _, invalid = reg.split_invalid(means, stds)
    lower, upper = reg.central_interval(means, stds, level)
    invalid = invalid | jnp.isnan(margin) | (margin == -jnp.inf)
    return reg.poison(lower - margin, invalid), reg.poison(upper + margin, invalid)


def conformal_mixture_interval(
    means: jax.Array,
    stds: jax.Array | None,
    margin: float | jax.Array,
    level: float = 0.9,
) -> tuple[jax.Array, jax.Array]:
    """The mixture's central ``level`` interval widened by a conformal margin.

    ``(lower - margin, upper + margin)`` with ``(lower, upper)`` the mixture's
    central interval (:func:`~ensembles.uncertainty.mixture_interval`) and
    ``margin`` from :func:`fit_conformal_margin` at the same ``level``. A
    negative margin narrows the interval (empty, ``lower > upper``, where it
    exceeds half its width); ``inf`` makes it unbounded.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.zeros((1, 1)), jnp.ones((1, 1))  # one N(0, 1)
    >>> lower, upper = uncertainty.conformal_mixture_interval(
    ...     means, stds, 0.5, level=0.95)
    >>> round(float(lower[0]), 3), round(float(upper[0]), 3)  # 1.96 + 0.5
    (-2.46, 2.46)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      margin: a scalar, from :func:`fit_conformal_margin`.
      level: the mixture interval's share of its mass, as fitted, in
        ``(0, 1)``.

    Returns:
      ``(lower, upper)``, each ``[B]`` or ``[B, D]``; NaN for invalid entries
      (all of them for a NaN or ``-inf`` margin under :func:`jax.jit`).

    Raises:
      ValueError: if the shapes do not match, ``level`` is not in ``(0, 1)``,
        or ``margin`` is not a scalar or (when known) NaN or ``-inf``.
      TypeError: if an argument is not a real array.
    """
    level = reg.check_level(level)
    means = reg.check_means(means)
    stds = reg.check_stds(stds, means)
    value = check_array(margin, "margin", what="a number")
    if jnp.shape(value) != ():
        raise ValueError(
            f"`margin` must be a scalar, got shape {jnp.shape(value)}: pass the "
            f"one number `fit_conformal_margin` returns."
        )
    dtype = jnp.result_type(value)
    if dtype == jnp.bool_ or not (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    ):
        raise TypeError(f"`margin` must be a real number, got dtype {dtype}.")
    try:
        known = float(value)
    except (TypeError, jax.errors.ConcretizationTypeError):
        known = None
    if known is not None and (np.isnan(known) or known == -np.inf):
        raise ValueError(
            f"`margin` must be a number or inf, got {known}: fit it with "
            f"`uncertainty.fit_conformal_margin` on held-out data."
        )
    compute = reg.compute_dtype(means, stds)
    return _conformal_mixture_interval(
        means, stds, jnp.asarray(value).astype(compute), level
    )
