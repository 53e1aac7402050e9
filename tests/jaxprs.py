"""Reading what a function lowers to: the equations of one primitive."""

import functools

import jax

from ensembles.ops.autodiff import IMPLEMENTATIONS


def _subjaxprs(value):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _subjaxprs(item)
    elif isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value


def equations(closed_jaxpr, primitive: str) -> list:
    """Every equation of ``primitive`` in ``closed_jaxpr``, recursively.

    Walks into ``pjit``, ``custom_vjp_call`` and any other primitive that
    carries sub-jaxprs, and into the op primitives of
    :mod:`ensembles.ops.autodiff` (traced from the function they run).
    """
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == primitive:
                found.append(eqn)
            for param in eqn.params.values():
                for sub in _subjaxprs(param):
                    walk(sub)
            if eqn.primitive in IMPLEMENTATIONS:
                fn = functools.partial(IMPLEMENTATIONS[eqn.primitive], **eqn.params)
                avals = [
                    jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars
                ]
                walk(jax.make_jaxpr(fn)(*avals).jaxpr)

    walk(closed_jaxpr.jaxpr)
    return found
