"""Every formulation of the dense and convolution ops, against a plain layer.

What the rules ``ensembles.ops.dense.choose_dense`` and
``ensembles.ops.conv.choose_conv`` are measured from (``docs/cost.md``). For
the layers of the cost benchmark's MLP and CNN (``ensembles-bench --model
mlp,cnn``), times the forward pass, a first layer's gradient (parameters only)
and a hidden layer's (parameters and inputs) of the op under each forced
``Formulation``, and prints each as a ratio to the plain Flax layer's on the
same ``[E*B, ...]`` rows: medians of interleaved rounds in one process.
Also prints what the rule picks::

    python -m benchmarks.bench_formulations [--op conv,dense] [--members 4,8]
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ensembles.benchmark.timing import interleaved_times, median
from ensembles.ops import Formulation, batch_ensemble_conv, batch_ensemble_dense
from ensembles.ops.autodiff import Needs
from ensembles.ops.conv import choose_conv
from ensembles.ops.dense import choose_dense

# The cost benchmark's layers, B = 128 per member. conv: (H=W, in, out, stride)
CONV_LAYERS = [(32, 3, 16, 1), (32, 16, 32, 2), (16, 32, 32, 2)]
# dense: (in, out): the MLP's layers (width 1024) and a wide one.
DENSE_LAYERS = [(1024, 1024), (1024, 10)]
FORMULATIONS = [
    Formulation(forward, backward)
    for forward in ("scale", "fold")
    for backward in ("scaled_activations", "member_kernels")
]
MODES = ("forward", "first_layer", "hidden_layer")


def _draw(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _timed(fn, params, x, mode):
    """A jitted forward or gradient of ``0.5 * sum(fn(params, x)**2)``."""
    if mode == "forward":
        return functools.partial(jax.jit(fn), params, x)
    argnums = 0 if mode == "first_layer" else (0, 1)
    grad = jax.jit(
        jax.grad(lambda p, x: 0.5 * jnp.sum(jnp.square(fn(p, x))), argnums=argnums)
    )
    return functools.partial(grad, params, x)


def conv_cases(num_members, batch, layer, mode):
    size, cin, cout, stride = layer
    x = _draw((num_members * batch, size, size, cin), 0)
    kernel = 0.1 * _draw((3, 3, cin, cout), 1)
    params = {
        "kernel": kernel,
        "r": 1 + 0.5 * _draw((num_members, cin), 2),
        "s": 1 + 0.5 * _draw((num_members, cout), 3),
        "bias": _draw((num_members, cout), 4),
    }
    plain = nnx.Conv(cin, cout, (3, 3), strides=stride, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(plain)
    cases = {"flax": _timed(lambda p, x: nnx.merge(graphdef, p)(x), state, x, mode)}
    for f in FORMULATIONS:

        def op(p, x, f=f):
            return batch_ensemble_conv(
                x,
                p["kernel"],
                p["r"],
                p["s"],
                p["bias"],
                num_members=num_members,
                strides=stride,
                formulation=f,
            )

        cases[f"{f.forward}/{f.backward}"] = _timed(op, params, x, mode)
    return cases


def dense_cases(num_members, batch, layer, mode):
    cin, cout = layer
    x = _draw((num_members * batch, cin), 0)
    params = {
        "kernel": 0.03 * _draw((cin, cout), 1),
        "r": 1 + 0.5 * _draw((num_members, cin), 2),
        "s": 1 + 0.5 * _draw((num_members, cout), 3),
        "bias": _draw((num_members, cout), 4),
    }
    plain = nnx.Linear(cin, cout, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(plain)
    cases = {"flax": _timed(lambda p, x: nnx.merge(graphdef, p)(x), state, x, mode)}
    for f in FORMULATIONS:

        def op(p, x, f=f):
            return batch_ensemble_dense(
                x,
                p["kernel"],
                p["r"],
                p["s"],
                p["bias"],
                num_members=num_members,
                formulation=f,
            )

        cases[f"{f.forward}/{f.backward}"] = _timed(op, params, x, mode)
    return cases


def _needs(mode):
    return Needs(
        inputs=mode == "hidden_layer",
        kernel=mode != "forward",
        r=mode != "forward",
        s=mode != "forward",
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="conv,dense")
    parser.add_argument("--members", default="4,8")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; B={args.batch}; "
        f"median of {args.repeats} interleaved rounds; each cell: time / the plain "
        f"Flax layer's on the same rows ('rule': what the op's rule runs)"
    )
    names = ["flax", *(f"{f.forward}/{f.backward}" for f in FORMULATIONS)]
    print("| op | E | layer | mode | " + " | ".join(names[1:]) + " | rule |")
    print("|:---|---:|:---|:---|" + "---:|" * len(names))
    for op in args.op.split(","):
        layers = CONV_LAYERS if op == "conv" else DENSE_LAYERS
        build = conv_cases if op == "conv" else dense_cases
        for num_members in (int(e) for e in args.members.split(",")):
            for layer in layers:
                for mode in MODES:
                    cases = build(num_members, args.batch, layer, mode)
                    for fn in cases.values():
                        jax.block_until_ready(fn())
                    times = interleaved_times(cases, args.repeats)
                    base = median(times["flax"])
                    if op == "conv":
                        rule = choose_conv(_needs(mode), 1)
                    else:
                        rule = choose_dense(
                            num_members, args.batch, layer[0], layer[1], _needs(mode)
                        )
                    if mode == "forward":
                        rule = Formulation(rule.forward)
                    cells = [f"{median(times[n]) / base:.2f}" for n in names[1:]]
                    print(
                        f"| {op} | {num_members} | {layer} | {mode} | "
                        + " | ".join(cells)
                        + f" | {rule.forward}/{rule.backward} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
