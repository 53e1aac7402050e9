"""Split-conformal intervals of a regression ensemble: coverage guaranteed.

Fitted on ``n`` held-out entries (examples times outputs, pooled)
exchangeable with the test ones, they cover at least ``level`` of new
entries whatever the model (Lei et al., 2018; between ``level`` and ``level
+ 1 / (n + 1)`` on average over held-out draws, without ties among the
scores); a shift breaks the guarantee (``docs/regression.md`` measures by how
much). :func:`conformal_interval` widens ``mu +- q sd`` about the mixture
mean (the normalised score ``|y - mu| / sd``); :func:`conformal_mixture_interval`
widens the mixture's own central interval by a margin, as conformalised
quantile regression does (CQR; Romano, Patterson & Candès, 2019), keeping its
shape: skewed where the members disagree one way, wide where the noise is.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import check_array
from ensembles.uncertainty._common import check_level, conformal_quantile, poison_all
from ensembles.uncertainty.regression import _common as reg


@functools.partial(jax.jit, static_argnames="level")
def _fit_conformal_quantile(means, stds, targets, level):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    mean, sd = reg.mixture_std(means, stds)  # 1e-25 spreads: not squared to 0
    error = jnp.abs(targets - mean)
    score = jnp.where(
        sd > 0, error / jnp.where(sd > 0, sd, 1.0), jnp.where(error > 0, jnp.inf, 0.0)
    ).reshape(-1)
    return poison_all(conformal_quantile(score, level), invalid)


def fit_conformal_quantile(
    means: jax.Array, stds: jax.Array | None, targets: jax.Array, level: float = 0.9
) -> jax.Array:
    """The split-conformal quantile of the normalised errors ``|y - mu| / sd``.

    On ``n`` held-out entries (``B`` examples times ``D`` outputs, pooled),
    the ``ceil((n + 1) level)``-th smallest score, ``mu`` the mixture mean and
    ``sd`` its standard deviation (:func:`mixture_variance`; for point members
    their disagreement). :func:`conformal_interval` turns it into intervals
    ``mu +- q sd`` that cover at least ``level`` of new examples exchangeable
    with the held-out ones (Lei et al., 2018; the normalised score of
    Papadopoulos et al., 2008). ``inf`` where ``n`` is too small for the
    level (``(n + 1) level > n``).

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> keys = jax.random.split(jax.random.key(0), 2)
    >>> targets = jax.random.normal(keys[0], (9999,))
    >>> means, stds = jnp.zeros((2, 9999)), jnp.ones((2, 9999))
    >>> q = uncertainty.fit_conformal_quantile(means, stds, targets, level=0.9)
    >>> abs(float(q) - 1.645) < 0.05  # the Gaussian's 90% quantile of |z|
    True

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      targets: ``[B]`` or ``[B, D]``.
      level: the coverage to guarantee, in ``(0, 1)``.

    Returns:
      The quantile ``q``, a non-negative scalar (``inf`` as above); NaN if
      any entry is invalid.

    Raises:
      ValueError: if the shapes do not match or ``level`` is not in ``(0, 1)``.
      TypeError: if an argument is not a real array.
    """
    level = check_level(level, reg.LEVEL_OF)
    means, stds = reg.check_members(means, stds)
    targets = reg.check_targets(targets, means)
    return _fit_conformal_quantile(means, stds, targets, level)


def _check_fitted(value: Any, name: str, what: str) -> tuple[Any, float | None]:
    """A fitted scalar ``name``, and its value where it is known (not traced)."""
    value = check_array(value, name, what=what)
    if jnp.shape(value) != ():
        raise ValueError(
            f"`{name}` must be a scalar, got shape {jnp.shape(value)}: pass the "
            f"one number `fit_conformal_{name}` returns."
        )
    try:
        return value, float(value)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return value, None


@jax.jit
def _conformal_interval(means, stds, quantile):
    means, stds, _, invalid = reg.split_invalid(means, stds)
    mean, sd = reg.mixture_std(means, stds)
    # An infinite quantile (too few held-out examples for the level) gives
    # unbounded intervals, members that agree (sd 0) too: not inf * 0.
    half = jnp.where(jnp.isposinf(quantile), jnp.inf, quantile * sd)
    invalid = invalid | jnp.isnan(quantile) | (quantile < 0)
    return reg.poison(mean - half, invalid), reg.poison(mean + half, invalid)


def conformal_interval(
    means: jax.Array, stds: jax.Array | None, quantile: float | jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Split-conformal intervals ``mu +- quantile * sd`` around the mixture mean.

    ``quantile`` comes from :func:`fit_conformal_quantile` on held-out
    examples; ``sd`` is the mixture's standard deviation.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.array([[0.0], [2.0]]), jnp.array([[1.0], [1.0]])
    >>> lower, upper = uncertainty.conformal_interval(means, stds, 2.0)
    >>> float(lower[0]), float(upper[0])  # 1 +- 2 sqrt(2)
    (-1.828427..., 3.828427...)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      quantile: a non-negative scalar (``inf`` gives unbounded intervals).

    Returns:
      ``(lower, upper)``, each ``[B]`` or ``[B, D]``; NaN for invalid entries
      (all of them for a NaN or negative quantile under :func:`jax.jit`).

    Raises:
      ValueError: if the shapes do not match, or ``quantile`` is not a scalar
        or (when known) negative or NaN.
      TypeError: if an argument is not a real array.
    """
    means, stds = reg.check_members(means, stds)
    value, known = _check_fitted(quantile, "quantile", "a non-negative number")
    if known is not None and not known >= 0:
        raise ValueError(
            f"`quantile` must be non-negative, got {known}: fit it with "
            f"`uncertainty.fit_conformal_quantile` on held-out data."
        )
    dtype = reg.compute_dtype(means, stds)
    return _conformal_interval(means, stds, jnp.asarray(value).astype(dtype))


@functools.partial(jax.jit, static_argnames="level")
def _fit_conformal_margin(means, stds, targets, level):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    lower, upper = reg.central_interval(means, stds, level)
    score = jnp.maximum(lower - targets, targets - upper).reshape(-1)
    return poison_all(conformal_quantile(score, level), invalid)


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
    level = check_level(level, reg.LEVEL_OF)
    means, stds = reg.check_members(means, stds)
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
    level = check_level(level, reg.LEVEL_OF)
    means, stds = reg.check_members(means, stds)
    value, known = _check_fitted(margin, "margin", "a number")
    dtype = jnp.result_type(value)
    if dtype == jnp.bool_ or not (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    ):
        raise TypeError(f"`margin` must be a real number, got dtype {dtype}.")
    if known is not None and (np.isnan(known) or known == -np.inf):
        raise ValueError(
            f"`margin` must be a number or inf, got {known}: fit it with "
            f"`uncertainty.fit_conformal_margin` on held-out data."
        )
    compute = reg.compute_dtype(means, stds)
    return _conformal_mixture_interval(
        means, stds, jnp.asarray(value).astype(compute), level
    )
