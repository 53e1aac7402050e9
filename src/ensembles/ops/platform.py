"""Which formulation a program gets: the platform it is lowered for decides, here.

Some ops hold two formulations of the same math, because XLA's compilers
want different programs (``docs/cost.md``):

* ``cpu``: measured on XLA's CPU backend, which fuses no elementwise work
  into a matmul or convolution: per-row vectors, and per-member backward
  passes where they were measured to pay.
* ``accelerator``: read from the chips' own compiled programs (an H100's,
  TPUs'), whose compilers fuse the fast-weight scalings into the matmul when
  the members are a batch dimension of it: no per-member loop, no extra
  matmul, nothing materialised per member that a plain layer does not
  materialise.

:func:`by_platform` chooses when the program is lowered, through
``jax.lax.platform_dependent``: a program compiled ahead of time for an H100
or a TPU from a machine whose default backend is the CPU, or exported for
them, gets the accelerator's formulation. Both branches are plain ``jnp``,
so one export may hold several platforms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax import lax

__all__ = ["FORMULATIONS", "by_platform"]

#: The formulations an op may hold, by the platforms that get them.
FORMULATIONS: tuple[str, ...] = ("cpu", "accelerator")


def by_platform(
    *operands: Any,
    cpu: Callable[..., Any],
    accelerator: Callable[..., Any],
) -> Any:
    """``cpu(*operands)`` in a program lowered for the CPU, else ``accelerator``'s.

    >>> import jax, jax.numpy as jnp
    >>> jax.jit(lambda x: by_platform(x, cpu=jnp.sin, accelerator=jnp.cos))(0.0)
    Array(0., dtype=float32, weak_type=True)

    Args:
      *operands: the arrays both formulations take (a pytree each).
      cpu: the CPU's formulation.
      accelerator: every other platform's (GPUs, TPUs).

    Returns:
      What the chosen formulation returns (both must return the same
      shapes and dtypes).
    """
    return lax.platform_dependent(*operands, cpu=cpu, default=accelerator)
