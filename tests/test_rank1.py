"""Rank-1 Bayesian fast weights: ``posterior=`` on the weight layers, the KL.

References: the analytic moments of a linear layer's output under Gaussian
fast weights, the closed-form KLs written out in numpy and a Monte-Carlo
estimate of them, ``jax.grad`` / ``jax.jvp`` of the explicit reparameterised
formula (a per-member loop over ``W * outer(r~_k, s~_k)``), and a BatchEnsemble
layer holding the posterior means.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from ensembles import (
    BatchEnsembleConv,
    BatchEnsembleConvTranspose,
    BatchEnsembleEinsum,
    BatchEnsembleLinear,
    BatchEnsembleLinearGeneral,
    initializers,
)
from ensembles.layers.posterior import DEFAULT_PRIOR_STDDEV
from ensembles.ops import posterior as posterior_ops
from tests.models import MLP, ONES, random_input
from tests.reference import (
    assert_same,
    snapshot,
)
from tests.tolerances import assert_close

E = 3

#: Every weight layer with a rank-1 posterior, and an input of 2 rows a member.
LAYERS = {
    "linear": (
        lambda **kw: BatchEnsembleLinear(4, 5, num_members=E, **kw),
        (E * 2, 4),
    ),
    "linear_general": (
        lambda **kw: BatchEnsembleLinearGeneral(4, (2, 3), num_members=E, **kw),
        (E * 2, 3, 4),
    ),
    "einsum": (
        lambda **kw: BatchEnsembleEinsum(
            "BTD,DH->BTH", (4, 5), (5,), num_members=E, **kw
        ),
        (E * 2, 3, 4),
    ),
    "conv": (
        lambda **kw: BatchEnsembleConv(2, 3, (3, 3), num_members=E, **kw),
        (E * 2, 5, 5, 2),
    ),
    "conv_transpose": (
        lambda **kw: BatchEnsembleConvTranspose(2, 3, (3,), num_members=E, **kw),
        (E * 2, 6, 2),
    ),
}


def _softplus_inverse(x):
    return np.log(np.expm1(x))


def _draws(layer, x, num_draws):
    """``num_draws`` training-mode calls of ``layer`` on ``x``, vectorised."""

    @nnx.split_rngs(splits=num_draws)
    @nnx.vmap(in_axes=(nnx.StateAxes({nnx.RngState: 0, ...: None}), None))
    def draw(layer, x):
        return layer(x)

    return draw(layer, x)


class TestMoments:
    def test_linear_output_mean_and_variance_match_the_analytic_ones(self):
        # Member k's output y_j = s~_j z_j + b_j with z_j = sum_i x_i r~_i W_ij:
        # E[y] = mu_s E[z] + b, Var[y] = E[s~^2] E[z^2] - (mu_s E[z])^2.
        layer = BatchEnsembleLinear(
            3,
            4,
            num_members=2,
            posterior="gaussian",
            stddev_init=initializers.unconstrained_stddev(0.3, jitter=0.5),
            rngs=nnx.Rngs(0),
        )
        x = jnp.array([[0.5, -1.0, 2.0]])
        outputs = np.asarray(_draws(layer, ensembles.tile(x, 2), 40_000), np.float64)
        kernel = np.asarray(layer.kernel[...], np.float64)
        mu_r, mu_s = (np.asarray(v[...], np.float64) for v in (layer.r, layer.s))
        sd_r, sd_s = (
            np.log1p(np.exp(np.asarray(v[...], np.float64)))
            for v in (layer.r_unconstrained_stddev, layer.s_unconstrained_stddev)
        )
        bias = np.asarray(layer.bias[...], np.float64)
        xv = np.asarray(x[0], np.float64)
        for k in range(2):
            z_mean = (xv * mu_r[k]) @ kernel
            z_var = (xv**2 * sd_r[k] ** 2) @ kernel**2
            mean = mu_s[k] * z_mean + bias[k]
            var = (sd_s[k] ** 2 + mu_s[k] ** 2) * (z_var + z_mean**2) - (
                mu_s[k] * z_mean
            ) ** 2
            sample = outputs[:, k, :]
            standard_error = np.sqrt(var / sample.shape[0])
            np.testing.assert_array_less(
                np.abs(sample.mean(0) - mean), 5 * standard_error
            )
            np.testing.assert_allclose(sample.var(0), var, rtol=0.06)

    def test_gaussian_draws_have_the_posterior_moments(self):
        mean = jnp.linspace(0.5, 1.5, 6).reshape(2, 3)
        raw = jnp.asarray(_softplus_inverse(np.linspace(0.1, 0.6, 6)), jnp.float32)
        keys = jax.random.split(jax.random.key(0), 20_000)
        draws = jax.vmap(
            lambda key: posterior_ops.sample_fast_weights(
                key, mean, raw.reshape(2, 3), posterior="gaussian"
            )
        )(keys)
        np.testing.assert_allclose(draws.mean(0), mean, atol=0.02)
        np.testing.assert_allclose(
            draws.std(0).ravel(), np.linspace(0.1, 0.6, 6), rtol=0.03
        )

    def test_cauchy_draws_have_the_posterior_quartiles(self):
        # A Cauchy(m, c) has quartiles m -+ c (its moments do not exist).
        mean = jnp.array([[0.5, 2.0]])
        scale = np.array([0.2, 0.05])
        raw = jnp.asarray(_softplus_inverse(scale)[None], jnp.float32)
        keys = jax.random.split(jax.random.key(1), 40_000)
        draws = jax.vmap(
            lambda key: posterior_ops.sample_fast_weights(
                key, mean, raw, posterior="cauchy"
            )
        )(keys)[:, 0]
        quartiles = np.quantile(np.asarray(draws), [0.25, 0.5, 0.75], axis=0)
        expected = np.stack([mean[0] - scale, mean[0], mean[0] + scale])
        np.testing.assert_allclose(quartiles, expected, atol=0.02 * scale.max() * 5)

    def test_draws_differ_per_member_and_per_call(self):
        layer = BatchEnsembleLinear(
            3, 4, num_members=2, posterior="gaussian", rngs=nnx.Rngs(0)
        )
        x = ensembles.tile(jnp.ones((1, 3)), 2)
        first, second = layer(x), layer(x)
        assert not np.allclose(first, second)
        # One draw per member and call: the two rows of a member share it.
        x2 = ensembles.tile(jnp.ones((2, 3)), 2)
        y = layer(x2)
        np.testing.assert_array_equal(y[0], y[1])
        np.testing.assert_array_equal(y[2], y[3])


def _gaussian_kl_numpy(mean, scale, prior_scale, prior_mean=1.0):
    return np.sum(
        np.log(prior_scale / scale)
        + (scale**2 + (mean - prior_mean) ** 2) / (2 * prior_scale**2)
        - 0.5
    )


def _monte_carlo_kl(posterior, mean, scale, prior_scale, num=400_000, seed=0):
    rng = np.random.default_rng(seed)
    if posterior == "gaussian":
        x = mean + scale * rng.standard_normal(num)

        def log_density(x, m, c):
            return -0.5 * ((x - m) / c) ** 2 - np.log(c * np.sqrt(2 * np.pi))

    else:
        x = mean + scale * rng.standard_cauchy(num)

        def log_density(x, m, c):
            return -np.log(np.pi * c * (1 + ((x - m) / c) ** 2))

    terms = log_density(x, mean, scale) - log_density(x, 1.0, prior_scale)
    return terms.mean(), terms.std() / np.sqrt(num)


class TestKL:
    @pytest.mark.parametrize("posterior", ["gaussian", "cauchy"])
    @pytest.mark.parametrize("mean,scale", [(1.3, 0.05), (0.8, 0.2), (1.0, 0.1)])
    def test_closed_form_matches_a_monte_carlo_estimate(self, posterior, mean, scale):
        kl = posterior_ops.fast_weight_kl(
            jnp.array([mean]),
            jnp.array([_softplus_inverse(scale)], jnp.float32),
            posterior=posterior,
            prior_stddev=0.1,
        )
        estimate, standard_error = _monte_carlo_kl(posterior, mean, scale, 0.1)
        assert abs(float(kl) - estimate) < 5 * standard_error + 1e-4

    def test_gaussian_closed_form_equals_numpy(self):
        mean = np.array([[0.2, 1.0, 1.7], [1.1, 0.9, -1.0]])
        scale = np.array([[0.01, 0.1, 0.3], [0.05, 0.5, 0.02]])
        kl = posterior_ops.fast_weight_kl(
            jnp.asarray(mean, jnp.float32),
            jnp.asarray(_softplus_inverse(scale), jnp.float32),
            posterior="gaussian",
            prior_stddev=0.2,
        )
        np.testing.assert_allclose(
            float(kl), _gaussian_kl_numpy(mean, scale, 0.2), rtol=1e-5
        )

    def test_cauchy_closed_form_is_zero_at_the_prior_and_symmetric(self):
        def kl(mean, scale, prior_mean, prior_scale):
            return float(
                posterior_ops.fast_weight_kl(
                    jnp.array([mean]),
                    jnp.array([_softplus_inverse(scale)], jnp.float32),
                    posterior="cauchy",
                    prior_stddev=prior_scale,
                    prior_mean=prior_mean,
                )
            )

        assert abs(kl(1.0, 0.1, 1.0, 0.1)) < 1e-6
        # The KL between two Cauchys is symmetric (Chyzak & Nielsen, 2019).
        forward = kl(1.4, 0.3, 1.0, 0.1)
        np.testing.assert_allclose(forward, kl(1.0, 0.1, 1.4, 0.3), rtol=1e-5)
        np.testing.assert_allclose(
            forward, np.log(((0.3 + 0.1) ** 2 + 0.4**2) / (4 * 0.3 * 0.1)), rtol=1e-5
        )

    def test_model_kl_sums_layers_once_and_is_zero_without_posteriors(self):
        layer = BatchEnsembleLinear(
            3, 2, num_members=E, posterior="gaussian", rngs=nnx.Rngs(0)
        )
        other = BatchEnsembleConv(
            2, 3, (3,), num_members=E, posterior="cauchy", rngs=nnx.Rngs(1)
        )
        plain = BatchEnsembleLinear(3, 2, num_members=E, rngs=nnx.Rngs(2))
        model = nnx.Sequential(layer, plain, other, layer)  # `layer` shared

        def layer_kl(module):
            return sum(
                float(
                    posterior_ops.fast_weight_kl(
                        m[...],
                        u[...],
                        posterior=module.posterior,
                        prior_stddev=DEFAULT_PRIOR_STDDEV,
                    )
                )
                for m, u in (
                    (module.r, module.r_unconstrained_stddev),
                    (module.s, module.s_unconstrained_stddev),
                )
            )

        np.testing.assert_allclose(
            float(ensembles.kl_divergence(model)),
            layer_kl(layer) + layer_kl(other),
            rtol=1e-6,
        )
        assert float(ensembles.kl_divergence(plain)) == 0.0
        assert float(ensembles.kl_divergence(MLP(nnx.Rngs(0)))) == 0.0

    def test_model_kl_gradient_equals_the_explicit_formula(self):
        layer = BatchEnsembleLinear(
            3,
            2,
            num_members=E,
            posterior="gaussian",
            prior_stddev=0.2,
            rngs=nnx.Rngs(0),
        )
        grads = nnx.grad(ensembles.kl_divergence)(layer)

        def explicit(r, s, r_raw, s_raw):
            def kl(mean, raw):
                scale = jax.nn.softplus(raw)
                return jnp.sum(
                    jnp.log(0.2 / scale)
                    + (scale**2 + (mean - 1.0) ** 2) / (2 * 0.2**2)
                    - 0.5
                )

            return kl(r, r_raw) + kl(s, s_raw)

        expected = jax.grad(explicit, argnums=(0, 1, 2, 3))(
            layer.r[...],
            layer.s[...],
            layer.r_unconstrained_stddev[...],
            layer.s_unconstrained_stddev[...],
        )
        actual = (
            grads.r[...],
            grads.s[...],
            grads.r_unconstrained_stddev[...],
            grads.s_unconstrained_stddev[...],
        )
        for a, b in zip(actual, expected, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(grads.kernel[...], 0)

    def test_kl_is_float64_for_float64_parameters(self, x64):
        layer = BatchEnsembleLinear(
            3,
            2,
            num_members=2,
            posterior="gaussian",
            param_dtype=jnp.float64,
            rngs=nnx.Rngs(0),
        )
        assert ensembles.kl_divergence(layer).dtype == jnp.float64


def _explicit_forward(x, kernel, r, s, r_raw, s_raw, bias, key, num_members):
    """The reparameterised formula: one normal draw per member (drawn in at
    least float32, cast to the parameters' dtype), then a loop over the
    explicit weights ``W * outer(r~_k, s~_k)``, in at least float32."""
    r_key, s_key = jax.random.split(key)

    def draw(key, mean, raw):
        wide = jnp.promote_types(mean.dtype, jnp.float32)
        noise = jax.random.normal(key, mean.shape, wide)
        return (mean.astype(wide) + jax.nn.softplus(raw.astype(wide)) * noise).astype(
            mean.dtype
        )

    r_draw, s_draw = draw(r_key, r, r_raw), draw(s_key, s, s_raw)
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    rows = x.shape[0] // num_members
    return jnp.concatenate(
        [
            jnp.matmul(
                x[k * rows : (k + 1) * rows].astype(dtype),
                (kernel * jnp.outer(r_draw[k], s_draw[k])).astype(dtype),
                precision=jax.lax.Precision.HIGHEST,
            )
            + bias[k : k + 1].astype(dtype)
            for k in range(num_members)
        ]
    )


class TestGradients:
    @pytest.mark.parametrize(
        "dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)]
    )
    @pytest.mark.parametrize("jit", [False, True])
    def test_reverse_mode_equals_grad_of_the_explicit_formula(self, dtype, jit):
        layer = BatchEnsembleLinear(
            4,
            3,
            num_members=E,
            posterior="gaussian",
            param_dtype=dtype,
            stddev_init=initializers.unconstrained_stddev(0.2),
            rngs=nnx.Rngs(0),
        )
        x = random_input(1, (E * 2, 4), dtype)
        cotangent = random_input(2, (E * 2, 3))
        key = nnx.clone(layer).rngs()  # the key the layer's next call draws

        def loss(layer, x):
            return jnp.sum(layer(x).astype(jnp.float32) * cotangent)

        grad_fn = nnx.grad(loss, argnums=(0, 1))
        if jit:
            grad_fn = nnx.jit(grad_fn)
        layer_grads, x_grad = grad_fn(layer, x)

        def explicit(x, kernel, r, s, r_raw, s_raw, bias):
            y = _explicit_forward(x, kernel, r, s, r_raw, s_raw, bias, key, E)
            return jnp.sum(y * cotangent)

        operands = (
            x,
            layer.kernel[...],
            layer.r[...],
            layer.s[...],
            layer.r_unconstrained_stddev[...],
            layer.s_unconstrained_stddev[...],
            layer.bias[...],
        )
        expected = jax.grad(explicit, argnums=tuple(range(7)))(*operands)
        actual = (
            x_grad,
            layer_grads.kernel[...],
            layer_grads.r[...],
            layer_grads.s[...],
            layer_grads.r_unconstrained_stddev[...],
            layer_grads.s_unconstrained_stddev[...],
            layer_grads.bias[...],
        )
        for a, b in zip(actual, expected, strict=True):
            assert a.dtype == jnp.dtype(dtype)
            assert_close(a, b, dtype=dtype, scale=4.0)

    def test_forward_mode_equals_jvp_of_the_explicit_formula(self, x64):
        layer = BatchEnsembleLinear(
            4,
            3,
            num_members=E,
            posterior="gaussian",
            param_dtype=jnp.float64,
            stddev_init=initializers.unconstrained_stddev(0.2),
            rngs=nnx.Rngs(0),
        )
        x = random_input(1, (E * 2, 4), jnp.float64)
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
        key = nnx.clone(layer).rngs()
        tangents = jax.tree.map(
            lambda p: jnp.asarray(
                np.random.default_rng(3).standard_normal(p.shape), p.dtype
            ),
            params,
        )

        def forward(params):
            # Fresh rng Variables inside the trace (the stream advances there).
            return nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))(x)

        _, actual = jax.jvp(forward, (params,), (tangents,))

        def explicit(kernel, r, s, r_raw, s_raw, bias):
            return _explicit_forward(x, kernel, r, s, r_raw, s_raw, bias, key, E)

        names = (
            "kernel",
            "r",
            "s",
            "r_unconstrained_stddev",
            "s_unconstrained_stddev",
            "bias",
        )
        _, expected = jax.jvp(
            explicit,
            tuple(params[n][...] for n in names),
            tuple(tangents[n][...] for n in names),
        )
        np.testing.assert_allclose(actual, expected, rtol=1e-10, atol=1e-10)


class TestModes:
    @pytest.mark.parametrize("kind", sorted(LAYERS))
    @pytest.mark.parametrize("posterior", ["gaussian", "cauchy"])
    def test_eval_equals_a_batch_ensemble_holding_the_means(self, kind, posterior):
        make, shape = LAYERS[kind]
        rank1 = make(posterior=posterior, rngs=nnx.Rngs(0))
        plain = make(rngs=nnx.Rngs(0))  # draws the same kernel, r, s and bias
        x = random_input(0, shape)
        trained = rank1(x)
        assert not np.allclose(trained, plain(x))
        expected = plain(x)
        np.testing.assert_array_equal(rank1(x, deterministic=True), expected)
        np.testing.assert_array_equal(nnx.view(rank1, deterministic=True)(x), expected)
        rank1.eval()
        np.testing.assert_array_equal(rank1(x), expected)
        assert not np.allclose(rank1(x, deterministic=False), expected)
        rank1.train()
        assert not np.allclose(rank1(x), expected)

    @pytest.mark.parametrize("kind", sorted(LAYERS))
    def test_member_view_sees_its_slice_of_the_same_draw(self, kind):
        make, shape = LAYERS[kind]
        layer = make(posterior="gaussian", rngs=nnx.Rngs(0))
        x = random_input(0, shape)
        twin = nnx.clone(layer)
        full = layer(x)
        rows = x.shape[0] // E
        for k in range(E):
            member = nnx.view(nnx.clone(twin), member=k)(x[k * rows : (k + 1) * rows])
            assert_close(member, full[k * rows : (k + 1) * rows])
        # Evaluation: the view of the means, and extract_member's plain layer.
        layer.eval()
        for k in range(E):
            rows_k = x[k * rows : (k + 1) * rows]
            view = nnx.view(layer, member=k)(rows_k)
            assert_close(view, layer(x)[k * rows : (k + 1) * rows])
            assert_close(layer.extract_member(k)(rows_k), view, scale=2.0)

    @pytest.mark.parametrize("kind", sorted(LAYERS))
    def test_a_failed_call_draws_nothing(self, kind):
        make, shape = LAYERS[kind]
        layer = make(posterior="gaussian", rngs=nnx.Rngs(0))
        twin = nnx.clone(layer)
        x = random_input(0, shape)
        ragged = random_input(1, (x.shape[0] + 1, *x.shape[1:]))
        narrow = random_input(2, (*x.shape[:-1], x.shape[-1] + 1))
        counts = nnx.to_pure_dict(nnx.state(layer, nnx.RngCount))
        with pytest.raises(ValueError, match="multiple of `num_members`"):
            layer(ragged)  # the op raises after the draw
        with pytest.raises(ValueError):
            layer(narrow)
        with pytest.raises(ValueError):
            nnx.view(layer, member=1)(narrow[: x.shape[0] // E])
        with pytest.raises(TypeError, match="deterministic"):
            layer(x, deterministic="no")  # raises before the draw
        assert nnx.to_pure_dict(nnx.state(layer, nnx.RngCount)) == counts
        np.testing.assert_array_equal(layer(x), twin(x))
        assert nnx.to_pure_dict(nnx.state(layer, nnx.RngCount)) != counts

    @pytest.mark.parametrize(
        "kind", sorted(k for k in LAYERS if k != "conv_transpose")
    )  # nnx.ConvTranspose takes no out_sharding
    def test_a_call_whose_out_sharding_fails_draws_nothing(self, kind):
        # The placement comes after the op: it used to run after the draw
        # was taken back, so a failed placement advanced the stream.
        make, shape = LAYERS[kind]
        layer = make(posterior="gaussian", rngs=nnx.Rngs(0))
        twin = nnx.clone(layer)  # the reference: a layer that never failed
        x = random_input(0, shape)
        counts = nnx.to_pure_dict(nnx.state(layer, nnx.RngCount))
        with pytest.raises(ValueError, match="mesh"):
            layer(x, out_sharding=jax.sharding.PartitionSpec("data"))  # no mesh
        assert nnx.to_pure_dict(nnx.state(layer, nnx.RngCount)) == counts
        np.testing.assert_array_equal(layer(x), twin(x))

    def test_jit_draws_what_eager_calls_draw_and_advances_the_stream(self):
        layer = BatchEnsembleLinear(
            4, 3, num_members=E, posterior="gaussian", rngs=nnx.Rngs(0)
        )
        twin = nnx.clone(layer)
        x = random_input(0, (E, 4))
        eager = [layer(x), layer(x)]
        call = nnx.jit(lambda m, x: m(x))
        jitted = [call(twin, x), call(twin, x)]
        assert_close(jitted[0], eager[0])
        assert_close(jitted[1], eager[1])
        assert not np.allclose(jitted[0], jitted[1])

    def test_seeds_reproduce_and_the_posterior_stream_is_its_own(self):
        x = random_input(0, (E, 4))

        def run(**streams):
            layer = BatchEnsembleLinear(
                4, 3, num_members=E, posterior="gaussian", rngs=nnx.Rngs(**streams)
            )
            return layer.kernel[...], [layer(x) for _ in range(3)]

        kernel_a, draws_a = run(params=0, posterior=1)
        _, draws_b = run(params=0, posterior=1)
        kernel_c, draws_c = run(params=0, posterior=2)
        for a, b in zip(draws_a, draws_b, strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(kernel_a, kernel_c)
        assert not np.allclose(draws_a[0], draws_c[0])

    def test_custom_rng_collection(self):
        layer = BatchEnsembleLinear(
            4,
            3,
            num_members=E,
            posterior="gaussian",
            rng_collection="noise",
            rngs=nnx.Rngs(params=0, noise=5),
        )
        same = BatchEnsembleLinear(
            4,
            3,
            num_members=E,
            posterior="gaussian",
            rngs=nnx.Rngs(params=0, posterior=5),
        )
        x = random_input(0, (E, 4))
        np.testing.assert_array_equal(layer(x), same(x))

    def test_bfloat16_computation_and_parameters_stay_bfloat16(self):
        layer = BatchEnsembleLinear(
            4,
            3,
            num_members=E,
            posterior="cauchy",
            dtype=jnp.bfloat16,
            param_dtype=jnp.bfloat16,
            rngs=nnx.Rngs(0),
        )
        assert layer.r_unconstrained_stddev.dtype == jnp.bfloat16
        assert layer(random_input(0, (E, 4))).dtype == jnp.bfloat16

    def test_state_labels_and_summary(self):
        layer = BatchEnsembleLinear(
            4, 3, num_members=E, posterior="gaussian", rngs=nnx.Rngs(0)
        )
        labels = ensembles.optim.fast_weight_labels(nnx.state(layer, nnx.Param))
        assert dict(labels) == {
            "bias": "shared",
            "kernel": "shared",
            "r": "fast",
            "s": "fast",
            "r_unconstrained_stddev": "fast",
            "s_unconstrained_stddev": "fast",
        }
        summary = ensembles.summary(layer)
        assert summary.fast_params == 2 * E * (4 + 3)
        plain = BatchEnsembleLinear(4, 3, num_members=E, rngs=nnx.Rngs(0))
        assert "rngs" not in nnx.state(plain)
        assert plain.r_unconstrained_stddev is None


class TestConversion:
    @pytest.mark.parametrize("posterior", ["gaussian", "cauchy"])
    def test_convert_keeps_weights_and_leaves_the_source_untouched(self, posterior):
        model = MLP(nnx.Rngs(0))
        rngs = nnx.Rngs(1)
        before = snapshot(model)
        ensemble = ensembles.to_batch_ensemble(
            model,
            num_members=E,
            rngs=rngs,
            posterior=posterior,
            prior_stddev=0.2,
            **ONES,
        )
        assert_same(before, snapshot(model))
        layers = [
            node
            for _, node in nnx.iter_graph(ensemble)
            if isinstance(node, BatchEnsembleLinear)
        ]
        assert layers and all(
            layer.posterior == posterior and layer.prior_stddev == 0.2
            for layer in layers
        )
        x = random_input(0, (2, 4))
        ensemble.eval()
        # ones() means: in evaluation every member is the pretrained model.
        expected = model(x)
        outputs = ensemble(ensembles.tile(x, E))
        for k in range(E):
            assert_close(outputs[k * 2 : (k + 1) * 2], expected)
        ensemble.train()
        assert not np.allclose(ensemble(ensembles.tile(x, E))[:2], expected)
        assert float(ensembles.kl_divergence(ensemble)) > 0
        # One member back out: a plain model computing with the means.
        plain = ensembles.extract_member(ensemble, 1)
        assert_close(plain(x), expected)

    def test_from_layer_with_a_posterior(self):
        linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        layer = BatchEnsembleLinear.from_linear(
            linear, num_members=E, posterior="gaussian", rngs=nnx.Rngs(1), **ONES
        )
        assert layer.posterior == "gaussian"
        x = random_input(0, (1, 4))
        assert_close(layer(ensembles.tile(x, E), deterministic=True)[:1], linear(x))


class TestErrors:
    @pytest.mark.parametrize(
        "kwargs,error,match",
        [
            ({"posterior": "normal"}, ValueError, r"`posterior`.*'normal'"),
            ({"posterior": True}, ValueError, r"`posterior`"),
            ({"prior_stddev": 0.0}, ValueError, r"`prior_stddev`.*0\.0"),
            ({"prior_stddev": float("nan")}, ValueError, r"`prior_stddev`"),
            ({"prior_stddev": "0.1"}, TypeError, r"`prior_stddev`"),
            ({"prior_stddev": True}, TypeError, r"`prior_stddev`"),
            ({"deterministic": 1}, TypeError, r"`deterministic`.*1"),
            ({"rng_collection": 3}, TypeError, r"`rng_collection`.*3"),
            ({"rng_collection": ""}, ValueError, r"`rng_collection`.*''"),
        ],
    )
    @pytest.mark.parametrize("kind", sorted(LAYERS))
    def test_constructor_arguments_and_nothing_drawn(self, kind, kwargs, error, match):
        make, _ = LAYERS[kind]
        rngs = nnx.Rngs(0)
        before = snapshot(rngs)
        with pytest.raises(error, match=match):
            make(rngs=rngs, **{"posterior": "gaussian", **kwargs})
        assert_same(before, snapshot(rngs))

    def test_call_and_view_deterministic_must_be_a_bool(self):
        layer = BatchEnsembleLinear(
            4, 3, num_members=E, posterior="gaussian", rngs=nnx.Rngs(0)
        )
        before = snapshot(layer)
        with pytest.raises(TypeError, match=r"`deterministic`.*'yes'"):
            layer(jnp.ones((E, 4)), deterministic="yes")
        with pytest.raises(TypeError, match=r"`deterministic`"):
            nnx.view(layer, deterministic=1, impl="xla")
        assert_same(before, snapshot(layer))
        assert layer.impl == "xla" and layer.deterministic is False

    def test_convert_refuses_a_bad_posterior_and_changes_nothing(self):
        model = MLP(nnx.Rngs(0))
        rngs = nnx.Rngs(1)
        before = snapshot(model, rngs)
        with pytest.raises(ValueError, match=r"`posterior`.*'bayes'"):
            ensembles.to_batch_ensemble(
                model, num_members=E, rngs=rngs, posterior="bayes"
            )
        with pytest.raises(ValueError, match=r"`prior_stddev`.*-1"):
            ensembles.to_batch_ensemble(
                model,
                num_members=E,
                rngs=rngs,
                posterior="gaussian",
                prior_stddev=-1.0,
            )
        assert_same(before, snapshot(model, rngs))

    def test_kl_divergence_and_initializer_arguments(self):
        with pytest.raises(TypeError, match=r"`model`.*ndarray|`model`.*Array"):
            ensembles.kl_divergence(jnp.ones(3))
        with pytest.raises(ValueError, match=r"`stddev`.*0"):
            initializers.unconstrained_stddev(0.0)
        with pytest.raises(ValueError, match=r"`jitter`.*-0\.1"):
            initializers.unconstrained_stddev(0.1, jitter=-0.1)

    def test_unconstrained_stddev_initializer(self):
        raw = initializers.unconstrained_stddev(0.05, jitter=0.1)(
            jax.random.key(0), (2000,)
        )
        center = _softplus_inverse(0.05)
        assert abs(float(raw.mean()) - center) < 0.01
        assert float(jnp.abs(raw - center).max()) <= 0.2 + 1e-6
        huge = initializers.unconstrained_stddev(50.0, jitter=0.0)(
            jax.random.key(0), (2,)
        )
        np.testing.assert_allclose(jax.nn.softplus(huge), 50.0)
