"""The fused Pallas kernel against the "xla" formulation.

CPU has no compiled Pallas backend, so numerics are checked in Pallas' interpret
mode (both kernel families, and the TPU kernel once in the TPU simulator), and
the GPU/TPU paths are proven by lowering for "cuda" and "tpu" from this machine.
Shapes are tiny because the interpreter is slow.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

import ensembles
from ensembles.ops import BlockSizes, batch_ensemble_dense
from ensembles.ops import pallas_dense as pd
from ensembles.ops.dense import IMPLS, resolve_impl
from tests.reference import make_args
from tests.tolerances import assert_close

SMALL_BLOCKS = BlockSizes(block_b=16, block_out=16, block_k=16)
GRAD_NAMES = ("inputs", "kernel", "r", "s", "bias")


def outputs_and_grads(fn, args):
    """fn(*args) and the gradients of <fn(*args), cotangent> for every arg."""
    num_args = len(args) if args[-1] is not None else len(args) - 1
    args = args[:num_args]

    @jax.jit
    def run(*args):
        y, vjp = jax.vjp(fn, *args)
        cotangent = jax.random.normal(jax.random.key(0), y.shape, jnp.float32)
        return y, vjp(cotangent.astype(y.dtype))

    return run(*args)


def assert_matches_xla(pallas_fn, args, num_members, dtype):
    xla_fn = lambda *a: batch_ensemble_dense(*a, num_members=num_members, impl="xla")  # noqa: E731
    y, grads = outputs_and_grads(pallas_fn, args)
    y_xla, grads_xla = outputs_and_grads(xla_fn, args)
    assert y.shape == y_xla.shape and y.dtype == y_xla.dtype == dtype
    assert_close(y, y_xla, dtype, scale=4)
    assert len(grads) == len(grads_xla)
    for name, g, e in zip(GRAD_NAMES, grads, grads_xla, strict=False):
        assert g.dtype == e.dtype == dtype, name
        assert g.shape == e.shape, name
        # bf16 gradients are sums of dozens of rounded products on both sides.
        assert_close(g, e, dtype, scale=8 if dtype == jnp.float32 else 16)


# (E, B, middle axes, in, out, dtype, bias). With 16-wide blocks: ragged rows
# (R = 20, 6, 18 rows per member), in/out not multiples of the blocks, E in
# {1, 3, 4}. Few cases: each costs seconds of interpreter compilation.
GPU_CASES = [
    (1, 20, (), 40, 37, jnp.float32, True),
    (4, 3, (2,), 33, 20, jnp.float32, False),
    (3, 18, (), 24, 40, jnp.bfloat16, True),
]


def case_id(case):
    num_members, batch, middle, fan_in, fan_out, dtype, bias = case
    return (
        f"E{num_members}-B{batch}{'x' + str(middle) if middle else ''}-"
        f"{fan_in}x{fan_out}-{jnp.dtype(dtype).name}{'-bias' if bias else ''}"
    )


@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_gpu_kernels_interpreted_match_xla(case):
    num_members, batch, middle, fan_in, fan_out, dtype, bias = case
    args = make_args(3, num_members, batch, middle, fan_in, fan_out, dtype, bias)

    def fn(*a):
        return batch_ensemble_dense(
            *a,
            num_members=num_members,
            impl="pallas",
            interpret=True,
            block_sizes=SMALL_BLOCKS,
        )

    assert_matches_xla(fn, args, num_members, dtype)


# TPU blocks on the lane axis are at least 128 wide, so 130/140 features give
# two blocks each (reductions zero-padded, output tiles ragged); 20 and 18 rows
# give a ragged second row block with block_b=16 (forward, dx) and block_k=16
# (the row steps of the kernel gradient).
TPU_CASES = [
    (3, 20, (), 130, 140, jnp.float32, True),
    (4, 9, (2,), 20, 12, jnp.bfloat16, False),
]


@pytest.mark.parametrize("case", TPU_CASES, ids=case_id)
def test_tpu_kernels_interpreted_match_xla(case):
    num_members, batch, middle, fan_in, fan_out, dtype, bias = case
    args = make_args(4, num_members, batch, middle, fan_in, fan_out, dtype, bias)
    blocks = BlockSizes(block_b=16, block_out=128, block_k=16)

    def fn(*a):
        return pd.fused_dense(*a, block_sizes=blocks, _family="tpu")

    assert_matches_xla(fn, args, num_members, dtype)


def test_tpu_kernels_in_the_tpu_simulator():
    # Random grid order and uninitialised (NaN) VMEM: a stricter check of the
    # accumulator init/store logic and of the masking of the ragged row block.
    args = make_args(5, 2, 20, (), 7, 5, jnp.float32)
    params = pltpu.InterpretParams(random_seed=0)

    def fn(*a):
        return batch_ensemble_dense(
            *a,
            num_members=2,
            impl="pallas",
            interpret=params,
            block_sizes=SMALL_BLOCKS,
        )

    assert pallas_calls(fn, args) == [params]
    assert_matches_xla(fn, args, 2, jnp.float32)


def test_preferred_element_type_float32_on_bfloat16():
    args = make_args(7, 2, 5, (), 9, 6, jnp.bfloat16)
    kwargs = {"num_members": 2, "preferred_element_type": jnp.float32}
    y = batch_ensemble_dense(*args, impl="pallas", interpret=True, **kwargs)
    y_xla = batch_ensemble_dense(*args, impl="xla", **kwargs)
    assert y.dtype == y_xla.dtype == jnp.float32
    assert_close(y, y_xla, jnp.bfloat16)


# --------------------------------------------------------------------------- #
# interpret really reaches pallas_call; impl resolution
# --------------------------------------------------------------------------- #


def pallas_calls(fn, args):
    """The `interpret` parameter of every pallas_call in fn's jaxpr."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(eqn.params["interpret"])
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else [param]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*[a for a in args if a is not None]).jaxpr)
    return found


