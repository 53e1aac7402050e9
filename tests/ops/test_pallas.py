"""The fused Pallas kernel: poisoned against out-of-bounds access, exact when ragged.

CPU has no compiled Pallas backend, so numerics are checked in Pallas'
interpreters (both kernel families; the TPU family once in the TPU simulator),
and the GPU/TPU paths are proven by lowering for "cuda" and "tpu" from this
machine.

Why the interceptor. Pallas' Triton lowering masks no load or store: a block
that overhangs its array reads and writes the neighbouring rows, members or
buffers (shared/notes/gpu.md: that is how bb923f3's kernel went wrong on an
H100 while every CPU test passed, since the generic interpreter pads a partial
block with NaN and drops its out-of-bounds stores, and the kernel masked the
NaN away). So every ``pallas_call`` the tests trigger goes through
:func:`checked_pallas_call`, which raises on any block that does not tile its
operand, before the interpreter runs the kernel on NaN-filled scratch. The
check is this file's own, independent of the library's ``exact_block_spec``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import ensembles
from ensembles.ops import BlockSizes, batch_ensemble_dense, resolve_impl
from ensembles.ops.cost import AUTO_TABLE, Choice
from ensembles.ops.pallas import fused_dense
from ensembles.ops.plan import IMPLS
from tests.covering import covering
from tests.reference import make_args
from tests.tolerances import assert_close, assert_close_to_scale

SMALL_BLOCKS = BlockSizes(block_b=16, block_out=16, block_k=16)
GRAD_NAMES = ("inputs", "kernel", "r", "s", "bias")


class PartialBlockError(AssertionError):
    """A kernel block overhangs its operand: Triton would touch other memory."""


def _check_spec(spec, shape, what):
    block = getattr(spec, "block_shape", None)
    if block is None:  # the whole array is one block
        return
    dims = [b for b in block]
    if len(dims) != len(shape):
        raise PartialBlockError(f"{what}: block {block} for an array of shape {shape}")
    for dim, b in zip(shape, dims, strict=True):
        size = b if isinstance(b, int) else getattr(b, "block_size", None)
        if size is not None and dim % size:
            raise PartialBlockError(
                f"{what}: block {tuple(block)} does not tile shape {tuple(shape)}"
            )


def checked_pallas_call(original, log):
    """``pl.pallas_call`` that raises on a partial block and logs each launch."""

    def pallas_call(kernel, out_shape, *args, in_specs=None, out_specs=None, **kw):
        call = original(
            kernel, out_shape, *args, in_specs=in_specs, out_specs=out_specs, **kw
        )
        name = kw.get("name", "kernel")

        def run(*operands):
            for i, (spec, x) in enumerate(zip(in_specs, operands, strict=True)):
                _check_spec(spec, x.shape, f"{name} input {i}")
            outs = jax.tree.leaves(out_shape)
            specs = out_specs if isinstance(out_specs, tuple | list) else [out_specs]
            for i, (spec, o) in enumerate(zip(specs, outs, strict=True)):
                _check_spec(spec, o.shape, f"{name} output {i}")
            log.append(name)
            return call(*operands)

        return run

    return pallas_call


@pytest.fixture
def launches(monkeypatch):
    """The names of the kernels launched; every launch is checked for overhang."""
    log = []
    monkeypatch.setattr(pl, "pallas_call", checked_pallas_call(pl.pallas_call, log))
    return log


def test_interceptor_rejects_a_partial_block(launches):
    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    x = jnp.ones((10, 128))
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    call = pl.pallas_call(
        copy,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(2,),
        in_specs=[spec],
        out_specs=spec,
        interpret=True,
    )
    with pytest.raises(PartialBlockError, match=r"\(8, 128\) does not tile"):
        call(x)


def reference64(x, kernel, r, s, bias, num_members, cotangent):
    """Float64 numpy forward and VJP, member by member over W * outer(r_k, s_k)."""
    x, kernel, r, s, g = (
        np.asarray(a, np.float64) for a in (x, kernel, r, s, cotangent)
    )
    bias = None if bias is None else np.asarray(bias, np.float64)
    xs, gs = np.split(x, num_members), np.split(g, num_members)
    ys, dxs = [], []
    dkernel, dr, ds = np.zeros_like(kernel), np.zeros_like(r), np.zeros_like(s)
    for k in range(num_members):
        scale = np.outer(r[k], s[k])
        y = xs[k] @ (kernel * scale)
        ys.append(y if bias is None else y + bias[k])
        dxs.append(gs[k] @ (kernel * scale).T)
        m = xs[k].T @ gs[k]  # d loss / d (member k's effective kernel)
        dkernel += m * scale
        dr[k] = (m * kernel * s[k][None, :]).sum(1)
        ds[k] = (m * kernel * r[k][:, None]).sum(0)
    grads = [np.concatenate(dxs), dkernel, dr, ds]
    if bias is not None:
        grads.append(np.stack([gk.sum(0) for gk in gs]))
    return np.concatenate(ys), grads


def assert_matches_reference(fn, args, num_members, dtype):
    """fn's outputs and all gradients against the float64 per-member loop."""
    args = [a for a in args if a is not None]
    bias = args[4] if len(args) == 5 else None

    @jax.jit
    def run(*args):
        y, vjp = jax.vjp(fn, *args)
        cotangent = jax.random.normal(jax.random.key(0), y.shape, jnp.float32)
        return y, cotangent, vjp(cotangent.astype(y.dtype))

    y, cotangent, grads = run(*args)
    y_ref, grads_ref = reference64(*args[:4], bias, num_members, cotangent)
    assert y.dtype == dtype and y.shape == y_ref.shape
    assert_close_to_scale(y, y_ref, dtype, err_msg="outputs")
    assert len(grads) == len(grads_ref)
    for name, g, e in zip(GRAD_NAMES, grads, grads_ref, strict=False):
        assert g.dtype == dtype and g.shape == e.shape, name
        assert_close_to_scale(g, e, dtype, err_msg=name)


