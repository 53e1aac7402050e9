"""The one tolerance table every numerical test uses.

Keyed by the dtype compared and by the backend's default float32 matmul
precision: CPUs multiply float32 exactly; NVIDIA GPUs default to TensorFloat-32
(a 10-bit mantissa, unit roundoff 2**-11) and TPUs to one bfloat16 pass (8
bits, 2**-8) unless ``jax_default_matmul_precision`` asks for more. References
computed in float64 or at ``precision="highest"`` then differ from the
library's default-precision matmuls by the error of the latter.
"""

import jax
import jax.numpy as jnp
import numpy as np

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)

TOLERANCES = {
    (F32, "float32"): {"rtol": 1e-5, "atol": 1e-5},
    (F32, "tensorfloat32"): {"rtol": 4e-3, "atol": 4e-3},
    (F32, "bfloat16"): {"rtol": 3e-2, "atol": 3e-2},
    # bfloat16 has an 8-bit mantissa (relative step 2**-8 ~ 0.4%); sums of a
    # few dozen products accumulate a few such steps, whatever the matmul.
    (BF16, "float32"): {"rtol": 3e-2, "atol": 3e-2},
    (BF16, "tensorfloat32"): {"rtol": 3e-2, "atol": 3e-2},
    (BF16, "bfloat16"): {"rtol": 3e-2, "atol": 3e-2},
}

_DEFAULT_PRECISION = {"cpu": "float32", "gpu": "tensorfloat32", "tpu": "bfloat16"}


def matmul_precision() -> str:
    """The effective default float32 matmul precision where the tests run."""
    configured = str(jax.config.jax_default_matmul_precision or "").lower()
    if configured in ("highest", "float32", "precision.highest"):
        return "float32"
    if configured in ("tensorfloat32", "high", "precision.high"):
        return "tensorfloat32"
    return _DEFAULT_PRECISION.get(jax.default_backend(), "bfloat16")


def tolerance(dtype) -> dict:
    return TOLERANCES[(jnp.dtype(dtype), matmul_precision())]


def assert_close(actual, expected, dtype=None, scale=1.0, err_msg=""):
    """Compares in float32 with the tolerance of `dtype` (default: actual's)."""
    dtype = jnp.dtype(dtype if dtype is not None else actual.dtype)
    tol = tolerance(dtype)
    np.testing.assert_allclose(
        np.asarray(jnp.asarray(actual, jnp.float32)),
        np.asarray(jnp.asarray(expected, jnp.float32)),
        rtol=tol["rtol"] * scale,
        atol=tol["atol"] * scale,
        err_msg=err_msg,
    )


def assert_close_to_scale(actual, expected, dtype=None, scale=1.0, err_msg=""):
    """``max|actual - expected| <= rtol * scale * max|expected|`` (norm-wise).

    For results whose entries are sums of many rounded products (matmuls and
    their gradients against a float64 reference): the rounding error of each
    entry is relative to the size of the products summed, not to the entry,
    which may be near zero.
    """
    dtype = jnp.dtype(dtype if dtype is not None else actual.dtype)
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape, err_msg)
    assert np.isfinite(actual).all(), f"non-finite entries {err_msg}"
    error = np.max(np.abs(actual - expected), initial=0.0)
    bound = tolerance(dtype)["rtol"] * scale * max(np.max(np.abs(expected)), 1e-30)
    assert error <= bound, (
        f"{err_msg}: max error {error:.3g} > {bound:.3g} "
        f"({error / max(np.max(np.abs(expected)), 1e-30):.3g} of the largest entry)"
    )
