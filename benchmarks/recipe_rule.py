"""Issue 68's selection rule, registered before its results: which recipe to recommend.

Written and committed on 2026-11-29 before any run of the wider task pool,
and not changed after seeing results (a change would be a new rule, named and
dated, with both reported). It reads ``ensembles-bench --quality --json``
files (every task of one kind, classification or regression, each run with
``single``, ``deep_ensemble`` and the BatchEnsemble variants, seeds 0..n-1)
and scores every recipe, a (BatchEnsemble variant, calibration) pair with
the calibration applied alike to every method, on every pair (task, model).

**The targets** (one point each, every target alike):

1. ``shift_win``: on a task whose shift is strong (one model's shift NLL,
   as trained, above 1.10 times its in-distribution NLL, means over seeds),
   BatchEnsemble's shift NLL below one model's beyond noise; on a task with
   a mild shift, not above it beyond noise (a mild shift separates nothing:
   notes/shift.md).
2. ``shift_not_worse``: BatchEnsemble's shift NLL not above one model's
   beyond noise.
3. ``gap``: where the deep ensemble's shift NLL is below one model's beyond
   noise, BatchEnsemble closes at least half of that gap; met elsewhere.
4. ``nll``: BatchEnsemble's in-distribution NLL not above one model's beyond
   noise.
5. ``calibration``: a classifier's in-distribution ECE at most one model's +
   0.01; a regressor's 90% intervals covering 0.87-0.93 of the in-distribution
   test set.

"Beyond noise" is the benchmark's rule (``ensembles.benchmark.quality.report``,
via ``shift_targets.py``): a difference counts when it exceeds a fiftieth of
one model's value and two standard errors of the difference of the means
over seeds. A pair's score is the number of targets met (0-5).

**The choice, leaving one task out**: for each task, the recipe with the
highest total score on the pairs of every other task, ties broken by fewer
``shift_not_worse`` misses there, then by the lower mean rank of
BatchEnsemble's shift NLL among the recipes there, then by name. The held-out
task's score under that choice is what the recipe earns on data it was not
chosen on; the report prints it, task by task, and the recommendation is the
recipe chosen for the most held-out tasks (ties: the first by the same
order). Classification and regression are chosen apart (their calibrations
are different functions)::

    python benchmarks/recipe_rule.py cls_*.json
    python benchmarks/recipe_rule.py reg_*.json --variants batchensemble
"""

import argparse
import statistics
import sys

try:  # run as a script (python benchmarks/recipe_rule.py), or imported
    from shift_targets import FITTED, _beyond_noise, _measures, _stats, check, load
except ImportError:
    from benchmarks.shift_targets import (
        FITTED,
        _beyond_noise,
        _measures,
        _stats,
        check,
        load,
    )

TARGETS = ("shift_win", "shift_not_worse", "gap", "nll", "calibration")
STRONG_SHIFT = 1.10
ECE_SLACK = 0.01
COVERAGE = (0.87, 0.93)


def strong_shift(methods):
    """Whether one model's shift NLL, as trained, is over 1.10x its own inside."""
    rows = methods.get("single", [])
    measured = [_measures(row, "as trained") for row in rows]
    if not measured or any(m is None for m in measured):
        return None
    inside = statistics.fmean(m[0] for m in measured)
    shifted = statistics.fmean(m[2] for m in measured)
    return shifted > STRONG_SHIFT * inside


def _coverage(methods, variant, calibration):
    """BatchEnsemble's mean in-distribution 90% coverage, or ``None``."""
    values = []
    for row in methods.get(variant, []):
        found = (
            row.get("recalibrated")
            if calibration == "pooled"
            else row
            if calibration == "as trained"
            else row.get("calibrations", {}).get(calibration)
        )
        if found is None or "coverage90" not in found["in_distribution"]:
            return None
        values.append(found["in_distribution"]["coverage90"])
    return statistics.fmean(values) if values else None


def targets(methods, variant, calibration):
    """``{target: met}`` of one pair under a recipe, or ``None`` if not measured."""
    found = check(methods, calibration, variant)
    strong = strong_shift(methods)
    if found is None or strong is None:
        return None
    single = [_stats([_measures(r, calibration)[2] for r in methods["single"]])]
    be = [_stats([_measures(r, calibration)[2] for r in methods[variant]])]
    win = _beyond_noise(be[0], single[0])
    not_worse = found["shift"] != "loss"
    coverage = _coverage(methods, variant, calibration)
    if coverage is not None:  # a regressor
        calibrated = COVERAGE[0] <= coverage <= COVERAGE[1]
    else:
        calibrated = found["ece_ok"]
    return {
        "shift_win": win if strong else not_worse,
        "shift_not_worse": not_worse,
        "gap": found["gap_ok"],
        "nll": found["nll_ok"],
        "calibration": calibrated,
        "strong": strong,
        "shift_nll": found["values"]["batchensemble"][2],
        "values": found["values"],  # {method: [NLL, calibration error, shift NLL]}
        "coverage": coverage,
    }


