"""XLA's CPU fusion of elementwise work into a dot: does it help the layers?

XLA's CPU backend fuses no elementwise work into a matmul by default, so a
BatchEnsemble layer's scalings are passes of their own (``docs/cost.md``). An
experimental option of XLA's, the YNNPACK fusion type
``LIBRARY_FUSION_TYPE_ELTWISE`` (process-wide:
``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=+eltwise``; per function:
a jit's ``compiler_options``), compiles the whole forward,
scalings and bias included, into one fusion. This script times
``nnx.Linear`` and ``BatchEnsembleLinear`` each compiled with and without it,
interleaved in one process, at ``bench_dense``'s shapes and modes::

    python -m benchmarks.bench_ynn_fusion [--repeats 10]

Every ratio is over ``nnx.Linear`` compiled without the option.
"""

import argparse

import jax

from benchmarks.bench_dense import MODES, SHAPES, case
from ensembles.benchmark.cost.timing import (
    interleaved_times,
    median,
    reuse_freed_memory,
)

YNN_ELTWISE = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_ELTWISE"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    # Before JAX runs anything: no page faults per step (docs/cost.md).
    print(f"malloc keeps freed memory: {reuse_freed_memory()}")
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; median of "
        f"{args.repeats} interleaved rounds; +ew: compiled with {YNN_ELTWISE}"
    )
    print(
        f"{'E x B x in x out':>18} {'mode':>17} {'linear ms':>10} {'linear+ew':>10} "
        f"{'BE':>6} {'BE+ew':>6}"
    )
    variants = {"": None, "+ew": YNN_ELTWISE}
    for shape in SHAPES:
        for mode in MODES:
            steps = {
                label + name: case(method, mode, shape, compiler_options=options)
                for label, method in (("linear", "linear"), ("BE", "batchensemble"))
                for name, options in variants.items()
            }
            times = {
                k: median(v) for k, v in interleaved_times(steps, args.repeats).items()
            }
            base = times["linear"]
            print(
                f"{'x'.join(map(str, shape)):>18} {mode:>17} {1e3 * base:>10.2f} "
                f"{times['linear+ew'] / base:>10.3f} {times['BE'] / base:>6.3f} "
                f"{times['BE+ew'] / base:>6.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
