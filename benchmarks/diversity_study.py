"""What makes BatchEnsemble members diverse enough to beat one recalibrated model?

Trains one model (``single``), a deep ensemble and BatchEnsemble recipes
(``CANDIDATES``) on the quality benchmark's tasks and models, every one
measured as trained and recalibrated (its own temperature, fitted on the
validation split held out of the training data, never the test set:
``ensembles.benchmark.quality.classification.scores.evaluate``). Results go to
a JSON file, one row per (task, model, E, seed, recipe), and a run resumes
from it, so a long study can be stopped and restarted::

    python benchmarks/diversity_study.py --json study.json \\
        --tasks mnist1d,digits,tabular --members 4 --seeds 10,11,12
    python benchmarks/diversity_study.py --report study.json

The report gives, per recipe, the mean over seeds of every task and model,
and a leave-one-task-out choice: for each task, the recipe with the best mean
rank on the OTHER tasks (ranks per task, model, E and seed of the recalibrated
NLL in distribution and under shift), among the recipes that are, as trained,
no more underconfident than the deep ensemble (ECE as trained at most the deep
ensemble's, on average over the other tasks).
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

import ensembles
from ensembles.benchmark.quality.classification.mnist1d import SHIFTS, mnist1d_sets
from ensembles.benchmark.quality.classification.scores import evaluate
from ensembles.benchmark.quality.methods import BATCH_SIZE, train_method
from ensembles.benchmark.quality.run import split_validation
from ensembles.benchmark.quality.tasks import TASK_MODELS, TASK_STEPS, load_task

init = ensembles.initializers

#: Recipes (``std x``: every fast weight from N(1, x**2); ``signs first``:
#: the first layer's r random signs): train_method keyword arguments
#: ("method" defaults to batchensemble; "steps_factor" multiplies the task's
#: steps). "default" is whatever the library's defaults are when it runs
#: (since 2026-11-26 those of "signs first std 0.5 rest", drawn by
#: ``to_batch_ensemble`` itself); "std 0.75" is the default it replaced.
CANDIDATES = {
    "default": {},
    "std 0.75": {"fast_weight_init": init.normal(1.0, 0.75)},
    "std 0.5": {"fast_weight_init": init.normal(1.0, 0.5)},
    "std 0.25": {"fast_weight_init": init.normal(1.0, 0.25)},
    "member batches": {"tiled": False},
    "std 0.5 member batches": {
        "fast_weight_init": init.normal(1.0, 0.5),
        "tiled": False,
    },
    "TabM signs": {
        "fast_weight_init": init.ones(),
        "first_layer_init": (init.random_sign(), init.ones()),
    },
    "TabM signs member batches": {
        "fast_weight_init": init.ones(),
        "first_layer_init": (init.random_sign(), init.ones()),
        "tiled": False,
    },
    "signs first std 0.25 rest": {
        "fast_weight_init": init.normal(1.0, 0.25),
        "first_layer_init": (init.random_sign(), init.normal(1.0, 0.25)),
    },
    "signs first std 0.5 rest": {
        "fast_weight_init": init.normal(1.0, 0.5),
        "first_layer_init": (init.random_sign(), init.normal(1.0, 0.5)),
    },
    "signs first std 0.1 rest": {
        "fast_weight_init": init.normal(1.0, 0.1),
        "first_layer_init": (init.random_sign(), init.normal(1.0, 0.1)),
    },
    "signs first std 0.25 rest fast lr x2": {
        "fast_weight_init": init.normal(1.0, 0.25),
        "first_layer_init": (init.random_sign(), init.normal(1.0, 0.25)),
        "fast_lr_multiplier": 2.0,
    },
    "signs every r std 0.25 s": {
        "fast_weight_init": (init.random_sign(), init.normal(1.0, 0.25)),
    },
    "fast lr x2": {"fast_lr_multiplier": 2.0},
    "NCL 0.5": {"diversity": 0.5},
    "2x steps": {"steps_factor": 2},
    "rank1": {"method": "rank1"},
    "rank1 signs first std 0.5 rest": {
        "method": "rank1",
        "fast_weight_init": init.normal(1.0, 0.5),
        "first_layer_init": (init.random_sign(), init.normal(1.0, 0.5)),
    },
    "rank1 signs first std 0.25 rest": {
        "method": "rank1",
        "fast_weight_init": init.normal(1.0, 0.25),
        "first_layer_init": (init.random_sign(), init.normal(1.0, 0.25)),
    },
    # Issue 59: members that differ where it counts.
    "independent head": {"independent_head": True},
    "independent head member batches": {"independent_head": True, "tiled": False},
    # The same with E = 8 members at the rows of E = 4 per step (B halved):
    # more members for the same training compute ("members" overrides the
    # study's E; its rows say 8).
    "independent head member batches E8": {
        "independent_head": True,
        "tiled": False,
        "members": 8,
        "batch_size": BATCH_SIZE // 2,
    },
    # uncertainty-baselines' rank-1 recipe (baselines/cifar/rank1_bnn.py):
    # random +-1 fast-weight means, the fast weights at the full learning
    # rate; the prior (0.1 about 1), the KL annealing and 4 draws per member
    # at prediction are ours already.
    "rank1 UB": {
        "method": "rank1",
        "fast_weight_init": init.random_sign(),
        "fast_lr_multiplier": 1.0,
    },
}
BASELINES = {"single": {"method": "single"}, "deep": {"method": "deep_ensemble"}}


def load_check_task():
    """An MNIST-1D draw none of the recipes was chosen on (other seeds)."""
    return mnist1d_sets(
        8000,
        2000,
        1000,
        shifts=SHIFTS,
        seeds=(7070, 7100, 7099, 7098),
        name="mnist1d_check",
    )


def _load(task):
    return load_check_task() if task == "mnist1d_check" else load_task(task)


def _models(task):
    return ("cnn",) if task == "mnist1d_check" else TASK_MODELS[task]


def _steps(task):
    return TASK_STEPS["mnist1d" if task == "mnist1d_check" else task]


def _key(row):
    return (
        f"{row['task']}|{row['model']}|{row['members']}|{row['seed']}|{row['recipe']}"
    )


def run(args):
    rows = []
    if os.path.exists(args.json):
        with open(args.json) as f:
            rows = json.load(f)
    done = {_key(row) for row in rows}
    recipes = {**BASELINES, **{n: CANDIDATES[n] for n in args.recipes}}
    datasets = {task: split_validation(_load(task)) for task in args.tasks}
    for seed in args.seeds:  # a whole screen per seed, then the next seed
        for task, (data, x_valid, y_valid) in datasets.items():
            for model in args.models or _models(task):
                if model not in _models(task):
                    continue
                for members in args.members:
                    for name, recipe in recipes.items():
                        options = dict(recipe)
                        e = options.pop("members", members)
                        e = 1 if name == "single" else e
                        row = {
                            "task": task,
                            "model": model,
                            "members": e,
                            "seed": seed,
                            "recipe": name,
                        }
                        if _key(row) in done:
                            continue
                        method = options.pop("method", "batchensemble")
                        steps = _steps(task) * options.pop("steps_factor", 1)
                        began = time.time()
                        trained = train_method(
                            method,
                            model,
                            data.x_train,
                            data.y_train,
                            num_members=e,
                            steps=steps,
                            seed=seed,
                            num_classes=data.num_classes,
                            **options,
                        )
                        row.update(
                            evaluate(trained, data, x_valid=x_valid, y_valid=y_valid)
                        )
                        row["train_s"] = trained.train_s
                        rows.append(row)
                        done.add(_key(row))
                        with open(args.json + ".tmp", "w") as f:
                            json.dump(rows, f)
                        os.replace(args.json + ".tmp", args.json)
                        print(
                            f"{task} {model} E={e} seed {seed} {name}: "
                            f"{time.time() - began:.0f} s, recal NLL "
                            f"{row['recalibrated']['in_distribution']['nll']:.3f} "
                            f"shift {row['recalibrated']['shift_mean']['nll']:.3f}",
                            file=sys.stderr,
                            flush=True,
                        )


# ------------------------------------------------------------------ report

MEASURES = {
    "NLL cal": ("recalibrated", "in_distribution", "nll"),
    "shift NLL cal": ("recalibrated", "shift_mean", "nll"),
    "ECE cal": ("recalibrated", "in_distribution", "ece"),
    "shift ECE cal": ("recalibrated", "shift_mean", "ece"),
    "ECE": ("in_distribution", "ece"),
    "T": ("temperature",),
    "acc": ("in_distribution", "accuracy"),
    "shift NLL": ("shift_mean", "nll"),
    # The calibrations of ensembles.benchmark.quality.calibration.
    "NLL members noisy": ("calibrations", "members_noisy", "in_distribution", "nll"),
    "shift NLL members noisy": ("calibrations", "members_noisy", "shift_mean", "nll"),
    "ECE members noisy": ("calibrations", "members_noisy", "in_distribution", "ece"),
    "shift NLL pooled noisy": ("calibrations", "pooled_noisy", "shift_mean", "nll"),
    "KL": ("diversity", "in_distribution", "pairwise_kl"),
    "shift KL": ("diversity", "shift_mean", "pairwise_kl"),
}


def _value(row, measure):
    """A row's ``measure`` (``nan`` where the row predates it)."""
    value = row
    for key in MEASURES[measure]:
        if not isinstance(value, dict) or key not in value:
            return float("nan")
        value = value[key]
    return value


