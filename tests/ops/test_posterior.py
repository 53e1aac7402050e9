"""ensembles.ops.posterior at the edges: bf16 draws keep their tails, and the KL
and its gradient stay finite (and exact) at scales whose softplus underflows."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ensembles.ops import posterior

N = 40_000


def _draw(kind, dtype, num=N, seed=0):
    # Mean 0 and scale softplus(u) = 1: the draw is the standard noise itself.
    unconstrained = jnp.full((num,), math.log(math.expm1(1.0)), jnp.float32)
    return posterior.sample_fast_weights(
        jax.random.key(seed),
        jnp.zeros((num,), dtype),
        unconstrained.astype(dtype),
        posterior=kind,
    )


def _within(count, probability, num=N, sigmas=5.0):
    expected = probability * num
    return abs(count - expected) <= sigmas * math.sqrt(expected) + 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gaussian_draws_keep_their_tails(dtype):
    draws = np.asarray(_draw("gaussian", dtype).astype(jnp.float32))
    assert _draw("gaussian", dtype).dtype == jnp.dtype(dtype)
    for z in (2.5, 3.0, 3.5):
        tail = math.erfc(z / math.sqrt(2))  # P(|Z| > z)
        count = int((np.abs(draws) > z).sum())
        assert _within(count, tail), (z, count, tail * N)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cauchy_draws_keep_their_tails(dtype):
    draws = np.asarray(_draw("cauchy", dtype).astype(jnp.float32))
    for c in (10.0, 50.0, 200.0):
        tail = 2 / math.pi * math.atan(1 / c)  # P(|X| > c)
        count = int((np.abs(draws) > c).sum())
        assert _within(count, tail), (c, count, tail * N)


def test_bfloat16_draws_are_the_float32_draws_rounded():
    for kind in posterior.POSTERIORS:
        wide = _draw(kind, jnp.float32, num=1000, seed=3)
        narrow = _draw(kind, jnp.bfloat16, num=1000, seed=3)
        # The unconstrained scale rounds to bf16 too; its softplus is 1 to 1%.
        np.testing.assert_allclose(
            np.asarray(narrow, np.float32), np.asarray(wide), rtol=2e-2
        )


# ------------------------------------------------------------------------- KL


def _ref_log_softplus(u):
    u = np.asarray(u, np.float64)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        direct = np.log(np.log1p(np.exp(u)))
        # Where exp(u) underflows even in float64, log(softplus(u)) = u exactly.
        return np.where(u < -700, u, np.where(u > 700, np.log(np.abs(u)), direct))


def _ref_kl(kind, mean, u, prior):
    mean = np.asarray(mean, np.float64)
    log_scale = _ref_log_softplus(u)
    scale = np.exp(log_scale)
    offset = (mean - 1.0) ** 2
    if kind == "gaussian":
        kl = np.log(prior) - log_scale + (scale**2 + offset) / (2 * prior**2) - 0.5
    else:
        kl = np.log((scale + prior) ** 2 + offset) - np.log(4 * prior) - log_scale
    return kl.sum()


EXTREME = [-1e4, -1000.0, -200.0, -104.0, -88.0, -50.0, -20.0, -5.0, 0.0, 5.0, 30.0]


def test_log_posterior_stddev_matches_float64(x64):
    u = np.array([*EXTREME, -20.001, -19.999, 200.0])
    for dtype, rtol in ((jnp.float64, 1e-13), (jnp.float32, 1e-6)):
        actual = posterior.log_posterior_stddev(jnp.asarray(u, dtype))
        assert bool(jnp.isfinite(actual).all())
        np.testing.assert_allclose(actual, _ref_log_softplus(u), rtol=rtol)


@pytest.mark.parametrize("kind", posterior.POSTERIORS)
@pytest.mark.parametrize("u", EXTREME)
def test_kl_is_finite_and_exact_at_extreme_scales(kind, u):
    mean = jnp.array([1.3, 0.8])
    raw = jnp.full((2,), u, jnp.float32)
    kl = posterior.fast_weight_kl(mean, raw, posterior=kind, prior_stddev=0.1)
    assert bool(jnp.isfinite(kl))
    np.testing.assert_allclose(
        float(kl), _ref_kl(kind, mean, np.full(2, u), 0.1), rtol=1e-5
    )


def _ref_kl_grad(kind, mean, u, prior):
    """d KL / d u and d KL / d mean in float64, from the closed forms."""
    mean = np.asarray(mean, np.float64)
    u = np.asarray(u, np.float64)
    with np.errstate(over="ignore"):
        sigmoid = 1 / (1 + np.exp(-u))
    log_scale = _ref_log_softplus(u)
    scale = np.exp(log_scale)
    # d log(softplus(u)) / du = sigmoid(u) / softplus(u) -> 1 as u -> -inf.
    with np.errstate(divide="ignore", invalid="ignore"):
        dlog = np.where(u < -30, 1.0, sigmoid / scale)
    offset = mean - 1.0
    if kind == "gaussian":
        du = -dlog + scale * sigmoid / prior**2
        dmean = offset / prior**2
    else:
        denom = (scale + prior) ** 2 + offset**2
        du = 2 * (scale + prior) * sigmoid / denom - dlog
        dmean = 2 * offset / denom
    return dmean, du


@pytest.mark.parametrize("kind", posterior.POSTERIORS)
def test_kl_gradient_is_finite_and_exact_at_extreme_scales(kind):
    u = jnp.asarray(EXTREME, jnp.float32)
    mean = jnp.linspace(0.5, 1.5, u.shape[0])
    dmean, du = jax.grad(
        lambda m, raw: posterior.fast_weight_kl(
            m, raw, posterior=kind, prior_stddev=0.1
        ),
        argnums=(0, 1),
    )(mean, u)
    ref_dmean, ref_du = _ref_kl_grad(kind, mean, np.asarray(EXTREME), 0.1)
    assert bool(jnp.isfinite(du).all()) and bool(jnp.isfinite(dmean).all())
    np.testing.assert_allclose(du, ref_du, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dmean, ref_dmean, rtol=1e-5)
