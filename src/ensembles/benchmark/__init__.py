"""The ``ensembles-bench`` command: what an ensemble of E costs, and what it buys.

It times one plain model, its BatchEnsemble conversion and a deep ensemble of
E models (vmapped, and in a Python loop) on the same ``E*B`` member-samples,
and reports throughput, parameters and XLA's memory analysis. With
``--quality`` it trains one model, a BatchEnsemble, a deep ensemble and MC
dropout on MNIST-1D (generated offline) and reports accuracy, NLL, ECE and
Brier score in distribution and under shift, and out-of-distribution AUROC.
Run it as ``ensembles-bench`` or ``python -m ensembles.benchmark``; ``--help``
lists the options.
"""

from ensembles.benchmark.cli import build_parser, main
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
from ensembles.benchmark.quality import (
    METRICS,
    VALIDATION_FRACTION,
    evaluate,
    run_quality,
    split_validation,
    validation_size,
)
from ensembles.benchmark.quality_checks import check_run
from ensembles.benchmark.quality_data import (
    SEVERITIES,
    SHIFTS,
    QualityData,
    load_quality_data,
)
from ensembles.benchmark.quality_methods import (
    QUALITY_METHODS,
    Trained,
    train_method,
)
from ensembles.benchmark.quality_models import QUALITY_MODELS, build_quality_model
from ensembles.benchmark.quality_plots import write_quality_plot
from ensembles.benchmark.quality_regression import (
    REGRESSION_METRICS,
    evaluate_regression,
)
from ensembles.benchmark.quality_report import (
    format_quality,
    summarize,
)
from ensembles.benchmark.speed import run_benchmark
from ensembles.benchmark.timing import (
    interleaved_times,
    median,
    page_faults_per_call,
    paired_ratio,
    quartiles,
    reuse_freed_memory,
)

__all__ = [
    "DEFAULT_IMAGE_SIZE",
    "DEFAULT_WIDTHS",
    "LEARNING_RATE",
    "METHODS",
    "METRICS",
    "MODELS",
    "MODES",
    "NUM_CLASSES",
    "QUALITY_METHODS",
    "QUALITY_MODELS",
    "REGRESSION_METRICS",
    "SEVERITIES",
    "SHIFTS",
    "VALIDATION_FRACTION",
    "MemoryStats",
    "Prepared",
    "QualityData",
    "Trained",
    "build_model",
    "build_parser",
    "build_quality_model",
    "check_convertible",
    "check_run",
    "evaluate",
    "evaluate_regression",
    "format_quality",
    "interleaved_times",
    "load_quality_data",
    "main",
    "median",
    "model_inputs",
    "page_faults_per_call",
    "paired_ratio",
    "prepare_method",
    "quartiles",
    "reuse_freed_memory",
    "run_benchmark",
    "run_quality",
    "split_validation",
    "summarize",
    "train_method",
    "validation_size",
    "write_quality_plot",
]