@pytest.mark.parametrize("impl", ["pallas", "auto"])
def test_interpret_reaches_pallas_call(impl):
    args = make_args(0, 2, 3, (), 4, 5, jnp.float32)

    def fn(*a):
        return batch_ensemble_dense(*a, num_members=2, impl=impl, interpret=True)

    def loss(*a):
        return jnp.sum(fn(*a) ** 2)

    assert pallas_calls(fn, args) == [True]
    # Forward, dx/dr and dkernel/ds kernels: the backward pass is fused too.
    assert pallas_calls(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), args) == [True] * 3


def test_xla_and_auto_on_cpu_run_no_kernel():
    args = make_args(0, 2, 3, (), 4, 5, jnp.float32)
    for impl in ("xla", "auto"):
        fn = lambda *a, impl=impl: batch_ensemble_dense(*a, num_members=2, impl=impl)  # noqa: E731
        assert pallas_calls(fn, args) == []


def test_auto_never_picks_the_kernel_for_operands_it_rejects(monkeypatch):
    # Pretend to be a GPU: shapes that suit the kernel, but operand dtypes it
    # rejects, must fall back to "xla" rather than raise.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x, kernel, r, s, bias = make_args(0, 1, 8, (), 128, 128, jnp.float32)
    cases = [
        ((x, kernel.astype(jnp.bfloat16), r, s, bias), {}),
        ((x, kernel, r, s, bias), {"preferred_element_type": jnp.bfloat16}),
        ((x.astype(jnp.float16), kernel, r, s, bias), {}),
    ]
    for args, kwargs in cases:
        fn = lambda *a, kw=kwargs: batch_ensemble_dense(*a, num_members=1, **kw)  # noqa: E731
        assert pallas_calls(fn, args) == []
    fn = lambda *a: batch_ensemble_dense(*a, num_members=1)  # noqa: E731
    assert len(pallas_calls(fn, (x, kernel, r, s, bias))) == 3  # cpu/cuda/tpu


