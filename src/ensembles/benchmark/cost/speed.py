"""The speed benchmark: every method timed for every model, mode and E.

``ensembles-bench`` (without ``--quality``) prints what :func:`run_benchmark`
returns; see :mod:`ensembles.benchmark.cost.methods` for the methods. It goes
in named steps: every method of one model, mode and E compiled
(:func:`compile_methods`), then timed together (:func:`time_methods`), then
one row each (:func:`cost_row`).

Your own model: a factory ``rngs -> nnx.Module`` and one example's shape
(train: softmax cross-entropy over its outputs' last axis; a model with
one output, where that is identically 0, trains on the squared error
against standard-normal targets, and its rows say so):

>>> from flax import nnx
>>> def my_mlp(rngs):
...     return nnx.Sequential(nnx.Linear(6, 8, rngs=rngs), nnx.relu,
...                           nnx.Linear(8, 3, rngs=rngs))
>>> rows = run_benchmark(models=[my_mlp], input_shape=(6,), modes=["train"],
...                      members=[2], batch=4, repeats=2)
>>> rows[0]["model"], rows[2]["method"], rows[2]["samples"]
('my_mlp', 'batchensemble', 8)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from ensembles.benchmark.cost.methods import (
    DEEP_ENSEMBLE,
    DEEP_ENSEMBLE_LOOP,
    METHOD_TABLE,
    MODES,
    SINGLE,
    SINGLE_B,
    CostMethod,
    Prepared,
    prepare_method,
)
from ensembles.benchmark.cost.models import DEFAULT_IMAGE_SIZE, DEFAULT_WIDTHS
from ensembles.benchmark.cost.timing import interleaved_times, median, quartiles
from ensembles.benchmark.report import model_name
from ensembles.multihost import local_mesh

__all__ = [
    "Options",
    "Timed",
    "compile_methods",
    "cost_row",
    "run_benchmark",
    "time_methods",
]


def run_benchmark(
    *,
    models: Sequence[str | Callable[..., Any]] = ("mlp",),
    modes: Sequence[str] = MODES,
    members: Sequence[int] = (1, 2, 4, 8),
    batch: int = 128,
    width: int | None = None,
    image_size: int = DEFAULT_IMAGE_SIZE,
    input_shape: Sequence[int] | None = None,
    impl: str = "xla",
    repeats: int = 10,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Times every method for every model, mode and E; returns one row each.

    The six methods of one (model, mode, E) are compiled, then timed in
    interleaved rounds (2 untimed warm-up calls each), counting the process's
    page faults during each timed call. On CPU, call
    :func:`~ensembles.benchmark.reuse_freed_memory` first, before JAX runs
    anything (``ensembles-bench`` does): else a step whose temporaries pass
    glibc's mmap threshold page-faults on every call, and the times compare
    allocators as much as models. Every ratio is a ratio
    of the printed medians; "the deep ensemble" of the ratios is the faster of
    ``deep_ensemble`` (vmap) and ``deep_ensemble_loop``.

    >>> from ensembles.benchmark import run_benchmark
    >>> rows = run_benchmark(models=["linear"], modes=["forward"], members=[2],
    ...                      batch=2, width=4, repeats=2)
    >>> [row["method"] for row in rows]  # doctest: +NORMALIZE_WHITESPACE
    ['single', 'single_b', 'batchensemble', 'rank1', 'deep_ensemble',
     'deep_ensemble_loop']
    >>> rows[4]["params"] == 2 * rows[0]["params"], rows[0]["ratio_to_single"]
    (True, 1.0)

    Args:
      models: names from :data:`~ensembles.benchmark.MODELS`, or factories
        ``rngs -> nnx.Module`` of your own models.
      modes: names from :data:`~ensembles.benchmark.MODES`.
      members: ensemble sizes E.
      batch: samples per member B.
      width: see :func:`~ensembles.benchmark.build_model`.
      image_size: the CNN's image height and width.
      input_shape: one example's shape, for the factories in ``models``.
      impl: the BatchEnsemble op implementation.
      repeats: timed rounds.
      seed: seed of parameters and data.
      progress: called with a status line before each stage, and with ``""``
        at the end.

    Returns:
      One row (a dict) per method, model, mode and E, in table order
      (:func:`cost_row` says what each holds).
    """
    show = progress or (lambda message: None)
    options = Options(batch, width, image_size, input_shape, impl, seed)
    rows: list[dict[str, Any]] = []
    # Every array here lives on this process's first device: the ops take their
    # one-device formulation, also in a run of several processes.
    with local_mesh():
        groups = list(itertools.product(models, modes, members))
        for index, (model, mode, num_members) in enumerate(groups, 1):
            name = model_name(model)
            where = f"[{index}/{len(groups)}] {name} {mode} E={num_members}"
            prepared = compile_methods(model, mode, num_members, options, where, show)
            show(f"{where}: timing {repeats} rounds")
            timed = time_methods(prepared, repeats)
            config = {"model": name, "mode": mode, "members": num_members}
            config.update(options.row(model))
            rows += [cost_row(method, timed, config) for method in METHOD_TABLE]
            del prepared, timed
    show("")
    return rows


@dataclasses.dataclass(frozen=True)
class Options:
    """What every method of a run is prepared with: ``run_benchmark``'s options.

    Attributes:
      batch: samples per member B.
      width: the benchmark's models' width (``None``: each one's default).
      image_size: the CNN's image height and width.
      input_shape: a factory's example shape.
      impl: the BatchEnsemble op implementation.
      seed: seed of parameters and data.
    """

    batch: int
    width: int | None
    image_size: int
    input_shape: Sequence[int] | None
    impl: str
    seed: int

    def row(self, model: str | Callable[..., Any]) -> dict[str, Any]:
        """A row's ``batch``, ``width`` (``None`` for a factory) and ``impl``."""
        width = None
        if isinstance(model, str):
            width = DEFAULT_WIDTHS[model] if self.width is None else self.width
        return {"batch": self.batch, "width": width, "impl": self.impl}


