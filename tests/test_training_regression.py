"""Regression training: the Gaussian head, its (beta-)NLL and MSE, end to end.

References: a float64 loop over members of the per-member losses, the
beta-NLL's gradient written out by hand, and a model trained the way a user
trains one (converted by ``to_batch_ensemble``, a head of two outputs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import ensembles
from ensembles import uncertainty
from ensembles.training import gaussian_head, gaussian_nll, mse

E, B, D = 3, 5, 2


def _draw(seed=0, outputs=()):
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(E * B, *outputs))
    stds = rng.uniform(0.2, 2.0, size=(E * B, *outputs))
    return (
        means,
        stds,
        rng.normal(size=(B, *outputs)),
        rng.normal(size=(E * B, *outputs)),
    )


def _reference_nll(means, stds, targets, beta=0.0):
    """Mean over members of each member's mean (beta-)NLL, float64."""
    if len(targets) == B:
        targets = np.concatenate([targets] * E)
    member = []
    for k in range(E):
        rows = slice(k * B, (k + 1) * B)
        mu, sigma, y = means[rows], stds[rows], targets[rows]
        nll = np.log(sigma) + 0.5 * ((y - mu) / sigma) ** 2 + 0.5 * np.log(2 * np.pi)
        nll = nll * (sigma**2) ** beta
        member.append((nll if nll.ndim == 1 else nll.sum(-1)).mean())
    return np.mean(member)


@pytest.mark.parametrize("outputs", [(), (D,)])
@pytest.mark.parametrize("layout", ["tiled", "member_major", "untiled_members"])
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_gaussian_nll_is_the_mean_of_member_losses(outputs, layout, beta):
    means, stds, tiled, member_major = _draw(0, outputs)
    targets = member_major if layout == "member_major" else tiled
    m, s = means, stds
    if layout == "untiled_members":  # [E, B(, D)], as Ensemble returns them
        m, s = ensembles.untile(means, E), ensembles.untile(stds, E)
    loss = gaussian_nll(
        jnp.asarray(m, jnp.float32), s, targets, num_members=E, beta=beta
    )
    assert loss.dtype == jnp.float32
    expected = _reference_nll(means, stds, targets, beta)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_gaussian_nll_float64_bf16_and_jit(x64):
    means, stds, tiled, _ = _draw(1)
    loss = gaussian_nll(means, stds, tiled, num_members=E)
    assert loss.dtype == jnp.float64
    np.testing.assert_allclose(loss, _reference_nll(means, stds, tiled), rtol=1e-12)
    low = [jnp.asarray(a, jnp.bfloat16) for a in (means, stds)]
    got = jax.jit(gaussian_nll, static_argnames="num_members")(
        *low, tiled, num_members=E
    )
    assert got.dtype == jnp.float32
    rounded = [np.asarray(a, np.float64) for a in low]
    np.testing.assert_allclose(got, _reference_nll(*rounded, tiled), rtol=1e-5)


