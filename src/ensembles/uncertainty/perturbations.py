"""Held-out data for a calibration that should survive a shift: noisy copies.

A temperature (or a scale of the spread) fitted on clean held-out examples
fits them; under a shift the same model is less sure than it should be told,
and a temperature below 1 sharpens an ensemble exactly where it was right to
hesitate (Ovadia et al., 2019). Fitting it on the held-out examples together
with copies perturbed at several strengths keeps it honest under moderate
drift (Tomani et al., CVPR 2021). :func:`noisy_copies` makes such a set from
the held-out examples and a noise scale taken from the training data alone,
never from the shifts a model will be tested on; ``docs/training.md`` measures
what it buys.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import as_array, check_array, check_real, known_values


def noisy_copies(
    inputs: Any,
    targets: Any,
    *,
    feature_std: Any,
    strengths: Sequence[float] | float = (0.05, 0.1, 0.2),
    key: jax.Array,
) -> tuple[jax.Array, jax.Array | np.ndarray]:
    """The examples and copies of them with Gaussian noise, and their targets.

    Copy ``i`` adds noise of standard deviation ``strengths[i] *
    feature_std`` to every input; the targets (labels, or regression
    targets) are the originals'. Fit the temperature or scale on the result
    (:func:`fit_temperature`, :func:`fit_std_scale`, or the per-member fits)
    instead of on the clean held-out examples alone.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> x_valid, y_valid = jnp.zeros((3, 2)), jnp.array([0, 1, 0])
    >>> x_train = jnp.array([[0.0, 10.0], [2.0, -10.0]])
    >>> x, y = uncertainty.noisy_copies(
    ...     x_valid, y_valid, feature_std=x_train.std(axis=0),
    ...     strengths=(0.1, 0.2), key=jax.random.key(0))
    >>> x.shape, y.tolist()  # the originals, then one copy per strength
    ((9, 2), [0, 1, 0, 0, 1, 0, 0, 1, 0])
    >>> bool(jnp.all(x[:3] == 0))
    True

    Args:
      inputs: ``[N, ...]`` held-out examples (never test examples).
      targets: their ``[N, ...]`` labels or targets.
      feature_std: the training inputs' standard deviation, a scalar or an
        array broadcasting against one example (``x_train.std(axis=0)``).
      strengths: the noise of each copy, in units of ``feature_std``; every
        one positive and finite (one number: one copy).
      key: a JAX random key.

    Returns:
      ``(inputs, targets)`` with ``(len(strengths) + 1) * N`` rows: the
      originals first, then each copy, in float32 (or the inputs' float
      dtype). The targets are repeated as they came, never converted: a
      numpy array (or list) gives a numpy array of its own dtype (int64
      targets beyond ``2**31`` stay whole without ``jax_enable_x64``), a
      ``jax.Array`` a ``jax.Array``.

    Raises:
      ValueError: if ``targets`` has another number of rows, ``feature_std``
        does not broadcast against one example or is negative or not
        finite, or a strength is not positive and finite.
      TypeError: if an argument is not an array of numbers.
    """
    inputs = as_array(inputs, "inputs")
    targets = check_array(targets, "targets")
    if not isinstance(targets, jax.Array) and not hasattr(targets, "__jax_array__"):
        # Host targets stay on the host: jnp.asarray would wrap 64-bit integers
        # to 32 bits without jax_enable_x64 (3e9 becomes -1294967296).
        targets = np.asarray(targets)
        concatenate = np.concatenate
    else:
        targets = jnp.asarray(targets)
        concatenate = jnp.concatenate
    if inputs.ndim < 1 or targets.ndim < 1 or inputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"`inputs` and `targets` must have the same number of rows, got "
            f"shapes {tuple(inputs.shape)} and {tuple(targets.shape)}."
        )
    scale = as_array(feature_std, "feature_std")
    try:
        np.broadcast_shapes(tuple(scale.shape), tuple(inputs.shape[1:]))
    except ValueError:
        raise ValueError(
            f"`feature_std` of shape {tuple(scale.shape)} must broadcast against "
            f"one example of shape {tuple(inputs.shape[1:])}: pass "
            f"`x_train.std(axis=0)` or a scalar."
        ) from None
    known = known_values(scale)  # None under jax.jit: not checked
    if (
        known is not None
        and not (
            np.isfinite(known.astype(np.float64)) & (known.astype(np.float64) >= 0)
        ).all()
    ):
        raise ValueError(
            "`feature_std` must be finite and non-negative: the training inputs' "
            "standard deviation (`x_train.std(axis=0)`)."
        )
    values = _check_strengths(strengths)
    dtype = jnp.promote_types(inputs.dtype, jnp.float32)
    inputs = inputs.astype(dtype)
    keys = jax.random.split(key, len(values))
    # Broadcast explicitly: one example's scale against every row.
    noise_scale = jnp.broadcast_to(scale.astype(dtype), inputs.shape)
    copies = [inputs] + [
        inputs + strength * noise_scale * jax.random.normal(k, inputs.shape, dtype)
        for strength, k in zip(values, keys, strict=True)
    ]
    return jnp.concatenate(copies), concatenate([targets] * len(copies))


def _check_strengths(strengths: Any) -> list[float]:
    """``strengths`` as a list of positive finite floats (one number: one copy)."""
    fix = "e.g. strengths=(0.05, 0.1, 0.2), or strengths=0.1 for one copy"
    if isinstance(strengths, str | bytes) or strengths is None:
        raise TypeError(
            f"`strengths` must be one or more noise levels, got {strengths!r}: {fix}."
        )
    if np.ndim(strengths) == 0:
        strengths = [strengths]
    values = [check_real(s, "strengths") for s in strengths]
    if not values or not all(0 < v < math.inf for v in values):
        raise ValueError(
            f"`strengths` must be one or more positive, finite noise levels, got "
            f"{list(strengths)!r}: {fix}."
        )
    return values
