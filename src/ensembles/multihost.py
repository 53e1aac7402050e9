"""Several processes, one model: the rows a process loads, results read back.

Under JAX's multi-controller runtime (:func:`jax.distributed.initialize`: TPU
pods, multi-GPU nodes, SLURM) every process runs the same program on the
devices of all of them, and each process holds, loads and reads only what its
own devices hold. Three mistakes run without an error there:

- a batch passed to a jitted step as a host (numpy) array is read by JAX as
  the same replicated batch on every process; when each process passes its
  own rows, the "replicated" parameters silently differ between processes,
  each trained on its own rows (:func:`check_replicas` finds it;
  :func:`global_batch` avoids it);
- a mesh built from one process's devices (``jax.devices()[:n]``) runs every
  step on that process alone; the others fail only when they read a result
  (:func:`process_rows` and :func:`global_batch` refuse such a sharding);
- ``np.asarray`` of an array that spans other processes' devices raises;
  :func:`to_host` reads any array or tree back whole, on every process;
- processes that build different parameters (a different seed per process,
  ``nnx.Rngs(jax.process_index())``) place them with ``jax.device_put``
  without a word, each process's values on its own devices:
  :func:`place_state` places them and checks first that every process built
  the same (:func:`check_replicas` finds it later).

Every function also works in a single process, where it is the trivial
case, so the same training script runs on one machine and on many
(``docs/scaling_out.md``).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from ensembles._checks import check_positive_int

__all__ = [
    "check_replicas",
    "global_batch",
    "local_mesh",
    "place_state",
    "process_rows",
    "to_host",
]


@contextlib.contextmanager
def local_mesh() -> Iterator[jax.sharding.Mesh]:
    """A one-device mesh of this process's first device, set for the block.

    For purely local work in a run of several processes (or on a host of
    several devices): a benchmark, an evaluation of one member on one
    device. Arrays made in the block live on that device, and the ops,
    which read the mesh in context (:func:`ensembles.ops.groups.row_shards`),
    trace one device's program, as they do with no mesh at all; the block
    keeps a mesh of several set around it from reaching local work.

    >>> import jax, jax.numpy as jnp
    >>> from ensembles.multihost import local_mesh
    >>> from ensembles.ops.groups import row_shards
    >>> with local_mesh() as mesh:
    ...     print(mesh.size, row_shards(jnp.ones(3)))
    1 None

    Yields:
      The mesh, of axis ``"local"``.
    """
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("local",))
    with jax.set_mesh(mesh):
        yield mesh


def _row_sharding(sharding: Any, name: str) -> NamedSharding:
    """``sharding``'s placement of a leading row axis, checked.

    Raises:
      TypeError: if ``sharding`` is not a ``NamedSharding``.
      ValueError: if its devices are not those of every process.
    """
    if not isinstance(sharding, NamedSharding):
        raise TypeError(
            f"`{name}` must be a jax.sharding.NamedSharding (a mesh and a "
            f"PartitionSpec of the rows, e.g. NamedSharding(mesh, P('data'))), got "
            f"{type(sharding).__name__}."
        )
    _check_every_process(sharding.device_set, f"`{name}`'s mesh")
    rows = sharding.spec[0] if len(sharding.spec) else None
    return NamedSharding(sharding.mesh, PartitionSpec(rows))


def _check_every_process(devices: Any, what: str) -> None:
    """Raises unless ``devices`` include devices of every process."""
    held = sorted({device.process_index for device in devices})
    if len(held) != jax.process_count():
        raise ValueError(
            f"{what} holds the devices of process(es) {held} only, of "
            f"{jax.process_count()}: every step would run on them alone and the "
            f"other processes fail only when they read a result. Build the mesh "
            f"from every process's devices, e.g. jax.make_mesh((jax.device_count(),"
            f"), ('data',), devices=jax.devices()), not jax.devices()[:"
            f"jax.local_device_count()]."
        )


def process_rows(sharding: NamedSharding, num_rows: int) -> np.ndarray:
    """The rows of a global batch that this process's devices hold.

    Read from ``sharding`` itself, not from an assumed order of the
    processes: a process loads exactly these rows of the member-major
    ``[E*B, ...]`` batch (row ``i`` is example ``i % B`` seen by member
    ``i // B``) and passes them to :func:`global_batch`.

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> import ensembles
    >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> ensembles.multihost.process_rows(NamedSharding(mesh, P("data")), 6)
    array([0, 1, 2, 3, 4, 5])

    Args:
      sharding: the batch's ``NamedSharding``; its spec's first entry places
        the rows (``P("data")``: rows over the ``data`` axis).
      num_rows: the global number of rows, ``E*B``.

    Returns:
      The global row indices, sorted, as an int array.

    Raises:
      TypeError: if ``sharding`` is not a ``NamedSharding``.
      ValueError: if its mesh leaves out some process's devices, or
        ``num_rows`` is not a positive int.
    """
    rows = _row_sharding(sharding, "sharding")
    num_rows = check_positive_int(num_rows, "num_rows")
    held = set()
    for index in rows.addressable_devices_indices_map((num_rows,)).values():
        held.update(range(num_rows)[index[0]])
    return np.array(sorted(held), dtype=np.int64)


def global_batch(sharding: NamedSharding, local_rows: Any, *, num_rows: int) -> Any:
    """The global batch, built from the rows this process loaded.

    Every process calls it with the rows :func:`process_rows` gave it, in
    that order; each leaf of ``local_rows`` becomes a ``jax.Array`` of
    ``num_rows`` rows placed as ``sharding`` says. This is the safe way to
    feed a jitted step under several processes: a host (numpy) array passed
    directly is read as the same replicated batch everywhere.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> import ensembles
    >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> rows = NamedSharding(mesh, P("data"))
    >>> mine = ensembles.multihost.process_rows(rows, 4)
    >>> x, y = ensembles.multihost.global_batch(
    ...     rows, (np.ones((len(mine), 3)), np.arange(len(mine))), num_rows=4)
    >>> x.shape, y.shape, x.sharding == rows
    ((4, 3), (4,), True)

    Args:
      sharding: the batch's ``NamedSharding`` (as for :func:`process_rows`);
        a leaf with fewer axes than its spec is placed by its rows alone.
      local_rows: an array or a pytree of arrays, each of this process's
        rows ``[len(process_rows(...)), ...]``.
      num_rows: the global number of rows, ``E*B``.

    Returns:
      ``local_rows``'s structure, each leaf a global ``[num_rows, ...]``
      array.

    Raises:
      TypeError: if ``sharding`` is not a ``NamedSharding``.
      ValueError: if its mesh leaves out some process's devices, or a leaf
        does not hold this process's rows.
    """
    rows = _row_sharding(sharding, "sharding")
    mine = process_rows(sharding, num_rows)

    def place(path, leaf):
        host = np.asarray(leaf)
        if host.ndim == 0 or host.shape[0] != len(mine):
            where = jax.tree_util.keystr(path) or "local_rows"
            raise ValueError(
                f"`{where}` must hold this process's {len(mine)} rows of "
                f"{num_rows} (ensembles.multihost.process_rows), got shape "
                f"{host.shape}. Load exactly the rows process_rows returns."
            )
        placed = sharding if len(sharding.spec) <= host.ndim else rows
        return jax.make_array_from_callback(
            (num_rows, *host.shape[1:]),
            placed,
            lambda index: host[np.searchsorted(mine, np.arange(num_rows)[index[0]])][
                (slice(None), *index[1:])
            ],
        )

    return jax.tree_util.tree_map_with_path(place, local_rows)


def to_host(tree: Any) -> Any:
    """Every array of ``tree`` as one numpy array, whole, on every process.

    ``np.asarray`` of an array spanning other processes' devices raises (a
    member-sharded parameter, row-sharded outputs); this gathers it. Every
    process must call it with the same tree (a gather is a collective).

    >>> import jax.numpy as jnp
    >>> import ensembles
    >>> ensembles.multihost.to_host({"w": jnp.ones(2)})
    {'w': array([1., 1.], dtype=float32)}

    Args:
      tree: a pytree (an ``nnx.State``, a dict, an array).

    Returns:
      ``tree`` with every leaf a numpy array.
    """

    def read(leaf):
        if isinstance(leaf, jax.Array) and not (
            leaf.is_fully_addressable or leaf.sharding.is_fully_replicated
        ):
            # The gather runs on the array's own mesh, whatever mesh is set.
            mesh = getattr(leaf.sharding, "mesh", None)
            with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
                gathered = multihost_utils.process_allgather(leaf, tiled=True)
            return np.asarray(gathered)
        return np.asarray(leaf)

    return jax.tree.map(read, tree)


def place_state(state: Any, mesh: jax.sharding.Mesh) -> Any:
    """A model's state placed on ``mesh`` as annotated, once every process agrees.

    ``jax.device_put`` of a state built in each process takes each
    process's own values for its own devices: processes that built
    different ones (a different seed per process, a checkpoint read from
    different files) start with replicas that differ, and train apart from
    the first step without a word. This checks that every process holds the
    same values (:func:`check_replicas`: a digest per array and one small
    gather), then places every array as ``nnx.get_partition_spec`` reads
    its annotations (``to_batch_ensemble(..., member_axis=...)``'s, the
    model's own; none: replicated). Every process must call it with the
    same tree.

    >>> import jax
    >>> from flax import nnx
    >>> import ensembles
    >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> model = ensembles.to_batch_ensemble(nnx.Linear(3, 2, rngs=nnx.Rngs(0)),
    ...                                     num_members=2, rngs=nnx.Rngs(1),
    ...                                     member_axis="data")
    >>> graphdef, params = nnx.split(model, nnx.Param)
    >>> params = ensembles.multihost.place_state(params, mesh)
    >>> [tuple(params[name][...].sharding.spec) for name in ("r", "kernel")]
    [('data', None), ()]

    Args:
      state: an ``nnx.State`` (``nnx.split(model, nnx.Param)[1]``, or the
        whole state).
      mesh: the mesh of every process's devices.

    Returns:
      ``state`` with every array placed on ``mesh``.

    Raises:
      TypeError: if ``mesh`` is not a ``jax.sharding.Mesh``.
      ValueError: if the processes' values differ (naming the first array
        and both causes), or ``mesh`` leaves out some process's devices.
    """
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh of every process's devices, got "
            f"{type(mesh).__name__}: e.g. jax.make_mesh((jax.device_count(),), "
            f"('data',), devices=jax.devices())."
        )
    check_replicas(state, name="state")
    _check_every_process(mesh.devices.flat, "`mesh`")
    specs = nnx.get_partition_spec(state)
    return jax.device_put(
        state, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    )


def _blocks(leaf: Any) -> tuple[list, dict]:
    """A leaf's blocks (every process's) and the digests of this process's."""
    if not isinstance(leaf, jax.Array):  # a host value: one block per process
        return [()], {(): zlib.crc32(np.ascontiguousarray(leaf).tobytes())}

    def block_of(index):  # (start, stop) per axis
        return tuple(
            part.indices(n)[:2] for part, n in zip(index, leaf.shape, strict=True)
        )

    every = leaf.sharding.devices_indices_map(leaf.shape).values()
    blocks = sorted({block_of(index) for index in every})
    digests = {}
    for shard in leaf.addressable_shards:
        block = block_of(shard.index)
        digest = zlib.crc32(np.ascontiguousarray(shard.data).tobytes())
        if digests.setdefault(block, digest) != digest:
            digests[block] = -1  # two local replicas differ
    return blocks, digests


