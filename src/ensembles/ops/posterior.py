"""The math of rank-1 Bayesian fast weights: drawing them and their KL to a prior.

Rank-1 BNNs (Dusenberry et al., ICML 2020) keep BatchEnsemble's
parameterisation but treat each fast weight as a distribution: a Gaussian
``N(mean, stddev**2)`` or a Cauchy with location ``mean`` and scale
``stddev``, with ``stddev = softplus(unconstrained_stddev)`` (positive and
smooth, as edward2's ``TrainableNormal``). A draw is a reparameterisation,
``mean + stddev * noise`` with standard normal or standard Cauchy noise, so
gradients reach the mean and the stddev. The prior of every fast weight is the
same family centred on 1 (a member that equals the shared layer).

These functions are plain ``jnp`` and know nothing of ``nnx``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["POSTERIORS", "fast_weight_kl", "posterior_stddev", "sample_fast_weights"]

#: The posterior families a layer's ``posterior`` may name.
POSTERIORS = ("gaussian", "cauchy")


def posterior_stddev(unconstrained_stddev: jax.Array) -> jax.Array:
    """The positive scale ``softplus(unconstrained_stddev)``.

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import posterior
    >>> posterior.posterior_stddev(jnp.array([-3.0, 0.0]))
    Array([0.04858735, 0.6931472 ], dtype=float32)
    """
    return jax.nn.softplus(unconstrained_stddev)


def sample_fast_weights(
    key: jax.Array,
    mean: jax.Array,
    unconstrained_stddev: jax.Array,
    *,
    posterior: str,
) -> jax.Array:
    """One reparameterised draw of fast weights of ``mean``'s shape and dtype.

    ``mean + softplus(unconstrained_stddev) * noise``, the noise standard
    normal (``"gaussian"``) or standard Cauchy (``"cauchy"``), drawn in the
    dtype of ``mean``.

    >>> import jax, jax.numpy as jnp
    >>> from ensembles.ops import posterior
    >>> draws = posterior.sample_fast_weights(
    ...     jax.random.key(0), jnp.ones((4, 10000)), jnp.full((4, 10000), -2.0),
    ...     posterior="gaussian")
    >>> bool(abs(draws.std() - jax.nn.softplus(-2.0)) < 0.01)
    True

    Args:
      key: a PRNG key.
      mean: the ``[E, ...]`` means (the layer's ``r`` or ``s``).
      unconstrained_stddev: an array of ``mean``'s shape.
      posterior: ``"gaussian"`` or ``"cauchy"``.

    Returns:
      The draw, of ``mean``'s shape and dtype.
    """
    if posterior == "gaussian":
        noise = jax.random.normal(key, mean.shape, mean.dtype)
    elif posterior == "cauchy":
        noise = jax.random.cauchy(key, mean.shape, mean.dtype)
    else:
        raise ValueError(f"`posterior` must be one of {POSTERIORS}, got {posterior!r}.")
    stddev = posterior_stddev(unconstrained_stddev).astype(mean.dtype)
    return mean + stddev * noise


def fast_weight_kl(
    mean: jax.Array,
    unconstrained_stddev: jax.Array,
    *,
    posterior: str,
    prior_stddev: float,
    prior_mean: float = 1.0,
) -> jax.Array:
    """The summed KL divergence of every fast weight's posterior to its prior.

    Both are of the family ``posterior`` names; the prior is centred on
    ``prior_mean`` with scale ``prior_stddev``. Both are exact closed forms:
    for Gaussians ``log(p/q) + (q**2 + (m - m0)**2) / (2 p**2) - 1/2``; for
    Cauchys ``log(((q + p)**2 + (m - m0)**2) / (4 q p))`` (Chyzak & Nielsen,
    2019), where edward2 uses a one-draw Monte-Carlo estimate. Computed in at
    least float32.

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import posterior
    >>> raw = jnp.log(jnp.expm1(0.1))         # softplus(raw) == 0.1
    >>> kl = posterior.fast_weight_kl(jnp.ones(3), jnp.full(3, raw),
    ...                               posterior="gaussian", prior_stddev=0.1)
    >>> float(kl) < 1e-5                      # posterior == prior
    True

    Args:
      mean: the fast weights' means.
      unconstrained_stddev: their unconstrained scales, of ``mean``'s shape.
      posterior: ``"gaussian"`` or ``"cauchy"``.
      prior_stddev: the prior's scale, > 0.
      prior_mean: the prior's location (default: 1).

    Returns:
      A scalar: the sum over every entry.
    """
    dtype = jnp.promote_types(mean.dtype, jnp.float32)
    mean = mean.astype(dtype)
    scale = posterior_stddev(unconstrained_stddev.astype(dtype))
    prior = jnp.asarray(prior_stddev, dtype)
    squared_offset = jnp.square(mean - prior_mean)
    if posterior == "gaussian":
        kl = (
            jnp.log(prior)
            - jnp.log(scale)
            + (jnp.square(scale) + squared_offset) / (2 * jnp.square(prior))
            - 0.5
        )
    elif posterior == "cauchy":
        kl = jnp.log(jnp.square(scale + prior) + squared_offset) - jnp.log(
            4 * scale * prior
        )
    else:
        raise ValueError(f"`posterior` must be one of {POSTERIORS}, got {posterior!r}.")
    return jnp.sum(kl)
