"""What the recipe for shift costs a train step: an independent output layer.

The recipe ``docs/training.md`` recommends under shift trains the quality
benchmark's models with the output layer an ``EnsembleLinear`` (a kernel per
member) and each member drawing its own batches. Member batches change which
rows a step sees, not how many; the independent head changes the program.
This times one train step (softmax cross-entropy, AdamW) of the library's
default conversion and of the same with an independent head, interleaved on
this CPU (median of ``--rounds``), and reads both programs compiled for the
CPU, an H100 and a TPU v5e (deviceless: the compile tier's compilers) for
their flops, HBM bytes and kernels::

    python benchmarks/independent_head_cost.py --rounds 200
    python benchmarks/independent_head_cost.py --rounds 0 --chips v5e --classes 128

Prints one table row per model and chip: default / independent head, and
for each compiled program the bytes of its copy kernels (XLA's layout
changes). ``--rounds 0`` skips the CPU timing.
"""

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ensembles
from ensembles.benchmark import build_quality_model, interleaved_times
from ensembles.benchmark.cost.compiled.programs import program_cost
from ensembles.benchmark.quality.training import independent_head_options

E, B, FEATURES, CLASSES = 4, 100, 40, 10  # the quality benchmark's MNIST-1D


def _models(name, classes):
    """{"default": model, "independent head": model}, the same plain start."""
    plain = build_quality_model(
        name, input_shape=(FEATURES,), num_classes=classes, rngs=nnx.Rngs(0)
    )
    return {
        "default": ensembles.to_batch_ensemble(plain, num_members=E, rngs=nnx.Rngs(1)),
        "independent head": ensembles.to_batch_ensemble(
            plain,
            num_members=E,
            rngs=nnx.Rngs(1),
            **independent_head_options(plain),
        ),
    }


def _step(graphdef, tx):
    def step(params, opt_state, x, y):
        def loss_fn(params):
            logits = nnx.merge(graphdef, params)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _prepared(model, classes):
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(1e-3)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((E * B, FEATURES)), jnp.float32)
    y = jnp.asarray(rng.integers(0, classes, E * B))
    opt_state = tx.init(params)
    return _step(graphdef, tx), (params, opt_state, x, y)


def cpu_times(name, rounds, classes=CLASSES):
    """Median seconds of one train step, per variant, interleaved."""
    steps = {}
    for variant, model in _models(name, classes).items():
        step, args = _prepared(model, classes)
        compiled = jax.jit(step).lower(*args).compile()
        steps[variant] = lambda compiled=compiled, args=args: jax.block_until_ready(
            compiled(*args)
        )
    times = interleaved_times(steps, rounds)
    return {variant: statistics.median(values) for variant, values in times.items()}


def compiled_costs(name, chip, classes=CLASSES):
    """Flops, bytes and kernels of each variant's train step for ``chip``."""
    costs = {}
    for variant, model in _models(name, classes).items():
        step, args = _prepared(model, classes)
        specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
        cost = program_cost(chip, step, specs, donate_argnums=(0, 1))
        costs[variant] = cost
    return costs


def _copies(cost):
    """Bytes of the kernels that copy and nothing else (XLA's layout changes)."""
    return sum(
        k.hbm_bytes * k.trips for k in cost.program.kernels if k.ops == ("copy",)
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--chips", default="cpu,h100,v5e")
    parser.add_argument(
        "--classes", type=int, default=CLASSES, help="the head's outputs (10)"
    )
    args = parser.parse_args(argv)
    print(
        f"jax {jax.__version__}; E={E}, B={B}, {args.classes} classes; "
        "default / independent head"
    )
    if args.rounds:
        print("\n| model | CPU ms per step | ratio |")
        print("|:---|---:|---:|")
        for name in ("mlp", "cnn"):
            median = cpu_times(name, args.rounds, args.classes)
            a, b = median["default"], median["independent head"]
            print(f"| {name} | {1e3 * a:.3f} / {1e3 * b:.3f} | {b / a:.3f} |")
    print(
        "\n| model | chip | flops ratio | bytes ratio | kernel launches "
        "| copies, bytes |"
    )
    print("|:---|:---|---:|---:|---:|---:|")
    for name in ("mlp", "cnn"):
        for chip in args.chips.split(","):
            try:
                costs = compiled_costs(name, chip, args.classes)
            except RuntimeError as error:  # the chip's compiler is missing
                print(f"| {name} | {chip} | not compiled: {error} | | | |")
                continue
            a, b = costs["default"], costs["independent head"]
            print(
                f"| {name} | {chip} | {b.flops / a.flops:.3f} "
                f"| {b.hbm_bytes / a.hbm_bytes:.3f} | {a.launches} / {b.launches} "
                f"| {_copies(a)} / {_copies(b)} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
