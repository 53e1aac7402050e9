"""The fused Pallas kernel: poisoned against out-of-bounds access, exact when ragged.

CPU has no compiled Pallas backend, so numerics are checked in Pallas'
generic interpreter here (both kernel families) and in its TPU simulator
(``test_pallas_simulator.py``); the GPU/TPU paths are lowered for "cuda" and
"tpu" from this machine (``test_pallas_lowering.py``) and compiled for an H100
and TPUs in the compile tier (``test_compile.py``); the options and errors are
in ``test_pallas_errors.py``.

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

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import pallas as pl

import ensembles
from ensembles.experimental.pallas import BlockSizes, fused_dense
from ensembles.ops import batch_ensemble_dense
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


def assert_matches_reference(fn, args, num_members, dtype, first_layer=False):
    """fn's outputs and all gradients against the float64 per-member loop.

    With ``first_layer``, the inputs carry no derivative (``fn`` is
    differentiated w.r.t. its parameters only, as a model's first layer is):
    the kernel, ``r``, ``s`` and bias gradients are checked.
    """
    args = [a for a in args if a is not None]
    bias = args[4] if len(args) == 5 else None
    x, params = args[0], args[1:]

    @jax.jit
    def run(x, *params):
        if first_layer:
            y, vjp = jax.vjp(lambda *p: fn(x, *p), *params)
        else:
            y, vjp = jax.vjp(fn, x, *params)
        cotangent = jax.random.normal(jax.random.key(0), y.shape, jnp.float32)
        return y, cotangent, vjp(cotangent.astype(y.dtype))

    y, cotangent, grads = run(x, *params)
    y_ref, grads_ref = reference64(*args[:4], bias, num_members, cotangent)
    names = GRAD_NAMES
    if first_layer:
        names, grads_ref = names[1:], grads_ref[1:]
    assert y.dtype == dtype and y.shape == y_ref.shape
    assert_close_to_scale(y, y_ref, dtype, err_msg="outputs")
    assert len(grads) == len(grads_ref)
    for name, g, e in zip(names, grads, grads_ref, strict=False):
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


@pytest.mark.slow
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
        return fused_dense(*a, family=family)

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


# A first layer (the inputs carry no derivative): no input-gradient kernel,
# dr read off the kernel-gradient tiles; ragged on every axis, several blocks
# along each, in both families and dtypes.
FIRST_LAYER_CASES = [
    ("gpu", (2, 20, (), 40, 37, jnp.float32, True)),
    ("gpu", (3, 5, (2,), 33, 20, jnp.bfloat16, False)),
    ("tpu", (2, 20, (), 140, 130, jnp.bfloat16, True)),
]


@pytest.mark.parametrize(
    "family, case",
    FIRST_LAYER_CASES,
    ids=[f"{family}-{case_id(case)}" for family, case in FIRST_LAYER_CASES],
)
def test_first_layer_runs_no_input_gradient_kernel(launches, family, case):
    num_members, batch, middle, fan_in, fan_out, dtype, bias = case
    args = make_args(4, num_members, batch, middle, fan_in, fan_out, dtype, bias)

    def fn(x, *rest):
        y = fused_dense(
            x.reshape(num_members * batch, *middle, fan_in),
            *rest,
            family=family,
            block_sizes=SMALL_BLOCKS,
        )
        return y.reshape(-1, fan_out)

    flat_args = (args[0].reshape(-1, fan_in), *args[1:])
    assert_matches_reference(fn, flat_args, num_members, dtype, first_layer=True)
    assert sorted(set(launches)) == [
        "batch_ensemble_dense_dw",
        "batch_ensemble_dense_fwd",
    ]


def test_preferred_element_type_float32_on_bfloat16():
    args = make_args(7, 2, 5, (), 9, 6, jnp.bfloat16)
    kwargs = {"num_members": 2, "preferred_element_type": jnp.float32}
    y = batch_ensemble_dense(*args, impl="pallas", interpret=True, **kwargs)
    y_xla = batch_ensemble_dense(*args, impl="xla", **kwargs)
    assert y.dtype == y_xla.dtype == jnp.float32
    assert_close(y, y_xla, jnp.bfloat16)


# --------------------------------------------------------------------------- #
# interpret really reaches pallas_call; the kernel runs only when named
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


def test_interpret_reaches_pallas_call():
    args = make_args(0, 2, 3, (), 4, 5, jnp.float32)

    def fn(*a):
        return batch_ensemble_dense(*a, num_members=2, impl="pallas", interpret=True)

    def loss(*a):
        return jnp.sum(fn(*a) ** 2)

    assert pallas_calls(fn, args) == [True]
    # Forward, dx/dr and dkernel/ds kernels: the backward pass is fused too.
    assert pallas_calls(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), args) == [True] * 3
    # A first layer: forward and dkernel/ds/dr; no input gradient.
    assert pallas_calls(jax.grad(loss, argnums=(1, 2, 3, 4)), args) == [True] * 2
    # The inputs alone: forward and dx/dr; no kernel gradient.
    assert pallas_calls(jax.grad(loss, argnums=0), args) == [True] * 2


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_default_and_xla_run_no_kernel_on_any_backend(monkeypatch, backend):
    # The kernel is opt-in: without impl="pallas" no backend runs it, for any
    # dtype or shape (shapes the retired "auto" table covered included).
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    cases = [
        make_args(0, 2, 3, (), 4, 5, jnp.float32),
        make_args(0, 8, 130, (), 256, 384, jnp.bfloat16),
    ]
    for args in cases:
        num_members = args[2].shape[0]
        for extra in ({}, {"impl": "xla"}):

            def fn(*a, extra=extra, num_members=num_members):
                return batch_ensemble_dense(*a, num_members=num_members, **extra)

            def loss(*a, fn=fn):
                return jnp.sum(fn(*a).astype(jnp.float32) ** 2)

            assert pallas_calls(fn, args) == []
            assert pallas_calls(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), args) == []


def test_pallas_without_interpret_picks_the_kernel_per_platform():
    # Named without `interpret`, the op dispatches on the platform it runs
    # on (lax.platform_dependent): the GPU kernel, interpreted on CPU, and
    # the compiled Triton and Mosaic kernels beside it.
    args = make_args(0, 1, 8, (), 128, 128, jnp.float32)

    def fn(*a):
        return batch_ensemble_dense(*a, num_members=1, impl="pallas")

    calls = pallas_calls(fn, args)
    assert len(calls) == 3 and calls.count(True) == 1, calls


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
    assert model.hidden.impl == model.out.impl == "xla"
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
    # forward, beside the cuda and tpu branches'. Under grad, the first layer
    # (its inputs are data) runs the forward and kernel-gradient kernels, the
    # second the input-gradient kernel too.
    assert pallas_calls(lambda x: fused(x), [x]).count(True) == 2
    graphdef, state = nnx.split(fused)
    grad_fn = lambda state, x: nnx.grad(loss)(nnx.merge(graphdef, state), x)  # noqa: E731
    interpreted = pallas_calls(grad_fn, [state, x])
    assert interpreted.count(True) == 5 and len(interpreted) == 15
