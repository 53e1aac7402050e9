"""``BatchEnsembleEinsum`` against per-member ``nnx.Einsum`` layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from ensembles import BatchEnsembleEinsum, FastWeight, initializers
from tests.covering import covering
from tests.ops.test_einsum import (
    CONFIGS,
    fast_weight_shapes,
    jitted_reference,
    member_axis,
    reference,
)
from tests.reference import (
    assert_same,
    assert_trees_equal,
    numpy_normal,
    random_cotangent,
    snapshot,
)
from tests.tolerances import assert_close

ONES = {"r_init": initializers.ones(), "s_init": initializers.ones()}
# Flax's default lecun_normal needs a kernel of rank >= 2. Drawn with numpy:
# jax.random would compile for each of the configurations' shapes.
INITS = {"kernel_init": numpy_normal(1.0), "bias_init": numpy_normal(1.0)}
FAST_WEIGHTS = {"r_init": numpy_normal(0.5, 1.0), "s_init": numpy_normal(0.5, 1.0)}


apply = nnx.jit(lambda module, x: module(x))


def random_input(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def make_layer(name, num_members=3, use_bias=True, **kwargs):
    einsum_str, kernel_shape, bias_shape, _ = CONFIGS[name]
    kwargs = {**INITS, **FAST_WEIGHTS, **kwargs}
    return BatchEnsembleEinsum(
        einsum_str,
        kernel_shape,
        bias_shape if use_bias else None,
        num_members=num_members,
        rngs=nnx.Rngs(0),
        **kwargs,
    )


def make_flax(name, use_bias=True, seed=3, **kwargs):
    einsum_str, kernel_shape, bias_shape, _ = CONFIGS[name]
    return nnx.Einsum(
        einsum_str,
        kernel_shape,
        bias_shape if use_bias else None,
        rngs=nnx.Rngs(seed),
        **{**INITS, **kwargs},
    )


def member_input(name, seed=1, dtype=jnp.float32):
    return random_input(seed, CONFIGS[name][3], dtype)


def layer_reference(layer, name, x, call_str=None):
    einsum_str, kernel_shape, bias_shape, _ = CONFIGS[name]
    bias = None if layer.bias is None else layer.bias[...]
    config = (einsum_str, kernel_shape, None if bias is None else bias_shape)
    return jitted_reference(
        config,
        x,
        layer.kernel[...],
        layer.r[...],
        layer.s[...],
        bias,
        layer.num_members,
        call_str=call_str,
    )


def split_members(y, axis, num_members):
    return jnp.split(y, num_members, axis=axis)


# Each configuration once, the three (dtype, E) variants in turn: 13 of the 39
# combinations; every variant runs on four or five configurations, and the
# float32 ones run eagerly too (nine configurations).
FORWARD_VARIANTS = [(jnp.float32, 1), (jnp.float32, 3), (jnp.bfloat16, 3)]
FORWARD_CASES = covering(
    {
        "dtype": [jnp.float32, jnp.bfloat16],
        "num_members": [1, 3],
        "name": list(CONFIGS),
    },
    [(*FORWARD_VARIANTS[i % 3], name) for i, name in enumerate(CONFIGS)],
    pairs=[],
)


@pytest.mark.parametrize("dtype, num_members, name", FORWARD_CASES)
def test_forward_matches_flax_einsum_per_member(name, dtype, num_members):
    layer = make_layer(name, num_members, dtype=dtype, param_dtype=dtype)
    x = ensembles.tile(member_input(name, dtype=dtype), num_members)
    expected = layer_reference(layer, name, x)
    outputs = [nnx.jit(lambda m, x: m(x))(layer, x)]
    if dtype == jnp.float32:
        outputs.append(layer(x))
    for y in outputs:
        assert y.dtype == dtype and y.shape == expected.shape
        assert_close(y, expected, dtype, scale=4)


@pytest.mark.parametrize(
    "name, dtype, use_bias",
    [
        ("gemma_qkv", jnp.float32, True),
        ("gemma_out", jnp.bfloat16, True),
        ("member_not_first", jnp.float32, True),
        ("ellipsis", jnp.float32, False),
        ("batch_letter", jnp.bfloat16, False),
        ("permuted_output", jnp.float32, True),
    ],
)
def test_gradients_match_jax_grad_of_flax_reference(name, dtype, use_bias):
    layer = make_layer(name, 3, use_bias, dtype=dtype, param_dtype=dtype)
    x = random_input(2, (6, *CONFIGS[name][3][1:]), dtype)
    cotangent = random_cotangent(layer_reference(layer, name, x).shape)

    def loss(layer, x):
        return jnp.sum(layer(x).astype(jnp.float32) * cotangent)

    grads, grad_x = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(layer, x)
    einsum_str, kernel_shape, bias_shape, _ = CONFIGS[name]
    config = (einsum_str, kernel_shape, bias_shape if use_bias else None)

    def reference_loss(x, kernel, r, s, bias):
        y = reference(config, x, kernel, r, s, bias, 3)
        return jnp.sum(y * cotangent)

    bias = layer.bias[...] if use_bias else None
    argnums = (0, 1, 2, 3, 4) if use_bias else (0, 1, 2, 3)
    expected = jax.jit(jax.grad(reference_loss, argnums=argnums))(
        x, layer.kernel[...], layer.r[...], layer.s[...], bias
    )
    assert_close(grad_x, expected[0], dtype, scale=8)
    for param, e in zip(("kernel", "r", "s", "bias"), expected[1:], strict=False):
        assert_close(getattr(grads, param)[...], e, dtype, scale=8, err_msg=param)
    assert ("bias" in grads) is use_bias


@pytest.mark.parametrize("name", ["flax_docstring", "member_not_first", "flat_bias"])
def test_parameters(name):
    einsum_str, kernel_shape, bias_shape, member_shape = CONFIGS[name]
    layer = make_layer(name, 3)
    r_shape, s_shape = fast_weight_shapes(
        einsum_str, kernel_shape, len(member_shape), 3
    )
    assert type(layer.kernel) is nnx.Param and layer.kernel.shape == kernel_shape
    assert type(layer.r) is FastWeight and layer.r.shape == r_shape
    assert type(layer.s) is FastWeight and layer.s.shape == s_shape
    assert type(layer.bias) is nnx.Param and layer.bias.shape == (3, *bias_shape)
    assert layer.num_members == 3
    plain = make_layer(name, 2, use_bias=False)
    assert plain.bias is None and "bias" not in nnx.state(plain)
    assert set(nnx.state(plain)) == {"kernel", "r", "s"}


def test_flax_docstring_shapes():
    layer = make_layer("flax_docstring", 3)
    assert layer.r.shape == (3, 2) and layer.s.shape == (3, 8, 4)
    assert layer(jnp.ones((3 * 16, 11, 2))).shape == (48, 11, 8, 4)


def test_bf16_compute_with_f32_params():
    layer = make_layer("gemma_qkv", dtype=jnp.bfloat16)
    assert layer.r[...].dtype == jnp.float32
    assert layer(jnp.ones((6, 5, 7))).dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "name, call_str",
    [
        ("gemma_qkv", "BTD,NDH->BNTH"),
        ("gemma_qkv", "BTD,NDH->TBNH"),
        ("ellipsis", "b...d,df->...bf"),
    ],
)
def test_einsum_str_at_call_time(name, call_str):
    layer = make_layer(name, 3)
    x = ensembles.tile(member_input(name), 3)
    expected = layer_reference(layer, name, x, call_str=call_str)
    assert_close(layer(x, einsum_str=call_str), expected, scale=4)
    assert_close(layer(x), layer_reference(layer, name, x), scale=4)


@pytest.mark.parametrize("member", [None, 1])
def test_einsum_str_at_call_time_that_splits_the_kernel_otherwise_is_refused(member):
    # Same sizes, so r and s would fit: only the split tells the strings apart.
    layer = BatchEnsembleEinsum(
        "BD,DF->BF", (4, 4), (4,), num_members=2, rngs=nnx.Rngs(0)
    )
    x = jnp.ones((6, 4) if member is None else (3, 4))
    view = layer if member is None else nnx.view(layer, member=member)
    with pytest.raises(ValueError, match=r"`einsum_str` 'BF,DF->BD' splits"):
        view(x, einsum_str="BF,DF->BD")


class TestViewsAndExtract:
    @pytest.mark.parametrize("name", list(CONFIGS))
    def test_member_view_and_extracted_member_match_reference(self, name):
        layer = make_layer(name, 3)
        x = member_input(name)
        axis = member_axis(CONFIGS[name][0], x.ndim)
        full = split_members(
            layer_reference(layer, name, ensembles.tile(x, 3)), axis, 3
        )
        before = snapshot(layer)
        for k in range(3):
            view = nnx.view(layer, member=k)
            assert_close(view(x), full[k], scale=4)
            plain = layer.extract_member(k)
            assert type(plain) is nnx.Einsum
            assert plain.kernel.shape == layer.kernel.shape
            assert_close(plain(x), full[k], scale=4)
        assert_same(before, snapshot(layer))
        assert layer.member is None

    def test_extract_member_bias_and_kernel(self):
        layer = make_layer("permuted_output", 2)
        plain = layer.extract_member(1)
        assert plain.bias.shape == CONFIGS["permuted_output"][2]
        np.testing.assert_array_equal(plain.bias[...], layer.bias[1])
        assert make_layer("gemma_qkv", 2, use_bias=False).extract_member(0).bias is None

    def test_bad_member(self):
        with pytest.raises(ValueError, match=r"member"):
            make_layer("gemma_qkv", 3).extract_member(3)


class TestFromEinsum:
    # Every configuration with its bias (whose shape each configuration sets);
    # without one on three of them: 16 of the 26 combinations.
    @pytest.mark.parametrize(
        "use_bias, name",
        covering(
            {"use_bias": [True, False], "name": list(CONFIGS)},
            [(True, name) for name in CONFIGS]
            + [
                (False, name)
                for name in ("gemma_out", "member_not_first", "kernel_all_contracted")
            ],
            pairs=[],
        ),
    )
    def test_ones_reproduce_the_original_for_every_member(self, name, use_bias):
        original = make_flax(name, use_bias)
        layer = BatchEnsembleEinsum.from_einsum(
            original, num_members=3, rngs=nnx.Rngs(0), **ONES
        )
        x = member_input(name)
        axis = member_axis(CONFIGS[name][0], x.ndim)
        expected = original(x)
        # Jitted: the eager layer runs in test_forward_matches_flax_einsum_per_member.
        for y in split_members(apply(layer, ensembles.tile(x, 3)), axis, 3):
            assert_close(y, expected)
        np.testing.assert_array_equal(layer.kernel[...], original.kernel[...])
        assert (layer.bias is None) is not use_bias
        # Round trip: every member is the original again.
        for k in range(3):
            assert_trees_equal(
                nnx.state(layer.extract_member(k)),
                nnx.state(original),
            )

    def test_random_fast_weights_match_reference(self):
        original = make_flax("member_not_first")
        layer = BatchEnsembleEinsum.from_einsum(
            original, num_members=2, rngs=nnx.Rngs(0), impl="xla"
        )
        x = ensembles.tile(member_input("member_not_first"), 2)
        assert_close(layer(x), layer_reference(layer, "member_not_first", x), scale=4)
        assert layer.bias.shape == (2, *CONFIGS["member_not_first"][2])
        np.testing.assert_array_equal(layer.bias[1], original.bias[...])

    def test_copies_and_leaves_original_unchanged(self):
        original = make_flax("gemma_qkv", precision="highest")
        before = snapshot(original)
        layer = BatchEnsembleEinsum.from_einsum(
            original, num_members=2, rngs=nnx.Rngs(0)
        )
        assert layer.kernel is not original.kernel
        assert layer.precision == "highest"
        layer.kernel[...] = layer.kernel[...] + 1
        layer.bias[...] = layer.bias[...] + 1
        assert_same(before, snapshot(original))
        shared = BatchEnsembleEinsum.from_einsum(
            original, num_members=2, rngs=nnx.Rngs(0), share_kernel=True
        )
        assert shared.kernel is original.kernel
        assert shared.bias is not original.bias

    def test_rejects_non_einsum_and_custom_einsum_op(self):
        with pytest.raises(TypeError, match=r"`layer`.*nnx.Einsum"):
            BatchEnsembleEinsum.from_einsum(
                nnx.Linear(2, 3, rngs=nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(0)
            )
        custom = make_flax("gemma_qkv", einsum_op=lambda *a, **k: jnp.einsum(*a, **k))
        with pytest.raises(ValueError, match=r"einsum_op"):
            BatchEnsembleEinsum.from_einsum(custom, num_members=2, rngs=nnx.Rngs(0))
        # Flax contracts the first input axis here, which carries the members.
        contracting = nnx.Einsum("BTD,BDH->TH", (2, 7, 5), rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"einsum_str"):
            BatchEnsembleEinsum.from_einsum(
                contracting, num_members=2, rngs=nnx.Rngs(0)
            )


class Model(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Einsum(
            "BTD,NDH->BTNH",
            (3, 7, 5),
            (3, 5),
            bias_init=numpy_normal(1.0),
            rngs=rngs,
        )
        self.head = nnx.Linear(5, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(self.proj(x))


@pytest.mark.parametrize("ones", [True, False])
def test_to_batch_ensemble_and_extract_member(ones):
    model = Model(nnx.Rngs(0))
    kwargs = ONES if ones else {}
    ensemble = ensembles.to_batch_ensemble(
        model, num_members=3, rngs=nnx.Rngs(1), **kwargs
    )
    assert type(ensemble.proj) is BatchEnsembleEinsum
    assert type(ensemble.head) is ensembles.BatchEnsembleLinear
    assert type(model.proj) is nnx.Einsum
    x = random_input(0, (2, 5, 7))
    y = ensembles.untile(ensemble(ensembles.tile(x, 3)), 3)
    for k in range(3):
        member = ensembles.extract_member(ensemble, k)
        assert type(member.proj) is nnx.Einsum and type(member.head) is nnx.Linear
        assert_close(member(x), y[k], scale=4)
        if ones:
            assert_close(y[k], model(x))


class TestErrors:
    @pytest.mark.parametrize(
        "einsum_str, kernel_shape",
        [
            ("BTD,DZ->BT", (7, 5)),
            ("BTD,BDH->BTH", (2, 7, 5)),
            ("ecd,edf->ecf", (2, 7, 5)),
            ("BTD,DH->TH", (7, 5)),
            ("BDD,DH->BH", (7, 5)),
            ("BTD,DD->BTD", (7, 7)),
            ("BTD,DH", (7, 5)),
            ("BTD->BTD", (7, 5)),
            ("BTD,DH,HK->BTK", (7, 5)),
        ],
    )
    def test_bad_einsum_str_draws_nothing(self, einsum_str, kernel_shape):
        rngs = nnx.Rngs(params=0, dropout=1)
        before = snapshot(rngs)
        with pytest.raises(ValueError, match=r"einsum_str"):
            BatchEnsembleEinsum(einsum_str, kernel_shape, num_members=2, rngs=rngs)
        assert_same(before, snapshot(rngs))
        BatchEnsembleEinsum("BTD,DH->BTH", (7, 5), (5,), num_members=2, rngs=rngs)
        assert not all(
            np.array_equal(a, b) for a, b in zip(before, snapshot(rngs), strict=True)
        )

    @pytest.mark.parametrize("init", ["kernel_init", "s_init"])
    def test_failing_initializer_draws_nothing(self, init):
        rngs = nnx.Rngs(0)
        before = snapshot(rngs)
        wrong_shape = lambda key, shape, dtype: jnp.ones((1,), dtype)  # noqa: E731
        with pytest.raises(ValueError, match=init):
            BatchEnsembleEinsum(
                "BTD,DH->BTH", (7, 5), num_members=2, rngs=rngs, **{init: wrong_shape}
            )
        assert_same(before, snapshot(rngs))

    def test_num_members(self):
        with pytest.raises(ValueError, match=r"`num_members`"):
            BatchEnsembleEinsum("BTD,DH->BTH", (7, 5), num_members=0, rngs=nnx.Rngs(0))

    def test_batch_not_multiple_of_members(self):
        with pytest.raises(ValueError, match=r"num_members"):
            make_layer("gemma_qkv", 3)(jnp.ones((4, 5, 7)))

    def test_wrong_input_features(self):
        with pytest.raises(ValueError, match=r"`(inputs|kernel)"):
            make_layer("gemma_qkv", 3)(jnp.ones((6, 5, 6)))
