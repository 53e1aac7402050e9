"""BatchEnsembleConv / BatchEnsembleConvTranspose against nnx.Conv / ConvTranspose.

Every member's rows must be what the original Flax layer computes when it holds
that member's effective kernel (``W * (r_k (x) s_k)`` over the channel axes, per
group for grouped convolutions) and bias ``bias_k``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import ensembles
from ensembles import BatchEnsembleConv, BatchEnsembleConvTranspose, initializers
from ensembles.layers.sharding import without_member_axis_metadata
from ensembles.ops import conv_options
from tests.reference import (
    assert_same,
    assert_trees_equal,
    conv_effective_kernel,
    flax_member_outputs,
    numpy_normal,
    snapshot,
)
from tests.tolerances import assert_close

NUM_MEMBERS, BATCH = 2, 2


def canonical(layer, name, value):
    """An option in the canonical form our layers hold it in (checked once, at
    construction): spatial options as tuples, padding as lax or Flax takes it."""
    rank = len(layer.kernel_size)
    if name in ("strides", "input_dilation", "kernel_dilation"):
        return conv_options.spatial_tuple(value, name, rank)
    if name == "padding":
        transpose = isinstance(layer, nnx.ConvTranspose | BatchEnsembleConvTranspose)
        return conv_options.check_padding(value, rank, transpose=transpose)
    return value


# name -> (constructor options, spatial input shape, extra batch axes)
CONV_CASES = {
    "1d-causal-dilated": (
        {"kernel_size": (3,), "padding": "CAUSAL", "kernel_dilation": 2},
        (9,),
        (),
    ),
    "1d-int-padding-strided": (
        {"kernel_size": 4, "padding": 2, "strides": 2},
        (9,),
        (),
    ),
    "2d-valid-strides": (
        {"kernel_size": (3, 2), "padding": "VALID", "strides": (2, 1)},
        (7, 6),
        (),
    ),
    "2d-circular-strided": (
        {"kernel_size": (3, 3), "padding": "CIRCULAR", "strides": 2},
        (7, 6),
        (),
    ),
    "2d-reflect-kernel-dilation": (
        {"kernel_size": (3, 2), "padding": "REFLECT", "kernel_dilation": (1, 2)},
        (7, 6),
        (),
    ),
    "2d-mixed-pairs-input-dilation": (
        {"kernel_size": (2, 3), "padding": [1, (2, 1)], "input_dilation": 2},
        (4, 5),
        (),
    ),
    "2d-same-groups-extra-batch-axis": (
        {"kernel_size": (3, 3), "feature_group_count": 2},
        (5, 4),
        (2,),
    ),
    "2d-depthwise-circular": (
        {
            "kernel_size": (3, 3),
            "feature_group_count": 4,
            "out_features": 8,
            "padding": "CIRCULAR",
        },
        (6, 5),
        (),
    ),
    "2d-mask-no-bias": (
        {"kernel_size": (3, 3), "mask": True, "use_bias": False},
        (6, 5),
        (),
    ),
    "3d-same-strided": (
        {"kernel_size": (2, 3, 2), "strides": (1, 2, 2)},
        (4, 5, 4),
        (),
    ),
}

TRANSPOSE_CASES = {
    "1d-same-strided": ({"kernel_size": 3, "strides": 2}, (5,), ()),
    "1d-valid-transpose-kernel-dilated": (
        {
            "kernel_size": (4,),
            "padding": "VALID",
            "transpose_kernel": True,
            "kernel_dilation": 2,
        },
        (5,),
        (),
    ),
    "2d-valid-kernel-dilation": (
        {"kernel_size": (3, 2), "padding": "VALID", "kernel_dilation": (2, 1)},
        (4, 5),
        (),
    ),
    "2d-circular-strided": (
        {"kernel_size": (3, 3), "padding": "CIRCULAR", "strides": 2},
        (4, 5),
        (),
    ),
    "2d-circular-transpose-kernel": (
        {
            "kernel_size": (4, 3),
            "padding": "CIRCULAR",
            "strides": (2, 1),
            "transpose_kernel": True,
        },
        (4, 5),
        (),
    ),
    "2d-pairs-strided-extra-batch-axis": (
        {"kernel_size": (3, 2), "padding": [(1, 2), (0, 1)], "strides": (2, 1)},
        (3, 4),
        (2,),
    ),
    "2d-int-padding-mask-no-bias": (
        {"kernel_size": (3, 3), "padding": 1, "mask": True, "use_bias": False},
        (4, 5),
        (),
    ),
    "3d-same-strided": ({"kernel_size": (2, 2, 2), "strides": 2}, (3, 4, 3), ()),
}

DTYPES = [jnp.float32, jnp.bfloat16]


apply = nnx.jit(lambda module, x: module(x))


def out_type(module, x):
    """The output's shape and dtype, traced without compiling."""
    return nnx.eval_shape(lambda module, x: module(x), module, x)


