"""Every kernel family in Pallas' TPU simulator: TPU semantics, poisoned memory.

Pallas' generic interpreter (``interpret=True``) clamps an out-of-bounds
``pl.ds`` like ``lax.dynamic_slice``, so a read past a block can pass there
unseen. The TPU simulator (``interpret=pltpu.InterpretParams(...)``) runs a
kernel as a TPU core would: it raises on an out-of-bounds read, fills memory
no one wrote (scratch, output blocks, the padding of a partial block) with NaN,
detects races between simulated cores, and runs grid axes marked "parallel"
in a random order. The Triton kernels run in it unchanged, so both families
are checked here, forward and backward, on ragged shapes whose edge blocks are
partial before padding, in float32 and bfloat16, against the float64
per-member loop of ``test_pallas.py``. (The Hopper family runs in jax's
Mosaic GPU interpreter with the same poisoning: ``test_pallas_hopper.py``.)

About 100x slower than the generic interpreter: the quick tier runs one small
case per family, the slow tier the sweep. ``test_pallas_injections.py``
shows that bugs injected into a copy of a kernel fail these checks.
"""

import logging

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from ensembles.experimental.pallas import BlockSizes, fused_dense
from tests.experimental.test_pallas import (
    assert_matches_reference,
    pallas_calls,
    reference64,
)
from tests.reference import make_args
from tests.tolerances import assert_close_to_scale

SMALL_BLOCKS = BlockSizes(block_b=16, block_out=16, block_k=16)


def simulator(seed=0, cores=1):
    """The TPU simulator as strict as it goes: what a user passes to ``interpret``."""
    return pltpu.InterpretParams(
        out_of_bounds_reads="raise",
        uninitialized_memory="nan",
        detect_races=True,
        num_cores_or_threads=cores,
        random_seed=seed,
    )


@pytest.fixture(autouse=True)
def _quiet_callbacks():
    # The simulator reports through io_callback, which logs every traceback
    # it passes on; an expected error would flood the output.
    logger = logging.getLogger("jax._src.callback")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def check_in_simulator(family, case, params=None, gradients=True, first_layer=False):
    """``family``'s output (and five gradients) in the simulator vs the float64 loop.

    ``first_layer``: the inputs carry no derivative (four gradients).
    """
    num_members, batch, middle, fan_in, fan_out, dtype, use_bias, blocks = case
    args = make_args(1, num_members, batch, middle, fan_in, fan_out, dtype, use_bias)
    params = simulator() if params is None else params

    def fn(x, *rest):
        y = fused_dense(
            x.reshape(num_members * batch, *middle, fan_in),
            *rest,
            interpret=params,
            family=family,
            block_sizes=blocks,
        )
        return y.reshape(-1, fan_out)

    flat = (args[0].reshape(-1, fan_in), *args[1:])
    if gradients:
        assert_matches_reference(fn, flat, num_members, dtype, first_layer)
        return
    y = jax.jit(fn)(*flat)
    bias = flat[4] if use_bias else None
    y_ref, _ = reference64(*flat[:4], bias, num_members, jnp.zeros(y.shape))
    assert y.dtype == dtype
    assert_close_to_scale(y, y_ref, dtype, err_msg="outputs")


# (E, B, middle, in, out, dtype, bias, blocks). Every case is ragged on every
# axis (rows of a member, in, out): before padding, each has partial edge
# blocks in both families (TPU feature blocks are at least 128 wide, so its
# cases reach past 128 on both feature axes).
QUICK = {
    "gpu": (2, 20, (), 40, 37, jnp.float32, True, SMALL_BLOCKS),
    "tpu": (2, 20, (), 140, 130, jnp.float32, True, SMALL_BLOCKS),
}
SWEEP = [
    (3, 18, (), 70, 136, jnp.bfloat16, False, BlockSizes(16, 64, 32)),
    (1, 130, (), 100, 48, jnp.float32, True, BlockSizes()),
    (2, 5, (3,), 140, 260, jnp.bfloat16, True, BlockSizes(16, 128, 32)),
]


def case_id(case):
    num_members, batch, middle, fan_in, fan_out, dtype, bias, blocks = case
    return (
        f"E{num_members}-B{batch}{'x' + str(middle) if middle else ''}-"
        f"{fan_in}x{fan_out}-{jnp.dtype(dtype).name}{'-bias' if bias else ''}-"
        f"{blocks.block_b}.{blocks.block_out}.{blocks.block_k}"
    )


@pytest.mark.parametrize("family", ["gpu", "tpu"])
def test_each_family_in_the_simulator(family):
    check_in_simulator(family, QUICK[family])


def test_a_first_layer_in_the_simulator():
    # No input-gradient kernel: dr from the kernel-gradient tiles.
    check_in_simulator("gpu", QUICK["gpu"], first_layer=True)


@pytest.mark.slow
@pytest.mark.parametrize("layer", ["hidden", "first"])
@pytest.mark.parametrize("case", SWEEP, ids=case_id)
@pytest.mark.parametrize("family", ["gpu", "tpu"])
def test_each_family_in_the_simulator_sweep(family, case, layer):
    check_in_simulator(family, case, first_layer=layer == "first")


@pytest.mark.slow
def test_tpu_kernels_on_two_simulated_cores():
    # The "parallel" grid axes split between two cores, a race detector on
    # every buffer and another grid order.
    check_in_simulator("tpu", QUICK["tpu"], simulator(seed=1, cores=2))


def test_the_simulator_reaches_every_pallas_call():
    args = make_args(0, 2, 3, (), 4, 5, jnp.float32)
    params = simulator()

    def loss(*a, family):
        y = fused_dense(*a, interpret=params, family=family)
        return jnp.sum(y**2)

    for family in ("gpu", "tpu", None):  # None: the TPU kernels, as before
        grad = jax.grad(lambda *a, f=family: loss(*a, family=f), argnums=range(5))
        assert pallas_calls(grad, args) == [params] * 3, family
        first = jax.grad(lambda *a, f=family: loss(*a, family=f), argnums=(1, 2, 3))
        assert pallas_calls(first, args) == [params] * 2, family
