import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import ensembles
from ensembles import BatchEnsembleLinear, FastWeight, initializers
from ensembles.layers.sharding import member_axis_metadata
from tests.covering import covering
from tests.reference import assert_trees_equal, dense_reference
from tests.tolerances import assert_close

MIDDLE_SHAPES = {2: (), 3: (3,), 4: (2, 3)}


def member_linear(layer, k):
    """The plain nnx.Linear member k should behave as: effective kernel and bias."""
    linear = nnx.Linear(
        layer.in_features,
        layer.out_features,
        use_bias=layer.use_bias,
        dtype=layer.dtype,
        param_dtype=layer.param_dtype,
        rngs=nnx.Rngs(0),
    )
    linear.kernel[...] = layer.kernel[...] * jnp.outer(layer.r[k], layer.s[k])
    if layer.use_bias:
        linear.bias[...] = layer.bias[k]
    return linear


def random_input(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def make_layer(num_members=3, in_features=6, out_features=4, **kwargs):
    return BatchEnsembleLinear(
        in_features, out_features, num_members=num_members, rngs=nnx.Rngs(0), **kwargs
    )


# Every rank, E, dtype and eager/jit, and every pair of their values: 9 of the
# 36 combinations (tests/covering.py checks the claim).
FORWARD_CASES = covering(
    {
        "jit": [False, True],
        "dtype": [jnp.float32, jnp.bfloat16],
        "num_members": [1, 2, 5],
        "rank": [2, 3, 4],
    },
    [
        (False, jnp.float32, 1, 2),
        (True, jnp.bfloat16, 2, 2),
        (True, jnp.float32, 5, 2),
        (True, jnp.bfloat16, 1, 3),
        (False, jnp.float32, 2, 3),
        (False, jnp.bfloat16, 5, 3),
        (False, jnp.bfloat16, 1, 4),
        (True, jnp.float32, 2, 4),
        (True, jnp.bfloat16, 5, 4),
    ],
)


@pytest.mark.parametrize("jit, dtype, num_members, rank", FORWARD_CASES)
def test_forward_matches_flax_linear_per_member(rank, num_members, dtype, jit):
    layer = make_layer(
        num_members,
        dtype=dtype,
        param_dtype=dtype,
        bias_init=nnx.initializers.normal(1.0),
    )
    batch = 2
    x = random_input(rank, (num_members * batch, *MIDDLE_SHAPES[rank], 6), dtype)
    call = nnx.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    y = call(layer, x)
    assert y.dtype == dtype
    assert y.shape == (num_members * batch, *MIDDLE_SHAPES[rank], 4)
    for k in range(num_members):
        rows = slice(k * batch, (k + 1) * batch)
        assert_close(y[rows], member_linear(layer, k)(x[rows]), dtype, scale=4)


def test_bf16_layer_returns_bf16_with_f32_params():
    layer = make_layer(dtype=jnp.bfloat16)
    assert layer.r[...].dtype == jnp.float32
    y = layer(random_input(0, (6, 6)))
    assert y.dtype == jnp.bfloat16


def test_f32_inputs_and_bf16_params_promote_like_flax():
    layer = make_layer(param_dtype=jnp.bfloat16)
    x = random_input(0, (6, 6))
    assert layer(x).dtype == member_linear(layer, 0)(x[:2]).dtype


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("use_bias", [True, False])
def test_gradients_match_jax_grad_of_reference(dtype, use_bias):
    num_members, batch = 3, 2
    layer = make_layer(num_members, dtype=dtype, param_dtype=dtype, use_bias=use_bias)
    x = random_input(1, (num_members * batch, 3, 6), dtype)
    cotangent = random_input(2, (num_members * batch, 3, 4))

    def loss(layer, x):
        return jnp.sum(layer(x).astype(jnp.float32) * cotangent)

    grads, grad_x = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(layer, x)

    def reference_loss(kernel, r, s, bias, x):
        y = dense_reference(x, kernel, r, s, bias, num_members)
        return jnp.sum(y * cotangent)

    bias = layer.bias[...] if use_bias else None
    expected = jax.grad(reference_loss, argnums=(0, 1, 2, 3, 4))(
        layer.kernel[...], layer.r[...], layer.s[...], bias, x
    )
    names = ["kernel", "r", "s", "bias"]
    for name, e in zip(names, expected[:4], strict=True):
        if name == "bias" and not use_bias:
            assert "bias" not in grads
            continue
        assert_close(getattr(grads, name)[...], e, dtype, scale=8)
    assert_close(grad_x, expected[4], dtype, scale=8)


def test_parameters_and_attributes():
    layer = make_layer(3, 6, 4, precision="highest", impl="xla")
    assert type(layer.kernel) is nnx.Param and layer.kernel.shape == (6, 4)
    assert type(layer.r) is FastWeight and layer.r.shape == (3, 6)
    assert type(layer.s) is FastWeight and layer.s.shape == (3, 4)
    assert type(layer.bias) is nnx.Param and layer.bias.shape == (3, 4)
    assert isinstance(layer.r, nnx.Param)
    assert (layer.in_features, layer.out_features, layer.num_members) == (6, 4, 3)
    assert layer.use_bias and layer.dtype is None
    assert layer.param_dtype == jnp.float32
    assert layer.precision == "highest" and layer.impl == "xla"
    assert layer.member is None
    assert not isinstance(layer, nnx.Linear)
    no_bias = make_layer(use_bias=False)
    assert no_bias.bias is None
    assert "bias" not in nnx.state(no_bias)


def test_default_initializers():
    layer = make_layer(4, 300, 200)
    np.testing.assert_array_equal(layer.bias[...], 0.0)
    for fast in (layer.r[...], layer.s[...]):
        # The default N(1, 0.5), within 4 standard errors of the draw.
        assert abs(float(fast.mean()) - 1.0) < 4 * 0.6 / fast.size**0.5
        assert abs(float(fast.std()) - 0.5) < 4 * 0.5 / (2 * fast.size) ** 0.5
    # nnx.Linear's default: lecun_normal, variance 1 / fan_in.
    assert abs(float(layer.kernel[...].var()) * 300 - 1.0) < 0.1


def test_metadata_is_attached():
    layer = make_layer(
        kernel_metadata={"tag": "k"},
        bias_metadata={"tag": "b"},
        fast_weight_metadata={"tag": "f"},
    )
    assert layer.kernel.get_metadata()["tag"] == "k"
    assert layer.bias.get_metadata()["tag"] == "b"
    assert layer.r.get_metadata()["tag"] == "f"
    assert layer.s.get_metadata()["tag"] == "f"


def test_two_layers_from_one_rngs_differ():
    rngs = nnx.Rngs(0)
    a = BatchEnsembleLinear(5, 5, num_members=2, rngs=rngs)
    b = BatchEnsembleLinear(5, 5, num_members=2, rngs=rngs)
    for name in ("kernel", "r", "s"):
        assert not np.allclose(getattr(a, name)[...], getattr(b, name)[...]), name
    # ... and r and s of one layer differ from each other.
    assert not np.allclose(a.r[...], a.s[...])


class TestFromLinear:
    def linear(self, **kwargs):
        linear = nnx.Linear(6, 4, rngs=nnx.Rngs(3), **kwargs)
        if linear.bias is not None:
            linear.bias[...] = random_input(4, (4,), linear.param_dtype)
        return linear

    @pytest.mark.parametrize("use_bias", [True, False])
    def test_ones_reproduce_the_original_for_every_member(self, use_bias):
        linear = self.linear(use_bias=use_bias)
        layer = BatchEnsembleLinear.from_linear(
            linear,
            num_members=3,
            rngs=nnx.Rngs(0),
            r_init=initializers.ones(),
            s_init=initializers.ones(),
        )
        x = random_input(5, (2, 6))
        y = ensembles.untile(layer(ensembles.tile(x, 3)), 3)
        for k in range(3):
            assert_close(y[k], linear(x))
        assert layer.use_bias is use_bias

    def test_random_fast_weights_are_the_effective_kernel(self):
        linear = self.linear()
        layer = BatchEnsembleLinear.from_linear(linear, num_members=3, rngs=nnx.Rngs(0))
        np.testing.assert_array_equal(layer.kernel[...], linear.kernel[...])
        for k in range(3):
            np.testing.assert_array_equal(layer.bias[k], linear.bias[...])
        x = random_input(5, (6, 6))
        y = layer(x)
        for k in range(3):
            rows = slice(2 * k, 2 * k + 2)
            assert_close(y[rows], member_linear(layer, k)(x[rows]))
        assert not np.allclose(y[0:2], y[2:4])

    def test_copies_configuration(self):
        linear = self.linear(
            dtype=jnp.bfloat16,
            param_dtype=jnp.bfloat16,
            precision="highest",
            preferred_element_type=jnp.float32,
        )
        layer = BatchEnsembleLinear.from_linear(linear, num_members=2, rngs=nnx.Rngs(0))
        assert layer.dtype == jnp.bfloat16 and layer.param_dtype == jnp.bfloat16
        assert layer.precision == "highest"
        assert layer.preferred_element_type == jnp.float32
        assert layer.r[...].dtype == jnp.bfloat16
        assert layer.kernel[...].dtype == jnp.bfloat16

    def test_copied_kernel_is_independent_and_original_unchanged(self):
        linear = self.linear()
        before = jax.tree.map(np.array, nnx.state(linear))
        layer = BatchEnsembleLinear.from_linear(linear, num_members=2, rngs=nnx.Rngs(0))
        assert layer.kernel is not linear.kernel
        layer.kernel[...] = layer.kernel[...] + 1.0
        layer.bias[...] = layer.bias[...] + 1.0
        after = jax.tree.map(np.array, nnx.state(linear))
        assert_trees_equal(before, after)
        assert type(linear) is nnx.Linear

    def test_shared_kernel_is_the_same_variable(self):
        linear = self.linear()
        layer = BatchEnsembleLinear.from_linear(
            linear, num_members=2, rngs=nnx.Rngs(0), share_kernel=True
        )
        assert layer.kernel is linear.kernel
        layer.kernel[...] = jnp.zeros((6, 4))
        np.testing.assert_array_equal(linear.kernel[...], 0.0)
        # The bias is per member, so it can never be shared.
        assert layer.bias is not linear.bias

    def test_kernel_metadata_kept_and_bias_metadata_gets_member_axis(self):
        linear = self.linear(kernel_metadata={"tag": "k"})
        layer = BatchEnsembleLinear.from_linear(linear, num_members=2, rngs=nnx.Rngs(0))
        assert layer.kernel.get_metadata()["tag"] == "k"
        assert member_axis_metadata({"sharding_names": ("model",), "x": 1}) == {
            "sharding_names": (None, "model"),
            "x": 1,
        }

    def test_rejects_non_linear(self):
        with pytest.raises(
            TypeError,
            match=r"`linear` must be an `nnx.Linear`, got "
            r"BatchEnsembleLinear",
        ):
            BatchEnsembleLinear.from_linear(
                make_layer(), num_members=2, rngs=nnx.Rngs(0)
            )

    def test_rejects_custom_dot_general(self):
        linear = self.linear(dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k))
        with pytest.raises(ValueError, match=r"`linear.dot_general` is a custom"):
            BatchEnsembleLinear.from_linear(linear, num_members=2, rngs=nnx.Rngs(0))


