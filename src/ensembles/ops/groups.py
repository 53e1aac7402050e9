"""How an op views the member-major rows: one group per member, or more when sharded.

The rows of a member-major batch ``[E*B, ...]`` are viewed as ``G`` groups of
``R = E*B/G`` consecutive rows, ``[G, R, ...]``, with ``G`` a multiple of
``E``: each group lies inside one member (group ``g`` is member ``g // (G/E)``'s),
and the per-member vectors are repeated to the groups (:func:`group_weights`,
``[E, F] -> [G, F]``, a copy of ``G*F`` numbers, not of the activations).

On one device ``G = E``: the ``[E, B, ...]`` view the ops have always used.
Where the program may split the rows over ``D`` devices, ``G`` is also a
multiple of ``D`` (:func:`member_groups`): each device's rows are then whole
groups, so the view is a reshape that every device does on its own rows, and
a batched matmul over the groups runs where the rows are, with no all-gather,
whatever ``E`` and ``D`` are (``E = 3`` on 8 devices: 24 groups, 3 a device).
With ``G = E`` there, rows that straddle members (``E = 3`` on 8 devices) would
make XLA's partitioner gather the whole batch to every device
(``docs/scaling_out.md``).

What the program splits the rows over is read where it can be known when the
op is traced (:func:`row_shards`), never from the machine: a program compiled
for one device on a machine of eight is a one-device program.

>>> import jax.numpy as jnp
>>> member_groups(num_rows=24, num_members=3, shards=1)   # rows not split
3
>>> member_groups(num_rows=24, num_members=3, shards=8)   # 8 devices, 3 rows each
24
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

__all__ = ["group_weights", "member_groups", "place_as_groups", "row_shards"]


def _explicit_sharding(array: Any) -> jax.sharding.NamedSharding | None:
    """``array``'s sharding if its type places it on an explicit mesh, else ``None``."""
    sharding = getattr(jax.typeof(array), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not mesh.explicit_axes:
        return None
    return sharding


def row_shards(inputs: Any) -> int | None:
    """One device's program (``None``), or how many pieces its rows may split into.

    Decided from what the op can see when it is traced, the first of:

    1. ``inputs`` a placed (concrete) ``jax.Array``: on one device, ``None``;
       else how many pieces its sharding cuts its first axis into;
    2. ``inputs`` typed with an explicit mesh's sharding
       (``jax.sharding.AxisType.Explicit``) of several devices: the devices
       along the mesh axes of its first axis (1 where only other axes are
       split, tokens say);
    3. a mesh of several devices set with ``jax.set_mesh`` (or
       ``jax.sharding.use_mesh``): its devices, since any of its axes may
       hold the rows;
    4. none of these (a ``jax.jit`` argument with no mesh in context, or a
       mesh of one device): ``None``. The program is compiled as the arrays
       passed to it place it, which tracing cannot see; a one-device program
       gets the one-device formulation whatever ``jax.device_count()``
       says. A program sharded this way is correct and costs one model per
       device where each device's rows and each member's nest (one holds the
       other); set the mesh for the rest (``docs/scaling_out.md``).

    >>> import jax, jax.numpy as jnp
    >>> row_shards(jnp.ones((4, 3))) is None            # placed on one device
    True
    >>> jax.jit(lambda x: x * (row_shards(x) is None))(1.0)   # nothing says more
    Array(1., dtype=float32, weak_type=True)

    Args:
      inputs: the op's ``[E*B, ...]`` rows, concrete or traced.

    Returns:
      ``None`` for one device's program; else the number of row pieces
      ``D`` (at least 1), for :func:`member_groups`.
    """
    if isinstance(inputs, jax.Array) and not isinstance(inputs, jax.core.Tracer):
        sharding = inputs.sharding
        if len(sharding.device_set) == 1:
            return None
        if not inputs.ndim:
            return 1
        return inputs.shape[0] // sharding.shard_shape(inputs.shape)[0]
    explicit = _explicit_sharding(inputs)
    if explicit is not None and explicit.mesh.size > 1:
        spec = explicit.spec
        axes = spec[0] if len(spec) else None
        if axes is None:
            return 1
        axes = axes if isinstance(axes, tuple) else (axes,)
        return math.prod(explicit.mesh.shape[a] for a in axes)
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh.size


def member_groups(*, num_rows: int, num_members: int, shards: int) -> int:
    """``G``: how many groups of consecutive rows an op views the batch as.

    The least common multiple of ``E`` and ``D`` (``shards``), so that every
    group lies inside a member and every device's rows are whole groups; where
    the rows cannot split evenly into ``D`` pieces, the largest divisor of
    ``D`` that they split into stands for it.

    >>> member_groups(num_rows=1024, num_members=4, shards=8)
    8
    >>> member_groups(num_rows=1024, num_members=8, shards=4)
    8

    Args:
      num_rows: ``E*B``.
      num_members: ``E``.
      shards: ``D``, from :func:`row_shards`.

    Returns:
      ``G``, a multiple of ``E`` dividing ``E*B``.
    """
    for divisor in range(shards, 0, -1):
        if shards % divisor:
            continue
        groups = math.lcm(num_members, divisor)
        if num_rows % groups == 0:
            return groups
    return num_members


def group_weights(weights: jax.Array, groups: int, like: jax.Array) -> jax.Array:
    """Per-member ``[E, ...]`` values repeated to ``[G, ...]``, one per group.

    JAX differentiates it into a sum over each member's groups, so gradients
    come back per member. Under an explicit mesh the result is placed as the
    groups of ``like`` are.

    >>> import jax.numpy as jnp
    >>> group_weights(jnp.arange(2.0)[:, None], 4, jnp.ones((4, 3, 5)))[:, 0]
    Array([0., 0., 1., 1.], dtype=float32)

    Args:
      weights: ``[E, ...]``.
      groups: ``G``, a multiple of ``E``.
      like: the activations they scale, flat (``[E*B, ...]``) or viewed
        (``[G, R, ...]``): where their first axis lies.

    Returns:
      ``[G, ...]``: group ``g`` holds member ``g // (G/E)``'s values.
    """
    num_members = weights.shape[0]
    placed = _group_sharding(like, weights.ndim)
    if groups == num_members and placed is None:
        return weights
    member = lax.broadcasted_iota(jnp.int32, (groups,), 0) // (groups // num_members)
    # A gather by an iota (no index array to move), whose transpose sums each
    # member's groups on the devices holding them before one reduction across
    # devices, combined with the shared kernel's.
    return weights.at[member].get(
        mode="clip", indices_are_sorted=True, out_sharding=placed
    )


def place_as_groups(array: jax.Array, like: jax.Array) -> jax.Array:
    """``array`` (``[G, ...]``) placed as the groups of ``like``: where they lie.

    Only under an explicit mesh, where each value's placement is part of its
    type and a matmul batched over the groups needs both operands' groups on
    the same devices (the shared kernel broadcast to ``[G, in, out]`` would
    otherwise be typed replicated, which jax 0.12 refuses); a resharding of a
    replicated value to a split one is each device's slice, no transfer.
    Elsewhere ``array`` is returned as it is.

    >>> import jax.numpy as jnp
    >>> place_as_groups(jnp.ones((4, 3)), jnp.ones((4, 2, 3))).shape
    (4, 3)

    Args:
      array: ``[G, ...]``.
      like: the ``[G, R, ...]`` (or flat) activations whose groups it pairs with.

    Returns:
      ``array``, resharded under an explicit mesh.
    """
    placed = _group_sharding(like, array.ndim)
    return array if placed is None else jax.sharding.reshard(array, placed)


def _group_sharding(like: Any, ndim: int) -> jax.sharding.NamedSharding | None:
    """Where a ``[G, ...]`` array goes under an explicit mesh: as ``like``'s rows.

    ``None`` elsewhere (the partitioner infers the placement). Under an
    explicit mesh each value's placement is part of its type: a product of
    replicated parameters (a first layer's per-group tangent kernels) would
    be replicated, and JAX's transpose of the matmul with it would gather to
    every device the kernel gradients each device formed for its own groups.
    """
    sharding = _explicit_sharding(like)
    if sharding is None or not len(sharding.spec) or sharding.spec[0] is None:
        return None
    spec = P(sharding.spec[0], *(None,) * (ndim - 1))
    return jax.sharding.NamedSharding(sharding.mesh, spec)
