"""Split-conformal intervals around the ensemble's mixture mean.

:func:`fit_conformal_quantile` and :func:`conformal_interval` give
split-conformal intervals (Lei et al., 2018) with the normalised score
``|y - mu| / sd``: on held-out examples exchangeable with the test examples
they cover at least ``level`` of them whatever the model, a guarantee that
does not survive a shift (``docs/regression.md`` measures by how much).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ensembles._checks import check_array
from ensembles.uncertainty import _regression as reg
from ensembles.uncertainty._common import conformal_rank

__all__ = ["conformal_interval", "fit_conformal_quantile"]


@functools.partial(jax.jit, static_argnames="level")
def _fit_conformal_quantile(means, stds, targets, level):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    mean, sd = reg.mixture_std(means, stds)  # 1e-25 spreads: not squared to 0
    error = jnp.abs(targets - mean)
    score = jnp.where(
        sd > 0, error / jnp.where(sd > 0, sd, 1.0), jnp.where(error > 0, jnp.inf, 0.0)
    ).reshape(-1)
    count = score.shape[0]
    rank = conformal_rank(count, level)  # the finite-sample correction
    if rank > count:
        quantile = jnp.asarray(jnp.inf, score.dtype)
    else:
        quantile = jnp.sort(score)[rank - 1]
    return reg.poison_all(quantile, invalid)


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
    level = reg.check_level(level)
    means = reg.check_means(means)
    stds = reg.check_stds(stds, means)
    targets = reg.check_targets(targets, means)
    return _fit_conformal_quantile(means, stds, targets, level)


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
    means = reg.check_means(means)
    stds = reg.check_stds(stds, means)
    value = check_array(quantile, "quantile", what="a non-negative number")
    if jnp.shape(value) != ():
        raise ValueError(
            f"`quantile` must be a scalar, got shape {jnp.shape(value)}: pass the "
            f"one number `fit_conformal_quantile` returns."
        )
    try:
        known = float(value)
    except (TypeError, jax.errors.ConcretizationTypeError):
        known = None
    if known is not None and not known >= 0:
        raise ValueError(
            f"`quantile` must be non-negative, got {known}: fit it with "
            f"`uncertainty.fit_conformal_quantile` on held-out data."
        )
    dtype = reg.compute_dtype(means, stds)
    return _conformal_interval(means, stds, jnp.asarray(value).astype(dtype))
