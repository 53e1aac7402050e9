"""``ensembles-bench --compiled-for``: runs the comparisons and prints them.

:func:`run_comparisons` compiles every chip, model, mode, ensemble size and
dtype asked for (:func:`ensembles.benchmark.cost.compiled.programs.compare_programs`);
:func:`format_comparisons` prints one table of ratios (the BatchEnsemble's
program over the plain model's on the same ``E*B`` rows) and, under it, where
each BatchEnsemble's extra kernels come from.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ensembles.benchmark.cost.compiled.hlo import Kernel
from ensembles.benchmark.cost.compiled.programs import (
    Comparison,
    compare_programs,
    layout_name,
)
from ensembles.benchmark.report import render_table

__all__ = [
    "COLLECTIVES_COLUMN",
    "COLUMNS",
    "SIDES",
    "format_comparisons",
    "run_comparisons",
]

#: The table's columns (and :data:`COLLECTIVES_COLUMN` where a program has
#: collectives).
COLUMNS: tuple[str, ...] = (
    "chip",
    "model",
    "mode",
    "dtype",
    "E",
    "B",
    "flops x",
    "bytes x",
    "kernels",
    "matmul/conv",
    "loops (trips)",
    "temp MiB",
    "compile s",
)

#: The column a table of several devices' programs adds: each program's
#: collectives and the megabytes they carry (BatchEnsemble / plain).
COLLECTIVES_COLUMN = "collectives (MB)"

#: The line under the table that says which side of each pair is which.
SIDES = (
    "a / b: the BatchEnsemble's / the plain model's (one model on the same "
    "E*B rows); flops x and bytes x: the BatchEnsemble's over the plain "
    "model's."
)


def run_comparisons(
    *,
    chips: Sequence[str],
    models: Sequence[Any],
    modes: Sequence[str],
    members: Sequence[int],
    dtypes: Sequence[str],
    batch: int,
    width: int | None = None,
    image_size: int = 32,
    input_shape: Sequence[int] | None = None,
    impl: str = "xla",
    mesh: Mapping[str, int] | None = None,
    member_axis: str | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> list[Comparison]:
    """Every comparison asked for, chip by chip (libtpu allows one at a time).

    Start the chips' compilers first
    (:func:`~ensembles.benchmark.cost.compiled.chips.start_compilers`, as
    ``ensembles-bench`` does before anything else runs JAX), so that their
    start-up lines stay off stderr.

    Args:
      chips: names of :data:`ensembles.benchmark.cost.compiled.chips.CHIPS`.
      models: benchmark model names or factories.
      modes: ``"forward"`` and/or ``"train"``.
      members: ensemble sizes E.
      dtypes: keys of :data:`ensembles.benchmark.cost.compiled.programs.DTYPES`.
      batch: B, rows per member.
      width: see :func:`~ensembles.benchmark.build_model`.
      image_size: the CNN's image height and width.
      input_shape: a factory's example shape.
      impl: the BatchEnsemble layers' ``impl``.
      mesh: the devices' mesh axes (``{"data": 8}``): each program is
        compiled for that many chips, the rows over the mesh, and its
        figures are one device's; ``None``: one device.
      member_axis: with ``mesh``, the axis the BatchEnsemble's per-member
        arrays are split over (``to_batch_ensemble(member_axis=...)``).
      progress: called with a line before each compile.

    Returns:
      The :class:`~ensembles.benchmark.cost.compiled.programs.Comparison` of each.
    """
    rows = []
    for chip in chips:
        for model in models:
            for mode in modes:
                for num_members in members:
                    for dtype in dtypes:
                        progress(
                            f"compiling {getattr(model, '__name__', model)} {mode} "
                            f"E={num_members} {dtype} for {chip} "
                            f"({layout_name(mesh, member_axis)})"
                        )
                        rows.append(
                            compare_programs(
                                model,
                                mode,
                                chip=chip,
                                num_members=num_members,
                                batch=batch,
                                dtype=dtype,
                                width=width,
                                image_size=image_size,
                                input_shape=input_shape,
                                impl=impl,
                                mesh=mesh,
                                member_axis=member_axis,
                            )
                        )
    progress("")
    return rows


def _pair(ensemble: float, plain: float, digits: int = 0) -> str:
    return f"{ensemble:.{digits}f} / {plain:.{digits}f}"


def _cells(row: Comparison) -> list[str]:
    ensemble, plain = row.ensemble, row.plain
    return [
        row.chip,
        row.model,
        row.mode,
        row.dtype,
        str(row.num_members),
        str(row.batch),
        f"{row.ratio('flops'):.3f}",
        f"{row.ratio('hbm_bytes'):.2f}",
        _pair(ensemble.launches, plain.launches),
        _pair(ensemble.matmul_launches, plain.matmul_launches),
        f"{ensemble.loops} ({ensemble.loop_trips}) / {plain.loops} "
        f"({plain.loop_trips})",
        _pair(ensemble.temp_bytes / 2**20, plain.temp_bytes / 2**20, 1),
        _pair(ensemble.compile_seconds, plain.compile_seconds, 1),
    ]


def _collectives(row: Comparison) -> str:
    ensemble, plain = row.ensemble.program, row.plain.program
    return (
        f"{ensemble.collectives} ({ensemble.collective_bytes / 1e6:.2f}) / "
        f"{plain.collectives} ({plain.collective_bytes / 1e6:.2f})"
    )


def _where(kernel: Kernel) -> str:
    """A kernel's model line (its caller's file name) via its op's line."""
    if kernel.caller is None:
        return kernel.source or "(no source line)"
    caller = kernel.caller.rsplit("/", 1)[-1]
    if kernel.source in (None, kernel.caller):
        return caller
    return f"{caller} via {kernel.source}"


