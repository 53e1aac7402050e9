"""Whole-model conversion: ``to_batch_ensemble``.

``extract_member``, its inverse, lives in :mod:`ensembles.ensemble` beside
:class:`~ensembles.Ensemble` (which calls it) and is re-exported here.

``to_batch_ensemble`` and ``extract_member`` walk the model graph with
``nnx.recursive_map``, which copies the module structure, converts every shared
submodule once and re-links every reference to it, and keeps ``nnx.List`` /
``nnx.Dict`` / ``nnx.Sequential`` containers intact.
``recursive_map`` and ``iter_graph`` show a shared submodule under its first
path only, so the ``only`` filter is asked about every path separately
(:func:`_paths_to_nodes`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import nnx
from flax.nnx import filterlib
from flax.nnx import graph as nnx_graph

from ensembles._checks import (
    check_bool,
    check_choice,
    check_initializer,
    check_num_members,
)
from ensembles.ensemble import extract_member
from ensembles.initializers import Initializer
from ensembles.layers.base import BatchEnsembleModule, EnsembleModule
from ensembles.layers.batch_norm import EnsembleBatchNorm
from ensembles.layers.conv import BatchEnsembleConv
from ensembles.layers.conv_transpose import BatchEnsembleConvTranspose
from ensembles.layers.einsum import BatchEnsembleEinsum
from ensembles.layers.linear import BatchEnsembleLinear
from ensembles.layers.linear_general import BatchEnsembleLinearGeneral
from ensembles.layers.normalization import EnsembleLayerNorm, EnsembleRMSNorm
from ensembles.layers.parameters import (
    check_rngs,
    default_fast_weight_init,
    default_input_r_init,
    drawing_from,
)
from ensembles.layers.posterior import (
    DEFAULT_PRIOR_STDDEV,
    check_posterior,
    check_prior_stddev,
    default_stddev_init,
)
from ensembles.layers.stacking import layer_axes, map_layers
from ensembles.summary import is_norm_like

__all__ = ["CONVERTERS", "NORM_CONVERTERS", "extract_member", "to_batch_ensemble"]

M = TypeVar("M")

#: Flax layer type -> the ``from_*`` classmethod of its BatchEnsemble sibling.
#: Each is called as ``from_x(layer, num_members=, rngs=, r_init=, s_init=,
#: share_kernel=, posterior=, prior_stddev=, stddev_init=)``. Exact types: a
#: subclass may compute something else.
CONVERTERS: dict[type[nnx.Module], Callable[..., nnx.Module]] = {
    nnx.Linear: BatchEnsembleLinear.from_linear,
    nnx.LinearGeneral: BatchEnsembleLinearGeneral.from_linear_general,
    nnx.Conv: BatchEnsembleConv.from_conv,
    nnx.ConvTranspose: BatchEnsembleConvTranspose.from_conv_transpose,
    nnx.Einsum: BatchEnsembleEinsum.from_einsum,
}

#: Flax norm type -> the ``from_*`` classmethod of its per-member norm, used with
#: ``norms="member"``; called as ``from_x(norm, num_members=)``.
NORM_CONVERTERS: dict[type[nnx.Module], Callable[..., nnx.Module]] = {
    nnx.LayerNorm: EnsembleLayerNorm.from_layer_norm,
    nnx.RMSNorm: EnsembleRMSNorm.from_rms_norm,
    nnx.BatchNorm: EnsembleBatchNorm.from_batch_norm,
}

_NORM_MODES = ("shared", "member")


def to_batch_ensemble(
    model: M,
    *,
    num_members: int,
    rngs: nnx.Rngs,
    only: filterlib.Filter = ...,
    r_init: Initializer = default_fast_weight_init,
    s_init: Initializer = default_fast_weight_init,
    input_r_init: Initializer | None = None,
    input_layers: filterlib.Filter | None = None,
    norms: str = "shared",
    share_weights: bool = False,
    posterior: str | None = None,
    prior_stddev: float = DEFAULT_PRIOR_STDDEV,
    stddev_init: Initializer = default_stddev_init,
) -> M:
    """Returns a BatchEnsemble copy of ``model``, keeping its pretrained weights.

    Every ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Conv``,
    ``nnx.ConvTranspose`` and ``nnx.Einsum`` (the keys of ``CONVERTERS``)
    selected by ``only`` is
    replaced by its BatchEnsemble sibling built with ``from_*``: the kernel is
    kept, the bias is broadcast to every member and each fresh layer draws its
    own fast weights from ``rngs``. By default (the recipe of
    ``docs/training.md``) the input layer's ``r`` are random signs and every
    other fast weight is drawn from N(1, 0.5): members then see their inputs
    through different sign patterns, and disagree more where the data did not
    teach them to agree. With ``r_init = s_init = ones()`` every member
    computes exactly what ``model`` does. ``model`` itself
    is never changed. Layers that are already BatchEnsemble layers are left
    alone, so converting a converted model again with the same ``num_members``
    and ``posterior`` is a no-op (it returns a copy); another ``num_members``,
    ``posterior`` or ``prior_stddev`` raises, since those layers would not get
    it.

    The converted model takes member-major ``[E*B, ...]`` batches (see
    :func:`ensembles.tile`, or wrap it in :class:`ensembles.Ensemble`).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import ensembles
    >>> model = nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
    >>> ensemble = ensembles.to_batch_ensemble(model, num_members=4,
    ...                                        rngs=nnx.Rngs(2))
    >>> type(ensemble.layers[0]).__name__, type(model.layers[0]).__name__
    ('BatchEnsembleLinear', 'Linear')
    >>> ensemble(ensembles.tile(jnp.ones((5, 3)), 4)).shape
    (20, 2)

    Args:
      model: any NNX model (modules nested in attributes, ``nnx.List``,
        ``nnx.Dict``, ``nnx.Sequential``; shared submodules stay shared).
      num_members: the ensemble size E.
      rngs: rng keys for the fast weights (an ``nnx.Rngs``); advanced only
        if the conversion succeeds.
      only: an NNX filter (types, path predicates, ...) selecting which
        convertible layers (and, with ``norms="member"``, which norms) to
        convert; default: all of them. A layer reachable by several paths
        (shared by several attributes) is selected if any of its paths
        matches; it is converted once and stays shared.
      r_init: initializer for every converted layer's ``r`` (but the input
        layer's, see ``input_r_init``).
      s_init: initializer for every converted layer's ``s``.
      input_r_init: initializer for the input layer's ``r``. ``None``:
        :func:`~ensembles.initializers.random_sign` (TabM's recipe, chosen
        across tasks: ``docs/training.md``) while ``r_init`` is left at its
        default, else ``r_init`` (so an explicit ``r_init``, e.g. ``ones()``
        for an exact conversion, holds for every layer).
      input_layers: an NNX filter selecting the input layers among the
        converted ones. ``None``: the first of the layers converted that the
        model's constructor created (attributes in the order they were set,
        lists in order): the first layer of an ``nnx.Sequential``, and of a
        module that builds its layers in the order it calls them; where
        ``only`` leaves the first layers plain, the first layer it converts.
        Of a stack of layers built under ``nnx.vmap`` for ``nnx.scan``, only
        the first layer of the stack counts.
      norms: ``"shared"`` keeps norm layers as they are (statistics and scale
        shared by all members); ``"member"`` replaces every norm in
        ``NORM_CONVERTERS`` by its per-member sibling.
      share_weights: if True, the new model holds ``model``'s very Variables
        (kernels and every unconverted parameter), so training one trains the
        other; by default it holds copies.
      posterior: ``None`` (BatchEnsemble) or ``"gaussian"`` / ``"cauchy"``:
        every converted layer gets rank-1 Bayesian fast weights (means from
        ``r_init`` / ``s_init``, drawn in training mode; see
        ``docs/rank1.md``). Train with :func:`ensembles.kl_divergence`.
      prior_stddev: with a posterior, every converted layer's prior scale.
      stddev_init: with a posterior, the initializer of the unconstrained
        posterior scales.

    Returns:
      The converted model, of the same type as ``model``.

    Raises:
      ValueError: if the model holds nothing to convert and no BatchEnsemble
        layer, if ``input_layers`` selects none of the converted layers, if
        its BatchEnsemble layers have another ``num_members`` or
        another ``posterior`` or ``prior_stddev`` (a converted layer keeps its
        fast weights), if
        ``norms="member"`` but ``only`` excludes every norm, or if an argument
        is invalid (or an initializer fails). Nothing (neither ``model`` nor
        ``rngs``) is changed then.
      TypeError: if ``rngs`` is not an ``nnx.Rngs``, ``prior_stddev`` is
        not a number, ``share_weights`` is not a bool (``"no"`` would read as
        True and share the pretrained Variables) or an initializer is not
        callable.
    """
    num_members = check_num_members(num_members)
    norms = check_choice(norms, "norms", _NORM_MODES)
    posterior = check_posterior(posterior)
    prior_stddev = check_prior_stddev(prior_stddev)
    rngs = check_rngs(rngs)
    share_weights = check_bool(share_weights, "share_weights")
    check_initializer(r_init, "r_init")
    check_initializer(s_init, "s_init")
    if input_r_init is not None:
        check_initializer(input_r_init, "input_r_init")
    elif r_init is default_fast_weight_init:
        input_r_init = default_input_r_init
    if posterior is not None:
        check_initializer(stddev_init, "stddev_init")
    predicate = filterlib.to_predicate(only)
    norm_types = NORM_CONVERTERS if norms == "member" else {}

    # Decide everything before converting anything: an error leaves the model
    # and `rngs` untouched. A shared node is selected if any path to it is.
    paths = _paths_to_nodes(model)
    selected_paths: set[tuple[Any, ...]] = set()

    def selected(path, node) -> bool:
        return any(predicate(p, node) for p in paths.get(id(node), [path]))

    layers, norm_layers, skipped_norms, existing = [], [], [], {}
    posteriors: dict[str, str | None] = {}
    custom_norms: list[str] = []
    subclassed: list[str] = []
    unselected: list[str] = []
    priors: dict[str, float] = {}
    for path, node in nnx.iter_graph(model):
        where = "/".join(map(str, path))
        if type(node) in CONVERTERS and not selected(path, node):
            unselected.append(f"{where} ({type(node).__name__})")
        elif type(node) in CONVERTERS:
            layers.append(where)
            selected_paths.update(paths.get(id(node), [path]))
        elif type(node) in norm_types:
            if selected(path, node):
                norm_layers.append(where)
                selected_paths.update(paths.get(id(node), [path]))
            else:
                skipped_norms.append(where)
        elif norms == "member" and is_norm_like(node) and _holds_params(node):
            custom_norms.append(f"{where} ({type(node).__name__})")
        elif isinstance(node, tuple(CONVERTERS)) and selected(path, node):
            subclassed.append(f"{where} ({type(node).__name__})")
        elif isinstance(node, EnsembleModule):
            existing[where] = node.num_members
            if isinstance(node, BatchEnsembleModule) and node.posterior is not None:
                priors[where] = node.prior_stddev
            if isinstance(node, BatchEnsembleModule):
                posteriors[where] = node.posterior
    mismatched = {w: e for w, e in existing.items() if e != num_members}
    if mismatched:
        raise ValueError(
            f"`num_members` (={num_members}) differs from the ensemble size of "
            f"layers `model` already holds: {mismatched}. Convert with "
            f"num_members={next(iter(mismatched.values()))}, or start from the "
            f"plain model."
        )
    other_posterior = {w: p for w, p in posteriors.items() if p != posterior}
    if other_posterior:
        raise ValueError(
            f"`posterior` (={posterior!r}) differs from that of the BatchEnsemble "
            f"layers `model` already holds: {other_posterior}. A converted layer "
            f"keeps the fast weights it was built with: convert the plain model "
            f"with posterior={posterior!r}, or pass "
            f"posterior={next(iter(other_posterior.values()))!r} to keep these "
            f"layers as they are."
        )
    other_prior = {w: p for w, p in priors.items() if p != prior_stddev}
    if posterior is not None and other_prior:
        raise ValueError(
            f"`prior_stddev` (={prior_stddev!r}) differs from that of the rank-1 "
            f"layers `model` already holds: {other_prior}. Pass "
            f"prior_stddev={next(iter(other_prior.values()))!r}, or convert the "
            f"plain model."
        )
    if skipped_norms and not norm_layers:
        raise ValueError(
            f'`norms="member"` would convert no norm: `only` (={only!r}) '
            f"excludes all of {skipped_norms}. Let `only` select them too (e.g. "
            f'add their types), or pass norms="shared".'
        )
    if not layers and not norm_layers and not existing:
        seen = (
            f"`only`={only!r} selects none of the convertible layers it saw: "
            f"{unselected}. A path predicate gets each layer's path as a tuple "
            f"of keys, e.g. ('blocks', 0, 'mlp', 'linear1'): test with "
            f"`'mlp' in path`, not a string match on the whole path"
            if unselected
            else f"it holds none of the convertible types "
            f"{sorted(t.__name__ for t in CONVERTERS)}"
        )
        raise ValueError(
            f"to_batch_ensemble found no layer to convert in "
            f"{type(model).__name__}: {seen}."
        )

    input_paths = _input_layer_paths(
        model, input_layers, paths, selected_paths, input_r_init is not None
    )

    if custom_norms:
        warnings.warn(
            f'`norms="member"` converts Flax\'s norms ({_names(NORM_CONVERTERS)}) '
            f"and left these norm-like modules shared by every member: "
            f"{custom_norms}. Build them as Flax norms, or replace them by "
            f"ensembles.EnsembleLayerNorm / EnsembleRMSNorm yourself, to give "
            f"each member its own.",
            UserWarning,
            stacklevel=2,
        )

    if subclassed:
        warnings.warn(
            f"`to_batch_ensemble` converts Flax's own layers "
            f"({_names(CONVERTERS)}) and left these subclasses of them shared "
            f"by every member: {subclassed}. A subclass may compute something "
            f"else than its Flax base, so it is not converted: build it as the "
            f"Flax layer, or replace it yourself (e.g. "
            f"ensembles.BatchEnsembleLinear.from_linear); leave it out with "
            f"`only=` to silence this.",
            UserWarning,
            stacklevel=2,
        )

    def convert_layer(layer, rngs, r_init=r_init):
        return CONVERTERS[type(layer)](
            layer,
            num_members=num_members,
            rngs=rngs,
            r_init=r_init,
            s_init=s_init,
            # `layer` belongs to the private copy (or, with share_weights, is
            # meant to be shared): holding its kernel is what we want.
            share_kernel=True,
            posterior=posterior,
            prior_stddev=prior_stddev,
            stddev_init=stddev_init,
        )

    def convert_norm(norm):
        return norm_types[type(norm)](norm, num_members=num_members)

    def convert(path, node):
        kind = type(node)
        # recursive_map visits a shared node once, under one of its paths (on
        # its own copy of the graph, so match by path rather than identity).
        chosen = tuple(path) in selected_paths
        if not chosen or (kind not in CONVERTERS and kind not in norm_types):
            return node
        try:
            # A layer stacked for nnx.scan converts one layer at a time.
            if kind in CONVERTERS:
                axes = layer_axes(node)
                if tuple(path) in input_paths and not axes:
                    return convert_layer(node, draw, r_init=input_r_init)
                converted = map_layers(convert_layer, node, rngs=draw)
                if axes:
                    converted.kernel = node.kernel  # the very Variable, stacked
                if tuple(path) in input_paths:  # the stack's first layer only
                    first = (0,) * axes
                    r = converted.r[...]
                    drawn = input_r_init(draw.params(), r[first].shape, r.dtype)
                    converted.r[...] = r.at[first].set(drawn)
                return converted
            return map_layers(convert_norm, node)
        except (ValueError, TypeError) as error:
            where = "/".join(map(str, path)) or "the model itself"
            raise type(error)(
                f"to_batch_ensemble could not convert `{where}` ({kind.__name__}"
                f", parameters {_shapes(node)}): {error}"
            ) from error

    source = model if share_weights else nnx.clone(model)
    # Fast weights draw from a copy of `rngs`, handed back only on success: an
    # initializer that fails halfway leaves the caller's streams where they were.
    with drawing_from(rngs) as draw:
        return nnx.recursive_map(convert, source, graph=True)


def _input_layer_paths(
    model: Any,
    input_layers: filterlib.Filter | None,
    paths: dict[int, list[tuple[Any, ...]]],
    selected_paths: set[tuple[Any, ...]],
    wanted: bool,
) -> set[tuple[Any, ...]]:
    """The paths of the layers that get ``input_r_init`` (all paths of each)."""
    if not wanted:
        return set()
    converted = [
        node
        for node in _in_construction_order(model)
        if type(node) in CONVERTERS
        and any(tuple(p) in selected_paths for p in paths.get(id(node), []))
    ]
    if input_layers is None:
        chosen = converted[:1]
    else:
        predicate = filterlib.to_predicate(input_layers)
        chosen = [
            node
            for node in converted
            if any(predicate(p, node) for p in paths[id(node)])
        ]
        if not chosen:
            names = ["/".join(map(str, paths[id(n)][0])) for n in converted]
            raise ValueError(
                f"`input_layers` (={input_layers!r}) selects none of the layers "
                f"to convert: {names}. Select the layers that read the model's "
                f"input, or leave it None (the first converted layer the model "
                f"created)."
            )
    return {tuple(p) for node in chosen for p in paths[id(node)]}


def _in_construction_order(model: Any) -> list[Any]:
    """``model``'s graph nodes, depth first, in the order they were created.

    Each module's attributes in the order they were set (``nnx.iter_graph``
    sorts them by name), lists in order.
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
        else:
            children = list(node_impl.node_dict(node).values())
        stack.extend(reversed(children))
    return order


def _names(types: Any) -> str:
    return ", ".join(f"nnx.{t.__name__}" for t in types)


def _holds_params(node: Any) -> bool:
    return bool(jax.tree.leaves(nnx.state(node, nnx.Param)))


def _shapes(node: Any) -> dict[str, tuple[int, ...]]:
    """The shapes of the Variables ``node`` holds, for an error message."""
    return {
        "/".join(map(str, path)): tuple(variable.shape)
        for path, variable in nnx.to_flat_state(nnx.state(node))
        if hasattr(variable, "shape")
    }


def _paths_to_nodes(model: Any) -> dict[int, list[tuple[Any, ...]]]:
    """Every path to every graph node of ``model``, keyed by ``id(node)``.

    ``nnx.iter_graph`` yields a node reachable by several paths only once; the
    walk here follows every edge (cycles excepted), so a filter can be asked
    about each path. Variables and other leaves are not entered.
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
