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

:func:`fit_member_std_scales` and :func:`scale_member_stds` calibrate each
member on its own before the mixture pools them. Split-conformal intervals
are in :mod:`ensembles.uncertainty.regression.conformal`.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import (
    check_array,
    check_positive_int,
    known_values,
)
from ensembles.uncertainty._common import check_bounds, poison_all
from ensembles.uncertainty.regression import _common as reg

#: Scales evaluated on a log-spaced grid before the bisection of the slope.
_GRID = 65


def _scaled_nll(means, stds, targets, log_scale):
    # Stretched by s about its mean c, member k is N(c + s (mu_k - c), s sigma_k),
    # whose density at y is N((y - c) / s; mu_k - c, sigma_k) / s: the residual
    # (y - c) / s is formed before anything is squared, so neither the NLL nor
    # its slope squares s (1e-25 squared underflows float32).
    center = jnp.mean(means, axis=0)
    residual = (targets - center) * jnp.exp(-log_scale)
    outputs = 1 if means.ndim == 2 else means.shape[-1]
    log_density = reg.mixture_log_density(means - center[None], stds, residual)
    return outputs * log_scale - jnp.mean(log_density)


def _fit_log(nll_of_log, log_low, log_high, iterations, dtype):
    """The log scale in ``[log_low, log_high]`` minimising ``nll_of_log``.

    A grid of :data:`_GRID` log-spaced scales, then bisection of the slope
    between the best one's neighbours: near the minimum the NLL is flat to
    rounding (a float32 NLL pins the scale to about sqrt(eps)); its slope is
    not. Returns the log scale and the NLL at each scale of the grid.
    """
    grid = jnp.linspace(log_low, log_high, _GRID, dtype=dtype)
    nlls = jax.lax.map(nll_of_log, grid)
    best = jnp.argmin(jnp.where(jnp.isnan(nlls), jnp.inf, nlls))
    step = grid[1] - grid[0]
    low = jnp.maximum(grid[best] - step, log_low)
    high = jnp.minimum(grid[best] + step, log_high)
    slope = jax.grad(nll_of_log)

    def bisect(_, bounds):
        low, high = bounds
        middle = (low + high) / 2
        rising = slope(middle) > 0
        return jnp.where(rising, low, middle), jnp.where(rising, middle, high)

    low, high = jax.lax.fori_loop(0, iterations, bisect, (low, high))
    return (low + high) / 2, nlls


@functools.partial(jax.jit, static_argnames="iterations")
def _fit_std_scale(means, stds, targets, log_low, log_high, iterations):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    dtype = means.dtype
    log_scale, nlls = _fit_log(
        lambda t: _scaled_nll(means, stds, targets, t),
        log_low,
        log_high,
        iterations,
        dtype,
    )
    scale = jnp.exp(log_scale)
    # An NLL of +inf at the largest scale means some example's errors are so
    # many standard deviations that (z / scale)^2 overflows for every member:
    # that example's term, decreasing in the scale, outweighs every finite
    # one, and the largest scale is the minimiser (the grid, all +inf, could
    # not say so: its argmin is the first).
    overflowed = jnp.isposinf(nlls[-1])
    scale = jnp.where(overflowed, jnp.exp(jnp.asarray(log_high, dtype)), scale)
    return poison_all(scale, invalid)


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
    means, stds = reg.check_members(means, stds, "fit_std_scale")
    targets = reg.check_targets(targets, means)
    low, high = check_bounds(bounds, "scales")
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


def _check_positive(
    value: Any, name: str, dtype: Any, shape: tuple[int, ...], fix: str
) -> jax.Array:
    """``value`` as positive finite numbers of ``shape`` in ``dtype``.

    Known values (a Python float, a numpy or concrete JAX array, under
    :func:`jax.jit` too) are checked on the host, in ``dtype``; traced ones
    reach the jitted twins, which make the results NaN for a bad one.
    """
    what = "a positive number" if shape == () else "positive numbers"
    value = check_array(value, name, what=what)
    if isinstance(value, list | tuple):  # jnp.shape of a list is deprecated
        value = np.asarray(value)
    if jnp.shape(value) != shape:
        expected = (
            "be a scalar"
            if shape == ()
            else f"have shape [E] = {shape}, one per member"
        )
        raise ValueError(
            f"`{name}` must {expected}, got shape {jnp.shape(value)}: {fix}."
        )
    kind = jnp.result_type(value)
    if kind == jnp.bool_ or not (
        jnp.issubdtype(kind, jnp.floating) or jnp.issubdtype(kind, jnp.integer)
    ):
        real = "a real number" if shape == () else "real numbers"
        raise TypeError(f"`{name}` must be {real}, got {value!r} of dtype {kind}.")
    known = known_values(value)
    if known is not None:
        wide = known.astype(np.float64)
        with np.errstate(over="ignore", under="ignore"):
            held = known.astype(np.dtype(dtype)).astype(np.float64)
        shown = wide.tolist()
        if not np.all((wide > 0) & (wide < math.inf)):
            raise ValueError(
                f"`{name}` must be positive and finite, got {shown}: {fix}."
            )
        if not np.all((held > 0) & (held < math.inf)):
            raise ValueError(
                f"`{name}` (={shown}) must be positive and finite in the dtype the "
                f"members are computed in ({jnp.dtype(dtype).name}), where it is "
                f"{held.tolist()}: {fix}."
            )
    return jnp.asarray(value).astype(dtype)


