"""The ops' custom derivatives against JAX's own, in whole train steps.

The dense and convolution ops differentiate their formula member by member
where a parameter is differentiated (``ensembles.ops.dense``,
``ensembles.ops.conv``). This script measures whether that pays: the same
BatchEnsemble model's Adam train step compiled twice, once as the library
runs it and once with each op's formula differentiated by JAX as written
(the custom derivatives swapped out while it compiles), beside one plain
model on all E*B rows; interleaved rounds, ratios of medians in one process,
and each step's temporary memory (XLA's memory analysis of the compiled
step)::

    python -m benchmarks.bench_derivatives [--models mlp,cnn] [--members 4,8]
    python -m benchmarks.bench_derivatives --batch 32 --input-shape 16,64 \
        --models benchmarks.small_transformer:small_transformer
"""

import argparse
import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from ensembles.benchmark import (
    interleaved_times,
    median,
    prepare_method,
    reuse_freed_memory,
)
from ensembles.benchmark.arguments import load_factory
from ensembles.ops import conv, dense


@contextlib.contextmanager
def plain_autodiff():
    """Every op's formula differentiated by JAX (what the library replaces)."""
    with (
        mock.patch.object(dense, "_scaled_matmul", dense._scaled_matmul.fun),
        mock.patch.object(conv, "_scaled_conv", conv._scaled_conv_formula),
    ):
        yield


def prepare(model, num_members, batch, mode, **options):
    """``{name: prepared}``: one model, the library's BE and plain autodiff's."""
    options.update(num_members=num_members, batch=batch)
    prepared = {
        "single": prepare_method("single", model, mode, **options),
        "library": prepare_method("batchensemble", model, mode, **options),
    }
    with plain_autodiff():
        prepared["jax"] = prepare_method("batchensemble", model, mode, **options)
    return prepared


def first_layer(shape, repeats):
    """``{name: ratio}``: a first layer's gradient over a plain layer's."""
    num_members, batch, in_features, out_features = shape
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((num_members * batch, in_features)))
    kernel = jnp.asarray(rng.standard_normal((in_features, out_features)))
    r, s, bias = (
        jnp.ones((num_members, in_features)),
        *jnp.ones((2, num_members, out_features)),
    )
    args = (x, kernel, r, s, bias)

    def grad(fn):
        return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), (1, 2, 3, 4)))

    plain = grad(lambda x, kernel, r, s, bias: x @ kernel + bias[0])
    with mock.patch.object(dense, "MEMBER_BACKWARD_MIN_ROWS", 1):
        member = grad(dense.dense_rows).lower(*args).compile()
    with plain_autodiff():
        own = grad(dense.dense_rows).lower(*args).compile()
    steps = {"plain": lambda: plain(*args), "member": lambda: member(*args)}
    steps["jax"] = lambda: own(*args)
    times = {k: median(v) for k, v in interleaved_times(steps, repeats).items()}
    return {k: v / times["plain"] for k, v in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--members", default="4,8")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--mode", default="train")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--input-shape", default=None)
    parser.add_argument("--first-layer", default=None)
    args = parser.parse_args(argv)
    # Before JAX runs anything: no page faults per step (docs/cost.md).
    print(f"malloc keeps freed memory: {reuse_freed_memory()}")
    if args.first_layer:
        print(f"{'E x B x in x out':>20} {'per member':>11} {'jax':>6}")
        for spec in args.first_layer.split(","):
            shape = tuple(map(int, spec.split("x")))
            ratios = first_layer(shape, args.repeats)
            print(f"{spec:>20} {ratios['member']:>11.3f} {ratios['jax']:>6.3f}")
        return
    options = {}
    if args.input_shape:
        options["input_shape"] = tuple(map(int, args.input_shape.split(",")))
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; median of "
        f"{args.repeats} interleaved rounds; times over one plain model's"
    )
    print(
        f"{'model':>6} {'E':>3} {'single ms':>10} {'library':>8} {'jax':>6} "
        f"{'temp MiB: single':>17} {'library':>8} {'jax':>6}"
    )
    for model in args.models.split(","):
        name = model.rsplit(":", 1)[-1][:6]
        if ":" in model:
            model = load_factory(model)
        for num_members in map(int, args.members.split(",")):
            prepared = prepare(model, num_members, args.batch, args.mode, **options)
            runs = interleaved_times(
                {key: p.step for key, p in prepared.items()}, args.repeats
            )
            times = {key: median(values) for key, values in runs.items()}
            temp = {key: p.memory.temp_bytes / 2**20 for key, p in prepared.items()}
            print(
                f"{name:>6} {num_members:>3} {1e3 * times['single']:>10.2f} "
                f"{times['library'] / times['single']:>8.3f} "
                f"{times['jax'] / times['single']:>6.3f} "
                f"{temp['single']:>17.1f} {temp['library']:>8.1f} {temp['jax']:>6.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
