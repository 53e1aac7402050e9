"""What the fused op checks before it traces anything: dtypes, the interpreter.

:func:`~ensembles.experimental.pallas.fused_dense` validates its options here,
once, where they enter; the tiles' fit to the chip is :mod:`.budget`'s.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["SUPPORTED_DTYPES", "check_dtypes", "check_interpret"]

#: The dtypes the fused kernel computes in (inputs and parameters alike).
SUPPORTED_DTYPES: tuple[jnp.dtype, ...] = (
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.bfloat16),
)


def check_dtypes(inputs, kernel, r, s, bias=None, preferred_element_type=None):
    """Checks that the fused kernel supports the dtypes of its operands.

    Args:
      inputs: the activations.
      kernel: the shared kernel.
      r: the input fast weights.
      s: the output fast weights.
      bias: the per-member bias, or ``None``.
      preferred_element_type: the requested output dtype, or ``None``.

    Returns:
      The common dtype of the operands.

    Raises:
      TypeError: if the operands do not share one dtype, if that dtype is not in
        :data:`SUPPORTED_DTYPES`, or if ``preferred_element_type`` is neither
        ``None``, float32 nor the operands' dtype.

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((2, 3), jnp.bfloat16)
    >>> check_dtypes(x, x, x, x)
    dtype(bfloat16)
    """
    named = {"inputs": inputs, "kernel": kernel, "r": r, "s": s}
    if bias is not None:
        named["bias"] = bias
    dtypes = {name: jnp.dtype(array.dtype) for name, array in named.items()}
    dtype = dtypes["inputs"]
    if len(set(dtypes.values())) > 1:
        shown = ", ".join(f"{name}={d.name}" for name, d in dtypes.items())
        raise TypeError(
            f'impl="pallas" needs inputs, kernel, r, s and bias of one dtype, got '
            f"{shown}. Cast them to one dtype first (the layers do this through "
            f"`promote_dtype`)."
        )
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f'impl="pallas" supports dtypes '
            f"{[d.name for d in SUPPORTED_DTYPES]}, got {dtype.name}. Cast to "
            f'one of them or use impl="xla".'
        )
    if preferred_element_type is not None:
        preferred = jnp.dtype(preferred_element_type)
        if preferred not in (jnp.dtype(jnp.float32), dtype):
            raise TypeError(
                f'impl="pallas" supports `preferred_element_type` None, float32 or '
                f"the operands' dtype ({dtype.name}), got {preferred.name}."
            )
    return dtype


def check_interpret(interpret, family):
    """A TypeError unless ``interpret`` is one the kernel ``family`` runs in."""
    if isinstance(interpret, bool):
        return
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas import tpu as pltpu

    gpu_params = getattr(plgpu, "InterpretGPUParams", None)
    if isinstance(interpret, pltpu.InterpretParams) and family != "hopper":
        return
    if gpu_params is not None and isinstance(interpret, gpu_params):
        if family == "hopper":
            return
        raise TypeError(
            f"`interpret` {interpret!r} configures jax's Mosaic GPU interpreter, "
            f'which runs family="hopper" only; family={family!r} runs in the TPU '
            f"simulator: pass a `jax.experimental.pallas.tpu.InterpretParams`."
        )
    if family == "hopper":
        raise TypeError(
            f'family="hopper" runs in jax\'s Mosaic GPU interpreter: `interpret` '
            f"must be a bool or a `jax.experimental.pallas.mosaic_gpu."
            f"InterpretGPUParams` (jax >= 0.12), got {interpret!r} of type "
            f"{type(interpret).__name__}."
        )
    raise TypeError(
        f"`interpret` must be a bool or a "
        f"`jax.experimental.pallas.tpu.InterpretParams`, got {interpret!r} "
        f"of type {type(interpret).__name__}."
    )
