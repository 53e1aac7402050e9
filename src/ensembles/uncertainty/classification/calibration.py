"""Temperature scaling of the ensemble predictive: pool the members, then calibrate.

An ensemble of individually calibrated members tends to be *underconfident*:
averaging members that disagree flattens the predictive (Rahaman & Thiery,
2021; Wu & Gales, 2021). One temperature fitted on held-out data corrects it
either way, without touching the members: :func:`fit_temperature` finds it,
:func:`scale_temperature` applies it. The temperature acts on the pooled
predictive ``p = 1/E sum_k p_k``, as ``softmax(log p / T)``; ``T < 1``
sharpens an underconfident ensemble, ``T > 1`` softens an overconfident model.
See :mod:`ensembles.uncertainty` for the input conventions.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import (
    check_array,
    check_positive_int,
    known_values,
)
from ensembles.uncertainty._common import check_bounds, poison_all
from ensembles.uncertainty.classification._common import (
    _check_labels,
    _check_logits,
    _member_log_probs,
    _poison,
    _predictive_log_probs,
    _split_invalid,
    _split_invalid_labeled,
)


def _bisect_temperatures(log_probs, labels, log_b_low, log_b_high, iterations):
    """Temperatures ``[...]`` minimising the NLL of ``log_probs`` ``[..., B, C]``.

    One fit per leading index (the pooled predictive, or each member).
    """
    possible = log_probs > -jnp.inf  # classes ruled out stay out
    z = jnp.where(possible, log_probs, 0.0)
    index = jnp.broadcast_to(labels[:, None], (*z.shape[:-1], 1))
    z_label = jnp.take_along_axis(z, index, axis=-1)[..., 0]
    label_possible = jnp.take_along_axis(possible, index, axis=-1)[..., 0]
    # NLL(b) = mean(logsumexp(b z) - b z_label) is convex in b = 1/T; its slope
    # mean(E_softmax(b z)[z] - z_label) increases with b: bisect its zero in log b.

    def slope(log_b):
        scaled = jnp.where(possible, jnp.exp(log_b)[..., None, None] * z, -jnp.inf)
        expected = jnp.sum(jax.nn.softmax(scaled, axis=-1) * z, axis=-1)
        return jnp.mean(expected - z_label, axis=-1)

    def step(_, bounds):
        low, high = bounds
        middle = (low + high) / 2
        rising = slope(middle) > 0
        return jnp.where(rising, low, middle), jnp.where(rising, middle, high)

    dtype = log_probs.dtype  # float32, or float64 under x64 for float64 logits
    shape = log_probs.shape[:-2]
    low, high = jax.lax.fori_loop(
        0,
        iterations,
        step,
        (jnp.full(shape, log_b_low, dtype), jnp.full(shape, log_b_high, dtype)),
    )
    # A label ruled out has an infinite NLL at every temperature: NaN.
    return jnp.where(
        jnp.all(label_possible, axis=-1), jnp.exp(-(low + high) / 2), jnp.nan
    )


@functools.partial(jax.jit, static_argnames=("iterations",))
def _fit_temperature(logits, labels, log_b_low, log_b_high, iterations):
    logits, labels, invalid = _split_invalid_labeled(logits, labels)
    log_probs = _predictive_log_probs(_member_log_probs(logits))  # [B, C]
    temperature = _bisect_temperatures(
        log_probs[None], labels, log_b_low, log_b_high, iterations
    )[0]
    return poison_all(temperature, invalid)


def fit_temperature(
    logits: jax.Array,
    labels: jax.Array,
    *,
    bounds: tuple[float, float] = (0.05, 20.0),
    iterations: int = 40,
) -> jax.Array:
    """The temperature that minimises the NLL of the pooled, rescaled predictive.

    Fit it on held-out examples (a validation split, never the test set you
    report), then apply it with :func:`scale_temperature`. The NLL of
    ``softmax(log p / T)`` is convex in ``1/T``; the minimum is found by
    bisection of its slope in ``log(1/T)`` to within ``bounds``, which it
    is clipped to. Where every temperature fits equally (one possible class
    per example) it returns the lower bound. It is a fit, not
    a differentiable function of the logits: its gradient is zero.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> # Two members that disagree: the predictive is 0.55 / 0.45, but the
    >>> # first class is right 3 times in 4; the NLL is lowest where the scaled
    >>> # predictive says 0.75: (0.55 / 0.45) ** (1 / T) = 3, T = 0.183.
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1]] * 4, [[0.2, 0.8]] * 4]))
    >>> labels = jnp.array([0, 0, 0, 1])
    >>> temperature = uncertainty.fit_temperature(logits, labels)
    >>> round(float(temperature), 3)
    0.183
    >>> probs = jnp.exp(uncertainty.scale_temperature(logits, temperature))
    >>> probs.shape, [round(p, 3) for p in probs[0, 0].tolist()]
    ((1, 4, 2), [0.75, 0.25])

    Args:
      logits: member logits of shape ``[E, B, C]``.
      labels: integer class indices of shape ``[B]``, in ``[0, C)``.
      bounds: the lowest and highest temperatures considered, ``1e-30 <=
        low < high <= 1e30``.
      iterations: bisection steps (40 narrow the range of ``log T`` by
        ``2**-40``); static under :func:`jax.jit`.

    Returns:
      The temperature, a scalar in the logits' compute dtype (float32, or
      float64 for float64 logits under x64) (``> 1``: the ensemble was
      overconfident, ``< 1``: underconfident); NaN if any example has invalid
      logits (see :mod:`ensembles.uncertainty`), a label every member rules
      out, or, under :func:`jax.jit`, a label outside ``[0, C)``.

    Raises:
      ValueError: if the shapes do not match ``[E, B, C]`` and ``[B]``, a
        label lies outside ``[0, C)`` (when not traced), or ``bounds`` are not
        two numbers with ``1e-30 <= low < high <= 1e30``.
      TypeError: if ``logits`` is not floating-point or ``labels`` not integer.
    """
    logits = _check_logits(logits)
    labels = _check_labels(labels, logits)
    return _fit_temperature(logits, labels, *_fit_options(bounds, iterations))


def _fit_options(bounds, iterations) -> tuple[float, float, int]:
    """The bisection's ends in ``log(1/T)`` (in float64 here), and its steps."""
    lowest, highest = check_bounds(bounds, "temperatures")
    iterations = check_positive_int(iterations, "iterations")
    return -math.log(highest), -math.log(lowest), iterations


