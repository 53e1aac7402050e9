"""What the kernel families share: the static configuration and the matmul."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax

__all__ = ["NN", "NT", "TN", "KernelConfig", "dot"]

NN = ((1,), (0,))  # a @ b
NT = ((1,), (1,))  # a @ b.T
TN = ((0,), (0,))  # a.T @ b


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Everything static about one kernel launch.

    Attributes:
      precision: matmul precision inside the kernels.
      out_dtype: the forward output's dtype.
      interpret: passed to ``pallas_call``: ``False`` (compiled), ``True``
        (Pallas' generic interpreter) or a ``pltpu.InterpretParams`` (the TPU
        simulator).
    """

    precision: Any
    out_dtype: Any
    interpret: Any


def dot(a, b, contract, precision):
    """``lax.dot_general`` without batch axes, accumulating in float32."""
    return lax.dot_general(
        a,
        b,
        (contract, ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )
