"""Whole-model conversion: ``to_batch_ensemble``.

``extract_member``, its inverse, lives in :mod:`ensembles.ensemble` beside
:class:`~ensembles.Ensemble` (which calls it), and the tables of what converts
into what (``CONVERTERS``, ``NORM_CONVERTERS``) in
:mod:`ensembles.convert_survey` beside the walk that decides what to convert;
all three are re-exported here.

``to_batch_ensemble`` and ``extract_member`` walk the model graph with
``nnx.recursive_map``, which copies the module structure, converts every shared
submodule once and re-links every reference to it, and keeps ``nnx.List`` /
``nnx.Dict`` / ``nnx.Sequential`` containers intact.
``recursive_map`` and ``iter_graph`` show a shared submodule under its first
path only, so the ``only`` filter is asked about every path separately
(:func:`ensembles._graph.paths_to_nodes`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from flax import nnx
from flax.nnx import filterlib

from ensembles._checks import (
    check_bool,
    check_choice,
    check_initializer,
    check_num_members,
)
from ensembles._graph import variable_shapes
from ensembles.convert_survey import (
    CONVERTERS,
    NORM_CONVERTERS,
    check_existing,
    check_selection,
    independent_layer_paths,
    input_layer_paths,
    survey,
    warn_about_what_stays_shared,
)
from ensembles.ensemble import extract_member
from ensembles.initializers import Initializer
from ensembles.layers.ensemble_linear import EnsembleLinear
from ensembles.layers.member_axis import shard_members
from ensembles.layers.parameters import (
    check_rngs,
    default_fast_weight_init,
    default_input_r_init,
    drawing_from,
    shape_checked,
)
from ensembles.layers.posterior import (
    DEFAULT_PRIOR_STDDEV,
    check_posterior,
    check_prior_stddev,
    default_stddev_init,
)
from ensembles.layers.stacking import layer_axes, map_layers

__all__ = ["CONVERTERS", "NORM_CONVERTERS", "extract_member", "to_batch_ensemble"]

M = TypeVar("M")

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
    independent: filterlib.Filter | None = None,
    independent_init: Initializer | None = None,
    member_axis: str | None = None,
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
    and ``posterior`` is a no-op (it returns a copy), ``independent=`` too
    (its ``EnsembleLinear`` layers stay as they are); another ``num_members``,
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
        lists and dicts in order): the first layer of an ``nnx.Sequential``, and of a
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
      independent: an NNX filter selecting ``nnx.Linear`` layers (among
        those converted) to make fully independent: each becomes an
        :class:`~ensembles.EnsembleLinear`, a kernel and bias of its own per
        member (TabM's independent heads), where the others share theirs; a
        stack of them (``nnx.vmap`` for ``nnx.scan``) layer by layer.
        ``None``: none.
      independent_init: ``None`` copies each independent layer's kernel and
        bias to every member (an exact conversion of a trained model); an
        initializer draws every member's kernel afresh from it (members as
        independent as a deep ensemble's, for a model not yet trained).
      member_axis: ``None`` (the member axis of every per-member array
        replicated) or a mesh axis name to shard the members over: the
        fast weights, per-member biases and norms and independent kernels
        of every ensemble layer of the result are annotated with it
        (:func:`ensembles.layers.shard_members`; ``docs/scaling_out.md``).
        Under ``jax.set_mesh`` it must be an axis of that mesh; outside
        one only the annotation is set.

    Returns:
      The converted model, of the same type as ``model``.

    Raises:
      ValueError: if the model holds nothing to convert and no BatchEnsemble
        layer, if ``input_layers`` selects none of the converted layers, if
        ``independent`` selects none (and the model holds no
        ``EnsembleLinear``), or one that is not an ``nnx.Linear`` (a layer
        converted already included), if
        its BatchEnsemble layers have another ``num_members`` or
        another ``posterior`` or ``prior_stddev`` (a converted layer keeps its
        fast weights), if
        ``norms="member"`` but ``only`` excludes every norm, or if an argument
        is invalid (or an initializer fails), or ``member_axis`` cannot
        annotate a per-member array (another axis there, or a mesh set by
        ``jax.set_mesh`` that lacks the axis or whose axis does not divide
        ``num_members``). Nothing (neither ``model``
        nor ``rngs``) is changed then.
      TypeError: if ``rngs`` is not an ``nnx.Rngs``, ``prior_stddev`` is
        not a number, ``share_weights`` is not a bool (``"no"`` would read as
        True and share the pretrained Variables) or an initializer is not
        callable, or ``member_axis`` is not a string.
    """
    num_members = check_num_members(num_members)
    norms = check_choice(norms, "norms", _NORM_MODES)
    posterior = check_posterior(posterior)
    prior_stddev = check_prior_stddev(prior_stddev)
    rngs = check_rngs(rngs)
    share_weights = check_bool(share_weights, "share_weights")
    input_r_init = _check_initializers(r_init, s_init, input_r_init)
    if posterior is not None:
        check_initializer(stddev_init, "stddev_init")
    if independent_init is not None:
        check_initializer(independent_init, "independent_init")
    if member_axis is not None and not isinstance(member_axis, str):
        raise TypeError(
            f"`member_axis` must be a mesh axis name (a str) or None, got "
            f"{member_axis!r}."
        )
    norm_types = NORM_CONVERTERS if norms == "member" else {}

    # Decide everything before converting anything: an error leaves the model
    # and `rngs` untouched, and a call that raises warns about nothing.
    found = survey(model, only, norms, norm_types)
    check_existing(found, num_members, posterior, prior_stddev)
    check_selection(found, model, only)
    independent_paths = independent_layer_paths(model, independent, found)
    # An independent layer has no fast weights: the input layers' r is for
    # the BatchEnsemble layers.
    shared = dataclasses.replace(
        found, selected_paths=found.selected_paths - independent_paths
    )
    plan = _Plan(
        selected_paths=frozenset(found.selected_paths),
        input_paths=input_layer_paths(
            model, input_layers, shared, wanted=input_r_init is not None
        ),
        independent_paths=independent_paths,
        independent_init=independent_init,
        norm_types=norm_types,
        layer_options={
            "num_members": num_members,
            "s_init": s_init,
            # The converted layer belongs to the private copy (or, with
            # share_weights, is meant to be shared): holding its kernel is
            # what we want.
            "share_kernel": True,
            "posterior": posterior,
            "prior_stddev": prior_stddev,
            "stddev_init": stddev_init,
        },
        r_init=r_init,
        input_r_init=input_r_init,
    )
    warn_about_what_stays_shared(found)

    source = model if share_weights else nnx.clone(model)
    # Fast weights draw from a copy of `rngs`, handed back only on success: an
    # initializer that fails halfway leaves the caller's streams where they were.
    with drawing_from(rngs) as draw:
        converted = nnx.recursive_map(
            lambda path, node: _convert_node(plan, draw, path, node),
            source,
            graph=True,
        )
        if member_axis is None:
            return converted
        # Annotates the new copy; an error here hands no draws back.
        return shard_members(converted, member_axis)


