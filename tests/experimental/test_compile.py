"""The compile tier: every path compiled for the chips it targets, without them.

Deviceless ahead-of-time compiles (``chips.py``) for an H100 and TPUs run the
chips' own compilers on the default path (dense, conv, a model's train step)
and on every kernel family for its chip (Triton and the Hopper kernel for the
H100, Mosaic for TPUs), forward and backward, float32 and bfloat16, at the
tiles the library picks and at the largest it accepts. What only a compiler
knows is checked here: shared memory, VMEM, register and layout limits, ops a
chip lacks (bfloat16 matmuls on TPU v2/v3). Numerics are not: the interpreter
and simulator tests are for that, a device for speed.

Marked ``compile`` (deselected by default): ``tox -e compile-oldest`` and
``tox -e compile-newest`` install the compilers and run it on both jax ends,
one process each (libtpu allows one at a time), as ``.ci/run`` does.
Few compiles, each holding many functions: a compile's fixed cost dominates.
"""

import importlib.metadata
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import ensembles
from ensembles.experimental.pallas import BlockSizes, budget, fused_dense
from ensembles.ops import batch_ensemble_conv, batch_ensemble_dense
from tests.experimental import chips

pytestmark = [
    pytest.mark.compile,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated"),
]

TRITON = "__gpu$xla.gpu.triton"
MOSAIC_TPU = "tpu_custom_call"
MOSAIC_GPU = "mosaic_gpu"
# The default path on the chips the issue names; the kernels on every chip
# the pinned libtpu describes (v2/v3: bfloat16 compiles, its matmul in
# float32), at the largest tiles too on one chip of each budget (v3, v5p and
# 7x share v2's, v5e's and v6e's budgets and compilers' limits): a compile of
# large tiles costs 5-30 s, of the default ones about 1 s.
DEFAULT_PATH_TARGETS = ["h100", "v4", "v5e", "v6e"]
KERNEL_TARGETS = ["h100", "v2", "v3", "v4", "v5e", "v5p", "v6e", "7x"]
LARGEST_TILE_TARGETS = ["h100", "v2", "v4", "v5e", "v6e"]
DTYPES = [jnp.float32, jnp.bfloat16]
E = 2


def test_the_gpu_compiler_is_jax_s_version():
    # The newest-stack env installs the newest of each: a plugin released
    # apart from jax would compile with another XLA.
    chips.mesh("h100")  # skips (fails in the tier) without the plugin
    for name in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jaxlib"):
        assert importlib.metadata.version(name) == jax.__version__, name