class TestViews:
    def test_member_view_equals_rows_of_member(self):
        layer = make_layer(3)
        x = random_input(0, (2, 5, 6))
        full = ensembles.untile(layer(ensembles.tile(x, 3)), 3)
        for k in range(3):
            view = nnx.view(layer, member=k)
            assert view.member == k and layer.member is None
            assert_close(view(x), full[k])
            assert_close(nnx.jit(lambda m, x: m(x))(view, x), full[k])

    def test_member_view_gradients_reach_member_rows_only(self):
        layer = make_layer(3)
        x = random_input(0, (2, 6))
        grads = nnx.grad(lambda m: jnp.sum(m(x)))(nnx.view(layer, member=1))
        grad_r, grad_bias = np.asarray(grads.r[...]), np.asarray(grads.bias[...])
        assert np.all(grad_r[[0, 2]] == 0) and np.any(grad_r[1] != 0)
        assert np.all(grad_bias[[0, 2]] == 0) and np.all(grad_bias[1] != 0)

    def test_impl_view(self):
        layer = make_layer()
        assert layer.impl == "xla"  # the default: no table decides it
        view = nnx.view(layer, impl="pallas")
        assert view.impl == "pallas" and layer.impl == "xla"
        x = random_input(0, (6, 6))
        np.testing.assert_array_equal(nnx.view(view, impl="xla")(x), layer(x))

    def test_view_info_lists_member_and_impl(self):
        info = nnx.view_info(make_layer())
        assert "BatchEnsembleLinear" in info
        assert "member: int | None = None" in info
        assert "impl: str | None = None" in info
        assert "un-tiled" in info

    @pytest.mark.parametrize(
        "kwargs, error, match",
        [
            (
                {"member": 3},
                ValueError,
                r"`member` must be in \[0, num_members\) = "
                r"\[0, 3\), got 3",
            ),
            ({"member": -1}, ValueError, r"got -1"),
            ({"member": 1.0}, TypeError, r"`member` must be an int, got 1.0"),
            ({"member": 1, "impl": "fast"}, ValueError, r"`impl` must be one of"),
        ],
    )
    def test_bad_views_raise_and_change_nothing(self, kwargs, error, match):
        layer = make_layer(3)
        with pytest.raises(error, match=match):
            layer.set_view(**kwargs)
        assert layer.member is None and layer.impl == "xla"
        with pytest.raises(error, match=match):
            nnx.view(layer, **kwargs)


