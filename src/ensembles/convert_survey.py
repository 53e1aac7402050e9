"""What ``to_batch_ensemble`` decides before it converts anything.

Which Flax layers convert, and into what (:data:`CONVERTERS`,
:data:`NORM_CONVERTERS`); one walk over the model that finds what ``only``
selects and what stays as it is (:func:`survey`); the errors for a model
whose ensemble layers would not get the options asked for, or for a
selection that converts nothing; the input layers; and the warnings about
layers left shared by every member. Nothing here converts, draws or
changes anything: an error raised here leaves the model and ``rngs`` as
they were.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from flax import nnx
from flax.nnx import filterlib

from ensembles._graph import holds_params, in_construction_order, paths_to_nodes
from ensembles.layers.base import BatchEnsembleModule, EnsembleModule
from ensembles.layers.batch_norm import EnsembleBatchNorm
from ensembles.layers.conv import BatchEnsembleConv
from ensembles.layers.conv_transpose import BatchEnsembleConvTranspose
from ensembles.layers.einsum import BatchEnsembleEinsum
from ensembles.layers.ensemble_linear import EnsembleLinear
from ensembles.layers.linear import BatchEnsembleLinear
from ensembles.layers.linear_general import BatchEnsembleLinearGeneral
from ensembles.layers.normalization import EnsembleLayerNorm, EnsembleRMSNorm
from ensembles.summary import is_norm_like

__all__ = [
    "CONVERTERS",
    "NORM_CONVERTERS",
    "Survey",
    "check_existing",
    "check_selection",
    "independent_layer_paths",
    "input_layer_paths",
    "survey",
    "warn_about_what_stays_shared",
]

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


@dataclasses.dataclass
class Survey:
    """What one walk over the model found, before anything is converted.

    Lists name layers by path (with their type where they are left alone);
    ``existing``, ``posteriors`` and ``priors`` map the paths of the ensemble
    layers the model already holds to their ``num_members``, ``posterior``
    and (with a posterior) ``prior_stddev``.
    """

    paths: dict[int, list[tuple[Any, ...]]]
    selected_paths: set[tuple[Any, ...]] = dataclasses.field(default_factory=set)
    layers: list[str] = dataclasses.field(default_factory=list)
    norm_layers: list[str] = dataclasses.field(default_factory=list)
    skipped_norms: list[str] = dataclasses.field(default_factory=list)
    unselected: list[str] = dataclasses.field(default_factory=list)
    custom_norms: list[str] = dataclasses.field(default_factory=list)
    subclassed: list[str] = dataclasses.field(default_factory=list)
    existing: dict[str, int] = dataclasses.field(default_factory=dict)
    posteriors: dict[str, str | None] = dataclasses.field(default_factory=dict)
    priors: dict[str, float] = dataclasses.field(default_factory=dict)


def survey(model: Any, only: filterlib.Filter, norms: str, norm_types: Any) -> Survey:
    """Walks ``model`` once: what ``only`` selects, and what stays as it is.

    A shared node is selected if any path to it is (all its paths are then
    selected: ``recursive_map`` visits it under one of them).
    """
    predicate = filterlib.to_predicate(only)
    survey = Survey(paths=paths_to_nodes(model))

    def selected(path, node) -> bool:
        return any(predicate(p, node) for p in survey.paths.get(id(node), [path]))

    for path, node in nnx.iter_graph(model):
        where = "/".join(map(str, path))
        every_path = survey.paths.get(id(node), [path])
        if type(node) in CONVERTERS and not selected(path, node):
            survey.unselected.append(f"{where} ({type(node).__name__})")
        elif type(node) in CONVERTERS:
            survey.layers.append(where)
            survey.selected_paths.update(every_path)
        elif type(node) in norm_types:
            if selected(path, node):
                survey.norm_layers.append(where)
                survey.selected_paths.update(every_path)
            else:
                survey.skipped_norms.append(where)
        elif norms == "member" and is_norm_like(node) and holds_params(node):
            survey.custom_norms.append(f"{where} ({type(node).__name__})")
        elif isinstance(node, tuple(CONVERTERS)) and selected(path, node):
            survey.subclassed.append(f"{where} ({type(node).__name__})")
        elif isinstance(node, EnsembleModule):
            survey.existing[where] = node.num_members
            if isinstance(node, BatchEnsembleModule):
                survey.posteriors[where] = node.posterior
                if node.posterior is not None:
                    survey.priors[where] = node.prior_stddev
    return survey


def check_existing(
    survey: Survey, num_members: int, posterior: str | None, prior_stddev: float
) -> None:
    """Refuses options the ensemble layers ``model`` already holds would not get."""
    mismatched = {w: e for w, e in survey.existing.items() if e != num_members}
    if mismatched:
        raise ValueError(
            f"`num_members` (={num_members}) differs from the ensemble size of "
            f"layers `model` already holds: {mismatched}. Convert with "
            f"num_members={next(iter(mismatched.values()))}, or start from the "
            f"plain model."
        )
    other_posterior = {w: p for w, p in survey.posteriors.items() if p != posterior}
    if other_posterior:
        raise ValueError(
            f"`posterior` (={posterior!r}) differs from that of the BatchEnsemble "
            f"layers `model` already holds: {other_posterior}. A converted layer "
            f"keeps the fast weights it was built with: convert the plain model "
            f"with posterior={posterior!r}, or pass "
            f"posterior={next(iter(other_posterior.values()))!r} to keep these "
            f"layers as they are."
        )
    other_prior = {w: p for w, p in survey.priors.items() if p != prior_stddev}
    if posterior is not None and other_prior:
        raise ValueError(
            f"`prior_stddev` (={prior_stddev!r}) differs from that of the rank-1 "
            f"layers `model` already holds: {other_prior}. Pass "
            f"prior_stddev={next(iter(other_prior.values()))!r}, or convert the "
            f"plain model."
        )


def check_selection(survey: Survey, model: Any, only: filterlib.Filter) -> None:
    """Refuses a conversion that would convert nothing (or no norm it was asked to)."""
    if survey.skipped_norms and not survey.norm_layers:
        raise ValueError(
            f'`norms="member"` would convert no norm: `only` (={only!r}) '
            f"excludes all of {survey.skipped_norms}. Let `only` select them too "
            f'(e.g. add their types), or pass norms="shared".'
        )
    if not survey.layers and not survey.norm_layers and not survey.existing:
        seen = (
            f"`only`={only!r} selects none of the convertible layers it saw: "
            f"{survey.unselected}. A path predicate gets each layer's path as a "
            f"tuple of keys, e.g. ('blocks', 0, 'mlp', 'linear1'): test with "
            f"`'mlp' in path`, not a string match on the whole path"
            if survey.unselected
            else f"it holds none of the convertible types "
            f"{sorted(t.__name__ for t in CONVERTERS)}"
        )
        raise ValueError(
            f"to_batch_ensemble found no layer to convert in "
            f"{type(model).__name__}: {seen}."
        )


def input_layer_paths(
    model: Any,
    input_layers: filterlib.Filter | None,
    survey: Survey,
    *,
    wanted: bool,
) -> frozenset[tuple[Any, ...]]:
    """The paths of the layers that get ``input_r_init`` (all paths of each).

    ``input_layers`` is checked even where no layer gets ``input_r_init``
    (``wanted`` False: an explicit ``r_init`` holds for every layer): a
    filter that selects nothing is a mistake either way.
    """
    paths = survey.paths
    converted = [
        node
        for node in in_construction_order(model)
        if type(node) in CONVERTERS
        and any(tuple(p) in survey.selected_paths for p in paths.get(id(node), []))
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
    if not wanted:
        return frozenset()
    return frozenset(tuple(p) for node in chosen for p in paths[id(node)])


def independent_layer_paths(
    model: Any, independent: filterlib.Filter | None, survey: Survey
) -> frozenset[tuple[Any, ...]]:
    """The paths of the ``nnx.Linear`` layers to make fully independent.

    Among the layers the conversion selects, those ``independent`` selects
    become :class:`~ensembles.EnsembleLinear` (all paths of each). An
    ``EnsembleLinear`` the model already holds, selected by ``independent``,
    is left as it is: converting a converted model again with the same
    ``independent`` is a no-op, as any second conversion is.

    Raises:
      ValueError: if ``independent`` selects a layer that is not an
        ``nnx.Linear`` (a BatchEnsemble layer included: it has fast weights
        to lose), or none of the layers to convert and no ``EnsembleLinear``.
    """
    if independent is None:
        return frozenset()
    predicate = filterlib.to_predicate(independent)
    chosen: set[tuple[Any, ...]] = set()
    candidates, other, already = [], [], []
    for path, node in nnx.iter_graph(model):
        every = [tuple(p) for p in survey.paths.get(id(node), [path])]
        where = "/".join(map(str, path))
        if isinstance(node, EnsembleModule) and any(predicate(p, node) for p in every):
            if isinstance(node, EnsembleLinear):
                already.append(where)
            else:
                other.append(f"{where} ({type(node).__name__}, converted)")
            continue
        if type(node) not in CONVERTERS or not set(every) & survey.selected_paths:
            continue
        candidates.append(where)
        if any(predicate(p, node) for p in every):
            if type(node) is nnx.Linear:
                chosen.update(every)
            else:
                other.append(f"{where} ({type(node).__name__})")
    if other:
        raise ValueError(
            f"`independent` (={independent!r}) selects layers that are not "
            f"nnx.Linear: {other}. Only an nnx.Linear becomes fully independent "
            f"(ensembles.EnsembleLinear); leave these to `only` (BatchEnsemble "
            f"layers), or convert the plain model with `independent=` (a "
            f"converted layer keeps its fast weights)."
        )
    if not chosen and not already:
        raise ValueError(
            f"`independent` (={independent!r}) selects none of the layers to "
            f"convert: {candidates}. Select the output layer by its path, e.g. "
            f"`independent=lambda path, node: path[-1] == 'head'`."
        )
    return frozenset(chosen)


def warn_about_what_stays_shared(survey: Survey) -> None:
    """Names the norm-like modules and Flax-layer subclasses left unconverted."""
    if survey.custom_norms:
        warnings.warn(
            f'`norms="member"` converts Flax\'s norms ({_names(NORM_CONVERTERS)}) '
            f"and left these norm-like modules shared by every member: "
            f"{survey.custom_norms}. Build them as Flax norms, or replace them by "
            f"ensembles.EnsembleLayerNorm / EnsembleRMSNorm yourself, to give "
            f"each member its own.",
            UserWarning,
            stacklevel=3,
        )
    if survey.subclassed:
        warnings.warn(
            f"`to_batch_ensemble` converts Flax's own layers "
            f"({_names(CONVERTERS)}) and left these subclasses of them shared "
            f"by every member: {survey.subclassed}. A subclass may compute "
            f"something else than its Flax base, so it is not converted: build "
            f"it as the Flax layer, or replace it yourself (e.g. "
            f"ensembles.BatchEnsembleLinear.from_linear); leave it out with "
            f"`only=` to silence this.",
            UserWarning,
            stacklevel=3,
        )


def _names(types: Any) -> str:
    return ", ".join(f"nnx.{t.__name__}" for t in types)