@functools.partial(jax.jit, static_argnames=("iterations",))
def _fit_member_temperatures(logits, labels, log_b_low, log_b_high, iterations):
    logits, labels, invalid = _split_invalid_labeled(logits, labels)
    temperatures = _bisect_temperatures(
        _member_log_probs(logits), labels, log_b_low, log_b_high, iterations
    )
    return poison_all(temperatures, invalid)


def fit_member_temperatures(
    logits: jax.Array,
    labels: jax.Array,
    *,
    bounds: tuple[float, float] = (0.05, 20.0),
    iterations: int = 40,
) -> jax.Array:
    """One temperature per member, each minimising that member's own NLL.

    Calibrate, then pool: each member's softmax is rescaled on its own
    (:func:`scale_member_temperatures`) and the ensemble is the mean of the
    rescaled members, where :func:`fit_temperature` rescales the pooled
    predictive. The mean of calibrated members tends to be underconfident
    (Rahaman & Thiery, 2021), and the members' disagreement survives the
    rescaling; ``docs/training.md`` measures both orders under shift.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1]] * 4, [[0.6, 0.4]] * 4]))
    >>> labels = jnp.array([0, 0, 0, 1])  # the first class is right 3 in 4
    >>> temperatures = uncertainty.fit_member_temperatures(logits, labels)
    >>> [round(t, 3) for t in temperatures.tolist()]
    [2.0, 0.369]

    Args:
      logits: member logits ``[E, B, C]``.
      labels: integer class indices ``[B]`` in ``[0, C)``.
      bounds: the lowest and highest temperatures considered, ``1e-30 <=
        low < high <= 1e30``.
      iterations: bisection steps; static under :func:`jax.jit`.

    Returns:
      ``[E]`` temperatures (``> 1``: that member was overconfident); NaN
      where :func:`fit_temperature` would be.

    Raises:
      ValueError: as :func:`fit_temperature`.
      TypeError: as :func:`fit_temperature`.
    """
    logits = _check_logits(logits)
    labels = _check_labels(labels, logits)
    return _fit_member_temperatures(logits, labels, *_fit_options(bounds, iterations))


