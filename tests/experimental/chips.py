"""Chips this machine lacks, as compile targets: meshes of compile-only devices.

``jax.experimental.topologies`` gives devices of a chip without the chip: an
H100 from ``jax-cuda12-plugin`` + ``jax-cuda12-pjrt`` and a GPU target config
(``h100_target_config.txtpb``, beside this file so that a checkout has it), TPUs
from ``libtpu`` (what ``jax[tpu]`` pins). Under ``jax.set_mesh`` over one of
them, ``jax.jit(f).trace(*specs).lower().compile()`` runs the chip's real
compilers (XLA GPU, Triton to an sm_90 binary, Mosaic GPU; XLA TPU, Mosaic
TPU). Nothing may run eagerly under such a mesh: build every model and
argument abstractly. libtpu allows one process at a time.
"""

import functools
import itertools
import os
import pathlib

import jax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ensembles.experimental.pallas import BlockSizes, budget
from ensembles.experimental.pallas.blocks import tiling

H100_CONFIG = pathlib.Path(__file__).with_name("h100_target_config.txtpb")
# The smallest slice of each TPU that libtpu describes (a 1x1 v5e is refused).
TPU_TOPOLOGIES = {
    "v2": "v2:2x2",
    "v3": "v3:2x2",
    "v4": "v4:2x2x1",
    "v5e": "v5e:2x2",
    "v5p": "v5p:2x2x1",
    "v6e": "v6e:2x2",
    "7x": "tpu7x:2x2x1",
}
# `tox -e compile-oldest / compile-newest` set this: a missing compiler then
# fails the tier instead of skipping it.
REQUIRED = os.environ.get("ENSEMBLES_COMPILE_TIER") == "1"


@functools.cache
def _mesh(name):
    from jax.experimental import topologies

    if name == "h100":
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=H100_CONFIG.read_text(), topology="1x1x1"
        )
    else:
        topology = topologies.get_topology_desc(TPU_TOPOLOGIES[name], platform="tpu")
    return Mesh(topology.devices[:1], ("x",))


def mesh(name):
    """A one-device mesh of chip ``name``; skips (fails in the tier) without it."""
    try:
        return _mesh(name)
    except Exception as error:  # a missing plugin or libtpu: any error type
        if REQUIRED:
            raise
        pytest.skip(
            f"no compiler for {name} here ({type(error).__name__}: "
            f"{str(error)[:200]}); the compile tier installs jax-cuda12-plugin, "
            f"jax-cuda12-pjrt and jax[tpu] at jax's version: tox -e compile-oldest"
        )


def lower(name, fn, specs):
    """``fn`` traced and lowered for chip ``name`` at ``specs`` (shape/dtype)."""
    target_mesh = mesh(name)
    replicated = NamedSharding(target_mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated) for s in specs]
    with jax.set_mesh(target_mesh):
        return jax.jit(fn).trace(*args).lower()


def target(name):
    """The library's view of chip ``name`` (what it checks tiles against)."""
    with jax.set_mesh(mesh(name)):
        return budget.target()


def family_of(name):
    return "gpu" if name == "h100" else "tpu"


def largest_block_sizes(family, dtype, where, largest=4096):
    """The largest tiles ``check_tiles`` accepts: most volume, then area, rows.

    On a problem larger than any tile, so that no block shrinks to it.
    """
    sizes = [1 << p for p in range(4, largest.bit_length())]
    best, best_key = None, None
    for b, o, k in itertools.product(sizes, repeat=3):
        blocks = BlockSizes(b, o, k)
        t = tiling(
            family, rows=largest, in_features=largest, out_features=largest,
            blocks=blocks,
        )  # fmt: skip
        try:
            budget.check_tiles(family, t, blocks, dtype, dtype, where)
        except ValueError:
            continue
        key = (b * o * k, b * o, b)
        if best_key is None or key > best_key:
            best, best_key = blocks, key
    return best
