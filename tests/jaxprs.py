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
    """``(equation, times)`` of every ``primitive`` in ``closed_jaxpr``, recursively.

    Walks into ``pjit``, ``scan``, ``custom_jvp_call`` and any other primitive
    that carries sub-jaxprs; ``times`` is how often the equation runs (the
    product of the lengths of the scans around it).
    """
    found = []

    def walk(jaxpr, times):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == primitive:
                found.append((eqn, times))
            inner = times * eqn.params.get("length", 1)
            for param in eqn.params.values():
                for sub in _subjaxprs(param):
                    walk(sub, inner)

    walk(closed_jaxpr.jaxpr, 1)
    return found