def compile_methods(
    model: str | Callable[..., Any],
    mode: str,
    num_members: int,
    options: Options,
    where: str,
    show: Callable[[str], None],
) -> dict[str, Prepared]:
    """Every method of the table prepared for one model, mode and E, by name."""
    prepared = {}
    for method in METHOD_TABLE:
        show(f"{where}: compiling {method.name}")
        prepared[method.name] = prepare_method(
            method.name,
            model,
            mode,
            num_members=num_members,
            batch=options.batch,
            width=options.width,
            image_size=options.image_size,
            input_shape=options.input_shape,
            impl=options.impl,
            seed=options.seed,
        )
    return prepared


@dataclasses.dataclass(frozen=True)
class Timed:
    """Every method of one model, mode and E, compiled and timed together.

    Attributes:
      prepared: each method's :class:`~ensembles.benchmark.Prepared`, by name.
      times: each method's timed calls, in seconds.
      faults: each method's page faults per timed call (empty where the
        system does not count them).
      medians: each method's median time.
      best_deep: the name of the faster deep ensemble.
    """

    prepared: dict[str, Prepared]
    times: dict[str, list[float]]
    faults: dict[str, list[int]]
    medians: dict[str, float]
    best_deep: str


def time_methods(prepared: dict[str, Prepared], repeats: int) -> Timed:
    """Times the prepared methods' steps in ``repeats`` interleaved rounds."""
    faults: dict[str, list[int]] = {}
    times = interleaved_times(
        {name: p.step for name, p in prepared.items()}, repeats, page_faults=faults
    )
    medians = {name: median(values) for name, values in times.items()}
    deep = [method.name for method in METHOD_TABLE if method.deep is not None]
    return Timed(prepared, times, faults, medians, min(deep, key=medians.get))


def cost_row(
    method: CostMethod, timed: Timed, config: dict[str, Any]
) -> dict[str, Any]:
    """One method's row: its configuration, times, ratios, parameters, memory.

    Args:
      method: the method.
      timed: every method of its model, mode and E, timed.
      config: ``model`` (its name), ``mode``, ``members``, ``batch``,
        ``width`` (``None`` for a factory) and ``impl``.

    Returns:
      The method, the configuration (with ``loss``, what a train step
      minimises: ``"softmax cross-entropy"``, ``"squared error"`` for a model
      with one output, ``None`` in forward mode), times (``median_s``,
      ``q1_s``, ``q3_s``, ``times_s``), ``samples_per_s``, ratios of medians
      (``ratio_to_single``, over one model on the same ``E*B`` rows;
      ``ratio_to_single_b``, over one model on ``B`` rows, what a prediction
      costs without an ensemble; ``speedup_vs_deep_ensemble`` and
      ``speedup_vs_deep_ensemble_loop``; ``speedup_vs_best_deep_ensemble``
      over the faster of the two, named in ``best_deep_ensemble``),
      ``params``, ``param_bytes`` and XLA's memory analysis
      (``argument_bytes``, ``output_bytes``, ``alias_bytes``, ``temp_bytes``,
      ``total_bytes``), with the ratio of parameters to the faster deep
      ensemble's (both hold E models) and of memory to the vmapped deep
      ensemble's (``deep_ensemble``, all E models in one step as the other
      methods run; the loop's is the arguments and outputs of its E calls
      and the temporaries of one), and ``page_faults_per_step`` (the median
      over the timed calls, ``None`` where the system does not count them;
      thousands mean the step got fresh memory from the system on most
      calls, and its time includes that: see
      :func:`~ensembles.benchmark.reuse_freed_memory`).
    """
    p, medians = timed.prepared[method.name], timed.medians
    median_s = medians[method.name]
    q1, q3 = quartiles(timed.times[method.name])
    samples = method.samples(config["members"], config["batch"])
    faults = timed.faults[method.name]
    return {
        "method": method.name,
        **config,
        "loss": p.loss,
        "samples": samples,
        "median_s": median_s,
        "q1_s": q1,
        "q3_s": q3,
        "samples_per_s": samples / median_s,
        "ratio_to_single": median_s / medians[SINGLE.name],
        "ratio_to_single_b": median_s / medians[SINGLE_B.name],
        "speedup_vs_deep_ensemble": medians[DEEP_ENSEMBLE.name] / median_s,
        "speedup_vs_deep_ensemble_loop": medians[DEEP_ENSEMBLE_LOOP.name] / median_s,
        "best_deep_ensemble": timed.best_deep,
        "speedup_vs_best_deep_ensemble": medians[timed.best_deep] / median_s,
        "params": p.num_params,
        "param_bytes": p.param_bytes,
        "params_ratio_to_deep_ensemble": (
            p.num_params / timed.prepared[timed.best_deep].num_params
        ),
        "argument_bytes": p.memory.argument_bytes,
        "output_bytes": p.memory.output_bytes,
        "alias_bytes": p.memory.alias_bytes,
        "temp_bytes": p.memory.temp_bytes,
        "total_bytes": p.memory.total_bytes,
        # Against the deep ensemble that holds all E models at once, as every
        # other method does (the loop's figure counts one call's temporaries:
        # its calls run apart).
        "memory_ratio_to_deep_ensemble": (
            p.memory.total_bytes / timed.prepared[DEEP_ENSEMBLE.name].memory.total_bytes
        ),
        "page_faults_per_step": median(faults) if faults else None,
        "times_s": timed.times[method.name],
    }