def test_resolve_impl():
    assert IMPLS == ("auto", "xla", "pallas")
    big = (256, 1024, 1024)
    assert resolve_impl("auto") == "xla"  # this machine is a CPU
    assert resolve_impl("auto", backend="cpu", shape=big, dtype=jnp.float32) == "xla"
    for backend in ("gpu", "tpu"):
        for dtype in (jnp.float32, jnp.bfloat16):
            assert resolve_impl("auto", backend=backend, shape=big, dtype=dtype) == (
                "pallas"
            )
        assert resolve_impl("auto", backend=backend) == "xla"
        unsuited = [
            ((256, 1000, 1024), jnp.float32),  # in not a multiple of 128
            ((256, 1024, 1000), jnp.float32),  # out not a multiple of 128
            ((4, 1024, 1024), jnp.float32),  # too few rows per member
            (big, jnp.float16),  # dtype the kernel does not support
        ]
        for shape, dtype in unsuited:
            assert resolve_impl("auto", backend=backend, shape=shape, dtype=dtype) == (
                "xla"
            )
    assert resolve_impl("pallas", backend="cpu") == "pallas"
    assert resolve_impl("xla", backend="gpu", shape=big, dtype=jnp.float32) == "xla"


# --------------------------------------------------------------------------- #
# Layers: nnx.view(model, impl="pallas") switches a whole model
# --------------------------------------------------------------------------- #


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = ensembles.BatchEnsembleLinear(6, 20, num_members=3, rngs=rngs)
        self.out = ensembles.BatchEnsembleLinear(
            20, 5, num_members=3, use_bias=False, rngs=rngs
        )

    def __call__(self, x):
        return self.out(jax.nn.tanh(self.hidden(x)))


def test_layers_switch_to_pallas_with_nnx_view():
    model = MLP(nnx.Rngs(0))
    fused = nnx.view(model, impl="pallas")
    assert model.hidden.impl == model.out.impl == "auto"
    assert fused.hidden.impl == fused.out.impl == "pallas"
    x = ensembles.tile(
        jnp.asarray(np.random.default_rng(1).standard_normal((7, 6)), jnp.float32), 3
    )

    def loss(model, x):
        return jnp.sum(model(x) ** 2)

    @nnx.jit
    def loss_and_grads(model, x):
        return model(x), nnx.grad(loss)(model, x)

    y, grads = loss_and_grads(fused, x)
    y_xla, grads_xla = loss_and_grads(model, x)
    assert_close(y, y_xla, jnp.float32, scale=4)
    flat, flat_xla = nnx.to_flat_state(grads), nnx.to_flat_state(grads_xla)
    assert [path for path, _ in flat] == [path for path, _ in flat_xla]
    assert len(flat) == 7  # kernel, r, s (x2) and one bias
    for (path, g), (_, e) in zip(flat, flat_xla, strict=True):
        assert_close(g[...], e[...], jnp.float32, scale=8), path
    # The view really runs the kernel. Layers pass no `interpret`, so the op
    # goes through lax.platform_dependent (forward and backward), whose CPU
    # branch interprets the GPU kernels: one interpreted pallas_call per layer
    # forward, three per layer under grad, beside the cuda and tpu branches'.
    assert pallas_calls(lambda x: fused(x), [x]).count(True) == 2
    graphdef, state = nnx.split(fused)
    grad_fn = lambda state, x: nnx.grad(loss)(nnx.merge(graphdef, state), x)  # noqa: E731
    interpreted = pallas_calls(grad_fn, [state, x])
    assert interpreted.count(True) == 6 and len(interpreted) == 18


# --------------------------------------------------------------------------- #
# Lowering proofs: the GPU and TPU paths lower from this CPU-only machine
# --------------------------------------------------------------------------- #

TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "tpu_custom_call"
PLATFORMS = {
    # platform: (abstract device kind, custom call it must hold, one it must not)
    "cuda": ("NVIDIA H100 80GB HBM3", TRITON, MOSAIC),
    "tpu": ("TPU v5 lite", MOSAIC, TRITON),
}


def lowered_text(fn, args, platform):
    if not (
        hasattr(jax.sharding, "AbstractDevice")
        and hasattr(jax.sharding, "use_abstract_mesh")
    ):
        pytest.skip(
            f"jax {jax.__version__} has no jax.sharding.AbstractDevice / "
            f"use_abstract_mesh to lower for a platform this machine lacks"
        )
    device = jax.sharding.AbstractDevice(
        device_kind=PLATFORMS[platform][0], num_cores=None, platform=platform
    )
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args if a is not None]
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(fn).trace(*specs)
        return traced.lower(lowering_platforms=(platform,)).as_text()


