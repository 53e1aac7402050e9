"""The predictive distribution of a regression ensemble: its members' exact mixture.

Member ``k`` of an ensemble of ``E`` predicts, for every example and output, a
Gaussian ``N(mu_k, sigma_k^2)`` (a mean-and-spread head) or a point ``mu_k``
(members trained on a squared error). The ensemble predicts their uniform
mixture, ``p(y | x) = 1/E sum_k N(y; mu_k, sigma_k^2)``, exactly: never one
Gaussian with the members' averaged parameters (which drops their
disagreement), and a Gaussian of the mixture's moments only where a function
says so (:func:`~ensembles.uncertainty.moment_matched_nll`).

Every function takes the members' means ``[E, B]`` (or ``[E, B, D]`` for D
outputs) and their standard deviations of the same shape, or ``None`` for
point members, whose mixture is their empirical distribution and whose only
spread is their disagreement. Its variance splits by the law of total
variance::

    mixture_variance  =  aleatoric_variance  +  epistemic_variance
    Var[y]            =  1/E sum_k sigma_k^2  +  1/E sum_k (mu_k - mu)^2

``aleatoric_variance`` is the noise the members see in the data;
``epistemic_variance`` their disagreement, the usual score for out-of-
distribution detection (:func:`~ensembles.uncertainty.auroc`). See
:mod:`ensembles.uncertainty` for the scores, the recalibration and the common
contract: results are computed in at least float32; an entry (one example's
output) is invalid where a member's mean is NaN or infinite, or a given
standard deviation is not positive and finite (or its target, where a
function takes targets, is NaN or infinite), and its result is then NaN,
other entries unaffected; a function that returns one value per example is NaN
for an example with any invalid output.

>>> import jax.numpy as jnp
>>> from ensembles import uncertainty
>>> means = jnp.array([[0.0, 1.0], [2.0, 1.0]])  # E = 2 members, B = 2 examples
>>> stds = jnp.array([[1.0, 1.0], [1.0, 1.0]])
>>> uncertainty.mixture_mean(means, stds)
Array([1., 1.], dtype=float32)
>>> uncertainty.epistemic_variance(means, stds)  # they disagree on example 0
Array([1., 0.], dtype=float32)
>>> uncertainty.mixture_variance(means, stds)  # aleatoric 1 + epistemic
Array([2., 1.], dtype=float32)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import check_array, known_values
from ensembles.uncertainty._common import check_level
from ensembles.uncertainty.regression import _common as reg


@functools.partial(jax.jit, static_argnames="part")
def _moment(means, stds, part):
    means, stds, _, invalid = reg.split_invalid(means, stds)
    mean, aleatoric, epistemic = reg.mixture_moments(means, stds)
    value = {
        "mean": mean,
        "aleatoric": aleatoric,
        "epistemic": epistemic,
        "total": aleatoric + epistemic,
    }[part]
    return reg.poison(value, invalid)


def mixture_mean(means: jax.Array, stds: jax.Array | None = None) -> jax.Array:
    """The mean of the ensemble's predictive: the mean of the member means.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> uncertainty.mixture_mean(jnp.array([[1.0], [3.0]]))  # E = 2, B = 1
    Array([2.], dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations (same shape), or ``None`` (point
        members); used only to mark invalid entries.

    Returns:
      ``[B]`` or ``[B, D]``, in at least float32; NaN for invalid entries.

    Raises:
      ValueError: if ``means`` is not ``[E, B]``/``[E, B, D]`` or ``stds``
        has another shape.
      TypeError: if they are not floating-point arrays.
    """
    return _moment(*reg.check_members(means, stds), part="mean")


def mixture_variance(means: jax.Array, stds: jax.Array | None = None) -> jax.Array:
    """Total predictive variance: aleatoric plus epistemic.

    ``1/E sum_k (sigma_k^2 + (mu_k - mu)^2)`` with ``mu`` the mixture mean:
    the variance of the exact mixture (for point members, of the members'
    means alone).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.array([[0.0], [2.0]]), jnp.array([[1.0], [2.0]])
    >>> uncertainty.mixture_variance(means, stds)  # (1 + 4) / 2 + 1
    Array([3.5], dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).

    Returns:
      ``[B]`` or ``[B, D]`` non-negative variances; NaN for invalid entries.

    Raises:
      ValueError: if ``means`` is not ``[E, B]``/``[E, B, D]`` or ``stds``
        has another shape.
      TypeError: if they are not floating-point arrays.
    """
    return _moment(*reg.check_members(means, stds), part="total")


def aleatoric_variance(means: jax.Array, stds: jax.Array | None = None) -> jax.Array:
    """The members' mean variance ``1/E sum_k sigma_k^2``: the noise they see.

    0 for point members (``stds=None``), which model no noise.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.array([[0.0], [2.0]]), jnp.array([[1.0], [2.0]])
    >>> uncertainty.aleatoric_variance(means, stds)
    Array([2.5], dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).

    Returns:
      ``[B]`` or ``[B, D]``; NaN for invalid entries.

    Raises:
      ValueError: if ``means`` is not ``[E, B]``/``[E, B, D]`` or ``stds``
        has another shape.
      TypeError: if they are not floating-point arrays.
    """
    return _moment(*reg.check_members(means, stds), part="aleatoric")


def epistemic_variance(means: jax.Array, stds: jax.Array | None = None) -> jax.Array:
    """The members' disagreement: the variance of their means over members.

    ``1/E sum_k (mu_k - mu)^2`` (``ddof=0``), 0 where the members agree and
    for one member. The usual out-of-distribution score of an ensemble.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> uncertainty.epistemic_variance(jnp.array([[0.0, 1.0], [2.0, 1.0]]))
    Array([1., 0.], dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None``; used only to mark
        invalid entries.

    Returns:
      ``[B]`` or ``[B, D]`` non-negative variances; NaN for invalid entries.

    Raises:
      ValueError: if ``means`` is not ``[E, B]``/``[E, B, D]`` or ``stds``
        has another shape.
      TypeError: if they are not floating-point arrays.
    """
    return _moment(*reg.check_members(means, stds), part="epistemic")


@jax.jit
def _pairwise_gaussian_kl(means, stds):
    means, stds, _, invalid = reg.split_invalid(means, stds)
    num_members = means.shape[0]
    # KL(N_k || N_l) = log(s_l / s_k) + (s_k^2 + (m_k - m_l)^2) / (2 s_l^2) - 1/2,
    # with the ratios formed before squaring (tiny valid stds stay finite).
    ratio = stds[:, None] / stds[None, :]  # s_k / s_l, [E, E, B(, D)]
    gap = (means[:, None] - means[None, :]) / stds[None, :]
    kl = -jnp.log(ratio) + 0.5 * (jnp.square(ratio) + jnp.square(gap)) - 0.5
    if kl.ndim == 4:  # the D outputs of a member are independent: KLs add
        kl = jnp.sum(kl, axis=-1)
    kl = jnp.maximum(kl, 0.0)  # a divergence: rounding may leave it below 0
    pairs = max(num_members * (num_members - 1), 1)
    return reg.poison(jnp.sum(kl, axis=(0, 1)) / pairs, reg.example_invalid(invalid))


def pairwise_gaussian_kl(means: jax.Array, stds: jax.Array) -> jax.Array:
    """Mean KL divergence between Gaussian members: their diversity in nats.

    ``1 / (E (E - 1)) sum_{k != l} KL(N_k || N_l)`` over ordered pairs, each
    member's D outputs independent Gaussians (their KLs add). It grows with
    the members' disagreement relative to their spreads, where
    :func:`epistemic_variance` is in the targets' units.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.array([[0.0], [1.0]]), jnp.ones((2, 1))
    >>> uncertainty.pairwise_gaussian_kl(means, stds)  # (1 - 0)^2 / 2 each way
    Array([0.5], dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations (point members have no density).

    Returns:
      ``[B]`` non-negative divergences (0 for one member); NaN for invalid
      examples.

    Raises:
      ValueError: if the shapes do not match, or ``stds`` is ``None``.
      TypeError: if an argument is not a real array.
    """
    means, stds = reg.check_members(means, stds, "pairwise_gaussian_kl")
    return _pairwise_gaussian_kl(means, stds)


@jax.jit
def _log_density(means, stds, targets):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    log_density = reg.mixture_log_density(means, stds, targets)
    return reg.poison(log_density, reg.example_invalid(invalid))


def mixture_log_density(
    means: jax.Array, stds: jax.Array, targets: jax.Array
) -> jax.Array:
    """The log-density of each example's targets under the ensemble's mixture.

    ``log(1/E sum_k prod_d N(y_d; mu_kd, sigma_kd^2))``, computed by
    ``logsumexp`` over members (finite where every member alone would
    underflow). For D outputs it is the joint density of the D targets: each
    member's outputs are independent, the mixture couples them.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.array([[-1.0], [1.0]]), jnp.array([[1.0], [1.0]])
    >>> uncertainty.mixture_log_density(means, stds, jnp.array([1.0])).round(4)
    Array([-1.4851999], dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, positive (point members have no
        density).
      targets: ``[B]`` or ``[B, D]``.

    Returns:
      ``[B]`` log-densities (nats); NaN for an example with an invalid entry.

    Raises:
      ValueError: if the shapes do not match, or ``stds`` is ``None``.
      TypeError: if an argument is not a real array.
    """
    means, stds = reg.check_members(means, stds, "mixture_log_density")
    return _log_density(means, stds, reg.check_targets(targets, means))


@jax.jit
def _cdf(means, stds, targets):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    return reg.poison(reg.mixture_cdf(means, stds, targets), invalid)


def mixture_cdf(
    means: jax.Array, stds: jax.Array | None, targets: jax.Array
) -> jax.Array:
    """The mixture's CDF at the targets: their probability integral transform.

    ``F(y) = 1/E sum_k Phi((y - mu_k) / sigma_k)`` per example and output (for
    point members, the share of members at or below ``y``). On a calibrated
    predictive these PIT values are uniform on ``[0, 1]``
    (:func:`~ensembles.uncertainty.pit_calibration_error` measures how far
    they are from it).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.array([[-1.0], [1.0]]), jnp.array([[1.0], [1.0]])
    >>> uncertainty.mixture_cdf(means, stds, jnp.array([0.0]))  # symmetric
    Array([0.5], dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      targets: ``[B]`` or ``[B, D]``.

    Returns:
      ``[B]`` or ``[B, D]`` values in ``[0, 1]``; NaN for invalid entries.

    Raises:
      ValueError: if the shapes do not match.
      TypeError: if an argument is not a real array.
    """
    means, stds = reg.check_members(means, stds)
    return _cdf(means, stds, reg.check_targets(targets, means))


@jax.jit
def _quantile(means, stds, levels):
    means, stds, _, invalid = reg.split_invalid(means, stds)
    return reg.poison(reg.mixture_quantiles(means, stds, levels), invalid[None])


def _check_levels(levels: Any) -> tuple[jax.Array, bool]:
    """``levels`` as a ``[Q]`` array in ``(0, 1)``, and whether it was a scalar."""
    levels = check_array(levels, "levels", what="a level in (0, 1) or an array of them")
    # Known values are checked on the host, under jax.jit too (a jnp
    # conversion of them would be traced there).
    values = known_values(levels)
    array = jnp.asarray(levels)
    if array.dtype == jnp.bool_ or not (
        jnp.issubdtype(array.dtype, jnp.floating)
        or jnp.issubdtype(array.dtype, jnp.integer)
    ):
        raise TypeError(f"`levels` must be real numbers, got dtype {array.dtype}.")
    if array.ndim > 1:
        raise ValueError(
            f"`levels` must be a number or a 1-D array of them, got shape "
            f"{tuple(array.shape)}: pass `levels.reshape(-1)`."
        )
    if values is not None:
        values = values.astype(np.float64)
    if values is not None and not ((values > 0) & (values < 1)).all():
        raise ValueError(
            f"`levels` must lie strictly between 0 and 1, got {values.tolist()!r}."
        )
    return array.reshape(-1), array.ndim == 0


def mixture_quantile(
    means: jax.Array, stds: jax.Array | None, levels: float | jax.Array
) -> jax.Array:
    """The mixture's quantiles: the smallest ``y`` with ``F(y) >= level``.

    Exact for point members (an order statistic of the member means); for
    Gaussian members found by jitted bisection between the members' own
    quantiles, which bracket the mixture's, to float precision.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> uncertainty.mixture_quantile(jnp.zeros((1, 1)), jnp.ones((1, 1)), 0.975)
    Array([1.9599644], dtype=float32)
    >>> means, stds = jnp.array([[-1.0], [1.0]]), jnp.array([[1.0], [1.0]])
    >>> uncertainty.mixture_quantile(means, stds, jnp.array([0.05, 0.95])).round(2)
    Array([[-2.28],
           [ 2.28]], dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      levels: a level in ``(0, 1)``, or a 1-D array of ``Q`` levels.

    Returns:
      ``[B]`` or ``[B, D]`` for one level; ``[Q, B(, D)]`` for an array of
      them. NaN for invalid entries (and, under :func:`jax.jit`, for a level
      outside ``(0, 1)``).

    Raises:
      ValueError: if the shapes do not match, or a known level lies outside
        ``(0, 1)``.
      TypeError: if an argument is not a real array.
    """
    means, stds = reg.check_members(means, stds)
    levels, scalar = _check_levels(levels)
    dtype = reg.compute_dtype(means, stds)
    quantiles = _quantile(means, stds, levels.astype(dtype))
    bad = (levels <= 0) | (levels >= 1)
    bad = bad.reshape((-1,) + (1,) * (quantiles.ndim - 1))
    quantiles = jnp.where(bad, jnp.nan, quantiles)
    return quantiles[0] if scalar else quantiles


def mixture_interval(
    means: jax.Array, stds: jax.Array | None, level: float = 0.9
) -> tuple[jax.Array, jax.Array]:
    """The mixture's central interval holding ``level`` of its mass.

    From its ``(1 - level) / 2`` quantile to its ``(1 + level) / 2`` quantile
    (:func:`mixture_quantile`).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> lower, upper = uncertainty.mixture_interval(
    ...     jnp.zeros((1, 1)), jnp.ones((1, 1)), level=0.95)
    >>> round(float(lower[0]), 3), round(float(upper[0]), 3)  # one N(0, 1)
    (-1.96, 1.96)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      level: the interval's share of the mass, in ``(0, 1)``.

    Returns:
      ``(lower, upper)``, each ``[B]`` or ``[B, D]``; NaN for invalid entries.

    Raises:
      ValueError: if the shapes do not match or ``level`` is not in ``(0, 1)``.
      TypeError: if an argument is not a real array.
    """
    level = check_level(level, reg.LEVEL_OF)
    means, stds = reg.check_members(means, stds)
    return _interval(means, stds, level)


@functools.partial(jax.jit, static_argnames="level")
def _interval(means, stds, level):
    means, stds, _, invalid = reg.split_invalid(means, stds)
    lower, upper = reg.central_interval(means, stds, level)
    return reg.poison(lower, invalid), reg.poison(upper, invalid)