@jax.jit
def _scale_member_temperatures(logits, temperatures):
    logits, invalid = _split_invalid(logits)
    log_probs = _member_log_probs(logits)
    bad = ~(jnp.isfinite(temperatures) & (temperatures > 0))
    temperatures = jnp.where(bad, 1.0, temperatures).astype(log_probs.dtype)
    possible = log_probs > -jnp.inf
    scaled = jnp.where(
        possible,
        jnp.where(possible, log_probs, 0.0) / temperatures[:, None, None],
        -jnp.inf,
    )
    scaled = jax.nn.log_softmax(scaled, axis=-1)
    return jnp.where(jnp.any(bad) | invalid[None, :, None], jnp.nan, scaled)


def scale_member_temperatures(logits: jax.Array, temperatures: jax.Array) -> jax.Array:
    """Each member's softmax at its own temperature: member log-probs ``[E, B, C]``.

    ``log_softmax(log_softmax(logits_k) / T_k)``; every function of
    :mod:`ensembles.uncertainty` takes the result as member logits and pools
    them (their disagreement is kept: :func:`mutual_information` of the
    result is that of the rescaled members).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1]], [[0.6, 0.4]]]))
    >>> scaled = uncertainty.scale_member_temperatures(logits, jnp.array([1.0, 0.5]))
    >>> [[round(p, 3) for p in row] for row in jnp.exp(scaled)[:, 0].tolist()]
    [[0.9, 0.1], [0.692, 0.308]]

    Args:
      logits: member logits ``[E, B, C]``.
      temperatures: ``[E]`` positive temperatures, e.g. from
        :func:`fit_member_temperatures`.

    Returns:
      ``[E, B, C]`` log-probabilities in at least float32; NaN for examples
      with invalid logits, and all NaN for a temperature that is not positive
      and finite under :func:`jax.jit`.

    Raises:
      ValueError: if ``temperatures`` is not ``[E]``, or (when known) one is
        not positive and finite in the compute dtype.
      TypeError: if ``logits`` is not floating-point or ``temperatures`` not
        real numbers.
    """
    logits = _check_logits(logits)
    temperatures = check_array(temperatures, "temperatures", what="positive numbers")
    known = known_values(temperatures)
    temperatures = jnp.asarray(temperatures)
    if tuple(temperatures.shape) != (logits.shape[0],):
        raise ValueError(
            f"`temperatures` must have shape [E] = ({logits.shape[0]},), one per "
            f"member, got shape {tuple(temperatures.shape)}: fit them with "
            f"`uncertainty.fit_member_temperatures`."
        )
    if temperatures.dtype == jnp.bool_ or not (
        jnp.issubdtype(temperatures.dtype, jnp.floating)
        or jnp.issubdtype(temperatures.dtype, jnp.integer)
    ):
        raise TypeError(
            f"`temperatures` must be real numbers, got dtype {temperatures.dtype}."
        )
    compute = jnp.promote_types(logits.dtype, jnp.float32)
    # Checked on the host, known values under jax.jit too: a jnp cast of them
    # would be traced there.
    if known is not None:
        with np.errstate(over="ignore", under="ignore"):
            values = known.astype(np.dtype(compute)).astype(np.float64)
        if not ((values > 0) & np.isfinite(values)).all():
            raise ValueError(
                f"`temperatures` must be positive and finite in {compute.name}, "
                f"got {values.tolist()}: fit them with "
                f"`uncertainty.fit_member_temperatures`."
            )
    return _scale_member_temperatures(logits, temperatures.astype(compute))


