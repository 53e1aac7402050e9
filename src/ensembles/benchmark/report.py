"""What every report of ``ensembles-bench`` shares: tables, names, JSON.

The cost benchmark (:mod:`ensembles.benchmark.cost.report`), the compiled
programs' comparison (:mod:`ensembles.benchmark.cost.compiled.report`) and
the quality benchmark (:mod:`ensembles.benchmark.quality.report`) lay out
their own rows; each renders them with :func:`render_table`, names a model
with :func:`model_name` and opens its output with :func:`run_header`; each
benchmark's command hands its :class:`Results` back, and the command line
writes any of them with :func:`write_json`: the rows with the date, the
device (:func:`describe_device`), the versions and the options.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

import ensembles

__all__ = [
    "Results",
    "describe_device",
    "model_name",
    "model_reference",
    "render_table",
    "run_header",
    "write_json",
]


@dataclasses.dataclass(frozen=True)
class Results:
    """What a benchmark's command hands back for the JSON record.

    Attributes:
      rows: the rows (``"results"``).
      summary: ``--quality``'s means and standard deviations over seeds
        (``"summary"``), or ``None``.
    """

    rows: list[dict[str, Any]]
    summary: list[dict[str, Any]] | None = None


def model_name(name: str | Callable[[nnx.Rngs], nnx.Module]) -> str:
    """A model's name in tables: the name itself, or its factory's name."""
    return name if isinstance(name, str) else getattr(name, "__name__", "model")


def model_reference(name: str | Callable[[nnx.Rngs], nnx.Module]) -> str:
    """A model as ``--model`` names it: the name, or ``"module:factory"``."""
    if isinstance(name, str):
        return name
    return f"{name.__module__}:{getattr(name, '__name__', name)}"


def render_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, markdown: bool, left: int
) -> str:
    """One table of string cells: aligned text, or Markdown.

    >>> from ensembles.benchmark.report import render_table
    >>> print(render_table(["method", "ms"], [["single", "1.5"]], markdown=False,
    ...                    left=0))
    method   ms
    single  1.5
    >>> print(render_table(["method", "ms"], [["single", "1.5"]], markdown=True,
    ...                    left=0))
    | method | ms |
    |:---|---:|
    | single | 1.5 |

    Args:
      header: the column names.
      rows: the rows' cells.
      markdown: a Markdown table instead of aligned text.
      left: the one column aligned left (the others align right).

    Returns:
      The table, without a title.
    """
    if markdown:
        align = "|".join(":---" if i == left else "---:" for i in range(len(header)))
        lines = ["| " + " | ".join(header) + " |", "|" + align + "|"]
        return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])
    cells = [header, *rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == left else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in cells
    )


def describe_device() -> dict[str, Any]:
    """The device the benchmark runs on, and the host.

    Returns:
      ``platform``, ``device_kind``, ``device_count`` (every process's),
      ``process_count``, ``host`` (the CPU) and ``cpu_count``.
    """
    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "host": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }


def run_header(device: dict[str, Any]) -> str:
    """The start of a run's first line: the versions and the device it runs on."""
    return (
        f"ensembles {ensembles.__version__}, jax {jax.__version__} on "
        f"{device['device_kind']} ({device['platform']}, {device['cpu_count']} "
        f"CPUs)"
    )


def _versions() -> dict[str, str]:
    import flax
    import jaxlib
    import numpy

    versions = {
        "python": platform.python_version(),
        "ensembles": ensembles.__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "numpy": numpy.__version__,
    }
    for name in ("optax", "mnist1d"):  # optional: the bench extra
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return versions


def write_json(
    rows: list[dict[str, Any]],
    path: str,
    *,
    device: dict[str, Any],
    config: dict[str, Any],
    summary: list[dict[str, Any]] | None = None,
) -> None:
    """Writes rows of a benchmark as JSON, with how they were made.

    Args:
      rows: the rows (``"results"``).
      path: the JSON file to write.
      device: :func:`describe_device`'s description.
      config: the command's options (tuples are written as lists, model
        factories as ``"module:name"``).
      summary: written as ``"summary"`` if given (``--quality``: means and
        standard deviations over seeds).
    """

    def plain(value: Any) -> Any:  # a user's factory is written by its name
        return model_reference(value) if callable(value) else value

    config = {
        key: [plain(v) for v in value] if isinstance(value, tuple) else plain(value)
        for key, value in config.items()
    }
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device,
        "versions": _versions(),
        "config": config,
        "results": rows,
    }
    if summary is not None:
        result["summary"] = summary
    with open(path, "w") as file:
        json.dump(result, file, indent=1)
