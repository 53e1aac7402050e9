"""Reading what a function lowers to: the equations of one primitive."""

import jax


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
    carries sub-jaxprs.
    """
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == primitive:
                found.append(eqn)
            for param in eqn.params.values():
                for sub in _subjaxprs(param):
                    walk(sub)

    walk(closed_jaxpr.jaxpr)
    return found