@jax.jit
def _scale_temperature(logits, temperature):
    logits, invalid = _split_invalid(logits)
    log_probs = _predictive_log_probs(_member_log_probs(logits))
    bad = ~(jnp.isfinite(temperature) & (temperature > 0))
    temperature = jnp.where(bad, 1.0, temperature).astype(log_probs.dtype)
    # A class every member rules out stays -inf, kept out of the division so
    # that d(-inf / T)/dT does not turn the temperature's gradient into NaN.
    possible = log_probs > -jnp.inf
    scaled = jnp.where(
        possible, jnp.where(possible, log_probs, 0.0) / temperature, -jnp.inf
    )
    scaled = jax.nn.log_softmax(scaled, axis=-1)
    return _poison(jnp.where(bad, jnp.nan, scaled), invalid)[None]


def scale_temperature(logits: jax.Array, temperature: float | jax.Array) -> jax.Array:
    """The pooled predictive at ``temperature``, as one member's logits ``[1, B, C]``.

    ``log_softmax(log p / T)`` with ``p`` the mean of the member softmaxes:
    every metric of :mod:`ensembles.uncertainty` takes the result as a
    one-member ensemble (its :func:`nll`, :func:`ece` ... are those of the
    calibrated predictive). The members' disagreement is gone from it: score
    out-of-distribution inputs with :func:`mutual_information` of the original
    logits.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1]], [[0.5, 0.5]]]))  # predictive .7/.3
    >>> def probs(temperature):
    ...     scaled = uncertainty.scale_temperature(logits, temperature)  # [1, B, C]
    ...     return [round(p, 3) for p in jnp.exp(scaled)[0, 0].tolist()]
    >>> probs(1.0)
    [0.7, 0.3]
    >>> probs(0.5)  # 0.7 ** 2 : 0.3 ** 2
    [0.845, 0.155]

    Args:
      logits: member logits of shape ``[E, B, C]``.
      temperature: a positive scalar, e.g. from :func:`fit_temperature`.

    Returns:
      Log-probabilities ``[1, B, C]`` in the logits' compute dtype (at least
      float32; the temperature is cast to it); NaN rows for examples with
      invalid logits, and all NaN for a temperature that is not positive and
      finite under :func:`jax.jit`. Differentiable in the temperature and the
      logits.

    Raises:
      ValueError: if ``logits`` is not ``[E, B, C]``, or ``temperature`` is
        not a scalar, or (when not traced) not positive and finite in the
        compute dtype.
      TypeError: if ``logits`` is not floating-point or ``temperature`` not a
        real number.
    """
    logits = _check_logits(logits)
    temperature = check_array(temperature, "temperature", what="a positive number")
    if jnp.shape(temperature) != ():
        raise ValueError(
            f"`temperature` must be a scalar, got shape {jnp.shape(temperature)}: "
            "pass the one number `fit_temperature` returns."
        )
    dtype = jnp.result_type(temperature)
    if dtype == jnp.bool_ or not (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    ):
        raise TypeError(
            f"`temperature` must be a real number, got {temperature!r} of dtype "
            f"{dtype}."
        )
    compute = jnp.promote_types(logits.dtype, jnp.float32)
    known = known_values(temperature)  # None: traced, NaN if bad (see Returns)
    if known is not None:
        with np.errstate(over="ignore", under="ignore"):
            held = float(known.astype(np.dtype(compute)))
        if not 0 < held < math.inf:
            largest = float(jnp.finfo(compute).max)
            raise ValueError(
                f"`temperature` must be positive and finite in {compute.name} "
                f"(at most {largest:.4g}), got {float(known.astype(np.float64))}: "
                "fit it with `uncertainty.fit_temperature(logits, labels)` on "
                "held-out examples."
            )
    return _scale_temperature(logits, jnp.asarray(temperature).astype(compute))
