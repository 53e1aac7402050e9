"""``ensembles-bench``: what does an ensemble of E cost, in speed and memory?

For every ensemble size E it times ``single`` (one plain model on all ``E*B``
rows), ``batchensemble`` (the converted model), ``deep_ensemble`` (E models
under ``nnx.vmap``) and ``deep_ensemble_loop`` (E models in a Python loop), all
on the same ``E*B`` member-samples, interleaved so that machine drift hits all
methods alike, and prints samples/s, ratios and memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import jax

import ensembles
from ensembles.benchmark.methods import (
    METHODS,
    MODES,
    check_convertible,
    prepare_method,
)
from ensembles.benchmark.models import DEFAULT_IMAGE_SIZE, DEFAULT_WIDTHS, MODELS
from ensembles.benchmark.report import (
    _describe_device,
    _format_markdown,
    _format_table,
    _write_json,
    _write_plot,
)
from ensembles.benchmark.timing import (
    interleaved_times,
    median,
    quartiles,
)

__all__ = ["build_parser", "main", "run_benchmark"]

#: Defaults of the full run and of ``--quick`` (options not given on the line).
DEFAULTS: dict[str, Any] = {"members": (1, 2, 4, 8), "repeats": 10}
QUICK: dict[str, Any] = {"members": (1, 4), "repeats": 5}

_EXTRA_HINT = "pip install 'ensembles[bench]'"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 1, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",")]
    try:
        values = tuple(int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated list of integers >= 1 such as 1,2,4,8; "
            f"got {text!r}"
        ) from None
    bad = [value for value in values if value < 1]
    if bad:
        raise argparse.ArgumentTypeError(
            f"every ensemble size E must be >= 1; got {text!r}"
        )
    return tuple(dict.fromkeys(values))


def _choice_list(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(part.strip() for part in text.split(","))
        unknown = [value for value in values if value not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown))}; choose from "
                f"{', '.join(choices)} (comma-separated for several)"
            )
        return tuple(dict.fromkeys(values))

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``ensembles-bench`` argument parser.

    >>> from ensembles.benchmark import build_parser
    >>> args = build_parser().parse_args(["--members", "2,4", "--mode", "train"])
    >>> args.members, args.mode, args.model
    ((2, 4), ('train',), ('mlp',))

    Returns:
      The parser. Options that ``--quick`` changes default to ``None``;
      :func:`main` fills them in.
    """
    parser = argparse.ArgumentParser(
        prog="ensembles-bench",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog=(
            "Every method processes the same E*B member-samples; samples/s counts "
            "member-samples; 'ms' is the median time of a step. 'x single' is that "
            "median over the median of one plain model on all E*B rows; 'vs deep' "
            "is the median of the faster deep ensemble (E models run with "
            "nnx.vmap, or one after another in a Python loop; both are rows of "
            "the table) over the row's median: above 1, the row is faster. "
            "'/deep' columns are fractions of that faster deep ensemble's "
            "parameters and memory (XLA's memory analysis of the compiled step: "
            "arguments + outputs + temporaries; the loop's temporaries are those "
            "of one of its E calls). On XLA's CPU backend that analysis does not "
            "count the scratch space of grouped convolutions, so the vmap deep "
            "ensemble of the CNN (E grouped into one convolution) shows less "
            "memory than one model: read its memory as a lower bound."
        ),
    )
    parser.add_argument(
        "--model",
        type=_choice_list(MODELS),
        default=("mlp",),
        help=f"{'|'.join(MODELS)} or a comma-separated list (default: mlp)",
    )
    parser.add_argument(
        "--mode",
        type=_choice_list(MODES),
        default=MODES,
        help="forward (inference) and/or train (forward + backward + adam "
        "update), comma-separated (default: forward,train)",
    )
    parser.add_argument(
        "--members",
        type=_int_list,
        default=None,
        help="ensemble sizes E, comma-separated (default: 1,2,4,8; --quick: 1,4)",
    )
    parser.add_argument(
        "--batch",
        type=_positive_int,
        default=128,
        help="samples per member B; every method sees E*B (default: 128)",
    )
    parser.add_argument(
        "--width",
        type=_positive_int,
        default=None,
        help="features of the linear layer and of the MLP's hidden layers, base "
        "channels of the CNN (default: "
        + ", ".join(f"{name} {width}" for name, width in DEFAULT_WIDTHS.items())
        + ")",
    )
    parser.add_argument(
        "--image-size",
        type=_positive_int,
        default=DEFAULT_IMAGE_SIZE,
        help=f"height and width of the CNN's images (default: {DEFAULT_IMAGE_SIZE})",
    )
    parser.add_argument(
        "--impl",
        choices=ensembles.ops.IMPLS,
        default="auto",
        help="BatchEnsemble op implementation, set with nnx.view(model, impl=...) "
        "(default: auto)",
    )
    parser.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        help="timed rounds per method; the median and quartiles are reported "
        "(default: 10; --quick: 5)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of parameters and data"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer sizes and rounds (E=1,4, 5 rounds): under a minute on a 2-core CPU",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "--markdown", action="store_true", help="print a Markdown table instead"
    )
    parser.add_argument(
        "--plot",
        metavar="PATH.png",
        help=f"plot throughput and memory against E (needs matplotlib: {_EXTRA_HINT})",
    )
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.plot is not None:
        if not args.plot.lower().endswith(".png"):
            parser.error(
                f"--plot writes a PNG: its path must end in .png, got {args.plot!r}"
            )
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(
                f"--plot needs matplotlib, which is not installed: {_EXTRA_HINT} "
                f"(the 'bench' extra)"
            )
    if "train" in args.mode:
        try:
            import optax  # noqa: F401
        except ImportError:
            parser.error(
                f"--mode train needs optax, which is not installed: {_EXTRA_HINT}"
            )
    for model in args.model:
        try:
            check_convertible(model, args.impl)
        except ValueError as error:
            parser.error(f"--model {model} --impl {args.impl}: {error}")
    return args


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