def spec(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def dense_specs(dtype, batch, fan_in, fan_out, num_members=E):
    return [
        spec((num_members * batch, fan_in), dtype),
        spec((fan_in, fan_out), dtype),
        spec((num_members, fan_in), dtype),
        spec((num_members, fan_out), dtype),
        spec((num_members, fan_out), dtype),
    ]


def grads(fn, first_layer=False):
    """The gradient of a scalar of ``fn`` w.r.t. every operand (its forward too).

    ``first_layer``: w.r.t. every operand but the inputs (a model's first layer).
    """

    def loss(*args):
        return jnp.sum(fn(*args).astype(jnp.float32) ** 2)

    start = 1 if first_layer else 0
    return lambda *args: jax.grad(loss, argnums=tuple(range(start, len(args))))(*args)


class CNN(nnx.Module):
    def __init__(self, rngs):
        self.conv = ensembles.BatchEnsembleConv(3, 16, (3, 3), num_members=E, rngs=rngs)
        self.dense = ensembles.BatchEnsembleLinear(16, 10, num_members=E, rngs=rngs)

    def __call__(self, x):
        return self.dense(nnx.relu(self.conv(x)).mean(axis=(1, 2)))


def train_step_and_specs():
    """An SGD step of a BatchEnsemble CNN on flat parameters, built abstractly."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CNN(nnx.Rngs(0))))
    leaves, treedef = jax.tree.flatten(state)

    def step(x, labels, *params):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, list(params)))

        def loss(model):
            log_probs = jax.nn.log_softmax(model(x))
            return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], 1))

        grads = jax.tree.leaves(nnx.state(nnx.grad(loss)(model)))
        return [p - 0.1 * g for p, g in zip(params, grads, strict=True)]

    specs = [spec((E * 8, 16, 16, 3)), spec((E * 8,), jnp.int32)]
    return step, specs + [spec(leaf.shape, leaf.dtype) for leaf in leaves]


def custom_calls(text):
    return re.findall(r"custom_call @([^(\s]+)\(", text)


def lower_together(name, parts):
    """One lowering of every ``(fn, specs, ...)`` in ``parts``: one compile."""

    def everything(*args):
        outs, start = [], 0
        for fn, specs, *_ in parts:
            outs.append(fn(*args[start : start + len(specs)]))
            start += len(specs)
        return outs

    return chips.lower(name, everything, [s for _, specs, *_ in parts for s in specs])


@pytest.mark.parametrize("name", DEFAULT_PATH_TARGETS)
def test_default_path_compiles(name):
    """A float32 train step (dense and conv, forward and backward), bfloat16
    dense and conv gradients: one compile."""
    dtype = jnp.bfloat16
    conv_specs = [
        spec((E * 3, 15, 15, 8), dtype),
        spec((3, 3, 8, 24), dtype),
        spec((E, 8), dtype),
        spec((E, 24), dtype),
        spec((E, 24), dtype),
    ]
    parts = [
        train_step_and_specs(),
        (
            grads(lambda *a: batch_ensemble_dense(*a, num_members=E)),
            dense_specs(dtype, 37, 200, 136),
        ),
        (
            grads(lambda *a: batch_ensemble_conv(*a, num_members=E, strides=2)),
            conv_specs,
        ),
    ]
    lowered = lower_together(name, parts)
    assert custom_calls(lowered.as_text()) == []  # no kernel on the default path
    lowered.compile()


def kernel_parts(name):
    """(function, specs, custom calls it must lower to) for chip ``name``."""
    family = chips.family_of(name)
    where = chips.target(name)
    call = TRITON if family == "gpu" else MOSAIC_TPU
    parts = []
    for dtype in DTYPES:
        tiles = [BlockSizes()]
        if name in LARGEST_TILE_TARGETS and (name != "v2" or dtype == jnp.bfloat16):
            # v2 for its float32 matmul path only (its f32 kernels are v4's).
            tiles.append(chips.largest_block_sizes(family, dtype, where))
        for blocks in tiles:
            # Every axis ragged (padded), no block shrunk to the problem; the
            # kernels' code does not depend on how many blocks there are.
            size = max(blocks.block_b, blocks.block_out, blocks.block_k)
            fn = grads(
                lambda *a, blocks=blocks: batch_ensemble_dense(
                    *a, num_members=E, impl="pallas", block_sizes=blocks
                )
            )
            parts.append((fn, dense_specs(dtype, size - 3, size - 5, size - 7), 3))
            # A first layer: the kernel gradient forms dr; no input gradient.
            first = grads(
                lambda *a, blocks=blocks: batch_ensemble_dense(
                    *a, num_members=E, impl="pallas", block_sizes=blocks
                ),
                first_layer=True,
            )
            parts.append((first, dense_specs(dtype, size - 3, size - 5, size - 7), 2))
    return parts, call


def hopper_parts():
    """The Hopper kernels (bfloat16 only), hidden and first layer, for the H100.

    Rows ragged; 128-wide warpgroup tiles on both feature axes, and 64-wide
    ones; 16 members of 64 rows (the kernel-gradient pipeline crosses a
    member every step). Mosaic GPU checks its shared-memory budget, layouts
    and ``wgmma`` shapes while it compiles.
    """

    def hopper(*a):
        return fused_dense(*a, family="hopper")

    parts = []
    shapes = [(E, 130, 200, 300), (E, 37, 100, 48), (16, 64, 512, 512)]
    for num_members, batch, fan_in, fan_out in shapes:
        specs = dense_specs(jnp.bfloat16, batch, fan_in, fan_out, num_members)
        # Forward, input gradient, kernel gradient; a first layer two.
        parts.append((grads(hopper), specs, 3))
        parts.append((grads(hopper, first_layer=True), specs, 2))
    return parts


@pytest.mark.parametrize("name", KERNEL_TARGETS)
def test_kernels_compile(name):
    """Every family for its chip, f32/bf16, forward and backward: one compile."""
    parts, call = kernel_parts(name)
    hopper = hopper_parts() if name == "h100" else []
    lowered = lower_together(name, parts + hopper)
    calls = custom_calls(lowered.as_text())
    # Forward, input gradient, kernel gradient per fused call (a first
    # layer: forward and kernel gradient):
    assert calls.count(call) == sum(n for *_, n in parts), calls
    mosaic_gpu = [c for c in calls if c.startswith(MOSAIC_GPU)]
    assert len(mosaic_gpu) == sum(n for *_, n in hopper), calls
    lowered.compile()


# --------------------------------------------------------------------------- #
# What the budget refuses, the compiler refuses too
# --------------------------------------------------------------------------- #

# (chip, dtype, tiles the library refuses, what the compiler says without it)
OVERSIZED = [
    ("h100", jnp.float32, BlockSizes(256, 256, 256), "Shared memory size limit"),
    ("h100", jnp.float32, BlockSizes(128, 128, 128), "Shared memory size limit"),
    ("v5e", jnp.float32, BlockSizes(1024, 1024, 1024), "vmem"),
]


def fused_fn(blocks):
    return lambda *a: batch_ensemble_dense(
        *a, num_members=E, impl="pallas", block_sizes=blocks
    )


@pytest.mark.parametrize(
    "name, dtype, blocks, _", OVERSIZED, ids=[f"{o[0]}-{o[2]}" for o in OVERSIZED]
)
def test_oversized_tiles_are_refused_when_chosen(name, dtype, blocks, _):
    size = 2 * blocks.block_b
    with pytest.raises(ValueError, match=r"`block_sizes` BlockSizes\(.*more than"):
        chips.lower(name, fused_fn(blocks), dense_specs(dtype, size, size, size))


@pytest.mark.parametrize(
    "name, dtype, blocks, message",
    OVERSIZED,
    ids=[f"{o[0]}-{o[2]}" for o in OVERSIZED],
)
def test_the_compiler_refuses_them_too(monkeypatch, name, dtype, blocks, message):
    # The injected bug: the check gone, the tiles reach the compiler, which
    # must fail on them (so the budget refuses nothing that would compile).
    monkeypatch.setattr(budget, "check_tiles", lambda *a, **k: None)
    size = 2 * blocks.block_b
    lowered = chips.lower(name, fused_fn(blocks), dense_specs(dtype, size, size, size))
    with pytest.raises(Exception, match=message) as raised:
        lowered.compile()
    assert "RESOURCE_EXHAUSTED" in str(raised.value)