def custom_calls(text):
    return re.findall(r"custom_call @([^(\s]+)\(", text)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize(
    "shape, dtype, bias",
    [
        ((4, 64, 256, 384), jnp.float32, True),
        ((3, 37, 200, 130), jnp.bfloat16, False),  # ragged rows, padded in
    ],
    ids=["aligned-f32", "ragged-bf16"],
)
def test_lowers_for_gpu_and_tpu(platform, shape, dtype, bias):
    num_members, batch, fan_in, fan_out = shape
    args = make_args(0, num_members, batch, (), fan_in, fan_out, dtype, bias)
    _, wanted, unwanted = PLATFORMS[platform]

    def fn(*a):
        return batch_ensemble_dense(*a, num_members=num_members, impl="pallas")

    def loss(*a):
        return jnp.sum(fn(*a).astype(jnp.float32) ** 2)

    forward = custom_calls(lowered_text(fn, args, platform))
    assert forward == [wanted]
    argnums = tuple(range(len(args) if bias else len(args) - 1))
    backward = custom_calls(
        lowered_text(jax.grad(loss, argnums=argnums), args, platform)
    )
    # The forward kernel plus the dx/dr and dkernel/ds kernels; nothing else.
    assert backward == [wanted] * 3
    assert unwanted not in forward + backward


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


class TestErrors:
    def args(self, dtype=jnp.float32):
        return make_args(0, 2, 3, (), 4, 5, dtype)

    @pytest.mark.parametrize(
        "field, value", [("block_b", 24), ("block_out", 8), ("block_k", 0)]
    )
    def test_block_size_values(self, field, value):
        with pytest.raises(
            ValueError,
            match=rf"`BlockSizes.{field}` must be a power of two >= 16, got {value}",
        ):
            BlockSizes(**{field: value})

    @pytest.mark.parametrize("value", [32.0, True, "32"])
    def test_block_size_types(self, value):
        with pytest.raises(TypeError, match=r"`BlockSizes.block_k` must be an int"):
            BlockSizes(block_k=value)

    def test_block_sizes_is_frozen(self):
        with pytest.raises(AttributeError):
            BlockSizes().block_b = 32

    def test_block_sizes_type(self):
        with pytest.raises(TypeError, match=r"`block_sizes` must be an .*BlockSizes"):
            batch_ensemble_dense(
                *self.args(), num_members=2, impl="pallas", block_sizes=(16, 16, 16)
            )

    @pytest.mark.parametrize("dtype", [jnp.float16, jnp.int32])
    def test_unsupported_dtype(self, dtype):
        with pytest.raises(
            TypeError,
            match=rf"supports dtypes \['float32', 'bfloat16'\], got "
            rf"{jnp.dtype(dtype).name}.*impl=\"xla\"",
        ):
            batch_ensemble_dense(*self.args(dtype), num_members=2, impl="pallas")

    def test_mixed_dtypes(self):
        x, kernel, r, s, bias = self.args()
        with pytest.raises(
            TypeError, match=r"one dtype, got inputs=float32, kernel=bfloat16"
        ):
            batch_ensemble_dense(
                x, kernel.astype(jnp.bfloat16), r, s, bias, num_members=2, impl="pallas"
            )

    def test_preferred_element_type(self):
        with pytest.raises(TypeError, match=r"`preferred_element_type`.*bfloat16"):
            batch_ensemble_dense(
                *self.args(),
                num_members=2,
                impl="pallas",
                preferred_element_type=jnp.bfloat16,
            )

    @pytest.mark.parametrize(
        "kwargs, name",
        [({"interpret": True}, "interpret"), ({"block_sizes": BlockSizes()}, "block")],
    )
    def test_pallas_options_with_xla(self, kwargs, name):
        with pytest.raises(ValueError, match=rf'`{name}.*impl="xla"'):
            batch_ensemble_dense(*self.args(), num_members=2, impl="xla", **kwargs)

    def test_interpret_type(self):
        with pytest.raises(TypeError, match=r"`interpret` must be a bool"):
            batch_ensemble_dense(
                *self.args(), num_members=2, impl="pallas", interpret="yes"
            )

    def test_shape_errors_unchanged(self):
        x, kernel, r, s, bias = self.args()
        with pytest.raises(ValueError, match=r"inputs.shape\[0\]` \(=5\)"):
            batch_ensemble_dense(
                x[:5], kernel, r, s, bias, num_members=2, impl="pallas"
            )
