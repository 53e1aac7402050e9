"""Initializers for the fast weights ``r`` and ``s`` (and their posterior scales).

Each function returns a JAX initializer ``(key, shape, dtype) -> Array`` like
those in ``jax.nn.initializers``, so it can be passed as ``r_init`` / ``s_init``
(or, for rank-1 posteriors, ``stddev_init``) or used anywhere Flax takes an
initializer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.nn.initializers import Initializer

from ensembles._checks import check_real

__all__ = ["Initializer", "normal", "ones", "random_sign", "unconstrained_stddev"]


def ones() -> Initializer:
    """Fast weights of all ones: every member starts as the shared layer.

    Converting a pretrained layer with ``ones()`` fast weights keeps its output
    unchanged for every member.

    >>> import jax
    >>> from ensembles import initializers
    >>> initializers.ones()(jax.random.key(0), (2, 3))
    Array([[1., 1., 1.],
           [1., 1., 1.]], dtype=float32)

    Returns:
      An initializer ``(key, shape, dtype=float32) -> Array``.
    """

    def init(
        key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32
    ) -> jax.Array:
        del key
        return jnp.ones(shape, dtype)

    return init


def normal(mean: float = 1.0, stddev: float = 0.5) -> Initializer:
    """Fast weights drawn from ``N(mean, stddev**2)``; the default ``N(1, 0.5**2)``.

    That default is every BatchEnsemble layer's (with
    :func:`random_sign` for the input layer's ``r`` when a model is converted
    by :func:`ensembles.to_batch_ensemble`). A wider draw makes the members
    differ more everywhere, in distribution too: the ensemble comes out
    underconfident, and once each method is recalibrated that buys nothing
    under shift. N(1, 0.5) with random signs at the input had the best mean
    rank of the recalibrated NLL in distribution and under shift across three
    tasks (MNIST-1D, scikit-learn's digits, a tabular task), chosen leaving
    each task out in turn (``docs/training.md`` has the tables); it is
    uncertainty-baselines' too. From a pretrained model, fine-tuning uses
    0.3 (``docs/converting.md``).

    >>> import jax
    >>> from ensembles import initializers
    >>> w = initializers.normal(1.0, 0.5)(jax.random.key(0), (4, 1000))
    >>> bool(abs(w.mean() - 1.0) < 0.05), bool(abs(w.std() - 0.5) < 0.05)
    (True, True)

    Args:
      mean: the mean of the distribution.
      stddev: its standard deviation, >= 0.

    Returns:
      An initializer ``(key, shape, dtype=float32) -> Array``.

    Raises:
      ValueError: if ``stddev`` is negative.
      TypeError: if ``mean`` or ``stddev`` is not a real number.
    """
    mean = check_real(mean, "mean")
    stddev = check_real(stddev, "stddev")
    if not stddev >= 0:
        raise ValueError(f"`stddev` must be >= 0, got {stddev!r}.")

    def init(
        key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32
    ) -> jax.Array:
        return mean + stddev * jax.random.normal(key, shape, dtype)

    return init


def random_sign(p: float = 0.5) -> Initializer:
    """Fast weights of ``+1`` with probability ``p`` and ``-1`` otherwise.

    >>> import jax
    >>> from ensembles import initializers
    >>> w = initializers.random_sign(0.5)(jax.random.key(0), (8,))
    >>> sorted(set(w.tolist())) == [-1.0, 1.0]
    True

    Args:
      p: probability of ``+1``, in ``[0, 1]``.

    Returns:
      An initializer ``(key, shape, dtype=float32) -> Array``.

    Raises:
      ValueError: if ``p`` is outside ``[0, 1]``.
      TypeError: if ``p`` is not a real number.
    """
    p = check_real(p, "p")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"`p` must be a probability in [0, 1], got {p!r}.")

    def init(
        key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32
    ) -> jax.Array:
        positive = jax.random.bernoulli(key, p, shape)
        return jnp.where(positive, 1, -1).astype(dtype)

    return init


#: The posterior stddev every rank-1 layer starts from, 0.1: chosen across
#: tasks with the prior 0.5 (benchmarks/quality_defaults.py, docs/rank1.md),
#: where leaving any task out chose it over uncertainty-baselines'
#: ``sqrt(p / (1 - p))`` for its ``dropout_rate`` p = 1e-3 (about 0.0316).
DEFAULT_POSTERIOR_STDDEV = 0.1


def unconstrained_stddev(
    stddev: float = DEFAULT_POSTERIOR_STDDEV, jitter: float = 0.1
) -> Initializer:
    """Unconstrained scales whose ``softplus`` is about ``stddev``.

    A rank-1 layer (``posterior="gaussian"`` or ``"cauchy"``) holds its
    posterior scales as ``r_unconstrained_stddev`` / ``s_unconstrained_stddev``,
    the scale being their softplus. This initializer draws them as
    ``softplus^-1(stddev)`` plus normal noise of stddev ``jitter`` truncated at
    two stddevs, as uncertainty-baselines' rank-1 recipe does (its default
    ``stddev`` is about 0.0316, ours 0.1, chosen across tasks; ``jitter`` 0.1).

    >>> import jax
    >>> from ensembles import initializers
    >>> raw = initializers.unconstrained_stddev(0.05, jitter=0.0)(
    ...     jax.random.key(0), (2, 3))
    >>> jax.nn.softplus(raw).round(4)
    Array([[0.05, 0.05, 0.05],
           [0.05, 0.05, 0.05]], dtype=float32)

    Args:
      stddev: the posterior stddev (scale) to start from, > 0.
      jitter: the stddev of the noise added to the unconstrained value, >= 0.

    Returns:
      An initializer ``(key, shape, dtype=float32) -> Array``.

    Raises:
      ValueError: if ``stddev`` is not positive or ``jitter`` is negative.
      TypeError: if ``stddev`` or ``jitter`` is not a real number.
    """
    stddev = check_real(stddev, "stddev")
    jitter = check_real(jitter, "jitter")
    if not stddev > 0:
        raise ValueError(f"`stddev` must be > 0 (a posterior scale), got {stddev!r}.")
    if not jitter >= 0:
        raise ValueError(f"`jitter` must be >= 0, got {jitter!r}.")
    # softplus^-1(x) = log(expm1(x)); past 20, softplus is the identity in float.
    center = math.log(math.expm1(stddev)) if stddev < 20 else float(stddev)

    def init(
        key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32
    ) -> jax.Array:
        noise = jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype)
        return (center + jitter * noise).astype(dtype)

    return init