# The shapes of shared/notes/gpu.md's correctness table (E, B, in, out): aligned,
# rows per member not a multiple of the row block, in and out not multiples of
# their blocks, and the shape "auto" used to send to the kernel. With the
# default BlockSizes, as on the GPU.
GPU_TABLE = [
    (2, 128, 128, 128),
    (2, 130, 128, 128),
    (1, 130, 128, 128),
    (2, 128, 100, 128),
    (2, 128, 160, 128),
    (2, 128, 128, 100),
    (2, 128, 128, 160),
    (8, 130, 256, 384),
    (4, 5, 96, 48),
]


def table_id(shape):
    return "E{}-B{}-{}x{}".format(*shape)


# Every shape in both kernel families; the dtype alternates so that every shape
# runs in both dtypes (one per family) and each family runs both dtypes on four
# or five shapes: 18 of the 36 combinations. (The tiling, which the shapes
# probe, depends on the family and the shape, not on the dtype.)
TABLE_CASES = covering(
    {
        "family": ["gpu", "tpu"],
        "shape": GPU_TABLE,
        "dtype": [jnp.float32, jnp.bfloat16],
    },
    [
        (family, shape, [jnp.float32, jnp.bfloat16][(i + j) % 2])
        for j, family in enumerate(["gpu", "tpu"])
        for i, shape in enumerate(GPU_TABLE)
    ],
)


@pytest.mark.parametrize(
    "family, shape, dtype",
    [
        pytest.param(family, shape, dtype, id=f"{family}-{table_id(shape)}-{name}")
        for family, shape, dtype in TABLE_CASES
        for name in ["f32" if dtype == jnp.float32 else "bf16"]
    ],
)
def test_kernels_on_the_gpu_table(launches, family, shape, dtype):
    num_members, batch, fan_in, fan_out = shape
    args = make_args(sum(shape), num_members, batch, (), fan_in, fan_out, dtype)

    def fn(*a):
        return fused_dense(*a, _family=family)

    assert_matches_reference(fn, args, num_members, dtype)
    # Forward, the forward again inside the VJP's trace, dx/dr and dkernel/ds.
    assert sorted(set(launches)) == [
        "batch_ensemble_dense_dw",
        "batch_ensemble_dense_dx",
        "batch_ensemble_dense_fwd",
    ]


# Small blocks and odd sizes: several row, in and out blocks at once, middle
# axes, no bias, E in {1, 3, 4}.
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
def test_gpu_kernels_with_small_blocks(launches, case):
    num_members, batch, middle, fan_in, fan_out, dtype, bias = case
    args = make_args(3, num_members, batch, middle, fan_in, fan_out, dtype, bias)

    def fn(x, *rest):
        y = batch_ensemble_dense(
            x.reshape(num_members * batch, *middle, fan_in),
            *rest,
            num_members=num_members,
            impl="pallas",
            interpret=True,
            block_sizes=SMALL_BLOCKS,
        )
        return y.reshape(-1, fan_out)

    flat_args = (args[0].reshape(-1, fan_in), *args[1:])
    assert_matches_reference(fn, flat_args, num_members, dtype)
    assert len(launches) >= 3


