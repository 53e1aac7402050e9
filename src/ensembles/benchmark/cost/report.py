"""The report of the cost benchmark: its rows as text, Markdown and a plot.

:func:`~ensembles.benchmark.run_benchmark` measures; this module only presents
its rows: aligned text tables and Markdown tables (one per model, mode and
configuration, with notes under them), and the PNG of throughput and memory
against E. The JSON record is :func:`ensembles.benchmark.report.write_json`'s.
"""

from __future__ import annotations

from typing import Any

from ensembles.benchmark.cost.methods import METHODS, cost_method
from ensembles.benchmark.report import render_table

__all__ = [
    "FAULTS_NOTED",
    "RATIOS_LEGEND",
    "SPREAD_NOTED",
    "format_markdown",
    "format_rows",
    "format_table",
    "write_plot",
]


def _count(value: float) -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.2f}{suffix}"
    return f"{value:.0f}"


def _megabytes(value: int) -> str:
    return f"{value / 2**20:.1f}"


_COLUMNS = (
    "E",
    "method",
    "ms",
    "spread",
    "samples/s",
    "x 1 on E*B",
    "x 1 on B",
    "vs deep",
    "params",
    "params/deep",
    "memory MiB",
    "memory/vmap deep",
)


#: The line under every table that says what its two ratio columns divide by.
RATIOS_LEGEND: str = (
    "x 1 on E*B: the row's median over one plain model's on all E*B rows "
    "(the same matmuls: the limit; above 1, slower); x 1 on B: over one "
    "plain model's on one member's B rows (what a prediction costs without "
    "an ensemble: E members cost about E times its FLOPs)."
)


def _spread(row: dict[str, Any]) -> float:
    """Half the interquartile range of a row's times over their median."""
    return (row["q3_s"] - row["q1_s"]) / 2 / row["median_s"]


def _cells(row: dict[str, Any]) -> tuple[str, ...]:
    return (
        str(row["members"]),
        row["method"],
        f"{1e3 * row['median_s']:.2f}",
        f"±{100 * _spread(row):.0f}%",
        _count(row["samples_per_s"]),
        f"{row['ratio_to_single']:.2f}",
        f"{row['ratio_to_single_b']:.2f}",
        f"{row['speedup_vs_best_deep_ensemble']:.2f}x",
        _count(row["params"]),
        f"{100 * row['params_ratio_to_deep_ensemble']:.0f}%",
        _megabytes(row["total_bytes"]),
        f"{100 * row['memory_ratio_to_deep_ensemble']:.0f}%",
    )


def _groups(rows: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["model"], row["mode"], row["batch"], row["width"], row["impl"])
        groups.setdefault(key, []).append(row)
    return groups


def _title(key: tuple, group: list[dict[str, Any]] | None = None) -> str:
    model, mode, batch, width, impl = key
    shape = "" if width is None else f", width {width}"
    title = f"{model} {mode}: B={batch} per member{shape}, impl={impl}"
    if group:
        best = {row["members"]: row["best_deep_ensemble"] for row in group}
        named = ", ".join(f"E={e}: {cost_method(b).deep}" for e, b in best.items())
        title += (
            f"; 'vs deep' and 'params/deep' against the faster deep ensemble "
            f"({named}), 'memory/vmap deep' against the vmapped one (all E "
            f"models in one step)"
        )
    return title


#: Page faults per step from which a method's row gets a note: about 4 MiB of
#: fresh pages a step (a step that reuses its memory faults a few hundred
#: times at most).
FAULTS_NOTED: int = 1000


#: Spread (:func:`_spread`) from which a method's row gets a note: a ratio
#: against its median can be off by about as much.
SPREAD_NOTED: float = 0.10


def _spread_note(group: list[dict[str, Any]]) -> str:
    """A line naming the methods whose times spread widely, or ``""``."""
    noisy = [
        f"{row['method']} (E={row['members']}) ±{100 * _spread(row):.0f}%"
        for row in group
        if _spread(row) >= SPREAD_NOTED
    ]
    if not noisy:
        return ""
    return (
        f"Spread of ±{100 * SPREAD_NOTED:.0f}% or more over the rounds: "
        f"{', '.join(noisy)}. A ratio against these rows can be off by as "
        f"much: rerun with more --repeats, or on a quieter machine."
    )


