"""Walks over an NNX model's graph that ``nnx.iter_graph`` does not make.

``nnx.iter_graph`` yields each node once, under its first path, with every
module's attributes and every dict's keys sorted by name. Conversion needs two
other views of the graph (:mod:`ensembles.convert`): every path to a shared
node, so that a filter can be asked about each; and the nodes in the order
they were created, which is where a model's input layer stands.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx
from flax.nnx import graph as nnx_graph

__all__ = [
    "holds_params",
    "in_construction_order",
    "paths_to_nodes",
    "variable_shapes",
]


def paths_to_nodes(model: Any) -> dict[int, list[tuple[Any, ...]]]:
    """Every path to every graph node of ``model``, keyed by ``id(node)``.

    The walk follows every edge (cycles excepted); Variables and other leaves
    are not entered.

    >>> from flax import nnx
    >>> shared = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> model = nnx.List([shared, shared])
    >>> paths_to_nodes(model)[id(shared)]
    [(0,), (1,)]
    """
    paths: dict[int, list[tuple[Any, ...]]] = {}
    stack: list[tuple[tuple[Any, ...], Any, frozenset[int]]] = [
        ((), model, frozenset())
    ]
    while stack:
        path, node, ancestors = stack.pop()
        if isinstance(node, nnx.Variable) or id(node) in ancestors:
            continue
        node_impl = nnx_graph.get_node_impl(node)
        if node_impl is None:
            continue
        paths.setdefault(id(node), []).append(path)
        inner = ancestors | {id(node)}
        for key, child in reversed(list(node_impl.node_dict(node).items())):
            stack.append(((*path, key), child, inner))
    return paths


def in_construction_order(model: Any) -> list[Any]:
    """``model``'s graph nodes, depth first, in the order they were created.

    A module's attributes in the order they were set, a dict's items in the
    order they were inserted (``nnx.iter_graph`` sorts both by name), lists
    in order.

    >>> from flax import nnx
    >>> class Model(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.layers = nnx.data({"z_in": nnx.Linear(2, 3, rngs=rngs),
    ...                                 "a_out": nnx.Linear(3, 1, rngs=rngs)})
    >>> model = Model(nnx.Rngs(0))
    >>> [n.out_features for n in in_construction_order(model)
    ...  if isinstance(n, nnx.Linear)]
    [3, 1]
    """
    order: list[Any] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        node = stack.pop()
        if isinstance(node, nnx.Variable) or id(node) in seen:
            continue
        node_impl = nnx_graph.get_node_impl(node)
        if node_impl is None:
            continue
        seen.add(id(node))
        order.append(node)
        if isinstance(node, nnx.Module):
            children = [
                child
                for key, child in vars(node).items()
                if not key.startswith("_pytree__")
            ]
        elif isinstance(node, Mapping):
            # A plain dict held with nnx.data: its own (insertion) order.
            children = list(node.values())
        else:
            children = list(node_impl.node_dict(node).values())
        stack.extend(reversed(children))
    return order


def holds_params(node: Any) -> bool:
    """Whether ``node`` holds an ``nnx.Param`` (itself or in a submodule)."""
    return bool(jax.tree.leaves(nnx.state(node, nnx.Param)))


def variable_shapes(node: Any) -> dict[str, tuple[int, ...]]:
    """The shapes of the Variables ``node`` holds, by path: for an error message."""
    return {
        "/".join(map(str, path)): tuple(variable.shape)
        for path, variable in nnx.to_flat_state(nnx.state(node))
        if hasattr(variable, "shape")
    }