def random_array(seed, shape, dtype=jnp.float32, mean=0.0, scale=1.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(mean + scale * rng.standard_normal(shape), dtype)


def kernel_shape(options, transpose):
    kernel_size = options["kernel_size"]
    kernel_size = (kernel_size,) if isinstance(kernel_size, int) else kernel_size
    in_features, out_features = 4, options.get("out_features", 6)
    if transpose:
        channels = (out_features, in_features)
        if not options.get("transpose_kernel", False):
            channels = channels[::-1]
    else:
        channels = (in_features // options.get("feature_group_count", 1), out_features)
    return (*kernel_size, *channels)


def layer_options(options, transpose):
    """Constructor options, with `mask: True` replaced by a random 0/1 mask."""
    options = dict(options)
    options.setdefault("out_features", 6)
    if options.pop("mask", False):
        shape = kernel_shape(options, transpose)
        mask = np.random.default_rng(7).random(shape) > 0.3
        options["mask"] = jnp.asarray(mask, jnp.float32)
    return options


def make_layer(options, transpose, dtype=jnp.float32, num_members=NUM_MEMBERS):
    options = dict(options)
    out_features = options.pop("out_features")
    kernel_size = options.pop("kernel_size")
    cls = BatchEnsembleConvTranspose if transpose else BatchEnsembleConv
    return cls(
        4,
        out_features,
        kernel_size,
        num_members=num_members,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=numpy_normal(1.0),
        bias_init=numpy_normal(1.0),
        r_init=numpy_normal(0.5, 1.0),
        s_init=numpy_normal(0.5, 1.0),
        rngs=nnx.Rngs(0),
        **options,
    )


def flax_factory(options, transpose):
    """`make(kernel, bias)`: the original Flax layer, in float32 at full precision."""
    options = dict(options)
    out_features = options.pop("out_features")
    kernel_size = options.pop("kernel_size")
    cls = nnx.ConvTranspose if transpose else nnx.Conv

    def make(kernel, bias):
        return cls(
            4,
            out_features,
            kernel_size,
            use_bias=bias is not None,
            precision=lax.Precision.HIGHEST,
            kernel_init=lambda *_: kernel,
            bias_init=lambda *_: bias,
            rngs=nnx.Rngs(0),
            **{k: v for k, v in options.items() if k != "use_bias"},
        )

    return make


def reference_fn(options, transpose):
    """`(x, kernel, r, s, bias) -> outputs` of the Flax reference."""
    return functools.partial(
        flax_member_outputs,
        flax_factory(options, transpose),
        num_members=NUM_MEMBERS,
        feature_group_count=options.get("feature_group_count", 1),
        transpose_kernel=options.get("transpose_kernel", False),
    )


def params(layer):
    bias = None if layer.bias is None else layer.bias[...]
    return layer.kernel[...], layer.r[...], layer.s[...], bias


def case_input(spatial, extra, dtype, seed=1):
    return random_array(seed, (NUM_MEMBERS * BATCH, *extra, *spatial, 4), dtype)


ALL_CASES = [pytest.param(False, name, id=f"conv-{name}") for name in CONV_CASES] + [
    pytest.param(True, name, id=f"transpose-{name}") for name in TRANSPOSE_CASES
]


def get_case(transpose, name):
    options, spatial, extra = (TRANSPOSE_CASES if transpose else CONV_CASES)[name]
    return layer_options(options, transpose), spatial, extra


# Every case in float32; bfloat16 on a subset that covers each code path
# (circular/reflect padding, groups, mask, transposed kernels, 1-D and 3-D).
BF16_CASES = {
    "conv-1d-causal-dilated",
    "conv-2d-reflect-kernel-dilation",
    "conv-2d-depthwise-circular",
    "conv-2d-mask-no-bias",
    "transpose-2d-circular-transpose-kernel",
    "transpose-3d-same-strided",
}
MATRIX = [
    pytest.param(*case.values, dtype, id=f"{case.id}-{jnp.dtype(dtype).name}")
    for case in ALL_CASES
    for dtype in DTYPES
    if dtype == jnp.float32 or case.id in BF16_CASES
]


@pytest.mark.parametrize("transpose, name, dtype", MATRIX)
def test_outputs_and_gradients_match_flax_per_member(
    transpose, name, dtype, formulation
):
    """Jitted outputs and gradients against the Flax reference.

    One jitted forward-and-backward per side keeps the compile count (the
    dominant cost of these small cases) low; eager runs are tested below.
    """
    options, spatial, extra = get_case(transpose, name)
    layer = make_layer(options, transpose, dtype)
    x = case_input(spatial, extra, dtype)
    reference = reference_fn(options, transpose)
    out_shape = jax.eval_shape(reference, x, *params(layer)).shape
    cotangent = random_array(2, out_shape)

    def loss(layer, x):
        y = layer(x)
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    (grads, grad_x), y = nnx.jit(nnx.grad(loss, argnums=(0, 1), has_aux=True))(layer, x)

    def reference_loss(x, kernel, r, s, bias):
        y = reference(x, kernel, r, s, bias)
        return jnp.sum(y * cotangent), y

    use_bias = layer.bias is not None
    argnums = (0, 1, 2, 3, 4) if use_bias else (0, 1, 2, 3)
    expected_grads, expected = jax.jit(
        jax.grad(reference_loss, argnums=argnums, has_aux=True)
    )(x, *params(layer))

    assert y.dtype == dtype
    assert y.shape == expected.shape
    assert_close(y, expected, dtype, scale=4)
    # The reference is neither trivially constant nor the same for all members.
    assert float(jnp.std(expected)) > 0.1
    rows = expected.shape[0] // NUM_MEMBERS
    assert not np.allclose(expected[:rows], expected[rows : 2 * rows])

    assert_close(grad_x, expected_grads[0], dtype, scale=8)
    names = ["kernel", "r", "s", "bias"]
    for name_, e in zip(names, expected_grads[1:], strict=False):
        actual = getattr(grads, name_)[...]
        assert actual.dtype == dtype
        scale = 8.0
        if dtype == jnp.bfloat16:
            # Parameter gradients sum hundreds of bf16-rounded products: allow
            # 3% of the largest entry rather than of each entry.
            scale = max(scale, float(jnp.max(jnp.abs(e))))
        assert_close(actual, e, dtype, scale=scale)
    assert use_bias == ("bias" in grads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "transpose, name",
    [
        pytest.param(False, "2d-mask-no-bias", id="conv"),
        pytest.param(True, "2d-circular-transpose-kernel", id="transpose"),
    ],
)
def test_eager_matches_flax_per_member(transpose, name, dtype, formulation):
    options, spatial, extra = get_case(transpose, name)
    layer = make_layer(options, transpose, dtype)
    x = case_input(spatial, extra, dtype)
    expected = jax.jit(reference_fn(options, transpose))(x, *params(layer))
    y = layer(x)
    assert y.dtype == dtype
    assert_close(y, expected, dtype, scale=4)


def test_bf16_compute_with_f32_params_returns_bf16():
    layer = BatchEnsembleConv(
        4, 6, (3, 3), num_members=3, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
    )
    assert layer.r[...].dtype == jnp.float32
    assert out_type(layer, random_array(0, (6, 5, 5, 4))).dtype == jnp.bfloat16


@pytest.mark.parametrize("transpose", [False, True])
def test_dtype_promotion_follows_flax(transpose):
    # bf16 params, f32 inputs, an f32 mask: whatever Flax returns, we return.
    options = layer_options({"kernel_size": (3, 3), "mask": True}, transpose)
    options.pop("out_features")
    cls = BatchEnsembleConvTranspose if transpose else BatchEnsembleConv
    layer = cls(
        4, 6, num_members=3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), **options
    )
    x = random_array(0, (6, 5, 5, 4))
    plain = layer.extract_member(0)
    assert out_type(layer, x).dtype == out_type(plain, x[:2]).dtype == jnp.float32


class TestParameters:
    def test_conv_parameters_and_attributes(self):
        layer = BatchEnsembleConv(
            4,
            6,
            (3, 2),
            2,
            num_members=3,
            feature_group_count=2,
            padding="VALID",
            precision="highest",
            impl="xla",
            rngs=nnx.Rngs(0),
        )
        assert type(layer.kernel) is nnx.Param
        assert layer.kernel.shape == layer.kernel_shape == (3, 2, 2, 6)
        assert type(layer.r) is ensembles.FastWeight and layer.r.shape == (3, 4)
        assert type(layer.s) is ensembles.FastWeight and layer.s.shape == (3, 6)
        assert type(layer.bias) is nnx.Param and layer.bias.shape == (3, 6)
        assert layer.kernel_size == (3, 2) and layer.strides == (2, 2)
        assert layer.padding == "VALID" and layer.feature_group_count == 2
        assert layer.precision == "highest" and layer.impl == "xla"
        assert layer.member is None and layer.mask is None
        assert not isinstance(layer, nnx.Conv)
        no_bias = BatchEnsembleConv(
            4, 6, 3, num_members=2, use_bias=False, rngs=nnx.Rngs(0)
        )
        assert no_bias.bias is None and "bias" not in nnx.state(no_bias)
        assert no_bias.kernel_size == (3,)

    def test_transpose_parameters(self):
        layer = BatchEnsembleConvTranspose(
            4, 6, (3, 2), num_members=3, transpose_kernel=True, rngs=nnx.Rngs(0)
        )
        assert layer.kernel.shape == (3, 2, 6, 4)
        assert layer.r.shape == (3, 4) and layer.s.shape == (3, 6)
        assert layer.strides == layer.kernel_dilation == (1, 1)

    def test_positional_arguments_mirror_flax(self):
        # nnx.Conv(3, 8, (3, 3), 2, rngs=r) -> BatchEnsembleConv(..., num_members=4)
        flax_layer = nnx.Conv(3, 8, (3, 3), 2, rngs=nnx.Rngs(0))
        layer = BatchEnsembleConv(3, 8, (3, 3), 2, num_members=4, rngs=nnx.Rngs(0))
        assert layer.kernel.shape == flax_layer.kernel.shape
        assert layer.strides == (2, 2) and flax_layer.strides == 2

    def test_default_initializers_and_metadata(self):
        layer = BatchEnsembleConv(
            40,
            50,
            (3, 3),
            num_members=4,
            rngs=nnx.Rngs(0),
            kernel_metadata={"tag": "k"},
            bias_metadata={"tag": "b"},
            fast_weight_metadata={"tag": "f"},
        )
        np.testing.assert_array_equal(layer.bias[...], 0.0)
        for fast in (layer.r[...], layer.s[...]):
            # The default N(1, 0.5), within 4 standard errors of the draw.
            assert abs(float(fast.mean()) - 1.0) < 4 * 0.6 / fast.size**0.5
            assert abs(float(fast.std()) - 0.5) < 4 * 0.5 / (2 * fast.size) ** 0.5
        # nnx.Conv's default: lecun_normal, variance 1 / fan_in (3*3*40).
        assert abs(float(layer.kernel[...].var()) * 360 - 1.0) < 0.1
        assert layer.kernel.get_metadata()["tag"] == "k"
        assert layer.bias.get_metadata()["tag"] == "b"
        assert layer.r.get_metadata()["tag"] == layer.s.get_metadata()["tag"] == "f"

    @pytest.mark.parametrize("transpose", [False, True])
    def test_call_does_not_mutate_the_module(self, transpose):
        options = layer_options({"kernel_size": (3, 3), "mask": True}, transpose)
        layer = make_layer(options, transpose)
        graphdef, state = nnx.split(layer)
        before = jax.tree.map(np.array, state)
        x = case_input((5, 5), (), jnp.float32)
        layer(x)
        nnx.jit(lambda m, x: m(x))(layer, x)
        nnx.view(layer, member=1)(x[:2])
        assert nnx.graphdef(layer) == graphdef
        assert_trees_equal(before, nnx.state(layer))
        assert layer.member is None and layer.use_bias


CONVERT_CASES = [
    pytest.param(False, {"kernel_size": (3, 3)}, id="conv"),
    pytest.param(
        False,
        {
            "kernel_size": (3, 3),
            "feature_group_count": 2,
            "padding": "CIRCULAR",
            "strides": 2,
            "mask": True,
        },
        id="conv-groups-circular-mask",
    ),
    pytest.param(
        False,
        {"kernel_size": 3, "padding": "CAUSAL", "kernel_dilation": 2},
        id="conv-1d-causal",
    ),
    pytest.param(True, {"kernel_size": (3, 3), "strides": 2}, id="transpose"),
    pytest.param(
        True,
        {
            "kernel_size": (4, 3),
            "transpose_kernel": True,
            "padding": "CIRCULAR",
            "use_bias": False,
        },
        id="transpose-kernel-circular",
    ),
    # Flax reads lax's padding names in any case; so must a converted layer.
    pytest.param(False, {"kernel_size": (3, 3), "padding": "same"}, id="conv-same"),
    pytest.param(
        False,
        {"kernel_size": (3, 3), "padding": "Valid", "strides": 2},
        id="conv-valid",
    ),
    pytest.param(
        False, {"kernel_size": (4, 4), "padding": "same_lower"}, id="conv-same-lower"
    ),
    # (nnx.ConvTranspose passes lower case on to lax.conv_transpose, which
    # reads it as the dilated convolution's padding: strides > 1 then fail in
    # Flax too.)
    pytest.param(True, {"kernel_size": (3, 3), "padding": "valid"}, id="t-valid"),
    pytest.param(True, {"kernel_size": (4, 3), "padding": "same"}, id="t-same"),
]


def flax_layer(options, transpose, **overrides):
    options = layer_options(options, transpose)
    options.update(overrides)
    out_features = options.pop("out_features")
    kernel_size = options.pop("kernel_size")
    cls = nnx.ConvTranspose if transpose else nnx.Conv
    options.setdefault("kernel_init", numpy_normal(0.2))  # ~ lecun_normal here
    layer = cls(4, out_features, kernel_size, rngs=nnx.Rngs(3), **options)
    if layer.bias is not None:
        layer.bias[...] = random_array(4, layer.bias.shape, layer.param_dtype)
    return layer


def convert(layer, num_members=3, **kwargs):
    if isinstance(layer, nnx.ConvTranspose):
        return BatchEnsembleConvTranspose.from_conv_transpose(
            layer, num_members=num_members, rngs=nnx.Rngs(0), **kwargs
        )
    return BatchEnsembleConv.from_conv(
        layer, num_members=num_members, rngs=nnx.Rngs(0), **kwargs
    )


ONES = {"r_init": initializers.ones(), "s_init": initializers.ones()}


class TestFromConv:
    @pytest.mark.parametrize("transpose, options", CONVERT_CASES)
    def test_ones_reproduce_the_original_for_every_member(self, transpose, options):
        original = flax_layer(options, transpose)
        layer = convert(original, **ONES)
        spatial = (9,) if isinstance(options["kernel_size"], int) else (6, 5)
        x = random_array(5, (2, *spatial, 4))
        y = ensembles.untile(apply(layer, ensembles.tile(x, 3)), 3)
        expected = apply(original, x)
        for k in range(3):
            assert_close(y[k], expected)
        assert layer.use_bias is (original.bias is not None)

    @pytest.mark.parametrize("transpose, options", CONVERT_CASES)
    def test_random_fast_weights_give_the_effective_kernels(self, transpose, options):
        original = flax_layer(options, transpose)
        layer = convert(original)
        np.testing.assert_array_equal(layer.kernel[...], original.kernel[...])
        if original.bias is not None:
            for k in range(3):
                np.testing.assert_array_equal(layer.bias[k], original.bias[...])
        for name in vars(original):
            if name.startswith("_") or name in ("kernel", "bias", "mask"):
                continue
            if name != "conv_general_dilated":
                expected = canonical(original, name, getattr(original, name))
                assert getattr(layer, name) == expected, name
        assert layer.mask is original.mask
        spatial = (9,) if isinstance(options["kernel_size"], int) else (6, 5)
        x = random_array(5, (6, *spatial, 4))
        options = layer_options(options, transpose)  # the same seeded mask
        expected = jax.jit(
            functools.partial(
                flax_member_outputs,
                flax_factory(options, transpose),
                num_members=3,
                feature_group_count=options.get("feature_group_count", 1),
                transpose_kernel=options.get("transpose_kernel", False),
            )
        )(x, *params(layer))
        assert_close(apply(layer, x), expected, scale=4)
        assert not np.allclose(expected[:2], expected[2:4])

    def test_copies_dtype_configuration(self):
        original = nnx.Conv(
            4,
            6,
            (3, 3),
            dtype=jnp.bfloat16,
            param_dtype=jnp.bfloat16,
            precision="highest",
            preferred_element_type=jnp.float32,
            rngs=nnx.Rngs(0),
        )
        layer = convert(original)
        assert layer.dtype == jnp.bfloat16 and layer.param_dtype == jnp.bfloat16
        assert layer.precision == "highest"
        assert layer.preferred_element_type == jnp.float32
        assert layer.r[...].dtype == layer.kernel[...].dtype == jnp.bfloat16
        x = random_array(0, (6, 5, 5, 4), jnp.bfloat16)
        assert out_type(layer, x).dtype == out_type(original, x).dtype == jnp.float32

    @pytest.mark.parametrize("transpose", [False, True])
    def test_copied_kernel_is_independent_and_original_unchanged(self, transpose):
        original = flax_layer({"kernel_size": (3, 3)}, transpose)
        before = jax.tree.map(np.array, nnx.state(original))
        layer = convert(original)
        assert layer.kernel is not original.kernel
        layer.kernel[...] = layer.kernel[...] + 1.0
        layer.bias[...] = layer.bias[...] + 1.0
        apply(layer, random_array(0, (3, 5, 5, 4)))
        assert_trees_equal(before, nnx.state(original))
        assert type(original) is (nnx.ConvTranspose if transpose else nnx.Conv)

    @pytest.mark.parametrize("transpose", [False, True])
    def test_shared_kernel_is_the_same_variable(self, transpose):
        original = flax_layer({"kernel_size": (3, 3)}, transpose)
        layer = convert(original, share_kernel=True)
        assert layer.kernel is original.kernel
        layer.kernel[...] = jnp.zeros(original.kernel.shape)
        np.testing.assert_array_equal(original.kernel[...], 0.0)
        assert layer.bias is not original.bias

    def test_metadata(self):
        original = nnx.Conv(
            4,
            6,
            3,
            kernel_metadata={"tag": "k"},
            bias_metadata={"tag": "b"},
            rngs=nnx.Rngs(0),
        )
        layer = convert(original)
        assert layer.kernel.get_metadata()["tag"] == "k"
        assert layer.bias.get_metadata()["tag"] == "b"

    def test_rejects_wrong_layer_types(self):
        conv = nnx.Conv(4, 6, 3, rngs=nnx.Rngs(0))
        transpose = nnx.ConvTranspose(4, 6, 3, rngs=nnx.Rngs(0))
        with pytest.raises(
            TypeError, match=r"`layer` must be an `nnx.Conv`, got Linear"
        ):
            BatchEnsembleConv.from_conv(
                nnx.Linear(2, 2, rngs=nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(0)
            )
        with pytest.raises(
            TypeError, match=r"`layer` must be an `nnx.ConvTranspose`, got Conv"
        ):
            BatchEnsembleConvTranspose.from_conv_transpose(
                conv, num_members=2, rngs=nnx.Rngs(0)
            )
        with pytest.raises(TypeError, match=r"got ConvTranspose"):
            BatchEnsembleConv.from_conv(transpose, num_members=2, rngs=nnx.Rngs(0))

    def test_rejects_custom_conv_general_dilated(self):
        original = nnx.Conv(
            4,
            6,
            3,
            rngs=nnx.Rngs(0),
            conv_general_dilated=lambda *a, **k: lax.conv_general_dilated(*a, **k),
        )
        before = jax.tree.map(np.array, nnx.state(original))
        with pytest.raises(
            ValueError, match=r"`layer.conv_general_dilated` is a custom"
        ):
            convert(original)
        assert_trees_equal(before, nnx.state(original))

    def test_rejects_bad_num_members(self):
        with pytest.raises(
            ValueError, match=r"`num_members` must be an int >= 1, got 0"
        ):
            convert(nnx.Conv(4, 6, 3, rngs=nnx.Rngs(0)), num_members=0)


class TestMembers:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize(
        "transpose, options",
        [
            pytest.param(
                False,
                {"kernel_size": (3, 3), "feature_group_count": 2, "mask": True},
                id="conv-groups-mask",
            ),
            pytest.param(
                True,
                {"kernel_size": (3, 2), "transpose_kernel": True, "strides": 2},
                id="transpose-kernel",
            ),
        ],
    )
    def test_extract_member_equals_view_equals_member_rows(
        self, transpose, options, dtype
    ):
        options = layer_options(options, transpose)
        layer = make_layer(options, transpose, dtype, num_members=3)
        x = random_array(0, (2, 6, 5, 4), dtype)
        full = ensembles.untile(apply(layer, ensembles.tile(x, 3)), 3)
        flax_type = nnx.ConvTranspose if transpose else nnx.Conv
        for k in range(3):
            plain = layer.extract_member(k)
            assert type(plain) is flax_type
            assert plain.kernel[...].dtype == dtype
            assert plain.mask is layer.mask
            expected_kernel = conv_effective_kernel(
                layer.kernel[...].astype(jnp.float32),
                layer.r[...].astype(jnp.float32),
                layer.s[...].astype(jnp.float32),
                k,
                options.get("feature_group_count", 1),
                options.get("transpose_kernel", False),
            )
            assert_close(plain.kernel[...], expected_kernel, dtype)
            np.testing.assert_array_equal(plain.bias[...], layer.bias[k])
            view = nnx.view(layer, member=k)
            assert view.member == k and layer.member is None
            view_out = apply(view, x)
            assert_close(view_out, full[k], dtype)
            assert_close(apply(plain, x), view_out, dtype, scale=4)

    @pytest.mark.parametrize("transpose", [False, True])
    def test_roundtrip_through_from_with_ones(self, transpose):
        original = flax_layer(
            {"kernel_size": (3, 3), "mask": True}, transpose, padding="VALID"
        )
        back = convert(original, **ONES).extract_member(2)
        assert type(back) is type(original)
        assert_trees_equal(nnx.state(back), nnx.state(original))
        for name in vars(original):
            if not name.startswith("_") and name not in ("kernel", "bias", "mask"):
                expected = canonical(original, name, getattr(original, name))
                assert canonical(back, name, getattr(back, name)) == expected, name
        assert without_member_axis_metadata({"sharding_names": (None, "x")}) == {
            "sharding_names": ("x",)
        }

    def test_extract_member_leaves_layer_unchanged_and_checks_member(self):
        layer = BatchEnsembleConv(4, 6, 3, num_members=3, rngs=nnx.Rngs(0))
        before = jax.tree.map(np.array, nnx.state(layer))
        layer.extract_member(1).kernel[...] = jnp.zeros((3, 4, 6))
        assert_trees_equal(before, nnx.state(layer))
        with pytest.raises(ValueError, match=r"`member` must be in \[0, num_members\)"):
            layer.extract_member(3)

    def test_member_view_gradients_reach_member_only(self):
        layer = BatchEnsembleConv(4, 6, (3, 3), num_members=3, rngs=nnx.Rngs(0))
        x = random_array(0, (2, 5, 5, 4))
        grads = nnx.grad(lambda m: jnp.sum(m(x)))(nnx.view(layer, member=1))
        grad_r, grad_bias = np.asarray(grads.r[...]), np.asarray(grads.bias[...])
        assert np.all(grad_r[[0, 2]] == 0) and np.any(grad_r[1] != 0)
        assert np.all(grad_bias[[0, 2]] == 0) and np.all(grad_bias[1] != 0)

    @pytest.mark.parametrize("cls", [BatchEnsembleConv, BatchEnsembleConvTranspose])
    def test_impl_view_and_view_info(self, cls):
        layer = cls(4, 6, (3, 3), num_members=3, rngs=nnx.Rngs(0))
        view = nnx.view(layer, impl="xla")
        assert view.impl == "xla" and layer.impl == "xla"
        x = random_array(0, (6, 5, 5, 4))
        np.testing.assert_array_equal(view(x), layer(x))
        info = nnx.view_info(layer)
        assert cls.__name__ in info and "member: int | None = None" in info
        # A dense kernel's name leaves a convolution's impl as it is.
        dense_view = nnx.view(layer, member=1, impl="pallas")
        assert dense_view.impl == layer.impl and dense_view.member == 1
        with pytest.raises(ValueError, match=r"`impl` must be one of"):
            nnx.view(layer, member=1, impl="triton")
        assert layer.member is None


class TestErrors:
    @pytest.fixture(params=[False, True], ids=["conv", "transpose"])
    def layer(self, request):
        cls = BatchEnsembleConvTranspose if request.param else BatchEnsembleConv
        return cls(4, 6, (3, 3), num_members=3, rngs=nnx.Rngs(0))

    @pytest.mark.parametrize(
        "shape, match",
        [
            ((6, 5, 5, 3), r"`inputs.shape\[-1\]` \(=3\) must equal in_features \(=4"),
            (
                (4, 5, 5, 4),
                r"`inputs.shape\[0\]` \(=4\) must be a multiple of `num_members` "
                r"\(=3\).*ensembles.tile\(x, 3\)",
            ),
            (
                (5, 5, 4),
                r"`inputs` must have shape \[E\*B, \*spatial \(2 dims\), "
                r"in_features\].*got shape \(5, 5, 4\)",
            ),
        ],
        ids=["channels", "batch", "rank"],
    )
    def test_bad_inputs_raise_and_change_nothing(self, layer, shape, match):
        before = jax.tree.map(np.array, nnx.state(layer))
        with pytest.raises(ValueError, match=match):
            layer(random_array(0, shape))
        with pytest.raises(ValueError, match=match):
            nnx.jit(lambda m, x: m(x))(layer, random_array(0, shape))
        assert_trees_equal(before, nnx.state(layer))
        assert layer.member is None

    @pytest.mark.parametrize("cls", [BatchEnsembleConv, BatchEnsembleConvTranspose])
    @pytest.mark.parametrize(
        "kwargs, error, match",
        [
            (
                {"num_members": 0},
                ValueError,
                r"`num_members` must be an int >= 1, got 0",
            ),
            ({"num_members": 2.5}, TypeError, r"`num_members` must be an int >= 1"),
            ({"num_members": True}, TypeError, r"`num_members` must be an int >= 1"),
            (
                {"impl": "pallas_gpu"},
                ValueError,
                r"`impl` must be one of \['xla'\], got 'pallas_gpu'",
            ),
            (
                {"in_features": 0},
                ValueError,
                r"`in_features` must be an int >= 1, got 0",
            ),
            (
                {"kernel_size": (3, 0)},
                ValueError,
                r"`kernel_size` must be an int >= 1, got 0",
            ),
            (
                {"kernel_size": (1, 1, 1, 1)},
                ValueError,
                r"`kernel_size` must have 1, 2 or 3",
            ),
            (
                {"mask": jnp.ones((3, 3))},
                ValueError,
                r"`mask` must have the kernel's shape \(3, 3, 4, 6\), got \(3, 3\)",
            ),
            (
                {"r_init": lambda k, s, d: jnp.ones(s[1:], d)},
                ValueError,
                r"`r_init` returned an array of shape",
            ),
        ],
    )
    def test_bad_constructor_arguments(self, cls, kwargs, error, match):
        arguments = {"in_features": 4, "out_features": 6, "kernel_size": (3, 3)}
        arguments.update(kwargs)
        arguments.setdefault("num_members", 3)
        with pytest.raises(error, match=match):
            cls(**arguments, rngs=nnx.Rngs(0))

    def test_feature_groups_must_divide_channels(self):
        with pytest.raises(
            ValueError,
            match=r"`feature_group_count` \(=4\) must divide both `in_features` "
            r"\(=4\) and `out_features` \(=6\)",
        ):
            BatchEnsembleConv(
                4, 6, 3, num_members=2, feature_group_count=4, rngs=nnx.Rngs(0)
            )

    @pytest.mark.parametrize(
        "cls, padding, match",
        [
            (
                BatchEnsembleConv,
                "CAUSAL",
                r"`padding='CAUSAL'` is only defined for 1-D",
            ),
            (
                BatchEnsembleConv,
                "FULL",
                r"`padding` must be one of \['SAME'.*got 'FULL'",
            ),
            (
                BatchEnsembleConv,
                [1, 2, 3],
                r"`padding` must be one of .*got \[1, 2, 3\]",
            ),
            (BatchEnsembleConv, "circular", r"got 'circular'.*write 'CIRCULAR'"),
            (
                BatchEnsembleConvTranspose,
                "REFLECT",
                r"`padding='REFLECT'` is not defined for transposed",
            ),
            (
                BatchEnsembleConvTranspose,
                "CAUSAL",
                r"`padding='CAUSAL'` is not defined for transposed",
            ),
        ],
    )
    def test_bad_padding_raises_at_construction(self, cls, padding, match):
        rngs = nnx.Rngs(0)
        before = snapshot(rngs)
        with pytest.raises(ValueError, match=match):
            cls(4, 6, (3, 3), num_members=3, padding=padding, rngs=rngs)
        assert_same(before, snapshot(rngs))

    @pytest.mark.parametrize(
        "cls, kwargs, match",
        [
            (
                BatchEnsembleConv,
                {"strides": (1, 2, 1)},
                r"`strides` must be an int or a sequence of 2 ints",
            ),
            (
                BatchEnsembleConv,
                {"kernel_dilation": 0},
                r"`kernel_dilation` must be an int >= 1, got 0",
            ),
            (
                BatchEnsembleConv,
                {"input_dilation": (1, "2")},
                r"`input_dilation` must be an int >= 1",
            ),
            (
                BatchEnsembleConvTranspose,
                {"strides": (2,)},
                r"`strides` must be an int or a sequence of 2 ints",
            ),
        ],
    )
    def test_bad_options_raise_at_construction(self, cls, kwargs, match):
        rngs = nnx.Rngs(0)
        before = snapshot(rngs)
        with pytest.raises((ValueError, TypeError), match=match):
            cls(4, 6, (3, 3), num_members=3, rngs=rngs, **kwargs)
        assert_same(before, snapshot(rngs))

    @pytest.mark.parametrize("padding", ["SAME", "VALID", "same", "CIRCULAR"])
    def test_string_padding_with_input_dilation_raises_at_construction(self, padding):
        rngs = nnx.Rngs(0)
        before = snapshot(rngs)
        with pytest.raises(
            ValueError,
            match=r"`padding='.*'` is not defined with `input_dilation` "
            r"\(=\(2, 1\)\) above 1.*\(low, high\) pair",
        ):
            BatchEnsembleConv(
                4,
                6,
                (3, 3),
                num_members=3,
                padding=padding,
                input_dilation=(2, 1),
                rngs=rngs,
            )
        assert_same(before, snapshot(rngs))
        # Flax constructs such a layer and fails only when it is called.
        flax_layer = nnx.Conv(
            4, 6, (3, 3), padding=padding, input_dilation=(2, 1), rngs=nnx.Rngs(0)
        )
        with pytest.raises(ValueError, match="String padding is not implemented"):
            flax_layer(random_array(0, (1, 5, 5, 4)))

    def test_explicit_padding_with_input_dilation_equals_flax(self):
        padding = ((1, 1), (2, 0))
        layer = BatchEnsembleConv(
            4,
            6,
            (3, 3),
            num_members=3,
            padding=padding,
            input_dilation=2,
            r_init=initializers.ones(),
            s_init=initializers.ones(),
            rngs=nnx.Rngs(0),
        )
        flax_layer = nnx.Conv(
            4, 6, (3, 3), padding=padding, input_dilation=2, rngs=nnx.Rngs(1)
        )
        flax_layer.kernel[...] = layer.kernel[...]
        x = random_array(0, (2, 5, 5, 4))
        y = layer(ensembles.tile(x, 3))
        assert_close(y[:2], flax_layer(x))
        assert_close(y[4:], flax_layer(x))


# (transpose, constructor options, input shape after the batch axis) of inputs
# with an empty spatial axis. Flax gives an empty output axis for every padding
# but a transposed VALID (or explicitly padded) one, whose outputs are the bias
# alone: the gradients then reach the bias and nothing else.
EMPTY_CASES = {
    "conv-same": (False, {"kernel_size": 3}, (0, 4)),
    "conv-valid-strided": (
        False,
        {"kernel_size": 3, "padding": "VALID", "strides": 2},
        (0, 4),
    ),
    "conv-padded-2d": (
        False,
        {"kernel_size": (1, 3), "padding": [(1, 1), (0, 2)]},
        (0, 5, 4),
    ),
    "conv-circular-kernel-1": (
        False,
        {"kernel_size": (1, 3), "padding": "CIRCULAR"},
        (0, 5, 4),
    ),
    "conv-groups-causal": (
        False,
        {"kernel_size": 2, "padding": "CAUSAL", "feature_group_count": 2},
        (0, 4),
    ),
    "transpose-same-strided": (True, {"kernel_size": 3, "strides": 2}, (0, 4)),
    "transpose-valid": (
        True,
        {"kernel_size": 3, "padding": "VALID", "transpose_kernel": True},
        (0, 4),
    ),
}


@pytest.mark.parametrize(
    "name",
    [
        # A spread in the quick tier: conv, transposed, an output of the bias alone.
        name
        if name in ("conv-padded-2d", "transpose-valid", "conv-groups-causal")
        else pytest.param(name, marks=pytest.mark.slow)
        for name in EMPTY_CASES
    ],
)
def test_an_empty_spatial_axis_gives_what_flax_gives(name, formulation):
    # nnx.Conv maps [N, 0, C] to [N, 0, out]; this used to raise a bare
    # ZeroDivisionError from inside jnp.reshape.
    transpose, options, shape = EMPTY_CASES[name]
    options = layer_options(options, transpose)
    layer = make_layer(options, transpose)
    x = random_array(1, (NUM_MEMBERS * BATCH, *shape))
    reference = reference_fn(options, transpose)
    expected = jax.jit(reference)(x, *params(layer))
    cotangent = random_array(2, expected.shape)

    def loss(layer, x):
        y = layer(x)
        return jnp.sum(y * cotangent), y

    def reference_loss(x, kernel, r, s, bias):
        return jnp.sum(reference(x, kernel, r, s, bias) * cotangent)

    (grads, grad_x), y = nnx.jit(nnx.grad(loss, argnums=(0, 1), has_aux=True))(layer, x)
    expected_grads = jax.jit(jax.grad(reference_loss, argnums=(0, 1, 2, 3, 4)))(
        x, *params(layer)
    )
    assert y.shape == expected.shape
    assert_close(y, expected)
    assert_close(grad_x, expected_grads[0])
    for name_, e in zip(["kernel", "r", "s", "bias"], expected_grads[1:], strict=True):
        assert_close(getattr(grads, name_)[...], e)
    # The functional op and a member view give the same.
    if transpose:
        y_op = ensembles.ops.batch_ensemble_conv_transpose(
            x,
            *params(layer),
            num_members=NUM_MEMBERS,
            strides=options.get("strides"),
            padding=options.get("padding", "SAME"),
            transpose_kernel=options.get("transpose_kernel", False),
        )
    else:
        y_op = ensembles.ops.batch_ensemble_conv(
            x,
            *params(layer),
            num_members=NUM_MEMBERS,
            strides=options.get("strides", 1),
            padding=options.get("padding", "SAME"),
            feature_group_count=options.get("feature_group_count", 1),
        )
    assert_close(y_op, expected)
    assert_close(nnx.view(layer, member=1)(x[BATCH:]), expected[BATCH:])


def test_an_empty_axis_of_an_extra_batch_axis_or_both_runs():
    # Flax's own reshape divides by zero on [N, 2, 0, C]: ours flattens the
    # batch axes by their counted size.
    layer = make_layer({"kernel_size": 3, "out_features": 6}, transpose=False)
    for shape in [(2, 0, 4), (0, 0, 4), (0, 5, 4)]:
        x = jnp.zeros((NUM_MEMBERS * BATCH, *shape))
        y = layer(x)
        assert y.shape == (NUM_MEMBERS * BATCH, *shape[:-1], 6)


def test_an_empty_circular_transposed_axis_is_empty_and_differentiable():
    # nnx.ConvTranspose divides by the zero period of an empty axis; its
    # output size there is the input's times the stride: empty.
    layer = make_layer(
        {"kernel_size": 3, "out_features": 6, "padding": "CIRCULAR", "strides": 2},
        transpose=True,
    )
    x = jnp.zeros((NUM_MEMBERS * BATCH, 0, 4))
    assert layer(x).shape == (NUM_MEMBERS * BATCH, 0, 6)
    grads = nnx.grad(lambda layer: jnp.sum(layer(x)))(layer)
    for leaf in jax.tree.leaves(grads):
        np.testing.assert_array_equal(leaf, 0.0)


@pytest.mark.parametrize("padding", ["CIRCULAR", "REFLECT"])
@pytest.mark.parametrize("posterior", [None, "gaussian"])
def test_wrapping_an_empty_axis_raises_and_changes_nothing(padding, posterior):
    # nnx.Conv's jnp.pad refuses too ("Cannot apply 'wrap' padding to empty
    # axis"); ours names the argument, and a rank-1 layer draws nothing.
    layer = BatchEnsembleConv(
        4, 6, 3, padding=padding, num_members=2, posterior=posterior, rngs=nnx.Rngs(0)
    )
    before = snapshot(layer)
    with pytest.raises(
        ValueError, match=rf"`inputs` has an empty spatial axis.*{padding}"
    ):
        layer(jnp.zeros((4, 0, 4)))
    assert_same(before, snapshot(layer))
    with pytest.raises(ValueError, match="`inputs` has an empty spatial axis"):
        ensembles.ops.batch_ensemble_conv(
            jnp.zeros((4, 0, 4)), *params(layer), num_members=2, padding=padding
        )
