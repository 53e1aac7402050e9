"""Choosing the regression recipe across tasks, leave one task out (docs/regression.md).

Trains ``single``, ``batchensemble`` and ``deep_ensemble`` of the quality
benchmark (``ensembles-bench --quality``) on every regression task with each
candidate recipe, over the choosing seeds (10 and 11: not the seeds the
README reports), and ranks the candidates per task, method and seed on four
measures of the recalibrated predictive, lower is better: NLL and CRPS in
distribution, NLL and CRPS under shift (means over the severities). A
candidate's score on a task is its mean rank there; leave one task out: for
each task, the candidate with the best mean score on the OTHER tasks is the
one chosen for it, so that the choice is judged on a task it was not chosen
on::

    python benchmarks/regression_defaults.py --json recipes.json
    python benchmarks/regression_defaults.py --report recipes.json

A recipe is the beta-NLL exponent, whether the parameters of the best check
of the validation NLL are kept (early stopping;
``quality.methods.EARLY_STOPPING_CHECKS`` checks, 20 when the recipe was
chosen on 2026-11-26), and the steps (a multiple of the task's default);
``--inits`` compares BatchEnsemble's fast-weight inits under one recipe.
"""

import argparse
import json
import statistics
import sys

import ensembles
from ensembles.benchmark.quality.methods import train_method
from ensembles.benchmark.quality.regression.scores import (
    TargetScale,
    evaluate_regression,
)
from ensembles.benchmark.quality.regression.tasks import REGRESSION_TASKS
from ensembles.benchmark.quality.run import split_validation
from ensembles.benchmark.quality.tasks import TASK_STEPS, load_task

SEEDS = (10, 11)
E = 4
METHODS = ("single", "batchensemble", "deep_ensemble")
MEASURES = (
    ("in_distribution", "nll"),
    ("in_distribution", "crps"),
    ("shift_mean", "nll"),
    ("shift_mean", "crps"),
)


def candidates(betas=(0.0, 0.5), stopping=(False, True), factors=(1.0,)):
    return {
        f"beta {beta}, {'early stopping' if stop else 'last step'}, steps x{f}": {
            "beta": beta,
            "stop": stop,
            "factor": f,
            "init": None,
            "batchensemble_only": False,
        }
        for beta in betas
        for stop in stopping
        for f in factors
    }


def init_candidates(stds, beta, stop):
    """BatchEnsemble's fast weights from N(1, std^2) (the input layer's r random
    signs, as the library's default); ``None`` is the library's default."""
    return {
        f"init {'default' if std is None else f'N(1, {std})'}": {
            "beta": beta,
            "stop": stop,
            "factor": 1.0,
            "init": std,
            "batchensemble_only": True,
        }
        for std in stds
    }


def measure(task, recipes, seeds, show):
    data = load_task(task)
    train, x_valid, y_valid = split_validation(data)
    scale = TargetScale(train.y_train)
    y_train = scale.standardise(train.y_train)
    stopping = (x_valid, scale.standardise(y_valid))
    results = []
    for name, recipe in recipes.items():
        steps = max(1, round(TASK_STEPS[task] * recipe["factor"]))
        options = {}
        if recipe["init"] is not None:
            options["fast_weight_init"] = ensembles.initializers.normal(
                1.0, recipe["init"]
            )
        methods = ("batchensemble",) if recipe["batchensemble_only"] else METHODS
        for seed in seeds:
            for method in methods:
                show(f"{task} {name} seed {seed} {method}")
                trained = train_method(
                    method,
                    "mlp",
                    train.x_train,
                    y_train,
                    num_members=E,
                    steps=steps,
                    seed=seed,
                    regression=True,
                    beta=recipe["beta"],
                    early_stopping=stopping if recipe["stop"] else None,
                    **options,
                )
                result = evaluate_regression(
                    trained, data, x_valid=x_valid, y_valid=y_valid, scale=scale
                )
                recal = result["recalibrated"]
                results.append(
                    {
                        "task": task,
                        "recipe": name,
                        "seed": seed,
                        "method": method,
                        "best_step": trained.best_step,
                        "scale": result["std_scale"],
                        **{f"{w} {m}": recal[w][m] for w, m in MEASURES},
                        "as trained": {f"{w} {m}": result[w][m] for w, m in MEASURES},
                        "coverage90": recal["in_distribution"]["coverage90"],
                    }
                )
    return results


