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

__all__ = [
    "POSTERIORS",
    "fast_weight_kl",
    "log_posterior_stddev",
    "posterior_stddev",
    "sample_fast_weights",
]

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
    normal (``"gaussian"``) or standard Cauchy (``"cauchy"``), drawn and
    combined in at least float32 and cast to ``mean``'s dtype, so bf16 fast
    weights keep the tails of their distribution.

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
    # Drawn in at least float32, then cast: bf16 noise has 128 distinct
    # magnitudes per octave and no Gaussian draw beyond |z| = 2.9 in practice.
    dtype = jnp.promote_types(mean.dtype, jnp.float32)
    if posterior == "gaussian":
        noise = jax.random.normal(key, mean.shape, dtype)
    elif posterior == "cauchy":
        noise = jax.random.cauchy(key, mean.shape, dtype)
    else:
        raise ValueError(f"`posterior` must be one of {POSTERIORS}, got {posterior!r}.")
    stddev = posterior_stddev(unconstrained_stddev.astype(dtype))
    return (mean.astype(dtype) + stddev * noise).astype(mean.dtype)


def log_posterior_stddev(unconstrained_stddev: jax.Array) -> jax.Array:
    """``log(softplus(u))``, finite and accurate where ``softplus(u)`` underflows.

    Below ``u = -20``, ``softplus(u) = t - t**2/2 + ...`` with ``t = exp(u) <
    2.1e-9``, so ``log(softplus(u)) = u - t/2`` to within ``t**2/5``, far below
    float64's resolution of values of that size; its gradient ``1 - t/2`` stays
    finite where ``softplus(u)`` itself becomes 0 (``u < -104`` in float32),
    which would make ``log`` give ``-inf`` and its gradient NaN.

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import posterior
    >>> posterior.log_posterior_stddev(jnp.array([-1000.0, 0.0]))
    Array([-1.0000000e+03, -3.6651292e-01], dtype=float32)
    """
    u = unconstrained_stddev
    tail = u < -20.0
    # Each branch sees a stand-in where it is not used, so neither its value
    # nor its gradient is ever inf (where, not min/max: those split the
    # gradient at a tie).
    small = u - 0.5 * jnp.exp(jnp.where(tail, u, -20.0))
    direct = jnp.log(jax.nn.softplus(jnp.where(tail, -20.0, u)))
    return jnp.where(tail, small, direct)


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
    least float32, with ``log q`` as :func:`log_posterior_stddev`, so the KL
    and its gradient stay finite for scales that underflow (``u <= -88`` in
    float32, where the KL is about ``-u``).

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
    unconstrained = unconstrained_stddev.astype(dtype)
    scale = posterior_stddev(unconstrained)
    # log(scale) in a form that stays finite where softplus underflows (a
    # scale of 0 would make the KL inf and its gradient NaN).
    log_scale = log_posterior_stddev(unconstrained)
    prior = jnp.asarray(prior_stddev, dtype)
    squared_offset = jnp.square(mean - prior_mean)
    if posterior == "gaussian":
        kl = (
            jnp.log(prior)
            - log_scale
            + (jnp.square(scale) + squared_offset) / (2 * jnp.square(prior))
            - 0.5
        )
    elif posterior == "cauchy":
        kl = (
            jnp.log(jnp.square(scale + prior) + squared_offset)
            - jnp.log(4 * prior)
            - log_scale
        )
    else:
        raise ValueError(f"`posterior` must be one of {POSTERIORS}, got {posterior!r}.")
    return jnp.sum(kl)
