"""Layers stacked for ``nnx.scan``: their leading layer axes, and mapping over them.

Deep NNX models build their blocks once under ``nnx.vmap`` (Flax's
scan-over-layers recipe) and apply them with ``nnx.scan``: every parameter of
a stacked ``nnx.Linear`` then has leading layer axes, ``kernel [L, in, out]``,
while the layer's attributes (``in_features``, ...) describe one layer. A
stacked BatchEnsemble layer has the same leading axes on every parameter, fast
weights included (``r [L, E, in]``), and runs unchanged under the model's own
``nnx.scan``, which hands it one layer at a time.

:func:`layer_axes` reads how many leading axes a layer's parameters have
beyond what its attributes describe; :func:`map_layers` applies a function to
each layer of a stack under ``nnx.vmap`` (nested, one per axis), splitting
``rngs`` so that every layer draws its own keys and keeping the axis names of
sharding annotations (``nnx.PARTITION_NAME``) as the stack was built with.
Conversion (``to_batch_ensemble``) and member extraction use both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from flax import nnx

from ensembles.layers.sharding import SHARDING_KEYS

__all__ = ["layer_axes", "map_layers", "over_layer_axes", "reference_parameter"]


def reference_parameter(layer: Any) -> tuple[nnx.Variable | None, int]:
    """A parameter of ``layer`` and its number of axes in one unstacked layer."""
    kernel = getattr(layer, "kernel", None)
    if kernel is not None:
        if getattr(layer, "kernel_shape", None) is not None:  # Conv, Einsum
            return kernel, len(layer.kernel_shape)
        if getattr(layer, "kernel_size", None) is not None:  # ours: conv
            return kernel, len(layer.kernel_size) + 2
        if getattr(layer, "batch_axis", None) is not None:  # LinearGeneral
            return kernel, (
                len(layer.batch_axis)
                + len(tuple(layer.in_features))
                + len(tuple(layer.out_features))
            )
        # Linear; EnsembleLinear's kernel has a member axis first.
        per_member = "kernel" not in getattr(layer, "shared_variables", ("kernel",))
        return kernel, 2 + per_member
    # Norms: per-feature parameters (per member: [E, features]).
    member_axis = 1 if hasattr(layer, "num_members") else 0
    for name in ("scale", "bias", "mean"):
        variable = getattr(layer, name, None)
        if isinstance(variable, nnx.Variable):
            return variable, 1 + member_axis
    return None, 0


def layer_axes(layer: Any) -> int:
    """How many leading layer axes ``layer``'s parameters have (0: not stacked).

    >>> from flax import nnx
    >>> from ensembles.layers.stacking import layer_axes
    >>> layer_axes(nnx.Linear(3, 4, rngs=nnx.Rngs(0)))
    0
    >>> @nnx.split_rngs(splits=5)
    ... @nnx.vmap(axis_size=5)
    ... def stack(rngs):
    ...     return nnx.Linear(3, 4, rngs=rngs)
    >>> layer_axes(stack(nnx.Rngs(0)))                 # kernel [5, 3, 4]
    1

    Args:
      layer: a Flax layer this library converts, or one of its layers.

    Returns:
      The number of leading axes of its parameters beyond one layer's.
    """
    variable, ndim = reference_parameter(layer)
    if variable is None:
        return 0
    return max(variable.ndim - ndim, 0)


def _stack_metadata(layer: Any) -> dict[str, Any]:
    """``nnx.vmap``'s ``transform_metadata`` for the first layer axis.

    A stack built with ``transform_metadata={nnx.PARTITION_NAME: name}``
    annotates every axis of its parameters, the layer axis included: that
    name is handed back. An unannotated stack gets no metadata transform, as
    it was built.
    """
    variable, _ = reference_parameter(layer)
    metadata = variable.get_metadata() if variable is not None else {}
    for key in SHARDING_KEYS:
        names = metadata.get(key)
        if names is not None and len(names) == variable.ndim:
            return {nnx.PARTITION_NAME: names[0]}
    return {}


def map_layers(
    fn: Callable[..., Any],
    layer: Any,
    *,
    rngs: nnx.Rngs | None = None,
    num_axes: int | None = None,
) -> Any:
    """``fn(one_layer)`` (or ``fn(one_layer, rngs)``) for every layer of a stack.

    ``layer``'s leading ``num_axes`` axes (default: :func:`layer_axes`) are
    mapped with nested ``nnx.vmap``; what ``fn`` returns is stacked along them,
    modules included (their parameters gain the same leading axes). With
    ``rngs``, every stream is split per layer (``nnx.split_rngs``), so each
    layer draws its own keys. Sharding annotations keep the stack's axis
    names. With no layer axes this is ``fn(layer)`` itself.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from ensembles.layers.stacking import map_layers
    >>> @nnx.split_rngs(splits=5)
    ... @nnx.vmap(axis_size=5)
    ... def stack(rngs):
    ...     return nnx.Linear(3, 4, rngs=rngs)
    >>> norms = map_layers(lambda linear: jnp.linalg.norm(linear.kernel[...]),
    ...                    stack(nnx.Rngs(0)))
    >>> norms.shape
    (5,)

    Args:
      fn: called on one layer (and, with ``rngs``, an ``nnx.Rngs`` for it).
      layer: the stacked layer.
      rngs: streams to split over the layers, or ``None``.
      num_axes: how many leading axes to map (default: all layer axes).

    Returns:
      ``fn``'s results, stacked along the layer axes.
    """
    if num_axes is None:
        num_axes = layer_axes(layer)
    if num_axes == 0:
        return fn(layer) if rngs is None else fn(layer, rngs)
    size = reference_parameter(layer)[0].shape[0]
    metadata = _stack_metadata(layer)

    def inner(one, *streams):
        stream = streams[0] if streams else None
        return map_layers(fn, one, rngs=stream, num_axes=num_axes - 1)

    if rngs is None:
        return nnx.vmap(inner, in_axes=0, out_axes=0, transform_metadata=metadata)(
            layer
        )
    mapped = nnx.vmap(inner, in_axes=(0, 0), out_axes=0, transform_metadata=metadata)
    return nnx.split_rngs(splits=size)(mapped)(layer, rngs)


def over_layer_axes(method: Callable[..., Any]) -> Callable[..., Any]:
    """Makes a layer method that returns a module work on a stacked layer too.

    On a layer with layer axes the method runs on each layer
    (:func:`map_layers`) and the modules it returns are stacked: what
    ``extract_member`` of a stacked BatchEnsemble layer needs, to return the
    stacked Flax layer the model's ``nnx.scan`` expects.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if layer_axes(self) == 0:
            return method(self, *args, **kwargs)
        return map_layers(lambda one: method(one, *args, **kwargs), self)

    return wrapper