def test_tpu_kernels_in_the_tpu_simulator(launches):
    # Random grid order and NaN-filled VMEM: a stricter check of the
    # accumulators' init/store logic.
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
    assert_matches_reference(fn, args, 2, jnp.float32)


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


MEASURED_WIN = Choice(
    "gpu",
    "pallas",
    measured="a test's invented row",
    dtypes=("float32", "bfloat16"),
    min_rows=8,
    feature_multiple=128,
    pallas_over_xla=(0.9, 0.95),
)


def test_auto_runs_xla_everywhere_today(monkeypatch):
    # No backend has a measurement where the kernel wins: "auto" never runs it,
    # for any backend, dtype or shape (it used to on GPU/TPU, silently wrong).
    assert all(choice.impl == "xla" for choice in AUTO_TABLE)
    assert {choice.backend for choice in AUTO_TABLE} == {"cpu", "gpu", "tpu"}
    for backend in ("cpu", "gpu", "tpu"):
        for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
            for shape in [(256, 1024, 1024), (130, 256, 384), (5, 96, 48)]:
                assert resolve_impl(
                    "auto", backend=backend, shape=shape, dtype=dtype
                ) == ("xla")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    args = make_args(0, 8, 130, (), 256, 384, jnp.bfloat16)
    fn = lambda *a: batch_ensemble_dense(*a, num_members=8)  # noqa: E731
    assert pallas_calls(fn, args) == []


def test_auto_follows_a_measured_row(monkeypatch):
    monkeypatch.setattr("ensembles.ops.plan.AUTO_TABLE", (MEASURED_WIN,))
    big = (256, 1024, 1024)
    assert resolve_impl("auto", backend="gpu", shape=big, dtype=jnp.bfloat16) == (
        "pallas"
    )
    uncovered = [
        ("gpu", (256, 1000, 1024), jnp.float32),  # in not a multiple of 128
        ("gpu", (256, 1024, 1000), jnp.float32),  # out not a multiple of 128
        ("gpu", (4, 1024, 1024), jnp.float32),  # too few rows per member
        ("gpu", big, jnp.float16),  # a dtype the row does not cover
        ("tpu", big, jnp.float32),  # another backend
    ]
    for backend, shape, dtype in uncovered:
        assert resolve_impl("auto", backend=backend, shape=shape, dtype=dtype) == "xla"
    assert resolve_impl("auto", backend="gpu") == "xla"  # no shape, no dtype
    # Operands the kernel rejects fall back to "xla" rather than raise.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x, kernel, r, s, bias = make_args(0, 1, 8, (), 128, 128, jnp.float32)
    cases = [
        ((x, kernel.astype(jnp.bfloat16), r, s, bias), {}),
        ((x, kernel, r, s, bias), {"preferred_element_type": jnp.bfloat16}),
    ]
    for args, kwargs in cases:
        fn = lambda *a, kw=kwargs: batch_ensemble_dense(*a, num_members=1, **kw)  # noqa: E731
        assert pallas_calls(fn, args) == []
    fn = lambda *a: batch_ensemble_dense(*a, num_members=1)  # noqa: E731
    assert len(pallas_calls(fn, (x, kernel, r, s, bias))) == 3  # cpu/cuda/tpu


@pytest.mark.parametrize("ratios", [None, (0.9, 1.2), (1.0, 0.5)])
def test_a_pallas_row_needs_a_measured_win(ratios):
    with pytest.raises(ValueError, match=r"needs `pallas_over_xla`"):
        Choice("gpu", "pallas", measured="x", pallas_over_xla=ratios)


def test_resolve_impl_explicit_and_errors():
    assert IMPLS == ("auto", "xla", "pallas")
    assert resolve_impl("auto") == "xla"  # this machine is a CPU
    assert resolve_impl("pallas", backend="cpu") == "pallas"
    assert resolve_impl("xla", backend="gpu", shape=(256, 1024, 1024)) == "xla"
    with pytest.raises(ValueError, match=r"`impl` must be one of"):
        resolve_impl("triton")
    with pytest.raises(ValueError, match=r"`backend` must be one of"):
        Choice("rocm", "xla", measured="x")


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
