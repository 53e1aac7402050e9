import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from ensembles import (
    BatchEnsembleLinearGeneral,
    EnsembleBatchNorm,
    EnsembleLayerNorm,
    EnsembleRMSNorm,
)
from tests.reference import assert_trees_equal, flax_rows_reference, numpy_normal
from tests.tolerances import assert_close

E = 3
RANDOM = numpy_normal(1.0)  # jax.random would compile for each shape and dtype


def random_input(seed, shape, dtype=jnp.float32, mean=0.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(mean + rng.standard_normal(shape), dtype)


def param_state(norm, k, names=("scale", "bias")):
    state = {}
    for name in names:
        variable = getattr(norm, name, None)
        if variable is not None:
            state[name] = type(variable)(variable[k].astype(jnp.float32))
    return state


def flax_reference(norm, template, x, **call_kwargs):
    """Each member's rows through the Flax norm holding that member's state."""
    names = ("scale", "bias", "mean", "var")

    @jax.jit
    def run(x):
        return flax_rows_reference(
            template,
            lambda k: param_state(norm, k, names),
            x.astype(jnp.float32),
            norm.num_members,
            **call_kwargs,
        )

    return run(x)


def flax_layer_norm(norm):
    return nnx.LayerNorm(
        norm.num_features,
        epsilon=norm.epsilon,
        use_bias=norm.use_bias,
        use_scale=norm.use_scale,
        reduction_axes=norm.reduction_axes,
        feature_axes=norm.feature_axes,
        use_fast_variance=norm.use_fast_variance,
        rngs=nnx.Rngs(0),
    )


def flax_rms_norm(norm):
    return nnx.RMSNorm(
        norm.num_features,
        epsilon=norm.epsilon,
        use_scale=norm.use_scale,
        reduction_axes=norm.reduction_axes,
        feature_axes=norm.feature_axes,
        rngs=nnx.Rngs(0),
    )


def flax_batch_norm(norm, use_running_average):
    return nnx.BatchNorm(
        norm.num_features,
        use_running_average=use_running_average,
        axis=norm.axis,
        momentum=norm.momentum,
        epsilon=norm.epsilon,
        use_bias=norm.use_bias,
        use_scale=norm.use_scale,
        use_fast_variance=norm.use_fast_variance,
        rngs=nnx.Rngs(0),
    )


# name: (factory(dtype) -> norm, flax template builder, one member's input shape)
PER_SAMPLE = {
    "layer_norm": (
        lambda **kw: EnsembleLayerNorm(
            6, num_members=E, bias_init=RANDOM, scale_init=RANDOM, **kw
        ),
        flax_layer_norm,
        (2, 4, 6),
    ),
    "layer_norm_two_axes": (
        lambda **kw: EnsembleLayerNorm(
            6,
            num_members=E,
            reduction_axes=(-2, -1),
            use_fast_variance=False,
            scale_init=RANDOM,
            **kw,
        ),
        flax_layer_norm,
        (2, 4, 6),
    ),
    "layer_norm_no_bias": (
        lambda **kw: EnsembleLayerNorm(
            5, num_members=E, use_bias=False, scale_init=RANDOM, **kw
        ),
        flax_layer_norm,
        (3, 5),
    ),
    "rms_norm": (
        lambda **kw: EnsembleRMSNorm(6, num_members=E, scale_init=RANDOM, **kw),
        flax_rms_norm,
        (2, 4, 6),
    ),
    "rms_norm_no_scale": (
        lambda **kw: EnsembleRMSNorm(5, num_members=E, use_scale=False, **kw),
        flax_rms_norm,
        (3, 5),
    ),
}


def tiled_shape(member_shape):
    return (E * member_shape[0], *member_shape[1:])


@pytest.mark.parametrize("name", list(PER_SAMPLE))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_per_sample_norms_match_flax_per_member(name, dtype, formulation):
    factory, template, member_shape = PER_SAMPLE[name]
    norm = factory(dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    x = random_input(1, tiled_shape(member_shape), dtype, mean=2.0)
    expected = flax_reference(norm, template(norm), x)
    for y in (norm(x), nnx.jit(lambda m, x: m(x))(norm, x)):
        assert y.dtype == dtype and y.shape == x.shape
        assert_close(y, expected, dtype, scale=2)


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_per_sample_gradients_match_jax_grad_of_flax_reference(
    name, dtype, formulation
):
    factory, template, member_shape = PER_SAMPLE[name]
    norm = factory(dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    x = random_input(1, tiled_shape(member_shape), dtype)
    cotangent = random_input(2, x.shape)
    grads, grad_x = nnx.jit(
        nnx.grad(
            lambda m, x: jnp.sum(m(x).astype(jnp.float32) * cotangent),
            argnums=(0, 1),
        )
    )(norm, x)
    graphdef, _ = nnx.split(template(norm))
    names = [n for n in ("scale", "bias") if getattr(norm, n, None) is not None]

    @jax.jit
    def reference_grads(params, x):
        def loss(params, x):
            outputs = []
            for k in range(E):
                state = {n: nnx.Param(params[n][k].astype(jnp.float32)) for n in names}
                module = nnx.merge(graphdef, nnx.State(state))
                rows = x[k * member_shape[0] : (k + 1) * member_shape[0]]
                outputs.append(module(rows.astype(jnp.float32)))
            return jnp.sum(jnp.concatenate(outputs) * cotangent)

        return jax.grad(loss, argnums=(0, 1))(params, x)

    expected, expected_x = reference_grads({n: getattr(norm, n)[...] for n in names}, x)
    for n in names:
        assert_close(getattr(grads, n)[...], expected[n], dtype, scale=8)
    assert_close(grad_x, expected_x, dtype, scale=8)


def make_batch_norm(**kwargs):
    kwargs = {"bias_init": RANDOM, "scale_init": RANDOM, "momentum": 0.8, **kwargs}
    return EnsembleBatchNorm(4, num_members=E, rngs=nnx.Rngs(0), **kwargs)


def numpy_statistics(x, axis=-1):
    """Per-member mean and variance over every axis but `axis`, in numpy."""
    members = np.asarray(x, np.float64).reshape(E, -1, *x.shape[1:])
    members = np.moveaxis(members, axis if axis < 0 else axis + 1, -1)
    flat = members.reshape(E, -1, members.shape[-1])
    return flat.mean(1), flat.var(1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("axis, member_shape", [(-1, (5, 4)), (1, (3, 4, 2))])
def test_batch_norm_training_matches_flax_per_member(
    dtype, axis, member_shape, formulation
):
    norm = make_batch_norm(axis=axis, dtype=dtype)
    norm.mean[...] = random_input(3, (E, 4))
    norm.var[...] = random_input(4, (E, 4), mean=2.0) ** 2
    mean0, var0 = np.asarray(norm.mean[...]), np.asarray(norm.var[...])
    x = random_input(1, tiled_shape(member_shape), dtype, mean=1.0)
    expected = flax_reference(
        norm, flax_batch_norm(norm, False), x, use_running_average=False
    )
    y = nnx.jit(lambda m, x: m(x))(norm, x)
    assert y.dtype == dtype
    assert_close(y, expected, dtype, scale=2)
    batch_mean, batch_var = numpy_statistics(x, axis)
    tol = {"rtol": 1e-5, "atol": 1e-5}
    np.testing.assert_allclose(norm.mean[...], 0.8 * mean0 + 0.2 * batch_mean, **tol)
    np.testing.assert_allclose(norm.var[...], 0.8 * var0 + 0.2 * batch_var, **tol)
    # A second, eager step moves the averages again, per member.
    norm(x)
    np.testing.assert_allclose(norm.mean[...], 0.64 * mean0 + 0.36 * batch_mean, **tol)


def test_batch_norm_eval_uses_running_averages():
    norm = make_batch_norm()
    norm.mean[...] = random_input(3, (E, 4))
    norm.var[...] = random_input(4, (E, 4), mean=2.0) ** 2
    before = jax.tree.map(np.array, nnx.state(norm, nnx.BatchStat))
    x = random_input(1, (E * 5, 4))
    members = np.asarray(x).reshape(E, 5, 4)
    mean, var = np.asarray(norm.mean[...]), np.asarray(norm.var[...])
    scale, bias = np.asarray(norm.scale[...]), np.asarray(norm.bias[...])
    expected = (members - mean[:, None]) / np.sqrt(var[:, None] + 1e-5)
    expected = (expected * scale[:, None] + bias[:, None]).reshape(x.shape)

    view = nnx.view(norm, use_running_average=True)
    assert view.use_running_average is True and norm.use_running_average is False
    assert_close(view(x), expected)
    assert_close(norm(x, use_running_average=True), expected)
    norm.eval()
    assert norm.use_running_average is True
    assert_close(nnx.jit(lambda m, x: m(x))(norm, x), expected)
    assert_trees_equal(before, nnx.state(norm, nnx.BatchStat))
    norm.train()
    assert norm.use_running_average is False


def test_batch_norm_gradients_match_jax_grad_of_flax_reference(formulation):
    norm = make_batch_norm()
    x = random_input(1, (E * 5, 4))
    cotangent = random_input(2, x.shape)
    grads, grad_x = nnx.grad(lambda m, x: jnp.sum(m(x) * cotangent), argnums=(0, 1))(
        norm, x
    )
    graphdef, _ = nnx.split(flax_batch_norm(norm, False))

    @jax.jit
    def reference_grads(scale, bias, x):
        def loss(scale, bias, x):
            outputs = []
            for k in range(E):
                state = {
                    "scale": nnx.Param(scale[k]),
                    "bias": nnx.Param(bias[k]),
                    "mean": nnx.BatchStat(jnp.zeros(4)),
                    "var": nnx.BatchStat(jnp.ones(4)),
                }
                module = nnx.merge(graphdef, nnx.State(state))
                outputs.append(module(x[5 * k : 5 * k + 5]))
            return jnp.sum(jnp.concatenate(outputs) * cotangent)

        return jax.grad(loss, argnums=(0, 1, 2))(scale, bias, x)

    expected = reference_grads(norm.scale[...], norm.bias[...], x)
    assert_close(grads.scale[...], expected[0])
    assert_close(grads.bias[...], expected[1])
    assert_close(grad_x, expected[2], scale=4)
    assert "mean" not in grads


NORMS = {
    "layer_norm": lambda: EnsembleLayerNorm(4, num_members=E, rngs=nnx.Rngs(0)),
    "rms_norm": lambda: EnsembleRMSNorm(4, num_members=E, rngs=nnx.Rngs(0)),
    "batch_norm": make_batch_norm,
}


@pytest.mark.parametrize("name", list(NORMS))
def test_changing_one_member_changes_no_other_member(name):
    norm = NORMS[name]()
    x = random_input(1, (E * 3, 2, 4))
    changed = x.at[3:6].set(100.0 * random_input(2, (3, 2, 4)))
    y, y_changed = norm(x), norm(changed)
    np.testing.assert_array_equal(y[:3], y_changed[:3])
    np.testing.assert_array_equal(y[6:], y_changed[6:])
    assert not np.allclose(y[3:6], y_changed[3:6])


@pytest.mark.parametrize("name", list(NORMS))
def test_member_view_and_extracted_member_match_rows(name):
    norm = NORMS[name]()
    if name == "batch_norm":
        norm.mean[...] = random_input(3, (E, 4))
    else:
        norm.scale[...] = random_input(3, (E, 4))
    x = random_input(1, (3, 2, 4))
    full = ensembles.untile(norm(ensembles.tile(x, E)), E)
    if name == "batch_norm":
        norm.eval()
        full_eval = ensembles.untile(norm(ensembles.tile(x, E)), E)
        norm.train()
    # Extracted before the (training) views move the running averages.
    plains = [norm.extract_member(k) for k in range(E)]
    for k, plain in enumerate(plains):
        view = nnx.view(norm, member=k)
        assert view.member == k and norm.member is None
        assert_close(view(x), full[k])
        assert type(plain).__name__ == name.title().replace("_", "").replace(
            "Rms", "RMS"
        )
        if name == "batch_norm":
            plain.eval()
            assert_close(plain(x), full_eval[k])
        else:
            assert_close(plain(x), full[k])


def test_batch_norm_member_view_updates_only_its_member():
    norm = make_batch_norm()
    before = np.array(norm.mean[...])
    view = nnx.view(norm, member=1)
    x = random_input(1, (5, 4), mean=3.0)
    y = view(x)
    after = np.asarray(norm.mean[...])
    np.testing.assert_array_equal(after[[0, 2]], before[[0, 2]])
    np.testing.assert_allclose(after[1], 0.8 * before[1] + 0.2 * np.mean(x, 0), 1e-5)
    plain = nnx.BatchNorm(4, momentum=0.8, rngs=nnx.Rngs(0))
    plain.scale[...], plain.bias[...] = norm.scale[1], norm.bias[1]
    assert_close(y, plain(x))


def test_view_info_and_model_views():
    info = nnx.view_info(make_batch_norm())
    assert "member: int | None = None" in info
    assert "use_running_average: bool | None = None" in info
    assert "member: int | None = None" in nnx.view_info(NORMS["layer_norm"]())

    model = nnx.Sequential(
        BatchEnsembleLinearGeneral(4, (2, 3), num_members=E, rngs=nnx.Rngs(0)),
        EnsembleLayerNorm(3, num_members=E, scale_init=RANDOM, rngs=nnx.Rngs(1)),
        EnsembleBatchNorm(3, num_members=E, bias_init=RANDOM, rngs=nnx.Rngs(2)),
    )
    model.eval()
    x = random_input(0, (2, 5, 4))
    full = ensembles.untile(model(ensembles.tile(x, E)), E)
    for k in range(E):
        assert_close(nnx.view(model, member=k)(x), full[k])


class TestFromFlax:
    def test_from_layer_norm(self):
        norm = nnx.LayerNorm(
            4, bias_init=RANDOM, scale_init=RANDOM, epsilon=1e-3, rngs=nnx.Rngs(0)
        )
        before = jax.tree.map(np.array, nnx.state(norm))
        ensemble = EnsembleLayerNorm.from_layer_norm(norm, num_members=E)
        assert ensemble.epsilon == 1e-3 and ensemble.scale.shape == (E, 4)
        x = random_input(1, (3, 2, 4))
        y = ensembles.untile(ensemble(ensembles.tile(x, E)), E)
        for k in range(E):
            assert_close(y[k], norm(x))
        ensemble.scale[...] = ensemble.scale[...] + 1
        assert_trees_equal(before, nnx.state(norm))

    def test_from_rms_norm(self):
        norm = nnx.RMSNorm(4, scale_init=RANDOM, rngs=nnx.Rngs(0))
        ensemble = EnsembleRMSNorm.from_rms_norm(norm, num_members=E)
        x = random_input(1, (3, 4))
        y = ensembles.untile(ensemble(ensembles.tile(x, E)), E)
        for k in range(E):
            assert_close(y[k], norm(x))

    @pytest.mark.parametrize("use_running_average", [True, False])
    def test_from_batch_norm(self, use_running_average):
        norm = nnx.BatchNorm(
            4,
            use_running_average=use_running_average,
            momentum=0.7,
            bias_init=RANDOM,
            rngs=nnx.Rngs(0),
        )
        norm.mean[...] = random_input(2, (4,))
        norm.var[...] = random_input(3, (4,), mean=2.0) ** 2
        ensemble = EnsembleBatchNorm.from_batch_norm(norm, num_members=E)
        assert ensemble.use_running_average is use_running_average
        assert ensemble.momentum == 0.7
        x = random_input(1, (5, 4))
        y = ensembles.untile(ensemble(ensembles.tile(x, E)), E)
        expected = norm(x)  # in training this also moves norm's averages
        for k in range(E):
            assert_close(y[k], expected)
            assert_close(ensemble.mean[k], norm.mean[...])
            assert_close(ensemble.var[k], norm.var[...])

    @pytest.mark.parametrize(
        "method, flax_layer",
        [
            (EnsembleLayerNorm.from_layer_norm, nnx.RMSNorm),
            (EnsembleRMSNorm.from_rms_norm, nnx.LayerNorm),
            (EnsembleBatchNorm.from_batch_norm, nnx.LayerNorm),
        ],
    )
    def test_rejects_other_layers(self, method, flax_layer):
        with pytest.raises(TypeError, match=r"`norm` must be an `nnx\."):
            method(flax_layer(4, rngs=nnx.Rngs(0)), num_members=E)


class TestErrors:
    @pytest.mark.parametrize("name", list(NORMS))
    def test_batch_not_multiple_of_members(self, name):
        norm = NORMS[name]()
        before = jax.tree.map(np.array, nnx.state(norm))
        with pytest.raises(
            ValueError,
            match=r"`inputs.shape\[0\]` \(=4\) must be a multiple of `num_members` "
            r"\(=3\)",
        ):
            norm(random_input(0, (4, 4)))
        assert_trees_equal(before, nnx.state(norm))

    @pytest.mark.parametrize("name", list(NORMS))
    def test_wrong_features(self, name):
        norm = NORMS[name]()
        before = jax.tree.map(np.array, nnx.state(norm))
        with pytest.raises(
            ValueError, match=r"The feature axes \(2,\) of `inputs` hold 5 features"
        ):
            norm(random_input(0, (6, 2, 5)))
        assert_trees_equal(before, nnx.state(norm))

    def test_wrong_rank(self):
        norm = EnsembleLayerNorm(
            4, num_members=E, reduction_axes=(-2, -1), rngs=nnx.Rngs(0)
        )
        with pytest.raises(
            ValueError, match=r"`reduction_axes` \(=\(-2, -1\)\) holds -2, out of"
        ):
            norm(random_input(0, (6,)))

    @pytest.mark.parametrize(
        "cls", [EnsembleLayerNorm, EnsembleRMSNorm, EnsembleBatchNorm]
    )
    @pytest.mark.parametrize(
        "num_members, error", [(0, ValueError), (1.5, TypeError), (None, TypeError)]
    )
    def test_bad_num_members(self, cls, num_members, error):
        with pytest.raises(error, match=r"`num_members` must be an int >= 1"):
            cls(4, num_members=num_members, rngs=nnx.Rngs(0))

    @pytest.mark.parametrize("name", list(NORMS))
    @pytest.mark.parametrize(
        "member, error", [(3, ValueError), (-1, ValueError), ("0", TypeError)]
    )
    def test_bad_member(self, name, member, error):
        norm = NORMS[name]()
        with pytest.raises(error, match=r"`member` must be"):
            nnx.view(norm, member=member)
        with pytest.raises(error, match=r"`member` must be"):
            norm.extract_member(member)
        assert norm.member is None

    def test_bad_use_running_average_view_mutates_nothing(self):
        norm = make_batch_norm()
        with pytest.raises(ValueError, match=r"`member` must be in"):
            norm.set_view(member=5, use_running_average=True)
        with pytest.raises(TypeError, match=r"`use_running_average` must be a bool"):
            norm.set_view(member=1, use_running_average="yes")
        assert norm.member is None and norm.use_running_average is False

    def test_batch_norm_without_use_running_average(self):
        norm = make_batch_norm(use_running_average=None)
        with pytest.raises(ValueError, match=r"No `use_running_average`"):
            norm(random_input(0, (6, 4)))

    def test_initializer_returning_wrong_shape(self):
        bad = lambda key, shape, dtype: jnp.ones(shape[1:], dtype)  # noqa: E731
        with pytest.raises(ValueError, match=r"`scale_init` returned an array"):
            EnsembleLayerNorm(4, num_members=E, scale_init=bad, rngs=nnx.Rngs(0))
