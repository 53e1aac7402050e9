import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from ensembles import BatchEnsembleLinearGeneral, FastWeight, initializers
from ensembles.ops import batch_ensemble_dense_general
from tests.covering import covering
from tests.reference import (
    assert_trees_equal,
    flax_rows_reference,
    general_effective_kernel,
    numpy_normal,
)
from tests.tolerances import assert_close

# name: (in_features, out_features, constructor kwargs, one member's input shape)
CONFIGS = {
    # nnx.MultiHeadAttention's query/key/value: features -> (heads, head_dim).
    "attention_qkv": (8, (2, 4), {}, (2, 5, 8)),
    # ... and its output projection: (heads, head_dim) -> features.
    "attention_out": ((2, 4), 8, {"axis": (-2, -1)}, (2, 5, 2, 4)),
    "rank2": (6, 4, {}, (3, 6)),
    "middle_axis": (4, 3, {"axis": 1}, (2, 4, 5)),
    "unsorted_axes": ((2, 3), (4,), {"axis": (-1, -2)}, (2, 5, 2, 3)),
    "split_axes": ((2, 3), (2, 2), {"axis": (1, 3)}, (2, 2, 5, 3)),
    "batch_axis": (4, (3, 2), {"batch_axis": {0: 2}}, (2, 5, 4)),
    "two_batch_axes": (4, 3, {"batch_axis": {0: 2, 1: 5}}, (2, 5, 6, 4)),
}