def _sources(row: Comparison, limit: int) -> str:
    """The extra kernels' bytes by the line that made them, largest first.

    Headed by their count (the ``kernels`` column's difference); the DMAs,
    which that column leaves out, follow where the two programs' differ.
    """
    by_source: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    extra = row.extra_kernels()
    for kernel in extra:
        entry = by_source[_where(kernel)]
        entry[0] += kernel.trips
        entry[1] += kernel.hbm_bytes * kernel.trips
    ranked = sorted(by_source.items(), key=lambda item: -item[1][1])
    shown = [
        f"{count} x {size / 1e6:.1f} MB at {source}"
        for source, (count, size) in ranked[:limit]
    ]
    if len(ranked) > limit:
        shown.append(f"{len(ranked) - limit} more lines")
    count = sum(kernel.trips for kernel in extra)
    text = (
        f"({count} kernel{'' if count == 1 else 's'}): "
        f"{'; '.join(shown) if shown else 'none'}"
    )
    dmas = [cost.program.launches_of("dma") for cost in (row.ensemble, row.plain)]
    if dmas[0] != dmas[1]:
        text += f"; DMAs (no kernels: not in the table's counts): {_pair(*dmas)}"
    return text


def format_comparisons(
    rows: Sequence[Comparison], *, markdown: bool = False, limit: int = 4
) -> str:
    """The comparisons as one table and, under it, the extra kernels' sources.

    ``flops x`` and ``bytes x`` are the BatchEnsemble's over the plain
    model's; ``kernels``, ``matmul/conv``, ``loops``, ``temp MiB``,
    ``compile s`` and, where a program has collectives, ``collectives (MB)``
    give both, BatchEnsemble first (:data:`SIDES`, the line under the table,
    says so). Each row's extra kernels are as many as its ``kernels``
    column's difference (DMAs, which that column does not count, are named
    apart where the programs' differ). Where a comparison ran on a mesh of
    several devices a ``layout`` column names it, and its figures are one
    device's.

    Args:
      rows: :func:`run_comparisons`' results.
      markdown: a Markdown table instead of aligned text.
      limit: lines shown per row (the largest extra bytes first), each the
        model's own line that called the layer (a kernel's
        :attr:`~ensembles.benchmark.cost.compiled.hlo.Kernel.caller`) and
        the op's line in the library (its ``source``).

    Returns:
      The text.
    """
    cells = [_cells(row) for row in rows]
    columns = COLUMNS
    if any(r.ensemble.program.collectives + r.plain.program.collectives for r in rows):
        columns = (*COLUMNS, COLLECTIVES_COLUMN)
        for row, row_cells in zip(rows, cells, strict=True):
            row_cells.append(_collectives(row))
    left = columns.index("model")
    if any(row.layout != "one device" for row in rows):
        # Several devices' programs: the mesh (figures are one device's).
        columns = (columns[0], "layout", *columns[1:])
        for row, row_cells in zip(rows, cells, strict=True):
            row_cells.insert(1, row.layout)
        left += 1
    table = render_table(columns, cells, markdown=markdown, left=left)
    lines = [
        f"- {row.chip} {row.model} {row.mode} {row.dtype} E={row.num_members}"
        + ("" if row.layout == "one device" else f" ({row.layout})")
        + f" {_sources(row, limit)}"
        for row in rows
    ]
    heading = (
        "Kernels the BatchEnsemble adds (count x main-memory bytes, at the "
        "model's line via the op's):"
    )
    return "\n".join([table, "", SIDES, "", heading, *lines])
