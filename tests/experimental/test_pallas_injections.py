"""Bugs injected into a copy of a kernel fail the simulator tests.

Each case copies a kernel family's module, changes a line or two (the bug),
swaps the copy in for the family and runs ``test_pallas_simulator.py``'s check
(its forward half: the output in Pallas' TPU simulator against the float64
per-member loop; every bug is in a forward kernel) on a shape ragged on every
axis. The check must fail, by an
error of the simulator (an out-of-bounds read, a revisited block) or by a
wrong or NaN result; the unchanged copy must pass. The bugs are the kinds that
once went wrong on a GPU or that the generic interpreter lets through
(``shared/notes/accelerators.md``).
"""

import inspect
import re
import types

import jax.numpy as jnp
import pytest

from ensembles.experimental.pallas import BlockSizes, fused, mosaic_tpu, triton
from tests.experimental.test_pallas_simulator import check_in_simulator

# Several blocks along every axis, the last one partial before padding (TPU
# feature blocks are at least 128 wide).
CASES = {
    "gpu": (2, 20, (), 40, 37, jnp.float32, True, BlockSizes(16, 16, 16)),
    "tpu": (2, 20, (), 200, 150, jnp.float32, True, BlockSizes(16, 128, 128)),
}
MODULES = {"gpu": triton, "tpu": mosaic_tpu}

# The kernels see partial edge blocks: no padding, grids rounded up, specs
# unchecked (the library's exact_block_spec would refuse them first).
_UNPADDED = (
    "from ensembles.experimental.pallas.blocks import Tiling, exact_block_spec, "
    "num_blocks\n",
    "from ensembles.experimental.pallas.blocks import Tiling\n"
    "def exact_block_spec(shape, block, index_map):\n"
    "    return pl.BlockSpec(tuple(block), index_map)\n"
    "def num_blocks(dim, block):\n"
    "    return -(-dim // block)\n",
)

# {family: {bug: [(text in the module, what it becomes)]}}
BUGS = {
    "gpu": {
        "partial-edge-blocks": [_UNPADDED],
        "member-dropped-from-index-map": [
            (
                "(None, bm, bn), lambda e, i, j: (e, i, j)\n        ),\n"
                '        name="batch_ensemble_dense_fwd"',
                "(None, bm, bn), lambda e, i, j: (0, i, j)\n        ),\n"
                '        name="batch_ensemble_dense_fwd"',
            )
        ],
        "accumulator-not-zeroed": [
            (
                "acc = jnp.zeros((blocks.block_m, blocks.block_n), jnp.float32)\n"
                "    y = lax.fori_loop",
                "acc = o_ref[...].astype(jnp.float32)\n    y = lax.fori_loop",
            )
        ],
        "read-one-block-past-the-edge": [
            (
                "y = lax.fori_loop(0, steps, step, acc)",
                "y = lax.fori_loop(0, steps + 1, step, acc)",
            )
        ],
        "times-r-dropped": [
            (
                "scaled = x_ref[:, window] * r_ref[:, window]",
                "scaled = x_ref[:, window]",
            )
        ],
    },
    "tpu": {
        "partial-edge-blocks": [_UNPADDED],
        "member-dropped-from-index-map": [
            (
                "out_shape, (None, bm, bn), lambda e, i, j, k: (e, i, j)",
                "out_shape, (None, bm, bn), lambda e, i, j, k: (0, i, j)",
            )
        ],
        "accumulator-not-zeroed": [
            (
                "        acc_ref[...] = jnp.zeros_like(acc_ref)\n\n"
                "    acc_ref[...] += dot(x_ref[...] * r_ref[...]",
                "        pass\n\n    acc_ref[...] += dot(x_ref[...] * r_ref[...]",
            )
        ],
        "read-one-block-past-the-edge": [
            (
                "exact_block_spec(x3.shape, (None, bm, bk), "
                "lambda e, i, j, k: (e, i, k)),",
                "exact_block_spec(x3.shape, (None, bm, bk), "
                "lambda e, i, j, k: (e, i, k + 1)),",
            )
        ],
        "times-r-dropped": [
            (
                "dot(x_ref[...] * r_ref[...], w_ref[...]",
                "dot(x_ref[...], w_ref[...]",
            )
        ],
    },
}


def injected(module, edits):
    """A copy of ``module`` with each ``(old, new)`` of ``edits`` applied once."""
    source = inspect.getsource(module)
    for old, new in edits:
        assert source.count(old) == 1, f"the kernel changed; update the bug: {old!r}"
        source = source.replace(old, new)
    copy = types.ModuleType(f"{module.__name__}_injected")
    exec(compile(source, f"<{copy.__name__}>", "exec"), copy.__dict__)
    return copy


def run_copy(monkeypatch, family, edits, unpadded=False):
    monkeypatch.setitem(fused._FAMILIES, family, injected(MODULES[family], edits))
    if unpadded:
        monkeypatch.setattr(fused, "pad_to", lambda array, shape: array)
    # The bugs are in the forward kernels: the forward half of the check.
    check_in_simulator(family, CASES[family], gradients=False)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpu", "tpu"])
def test_an_unchanged_copy_passes(monkeypatch, family):
    run_copy(monkeypatch, family, [])


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, bug",
    [(family, bug) for family, bugs in BUGS.items() for bug in bugs],
)
def test_an_injected_bug_fails_in_the_simulator(monkeypatch, family, bug):
    with pytest.raises(Exception) as caught:  # any failure counts
        run_copy(
            monkeypatch,
            family,
            BUGS[family][bug],
            unpadded=bug == "partial-edge-blocks",
        )
    # Printed with -s: what caught it. The simulator's own errors arrive
    # wrapped in a runtime error carrying the callback's traceback.
    *_, cause = re.findall(r"^(\w*Error: .*)$", str(caught.value), re.M) or [""]
    print(f"{family} {bug}: {type(caught.value).__name__}: {cause or caught.value}")
