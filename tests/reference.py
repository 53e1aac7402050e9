"""Reference implementations the library is tested against.

They are written the slow, obvious way: one member at a time, with the member's
explicit effective weight ``W * outer(r_k, s_k)``.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def effective_kernel(kernel, r, s, k):
    return kernel * jnp.outer(r[k], s[k])


@partial(jax.jit, static_argnums=5)
def dense_reference(inputs, kernel, r, s, bias, num_members):
    """Per-member loop over explicit weights, computed in float32."""
    batch = inputs.shape[0] // num_members
    outputs = []
    for k in range(num_members):
        rows = inputs[k * batch : (k + 1) * batch].astype(jnp.float32)
        weight = effective_kernel(
            kernel.astype(jnp.float32), r.astype(jnp.float32), s.astype(jnp.float32), k
        )
        y = jnp.matmul(rows, weight, precision=lax.Precision.HIGHEST)
        if bias is not None:
            y = y + bias[k].astype(jnp.float32).reshape((1,) * (y.ndim - 1) + (-1,))
        outputs.append(y)
    return jnp.concatenate(outputs)


def make_args(
    seed, num_members, batch, middle, in_features, out_features, dtype, use_bias=True
):
    """Random inputs, kernel, fast weights around 1 and bias, drawn with numpy."""
    rng = np.random.default_rng(seed)

    def draw(shape, mean=0.0, scale=1.0):
        return jnp.asarray(mean + scale * rng.standard_normal(shape), dtype)

    x = draw((num_members * batch, *middle, in_features))
    kernel = draw((in_features, out_features))
    r = draw((num_members, in_features), 1.0, 0.5)
    s = draw((num_members, out_features), 1.0, 0.5)
    bias = draw((num_members, out_features)) if use_bias else None
    return x, kernel, r, s, bias