class Model(nnx.Module):
    """A small model that sows and perturbs around a BatchEnsembleLinear."""

    def __init__(self, num_members, rngs):
        self.hidden = BatchEnsembleLinear(6, 5, num_members=num_members, rngs=rngs)
        self.head = BatchEnsembleLinear(5, 2, num_members=num_members, rngs=rngs)

    def __call__(self, x):
        h = self.hidden(x)
        self.sow(nnx.Intermediate, "features", h)
        h = self.perturb("hidden_grad", h)
        return self.head(jnp.tanh(h))


def mlp(num_members, rngs):
    return nnx.Sequential(
        BatchEnsembleLinear(6, 5, num_members=num_members, rngs=rngs),
        nnx.tanh,
        BatchEnsembleLinear(5, 2, num_members=num_members, rngs=rngs),
    )


class TestModuleFeatures:
    def test_capture_sow(self):
        model = Model(3, nnx.Rngs(0))
        x = random_input(0, (6, 6))
        y, intermediates = nnx.capture(model, nnx.Intermediate)(x)
        (hidden,) = intermediates["features"]
        np.testing.assert_array_equal(hidden, model.hidden(x))
        np.testing.assert_array_equal(y, model.head(jnp.tanh(hidden)))

    def test_perturb_gradients(self):
        model = Model(3, nnx.Rngs(0))
        x = random_input(0, (6, 6))
        _, perturbations = nnx.capture(model, nnx.Perturbation)(x)

        def loss(model, perturbations, x):
            y, sowed = nnx.capture(model, nnx.Intermediate, init=perturbations)(x)
            return jnp.sum(y**2), sowed

        (_, perturb_grads), _ = nnx.grad(loss, argnums=(0, 1), has_aux=True)(
            model, perturbations, x
        )
        hidden = model.hidden(x)
        expected = jax.grad(lambda h: jnp.sum(model.head(jnp.tanh(h)) ** 2))(hidden)
        assert_close(perturb_grads["hidden_grad"][...], expected)

    def test_split_merge_roundtrip(self):
        model = mlp(2, nnx.Rngs(0))
        x = random_input(0, (4, 6))
        graphdef, state = nnx.split(model)
        fast_paths = {
            path for path, _ in nnx.to_flat_state(nnx.state(model, FastWeight))
        }
        assert fast_paths == {
            ("layers", 0, "r"),
            ("layers", 0, "s"),
            ("layers", 2, "r"),
            ("layers", 2, "s"),
        }
        np.testing.assert_array_equal(nnx.merge(graphdef, state)(x), model(x))

    def test_optimizer_step_lowers_loss(self):
        model = mlp(3, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        x = random_input(0, (3 * 8, 6))
        target = random_input(1, (3 * 8, 2))

        @nnx.jit
        def step(model, optimizer):
            def loss_fn(model):
                return jnp.mean((model(x) - target) ** 2)

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        r_before = np.array(model.layers[0].r[...])
        losses = [float(step(model, optimizer)) for _ in range(20)]
        assert losses[-1] < 0.8 * losses[0]
        assert not np.allclose(model.layers[0].r[...], r_before)


class TestErrors:
    def test_batch_not_multiple_of_members(self):
        with pytest.raises(
            ValueError,
            match=r"`inputs.shape\[0\]` \(=4\) must be a "
            r"multiple of `num_members` \(=3\).*ensembles.tile",
        ):
            make_layer(3)(random_input(0, (4, 6)))

    def test_wrong_feature_size(self):
        with pytest.raises(
            ValueError,
            match=r"`inputs.shape\[-1\]` \(=5\) must "
            r"equal in_features",
        ):
            make_layer(3)(random_input(0, (6, 5)))

    @pytest.mark.parametrize(
        "bad, error",
        [(0, ValueError), (2.5, TypeError), (None, TypeError), (True, TypeError)],
    )
    def test_num_members(self, bad, error):
        with pytest.raises(
            error,
            match=rf"`num_members` must be an int >= 1, got "
            rf".*{bad}",
        ):
            BatchEnsembleLinear(3, 2, num_members=bad, rngs=nnx.Rngs(0))

    @pytest.mark.parametrize("name", ["in_features", "out_features"])
    def test_feature_counts(self, name):
        kwargs = {"in_features": 3, "out_features": 2, name: 0}
        with pytest.raises(ValueError, match=rf"`{name}` must be an int >= 1, got 0"):
            BatchEnsembleLinear(**kwargs, num_members=2, rngs=nnx.Rngs(0))

    def test_unknown_impl(self):
        with pytest.raises(
            ValueError,
            match=r"`impl` must be one of \['xla', 'pallas'\], got 'pallas_gpu'",
        ):
            make_layer(impl="pallas_gpu")

    @pytest.mark.parametrize("name", ["r_init", "s_init", "bias_init", "kernel_init"])
    def test_initializer_returning_wrong_shape(self, name):
        bad = lambda key, shape, dtype: jnp.ones(shape[1:], dtype)  # noqa: E731
        with pytest.raises(
            ValueError,
            match=rf"`{name}` returned an array of shape "
            r".* but the layer needs shape",
        ):
            make_layer(**{name: bad})


class TestExtractMember:
    @pytest.mark.parametrize("use_bias", [True, False])
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_extracted_member_is_a_plain_linear_matching_the_member(
        self, use_bias, dtype
    ):
        layer = make_layer(
            3,
            use_bias=use_bias,
            param_dtype=dtype,
            bias_init=nnx.initializers.normal(1.0),
        )
        x = random_input(0, (2, 4, 6), dtype)
        full = ensembles.untile(layer(ensembles.tile(x, 3)), 3)
        for k in range(3):
            linear = layer.extract_member(k)
            assert type(linear) is nnx.Linear
            assert linear.kernel[...].dtype == dtype
            assert (linear.bias is None) is (not use_bias)
            assert_close(linear(x), full[k], dtype, scale=4)
            assert_close(linear(x), nnx.view(layer, member=k)(x), dtype, scale=4)
            np.testing.assert_array_equal(
                linear.kernel[...],
                layer.kernel[...] * jnp.outer(layer.r[k], layer.s[k]).astype(dtype),
            )

    def test_roundtrip_through_from_linear_with_ones(self):
        linear = nnx.Linear(6, 4, rngs=nnx.Rngs(0))
        layer = BatchEnsembleLinear.from_linear(
            linear,
            num_members=2,
            rngs=nnx.Rngs(1),
            r_init=initializers.ones(),
            s_init=initializers.ones(),
        )
        back = layer.extract_member(1)
        assert_trees_equal(nnx.state(back), nnx.state(linear))

    def test_layer_unchanged_and_bad_member(self):
        layer = make_layer(3)
        before = jax.tree.map(np.array, nnx.state(layer))
        layer.extract_member(2).kernel[...] = jnp.zeros((6, 4))
        assert_trees_equal(before, nnx.state(layer))
        with pytest.raises(ValueError, match=r"`member` must be in \[0, num_members\)"):
            layer.extract_member(3)


@pytest.mark.parametrize(
    "make",
    [
        lambda: make_layer(2, 3, 4),
        lambda: ensembles.BatchEnsembleLinearGeneral(
            3, (2, 2), num_members=2, rngs=nnx.Rngs(0)
        ),
    ],
)
def test_out_sharding_places_outputs_like_flax(make):
    from jax.sharding import AxisType, PartitionSpec

    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
    x = random_input(0, (4, 3))
    with jax.set_mesh(mesh):
        layer = make()
        expected = layer(x)
        spec = PartitionSpec("data", *([None] * (expected.ndim - 1)))
        y = layer(x, out_sharding=spec)
        assert jax.typeof(y).sharding.spec == spec
    np.testing.assert_array_equal(y, expected)


def test_extract_member_of_a_module_without_it_says_what_to_define():
    class Custom(ensembles.layers.EnsembleModule):
        def __init__(self):
            self.num_members, self.member = 2, None

    with pytest.raises(
        NotImplementedError, match=r"does not implement `extract_member`"
    ):
        Custom().extract_member(0)
