"""Choosing the from-scratch and rank-1 defaults across tasks (docs/training.md).

Trains the quality benchmark's methods (``ensembles-bench --quality``) with
candidate recipes on every task and model of the choosing set (MNIST-1D CNN
and MLP, digits CNN and MLP, the tabular MLP; E = 4) over the choosing seeds
(10 and 11: not the seeds the README reports), and ranks the candidates per
task, model and seed on four measures, lower is better: NLL and ECE in
distribution, NLL and ECE under shift (mean over the five severities). A
candidate's score on a task is its mean rank there; leave one task out: for
each task, the candidate with the best mean score on the OTHER tasks is the
one chosen for it, so that the choice is judged on a task it was not chosen
on. The harsh MNIST-1D variant is never used here. Stage ``be`` chooses
BatchEnsemble's fast-weight init and learning-rate factor; stage ``rank1``
(run with the chosen BatchEnsemble init) the rank-1 prior and the prediction
draws, then (with those) the posterior's initial scale and the KL annealing::

    python benchmarks/quality_defaults.py --stage be --json be.json
    python benchmarks/quality_defaults.py --stage be --stds 0.9,1.0 --lrs 0.5 \\
        --json be_wide.json
    python benchmarks/quality_defaults.py --report be.json be_wide.json
    python benchmarks/quality_defaults.py --stage rank1 --json r1.json
    python benchmarks/quality_defaults.py --stage rank1 --priors 0.5,1.0 \\
        --draws 4 --json r1_wide.json
    python benchmarks/quality_defaults.py --stage rank1 --priors 0.5 --draws 4 \\
        --posts 0.0316,0.1 --kls 0.2,0.8 --json r1_posterior.json

(what was run for the defaults of 2026-11-25; each stage about 1-2 hours on
the 2-core CPU, docs/training.md has the tables). The rank-1 defaults still
come from stage ``rank1``; BatchEnsemble's fast-weight init was re-chosen on
2026-11-26 on recalibrated figures by ``benchmarks/diversity_study.py``,
which supersedes stage ``be``.
"""

import argparse
import json
import statistics
import sys

import numpy as np

import ensembles
from ensembles.benchmark.quality.classification.scores import evaluate
from ensembles.benchmark.quality.methods import train_method
from ensembles.benchmark.quality.run import split_validation
from ensembles.benchmark.quality.tasks import TASK_MODELS, TASK_STEPS, load_task

init = ensembles.initializers
TASKS = ("mnist1d", "digits", "tabular")
SEEDS = (10, 11)
E = 4
MEASURES = (
    ("in_distribution", "nll"),
    ("in_distribution", "ece"),
    ("shift_mean", "nll"),
    ("shift_mean", "ece"),
)


def be_candidates(stds=(0.4, 0.5, 0.6, 0.75), lrs=(0.5, 1.0)):
    return {
        f"N(1, {std}), fast lr x{lr}": {
            "method": "batchensemble",
            "fast_weight_init": init.normal(1.0, std),
            "fast_lr_multiplier": lr,
        }
        for std in stds
        for lr in lrs
    }


def rank1_candidates(
    std, lr, priors=(0.1, 0.3), draws_tried=(1, 4), posts=(None,), kls=(None,)
):
    """Rank-1 recipes; a ``None`` posterior init or KL annealing is the library's."""
    base = {
        "method": "rank1",
        "fast_weight_init": init.normal(1.0, std),
        "fast_lr_multiplier": lr,
    }
    candidates = {}
    for prior in priors:
        for draws in draws_tried:
            for post in posts:
                for kl in kls:
                    name = f"prior {prior}, {draws} draw{'s' * (draws > 1)}"
                    recipe = {**base, "prior_stddev": prior, "eval_draws": draws}
                    if post is not None:
                        name += f", posterior {post}"
                        recipe["stddev_init"] = init.unconstrained_stddev(post)
                    if kl is not None:
                        name += f", KL annealing {kl}"
                        recipe["kl_annealing"] = kl
                    candidates[name] = recipe
    return candidates


