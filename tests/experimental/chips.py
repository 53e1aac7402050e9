"""Chips this machine lacks, as compile targets, for the compile tier's tests.

:mod:`ensembles.benchmark.cost.compiled.chips` gives meshes of compile-only
devices (an H100 from ``jax-cuda12-plugin`` + ``jax-cuda12-pjrt``, TPUs from
``libtpu``); here a missing compiler skips a test, or fails it in the compile
tier (``tox -e compile-oldest / compile-newest`` set
``ENSEMBLES_COMPILE_TIER=1``). Nothing may run eagerly under such a mesh:
build every model and argument abstractly. libtpu allows one process at a
time.
"""

import itertools
import os

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ensembles.benchmark.cost.compiled.chips import TPU_TOPOLOGIES, chip_mesh
from ensembles.experimental.pallas import BlockSizes, budget
from ensembles.experimental.pallas.blocks import tiling

__all__ = [
    "TPU_TOPOLOGIES",
    "family_of",
    "largest_block_sizes",
    "lower",
    "mesh",
    "target",
]
# `tox -e compile-oldest / compile-newest` set this: a missing compiler then
# fails the tier instead of skipping it.
REQUIRED = os.environ.get("ENSEMBLES_COMPILE_TIER") == "1"


def mesh(name):
    """A one-device mesh of chip ``name``; skips (fails in the tier) without it."""
    try:
        return chip_mesh(name)
    except RuntimeError as error:
        if REQUIRED:
            raise
        pytest.skip(
            f"{error} (the compile tier installs jax-cuda12-plugin, "
            f"jax-cuda12-pjrt and jax[tpu] at jax's version: tox -e compile-oldest)"
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
