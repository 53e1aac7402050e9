"""The fused Pallas kernel lowers for GPU (Triton) and TPU (Mosaic) from a CPU.

No GPU or TPU is needed: ``jax.jit(...).trace(...).lower(lowering_platforms=
...)`` under an abstract mesh of the target's device kind runs each
platform's Pallas lowering, which must emit that platform's custom call (and
not the other's), for the forward and for the fused backward.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from ensembles.ops import batch_ensemble_dense
from tests.reference import make_args

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
    # A first layer: the forward and dkernel/ds/dr kernels; no dx/dr kernel.
    first = custom_calls(
        lowered_text(jax.grad(loss, argnums=argnums[1:]), args, platform)
    )
    assert first == [wanted] * 2
    assert unwanted not in forward + backward + first
