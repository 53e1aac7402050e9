"""A regression ensemble's two spreads, calibrated apart: noise from clean data.

:func:`~ensembles.uncertainty.fit_std_scale` stretches the whole predictive by
one factor. Fitted on noisy copies of the inputs
(:func:`~ensembles.uncertainty.noisy_copies`), that factor learns the error
the input noise adds to the targets as if it were the data's own noise: the
intervals then over-cover in distribution (``notes/shift.md``: 90% intervals
covering 0.95). :func:`fit_spread_scales` keeps the two apart:

1. the **aleatoric scale** ``a``, of every member's standard deviation (the
   members' means kept), minimises the NLL on clean held-out examples: the
   data's noise, measured where there is no shift;
2. the **epistemic scale** ``b``, of the members' distances from the mixture
   mean (``a`` kept), minimises the NLL on hard held-out examples (noisy
   copies, or a held-out shifted set): how much more the members should
   disagree where the inputs move. In distribution, where they agree, ``b``
   changes little; where they disagree, it widens the predictive.

:func:`scale_spread` applies them: member ``k`` becomes ``N(c + b (mu_k - c),
a sigma_k)``, ``c`` the mixture mean (which both keep). Both are fits, not
differentiable functions; both run under :func:`jax.jit`; invalid entries give
NaN, as everywhere in :mod:`ensembles.uncertainty`.

>>> import jax.numpy as jnp
>>> from ensembles import uncertainty
>>> means, stds = jnp.array([[0.0], [2.0]]), jnp.array([[1.0], [1.0]])
>>> uncertainty.scale_spread(means, stds, jnp.array([2.0, 0.5]))
(Array([[0.5],
       [1.5]], dtype=float32), Array([[2.],
       [2.]], dtype=float32))
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import check_array, check_positive_int, known_values
from ensembles.uncertainty._common import check_bounds, poison_all
from ensembles.uncertainty.regression import _common as reg
from ensembles.uncertainty.regression.calibration import _fit_log


def _spread(means, stds, aleatoric, epistemic):
    center = jnp.mean(means, axis=0, keepdims=True)
    return center + epistemic * (means - center), aleatoric * stds


def _nll(means, stds, targets, aleatoric, epistemic):
    spread_means, spread_stds = _spread(means, stds, aleatoric, epistemic)
    return -jnp.mean(reg.mixture_log_density(spread_means, spread_stds, targets))


@functools.partial(jax.jit, static_argnames="iterations")
def _fit_spread_scales(
    means, stds, targets, hard_means, hard_stds, hard_targets, low, high, iterations
):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    hard_means, hard_stds, hard_targets, hard_invalid = reg.split_invalid(
        hard_means, hard_stds, hard_targets
    )
    dtype = means.dtype
    log_a, _ = _fit_log(
        lambda t: _nll(means, stds, targets, jnp.exp(t), 1.0),
        low,
        high,
        iterations,
        dtype,
    )
    aleatoric = jnp.exp(log_a)
    log_b, _ = _fit_log(
        lambda t: _nll(hard_means, hard_stds, hard_targets, aleatoric, jnp.exp(t)),
        low,
        high,
        iterations,
        dtype,
    )
    # Members that never disagree (one member) leave b undetermined: 1.
    center = jnp.mean(hard_means, axis=0, keepdims=True)
    disagree = jnp.any(hard_means != center)
    epistemic = jnp.where(disagree, jnp.exp(log_b), jnp.ones((), dtype))
    scales = jnp.stack([aleatoric, epistemic])
    scales = poison_all(scales, invalid)
    return poison_all(scales, hard_invalid)


def fit_spread_scales(
    means: jax.Array,
    stds: jax.Array,
    targets: jax.Array,
    hard_means: jax.Array,
    hard_stds: jax.Array,
    hard_targets: jax.Array,
    *,
    bounds: tuple[float, float] = (0.05, 20.0),
    iterations: int = 40,
) -> jax.Array:
    """The aleatoric scale from clean held-out data, the epistemic one from hard data.

    ``a`` minimises the mixture's NLL on the clean examples with every
    member's standard deviation times ``a``; then ``b``, with ``a`` kept,
    on the hard ones (noisy copies of the clean examples, or a held-out
    shifted set) with every member's distance from the mixture mean times
    ``b``. Each search: a grid of 65 log-spaced scales in ``bounds``, then
    bisection of the slope (``iterations`` steps). With members that never
    disagree (one member) ``b`` is 1.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> keys = jax.random.split(jax.random.key(0), 3)
    >>> targets = 2.0 * jax.random.normal(keys[0], (2000,))    # noise of std 2
    >>> means = 0.1 * jax.random.normal(keys[1], (4, 2000))    # members near 0
    >>> stds = jnp.full((4, 2000), 0.5)                        # 4x too sure
    >>> hard_targets = 3.0 * jax.random.normal(keys[2], (2000,))
    >>> hard_means = 2.0 * jax.random.normal(keys[1], (4, 2000))  # disagreeing
    >>> scales = uncertainty.fit_spread_scales(
    ...     means, stds, targets, hard_means, stds, hard_targets)
    >>> [round(float(s), 1) for s in scales]
    [4.0, 1.3]

    Args:
      means: the members' means on clean held-out examples, ``[E, B]`` or
        ``[E, B, D]``.
      stds: their standard deviations.
      targets: ``[B]`` or ``[B, D]``.
      hard_means: the members' means on hard held-out examples ``[E, B', ...]``.
      hard_stds: their standard deviations.
      hard_targets: their targets.
      bounds: the smallest and largest scales considered.
      iterations: bisection steps; static under :func:`jax.jit`.

    Returns:
      ``[2]``: ``(a, b)``, positive; NaN if any entry of either set is invalid.

    Raises:
      ValueError: if the shapes do not match (each set its own ``B``, the
        same ``E`` and ``D``), ``stds`` are ``None`` or ``bounds`` invalid.
      TypeError: if an argument is not a real array.
    """
    means, stds = reg.check_members(means, stds, "fit_spread_scales")
    targets = reg.check_targets(targets, means)
    hard_means, hard_stds = reg.check_members(
        hard_means, hard_stds, "fit_spread_scales"
    )
    hard_targets = reg.check_targets(hard_targets, hard_means)
    if (hard_means.shape[0], hard_means.shape[2:]) != (
        means.shape[0],
        means.shape[2:],
    ):
        raise ValueError(
            f"`hard_means` must have the members and outputs of `means` "
            f"({means.shape[0]} members, outputs {tuple(means.shape[2:])}), got "
            f"shape {tuple(hard_means.shape)}: predict both sets with one model."
        )
    low, high = check_bounds(bounds, "scales")
    iterations = check_positive_int(iterations, "iterations")
    dtype = reg.compute_dtype(means, stds, hard_means, hard_stds)
    return _fit_spread_scales(
        means.astype(dtype),
        stds.astype(dtype),
        targets.astype(dtype),
        hard_means.astype(dtype),
        hard_stds.astype(dtype),
        hard_targets.astype(dtype),
        math.log(low),
        math.log(high),
        iterations,
    )


@jax.jit
def _scale_spread(means, stds, scales):
    means, stds, _, invalid = reg.split_invalid(means, stds)
    bad = ~jnp.all(jnp.isfinite(scales) & (scales > 0))
    safe = jnp.where(bad, 1.0, scales)
    spread_means, spread_stds = _spread(means, stds, safe[0], safe[1])
    invalid = invalid | bad
    return reg.poison(spread_means, invalid[None]), reg.poison(
        spread_stds, invalid[None]
    )


def scale_spread(
    means: jax.Array, stds: jax.Array, scales: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The members with their aleatoric and epistemic spreads rescaled apart.

    Member ``k`` becomes ``N(c + b (mu_k - c), a sigma_k)`` with ``(a, b) =
    scales`` from :func:`fit_spread_scales` and ``c`` the mixture mean: the
    aleatoric variance times ``a^2``, the epistemic times ``b^2``. Every
    function of :mod:`ensembles.uncertainty` takes the result as it takes the
    members.

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations.
      scales: ``[2]`` positive scales ``(a, b)``.

    Returns:
      ``(means, stds)``, in the compute dtype; NaN for invalid entries, all
      NaN for scales that are not positive and finite under :func:`jax.jit`.

    Raises:
      ValueError: if the shapes do not match, ``stds`` is ``None``, or
        ``scales`` is not ``[2]`` or (when known) not positive and finite.
      TypeError: if an argument is not a real array.
    """
    means, stds = reg.check_members(means, stds, "scale_spread")
    scales = check_array(scales, "scales", what="two positive scales")
    known = known_values(scales)
    fix = "fit them with `uncertainty.fit_spread_scales`."
    if tuple(np.shape(scales)) != (2,) or jnp.result_type(scales) == jnp.bool_:
        raise ValueError(
            f"`scales` must be two positive numbers (a, b), got shape "
            f"{tuple(np.shape(scales))}: {fix}"
        )
    if known is not None:
        values = known.astype(np.float64)
        if not (np.isfinite(values) & (values > 0)).all():
            raise ValueError(
                f"`scales` must be positive and finite, got {values.tolist()}: {fix}"
            )
    dtype = reg.compute_dtype(means, stds)
    return _scale_spread(
        means.astype(dtype), stds.astype(dtype), jnp.asarray(scales).astype(dtype)
    )
