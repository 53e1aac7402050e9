"""What the kernel families share: the static configuration and the matmul."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax

__all__ = ["NN", "NT", "TN", "KernelConfig", "Wanted", "dot"]

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
      float32_matmul: cast matmul operands to float32 in the TPU kernels: the
        Mosaic matmul of TPU v2 and v3 takes no bfloat16 operands (products
        of bfloat16 values are exact in float32, so the results agree).
    """

    precision: Any
    out_dtype: Any
    interpret: Any
    float32_matmul: bool = False


@dataclasses.dataclass(frozen=True)
class Wanted:
    """Which gradients one backward pass forms (static: read off the VJP's inputs).

    Attributes:
      inputs: ``dx``: the inputs carry a derivative (a hidden layer). Without
        it (a first layer) no input-gradient matmul runs: ``dr`` is formed from
        the per-member kernel-gradient tiles the kernel-gradient kernel reduces
        on chip anyway, ``dr_k[i] = sum_j W[i, j] s_k[j] M_k[i, j]`` with
        ``M_k = x_k^T g_k``, and no ``dx`` is written.
      params: ``dkernel``, ``dr`` and ``ds`` (the kernel-gradient kernel).
    """

    inputs: bool = True
    params: bool = True


def dot(a, b, contract, precision, float32_operands=False):
    """``lax.dot_general`` without batch axes, accumulating in float32."""
    if float32_operands:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return lax.dot_general(
        a,
        b,
        (contract, ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )
