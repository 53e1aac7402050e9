"""The Hopper (Mosaic GPU) forward kernel: poisoned interpreter runs and lowering.

No GPU here, so the kernel runs in jax's Mosaic GPU interpreter (jax >= 0.12:
the newest stack), which fills memory no one wrote with NaN, raises on an
out-of-bounds read and detects data races between the simulated warpgroups
and the TMA engine; on a GPU backend the same tests run the compiled kernel.
Independently, the kernel must lower for CUDA from this machine (every stack),
which runs Mosaic GPU's own layout inference and transfer planning. Neither
proves it right or fast on a real H100 (shared/notes/gpu.md): a device run
does.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from ensembles.experimental.pallas import fused_dense, mosaic_gpu
from tests.reference import dense_reference, make_args
from tests.tolerances import assert_close_to_scale

ON_GPU = jax.default_backend() == "gpu"


def _runnable():
    if ON_GPU:
        if not mosaic_gpu.is_hopper(jax.devices()[0]):
            pytest.skip(f"needs a Hopper GPU, not {jax.devices()[0].device_kind}")
    elif not hasattr(plgpu, "InterpretGPUParams"):
        pytest.skip(
            f"jax {jax.__version__} has no Mosaic GPU interpreter (jax >= 0.12); "
            f"the newest-stack tox env runs these tests"
        )


def hopper(x, kernel, r, s, bias, **kwargs):
    return fused_dense(
        x, kernel, r, s, bias, interpret=not ON_GPU, family="hopper", **kwargs
    )


SHAPES = [
    # (E, B, in, out): aligned; every axis ragged; one member of 5 rows and
    # out > 128 (128-wide warpgroup tiles); one pipeline step padded to two,
    # members walked by one program; several row and column tiles.
    (2, 128, 128, 256),
    (2, 130, 100, 48),
    (1, 5, 96, 200),
    (3, 64, 64, 64),
    (4, 70, 200, 300),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "nobias"])
def test_forward_matches_per_member_loop(shape, use_bias):
    _runnable()
    num_members, batch, fan_in, fan_out = shape
    x, kernel, r, s, bias = make_args(
        0, num_members, batch, (), fan_in, fan_out, jnp.bfloat16, use_bias
    )
    y = hopper(x, kernel, r, s, bias)
    assert y.shape == (num_members * batch, fan_out) and y.dtype == jnp.bfloat16
    expected = dense_reference(x, kernel, r, s, bias, num_members)
    assert_close_to_scale(y, expected, jnp.bfloat16, err_msg=str(shape))


def test_float32_output_and_jit_and_middle_axes():
    """preferred_element_type=float32 keeps the float32 accumulator; jit, HIGHEST."""
    _runnable()
    x, kernel, r, s, bias = make_args(1, 2, 6, (3,), 72, 136, jnp.bfloat16)
    y = jax.jit(
        lambda *a: hopper(
            *a, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST
        )
    )(x, kernel, r, s, bias)
    assert y.dtype == jnp.float32 and y.shape == (12, 3, 136)
    expected = dense_reference(x, kernel, r, s, bias, 2)
    # Products of bfloat16 operands are exact in float32: only the rounding of
    # x * r to bfloat16 (as the jnp formulation does) and the sum order differ.
    np.testing.assert_allclose(
        np.asarray(y),
        np.asarray(
            fused_dense(
                x,
                kernel,
                r,
                s,
                bias,
                preferred_element_type=jnp.float32,
                interpret=True,
            )
        ),
        rtol=1e-5,
        atol=1e-4,
    )
    assert_close_to_scale(y, expected, jnp.bfloat16)


def test_tiles_cover_every_axis():
    for shape in SHAPES:
        _, batch, fan_in, fan_out = shape
        t = mosaic_gpu.hopper_tiles(batch, fan_in, fan_out, jnp.bfloat16)
        assert t.rows % mosaic_gpu.TILE_M == 0 and t.rows >= batch
        assert t.in_features % t.tile_k == 0
        assert t.in_features >= max(fan_in, mosaic_gpu.STAGES * t.tile_k)
        assert t.out_features % (2 * t.tile_n) == 0 and t.out_features >= fan_out


def test_float32_operands_are_refused():
    x, kernel, r, s, bias = make_args(0, 2, 4, (), 8, 8, jnp.float32)
    with pytest.raises(TypeError, match=r"Hopper .*bfloat16.*got float32"):
        fused_dense(x, kernel, r, s, bias, family="hopper", interpret=True)


def test_unknown_family_is_refused():
    x, kernel, r, s, bias = make_args(0, 2, 4, (), 8, 8, jnp.bfloat16)
    with pytest.raises(
        ValueError, match=r"`family` must be None or one of .*, got 'x'"
    ):
        fused_dense(x, kernel, r, s, bias, family="x")


def test_interpreter_needs_jax_0_12():
    if hasattr(plgpu, "InterpretGPUParams"):
        pytest.skip(f"jax {jax.__version__} has the Mosaic GPU interpreter")
    x, kernel, r, s, bias = make_args(0, 2, 4, (), 8, 8, jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"needs jax >= 0.12.*this is jax"):
        fused_dense(x, kernel, r, s, bias, family="hopper", interpret=True)


def _lower_for_h100(fn, args, num_cores):
    device = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=num_cores, platform="cuda"
    )
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(fn).trace(*specs)
        return traced.lower(lowering_platforms=("cuda",)).as_text()


def test_compiled_kernel_needs_the_number_of_sms():
    if not hasattr(jax.sharding, "AbstractDevice"):
        pytest.skip(f"jax {jax.__version__} has no jax.sharding.AbstractDevice")
    args = make_args(0, 2, 64, (), 128, 128, jnp.bfloat16, False)[:4]

    def fn(*a):
        return fused_dense(*a, family="hopper")

    with pytest.raises(ValueError, match=r"one program per streaming.*num_cores"):
        _lower_for_h100(fn, args, num_cores=None)


@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "nobias"])
def test_lowers_for_cuda_from_cpu(use_bias):
    """Compiled (interpret=False) it lowers to one Mosaic GPU custom call."""
    if not hasattr(jax.sharding, "AbstractDevice"):
        pytest.skip(f"jax {jax.__version__} has no jax.sharding.AbstractDevice")
    x, kernel, r, s, bias = make_args(0, 3, 37, (), 200, 130, jnp.bfloat16, use_bias)
    args = [a for a in (x, kernel, r, s, bias) if a is not None]

    def fn(*a):
        return fused_dense(*a, family="hopper")

    text = _lower_for_h100(fn, args, num_cores=132)
    assert text.count("custom_call @mosaic_gpu") == 1
    assert "triton" not in text