def choose(pairs, recipes):
    """The leave-one-task-out choice: ``{task: (recipe, its scores there)}``."""
    scored = {
        (pair, recipe): targets(methods, *recipe)
        for pair, methods in pairs.items()
        for recipe in recipes
    }
    tasks = sorted({task for task, _ in pairs})
    choices = {}
    for held in tasks:
        others = [p for p in pairs if p[0] != held]
        ranking = []
        for recipe in recipes:
            results = [scored[(p, recipe)] for p in others]
            if not results or any(r is None for r in results):
                continue
            ranks = []
            for p in others:
                shifts = sorted(
                    scored[(p, r)]["shift_nll"]
                    for r in recipes
                    if scored[(p, r)] is not None
                )
                ranks.append(shifts.index(scored[(p, recipe)]["shift_nll"]) + 1)
            total = sum(sum(r[t] for t in TARGETS) for r in results)
            misses = sum(not r["shift_not_worse"] for r in results)
            ranking.append((-total, misses, statistics.fmean(ranks), recipe))
        if not ranking:
            continue
        ranking.sort()
        recipe = ranking[0][3]
        here = {p: scored[(p, recipe)] for p in pairs if p[0] == held}
        choices[held] = (recipe, here)
    return choices


def report(pairs, variants, calibrations):
    """Prints every held-out task's choice and its targets there."""
    recipes = [(v, c) for v in variants for c in calibrations]
    choices = choose(pairs, recipes)
    print("| held-out task | chosen on the others | pair | strong shift | "
          + " | ".join(TARGETS) + " | score |")  # fmt: skip
    print("|:---|:---|:---|:---|" + "---:|" * (len(TARGETS) + 1))
    for task, (recipe, here) in choices.items():
        for pair, result in sorted(here.items()):
            if result is None:
                continue
            marks = ["met" if result[t] else "missed" for t in TARGETS]
            print(
                f"| {task} | {' + '.join(recipe)} | {pair[1]} | "
                f"{'yes' if result['strong'] else 'no'} | {' | '.join(marks)} | "
                f"{sum(result[t] for t in TARGETS)}/{len(TARGETS)} |"
            )
    print("\n" + figures_table(choices))
    print("\n" + done_summary(choices))
    counts = {}
    for recipe, _ in choices.values():
        counts[recipe] = counts.get(recipe, 0) + 1
    if counts:
        best = max(counts.values())
        recommended = next(r for r in recipes if counts.get(r) == best)
        print(
            f"\nRecommended (chosen for {best} of {len(choices)} held-out tasks): "
            f"{' + '.join(recommended)}"
        )
    return choices


def figures_table(choices):
    """Each held-out task's figures at the recipe chosen on the others.

    One model / BatchEnsemble / deep ensemble, every method at the recipe's
    calibration: in-distribution NLL, shift NLL, and ECE (a regressor: the
    BatchEnsemble's 90% coverage).
    """
    lines = [
        "| held-out task | recipe | NLL: one / BE / deep | shift NLL: one / BE / deep "
        "| ECE: one / BE / deep, or BE's 90% coverage |",
        "|:---|:---|:---|:---|:---|",
    ]
    for task, (recipe, here) in choices.items():
        for result in here.values():
            if result is None:
                continue
            v = result["values"]
            methods = ("single", "batchensemble", "deep_ensemble")

            def cell(i, v=v, methods=methods):
                return " / ".join(f"{v[m][i]:.3f}" for m in methods)

            calibration = (
                f"{result['coverage']:.3f}"
                if result["coverage"] is not None
                else cell(1)
            )
            lines.append(
                f"| {task} | {' + '.join(recipe)} | {cell(0)} | {cell(2)} | "
                f"{calibration} |"
            )
    return "\n".join(lines)


def done_summary(choices):
    """Issue 68's done criteria over the held-out tasks, each at its choice.

    Strong-shift tasks where BatchEnsemble's shift NLL is below one model's
    beyond noise (the target: at least 80%), tasks where it is worse beyond
    noise (none), gaps closed by half, in-distribution NLLs, calibration.
    """
    results = [r for _, here in choices.values() for r in here.values() if r]
    strong = [r for r in results if r["strong"]]
    lines = [
        f"Over {len(results)} held-out pairs ({len(strong)} with a strong shift):",
        f"- shift NLL below one model's beyond noise: "
        f"{sum(r['shift_win'] for r in strong)} of {len(strong)} strong shifts",
        f"- shift NLL above one model's beyond noise: "
        f"{sum(not r['shift_not_worse'] for r in results)} of {len(results)}",
        f"- half the gap to the deep ensemble (where there is one): "
        f"{sum(r['gap'] for r in results)} of {len(results)}",
        f"- in-distribution NLL not worse: {sum(r['nll'] for r in results)} "
        f"of {len(results)}",
        f"- calibration (ECE within {ECE_SLACK} / 90% coverage "
        f"{COVERAGE[0]}-{COVERAGE[1]}): {sum(r['calibration'] for r in results)} "
        f"of {len(results)}",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="ensembles-bench --quality --json")
    parser.add_argument(
        "--variants",
        default="batchensemble,batchensemble_shift",
        help="comma-separated methods that play BatchEnsemble",
    )
    parser.add_argument(
        "--calibrations",
        default=",".join(FITTED),
        help="comma-separated calibrations a recipe may end with",
    )
    args = parser.parse_args(argv)
    report(
        load(args.json),
        tuple(args.variants.split(",")),
        tuple(args.calibrations.split(",")),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