def _cells(rows):
    """{(task, model, E): {recipe: {seed: row}}}, baselines under every E."""
    cells = {}
    for row in rows:
        if row["recipe"] == "single":
            continue
        cells.setdefault((row["task"], row["model"], row["members"]), {}).setdefault(
            row["recipe"], {}
        )[row["seed"]] = row
    for row in rows:
        if row["recipe"] != "single":
            continue
        for (task, model, _), recipes in cells.items():
            if (task, model) == (row["task"], row["model"]):
                recipes.setdefault("single", {})[row["seed"]] = row
    return cells


def _mean(recipes, recipe, measure, seeds):
    return statistics.fmean(_value(recipes[recipe][s], measure) for s in seeds)


def report(paths, tasks=None, recipes=None, choosing=("mnist1d", "digits", "tabular")):
    """Prints the tables; ``tasks``/``recipes`` restrict them (ranks are only
    comparable among recipes measured on the same tasks and seeds)."""
    rows = []
    for path in paths:
        with open(path) as f:
            rows += json.load(f)
    rows = [
        r
        for r in rows
        if (tasks is None or r["task"] in tasks)
        and (recipes is None or r["recipe"] in (*recipes, *BASELINES))
    ]
    cells = _cells(rows)
    ranks = {}  # (task, recipe) -> list of ranks
    underconfident = {}  # (task, recipe) -> list of ECE - deep's ECE
    for (task, model, members), recipes in sorted(cells.items()):
        if "single" not in recipes or "deep" not in recipes:
            continue
        seeds = sorted(set.intersection(*(set(r) for r in recipes.values())))
        if not seeds:
            continue
        names = [n for n in recipes if n not in ("single", "deep")]
        print(f"\n**{task}, {model}, E={members}** (seeds {seeds})\n")
        shown = list(MEASURES)
        print("| recipe | " + " | ".join(shown) + " |")
        print("|:---|" + "---:|" * len(shown))
        for name in ["single", "deep", *names]:
            cells_text = [f"{_mean(recipes, name, m, seeds):.3f}" for m in shown]
            print(f"| {name} | " + " | ".join(cells_text) + " |")
        for seed in seeds:
            for measure in ("NLL cal", "shift NLL cal"):
                values = {n: _value(recipes[n][seed], measure) for n in names}
                order = sorted(values, key=values.get)
                for rank, name in enumerate(order, 1):
                    ranks.setdefault((task, name), []).append(rank)
            deep_ece = _value(recipes["deep"][seed], "ECE")
            for name in names:
                underconfident.setdefault((task, name), []).append(
                    _value(recipes[name][seed], "ECE") - deep_ece
                )
    tasks = sorted({task for task, _ in ranks})
    names = sorted({name for _, name in ranks})
    print(
        "\nMean rank (recalibrated NLL in distribution and under shift; lower is "
        "better) and mean ECE as trained minus the deep ensemble's, per task:\n"
    )
    print("| recipe | " + " | ".join(tasks) + " |")
    print("|:---|" + "---:|" * len(tasks))
    for name in names:
        cells_text = [
            f"{statistics.fmean(ranks[(t, name)]):.2f} / "
            f"{statistics.fmean(underconfident[(t, name)]):+.3f}"
            if (t, name) in ranks
            else "n/a"
            for t in tasks
        ]
        print(f"| {name} | " + " | ".join(cells_text) + " |")
    print(
        "\nLeave one task out (chosen on the other tasks, among recipes whose ECE "
        "as trained is on average at most the deep ensemble's there):\n"
    )
    for held in tasks:
        others = [t for t in tasks if t != held and t in choosing]
        scored = []
        for name in names:
            if not all((t, name) in ranks for t in others):
                continue
            excess = statistics.fmean(
                v for t in others for v in underconfident[(t, name)]
            )
            score = statistics.fmean(statistics.fmean(ranks[(t, name)]) for t in others)
            scored.append((excess > 0, score, name))
        scored.sort()
        if scored:
            print(
                f"- {held}: {scored[0][2]} (rank {scored[0][1]:.2f} on the others"
                + (
                    "; none is as confident as the deep ensemble"
                    if scored[0][0]
                    else ""
                )
                + ")"
            )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json",
        default="diversity_study.json",
        help="results file, read to resume and written after every row",
    )
    parser.add_argument(
        "--tasks",
        default="mnist1d,digits,tabular",
        help="comma-separated: mnist1d, digits, tabular, mnist1d_harsh, "
        "mnist1d_check (an MNIST-1D draw of other seeds, CNN only)",
    )
    parser.add_argument(
        "--models", default=None, help="cnn and/or mlp (default: each task's)"
    )
    parser.add_argument("--members", default="4", help="ensemble sizes, e.g. 4,8")
    parser.add_argument("--seeds", default="10,11,12", help="e.g. 10,11,12")
    parser.add_argument(
        "--recipes",
        default=",".join(CANDIDATES),
        help="comma-separated names of CANDIDATES (single and deep always run)",
    )
    parser.add_argument(
        "--report",
        nargs="*",
        default=None,
        metavar="JSON",
        help="print the tables of these results files (none: --json's) and stop",
    )
    parser.add_argument(
        "--report-tasks", default=None, help="the report's tasks (default: all)"
    )
    parser.add_argument(
        "--report-recipes",
        default=None,
        help="the report's recipes (ranks compare only recipes run on the same "
        "tasks and seeds)",
    )
    args = parser.parse_args(argv)
    if args.report is not None:
        report(
            args.report or [args.json],
            tasks=args.report_tasks.split(",") if args.report_tasks else None,
            recipes=args.report_recipes.split(",") if args.report_recipes else None,
        )
        return
    args.tasks = args.tasks.split(",")
    args.models = args.models.split(",") if args.models else None
    args.members = [int(v) for v in args.members.split(",")]
    args.seeds = [int(v) for v in args.seeds.split(",")]
    args.recipes = args.recipes.split(",")
    unknown = [r for r in args.recipes if r not in CANDIDATES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; choose from {list(CANDIDATES)}")
    np.seterr(all="ignore")
    run(args)


if __name__ == "__main__":
    main()
