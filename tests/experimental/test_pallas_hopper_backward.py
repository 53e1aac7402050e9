"""The Hopper family's backward: interpreted against the float64 loop, lowered.

Off a GPU the kernels run in jax's Mosaic GPU interpreter (jax >= 0.12), poisoned
as in ``test_pallas_hopper.py``, forward and every gradient against the float64
per-member loop of ``test_pallas.py``: a hidden layer (dx, dkernel, dr, ds,
dbias) and a first layer (the inputs carry no derivative: no input-gradient
kernel, ``dr`` from the kernel-gradient kernel), ragged on every axis.

Each interpreted run is a subprocess under a timeout, with eight host devices.
The interpreter runs each warpgroup's callbacks on XLA's CPU thread pool; on
this 2-core machine a barrier wait of one warpgroup has been seen to starve
the warpgroup that would arrive on it, and the run hangs (the forward kernel
with one more unused shared-memory buffer hung every time; with eight host
devices it ran). A hang then fails a test instead of stopping the suite.
On a GPU backend the same checks run the compiled kernels in-process.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from ensembles.experimental.pallas import (
    fused_dense,
    mosaic_gpu,
    mosaic_gpu_kernel_grad,
)
from tests.experimental.test_pallas import assert_matches_reference
from tests.experimental.test_pallas_hopper import ON_GPU, _lower_for_h100, _runnable
from tests.reference import make_args

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 600

SCRIPT = """
import json, sys
import jax
jax.config.update("jax_numpy_rank_promotion", "raise")
from tests.experimental.test_pallas_hopper_backward import check
for case in json.loads(sys.argv[1]):
    check(*case)
    print("passed", json.dumps(case), flush=True)
"""


def check(num_members, batch, middle, fan_in, fan_out, use_bias, first_layer):
    """The Hopper kernels' forward and gradients against the float64 loop."""
    dtype = jnp.bfloat16
    middle = tuple(middle)
    args = make_args(5, num_members, batch, middle, fan_in, fan_out, dtype, use_bias)

    def fn(x, *rest):
        y = fused_dense(
            x.reshape(num_members * batch, *middle, fan_in),
            *rest,
            family="hopper",
            interpret=not ON_GPU,
        )
        return y.reshape(-1, fan_out)

    flat = (args[0].reshape(-1, fan_in), *args[1:])
    assert_matches_reference(fn, flat, num_members, dtype, first_layer)


def run(cases):
    """``check`` of every case: in-process on a GPU, else interpreted apart."""
    _runnable()
    if ON_GPU:
        for case in cases:
            check(*case)
        return
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    try:
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, json.dumps(cases)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as expired:
        done = (expired.stdout or b"").decode().count("passed")
        pytest.fail(
            f"the Mosaic GPU interpreter did not finish in {TIMEOUT_S} s "
            f"({done} of {len(cases)} cases passed)"
        )
    errors = re.findall(r"^\w*Error: .*$", proc.stderr, re.M)
    assert proc.returncode == 0, "\n".join(errors[-3:]) or proc.stderr[-3000:]
    assert proc.stdout.count("passed") == len(cases), proc.stdout


def case_id(case):
    num_members, batch, middle, fan_in, fan_out, use_bias, first_layer = case
    return (
        f"{'first' if first_layer else 'hidden'}-E{num_members}-B{batch}"
        f"{'x' + str(tuple(middle)) if middle else ''}-{fan_in}x{fan_out}"
        f"{'-bias' if use_bias else ''}"
    )


# (E, B, middle, in, out, bias, first layer).
QUICK = [
    # 128-wide warpgroup tiles, in and out ragged; 64-row members (the
    # kernel-gradient pipeline crosses members every step).
    (2, 64, [], 200, 300, True, True),
    # 64-wide tiles, every axis ragged.
    (3, 37, [], 100, 48, False, False),
]
SWEEP = [
    (2, 128, [], 128, 256, True, False),  # aligned
    (2, 130, [], 100, 48, True, True),
    (1, 5, [], 96, 200, False, True),  # one member of 5 rows: padded to 2 steps
    (1, 5, [], 96, 200, True, False),
    (3, 64, [], 64, 64, False, False),
    (4, 70, [], 200, 300, True, True),
    (4, 70, [], 200, 300, False, False),
    (2, 6, [3], 72, 136, True, True),  # middle axes
    (16, 64, [], 256, 256, True, True),  # many members
    (16, 64, [], 256, 256, False, False),
]


def test_backward_matches_per_member_loop():
    run(QUICK)


@pytest.mark.slow
def test_backward_matches_per_member_loop_sweep():
    run(SWEEP)


# --------------------------------------------------------------------------- #
# Lowered for an H100 from this machine (every stack with an AbstractDevice)
# --------------------------------------------------------------------------- #


def _lowerable():
    if not hasattr(jax.sharding, "AbstractDevice"):
        pytest.skip(f"jax {jax.__version__} has no jax.sharding.AbstractDevice")


def _gradient(first_layer):
    def loss(*a):
        return jnp.sum(fused_dense(*a, family="hopper").astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(1, 2, 3, 4) if first_layer else (0, 1, 2, 3, 4))


@pytest.mark.parametrize("first_layer", [False, True], ids=["hidden", "first"])
def test_a_first_layer_runs_no_input_gradient_kernel(first_layer):
    """Forward, input gradient and kernel gradient; a first layer has two."""
    _lowerable()
    args = make_args(0, 3, 37, (), 200, 130, jnp.bfloat16, True)
    text = _lower_for_h100(_gradient(first_layer), args, num_cores=132)
    calls = re.findall(r"custom_call @([^(\s]+)\(", text)
    assert calls == ["mosaic_gpu_v2"] * (2 if first_layer else 3), calls


def test_too_many_members_are_refused():
    # Every member's r and s windows of a tile sit in shared memory.
    _lowerable()
    args = make_args(0, 64, 8, (), 64, 512, jnp.bfloat16, True)
    with pytest.raises(ValueError, match=r"num_members=64 .* 232448"):
        _lower_for_h100(_gradient(True), args, num_cores=132)


def test_shared_memory_estimate_admits_the_compiled_tiles():
    # 48 members at 512 x 512 compiled for an H100 (233,552 bytes at 64).
    t = mosaic_gpu.backward_tiles(48, 64, 512, 512, jnp.bfloat16)
    estimate = mosaic_gpu_kernel_grad.kernel_grad_shared_memory_bytes
    assert estimate(48, t, jnp.bfloat16) <= mosaic_gpu_kernel_grad.SHARED_MEMORY_BYTES
