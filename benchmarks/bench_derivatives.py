"""The ops' custom derivatives against JAX's own, in whole train steps.

The dense and convolution ops differentiate their formula member by member
where a parameter is differentiated (``ensembles.ops.dense``,
``ensembles.ops.conv``). This script measures whether that pays: the same
BatchEnsemble model's Adam train step compiled twice, once as the library
runs it and once with each op's formula differentiated by JAX as written
(the custom derivatives swapped out while it compiles), beside one plain
model on all E*B rows; interleaved rounds, ratios of medians in one process::

    python -m benchmarks.bench_derivatives [--models mlp,cnn] [--members 4,8]
"""

import argparse
import contextlib
from unittest import mock

import jax

from ensembles.benchmark import interleaved_times, median, prepare_method
from ensembles.ops import conv, dense


@contextlib.contextmanager
def plain_autodiff():
    """Every op's formula differentiated by JAX (what the library replaces)."""
    with (
        mock.patch.object(dense, "_scaled_matmul", dense._scaled_matmul.fun),
        mock.patch.object(conv, "_scaled_conv", conv._scaled_conv_formula),
    ):
        yield


def prepare(model, num_members, batch, mode):
    """``{name: step}``: one model, the library's BE and plain autodiff's."""
    options = {"num_members": num_members, "batch": batch}
    steps = {
        "single": prepare_method("single", model, mode, **options).step,
        "library": prepare_method("batchensemble", model, mode, **options).step,
    }
    with plain_autodiff():
        steps["jax"] = prepare_method("batchensemble", model, mode, **options).step
    return steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--members", default="4,8")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--mode", default="train")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; median of "
        f"{args.repeats} interleaved rounds; times over one plain model's"
    )
    print(f"{'model':>6} {'E':>3} {'single ms':>10} {'library':>8} {'jax':>6}")
    for model in args.models.split(","):
        for num_members in map(int, args.members.split(",")):
            steps = prepare(model, num_members, args.batch, args.mode)
            runs = interleaved_times(steps, args.repeats)
            times = {name: median(values) for name, values in runs.items()}
            print(
                f"{model:>6} {num_members:>3} {1e3 * times['single']:>10.2f} "
                f"{times['library'] / times['single']:>8.3f} "
                f"{times['jax'] / times['single']:>6.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