@jax.jit
def _fit_member_std_scales(means, stds, targets, low, high):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    z = (targets[None] - means) / stds  # [E, B(, D)]
    axes = tuple(range(1, z.ndim))
    # A member's Gaussian NLL in its scale s: mean(log s + z^2 / (2 s^2)) + c,
    # least at s^2 = mean(z^2); clipped to the bounds, as the pooled fit is.
    scales = reg.root_mean_square(z, axis=axes)
    return poison_all(jnp.clip(scales, low, high), invalid)


def fit_member_std_scales(
    means: jax.Array,
    stds: jax.Array,
    targets: jax.Array,
    *,
    bounds: tuple[float, float] = (0.05, 20.0),
) -> jax.Array:
    """One scale per member, each minimising that member's own Gaussian NLL.

    Calibrate, then pool: member ``k``'s standard deviations are scaled by
    ``s_k`` (:func:`scale_member_stds`), its mean kept, and the ensemble is
    the mixture of the rescaled members, where :func:`fit_std_scale`
    stretches the whole mixture about its mean. ``s_k^2 = mean(((y -
    mu_k) / sigma_k)^2)`` exactly (over the D outputs too), clipped to
    ``bounds``. The mixture of calibrated members is wider than each (their
    disagreement adds to their spread): underconfident where they disagree.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.zeros((2, 4)), jnp.array([[1.0] * 4, [0.5] * 4])
    >>> targets = jnp.array([1.0, -1.0, 1.0, -1.0])  # |z| = 1 and 2
    >>> uncertainty.fit_member_std_scales(means, stds, targets)
    Array([1., 2.], dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations (point members have no density).
      targets: ``[B]`` or ``[B, D]``.
      bounds: the smallest and largest scales, ``1e-30 <= low < high <=
        1e30``.

    Returns:
      ``[E]`` scales in the compute dtype; NaN if any entry is invalid.

    Raises:
      ValueError: if the shapes do not match, ``stds`` is ``None``, or
        ``bounds`` are out of range.
      TypeError: if an argument is not a real array.
    """
    means, stds = reg.check_members(means, stds, "fit_member_std_scales")
    targets = reg.check_targets(targets, means)
    low, high = check_bounds(bounds, "scales")
    return _fit_member_std_scales(means, stds, targets, low, high)


@jax.jit
def _scale_member_stds(means, stds, scales):
    means, stds, _, invalid = reg.split_invalid(means, stds)
    bad = ~(jnp.isfinite(scales) & (scales > 0))
    scaled = stds * scales.reshape((-1,) + (1,) * (stds.ndim - 1))
    invalid = invalid | jnp.any(bad)
    return reg.poison(means, invalid[None]), reg.poison(scaled, invalid[None])


def scale_member_stds(
    means: jax.Array, stds: jax.Array, scales: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Each member's standard deviations times its own scale; means kept.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.zeros((2, 1)), jnp.ones((2, 1))
    >>> uncertainty.scale_member_stds(means, stds, jnp.array([1.0, 3.0]))[1][:, 0]
    Array([1., 3.], dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations.
      scales: ``[E]`` positive scales, e.g. from :func:`fit_member_std_scales`.

    Returns:
      ``(means, stds)`` in the compute dtype; NaN for invalid entries, and all
      NaN for a traced scale (an argument of a jitted function) that is not
      positive and finite.

    Raises:
      ValueError: if ``scales`` is not ``[E]``, ``stds`` is ``None``, or a
        known scale (a list, a numpy or concrete JAX array, under
        :func:`jax.jit` too) is not positive and finite in the compute dtype.
      TypeError: if an argument is not a real array (booleans included).
    """
    means, stds = reg.check_members(means, stds, "scale_member_stds")
    dtype = reg.compute_dtype(means, stds)
    converted = _check_positive(
        scales,
        "scales",
        dtype,
        (means.shape[0],),
        "fit them with `uncertainty.fit_member_std_scales`",
    )
    return _scale_member_stds(means, stds, converted)


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
      all NaN for a traced scale (an argument of a jitted function) that is
      not positive and finite.

    Raises:
      ValueError: if the shapes do not match, or ``scale`` is not a scalar or,
        known (a Python or numpy number, a concrete array, under
        :func:`jax.jit` too), not positive and finite in the compute dtype.
      TypeError: if an argument is not a real array (booleans included).
    """
    means, stds = reg.check_members(means, stds)
    dtype = reg.compute_dtype(means, stds)
    scale = _check_positive(
        scale,
        "scale",
        dtype,
        (),
        "fit it with `uncertainty.fit_std_scale` on held-out data",
    )
    return _scale_std(means, stds, scale)