def run_benchmark(
    *,
    models: Sequence[str] = ("mlp",),
    modes: Sequence[str] = MODES,
    members: Sequence[int] = (1, 2, 4, 8),
    batch: int = 128,
    width: int | None = None,
    image_size: int = DEFAULT_IMAGE_SIZE,
    impl: str = "auto",
    repeats: int = 10,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Times every method for every model, mode and E; returns one row each.

    The four methods of one (model, mode, E) are compiled, then timed in
    interleaved rounds (2 untimed warm-up calls each). Every ratio is a ratio
    of the printed medians; "the deep ensemble" of the ratios is the faster of
    ``deep_ensemble`` (vmap) and ``deep_ensemble_loop``.

    >>> from ensembles.benchmark import run_benchmark
    >>> rows = run_benchmark(models=["linear"], modes=["forward"], members=[2],
    ...                      batch=2, width=4, repeats=2)
    >>> [row["method"] for row in rows]
    ['single', 'batchensemble', 'deep_ensemble', 'deep_ensemble_loop']
    >>> rows[2]["params"] == 2 * rows[0]["params"], rows[0]["ratio_to_single"]
    (True, 1.0)

    Args:
      models: names from :data:`~ensembles.benchmark.MODELS`.
      modes: names from :data:`~ensembles.benchmark.MODES`.
      members: ensemble sizes E.
      batch: samples per member B.
      width: see :func:`~ensembles.benchmark.build_model`.
      image_size: the CNN's image height and width.
      impl: the BatchEnsemble op implementation.
      repeats: timed rounds.
      seed: seed of parameters and data.
      progress: called with a status line before each stage, and with ``""``
        at the end.

    Returns:
      Rows (dicts) with the method, the configuration, times (``median_s``,
      ``q1_s``, ``q3_s``, ``times_s``), ``samples_per_s``, ratios of medians
      (``ratio_to_single``; ``speedup_vs_deep_ensemble`` and
      ``speedup_vs_deep_ensemble_loop``; ``speedup_vs_best_deep_ensemble``
      over the faster of the two, named in ``best_deep_ensemble``),
      ``params``, ``param_bytes`` and XLA's memory analysis
      (``argument_bytes``, ``output_bytes``, ``alias_bytes``, ``temp_bytes``,
      ``total_bytes``), with the parameter and memory ratios to the faster
      deep ensemble.
    """
    show = progress or (lambda message: None)
    rows: list[dict[str, Any]] = []
    groups = [(m, d, e) for m in models for d in modes for e in members]
    for index, (model, mode, num_members) in enumerate(groups, 1):
        where = f"[{index}/{len(groups)}] {model} {mode} E={num_members}"
        prepared = {}
        for method in METHODS:
            show(f"{where}: compiling {method}")
            prepared[method] = prepare_method(
                method,
                model,
                mode,
                num_members=num_members,
                batch=batch,
                width=width,
                image_size=image_size,
                impl=impl,
                seed=seed,
            )
        show(f"{where}: timing {repeats} rounds")
        times = interleaved_times(
            {method: p.step for method, p in prepared.items()}, repeats
        )
        medians = {method: median(values) for method, values in times.items()}
        best = min(("deep_ensemble", "deep_ensemble_loop"), key=medians.get)
        deep = prepared[best]
        for method, p in prepared.items():
            median_s = medians[method]
            q1, q3 = quartiles(times[method])
            rows.append(
                {
                    "method": method,
                    "model": model,
                    "mode": mode,
                    "members": num_members,
                    "batch": batch,
                    "width": DEFAULT_WIDTHS[model] if width is None else width,
                    "impl": impl,
                    "samples": num_members * batch,
                    "median_s": median_s,
                    "q1_s": q1,
                    "q3_s": q3,
                    "samples_per_s": num_members * batch / median_s,
                    "ratio_to_single": median_s / medians["single"],
                    "speedup_vs_deep_ensemble": medians["deep_ensemble"] / median_s,
                    "speedup_vs_deep_ensemble_loop": (
                        medians["deep_ensemble_loop"] / median_s
                    ),
                    "best_deep_ensemble": best,
                    "speedup_vs_best_deep_ensemble": medians[best] / median_s,
                    "params": p.num_params,
                    "param_bytes": p.param_bytes,
                    "params_ratio_to_deep_ensemble": p.num_params / deep.num_params,
                    "argument_bytes": p.memory.argument_bytes,
                    "output_bytes": p.memory.output_bytes,
                    "alias_bytes": p.memory.alias_bytes,
                    "temp_bytes": p.memory.temp_bytes,
                    "total_bytes": p.memory.total_bytes,
                    "memory_ratio_to_deep_ensemble": (
                        p.memory.total_bytes / deep.memory.total_bytes
                    ),
                    "times_s": times[method],
                }
            )
        del prepared
    show("")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``ensembles-bench``; see ``ensembles-bench --help``.

    The table goes to stdout, the progress lines to stderr.

    >>> from ensembles.benchmark import main
    >>> main(["--model", "linear", "--mode", "forward", "--members", "2",
    ...       "--batch", "2", "--width", "4", "--repeats", "1", "--markdown"])
    ensembles ... median of 1 interleaved rounds
    **linear forward: B=2 per member, width 4, impl=auto; ...**
    <BLANKLINE>
    | E | method | ms | spread | samples/s | x single | vs deep | params | ...
    |---:|:---|---:|...
    | 2 | single | ... | 1.00 | ...
    | 2 | batchensemble | ...
    | 2 | deep_ensemble | ...
    | 2 | deep_ensemble_loop | ...
    0

    Args:
      argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
      The exit status, 0; bad arguments exit with status 2 and a message.
    """
    args = _parse(argv)
    start = time.perf_counter()
    device = _describe_device()
    print(
        f"ensembles {ensembles.__version__}, jax {jax.__version__} on "
        f"{device['device_kind']} ({device['platform']}, {device['cpu_count']} "
        f"CPUs); median of {args.repeats} interleaved rounds",
        flush=True,
    )
    rows = run_benchmark(
        models=args.model,
        modes=args.mode,
        members=args.members,
        batch=args.batch,
        width=args.width,
        image_size=args.image_size,
        impl=args.impl,
        repeats=args.repeats,
        seed=args.seed,
        progress=_progress(sys.stderr),
    )
    print(_format_markdown(rows) if args.markdown else _format_table(rows))
    if args.json:
        _write_json(rows, args.json, device=device, config=vars(args))
    if args.plot:
        _write_plot(rows, args.plot)
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0
