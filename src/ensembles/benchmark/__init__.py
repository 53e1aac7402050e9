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
from ensembles.benchmark.cost.checks import check_convertible
from ensembles.benchmark.cost.methods import (
    LEARNING_RATE,
    METHODS,
    MODES,
    MemoryStats,
    Prepared,
    prepare_method,
)
from ensembles.benchmark.cost.models import (
    DEFAULT_IMAGE_SIZE,
    DEFAULT_WIDTHS,
    MODELS,
    NUM_CLASSES,
    build_model,
    model_inputs,
)
from ensembles.benchmark.cost.speed import run_benchmark
from ensembles.benchmark.cost.timing import (
    interleaved_times,
    median,
    page_faults_per_call,
    paired_ratio,
    quartiles,
    reuse_freed_memory,
)
from ensembles.benchmark.quality.checks import check_run
from ensembles.benchmark.quality.classification.mnist1d import (
    SHIFTS,
    load_quality_data,
)
from ensembles.benchmark.quality.classification.scores import METRICS, evaluate
from ensembles.benchmark.quality.data import SEVERITIES, QualityData
from ensembles.benchmark.quality.methods import (
    QUALITY_METHODS,
    Trained,
    train_method,
)
from ensembles.benchmark.quality.models import QUALITY_MODELS, build_quality_model
from ensembles.benchmark.quality.plots import write_quality_plot
from ensembles.benchmark.quality.regression.scores import (
    REGRESSION_METRICS,
    evaluate_regression,
)
from ensembles.benchmark.quality.report import format_quality, summarize
from ensembles.benchmark.quality.run import (
    VALIDATION_FRACTION,
    run_quality,
    split_validation,
    validation_size,
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
