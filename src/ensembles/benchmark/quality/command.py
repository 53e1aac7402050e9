"""``ensembles-bench --quality``: every task checked, then trained, measured, printed.

:func:`quality_command` is what :func:`~ensembles.benchmark.cli.main` runs
for ``--quality``, in named steps: every task's data loaded and its models
and methods checked before anything trains (:func:`checked_tasks`), then
each task's line (``Task.describe``) and its rows
(:func:`~ensembles.benchmark.quality.run.run_task`), then the tables and the
figure of them all.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from ensembles.benchmark.quality.checks import check_run
from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.models import ModelSpec
from ensembles.benchmark.quality.plots import write_quality_plot
from ensembles.benchmark.quality.report import format_quality, summarize
from ensembles.benchmark.quality.run import prepare_task, run_task
from ensembles.benchmark.quality.tasks import TASK_MODELS, TASK_STEPS, load_task
from ensembles.benchmark.report import Results, run_header

__all__ = ["checked_tasks", "quality_command"]


def quality_command(
    args: argparse.Namespace, device: dict[str, Any], show: Callable[[str], None]
) -> Results | None:
    """Trains and measures every task of ``args``, prints the tables.

    Args:
      args: the parsed command line (its defaults filled in).
      device: the device description (the first line names it).
      show: the progress line.

    Returns:
      The rows and their summary; ``None`` if a task was refused (the error
      printed).
    """
    seeds = tuple(range(args.seed, args.seed + args.seeds))
    print(
        f"{run_header(device)}; tasks {', '.join(args.task)}, seeds "
        f"{', '.join(map(str, seeds))}",
        flush=True,
    )
    runs = checked_tasks(args, show)
    if runs is None:
        return None
    rows = []
    for name, models, data in runs:
        task = prepare_task(data, args.steps or TASK_STEPS[name], show)
        quick = " (--quick)" if args.quick and name.startswith("mnist1d") else ""
        skipped = [m for m in args.model if m not in models]
        print(
            f"{name}: {task.describe(quick)}"
            + (f"; {', '.join(skipped)} skipped (no use on {name})" if skipped else ""),
            flush=True,
        )
        if models:
            rows += run_task(task, models, args.members, seeds, args.methods)
            show("")
    summary = summarize(rows)
    print(format_quality(summary, markdown=args.markdown))
    if args.plot:
        write_quality_plot(summary, args.plot)
    return Results(rows, summary)


def checked_tasks(
    args: argparse.Namespace, show: Callable[[str], None]
) -> list[tuple[str, list[ModelSpec], QualityData]] | None:
    """Every task's data and the models that apply to it, checked before training.

    Returns:
      ``(task, models, data)`` per task; ``None`` once a task is refused
      (the error printed).
    """
    runs = []
    for name in args.task:
        models = [
            m for m in args.model if not isinstance(m, str) or m in TASK_MODELS[name]
        ]
        if not models and not args.model_given:  # --quick's cnn, on rows: an mlp
            models = list(TASK_MODELS[name][:1])
        show(f"generating {name} (offline)")
        data = load_task(name, quick=args.quick)
        try:
            check_run(models, args.methods, data)
        except ValueError as error:
            show("")
            print(f"ensembles-bench: error: --task {name}: {error}", file=sys.stderr)
            return None
        runs.append((name, models, data))
    show("")
    return runs