def report(results):
    tasks = list(dict.fromkeys(r["task"] for r in results))
    recipes = list(dict.fromkeys(r["recipe"] for r in results))
    # Mean rank of each recipe per (task, seed, method, measure).
    ranks = {(t, c): [] for t in tasks for c in recipes}
    groups = {}
    for r in results:
        groups.setdefault((r["task"], r["seed"], r["method"]), []).append(r)
    for (task, _, _), group in groups.items():
        for where, metric in MEASURES:
            key = f"{where} {metric}"
            ordered = sorted(group, key=lambda r: r[key])
            for position, r in enumerate(ordered, 1):
                ranks[(task, r["recipe"])].append(position)
    score = {k: statistics.fmean(v) for k, v in ranks.items() if v}
    lines = ["mean rank per task (lower is better):", ""]
    width = max(map(len, recipes))
    lines.append(" " * width + "  " + "  ".join(f"{t[:16]:>16}" for t in tasks))
    for c in recipes:
        cells = "  ".join(f"{score.get((t, c), float('nan')):16.2f}" for t in tasks)
        lines.append(f"{c:<{width}}  {cells}")
    lines += ["", "leave one task out: chosen on the other tasks, and its rank here:"]
    for held in tasks:
        others = [t for t in tasks if t != held]
        best = min(
            recipes, key=lambda c: statistics.fmean(score[(t, c)] for t in others)
        )
        lines.append(f"  {held}: {best} (rank here {score[(held, best)]:.2f})")
    overall = min(recipes, key=lambda c: statistics.fmean(score[(t, c)] for t in tasks))
    lines += ["", f"best over every task: {overall}", ""]
    lines.append(
        "means over seeds, recalibrated (NLL, CRPS in distribution; under shift):"
    )
    for task in tasks:
        for method in METHODS:
            for c in recipes:
                rows = [
                    r
                    for r in results
                    if (r["task"], r["method"], r["recipe"]) == (task, method, c)
                ]
                if not rows:
                    continue
                cells = " / ".join(
                    f"{statistics.fmean(r[f'{w} {m}'] for r in rows):.3f}"
                    for w, m in MEASURES
                )
                steps = [r["best_step"] for r in rows]
                lines.append(
                    f"  {task:<16} {method:<14} {c:<{width}}  {cells}  steps {steps}"
                )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(REGRESSION_TASKS))
    parser.add_argument("--betas", default="0,0.5")
    parser.add_argument("--stopping", default="0,1", help="0: last step, 1: best check")
    parser.add_argument("--factors", default="1", help="multiples of the task's steps")
    parser.add_argument(
        "--inits",
        default=None,
        help="BatchEnsemble only: fast-weight init stds ('default': the library's), "
        "with the first --betas and --stopping",
    )
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--json", default=None)
    parser.add_argument("--report", nargs="+", default=None)
    args = parser.parse_args(argv)
    if args.report:
        results = []
        for path in args.report:
            with open(path) as handle:
                results += json.load(handle)
        print(report(results))
        return 0
    betas = tuple(float(b) for b in args.betas.split(","))
    stopping = tuple(bool(int(s)) for s in args.stopping.split(","))
    if args.inits:
        stds = [None if v == "default" else float(v) for v in args.inits.split(",")]
        recipes = init_candidates(stds, betas[0], stopping[0])
    else:
        factors = tuple(float(f) for f in args.factors.split(","))
        recipes = candidates(betas, stopping, factors)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    results = []
    for task in args.tasks.split(","):
        results += measure(
            task, recipes, seeds, lambda m: print(m, file=sys.stderr, flush=True)
        )
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
