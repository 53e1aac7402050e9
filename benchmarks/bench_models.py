"""The ensemble methods of ``ensembles-bench`` on small models, for pytest-benchmark.

Absolute times per (model, method, mode), comparable across commits::

    pytest benchmarks/bench_models.py --benchmark-only

Builds every case with ``ensembles.benchmark.prepare_method``, the code behind
``ensembles-bench``: the same models, jitted steps and inputs, at sizes small
enough for a CI runner (E=4, B=32 per member).
"""

import jax
import pytest

from ensembles.benchmark import METHODS, MODES, prepare_method

NUM_MEMBERS = 4
BATCH = 32
# Small but not trivial: the matmuls still dominate the dispatch overhead.
WIDTHS = {"linear": 256, "mlp": 256, "cnn": 8}
IMAGE_SIZE = 16


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model", list(WIDTHS))
def test_model(benchmark, model, method, mode):
    prepared = prepare_method(
        method,
        model,
        mode,
        num_members=NUM_MEMBERS,
        batch=BATCH,
        width=WIDTHS[model],
        image_size=IMAGE_SIZE,
    )
    for _ in range(2):
        jax.block_until_ready(prepared.step())
    benchmark.extra_info.update(
        {
            "E": NUM_MEMBERS,
            "B": BATCH,
            "width": WIDTHS[model],
            "params": prepared.num_params,
            "temp_bytes": prepared.memory.temp_bytes,
        }
    )
    benchmark.pedantic(
        lambda: jax.block_until_ready(prepared.step()), rounds=20, warmup_rounds=1
    )
