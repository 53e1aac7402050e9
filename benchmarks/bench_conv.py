"""BatchEnsembleConv vs nnx.Conv on the same [E*B, H, W, C] batch.

pytest-benchmark suite (absolute times, comparable across commits)::

    pytest benchmarks/bench_conv.py --benchmark-only

Interleaved ratio table (what the targets are stated in)::

    python -m benchmarks.bench_conv [--repeats 20] [--impl xla]

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

# (E, B, H, W, in, out, kernel)
SHAPES = [
    (4, 32, 32, 32, 64, 64, 3),
    (4, 16, 16, 16, 128, 128, 3),
]
# "train": the gradient of the parameters only (a first layer, whose inputs need
# none); "forward_backward": of the parameters and the inputs (a hidden layer).
MODES = ("forward", "train", "forward_backward")


def build(method, shape, impl="xla"):
    num_members, _, _, _, in_features, out_features, kernel = shape
    rngs = nnx.Rngs(0)
    if method == "batchensemble":
        return ensembles.BatchEnsembleConv(
            in_features,
            out_features,
            (kernel, kernel),
            num_members=num_members,
            impl=impl,
            rngs=rngs,
        )
    return nnx.Conv(in_features, out_features, (kernel, kernel), rngs=rngs)


def compiled_step(module, mode):
    """A jitted function of (params, x) and the params it takes."""
    graphdef, params = nnx.split(module)

    def forward(params, x):
        return nnx.merge(graphdef, params)(x)

    if mode == "forward":
        return jax.jit(forward), params

    def loss(params, x):
        # A loss that needs the outputs, as a real one does: with jnp.sum(y) XLA
        # could drop nnx.Conv's forward convolution (its gradient ignores y).
        return 0.5 * jnp.sum(jnp.square(forward(params, x)))

    argnums = 0 if mode == "train" else (0, 1)
    return jax.jit(jax.grad(loss, argnums=argnums)), params


def case(method, mode, shape, impl="xla"):
    num_members, batch, height, width, in_features = shape[:5]
    module = build(method, shape, impl)
    step, params = compiled_step(module, mode)
    x = jnp.asarray(
        np.random.default_rng(0).standard_normal(
            (num_members * batch, height, width, in_features)
        ),
        jnp.float32,
    )
    return functools.partial(step, params, x)


def shape_id(shape):
    return "E{}-B{}-{}x{}x{}-{}-k{}".format(*shape)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["conv", "batchensemble"])
def test_conv(benchmark, method, mode, shape):
    fn = case(method, mode, shape)
    jax.block_until_ready(fn())
    benchmark.extra_info.update(
        dict(zip(["E", "B", "H", "W", "in", "out", "k"], shape, strict=True))
    )
    benchmark.pedantic(lambda: jax.block_until_ready(fn()), rounds=10, warmup_rounds=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--impl", default="xla")
    args = parser.parse_args(argv)
    # Before JAX runs anything: no page faults per step (docs/cost.md).
    print(f"malloc keeps freed memory: {reuse_freed_memory()}")
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; "
        f"median of {args.repeats} interleaved rounds; ratio = BE / nnx.Conv"
    )
    print(f"{'shape':>26} {'mode':>17} {'conv ms':>9} {'BE ms':>9} {'ratio':>6}")
    for shape in SHAPES:
        for mode in MODES:
            fns = {
                m: case(m, mode, shape, args.impl) for m in ("conv", "batchensemble")
            }
            times = interleaved_times(fns, args.repeats)
            ratio = paired_ratio(times["batchensemble"], times["conv"])
            print(
                f"{shape_id(shape):>26} {mode:>17} "
                f"{1e3 * median(times['conv']):>9.2f} "
                f"{1e3 * median(times['batchensemble']):>9.2f} {ratio:>6.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
