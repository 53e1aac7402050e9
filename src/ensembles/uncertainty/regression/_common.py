"""Private helpers of :mod:`ensembles.uncertainty.regression`.

The input checks (members' means and standard deviations, targets, levels),
the marking of invalid entries (:func:`_split_invalid`), and the mixture's
math: member log-densities, the CDF, quantiles by bisection and the pairwise
term of the CRPS. Every public regression function validates in Python and
makes one call to a jitted private twin, as the classification functions do.

``stds=None`` means *point members* (say, members trained on a squared
error): the predictive is the members' empirical distribution, a mixture of
point masses, whose only spread is the members' disagreement. The math below
reads it as every standard deviation being 0.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.scipy import special

from ensembles._checks import as_array, as_real_array

#: What a regression function's ``level`` is a share of.
LEVEL_OF = "the predictive the interval holds"

#: Bisection steps of the mixture's quantiles: the bracket (the members' own
#: quantiles) narrows by 2**-60, below float64's resolution.
QUANTILE_ITERATIONS = 60

_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)

# --------------------------------------------------------------------------- checks


def _float_array(value: Any, name: str, what: str) -> jax.Array:
    array = as_array(value, name, what=what)
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise TypeError(
            f"`{name}` must be a floating-point array, got dtype {array.dtype}: "
            f"cast it with `{name}.astype(jnp.float32)`."
        )
    return array


def check_means(means: Any) -> jax.Array:
    """Returns ``means`` as a floating ``[E, B]`` or ``[E, B, D]`` array."""
    means = _float_array(means, "means", "the members' predicted means")
    shape = tuple(means.shape)
    if len(shape) not in (2, 3):
        if len(shape) == 1:
            fix = (
                "One model's [B] predictions are a one-member ensemble: pass "
                "`means[None]`. A model's member-major [E*B] outputs: split "
                "them with `ensembles.untile(means, E)`."
            )
        elif len(shape) == 0:
            fix = "Give one prediction per member and example."
        else:
            fix = (
                "Fold the extra output axes into one: "
                f"`means.reshape({shape[0]}, {shape[1]}, -1)`."
            )
        raise ValueError(
            "`means` must have shape [E, B] or [E, B, D] (members, examples"
            f"[, outputs]), got shape {shape} ({len(shape)}-D). {fix}"
        )
    if 0 in shape:
        raise ValueError(
            f"`means` must have at least one member, example and output, got "
            f"shape {shape}."
        )
    return means


def check_members(
    means: Any, stds: Any, density_for: str | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """The members' ``means`` and ``stds`` (``None``: point members), checked.

    Point members are refused for ``density_for``, a function that needs a
    density.
    """
    means = check_means(means)
    if stds is None:
        if density_for is not None:
            raise ValueError(
                f"`stds` must be given for `{density_for}`: point members "
                f"(stds=None) form a mixture of point masses, which has no "
                f"density. Give the members' standard deviations, or score the "
                f"moment-matched Gaussian (`uncertainty.moment_matched_nll`, "
                f"which takes stds=None)."
            )
        return means, None
    stds = _float_array(stds, "stds", "the members' standard deviations (or None)")
    if tuple(stds.shape) != tuple(means.shape):
        raise ValueError(
            f"`stds` must have the shape of `means`, {tuple(means.shape)} "
            f"([E, B] or [E, B, D]), got shape {tuple(stds.shape)}: one standard "
            f"deviation per member, example and output (None for point members)."
        )
    return means, stds


def check_targets(targets: Any, means: jax.Array) -> jax.Array:
    """Returns ``targets`` as a real ``[B]`` or ``[B, D]`` array matching ``means``."""
    targets = as_real_array(targets, "targets", what="an array of real targets")
    if targets.dtype == jnp.bool_ or not (
        jnp.issubdtype(targets.dtype, jnp.floating)
        or jnp.issubdtype(targets.dtype, jnp.integer)
    ):
        raise TypeError(f"`targets` must hold real numbers, got dtype {targets.dtype}.")
    expected = tuple(means.shape[1:])
    shape = tuple(targets.shape)
    if shape != expected:
        fix = ""
        if len(expected) == 2 and expected[1] == 1 and shape == expected[:1]:
            fix = (
                " For one output, drop its axis from the members' predictions "
                "(`means[..., 0]`, `stds[..., 0]`) or add it to the targets "
                "(`targets[:, None]`)."
            )
        elif len(expected) == 1 and shape == (*expected, 1):
            fix = " For one output, pass `targets[:, 0]`."
        raise ValueError(
            f"`targets` must have shape {expected} (the [B] or [B, D] of `means` "
            f"of shape {tuple(means.shape)}), got shape {shape}.{fix}"
        )
    return targets


def compute_dtype(*arrays: jax.Array | None) -> jnp.dtype:
    """The dtype the functions compute in: the inputs' floats, at least float32."""
    dtype = jnp.float32
    for array in arrays:
        if array is not None and jnp.issubdtype(array.dtype, jnp.floating):
            dtype = jnp.promote_types(dtype, array.dtype)
    return dtype


