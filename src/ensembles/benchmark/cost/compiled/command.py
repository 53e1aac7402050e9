"""``ensembles-bench --compiled-for``: every program compiled, compared, printed.

:func:`compiled_command` is what :func:`~ensembles.benchmark.cli.main` runs
for ``--compiled-for``, once the chips' compilers are started and the models
checked: the first line, what each user's model left shared, and
:func:`~ensembles.benchmark.cost.compiled.report.run_comparisons`' rows as
one table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import jax

import ensembles
from ensembles.benchmark.cost.compiled.report import (
    format_comparisons,
    run_comparisons,
)
from ensembles.benchmark.report import Results

__all__ = ["compiled_command"]


def compiled_command(
    args: argparse.Namespace, shared: list[str], show: Callable[[str], None]
) -> Results | None:
    """Compiles and compares every program of ``args``, prints the table.

    Args:
      args: the parsed command line (its defaults filled in).
      shared: what each user's model left shared (a line each).
      show: the progress line.

    Returns:
      The rows (each comparison as a dict); ``None`` if a chip's compiler
      is missing (the error printed).
    """
    print(
        f"ensembles {ensembles.__version__}, jax {jax.__version__}: programs "
        f"compiled for {', '.join(args.compiled_for)} (deviceless where this "
        f"machine lacks the chip), the BatchEnsemble against one plain model on "
        f"the same E*B rows",
        flush=True,
    )
    for line in shared:
        print(line, flush=True)
    try:
        rows = run_comparisons(
            chips=args.compiled_for,
            models=args.model,
            modes=args.mode,
            members=args.members,
            dtypes=args.dtype,
            batch=args.batch,
            width=args.width,
            image_size=args.image_size,
            input_shape=args.input_shape,
            impl=args.impl,
            mesh=args.mesh,
            member_axis=args.member_axis,
            progress=show,
        )
    except RuntimeError as error:  # a chip's compiler is missing
        print(f"ensembles-bench: error: {error}", file=sys.stderr)
        return None
    print(format_comparisons(rows, markdown=args.markdown))
    return Results([row.as_dict() for row in rows])