def random_input(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def make_layer(config="attention_qkv", num_members=3, **kwargs):
    in_features, out_features, config_kwargs, _ = CONFIGS[config]
    # Drawn with numpy: jax.random would compile for each configuration's shapes
    # (the default initializers have tests of their own).
    kwargs = {
        "kernel_init": numpy_normal(0.5),
        "bias_init": numpy_normal(1.0),
        "r_init": numpy_normal(0.5, 1.0),
        "s_init": numpy_normal(0.5, 1.0),
        **config_kwargs,
        **kwargs,
    }
    return BatchEnsembleLinearGeneral(
        in_features,
        out_features,
        num_members=num_members,
        rngs=nnx.Rngs(0),
        **kwargs,
    )


def flax_template(layer, dtype=jnp.float32):
    """The plain nnx.LinearGeneral each member is, computing in `dtype`."""
    return nnx.LinearGeneral(
        layer.in_features,
        layer.out_features,
        axis=layer.axis,
        batch_axis=layer.batch_axis,
        use_bias=layer.use_bias,
        dtype=dtype,
        param_dtype=dtype,
        precision="highest",
        rngs=nnx.Rngs(0),
    )


def reference(layer, x, kernel=None, r=None, s=None, bias=None):
    """Each member's rows through Flax's LinearGeneral with its effective kernel."""
    kernel = layer.kernel[...] if kernel is None else kernel
    r = layer.r[...] if r is None else r
    s = layer.s[...] if s is None else s
    if bias is None and layer.use_bias:
        bias = layer.bias[...]
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    kernel, r, s, x = f32(kernel), f32(r), f32(s), f32(x)

    def member_state(k):
        eff = general_effective_kernel(kernel, r, s, k, len(layer.batch_axis))
        state = {"kernel": nnx.Param(eff)}
        if bias is not None:
            state["bias"] = nnx.Param(f32(bias[k]))
        return state

    return flax_rows_reference(flax_template(layer), member_state, x, layer.num_members)


def jitted_reference(layer):
    @jax.jit
    def run(kernel, r, s, bias, x):
        return reference(layer, x, kernel, r, s, bias)

    bias = layer.bias[...] if layer.use_bias else None
    return lambda x: run(layer.kernel[...], layer.r[...], layer.s[...], bias, x)


# Every configuration in float32 (jitted and eager); bfloat16 (jitted) on the
# axis layouts the bfloat16 gradient cases below do not run: 11 of the 16
# combinations.
FORWARD_CASES = covering(
    {"dtype": [jnp.float32, jnp.bfloat16], "config": list(CONFIGS)},
    [(jnp.float32, config) for config in CONFIGS]
    + [
        (jnp.bfloat16, config)
        for config in ("middle_axis", "split_axes", "two_batch_axes")
    ],
    pairs=[],
)


@pytest.mark.parametrize("dtype, config", FORWARD_CASES)
def test_forward_matches_flax_linear_general_per_member(config, dtype):
    num_members = 3
    layer = make_layer(config, num_members, dtype=dtype, param_dtype=dtype)
    member_shape = CONFIGS[config][3]
    x = random_input(1, (num_members * member_shape[0], *member_shape[1:]), dtype)
    expected = jitted_reference(layer)(x)
    outputs = [nnx.jit(lambda m, x: m(x))(layer, x)]
    if dtype == jnp.float32:  # eager once per configuration is enough
        outputs.append(layer(x))
    for y in outputs:
        assert y.dtype == dtype
        assert y.shape == expected.shape
        assert_close(y, expected, dtype, scale=4)


@pytest.mark.parametrize(
    "config, dtype, use_bias",
    [
        ("attention_qkv", jnp.float32, True),
        ("attention_qkv", jnp.bfloat16, False),
        ("attention_out", jnp.float32, False),
        ("attention_out", jnp.bfloat16, True),
        ("batch_axis", jnp.float32, True),
        ("batch_axis", jnp.bfloat16, True),
    ],
)
def test_gradients_match_jax_grad_of_flax_reference(config, dtype, use_bias):
    num_members = 3
    layer = make_layer(
        config, num_members, dtype=dtype, param_dtype=dtype, use_bias=use_bias
    )
    member_shape = CONFIGS[config][3]
    x = random_input(1, (num_members * member_shape[0], *member_shape[1:]), dtype)
    cotangent = random_input(2, jitted_reference(layer)(x).shape)

    def loss(layer, x):
        return jnp.sum(layer(x).astype(jnp.float32) * cotangent)

    grads, grad_x = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(layer, x)

    @jax.jit
    def reference_grads(kernel, r, s, bias, x):
        def reference_loss(kernel, r, s, bias, x):
            return jnp.sum(reference(layer, x, kernel, r, s, bias) * cotangent)

        return jax.grad(reference_loss, argnums=(0, 1, 2, 3, 4))(kernel, r, s, bias, x)

    bias = layer.bias[...] if use_bias else None
    expected = reference_grads(layer.kernel[...], layer.r[...], layer.s[...], bias, x)
    for name, e in zip(["kernel", "r", "s", "bias"], expected[:4], strict=True):
        if name == "bias" and not use_bias:
            assert "bias" not in grads
            continue
        assert_close(getattr(grads, name)[...], e, dtype, scale=8)
    assert_close(grad_x, expected[4], dtype, scale=8)


def test_op_without_batch_axes_runs_the_dense_op(monkeypatch):
    """The op flattens to the dense op (and passes `impl` through)."""
    calls = []
    original = ensembles.ops.dense.dense_rows

    def spy(*args, **kwargs):
        calls.append(kwargs["impl"])
        return original(*args, **kwargs)

    monkeypatch.setattr(ensembles.ops.dense, "dense_rows", spy)
    layer = make_layer("attention_out", impl="xla")
    x = random_input(0, (6, 5, 2, 4))
    assert_close(layer(x), reference(layer, x))
    assert calls == ["xla"]


def test_parameters_and_attributes():
    layer = make_layer("two_batch_axes", 3, precision="highest", impl="xla")
    assert type(layer.kernel) is nnx.Param and layer.kernel.shape == (2, 5, 4, 3)
    assert type(layer.r) is FastWeight and layer.r.shape == (3, 4)
    assert type(layer.s) is FastWeight and layer.s.shape == (3, 3)
    assert type(layer.bias) is nnx.Param and layer.bias.shape == (3, 2, 5, 3)
    assert layer.in_features == (4,) and layer.out_features == (3,)
    assert layer.axis == (-1,) and dict(layer.batch_axis) == {0: 2, 1: 5}
    assert layer.num_members == 3 and layer.member is None
    assert layer.precision == "highest" and layer.impl == "xla"
    out = make_layer("attention_out", use_bias=False)
    assert out.kernel.shape == (2, 4, 8) and out.r.shape == (3, 2, 4)
    assert out.bias is None and "bias" not in nnx.state(out)


def test_default_kernel_init_is_flax_flattened_lecun_normal():
    # Flax initializes [prod(in), prod(out)]: variance 1 / prod(in_features).
    layer = BatchEnsembleLinearGeneral(
        (10, 20), (30, 4), axis=(-2, -1), num_members=2, rngs=nnx.Rngs(0)
    )
    assert abs(float(np.var(layer.kernel[...])) * 200 - 1.0) < 0.1
    np.testing.assert_array_equal(layer.bias[...], 0.0)
    # The default fast weights N(1, 0.5), within 4 standard errors.
    r, s = layer.r[...], layer.s[...]
    assert abs(float(np.mean(r)) - 1.0) < 4 * 0.6 / r.size**0.5
    assert abs(float(np.std(s)) - 0.5) < 4 * 0.5 / (2 * s.size) ** 0.5


def test_bf16_layer_returns_bf16_with_f32_params():
    layer = make_layer(dtype=jnp.bfloat16)
    assert layer.r[...].dtype == jnp.float32
    assert layer(random_input(0, (6, 5, 8))).dtype == jnp.bfloat16


class TestFromLinearGeneral:
    @pytest.mark.parametrize("config", ["attention_qkv", "attention_out", "batch_axis"])
    @pytest.mark.parametrize("use_bias", [True, False])
    def test_ones_reproduce_the_original_for_every_member(self, config, use_bias):
        in_features, out_features, kwargs, member_shape = CONFIGS[config]
        original = nnx.LinearGeneral(
            in_features,
            out_features,
            use_bias=use_bias,
            bias_init=nnx.initializers.normal(1.0),
            rngs=nnx.Rngs(3),
            **kwargs,
        )
        layer = BatchEnsembleLinearGeneral.from_linear_general(
            original,
            num_members=3,
            rngs=nnx.Rngs(0),
            r_init=initializers.ones(),
            s_init=initializers.ones(),
        )
        x = random_input(5, member_shape)
        y = ensembles.untile(layer(ensembles.tile(x, 3)), 3)
        for k in range(3):
            assert_close(y[k], original(x))
        np.testing.assert_array_equal(layer.kernel[...], original.kernel[...])
        assert layer.use_bias is use_bias

    def test_multi_head_attention_projections(self):
        attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=8, decode=False, rngs=nnx.Rngs(0)
        )
        x = random_input(0, (2, 5, 8))
        heads = random_input(1, (2, 5, 2, 4))
        for name, inputs in [
            ("query", x),
            ("key", x),
            ("value", x),
            ("out", heads),
        ]:
            original = getattr(attention, name)
            layer = BatchEnsembleLinearGeneral.from_linear_general(
                original, num_members=2, rngs=nnx.Rngs(1)
            )
            tiled = ensembles.tile(inputs, 2)
            assert_close(layer(tiled), reference(layer, tiled))
            ones = BatchEnsembleLinearGeneral.from_linear_general(
                original,
                num_members=2,
                rngs=nnx.Rngs(1),
                r_init=initializers.ones(),
                s_init=initializers.ones(),
            )
            assert_close(ones(tiled)[2:], original(inputs))

    def test_copies_configuration_and_leaves_original_unchanged(self):
        original = nnx.LinearGeneral(
            (2, 4),
            6,
            axis=(-2, -1),
            dtype=jnp.bfloat16,
            precision="highest",
            kernel_metadata={"tag": "k"},
            rngs=nnx.Rngs(0),
        )
        before = jax.tree.map(np.array, nnx.state(original))
        layer = BatchEnsembleLinearGeneral.from_linear_general(
            original, num_members=2, rngs=nnx.Rngs(0)
        )
        assert layer.axis == (-2, -1) and layer.dtype == jnp.bfloat16
        assert layer.precision == "highest"
        assert layer.kernel.get_metadata()["tag"] == "k"
        assert layer.kernel is not original.kernel
        layer.kernel[...] = layer.kernel[...] + 1
        layer.bias[...] = layer.bias[...] + 1
        assert_trees_equal(before, nnx.state(original))
        shared = BatchEnsembleLinearGeneral.from_linear_general(
            original, num_members=2, rngs=nnx.Rngs(0), share_kernel=True
        )
        assert shared.kernel is original.kernel

    def test_rejects_non_linear_general_and_custom_dot_general(self):
        with pytest.raises(TypeError, match=r"`layer` must be an `nnx.LinearGeneral`"):
            BatchEnsembleLinearGeneral.from_linear_general(
                nnx.Linear(2, 3, rngs=nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(0)
            )
        custom = nnx.LinearGeneral(
            2,
            3,
            dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k),
            rngs=nnx.Rngs(0),
        )
        with pytest.raises(ValueError, match=r"`layer.dot_general` is a custom"):
            BatchEnsembleLinearGeneral.from_linear_general(
                custom, num_members=2, rngs=nnx.Rngs(0)
            )


