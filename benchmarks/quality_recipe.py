"""Which BatchEnsemble recipe choices matter: the table of docs/training.md.

Trains the quality benchmark's models (``ensembles-bench --quality``: MNIST-1D,
E = 4, 2,000 AdamW steps) with BatchEnsemble recipes that differ in one choice
from the library's (fast-weight init, fast-weight learning-rate multiplier,
tiled or per-member batches), beside one model, MC dropout and a deep
ensemble, over several seeds, and prints a Markdown table of means.

    python benchmarks/quality_recipe.py [--model cnn] [--seeds 3]
"""

import argparse
import sys

import ensembles
from ensembles.benchmark.quality import (
    _gap_closed,
    evaluate,
    split_validation,
    summarize,
)
from ensembles.benchmark.quality_data import load_quality_data
from ensembles.benchmark.quality_methods import FAST_LR_MULTIPLIER, train_method

init = ensembles.initializers
DEFAULT = {}
# name: (method, batchensemble recipe overrides)
RECIPES = {
    "single": ("single", DEFAULT),
    "mc_dropout": ("mc_dropout", DEFAULT),
    "deep_ensemble": ("deep_ensemble", DEFAULT),
    "batchensemble (the recipe)": ("batchensemble", DEFAULT),
    "init N(1, 0.5)": ("batchensemble", {"fast_weight_init": init.normal(1.0, 0.5)}),
    "init N(1, 0.5), fast lr x1": (
        "batchensemble",
        {"fast_weight_init": init.normal(1.0, 0.5), "fast_lr_multiplier": 1.0},
    ),
    "init N(1, 0.6) (the default until 2026-11-25)": (
        "batchensemble",
        {"fast_weight_init": init.normal(1.0, 0.6)},
    ),
    "init N(1, 1.0)": ("batchensemble", {"fast_weight_init": init.normal(1.0, 1.0)}),
    "init random_sign(0.5)": (
        "batchensemble",
        {"fast_weight_init": init.random_sign(0.5)},
    ),
    "fast lr x1": ("batchensemble", {"fast_lr_multiplier": 1.0}),
    "per-member batches": ("batchensemble", {"tiled": False}),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument(
        "--recipes",
        type=lambda text: text.split(","),
        default=list(RECIPES),
        help="comma-separated names of RECIPES to run (default: all)",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.recipes if name not in RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; choose from {list(RECIPES)}")
    data, x_valid, y_valid = split_validation(load_quality_data())
    rows = []
    for name in args.recipes:
        method, overrides = RECIPES[name]
        for seed in range(args.seeds):
            print(f"{name}, seed {seed}", file=sys.stderr, flush=True)
            trained = train_method(
                method,
                args.model,
                data.x_train,
                data.y_train,
                num_members=args.members,
                seed=seed,
                **overrides,
            )
            # summarize groups by "method": one group per recipe name.
            rows.append(
                {
                    "method": name,
                    "model": args.model,
                    "members": args.members,
                    "seed": seed,
                    "params": trained.params,
                    "train_s": trained.train_s,
                    **evaluate(trained, data, x_valid=x_valid, y_valid=y_valid),
                }
            )
    summary = {entry["method"]: entry for entry in summarize(rows)}

    columns = {
        "acc": lambda e: e["in_distribution"]["accuracy"],
        "NLL": lambda e: e["in_distribution"]["nll"],
        "ECE": lambda e: e["in_distribution"]["ece"],
        "shift NLL": lambda e: e["shift_mean"]["nll"],
        "shift ECE": lambda e: e["shift_mean"]["ece"],
        "shift 5 NLL": lambda e: e["shift"][-1]["nll"],
        "shuffled AUROC MI": lambda e: e["ood"]["shuffled"]["auroc_mi"],
    }
    print(
        f"{args.model}, E={args.members}, mean of {args.seeds} seeds; the recipe: "
        f"the library's default init, fast lr x{FAST_LR_MULTIPLIER}, tiled "
        f"batches; other rows change one choice. 'gap' is the share of the NLL "
        f"gap under shift from single to deep_ensemble closed."
    )
    print()
    print("| recipe | " + " | ".join(columns) + " | gap |")
    print("|:---|" + "---:|" * (len(columns) + 1))
    single, deep = summary.get("single"), summary.get("deep_ensemble")
    for name, entry in summary.items():
        cells = []
        for get in columns.values():
            value = get(entry)["mean"]
            cells.append("n/a" if value is None else f"{value:.3f}")
        gap = None
        if single is not None and deep is not None:  # run both for the gap
            where = "shift_mean"
            gap = _gap_closed(single[where], entry[where], deep[where])
        cells.append("n/a" if gap is None else f"{gap:.0%}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