# ---------------------------------------------------------------- invalid entries


def split_invalid(
    means: jax.Array, stds: jax.Array | None, targets: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array]:
    """The inputs in the compute dtype with invalid entries made harmless.

    An entry ``[b]`` (``[b, d]``) is invalid where some member's mean is NaN or
    infinite, some member's given standard deviation is not positive and
    finite, or the target is NaN or infinite. Those are replaced (means and
    targets by 0, standard deviations by 1), so that no NaN reaches the other
    entries' values or gradients; the caller poisons the invalid entries'
    results with :func:`poison`.

    Returns:
      ``(means, stds, targets, invalid)`` with ``invalid`` of shape ``[B]``
      or ``[B, D]``.
    """
    dtype = compute_dtype(means, stds, targets)
    means = means.astype(dtype)
    invalid = jnp.any(~jnp.isfinite(means), axis=0)
    if stds is not None:
        stds = stds.astype(dtype)
        invalid = invalid | jnp.any(~(jnp.isfinite(stds) & (stds > 0)), axis=0)
    if targets is not None:
        targets = targets.astype(dtype)
        invalid = invalid | ~jnp.isfinite(targets)
    means = jnp.where(invalid[None], 0.0, means)
    if stds is not None:
        stds = jnp.where(invalid[None], 1.0, stds)
    if targets is not None:
        targets = jnp.where(invalid, 0.0, targets)
    return means, stds, targets, invalid


def poison(values: jax.Array, invalid: jax.Array) -> jax.Array:
    """NaN where ``invalid`` is True (``invalid`` broadcast over ``values``)."""
    return jnp.where(invalid, jnp.nan, values)


def example_invalid(invalid: jax.Array) -> jax.Array:
    """``[B]``: an example is invalid where any of its outputs is."""
    return invalid if invalid.ndim == 1 else jnp.any(invalid, axis=-1)


# ----------------------------------------------------------------- mixture math