class TestViewsAndExtract:
    @pytest.mark.parametrize("config", ["attention_out", "two_batch_axes"])
    def test_member_view_and_extracted_member_match_rows(self, config):
        layer = make_layer(config, 3)
        x = random_input(0, CONFIGS[config][3])
        full = ensembles.untile(layer(ensembles.tile(x, 3)), 3)
        for k in range(3):
            view = nnx.view(layer, member=k)
            assert view.member == k and layer.member is None
            assert_close(view(x), full[k])
            plain = layer.extract_member(k)
            assert type(plain) is nnx.LinearGeneral
            assert plain.batch_axis == layer.batch_axis
            assert_close(plain(x), full[k])

    def test_roundtrip_through_from_linear_general_with_ones(self):
        original = nnx.LinearGeneral(8, (2, 4), rngs=nnx.Rngs(0))
        layer = BatchEnsembleLinearGeneral.from_linear_general(
            original,
            num_members=2,
            rngs=nnx.Rngs(1),
            r_init=initializers.ones(),
            s_init=initializers.ones(),
        )
        assert_trees_equal(
            nnx.state(layer.extract_member(1)),
            nnx.state(original),
        )

    def test_view_info_and_bad_views(self):
        layer = make_layer()
        info = nnx.view_info(layer)
        assert "member: int | None = None" in info and "impl" in info
        for kwargs, error in [
            ({"member": 3}, ValueError),
            ({"member": "1"}, TypeError),
            ({"impl": "nope"}, ValueError),
        ]:
            with pytest.raises(error, match=r"`(member|impl)`"):
                nnx.view(layer, **kwargs)
            assert layer.member is None and layer.impl == "xla"
        with pytest.raises(ValueError, match=r"`member` must be in \[0, 3\)|\[0, 3\)"):
            layer.extract_member(3)


