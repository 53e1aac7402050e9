"""The one dtype-tolerance table every numerical test uses."""

import jax.numpy as jnp
import numpy as np

# bfloat16 has an 8-bit mantissa (relative step 2**-8 ~ 0.4%); sums of a few
# dozen products accumulate a few such steps.
TOLERANCES = {
    jnp.dtype(jnp.float32): {"rtol": 1e-5, "atol": 1e-5},
    jnp.dtype(jnp.bfloat16): {"rtol": 3e-2, "atol": 3e-2},
}


def tolerance(dtype) -> dict:
    return TOLERANCES[jnp.dtype(dtype)]


def assert_close(actual, expected, dtype=None, scale=1.0):
    """Compares in float32 with the tolerance of `dtype` (default: actual's)."""
    dtype = jnp.dtype(dtype if dtype is not None else actual.dtype)
    tol = tolerance(dtype)
    np.testing.assert_allclose(
        np.asarray(jnp.asarray(actual, jnp.float32)),
        np.asarray(jnp.asarray(expected, jnp.float32)),
        rtol=tol["rtol"] * scale,
        atol=tol["atol"] * scale,
    )
