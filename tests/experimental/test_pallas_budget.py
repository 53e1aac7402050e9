"""Tiles too large for the target chip are refused when chosen; v2/v3 matmuls.

No compiler needed: the library reads the target from the mesh set while
tracing (here an abstract one naming the chip), as a deviceless compile or a
run on the chip does, and checks the tiles it fitted to the problem against
the chip's budget (``ensembles.experimental.pallas.budget``). That the
budgets refuse what the chips' compilers refuse, and accept the largest tiles
they compile, the compile tier shows (``test_compile.py``).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from ensembles.experimental.pallas import BlockSizes, budget, fused_dense
from ensembles.experimental.pallas.blocks import tiling
from tests.experimental import chips
from tests.reference import make_args

H100 = ("NVIDIA H100 80GB HBM3", "cuda", 132)


def tpu(kind):
    return (kind, "tpu", 1)


def abstract_mesh(device):
    kind, platform, cores = device
    abstract = jax.sharding.AbstractDevice(
        device_kind=kind, num_cores=cores, platform=platform
    )
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=abstract)


def trace(device, blocks, dtype=jnp.float32, size=512, **kwargs):
    """Traces the fused op (forward) for ``device``; returns its jaxpr."""
    args = make_args(0, 2, size, (), size, size, dtype)
    with jax.sharding.use_abstract_mesh(abstract_mesh(device)):
        return jax.make_jaxpr(lambda *a: fused_dense(*a, block_sizes=blocks, **kwargs))(
            *args
        )


def test_the_target_is_the_mesh_device_else_the_default_device():
    assert budget.target() == budget.Target("cpu", jax.devices()[0].device_kind)
    with jax.sharding.use_abstract_mesh(abstract_mesh(H100)):
        assert budget.target() == budget.Target("cuda", H100[0])
    with jax.sharding.use_abstract_mesh(abstract_mesh(tpu("TPU v5 lite"))):
        assert budget.target() == budget.Target("tpu", "TPU v5 lite", "v5e")


@pytest.mark.parametrize(
    "blocks, dtype, match",
    [
        # 3 pipeline stages of 128 x 128 f32 tiles: 328704 bytes.
        (
            BlockSizes(128, 128, 128),
            jnp.float32,
            r"needs 328704 bytes of shared memory in the Triton forward kernel "
            r"\(float32 tiles 128 x 128, steps of 128, 3 pipeline stages\), more "
            r"than the 232448 bytes a kernel may use on an H100",
        ),
        # The 256^3 float32 tile: its accumulator alone spills.
        (
            BlockSizes(256, 256, 256),
            jnp.float32,
            r"a 256 x 256 float32 accumulator \(65536 values\), more than the "
            r"16384 \(128 x 128\)",
        ),
        (
            BlockSizes(128, 128, 256),
            jnp.bfloat16,
            r"needs 329728 bytes of shared memory .*\(bfloat16 tiles",
        ),
    ],
)
def test_triton_tiles_beyond_an_h100_are_refused(blocks, dtype, match):
    with pytest.raises(ValueError, match=match):
        trace(H100, blocks, dtype)


@pytest.mark.parametrize(
    "kind, chip, limit",
    [("TPU v5 lite", "v5e", "16.00"), ("TPU v6 lite", "v6e", "32.00")],
)
def test_mosaic_tiles_beyond_a_tpu_are_refused(kind, chip, limit):
    with pytest.raises(
        ValueError,
        match=rf"needs 28.44 MiB of VMEM for the blocks and scratch of the Mosaic "
        rf"forward kernel .* more than half the {limit} MiB a kernel may use on a "
        rf"TPU {chip}",
    ):
        trace(tpu(kind), BlockSizes(1024, 1024, 1024), size=1024)


def test_the_largest_accepted_tiles_are_accepted_and_the_next_refused():
    # What the compile tier compiles: doubling any field of it is refused.
    for device, family in [(H100, "gpu"), (tpu("TPU v5 lite"), "tpu")]:
        with jax.sharding.use_abstract_mesh(abstract_mesh(device)):
            where = budget.target()
        for dtype in (jnp.float32, jnp.bfloat16):
            largest = chips.largest_block_sizes(family, dtype, where)
            assert largest.block_b * largest.block_out >= 128 * 128
            trace(device, largest, dtype, size=4096 // 4)
            for field in ("block_b", "block_out", "block_k"):
                bigger = BlockSizes(
                    **{**vars(largest), field: 2 * getattr(largest, field)}
                )
                t = tiling(
                    family,
                    rows=4096,
                    in_features=4096,
                    out_features=4096,
                    blocks=bigger,
                )
                with pytest.raises(ValueError, match="more than"):
                    budget.check_tiles(family, t, bigger, dtype, dtype, where)


def test_tiles_shrink_to_the_problem_before_they_are_checked():
    # 4096-wide blocks on a 64-wide problem are 64-wide tiles: they fit.
    trace(H100, BlockSizes(4096, 4096, 4096), size=64)


@pytest.mark.parametrize(
    "kwargs",
    [{"interpret": True}, {"family": "gpu"}, {"interpret": pltpu.InterpretParams()}],
)
def test_interpreted_kernels_have_no_budget(kwargs):
    # The interpreters have no on-chip memory; on CPU nothing compiles either.
    trace(H100, BlockSizes(512, 512, 512), **kwargs)
    jax.make_jaxpr(
        lambda *a: fused_dense(*a, block_sizes=BlockSizes(4096, 4096, 4096))
    )(*make_args(0, 2, 512, (), 512, 512, jnp.float32))


def test_an_unknown_tpu_is_not_checked():
    trace(tpu("TPU v99"), BlockSizes(1024, 1024, 1024), size=1024)


def mosaic_matmul_dtypes(jaxpr):
    """The operand dtypes of every matmul inside the Mosaic TPU kernels."""
    found = set()

    def walk(jaxpr, in_mosaic):
        for eqn in jaxpr.eqns:
            inner = in_mosaic
            if eqn.primitive.name == "pallas_call":
                inner = isinstance(eqn.params["compiler_params"], pltpu.CompilerParams)
            if inner and eqn.primitive.name == "dot_general":
                found.add(tuple(v.aval.dtype.name for v in eqn.invars))
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else [param]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr, inner)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub, inner)

    walk(jaxpr.jaxpr, False)
    return found


@pytest.mark.parametrize(
    "kind, operands",
    [
        ("TPU v2", "float32"),
        ("TPU v3", "float32"),
        ("TPU v4", "bfloat16"),
        ("TPU v5 lite", "bfloat16"),
    ],
)
def test_bfloat16_tpu_matmuls_run_in_float32_on_v2_and_v3(kind, operands):
    # libtpu's Mosaic on v2/v3 refuses a bfloat16 matmul (E2001); products of
    # bfloat16 values are exact in float32, so the kernels cast there.
    args = make_args(0, 2, 8, (), 128, 128, jnp.bfloat16)

    def loss(*a):
        return jnp.sum(fused_dense(*a).astype(jnp.float32) ** 2)

    with jax.sharding.use_abstract_mesh(abstract_mesh(tpu(kind))):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=range(5)))(*args)
    assert mosaic_matmul_dtypes(jaxpr) == {(operands, operands)}