def _notes(group: list[dict[str, Any]], separator: str) -> str:
    """The notes under a group's table: the ratios' legend, loss, spread, faults."""
    notes = (RATIOS_LEGEND, _loss_note(group), _spread_note(group), _faults_note(group))
    return separator.join(note for note in notes if note)


def _loss_note(group: list[dict[str, Any]]) -> str:
    """A line saying a train step fits a regressor's targets, or ``""``."""
    if not any(row.get("loss") == "squared error" for row in group):
        return ""
    return (
        "Trained on the squared error of the model's one output against "
        "standard-normal targets: a softmax cross-entropy over one output is "
        "identically 0 and has no gradient."
    )


def _faults_note(group: list[dict[str, Any]]) -> str:
    """A line naming the methods whose steps page-faulted, or ``""``."""
    faulted = [
        f"{row['method']} (E={row['members']}) {row['page_faults_per_step']:,.0f}"
        for row in group
        if (row.get("page_faults_per_step") or 0) >= FAULTS_NOTED
    ]
    if not faulted:
        return ""
    return (
        f"Page faults per step: {', '.join(faulted)}. These steps got fresh "
        f"memory from the system on every call, and their times include it "
        f"(ensembles.benchmark.reuse_freed_memory, docs/cost.md)."
    )


def format_rows(rows: list[dict[str, Any]], *, markdown: bool) -> str:
    """Renders rows of :func:`run_benchmark` as tables, one block per group.

    Args:
      rows: the rows.
      markdown: Markdown tables instead of aligned text.

    Returns:
      The tables with their titles and notes; ``spread`` is half the
      interquartile range over the median.
    """
    gap = "\n\n" if markdown else "\n"
    blocks = []
    for key, group in _groups(rows).items():
        note = _notes(group, gap)
        title = f"**{_title(key, group)}**" if markdown else _title(key, group)
        cells = [_cells(row) for row in group]
        table = render_table(_COLUMNS, cells, markdown=markdown, left=1)
        blocks.append(title + gap + table + (note and gap + note))
    return "\n\n".join(blocks)


def format_table(rows: list[dict[str, Any]]) -> str:
    """:func:`format_rows` as aligned text."""
    return format_rows(rows, markdown=False)


def format_markdown(rows: list[dict[str, Any]]) -> str:
    """:func:`format_rows` as Markdown."""
    return format_rows(rows, markdown=True)


def write_plot(rows: list[dict[str, Any]], path: str) -> None:
    """Plots throughput and memory against E, one row of panels per group.

    Args:
      rows: rows of :func:`run_benchmark`.
      path: the PNG to write.
    """
    from matplotlib.figure import Figure

    groups = _groups(rows)
    figure = Figure(figsize=(10, 3.6 * len(groups)), layout="constrained")
    axes = figure.subplots(len(groups), 2, squeeze=False)
    for (throughput, memory), (key, group) in zip(axes, groups.items(), strict=True):
        for method in METHODS:
            mine = [row for row in group if row["method"] == method]
            members = [row["members"] for row in mine]
            throughput.plot(
                members, [row["samples_per_s"] for row in mine], "o-", label=method
            )
            memory.plot(
                members,
                [row["total_bytes"] / 2**20 for row in mine],
                "o-",
                label=method,
            )
        for ax, label in ((throughput, "member-samples / s"), (memory, "MiB")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({row["members"] for row in group}))
            ax.set_xticklabels(sorted({str(row["members"]) for row in group}, key=int))
            ax.set_xlabel("ensemble size E")
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        throughput.set_title(f"throughput ({_title(key)})", fontsize=9)
        memory.set_title("memory (XLA: arguments + outputs + temporaries)", fontsize=9)
        throughput.legend(fontsize=8)
    figure.savefig(path, dpi=120)