def check_replicas(tree: Any, *, name: str = "tree") -> None:
    """Raises if the copies of any value of ``tree`` differ between processes.

    A replicated parameter lives on every device; its copies stay bit-equal
    as long as every process ran the same step on the same global batch. If
    each process passed its own rows as a host array (read by JAX as the
    same replicated batch everywhere), each trained its own copy and
    nothing else says so. A training loop calls this every few hundred
    steps (a digest per array block and one small gather; every process must
    call it with the same tree); arrays sharded across processes compare
    each block's copies, host arrays compare as a whole. In one process it
    compares a device's copies with each other.

    >>> import jax.numpy as jnp
    >>> import ensembles
    >>> ensembles.multihost.check_replicas({"w": jnp.ones(3)})  # one process

    Args:
      tree: a pytree of arrays (an ``nnx.State``, parameters, an optimizer
        state).
      name: what ``tree`` is, for the error.

    Raises:
      ValueError: naming the first array whose copies differ, and the fix.
    """
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    found = [_blocks(leaf) for _, leaf in leaves]
    # Each digest as two 16-bit halves: exact in float32, which the gather
    # keeps without x64; -1 marks a block this process does not hold.
    table = np.full((sum(len(blocks) for blocks, _ in found), 2), -1.0, np.float32)
    row = 0
    for blocks, digests in found:
        for block in blocks:
            digest = digests.get(block)
            if digest is not None:
                table[row] = [digest >> 16, digest & 0xFFFF] if digest >= 0 else -2
            row += 1
    every = table[None]
    if jax.process_count() > 1 and len(table):
        every = np.asarray(multihost_utils.process_allgather(table))
    row = 0
    for (path, _), (blocks, _) in zip(leaves, found, strict=True):
        for block in blocks:
            held = [tuple(copy) for copy in every[:, row] if copy[0] != -1]
            if len(set(held)) > 1 or (-2.0, -2.0) in held:
                where = jax.tree_util.keystr(path) or name
                raise ValueError(
                    f"`{name}`'s copies differ between processes (or devices) at "
                    f"{where} (block {list(block)}): each process holds its own. "
                    f"Two mistakes do this silently. (1) The processes built "
                    f"different values: a different seed per process (e.g. "
                    f"nnx.Rngs(jax.process_index())) or a model loaded "
                    f"differently; build it with the same seed everywhere, and "
                    f"place it with ensembles.multihost.place_state, which "
                    f"checks this before the first step. (2) A batch passed to a "
                    f"jitted step as a host (numpy) array is read as the same "
                    f"replicated batch on every process, so processes that pass "
                    f"their own rows train apart; build the global batch with "
                    f"ensembles.multihost.global_batch (or "
                    f"jax.make_array_from_process_local_data)."
                )
            row += 1
