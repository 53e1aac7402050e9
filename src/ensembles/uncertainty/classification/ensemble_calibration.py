"""Calibrating an ensemble for both worlds: in distribution and under shift.

One temperature fitted on clean held-out data sharpens an underconfident
ensemble where it is right and carries that sharpness into a shift where it
is not (Ovadia et al., 2019); one fitted on perturbed data does the reverse.
Two ways past one temperature, each fitted on held-out data and applied to
the members' logits ``[E, B, C]`` like the rest of :mod:`ensembles.uncertainty`:

* **Ensemble temperature scaling** (Mix-n-Match, Zhang et al., ICML 2020):
  the pooled predictive ``p`` at one temperature, mixed with ``p`` itself
  and the uniform distribution, ``w1 softmax(log p / T) + w2 p + w3 / C``,
  ``w`` on the simplex. The temperature is fitted first
  (:func:`~ensembles.uncertainty.fit_temperature`), then the weights by the
  NLL; the uncalibrated and uniform parts keep probability where the
  sharpened predictive would leave none (:func:`fit_ensemble_temperature`,
  :func:`scale_ensemble_temperature`).
* **An adaptive temperature** (after the Adaptive Calibrator Ensemble of
  Zou et al., ICCV 2023): one temperature fitted on clean held-out
  examples, one on hard ones (noisy copies of them,
  :func:`~ensembles.uncertainty.noisy_copies`, or any held-out shifted set),
  blended per example by how hard it looks: the entropy of its pooled
  predictive placed between the two sets' median entropies. An example as
  sure as the clean set gets the clean temperature, one as unsure as the
  hard set the hard one, in between the geometric interpolation
  (:func:`fit_adaptive_temperature`, :func:`scale_adaptive_temperature`).

Both are fits, not differentiable functions of the logits (their gradients
are zero), both run under :func:`jax.jit`, and both follow the package's NaN
contract: invalid logits in the fit give NaN parameters, invalid examples in
the scaling NaN rows.

>>> import jax.numpy as jnp
>>> from ensembles import uncertainty
>>> logits = jnp.log(jnp.array([[[0.9, 0.1]] * 4, [[0.2, 0.8]] * 4]))
>>> params = uncertainty.fit_ensemble_temperature(logits, jnp.array([0, 0, 0, 1]))
>>> params.shape
(4,)
>>> uncertainty.scale_ensemble_temperature(logits, params).shape
(1, 4, 2)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import check_array, known_values
from ensembles.uncertainty._common import poison_all
from ensembles.uncertainty._minimize import minimize
from ensembles.uncertainty.classification._common import (
    _check_labels,
    _check_logits,
    _entropy,
    _member_log_probs,
    _poison,
    _predictive_log_probs,
    _split_invalid,
    _split_invalid_labeled,
)
from ensembles.uncertainty.classification.calibration import (
    _fit_options,
    _fit_temperature,
)


def _pooled(logits):
    """``[B, C]`` log-probabilities of the pooled predictive (valid rows)."""
    return _predictive_log_probs(_member_log_probs(logits))


def _tempered(log_probs, temperature):
    """``log_softmax(log p / T)``, classes ruled out kept at ``-inf``."""
    possible = log_probs > -jnp.inf
    scaled = jnp.where(
        possible, jnp.where(possible, log_probs, 0.0) / temperature, -jnp.inf
    )
    return jax.nn.log_softmax(scaled, axis=-1)


def _mixed(log_probs, temperature, weights):
    """``log(w1 softmax(log p / T) + w2 p + w3 / C)``, ``[B, C]``."""
    num_classes = log_probs.shape[-1]
    parts = jnp.stack(
        [
            _tempered(log_probs, temperature),
            log_probs,
            jnp.full_like(log_probs, -jnp.log(num_classes)),
        ]
    )  # [3, B, C]
    log_weights = jnp.log(weights)[:, None, None]
    return jax.nn.logsumexp(parts + log_weights, axis=0)


@functools.partial(jax.jit, static_argnames=("iterations",))
def _fit_ensemble_temperature(logits, labels, log_b_low, log_b_high, iterations):
    temperature = _fit_temperature(logits, labels, log_b_low, log_b_high, iterations)
    logits, labels, invalid = _split_invalid_labeled(logits, labels)
    log_probs = _pooled(logits)
    # The weights' softmax parameters: all three parts start alike.
    safe_temperature = jnp.where(jnp.isfinite(temperature), temperature, 1.0)

    def objective(free):
        weights = jax.nn.softmax(free)
        mixed = _mixed(log_probs, safe_temperature, weights)
        picked = jnp.take_along_axis(mixed, labels[:, None], axis=-1)[:, 0]
        return -jnp.mean(picked)

    free = minimize(objective, jnp.zeros(3, log_probs.dtype), 100)
    weights = jax.nn.softmax(free)
    params = jnp.concatenate([temperature[None].astype(weights.dtype), weights])
    return poison_all(jnp.where(jnp.isfinite(temperature), params, jnp.nan), invalid)


def fit_ensemble_temperature(
    logits: jax.Array,
    labels: jax.Array,
    *,
    bounds: tuple[float, float] = (0.05, 20.0),
    iterations: int = 40,
) -> jax.Array:
    """Ensemble temperature scaling's parameters ``[T, w1, w2, w3]``, fitted.

    Zhang et al.'s Mix-n-Match ensemble temperature scaling of the pooled
    predictive ``p``: ``w1 softmax(log p / T) + w2 p + w3 / C``. ``T`` is
    :func:`~ensembles.uncertainty.fit_temperature`'s; the weights, on the
    simplex, minimise the NLL of the mixture on the same examples. Fit them
    on held-out examples, apply with :func:`scale_ensemble_temperature`.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1]] * 4, [[0.2, 0.8]] * 4]))
    >>> params = uncertainty.fit_ensemble_temperature(logits, jnp.array([0, 0, 0, 1]))
    >>> round(float(params[0]), 3), round(float(params[1:].sum()), 3)
    (0.183, 1.0)

    Args:
      logits: member logits ``[E, B, C]``.
      labels: integer class indices ``[B]``.
      bounds: the temperature's range, as for ``fit_temperature``.
      iterations: the temperature's bisection steps; static under ``jit``.

    Returns:
      ``[4]``: the temperature, then the three weights (summing to 1); all
      NaN if any example has invalid logits or a label every member rules
      out.

    Raises:
      ValueError: if the shapes do not match ``[E, B, C]`` and ``[B]``, a
        label is out of range (when not traced) or ``bounds`` are invalid.
      TypeError: if ``logits`` is not floating-point or ``labels`` not integer.
    """
    logits = _check_logits(logits)
    labels = _check_labels(labels, logits)
    log_b_low, log_b_high, iterations = _fit_options(bounds, iterations)
    return _fit_ensemble_temperature(logits, labels, log_b_low, log_b_high, iterations)


def _check_params(params, size: int, name: str, fix: str) -> jax.Array:
    """A fitted parameter vector ``[size]``, checked where its values are known."""
    params = check_array(params, "params", what="a fitted parameter vector")
    known = known_values(params)
    params = jnp.asarray(params)
    if tuple(params.shape) != (size,) or not jnp.issubdtype(params.dtype, jnp.floating):
        raise ValueError(
            f"`params` must be the [{size}] floats of `{name}`, got shape "
            f"{tuple(params.shape)} of dtype {params.dtype}: {fix}"
        )
    if known is not None and not np.isfinite(known.astype(np.float64)).all():
        raise ValueError(f"`params` must be finite, got {known.tolist()}: {fix}")
    return params


@jax.jit
def _scale_ensemble_temperature(logits, params):
    logits, invalid = _split_invalid(logits)
    log_probs = _pooled(logits)
    temperature = params[0].astype(log_probs.dtype)
    weights = params[1:].astype(log_probs.dtype)
    bad = ~(
        jnp.all(jnp.isfinite(params))
        & (temperature > 0)
        & jnp.all(weights >= 0)
        & (jnp.abs(weights.sum() - 1) < 1e-3)
    )
    mixed = _mixed(log_probs, jnp.where(bad, 1.0, temperature), weights)
    return _poison(jnp.where(bad, jnp.nan, mixed), invalid)[None]


def scale_ensemble_temperature(logits: jax.Array, params: jax.Array) -> jax.Array:
    """The pooled predictive under ensemble temperature scaling, ``[1, B, C]``.

    ``log(w1 softmax(log p / T) + w2 p + w3 / C)`` with ``params = [T, w1,
    w2, w3]`` from :func:`fit_ensemble_temperature`, as one member's
    log-probabilities (every metric of :mod:`ensembles.uncertainty` takes it).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.7, 0.3]]]))
    >>> out = uncertainty.scale_ensemble_temperature(
    ...     logits, jnp.array([1.0, 0.5, 0.0, 0.5]))
    >>> [round(p, 3) for p in jnp.exp(out)[0, 0].tolist()]
    [0.6, 0.4]

    Args:
      logits: member logits ``[E, B, C]``.
      params: ``[4]`` from :func:`fit_ensemble_temperature`.

    Returns:
      ``[1, B, C]`` log-probabilities; NaN rows for invalid examples, all NaN
      for parameters that are not a positive temperature and simplex weights
      (under :func:`jax.jit`, where they cannot be checked).

    Raises:
      ValueError: if ``params`` is not ``[4]`` floats or (when known) not
        finite, not a positive temperature or not weights summing to 1.
      TypeError: if ``logits`` is not floating-point.
    """
    logits = _check_logits(logits)
    fix = "fit them with `uncertainty.fit_ensemble_temperature`."
    params = _check_params(params, 4, "fit_ensemble_temperature", fix)
    known = known_values(params)
    if known is not None:
        values = known.astype(np.float64)
        if not (
            values[0] > 0
            and (values[1:] >= 0).all()
            and abs(values[1:].sum() - 1) < 1e-3
        ):
            raise ValueError(
                f"`params` must be a positive temperature and three weights "
                f"summing to 1, got {values.tolist()}: {fix}"
            )
    return _scale_ensemble_temperature(logits, params)


def _median(values, valid):
    """The median of ``values`` where ``valid`` (NaN elsewhere ignored)."""
    return jnp.nanmedian(jnp.where(valid, values, jnp.nan))


@functools.partial(jax.jit, static_argnames=("iterations",))
def _fit_adaptive(
    clean_logits, clean_labels, hard_logits, hard_labels, low, high, iterations
):
    clean = _fit_temperature(clean_logits, clean_labels, low, high, iterations)
    hard = _fit_temperature(hard_logits, hard_labels, low, high, iterations)
    difficulties = []
    for logits, labels in ((clean_logits, clean_labels), (hard_logits, hard_labels)):
        logits, _, invalid = _split_invalid_labeled(logits, labels)
        entropy = _entropy(_pooled(logits))
        difficulties.append(poison_all(_median(entropy, ~invalid), invalid))
    params = jnp.stack([clean, hard, *difficulties])
    return jnp.where(jnp.all(jnp.isfinite(params)), params, jnp.nan)


def fit_adaptive_temperature(
    clean_logits: jax.Array,
    clean_labels: jax.Array,
    hard_logits: jax.Array,
    hard_labels: jax.Array,
    *,
    bounds: tuple[float, float] = (0.05, 20.0),
    iterations: int = 40,
) -> jax.Array:
    """An adaptive temperature's parameters ``[T_clean, T_hard, H_clean, H_hard]``.

    Two temperatures of the pooled predictive
    (:func:`~ensembles.uncertainty.fit_temperature`), one fitted on clean
    held-out examples, one on hard ones (noisy copies of them, or a
    held-out shifted set), and the median entropy of the pooled predictive
    on each set, which :func:`scale_adaptive_temperature` places each new
    example between.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> # Sure examples right 3 times in 4 (soften: T = 2), unsure ones too
    >>> # (sharpen: T = 0.369).
    >>> sure = jnp.log(jnp.array([[[0.9, 0.1]] * 4]))
    >>> unsure = jnp.log(jnp.array([[[0.6, 0.4]] * 4]))
    >>> labels = jnp.array([0, 0, 0, 1])
    >>> params = uncertainty.fit_adaptive_temperature(sure, labels, unsure, labels)
    >>> [round(v, 3) for v in params.tolist()]
    [2.0, 0.369, 0.325, 0.673]

    Args:
      clean_logits: member logits ``[E, B, C]`` of clean held-out examples.
      clean_labels: their labels ``[B]``.
      hard_logits: member logits ``[E, B', C]`` of hard held-out examples.
      hard_labels: their labels ``[B']``.
      bounds: the temperatures' range, as for ``fit_temperature``.
      iterations: the bisection steps; static under ``jit``.

    Returns:
      ``[4]``: the two temperatures and the two median entropies; all NaN if
      either set has invalid logits or a label every member rules out.

    Raises:
      ValueError: if a shape does not fit (the class counts must match), a
        label is out of range or ``bounds`` are invalid.
      TypeError: if logits are not floating-point or labels not integer.
    """
    clean_logits = _check_logits(clean_logits)
    clean_labels = _check_labels(clean_labels, clean_logits)
    hard_logits = _check_logits(hard_logits)
    hard_labels = _check_labels(hard_labels, hard_logits)
    if hard_logits.shape[-1] != clean_logits.shape[-1]:
        raise ValueError(
            f"`hard_logits` must have the classes of `clean_logits` "
            f"({clean_logits.shape[-1]}), got shape {tuple(hard_logits.shape)}."
        )
    low, high, iterations = _fit_options(bounds, iterations)
    return _fit_adaptive(
        clean_logits, clean_labels, hard_logits, hard_labels, low, high, iterations
    )


@jax.jit
def _scale_adaptive(logits, params):
    logits, invalid = _split_invalid(logits)
    log_probs = _pooled(logits)
    params = params.astype(log_probs.dtype)
    clean, hard, easy_entropy, hard_entropy = params
    bad = ~(jnp.all(jnp.isfinite(params)) & (clean > 0) & (hard > 0))
    spread = hard_entropy - easy_entropy
    # Where the hard set is no harder than the clean one, the clean
    # temperature throughout (the sets cannot tell examples apart).
    blend = jnp.where(
        spread > 0,
        jnp.clip(
            (_entropy(log_probs) - easy_entropy) / jnp.where(spread > 0, spread, 1),
            0,
            1,
        ),
        0.0,
    )
    temperature = jnp.exp(
        (1 - blend) * jnp.log(jnp.where(bad, 1.0, clean))
        + blend * jnp.log(jnp.where(bad, 1.0, hard))
    )
    scaled = _tempered(log_probs, temperature[:, None])
    return _poison(jnp.where(bad, jnp.nan, scaled), invalid)[None]


def scale_adaptive_temperature(logits: jax.Array, params: jax.Array) -> jax.Array:
    """The pooled predictive at each example's own temperature, ``[1, B, C]``.

    With ``params = [T_clean, T_hard, H_clean, H_hard]`` from
    :func:`fit_adaptive_temperature`: an example whose pooled predictive has
    entropy ``H`` gets ``T = T_clean^(1 - b) T_hard^b`` with ``b = clip((H -
    H_clean) / (H_hard - H_clean), 0, 1)`` (``b = 0`` where the hard set is
    no more uncertain than the clean one), then ``softmax(log p / T)``.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.9, 0.1], [0.6, 0.4]]]))  # sure, unsure
    >>> out = uncertainty.scale_adaptive_temperature(
    ...     logits, jnp.array([2.0, 0.369, 0.325, 0.673]))
    >>> [round(p, 3) for p in jnp.exp(out)[0, :, 0].tolist()]
    [0.75, 0.75]

    Args:
      logits: member logits ``[E, B, C]``.
      params: ``[4]`` from :func:`fit_adaptive_temperature`.

    Returns:
      ``[1, B, C]`` log-probabilities; NaN rows for invalid examples, all NaN
      for temperatures that are not positive (under :func:`jax.jit`).

    Raises:
      ValueError: if ``params`` is not ``[4]`` floats or (when known) not
        finite or its temperatures not positive.
      TypeError: if ``logits`` is not floating-point.
    """
    logits = _check_logits(logits)
    fix = "fit them with `uncertainty.fit_adaptive_temperature`."
    params = _check_params(params, 4, "fit_adaptive_temperature", fix)
    known = known_values(params)
    if known is not None and not (known.astype(np.float64)[:2] > 0).all():
        raise ValueError(
            f"`params` must start with two positive temperatures, got "
            f"{known.tolist()}: {fix}"
        )
    return _scale_adaptive(logits, params)
