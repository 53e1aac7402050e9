"""What the ``"xla"`` ops' custom VJPs share: knowing what is differentiated.

A BatchEnsemble op's cheapest backward depends on which of its operands
``(inputs, kernel, r, s)`` are differentiated: a first layer's inputs are not,
and then no input-gradient matmul or convolution is needed. A ``jax.custom_vjp``
defined with ``symbolic_zeros=True`` sees that in its forward rule
(:meth:`Needs.of`); :func:`save` carries it, and the name of the formulation
chosen, to the backward rule in the residuals' tree structure (static), and
:func:`backward` runs the chosen formulation and casts the cotangents to the
primals' dtypes, as plain differentiation does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jax.custom_derivatives import SymbolicZero

__all__ = ["PARAM_GRADIENTS", "Needs", "backward", "save"]

#: The backward formulations: plain differentiation's math (``"activations"``)
#: or the per-member kernel gradients ``M_k`` (``"kernels"``).
PARAM_GRADIENTS: tuple[str, ...] = ("activations", "kernels")

_NEEDS = "needs:"


@dataclasses.dataclass(frozen=True)
class Needs:
    """Which operands are differentiated (carry a tangent).

    >>> Needs(kernel=True, r=True, s=True).params
    True
    """

    inputs: bool = False
    kernel: bool = False
    r: bool = False
    s: bool = False

    @property
    def params(self) -> bool:
        """Whether any of the kernel, r and s is differentiated."""
        return self.kernel or self.r or self.s

    @classmethod
    def of(cls, *primals) -> Needs:
        """From the ``CustomVJPPrimal`` wrappers of a ``symbolic_zeros`` rule."""
        return cls(*(primal.perturbed for primal in primals))

    def key(self) -> str:
        """A residual dict key that carries these flags to the backward rule."""
        flags = (self.inputs, self.kernel, self.r, self.s)
        return _NEEDS + "".join("1" if flag else "0" for flag in flags)

    @classmethod
    def from_residuals(cls, residuals: Mapping[str, Any]) -> Needs:
        """The flags stored by :func:`save` in a residual dict."""
        (key,) = [key for key in residuals if key.startswith(_NEEDS)]
        return cls(*(flag == "1" for flag in key.removeprefix(_NEEDS)))


def save(formulation: str, needs: Needs, operands: tuple) -> dict[str, Any]:
    """Residuals: ``operands`` under the formulation's name, and ``needs``.

    Both names are dict keys, so the backward rule sees them statically.
    ``operands`` starts with the primals ``(inputs, kernel, r, s)``.
    """
    return {formulation: operands, needs.key(): ()}


def backward(
    residuals: Mapping[str, Any],
    g: Any,
    formulations: Mapping[str, Callable[..., tuple]],
    config: Any,
) -> tuple:
    """Runs the formulation :func:`save` named; cotangents in primal dtypes.

    Args:
      residuals: what :func:`save` returned.
      g: the output cotangent (possibly a ``SymbolicZero``).
      formulations: name -> ``fn(*operands, g, config, needs)`` returning
        the cotangents of ``(inputs, kernel, r, s)``, ``None`` for those not
        differentiated.
      config: the op's static options, passed through.

    Returns:
      The four cotangents.
    """
    needs = Needs.from_residuals(residuals)
    (name,) = [key for key in residuals if key in formulations]
    operands = residuals[name]
    if isinstance(g, SymbolicZero):
        return None, None, None, None
    grads = formulations[name](*operands, g, config, needs)
    return tuple(
        None if grad is None else grad.astype(primal.dtype)
        for grad, primal in zip(grads, operands[:4], strict=True)
    )
