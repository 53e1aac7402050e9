"""The ``ensembles-bench`` command: what an ensemble of E costs.

It times one plain model, its BatchEnsemble conversion and a deep ensemble of
E models (vmapped, and in a Python loop) on the same ``E*B`` member-samples,
and reports throughput, parameters and XLA's memory analysis. Run it as
``ensembles-bench`` or ``python -m ensembles.benchmark``; ``--help`` lists the
options.
"""

from ensembles.benchmark.cli import build_parser, main, run_benchmark
from ensembles.benchmark.methods import (
    LEARNING_RATE,
    METHODS,
    MODES,
    MemoryStats,
    Prepared,
    check_convertible,
    prepare_method,
)
from ensembles.benchmark.models import (
    DEFAULT_IMAGE_SIZE,
    DEFAULT_WIDTHS,
    MODELS,
    NUM_CLASSES,
    build_model,
    model_inputs,
)
from ensembles.benchmark.timing import (
    interleaved_times,
    median,
    paired_ratio,
    quartiles,
)

__all__ = [
    "DEFAULT_IMAGE_SIZE",
    "DEFAULT_WIDTHS",
    "LEARNING_RATE",
    "METHODS",
    "MODELS",
    "MODES",
    "NUM_CLASSES",
    "MemoryStats",
    "Prepared",
    "build_model",
    "build_parser",
    "check_convertible",
    "interleaved_times",
    "main",
    "median",
    "model_inputs",
    "paired_ratio",
    "prepare_method",
    "quartiles",
    "run_benchmark",
]
