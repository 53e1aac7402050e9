"""Members over a mesh axis: the sharding annotation of every per-member array.

By default the member axis of every per-member array (fast weights, a
per-member bias, a norm's per-member scale and statistics, an
``EnsembleLinear``'s kernels) is replicated (:mod:`ensembles.layers.sharding`).
:func:`shard_members` annotates it with a mesh axis instead, so that
``nnx.get_partition_spec`` places member ``k``'s arrays on the devices of
that axis's ``k``-th slice: with rows over the same axis, each device holds
the members whose rows it runs. ``to_batch_ensemble(..., member_axis=...)``
calls it on the converted model.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from ensembles.layers.base import EnsembleModule
from ensembles.layers.sharding import SHARDING_KEYS
from ensembles.layers.stacking import layer_axes

__all__ = ["shard_members"]


def _member_spec(variable: nnx.Variable, at: int, axis: str, where: str) -> tuple:
    """``variable``'s annotation with ``axis`` on its member axis (index ``at``)."""
    metadata = variable.get_metadata()
    key = next((k for k in SHARDING_KEYS if metadata.get(k) is not None), None)
    spec = tuple(metadata[key]) if key else ()
    spec = spec + (None,) * (len(variable.get_value().shape) - len(spec))
    if spec[at] not in (None, axis) or axis in spec[:at] + spec[at + 1 :]:
        raise ValueError(
            f"`member_axis={axis!r}` cannot go on the member axis of `{where}`: its "
            f"annotation is {spec}, and axis {at} holds the members. Leave the "
            f"member axis unannotated (None) and {axis!r} on no other axis, or "
            f"choose another `member_axis`."
        )
    return (*spec[:at], axis, *spec[at + 1 :])


def shard_members(model: Any, axis: str) -> Any:
    """Annotates the member axis of every per-member array with mesh ``axis``.

    Every ensemble layer of ``model`` is annotated in place; a BatchEnsemble
    layer's shared kernel is not (it is one array for all members), nor is
    anything outside the ensemble layers. The annotation places nothing by
    itself: place the parameters from ``nnx.get_partition_spec`` (as
    ``docs/scaling_out.md`` does), on a mesh whose ``axis`` divides the
    number of members.

    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.BatchEnsembleLinear(3, 2, num_members=4,
    ...                                       rngs=nnx.Rngs(0))
    >>> _ = ensembles.layers.shard_members(layer, "data")
    >>> specs = nnx.get_partition_spec(nnx.state(layer))
    >>> [tuple(specs[name].get_value()) for name in ("r", "s", "bias", "kernel")]
    [('data', None), ('data', None), ('data', None), ()]

    Args:
      model: a model holding ensemble layers (or one layer).
      axis: the mesh axis name to shard members over.

    Returns:
      ``model``, annotated.

    Raises:
      TypeError: if ``axis`` is not a string.
      ValueError: if a per-member array's annotation already puts another
        axis on its member axis, or ``axis`` on another axis (nothing is
        annotated then), or the mesh set by ``jax.set_mesh`` has no axis
        ``axis`` or one that does not divide a layer's number of members
        (outside a mesh only the annotation is set, checked when placed).
    """
    if not isinstance(axis, str):
        raise TypeError(
            f"`member_axis` must be a mesh axis name (a str), got {axis!r}."
        )
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and axis not in mesh.axis_names:
        # Caught here, not at placement: nnx.get_partition_spec would name the
        # axis and jax.device_put fail far from the call that chose it.
        raise ValueError(
            f"`member_axis={axis!r}` names no axis of the mesh set by "
            f"jax.set_mesh, whose axes are {tuple(mesh.axis_names)}: pass one of "
            f"them (the axis the rows are sharded over, e.g. "
            f"member_axis={mesh.axis_names[0]!r}), or set the mesh that has "
            f"{axis!r}."
        )
    size = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)).get(axis)
    planned = []  # check everything, then annotate: a failure changes nothing
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, EnsembleModule):
            continue
        where = "/".join(map(str, path)) or type(node).__name__
        if size is not None and node.num_members % size:
            raise ValueError(
                f"`member_axis={axis!r}` has {size} devices in the mesh set by "
                f"jax.set_mesh, which do not divide `{where}`'s num_members="
                f"{node.num_members}. Use a number of members that the axis "
                f"divides, or shard the rows only (no member_axis)."
            )
        at = layer_axes(node)
        for name, variable in vars(node).items():
            if not isinstance(variable, nnx.Variable) or name in node.shared_variables:
                continue
            spec = _member_spec(variable, at, axis, f"{where}/{name}")
            planned.append((variable, spec))
    for variable, spec in planned:
        key = next(
            (k for k in SHARDING_KEYS if variable.get_metadata().get(k) is not None),
            "out_sharding",
        )
        variable.set_metadata(**{key: spec})
    return model
