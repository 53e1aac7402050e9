"""``ensembles-bench``'s timed run: every method timed, the table printed.

:func:`cost_command` is what :func:`~ensembles.benchmark.cli.main` runs
without ``--quality`` or ``--compiled-for``, once the models are checked:
the first line (versions, device, rounds, allocator), what each user's model
left shared, :func:`~ensembles.benchmark.cost.speed.run_benchmark`'s rows as
a table (:mod:`~ensembles.benchmark.cost.report`), and the figure.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ensembles.benchmark.cost.report import format_rows, write_plot
from ensembles.benchmark.cost.speed import run_benchmark
from ensembles.benchmark.report import Results, run_header

__all__ = ["cost_command"]


def cost_command(
    args: argparse.Namespace,
    device: dict[str, Any],
    shared: list[str],
    show: Callable[[str], None],
) -> Results:
    """Times every method of ``args``, prints the table, plots it.

    Args:
      args: the parsed command line (its defaults filled in, and
        ``malloc_keeps_freed_memory`` set).
      device: the device description (the first line names it).
      shared: what each user's model left shared (a line each).
      show: the progress line.

    Returns:
      The rows.
    """
    malloc = (
        "malloc keeps freed memory"
        if args.malloc_keeps_freed_memory
        else "the default malloc"
    )
    print(
        f"{run_header(device)}; median of {args.repeats} interleaved rounds; {malloc}",
        flush=True,
    )
    for line in shared:
        print(line, flush=True)
    rows = run_benchmark(
        models=args.model,
        modes=args.mode,
        members=args.members,
        batch=args.batch,
        width=args.width,
        image_size=args.image_size,
        input_shape=args.input_shape,
        impl=args.impl,
        repeats=args.repeats,
        seed=args.seed,
        progress=show,
    )
    print(format_rows(rows, markdown=args.markdown))
    if args.plot:
        write_plot(rows, args.plot)
    return Results(rows)