def _check_initializers(
    r_init: Any, s_init: Any, input_r_init: Any
) -> Initializer | None:
    """Checks the fast-weight initializers; returns the input layers' ``r`` one.

    ``None`` where the input layer takes ``r_init`` like every other layer
    (an explicit ``r_init`` and no ``input_r_init``). An ``input_r_init``
    comes back checking the shape it makes: a stacked layer's input ``r`` is
    set with ``.at[...].set``, which would broadcast a wrong one silently,
    and a plain layer's own check would blame ``r_init``.
    """
    check_initializer(r_init, "r_init")
    check_initializer(s_init, "s_init")
    if input_r_init is not None:
        check_initializer(input_r_init, "input_r_init")
    elif r_init is default_fast_weight_init:
        input_r_init = default_input_r_init
    else:
        return None
    return shape_checked(input_r_init, "input_r_init")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What to convert, and how: decided before anything is converted.

    ``selected_paths`` holds every path of every layer and norm to convert,
    ``input_paths`` those of the input layers; ``layer_options`` is what every
    ``from_*`` call gets but ``rngs`` and ``r_init``.
    """

    selected_paths: frozenset[tuple[Any, ...]]
    input_paths: frozenset[tuple[Any, ...]]
    independent_paths: frozenset[tuple[Any, ...]]
    independent_init: Initializer | None
    norm_types: Any
    layer_options: dict[str, Any]
    r_init: Initializer
    input_r_init: Initializer | None


def _convert_node(plan: _Plan, draw: nnx.Rngs, path: Any, node: Any) -> Any:
    """``recursive_map``'s function: ``node`` converted if the plan selects it.

    ``recursive_map`` visits a shared node once, under one of its paths, on
    its own copy of the graph: the plan matches by path, not identity.
    """
    kind = type(node)
    if tuple(path) not in plan.selected_paths or (
        kind not in CONVERTERS and kind not in plan.norm_types
    ):
        return node
    try:
        if tuple(path) in plan.independent_paths:
            # A stack (nnx.vmap for nnx.scan) converts layer by layer.
            return map_layers(
                lambda one_layer, rngs: EnsembleLinear.from_linear(
                    one_layer,
                    num_members=plan.layer_options["num_members"],
                    rngs=rngs,
                    kernel_init=plan.independent_init,
                ),
                node,
                rngs=draw,
            )
        if kind in CONVERTERS:
            return _convert_layer(plan, draw, tuple(path) in plan.input_paths, node)
        return map_layers(
            lambda norm: plan.norm_types[type(norm)](
                norm, num_members=plan.layer_options["num_members"]
            ),
            node,
        )
    except (ValueError, TypeError) as error:
        where = "/".join(map(str, path)) or "the model itself"
        raise type(error)(
            f"to_batch_ensemble could not convert `{where}` ({kind.__name__}"
            f", parameters {variable_shapes(node)}): {error}"
        ) from error


def _convert_layer(plan: _Plan, draw: nnx.Rngs, is_input: bool, layer: Any) -> Any:
    """One Flax layer (or a stack of them, for ``nnx.scan``) converted.

    A stack converts one layer at a time and keeps the very kernel Variable;
    of an input stack only the first layer's ``r`` is drawn anew from
    ``input_r_init``.
    """

    def convert(one_layer, rngs, r_init=plan.r_init):
        return CONVERTERS[type(one_layer)](
            one_layer, rngs=rngs, r_init=r_init, **plan.layer_options
        )

    axes = layer_axes(layer)
    if is_input and not axes:
        return convert(layer, draw, r_init=plan.input_r_init)
    converted = map_layers(convert, layer, rngs=draw)
    if axes:
        converted.kernel = layer.kernel  # the very Variable, stacked
    if is_input:  # the stack's first layer only
        first = (0,) * axes
        r = converted.r[...]
        drawn = plan.input_r_init(draw.params(), r[first].shape, r.dtype)
        converted.r[...] = r.at[first].set(drawn)
    return converted
