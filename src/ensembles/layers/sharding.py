"""Where parameters and outputs are placed: the layers' sharding metadata.

Every parameter carries the metadata its layer was given (``kernel_metadata``,
``bias_metadata``, ``fast_weight_metadata``), so ``nnx.get_partition_spec`` and
Flax's eager sharding place it as annotated; unannotated parameters are
replicated. The member axis is replicated by default: the fast weights
``[E, features]`` are small, and members live in the rows of the ``[E*B, ...]``
batch, which is what to shard for data parallelism. The shared kernel is
sharded as annotated (e.g. its output features over a ``model`` axis). A bias
broadcast from a pretrained layer (``from_*``) keeps that layer's annotation
for its feature axes, behind a replicated member axis
(:func:`member_axis_metadata`). See ``docs/scaling_out.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

__all__ = ["member_axis_metadata", "shard_output", "without_member_axis_metadata"]

#: Metadata keys that hold one sharding name per array axis: Flax 0.12's
#: ``out_sharding`` and the deprecated names it still accepts (and renames).
SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")


def member_axis_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Returns variable metadata for ``[E, ...]`` from metadata for ``[...]``.

    Sharding annotations get a leading ``None``: the member axis is replicated
    by default, like the fast weights, which are small.

    >>> member_axis_metadata({"out_sharding": ("model",), "note": 1})
    {'out_sharding': (None, 'model'), 'note': 1}
    """
    out = dict(metadata)
    for key in SHARDING_KEYS:
        if out.get(key) is not None:
            out[key] = (None, *out[key])
    return out


def without_member_axis_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`member_axis_metadata`: metadata for one member's slice."""
    out = dict(metadata)
    for key in SHARDING_KEYS:
        if out.get(key) is not None:
            out[key] = tuple(out[key])[1:]
    return out


def shard_output(outputs: jax.Array, out_sharding: Any) -> jax.Array:
    """Places a layer's outputs as ``out_sharding`` asks, as Flax's layers do.

    Flax passes ``out_sharding`` to its ``dot_general``; our ops reshape around
    theirs, so the layer reshards the final outputs instead (a no-op for
    ``None``, the default everywhere).
    """
    if out_sharding is None:
        return outputs
    return jax.sharding.reshard(outputs, out_sharding)
