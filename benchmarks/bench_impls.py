"""Every impl of the dense op against a plain dense layer and a deep ensemble.

For the shapes of the first GPU run (``shared/notes/gpu.md``), times the
forward pass and the gradient (of ``0.5 * sum(y**2)`` with respect to every
input) of ``batch_ensemble_dense`` with each ``impl``, and prints each as a
ratio to a plain dense layer on the same ``[E*B, in]`` rows (``x @ W + b``:
the same matmuls, the limit) and to a deep ensemble (E kernels in one batched
einsum). Medians of per-round ratios over interleaved rounds in one process:
compare ratios, not milliseconds, across machines. On CPU the Pallas kernel
only interprets, so it is not timed there. On a Hopper GPU in bfloat16 it also
times ``hopper``, the Mosaic GPU forward kernel (``fused_dense(...,
family="hopper")``; its gradient is the jnp formulation's), which no ``impl``
runs until these figures say it should. These figures decide whether a kernel
family may ever become a default (today every default is ``"xla"``; the
kernels are opt-in through ``impl="pallas"``)::

    python -m benchmarks.bench_impls [--dtype bfloat16] [--repeats 20] [--json out.json]
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from ensembles.benchmark.cost.timing import (
    interleaved_times,
    median,
    paired_ratio,
    reuse_freed_memory,
)
from ensembles.experimental.pallas import fused_dense, mosaic_gpu
from ensembles.ops import batch_ensemble_dense

# (E, B, in, out): shared/notes/gpu.md's speed table.
SHAPES = [
    (4, 256, 1024, 1024),
    (8, 512, 256, 256),
    (4, 32, 4096, 4096),
    (16, 64, 512, 512),
    (4, 1024, 4096, 4096),
    (8, 2048, 1024, 4096),
    (4, 128, 768, 3072),
    (16, 1024, 2048, 2048),
]
MODES = ("forward", "gradient")


def operands(shape, dtype, seed=0):
    num_members, batch, fan_in, fan_out = shape
    rng = np.random.default_rng(seed)

    def draw(shape, mean=0.0, scale=1.0):
        return jnp.asarray(mean + scale * rng.standard_normal(shape), dtype)

    return (
        draw((num_members * batch, fan_in)),
        draw((fan_in, fan_out), scale=fan_in**-0.5),
        draw((num_members, fan_in), 1.0, 0.5),
        draw((num_members, fan_out), 1.0, 0.5),
        draw((num_members, fan_out), scale=0.1),
    )


def methods(shape, impls):
    """name -> f(x, kernel, r, s, bias) computing ``[E*B, out]``."""
    num_members = shape[0]

    def linear(x, kernel, r, s, bias):
        return x @ kernel + bias[:1]

    def deep(x, kernel, r, s, bias):
        # E independent kernels (the member kernels, as a deep ensemble holds).
        kernels = kernel[None] * r[:, :, None] * s[:, None, :]
        xs = x.reshape(num_members, -1, x.shape[-1])
        y = jnp.einsum("ebi,eio->ebo", xs, kernels) + bias[:, None, :]
        return y.reshape(x.shape[0], -1)

    def hopper(x, kernel, r, s, bias):
        return fused_dense(x, kernel, r, s, bias, family="hopper")

    found = {"linear": linear, "deep": deep}
    for impl in impls:
        found[impl] = lambda *a, impl=impl: batch_ensemble_dense(
            *a, num_members=num_members, impl=impl
        )
    if "hopper" in impls:
        found["hopper"] = hopper
    return found


def step(fn, mode):
    if mode == "forward":
        return jax.jit(fn)

    def loss(*args):
        return 0.5 * jnp.sum(jnp.square(fn(*args).astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def measure(shape, dtype, impls, repeats):
    args = operands(shape, dtype)
    rows = []
    for mode in MODES:
        steps = {name: step(fn, mode) for name, fn in methods(shape, impls).items()}
        fns = {name: (lambda f=f: f(*args)) for name, f in steps.items()}
        times = interleaved_times(fns, repeats)
        for name in impls:
            rows.append(
                {
                    "shape": list(shape),
                    "dtype": jnp.dtype(dtype).name,
                    "mode": mode,
                    "impl": name,
                    "linear_ms": 1e3 * median(times["linear"]),
                    "vs_linear": paired_ratio(times[name], times["linear"]),
                    "vs_deep": paired_ratio(times[name], times["deep"]),
                }
            )
    return rows


def parse_shape(text):
    return tuple(int(v) for v in text.split(","))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dtype", default=None, help="default: bfloat16, float32 on CPU"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--shapes",
        type=parse_shape,
        nargs="*",
        default=SHAPES,
        help="E,B,in,out ... (default: the gpu.md table)",
    )
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    # Before JAX runs anything: no page faults per step (docs/cost.md).
    print(f"malloc keeps freed memory: {reuse_freed_memory()}")
    backend = jax.default_backend()
    dtype = jnp.dtype(args.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    impls = ["xla"] + ([] if backend == "cpu" else ["pallas"])
    if dtype in mosaic_gpu.SUPPORTED_DTYPES and mosaic_gpu.is_hopper(jax.devices()[0]):
        impls.append("hopper")
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({backend}), "
        f"{dtype.name}; medians of {args.repeats} interleaved rounds; "
        f"time / linear and time / deep ensemble"
        + ("; pallas not timed: it only interprets on CPU" if backend == "cpu" else "")
    )
    print(
        f"{'E':>3} {'B':>5} {'in':>5} {'out':>5} {'mode':>8} {'linear ms':>9} "
        + " ".join(f"{impl + ' /lin':>11} {impl + ' /deep':>12}" for impl in impls)
    )
    all_rows = []
    for shape in args.shapes:
        rows = measure(shape, dtype, impls, args.repeats)
        all_rows += rows
        for mode in MODES:
            mine = [row for row in rows if row["mode"] == mode]
            cells = " ".join(
                f"{row['vs_linear']:>11.2f} {row['vs_deep']:>12.2f}" for row in mine
            )
            print(
                f"{shape[0]:>3} {shape[1]:>5} {shape[2]:>5} {shape[3]:>5} "
                f"{mode:>8} {mine[0]['linear_ms']:>9.3f} {cells}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)
    return all_rows


if __name__ == "__main__":
    main()
