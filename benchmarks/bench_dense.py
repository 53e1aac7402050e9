"""BatchEnsembleLinear vs nnx.Linear on the same [E*B, in] batch.

pytest-benchmark suite (absolute times, comparable across commits)::

    pytest benchmarks/bench_dense.py --benchmark-only

Interleaved ratio table (what the targets are stated in)::

    python -m benchmarks.bench_dense [--repeats 30] [--impl xla]

Modules are passed to the jitted function as state, never closed over, so the
parameters are real inputs of the computation as in training.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from ensembles.benchmark.cost.timing import (
    interleaved_times,
    median,
    paired_ratio,
    reuse_freed_memory,
)

# (E, B, in, out)
SHAPES = [
    (4, 256, 1024, 1024),
    (8, 512, 256, 256),
    (4, 32, 4096, 4096),
    (16, 64, 512, 512),
]
# "train": the gradient of the parameters only (a first layer, whose inputs need
# none); "forward_backward": of the parameters and the inputs (a hidden layer).
MODES = ("forward", "train", "forward_backward")


def build(method, num_members, in_features, out_features, impl="xla"):
    rngs = nnx.Rngs(0)
    if method == "batchensemble":
        return ensembles.BatchEnsembleLinear(
            in_features, out_features, num_members=num_members, impl=impl, rngs=rngs
        )
    return nnx.Linear(in_features, out_features, rngs=rngs)


def compiled_step(module, mode, compiler_options=None):
    """A jitted function of (params, x) and the params it takes."""
    graphdef, params = nnx.split(module)
    jit = functools.partial(jax.jit, compiler_options=compiler_options)

    def forward(params, x):
        return nnx.merge(graphdef, params)(x)

    if mode == "forward":
        return jit(forward), params

    def loss(params, x):
        # A loss that needs the outputs, as a real one does: with jnp.sum(y) XLA
        # would drop nn.Linear's forward matmul (its gradient ignores y).
        return 0.5 * jnp.sum(jnp.square(forward(params, x)))

    argnums = 0 if mode == "train" else (0, 1)
    return jit(jax.grad(loss, argnums=argnums)), params


def case(method, mode, shape, impl="xla", compiler_options=None):
    num_members, batch, in_features, out_features = shape
    module = build(method, num_members, in_features, out_features, impl)
    step, params = compiled_step(module, mode, compiler_options)
    x = jnp.asarray(
        np.random.default_rng(0).standard_normal((num_members * batch, in_features)),
        jnp.float32,
    )
    return functools.partial(step, params, x)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-B{}-{}x{}".format(*s))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["linear", "batchensemble"])
def test_dense(benchmark, method, mode, shape):
    fn = case(method, mode, shape)
    jax.block_until_ready(fn())
    benchmark.extra_info.update(
        {"E": shape[0], "B": shape[1], "in": shape[2], "out": shape[3]}
    )
    benchmark.pedantic(lambda: jax.block_until_ready(fn()), rounds=20, warmup_rounds=2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--impl", default="xla")
    args = parser.parse_args(argv)
    # Before JAX runs anything: no page faults per step (docs/cost.md).
    print(f"malloc keeps freed memory: {reuse_freed_memory()}")
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; "
        f"median of {args.repeats} interleaved rounds; ratio = BE / nnx.Linear"
    )
    print(
        f"{'E':>3} {'B':>5} {'in':>5} {'out':>5} {'mode':>17} "
        f"{'linear ms':>10} {'BE ms':>8} {'ratio':>6}"
    )
    for shape in SHAPES:
        for mode in MODES:
            fns = {
                m: case(m, mode, shape, args.impl) for m in ("linear", "batchensemble")
            }
            times = interleaved_times(fns, args.repeats)
            ratio = paired_ratio(times["batchensemble"], times["linear"])
            print(
                f"{shape[0]:>3} {shape[1]:>5} {shape[2]:>5} {shape[3]:>5} "
                f"{mode:>17} {1e3 * median(times['linear']):>10.2f} "
                f"{1e3 * median(times['batchensemble']):>8.2f} {ratio:>6.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