def _measure(result):
    return {f"{where} {metric}": result[where][metric] for where, metric in MEASURES}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=["be", "rank1"], default="be")
    parser.add_argument("--init", type=float, default=0.75, help="rank1: BE init std")
    parser.add_argument("--fast-lr", type=float, default=0.5, help="rank1: BE lr")
    parser.add_argument(
        "--stds", default="0.4,0.5,0.6,0.75", help="be: the init stddevs tried"
    )
    parser.add_argument("--lrs", default="0.5,1.0", help="be: the fast lr factors")
    parser.add_argument("--priors", default="0.1,0.3", help="rank1: prior stddevs")
    parser.add_argument("--draws", default="1,4", help="rank1: prediction draws")
    parser.add_argument(
        "--posts", default=None, help="rank1: posterior init scales (library's)"
    )
    parser.add_argument(
        "--kls", default=None, help="rank1: KL annealing shares (library's)"
    )
    parser.add_argument("--json", default=None, help="write every measurement")
    parser.add_argument(
        "--report",
        nargs="+",
        default=None,
        help="only report: rank the candidates of these JSON files together",
    )
    args = parser.parse_args(argv)
    if args.report:
        records = []
        for path in args.report:
            with open(path) as file:
                records += json.load(file)
        report(records, list(dict.fromkeys(r["candidate"] for r in records)))
        return
    floats = lambda text: tuple(float(v) for v in text.split(","))  # noqa: E731
    candidates = (
        be_candidates(floats(args.stds), floats(args.lrs))
        if args.stage == "be"
        else rank1_candidates(
            args.init,
            args.fast_lr,
            floats(args.priors),
            tuple(int(v) for v in args.draws.split(",")),
            floats(args.posts) if args.posts else (None,),
            floats(args.kls) if args.kls else (None,),
        )
    )
    records = []
    for task in TASKS:
        data, x_valid, y_valid = split_validation(load_task(task))
        for model in TASK_MODELS[task]:
            for seed in SEEDS:
                for name, recipe in candidates.items():
                    print(f"{task} {model} seed {seed}: {name}", file=sys.stderr)
                    options = dict(recipe)
                    method = options.pop("method")
                    trained = train_method(
                        method,
                        model,
                        data.x_train,
                        data.y_train,
                        num_members=E,
                        steps=TASK_STEPS[task],
                        seed=seed,
                        **options,
                    )
                    records.append(
                        {
                            "task": task,
                            "model": model,
                            "seed": seed,
                            "candidate": name,
                            **_measure(
                                evaluate(
                                    trained, data, x_valid=x_valid, y_valid=y_valid
                                )
                            ),
                        }
                    )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(records, file, indent=1)
    report(records, list(candidates))


def report(records, names):
    """Prints mean measures and ranks per task, and the leave-one-task-out choice."""
    measures = [f"{w} {m}" for w, m in MEASURES]
    ranks = {}  # (task, candidate) -> ranks over models, seeds and measures
    for task in TASKS:
        for model in TASK_MODELS[task]:
            for seed in SEEDS:
                group = [
                    r
                    for r in records
                    if (r["task"], r["model"], r["seed"]) == (task, model, seed)
                ]
                for measure in measures:
                    order = sorted(group, key=lambda r, m=measure: r[m])
                    for rank, r in enumerate(order, 1):
                        ranks.setdefault((task, r["candidate"]), []).append(rank)
    score = {key: statistics.fmean(values) for key, values in ranks.items()}
    print("Mean rank per task (lower is better), and the mean measures:")
    print()
    print("| candidate | " + " | ".join(TASKS) + " | " + " | ".join(measures) + " |")
    print("|:---|" + "---:|" * (len(TASKS) + len(measures)))
    for name in names:
        cells = [f"{score[(task, name)]:.2f}" for task in TASKS]
        mine = [r for r in records if r["candidate"] == name]
        cells += [f"{np.mean([r[m] for r in mine]):.3f}" for m in measures]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    print("Leave one task out: the candidate with the best mean rank on the others.")
    for held_out in TASKS:
        others = [t for t in TASKS if t != held_out]
        chosen = min(
            names, key=lambda n: statistics.fmean(score[(t, n)] for t in others)
        )
        best_here = min(names, key=lambda n: score[(held_out, n)])
        print(
            f"- held out {held_out}: chosen {chosen!r} (its rank there "
            f"{score[(held_out, chosen)]:.2f}; best there {best_here!r}, "
            f"{score[(held_out, best_here)]:.2f})"
        )
    overall = min(names, key=lambda n: statistics.fmean(score[(t, n)] for t in TASKS))
    print(f"- over all tasks: {overall!r}")


if __name__ == "__main__":
    main()