class TestErrors:
    def test_batch_not_multiple_of_members(self):
        with pytest.raises(
            ValueError,
            match=r"`inputs.shape\[0\]` \(=4\) must be a multiple of `num_members` "
            r"\(=3\)",
        ):
            make_layer()(random_input(0, (4, 5, 8)))

    def test_wrong_features(self):
        with pytest.raises(
            ValueError, match=r"`inputs.shape\[3\]` \(=5\) must equal the input"
        ):
            make_layer("attention_out")(random_input(0, (6, 5, 2, 5)))

    def test_rank_too_small_for_axis(self):
        with pytest.raises(ValueError, match=r"`axis` \(=\(-2, -1\)\) resolves to"):
            make_layer("attention_out")(random_input(0, (6, 8)))
        with pytest.raises(ValueError, match=r"`inputs` must have shape \[E\*B"):
            make_layer("rank2")(random_input(0, (6,)))

    def test_batch_axis_must_match_rows_per_member(self):
        with pytest.raises(
            ValueError,
            match=r"`inputs.shape\[0\] // num_members` \(=3\) must equal the "
            r"kernel batch size batch_axis\[0\]=2",
        ):
            make_layer("batch_axis")(random_input(0, (9, 5, 4)))

    @pytest.mark.parametrize(
        "kwargs, error, match",
        [
            ({"num_members": 0}, ValueError, r"`num_members` must be an int >= 1"),
            ({"num_members": 2.0}, TypeError, r"`num_members` must be an int"),
            ({"axis": (0, -1)}, ValueError, r"`axis` \(=\(0, -1\)\) must not"),
            ({"axis": (-1,)}, ValueError, r"`in_features` \(=\(2, 4\)\) and `axis`"),
            ({"batch_axis": {1: 2}}, ValueError, r"`batch_axis` keys \(1,\)"),
            ({"impl": "fast"}, ValueError, r"`impl` must be one of"),
        ],
    )
    def test_constructor(self, kwargs, error, match):
        base = {"num_members": 2, "axis": (-2, -1)}
        with pytest.raises(error, match=match):
            BatchEnsembleLinearGeneral(
                (2, 4), 3, rngs=nnx.Rngs(0), **{**base, **kwargs}
            )

    def test_axis_overlapping_batch_axis(self):
        with pytest.raises(ValueError, match=r"must not contain a batch axis"):
            BatchEnsembleLinearGeneral(
                4, 3, axis=1, batch_axis={0: 2, 1: 4}, num_members=2, rngs=nnx.Rngs(0)
            )

    def test_op_checks_parameter_shapes(self):
        x = random_input(0, (4, 3))
        with pytest.raises(
            ValueError,
            match=r"`bias` must have shape \[num_members, features\] = \(2, 5\)",
        ):
            batch_ensemble_dense_general(
                x,
                jnp.ones((3, 5)),
                jnp.ones((2, 3)),
                jnp.ones((2, 5)),
                jnp.ones((3, 5)),
                num_members=2,
            )
        with pytest.raises(ValueError, match=r"`kernel` must have shape"):
            batch_ensemble_dense_general(
                x, jnp.ones((3, 4)), jnp.ones((2, 3)), jnp.ones((2, 5)), num_members=2
            )