def mixture_moments(
    means: jax.Array, stds: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(mean, aleatoric, epistemic)`` per entry: the law of total variance.

    The mean of the member means, the mean of the member variances, and the
    members' population variance (``ddof=0``) of their means, computed as the
    mean squared deviation from the mixture mean (never ``E[mu^2] - E[mu]^2``,
    which cancels).
    """
    mean = jnp.mean(means, axis=0)
    epistemic = jnp.mean(jnp.square(means - mean[None]), axis=0)
    if stds is None:
        aleatoric = jnp.zeros_like(mean)
    else:
        aleatoric = jnp.mean(jnp.square(stds), axis=0)
    return mean, aleatoric, epistemic


def root_mean_square(x: jax.Array, axis: int | tuple[int, ...]) -> jax.Array:
    """``sqrt(mean(x^2))`` over ``axis``, with no square of ``x`` itself.

    ``x / max|x|`` is squared instead: in float32 a square over- or
    underflows beyond ``1.8e19`` or below ``1e-19`` (a spread of 1e-25, an
    error of 1e25), where the root is an ordinary number. The scale is held
    fixed for the gradient, which it does not change (the root is
    homogeneous in ``x``).
    """
    largest = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    scale = jax.lax.stop_gradient(
        jnp.where((largest > 0) & jnp.isfinite(largest), largest, 1.0)
    )
    mean_square = jnp.mean(jnp.square(x / scale), axis=axis, keepdims=True)
    return jnp.squeeze(scale * jnp.sqrt(mean_square), axis)


def mixture_std(
    means: jax.Array, stds: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """``(mean, standard deviation)`` of the mixture per entry, never squared.

    ``sd^2 = mean(sigma_k^2) + mean((mu_k - mu)^2)``, the mean square of the
    ``2 E`` numbers ``sigma_k`` and ``mu_k - mu`` times 2: a root of a mean
    of squares (:func:`root_mean_square`), which holds spreads of 1e-25
    where their variance, 1e-50, is below float32's range.
    """
    mean = jnp.mean(means, axis=0)
    deviations = means - mean[None]
    if stds is None:
        return mean, root_mean_square(deviations, axis=0)
    both = jnp.concatenate([stds, deviations], axis=0)
    return mean, math.sqrt(2) * root_mean_square(both, axis=0)


def member_log_densities(
    means: jax.Array, stds: jax.Array, targets: jax.Array
) -> jax.Array:
    """``[E, B]``: each member's log-density of the example's targets.

    A member's outputs are independent Gaussians, so its density of a ``[D]``
    target is the product over outputs (a sum of log-densities).
    """
    z = (targets[None] - means) / stds
    log_density = -0.5 * jnp.square(z) - jnp.log(stds) - _HALF_LOG_TWO_PI
    return log_density if log_density.ndim == 2 else jnp.sum(log_density, axis=-1)


def mixture_log_density(
    means: jax.Array, stds: jax.Array, targets: jax.Array
) -> jax.Array:
    """``[B]``: ``log(1/E sum_k p_k(y))``, by ``logsumexp`` over members."""
    member = member_log_densities(means, stds, targets)
    return jax.nn.logsumexp(member, axis=0) - math.log(means.shape[0])


def member_cdfs(
    means: jax.Array, stds: jax.Array | None, values: jax.Array
) -> jax.Array:
    """Each member's CDF at ``values`` (broadcast against ``[E, B(, D)]``).

    A point member's CDF is the step ``values >= mean`` (right-continuous).
    """
    if stds is None:
        return (values >= means).astype(means.dtype)
    return special.ndtr((values - means) / stds)


def mixture_cdf(
    means: jax.Array, stds: jax.Array | None, values: jax.Array
) -> jax.Array:
    """``1/E sum_k F_k(values)`` per entry; ``values`` has the shape ``[B(, D)]``."""
    return jnp.mean(member_cdfs(means, stds, values[None]), axis=0)


def mixture_quantiles(
    means: jax.Array, stds: jax.Array | None, levels: jax.Array
) -> jax.Array:
    """The mixture's quantiles ``inf {y : F(y) >= q}`` at ``levels`` ``[Q]``.

    Returns ``[Q, B(, D)]``; NaN at a NaN level. Point members: the
    ``ceil(q E)``-th smallest member mean, exactly. Gaussian members:
    :func:`gaussian_quantiles`.
    """
    num_members = means.shape[0]
    shape = (levels.shape[0],) + (1,) * (means.ndim - 1)
    q = levels.reshape(shape).astype(means.dtype)
    if stds is not None:
        return gaussian_quantiles(means, stds, q)
    ordered = jnp.sort(means, axis=0)
    rank = jnp.clip(jnp.ceil(q * num_members) - 1, 0, num_members - 1)
    shape = (levels.shape[0], *means.shape[1:])
    # A NaN level has no rank: clip would make it the smallest member's.
    index = jnp.broadcast_to(jnp.nan_to_num(rank).astype(jnp.int32), shape)
    quantiles = jnp.take_along_axis(ordered, index, axis=0)
    return jnp.where(jnp.isnan(q), jnp.nan, quantiles)


@jax.custom_jvp
def gaussian_quantiles(means: jax.Array, stds: jax.Array, q: jax.Array) -> jax.Array:
    """A Gaussian mixture's quantiles at ``q`` (``[Q, 1, ...]``): ``[Q, B(, D)]``.

    Bisection between the members' own quantiles at ``q`` (the mixture's lies
    between the smallest and the largest of them, since its CDF is their
    CDFs' mean), for :data:`QUANTILE_ITERATIONS` steps. An upper level is
    solved as the lower level ``1 - q`` of the mirrored mixture (means
    negated): ``1 - q`` is exact in floating point for ``q >= 1/2``, and the
    CDF of a far lower tail is accurate where ``1 - F`` near 1 is not (the
    survival function, in effect). Differentiated by the implicit function
    theorem (:func:`_gaussian_quantiles_jvp`), not through the bisection.
    """
    upper = q > 0.5
    tail = jnp.where(upper, 1 - q, q)
    mirrored = jnp.where(upper[:, None], -means[None], means[None])  # [Q, E, ...]
    own = mirrored + stds[None] * special.ndtri(tail)[:, None]
    low, high = jnp.min(own, axis=1), jnp.max(own, axis=1)

    def step(_, bounds):
        low, high = bounds
        middle = (low + high) / 2
        cdf = jnp.mean(special.ndtr((middle[:, None] - mirrored) / stds[None]), axis=1)
        above = cdf >= tail
        return jnp.where(above, low, middle), jnp.where(above, middle, high)

    low, high = jax.lax.fori_loop(0, QUANTILE_ITERATIONS, step, (low, high))
    middle = (low + high) / 2
    return jnp.where(upper, -middle, middle)


@gaussian_quantiles.defjvp
def _gaussian_quantiles_jvp(primals, tangents):
    """``dy = (dq + sum_k w_k (dm_k + z_k ds_k) / E) / f(y)``.

    From ``F(y) = q`` with ``F = 1/E sum_k Phi(z_k)``, ``z_k = (y - m_k) /
    s_k``: the weights ``w_k = phi(z_k) / s_k`` are the members' densities at
    the quantile and ``f = 1/E sum_k w_k`` the mixture's. They are formed in
    log space, so that a quantile far in every member's tail keeps its
    weights' proportions (``pdf_k / sum pdf``).
    """
    means, stds, q = primals
    dmeans, dstds, dq = tangents
    y = gaussian_quantiles(means, stds, q)
    z = (y[:, None] - means[None]) / stds[None]  # [Q, E, ...]
    log_weights = -0.5 * jnp.square(z) - jnp.log(stds[None]) - _HALF_LOG_TWO_PI
    log_density = jax.nn.logsumexp(log_weights, axis=1) - math.log(means.shape[0])
    shares = jnp.exp(log_weights - jax.nn.logsumexp(log_weights, axis=1)[:, None])
    dy = jnp.sum(shares * (dmeans[None] + z * dstds[None]), axis=1)
    dy = dy + dq * jnp.exp(-log_density)
    return y, dy


def central_interval(
    means: jax.Array, stds: jax.Array | None, level: float
) -> tuple[jax.Array, jax.Array]:
    """The mixture's ``(lower, upper)`` bounds holding ``level`` of its mass.

    Its ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles. For Gaussian
    members the upper bound is the mirrored mixture's lower one at the same
    tail, so both tails are resolved alike: ``(1 + level) / 2`` rounded to
    float32 would lose most of a tail of ``1e-5`` (its spacing near 1 is
    ``6e-8``). ``level`` is a Python float, known when tracing.
    """
    if stds is None:
        levels = jnp.array([(1 - level) / 2, (1 + level) / 2], means.dtype)
        bounds = mixture_quantiles(means, None, levels)
        return bounds[0], bounds[1]
    tail = jnp.full((1,) * means.ndim, (1 - level) / 2, means.dtype)
    lower = gaussian_quantiles(means, stds, tail)[0]
    upper = -gaussian_quantiles(-means, stds, tail)[0]
    return lower, upper


@jax.custom_jvp
def _expected_abs(difference: jax.Array, scale: jax.Array) -> jax.Array:
    """``E|X|`` for ``X ~ N(difference, scale**2)``, ``scale > 0``."""
    z = difference / scale
    return difference * (2 * special.ndtr(z) - 1) + 2 * scale * jnp.exp(
        -0.5 * jnp.square(z) - _HALF_LOG_TWO_PI
    )


@_expected_abs.defjvp
def _expected_abs_jvp(primals, tangents):
    """``d/dm = 2 Phi(z) - 1`` and ``d/ds = 2 phi(z)``, ``z = m / s``.

    Written out, not JAX's derivative of the formula: for a tiny scale (a
    valid 1e-20) that one multiplies ``phi(z) = 0`` by ``dz/ds = -m / s^2``,
    which overflows: ``0 * inf``, NaN.
    """
    difference, scale = primals
    d_difference, d_scale = tangents
    z = difference / scale
    density = jnp.exp(-0.5 * jnp.square(z) - _HALF_LOG_TWO_PI)
    value = _expected_abs(difference, scale)
    return value, (2 * special.ndtr(z) - 1) * d_difference + 2 * density * d_scale


def _crps_term(difference: jax.Array, scale: jax.Array | None) -> jax.Array:
    """``E|X|`` for ``X ~ N(difference, scale**2)`` (``|difference|`` at 0)."""
    if scale is None:
        return jnp.abs(difference)
    positive = scale > 0
    value = _expected_abs(difference, jnp.where(positive, scale, 1.0))
    return jnp.where(positive, value, jnp.abs(difference))


@jax.custom_jvp
def _hypot(a: jax.Array, b: jax.Array) -> jax.Array:
    """``sqrt(a^2 + b^2)`` of positive ``a``, ``b`` without squaring them.

    ``a^2`` of a valid 1e-20 is below float32's smallest normal number (XLA
    may flush it to 0), and ``sqrt`` at 0 has no derivative; its derivative,
    ``a / hypot``, is written out for the same reason.
    """
    big, small = jnp.maximum(a, b), jnp.minimum(a, b)
    return big * jnp.sqrt(1 + jnp.square(small / big))


@_hypot.defjvp
def _hypot_jvp(primals, tangents):
    a, b = primals
    value = _hypot(a, b)
    return value, (a * tangents[0] + b * tangents[1]) / value


def mixture_crps(
    means: jax.Array, stds: jax.Array | None, targets: jax.Array
) -> jax.Array:
    """The CRPS of the uniform mixture per entry (Grimit et al., 2006).

    ``E|Y - y| - 1/2 E|Y - Y'|`` with ``Y, Y'`` independent draws of the
    mixture: ``1/E sum_k A(y - mu_k, s_k^2) - 1/(2 E^2) sum_{k,l}
    A(mu_k - mu_l, s_k^2 + s_l^2)``, ``A(m, v) = E|N(m, v)|``.
    """
    spread = None if stds is None else stds
    to_target = jnp.mean(_crps_term(targets[None] - means, spread), axis=0)
    pair_scale = None
    if stds is not None:
        pair_scale = _hypot(stds[:, None], stds[None, :])
    between = _crps_term(means[:, None] - means[None, :], pair_scale)
    return to_target - 0.5 * jnp.mean(between, axis=(0, 1))


def scale_about_mean(
    means: jax.Array, stds: jax.Array | None, scale: jax.Array
) -> tuple[jax.Array, jax.Array | None]:
    """The mixture stretched by ``scale`` about its mean (every spread times it)."""
    center = jnp.mean(means, axis=0, keepdims=True)
    scaled_means = center + scale * (means - center)
    return scaled_means, None if stds is None else scale * stds
