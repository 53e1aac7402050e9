"""One eager layer call runs a handful of library functions (issue 43).

Counted with ``benchmarks/call_path.py`` (``sys.setprofile``): the Python
calls into ``src/ensembles`` of one eager ``BatchEnsembleLinear`` call, and
the library frames between ``__call__`` and ``lax.dot_general``.
"""

import jax.numpy as jnp
from benchmarks.call_path import trace_call
from flax import nnx

import ensembles


def test_one_eager_linear_call_is_a_few_library_calls():
    layer = ensembles.BatchEnsembleLinear(64, 32, num_members=4, rngs=nnx.Rngs(0))
    x = jnp.ones((16, 64))
    layer(x)  # JAX's own caches
    calls, frames = trace_call(layer, x)
    # 12 before the platform chose the formulation (ops/platform.py): one call
    # more, and its branch, on the way to the CPU's formula.
    assert len(calls) <= 13, calls
    assert frames == [
        "__call__",
        "dense_rows",
        "by_platform",
        "<lambda>",
        "_scaled_matmul",
    ], frames
    # No cost model, no primitive, no re-check of a constructor's option.
    for name in ("choose", "estimate", "check_num_members", "check_choice"):
        assert not any(name in call for call in calls), calls