def test_beta_nll_gradient_is_the_weighted_nll_gradient():
    means, stds, tiled, _ = _draw(2)
    beta = 0.5
    grads = jax.grad(
        lambda m, s: gaussian_nll(m, s, tiled, num_members=E, beta=beta), (0, 1)
    )(jnp.asarray(means, jnp.float32), jnp.asarray(stds, jnp.float32))
    y = np.concatenate([tiled] * E)
    weight = (stds**2) ** beta / (E * B)  # the weight is not differentiated
    expected_means = weight * (means - y) / stds**2
    expected_stds = weight * (1 / stds - (y - means) ** 2 / stds**3)
    np.testing.assert_allclose(grads[0], expected_means, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(grads[1], expected_stds, rtol=1e-4, atol=1e-7)
    # beta = 1 gives the means the gradient of (half) a squared error.
    grad_one = jax.grad(
        lambda m: gaussian_nll(m, stds, tiled, num_members=E, beta=1.0)
    )(jnp.asarray(means, jnp.float32))
    np.testing.assert_allclose(grad_one, (means - y) / (E * B), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("outputs", [(), (D,)])
def test_mse_is_the_mean_of_member_losses(outputs):
    means, _, tiled, member_major = _draw(3, outputs)
    for targets in (tiled, member_major):
        full = targets if len(targets) == E * B else np.concatenate([targets] * E)
        expected = np.mean(
            [np.mean((full - means)[k * B : (k + 1) * B] ** 2) for k in range(E)]
        )
        got = mse(jnp.asarray(means, jnp.float32), targets, num_members=E)
        np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_gaussian_head_splits_and_floors():
    outputs = jnp.array([[[0.5, -30.0], [1.0, 2.0]]])  # [1, 2, 2]
    means, stds = gaussian_head(outputs, min_std=0.01)
    np.testing.assert_allclose(means, [[0.5, 1.0]])
    np.testing.assert_allclose(stds, np.log1p(np.exp([[-30.0, 2.0]])) + 0.01, rtol=1e-6)
    assert float(stds.min()) >= np.float32(0.01)
    bf16_means, _ = gaussian_head(outputs.astype(jnp.bfloat16))
    assert bf16_means.dtype == jnp.float32


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: gaussian_head(jnp.ones((4, 3))), ValueError, "axis of size 2"),
        (
            lambda: gaussian_head(jnp.ones((4, 2)), min_std=-1),
            ValueError,
            "`min_std` must be finite and >= 0",
        ),
        (lambda: gaussian_head(jnp.ones((4, 2), int)), TypeError, "floating-point"),
        (
            lambda: gaussian_nll(
                jnp.ones(6), jnp.ones(6), jnp.ones(2), num_members=3, beta=2
            ),
            ValueError,
            r"`beta` must lie in \[0, 1\]",
        ),
        (
            lambda: gaussian_nll(jnp.ones(6), jnp.ones(5), jnp.ones(2), num_members=3),
            ValueError,
            "`stds` must have the shape of `means`",
        ),
        (
            lambda: gaussian_nll(jnp.ones(6), jnp.ones(6), jnp.ones(4), num_members=3),
            ValueError,
            "`targets` must have 2 rows",
        ),
        (
            lambda: gaussian_nll(jnp.ones(7), jnp.ones(7), jnp.ones(2), num_members=3),
            ValueError,
            "multiple of",
        ),
        (
            lambda: mse(jnp.ones((2, 3)), jnp.ones(3), num_members=3),
            ValueError,
            "E = num_members = 3",
        ),
        (lambda: mse(jnp.ones(6), None, num_members=3), TypeError, "`targets`"),
    ],
)
def test_regression_losses_reject_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ------------------------------------------------------------------ one output


def test_cross_entropy_of_one_class_raises_naming_the_regression_losses():
    with pytest.raises(
        ValueError, match=r"one class.*training\.gaussian_nll.*training\.mse"
    ):
        ensembles.training.cross_entropy(
            jnp.ones((6, 1)), jnp.zeros(2, int), num_members=3
        )
    with pytest.raises(TypeError, match=r"regression problem.*gaussian_nll"):
        ensembles.training.cross_entropy(
            jnp.ones((6, 3)), jnp.array([0.5, 1.2]), num_members=3
        )


# ------------------------------------------------------------------ end to end


class Regressor(nnx.Module):
    """A user's Gaussian-head MLP: a trunk, and a head of (mean, raw spread)."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(1, 32, rngs=rngs)
        self.head = nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.hidden(x)))


@pytest.mark.slow
def test_a_gaussian_head_converts_trains_and_predicts_a_mixture():
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, (256, 1)).astype(np.float32)
    noise = 0.1 + 0.3 * np.abs(x[:, 0])  # heteroscedastic, known
    y = (np.sin(2 * x[:, 0]) + noise * rng.standard_normal(256)).astype(np.float32)
    model = ensembles.to_batch_ensemble(
        Regressor(nnx.Rngs(0)), num_members=E, rngs=nnx.Rngs(1)
    )
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            means, stds = gaussian_head(model(ensembles.tile(x, E)))
            return gaussian_nll(means, stds, y, num_members=E, beta=0.5)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    first = float(step(model, optimizer))
    for _ in range(300):
        last = float(step(model, optimizer))
    assert last < first - 1.0
    means, stds = gaussian_head(ensembles.Ensemble(model, num_members=E)(x))
    assert means.shape == stds.shape == (E, 256)
    assert float(uncertainty.epistemic_variance(means, stds).mean()) > 0
    # The aleatoric head learnt the noise: its spread grows with |x| as it does.
    aleatoric = np.sqrt(np.asarray(uncertainty.aleatoric_variance(means, stds)))
    assert np.corrcoef(aleatoric, noise)[0, 1] > 0.8
    assert float(uncertainty.interval_coverage(means, stds, y, level=0.9)) > 0.8
