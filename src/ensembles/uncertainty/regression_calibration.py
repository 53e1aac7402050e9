"""Recalibrating a regression ensemble on held-out data: one scale of its spread.

:func:`fit_std_scale` finds the one factor ``s`` that, stretching the
ensemble's whole predictive about its mean, minimises its NLL on held-out
examples (a validation split, never the test set); :func:`scale_std` applies
it. It is the regression analogue of temperature scaling
(:func:`~ensembles.uncertainty.fit_temperature`): ``s > 1`` widens an
overconfident predictive, ``s < 1`` sharpens an underconfident one, and the
mixture keeps its shape: every member's standard deviation and every
member's distance from the mixture mean are scaled alike, so aleatoric and
epistemic variance both scale by ``s^2``.

:func:`fit_conformal_quantile` and :func:`conformal_interval` give
split-conformal intervals (Lei et al., 2018) with the normalised score
``|y - mu| / sd``: on held-out examples exchangeable with the test examples
they cover at least ``level`` of them whatever the model, a guarantee that
does not survive a shift (``docs/regression.md`` measures by how much).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from ensembles._checks import check_array, check_positive_int, check_real
from ensembles.uncertainty import _regression as reg

__all__ = [
    "conformal_interval",
    "fit_conformal_quantile",
    "fit_std_scale",
    "scale_std",
]

#: Scales evaluated on a log-spaced grid before the bisection of the slope.
_GRID = 65


def _scaled_nll(means, stds, targets, log_scale):
    scaled_means, scaled_stds = reg.scale_about_mean(means, stds, jnp.exp(log_scale))
    return -jnp.mean(reg.mixture_log_density(scaled_means, scaled_stds, targets))


@functools.partial(jax.jit, static_argnames="iterations")
def _fit_std_scale(means, stds, targets, log_low, log_high, iterations):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    dtype = means.dtype
    grid = jnp.linspace(log_low, log_high, _GRID, dtype=dtype)
    nlls = jax.lax.map(lambda t: _scaled_nll(means, stds, targets, t), grid)
    best = jnp.argmin(jnp.where(jnp.isnan(nlls), jnp.inf, nlls))
    step = grid[1] - grid[0]
    low = jnp.maximum(grid[best] - step, log_low)
    high = jnp.minimum(grid[best] + step, log_high)
    # Near the minimum the NLL is flat to rounding (a float32 NLL pins the
    # scale to about sqrt(eps)); its slope is not: bisect the slope's zero.
    slope = jax.grad(_scaled_nll, argnums=3)

    def bisect(_, bounds):
        low, high = bounds
        middle = (low + high) / 2
        rising = slope(means, stds, targets, middle) > 0
        return jnp.where(rising, low, middle), jnp.where(rising, middle, high)

    low, high = jax.lax.fori_loop(0, iterations, bisect, (low, high))
    scale = jnp.exp((low + high) / 2)
    # An NLL of +inf at the largest scale means some example's errors are so
    # many standard deviations that (z / scale)^2 overflows for every member:
    # that example's term, decreasing in the scale, outweighs every finite
    # one, and the largest scale is the minimiser (the grid, all +inf, could
    # not say so: its argmin is the first).
    overflowed = jnp.isposinf(nlls[-1])
    scale = jnp.where(overflowed, jnp.exp(jnp.asarray(log_high, dtype)), scale)
    return reg.poison_all(scale, invalid)


def _check_bounds(bounds: Any) -> tuple[float, float]:
    if not isinstance(bounds, tuple | list) or len(bounds) != 2:
        raise ValueError(
            f"`bounds` must be two scales (low, high), got {bounds!r}: e.g. "
            f"bounds=(0.05, 20.0)."
        )
    low, high = (check_real(b, "bounds") for b in bounds)
    if not 1e-30 <= low < high <= 1e30:
        raise ValueError(
            f"`bounds` must satisfy 1e-30 <= low < high <= 1e30, got "
            f"{tuple(bounds)!r}: e.g. bounds=(0.05, 20.0)."
        )
    return low, high


def fit_std_scale(
    means: jax.Array,
    stds: jax.Array,
    targets: jax.Array,
    *,
    bounds: tuple[float, float] = (0.05, 20.0),
    iterations: int = 40,
) -> jax.Array:
    """The scale of the predictive's spread that minimises its held-out NLL.

    The NLL of the exact mixture stretched by ``s`` about its mean
    (:func:`scale_std`) is minimised over ``s`` within ``bounds``: a grid of
    65 log-spaced scales, then bisection of the NLL's slope in ``log s``
    between the best one's neighbours (``iterations`` steps). For one
    Gaussian member the optimum has a closed form, ``s^2 = mean(((y - mu) /
    sigma)^2)`` (over the D outputs too), which the search finds to float
    precision. Fit it on held-out examples, never
    on the test set you report; it is a fit, not a differentiable function.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> keys = jax.random.split(jax.random.key(0), 2)
    >>> targets = 2.0 * jax.random.normal(keys[0], (2000,))  # noise of std 2
    >>> means = 0.1 * jax.random.normal(keys[1], (4, 2000))   # members near 0
    >>> stds = jnp.full((4, 2000), 0.5)                       # 4x too sure
    >>> scale = uncertainty.fit_std_scale(means, stds, targets)
    >>> round(float(scale), 1)
    4.0
    >>> means, stds = uncertainty.scale_std(means, stds, scale)
    >>> round(float(uncertainty.interval_coverage(means, stds, targets)), 2)
    0.9

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations (point members have no density).
      targets: ``[B]`` or ``[B, D]``.
      bounds: the smallest and largest scales considered, ``1e-30 <= low <
        high <= 1e30``.
      iterations: bisection steps (40 narrow the bracket by ``2**-40``);
        static under :func:`jax.jit`.

    Returns:
      The scale, a positive scalar in the compute dtype (at least float32); a
      value at a bound says the optimum lies at or beyond it (outside
      :func:`jax.jit`, a ``UserWarning`` says so too). NaN if any entry is
      invalid.

    Raises:
      ValueError: if the shapes do not match, ``stds`` is ``None``, or
        ``bounds`` are not two numbers with ``1e-30 <= low < high <= 1e30``.
      TypeError: if an argument is not a real array.
    """
    means = reg.check_means(means)
    stds = reg.check_stds(stds, means)
    reg.check_point_members(stds, "fit_std_scale")
    targets = reg.check_targets(targets, means)
    low, high = _check_bounds(bounds)
    iterations = check_positive_int(iterations, "iterations")
    scale = _fit_std_scale(
        means, stds, targets, math.log(low), math.log(high), iterations
    )
    _warn_at_bound(scale, low, high)
    return scale


def _warn_at_bound(scale: jax.Array, low: float, high: float) -> None:
    """Warns, when the scale is known, that it ended at a bound of ``bounds``."""
    try:
        value = float(scale)
    except jax.errors.ConcretizationTypeError:
        return  # under jax.jit: the docstring says what a bound means
    for bound, side, fix in ((low, "lower", "lower"), (high, "upper", "raise")):
        if math.isclose(value, bound, rel_tol=1e-4):
            warnings.warn(
                f"fit_std_scale ended at its {side} bound {bound:g}: the NLL's "
                f"minimum lies at or beyond it, so the scale is not the "
                f"optimum. {fix.capitalize()} that bound (`bounds=(low, high)`) "
                f"to find it, or check the held-out data (the predicted "
                f"spreads may be off by orders of magnitude).",
                UserWarning,
                stacklevel=3,
            )


def _check_positive_scalar(value: Any, name: str, dtype: Any, fix: str) -> jax.Array:
    """``value`` as a positive finite scalar of ``dtype`` (when known)."""
    value = check_array(value, name, what="a positive number")
    if jnp.shape(value) != ():
        raise ValueError(
            f"`{name}` must be a scalar, got shape {jnp.shape(value)}: {fix}."
        )
    kind = jnp.result_type(value)
    if kind == jnp.bool_ or not (
        jnp.issubdtype(kind, jnp.floating) or jnp.issubdtype(kind, jnp.integer)
    ):
        raise TypeError(f"`{name}` must be a real number, got {value!r}.")
    try:
        known = float(value)
    except jax.errors.ConcretizationTypeError:
        known = None
    if known is not None and not (0 < known < math.inf):
        raise ValueError(f"`{name}` must be positive and finite, got {known}: {fix}.")
    converted = jnp.asarray(value).astype(dtype)
    if known is not None and not (0 < float(converted) < math.inf):
        raise ValueError(
            f"`{name}` (={known}) must be positive and finite in the dtype the "
            f"members are computed in ({jnp.dtype(dtype).name}), where it is "
            f"{float(converted)}: {fix}."
        )
    return converted


@jax.jit
def _scale_std(means, stds, scale):
    means, stds, _, invalid = reg.split_invalid(means, stds)
    bad = ~(jnp.isfinite(scale) & (scale > 0))
    scaled_means, scaled_stds = reg.scale_about_mean(means, stds, scale)
    invalid = invalid | bad
    scaled_means = reg.poison(scaled_means, invalid[None])
    if scaled_stds is not None:
        scaled_stds = reg.poison(scaled_stds, invalid[None])
    return scaled_means, scaled_stds


def scale_std(
    means: jax.Array, stds: jax.Array | None, scale: float | jax.Array
) -> tuple[jax.Array, jax.Array | None]:
    """The members stretched about their mean: the predictive's spread times ``scale``.

    Member ``k``'s mean becomes ``mu + scale * (mu_k - mu)`` and its standard
    deviation ``scale * sigma_k``, ``mu`` the mixture mean: the recalibrated
    predictive is the original one's distribution of ``mu + scale * (y -
    mu)``, its shape kept, its standard deviation (aleatoric and epistemic
    alike) times ``scale``. Every function of :mod:`ensembles.uncertainty`
    takes the result as it takes the members.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.array([[0.0], [2.0]]), jnp.array([[1.0], [1.0]])
    >>> scaled_means, scaled_stds = uncertainty.scale_std(means, stds, 2.0)
    >>> scaled_means[:, 0], scaled_stds[:, 0]
    (Array([-1.,  3.], dtype=float32), Array([2., 2.], dtype=float32))
    >>> uncertainty.mixture_variance(scaled_means, scaled_stds)  # 4 x (1 + 1)
    Array([8.], dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members, whose
        disagreement is scaled).
      scale: a positive scalar, e.g. from :func:`fit_std_scale`.

    Returns:
      ``(means, stds)`` of the recalibrated members, in the compute dtype
      (``stds`` ``None`` for point members); NaN for invalid entries, and
      all NaN for a scale that is not positive and finite under
      :func:`jax.jit`.

    Raises:
      ValueError: if the shapes do not match, or ``scale`` is not a scalar or
        (when known) not positive and finite.
      TypeError: if an argument is not a real array.
    """
    means = reg.check_means(means)
    stds = reg.check_stds(stds, means)
    dtype = reg.compute_dtype(means, stds)
    scale = _check_positive_scalar(
        scale,
        "scale",
        dtype,
        "fit it with `uncertainty.fit_std_scale` on held-out data",
    )
    return _scale_std(means, stds, scale)


@functools.partial(jax.jit, static_argnames="level")
def _fit_conformal_quantile(means, stds, targets, level):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    mean, aleatoric, epistemic = reg.mixture_moments(means, stds)
    sd = jnp.sqrt(aleatoric + epistemic)
    error = jnp.abs(targets - mean)
    score = jnp.where(
        sd > 0, error / jnp.where(sd > 0, sd, 1.0), jnp.where(error > 0, jnp.inf, 0.0)
    ).reshape(-1)
    count = score.shape[0]
    rank = math.ceil((count + 1) * level)  # the finite-sample correction
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
    mean, aleatoric, epistemic = reg.mixture_moments(means, stds)
    # An infinite quantile (too few held-out examples for the level) gives
    # unbounded intervals, members that agree (sd 0) too: not inf * 0.
    half = jnp.where(
        jnp.isposinf(quantile), jnp.inf, quantile * jnp.sqrt(aleatoric + epistemic)
    )
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
