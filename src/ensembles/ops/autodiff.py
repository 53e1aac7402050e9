"""How the ``"xla"`` ops are differentiated: a primitive and its linear tangent.

A BatchEnsemble op's cheapest backward depends on which of its operands
``(inputs, kernel, r, s)`` are differentiated: a first layer's inputs are not,
and then no input-gradient matmul or convolution is needed. Each such op is a
pair of JAX primitives built by :func:`define`:

* the op itself, ``y = op(x, kernel, r, s)``, whose forward-mode rule (JVP)
  sees which operands carry a tangent (:class:`Needs`), lets the op plan its
  formulation for exactly that case, computes ``y`` (and the unscaled product
  ``z`` where the plan keeps it) and emits
* the tangent, ``dy = tangent(x, kernel, r, s, z; dx, dkernel, dr, ds)``, a
  primitive linear in the tangents it is given. Evaluated, it is forward-mode
  differentiation (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``); transposed,
  which is how JAX runs reverse mode (``jax.grad``, ``jax.vjp``), it runs the
  op's measured backward for the planned case.

So reverse mode does exactly the work the planned backward does (what a
``jax.custom_vjp`` with symbolic zeros did before), and every transformation
JAX composes from JVP, transposition and batching works: ``jax.jacfwd``,
``jax.hessian``, ``jax.linear_transpose`` (the op is linear in each operand),
``jax.vmap`` (by running the op's ``jnp`` formulation under ``vmap``).
Cotangents and tangents take their primals' dtypes, as JAX's own rules do.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = [
    "BACKWARDS",
    "FORWARDS",
    "IMPLEMENTATIONS",
    "Formulation",
    "Needs",
    "Rules",
    "accumulation_dtype",
    "define",
    "static_precision",
]

#: How the dense and convolution ops compute their output: ``"scale"`` the
#: activations around one shared matmul (convolution), or ``"fold"`` each
#: member's ``W * (r_k (x) s_k)`` into a kernel of its own.
FORWARDS: tuple[str, ...] = ("scale", "fold")

#: How they form the gradients of ``W``, ``r`` and ``s``: through the
#: ``"scaled_activations"`` (plain differentiation's math: ``dW`` from ``x * r``
#: and ``g * s``, ``dr`` from the input gradient), or from the
#: ``"member_kernels"``, each member's own kernel gradient ``M_k = x_k^T g_k``,
#: reduced to ``dW``, ``dr`` and ``ds`` (no input-gradient matmul for a layer
#: whose inputs need none).
BACKWARDS: tuple[str, ...] = ("scaled_activations", "member_kernels")


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

    def flags(self) -> tuple[bool, bool, bool, bool]:
        """``(inputs, kernel, r, s)``."""
        return (self.inputs, self.kernel, self.r, self.s)


@dataclasses.dataclass(frozen=True)
class Formulation:
    """How a dense or convolution op computes its output and its gradients.

    Each op picks one per call from its own measured rule
    (:func:`ensembles.ops.dense.choose_dense`,
    :func:`ensembles.ops.conv.choose_conv`); ``formulation=`` on
    :func:`~ensembles.ops.batch_ensemble_dense` and
    :func:`~ensembles.ops.batch_ensemble_conv` forces one (tests, benchmarks).

    >>> Formulation("fold", "member_kernels").forward
    'fold'

    Attributes:
      forward: one of :data:`FORWARDS`.
      backward: one of :data:`BACKWARDS` (irrelevant when no parameter is
        differentiated).
    """

    forward: str = "scale"
    backward: str = "scaled_activations"

    def __post_init__(self):
        if self.forward not in FORWARDS:
            raise ValueError(
                f"`forward` must be one of {FORWARDS}, got {self.forward!r}."
            )
        if self.backward not in BACKWARDS:
            raise ValueError(
                f"`backward` must be one of {BACKWARDS}, got {self.backward!r}."
            )

    def runnable(self, needs: Needs, *operands: jax.Array) -> Formulation:
        """This formulation as it can run: ``"scale"`` where ``"fold"`` cannot.

        ``"fold"`` cannot run on operands of mixed dtypes, nor with a
        ``"scaled_activations"`` backward that differentiates ``s`` (its
        ``ds`` reads the ``"scale"`` forward's unscaled product).

        >>> import jax.numpy as jnp
        >>> Formulation("fold").runnable(Needs(s=True), jnp.ones(2))
        Formulation(forward='scale', backward='scaled_activations')

        Args:
          needs: which operands are differentiated.
          *operands: the op's arrays (inputs, kernel, r, s).

        Returns:
          The formulation that runs.
        """
        mixed = len({jnp.dtype(a.dtype) for a in operands}) > 1
        blocked = self.backward == "scaled_activations" and needs.s
        if self.forward == "fold" and (mixed or blocked):
            return Formulation("scale", self.backward)
        return self


def accumulation_dtype(*operands, preferred_element_type=None) -> jnp.dtype:
    """The dtype a reduction over ``operands`` accumulates in.

    At least float32, float64 where an operand is float64, and
    ``preferred_element_type`` where that is wider.

    >>> import jax.numpy as jnp
    >>> accumulation_dtype(jnp.ones(2, jnp.bfloat16))
    dtype('float32')
    """
    dtype = jnp.promote_types(jnp.result_type(*operands), jnp.float32)
    if preferred_element_type is not None:
        dtype = jnp.promote_types(dtype, preferred_element_type)
    return dtype


def static_precision(precision: Any) -> Any:
    """``precision`` in a hashable form (a primitive's parameters must hash).

    >>> from jax import lax
    >>> pair = [lax.Precision.HIGHEST, lax.Precision.DEFAULT]
    >>> static_precision(pair) == tuple(pair)
    True
    """
    return tuple(precision) if isinstance(precision, list) else precision


@dataclasses.dataclass(frozen=True)
class Rules:
    """The math of one op, as functions of arrays (what :func:`define` needs).

    Attributes:
      name: the primitive's name (in jaxprs).
      plan: ``(x, kernel, r, s, config, needs) -> plan``: how the op computes
        its output and gradients for the differentiated ``needs`` (hashable;
        reads shapes and dtypes only).
      keeps_product: ``(plan, needs) -> bool``: whether the forward's unscaled
        product ``z`` is kept for the backward (a residual of reverse mode).
      forward: ``(x, kernel, r, s, config, plan) -> (y, z)``.
      tangent: ``(x, kernel, r, s, z, tangents, config) -> dy``, linear in
        ``tangents`` (four entries, ``None`` where an operand has none);
        ``z`` may be ``None`` (then it is recomputed where needed).
      backward: ``(x, kernel, r, s, z, g, config, plan, needs) -> cotangents``
        of ``(x, kernel, r, s)``, ``None`` for those not in ``needs``.
    """

    name: str
    plan: Callable[..., Hashable]
    keeps_product: Callable[[Any, Needs], bool]
    forward: Callable[..., tuple[jax.Array, jax.Array | None]]
    tangent: Callable[..., jax.Array]
    backward: Callable[..., tuple]


def _aval(shape_dtype) -> jax.core.ShapedArray:
    return jax.core.ShapedArray(
        shape_dtype.shape, shape_dtype.dtype, weak_type=shape_dtype.weak_type
    )


def _abstract(fn):
    """An abstract-evaluation rule from a function of arrays."""

    def rule(*avals, **params):
        structs = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals
        ]
        return _aval(jax.eval_shape(functools.partial(fn, **params), *structs))

    return rule


def _vmapped(fn):
    """A batching rule: ``fn`` (a function of arrays) under ``jax.vmap``."""

    def rule(args, dims, **params):
        return jax.vmap(functools.partial(fn, **params), in_axes=dims)(*args), 0

    return rule


#: Every primitive :func:`define` made, with the function of arrays it runs
#: (what its lowering inlines; tests read through it).
IMPLEMENTATIONS: dict[Primitive, Callable[..., jax.Array]] = {}


def _register(primitive: Primitive, fn: Callable) -> None:
    IMPLEMENTATIONS[primitive] = fn
    primitive.def_impl(fn)
    primitive.def_abstract_eval(_abstract(fn))
    mlir.register_lowering(primitive, mlir.lower_fun(fn, multiple_results=False))
    batching.primitive_batchers[primitive] = _vmapped(fn)


def define(rules: Rules) -> Callable[..., jax.Array]:
    """The op of ``rules`` as a function ``(x, kernel, r, s, config) -> y``.

    ``config`` holds the op's static options (hashable).
    """
    op = Primitive(rules.name)
    tangent = Primitive(rules.name + "_tangent")

    def evaluate(x, kernel, r, s, *, config):
        plan = rules.plan(x, kernel, r, s, config, Needs())
        return rules.forward(x, kernel, r, s, config, plan)[0]

    def evaluate_tangent(*args, config, plan, needs, keeps_product):
        x, kernel, r, s, z, tangents = _split(args, needs, keeps_product)
        return rules.tangent(x, kernel, r, s, z, tangents, config)

    def jvp(primals, tangents, *, config):
        x, kernel, r, s = primals
        needs = Needs(*(type(t) is not ad.Zero for t in tangents))
        plan = rules.plan(x, kernel, r, s, config, needs)
        y, z = rules.forward(x, kernel, r, s, config, plan)
        keeps_product = rules.keeps_product(plan, needs) and z is not None
        dy = tangent.bind(
            *primals,
            *([z] if keeps_product else []),
            *(t for t in tangents if type(t) is not ad.Zero),
            config=config,
            plan=plan,
            needs=needs,
            keeps_product=keeps_product,
        )
        return y, dy

    def transpose(g, *args, config, plan, needs, keeps_product):
        x, kernel, r, s, z, tangents = _split(args, needs, keeps_product)
        if any(ad.is_undefined_primal(a) for a in (x, kernel, r, s, z)):
            raise NotImplementedError(
                f"{rules.name}: the tangent is linear in its tangents only."
            )
        wanted = Needs(
            *(
                flag and ad.is_undefined_primal(t)
                for flag, t in zip(needs.flags(), tangents, strict=True)
            )
        )
        cotangents = [None] * len(tangents)
        if type(g) is not ad.Zero and wanted.flags() != (False,) * 4:
            grads = rules.backward(x, kernel, r, s, z, g, config, plan, wanted)
            cotangents = [
                None if grad is None else grad.astype(t.aval.dtype)
                for grad, t in zip(grads, tangents, strict=True)
            ]
        num_primals = 4 + keeps_product
        return [None] * num_primals + [
            c for c, flag in zip(cotangents, needs.flags(), strict=True) if flag
        ]

    def transpose_op(g, x, kernel, r, s, *, config):
        # The op is linear in each of its operands alone (jax.linear_transpose).
        operands = (x, kernel, r, s)
        needs = Needs(*(ad.is_undefined_primal(a) for a in operands))
        if sum(needs.flags()) != 1:
            raise NotImplementedError(
                f"{rules.name} is linear in each operand alone; transposing it "
                f"in {sum(needs.flags())} operands at once is not defined."
            )
        # The backward never reads the value of the operand it differentiates.
        known = [
            jnp.zeros(a.aval.shape, a.aval.dtype) if ad.is_undefined_primal(a) else a
            for a in operands
        ]
        if type(g) is ad.Zero:
            return [None] * 4
        plan = rules.plan(*known, config, needs)
        grads = rules.backward(*known, None, g, config, plan, needs)
        return [
            None if grad is None else grad.astype(a.aval.dtype)
            for grad, a in zip(grads, operands, strict=True)
        ]

    def tangent_jvp(primals, tangents, **params):
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        return jax.jvp(functools.partial(evaluate_tangent, **params), primals, tangents)

    _register(op, evaluate)
    _register(tangent, evaluate_tangent)
    ad.primitive_jvps[op] = jvp
    ad.primitive_transposes[op] = transpose_op
    ad.primitive_jvps[tangent] = tangent_jvp
    ad.primitive_transposes[tangent] = transpose

    def apply(x, kernel, r, s, config: Any) -> jax.Array:
        return op.bind(x, kernel, r, s, config=config)

    return apply


def _split(args, needs: Needs, keeps_product: bool):
    """``(x, kernel, r, s, z, tangents)`` from a tangent primitive's operands."""
    x, kernel, r, s = args[:4]
    rest = list(args[4:])
    z = rest.pop(0) if keeps_product else None
    tangents = [rest.pop(0) if flag else None for flag in needs.flags()]
    return x, kernel, r, s, z, tangents
