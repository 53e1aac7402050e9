"""benchmarks/recipe_rule.py: issue 68's rule, registered before its results."""

import importlib.util
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
CALIBRATED = ("pooled_noisy", "members", "members_noisy")


@pytest.fixture(scope="module")
def rule():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(
            "recipe_rule", BENCHMARKS / "recipe_rule.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def _part(nll, ece, shift):
    return {"in_distribution": {"nll": nll, "ece": ece}, "shift_mean": {"nll": shift}}


def _row(task, method, seed, values, by_calibration):
    """A benchmark row: as trained ``values``; ``by_calibration`` overrides."""
    fitted = {c: by_calibration.get(c, values) for c in ("pooled", *CALIBRATED)}
    return {
        "task": task,
        "model": "mlp",
        "method": method,
        "seed": seed,
        **_part(*values),
        "recalibrated": _part(*fitted["pooled"]),
        "calibrations": {c: _part(*fitted[c]) for c in CALIBRATED},
    }


def _pairs(tasks):
    """``{(task, "mlp"): {method: rows}}``; ``tasks``: {task: {method: (cal -> v)}}."""
    pairs = {}
    for task, methods in tasks.items():
        for method, (values, by_calibration) in methods.items():
            for seed, jitter in enumerate((-0.005, 0.0, 0.005)):
                shifted = {
                    c: (v[0], v[1], v[2] + jitter) for c, v in by_calibration.items()
                }
                row = _row(
                    task,
                    method,
                    seed,
                    (values[0], values[1], values[2] + jitter),
                    shifted,
                )
                pairs.setdefault((task, "mlp"), {}).setdefault(method, []).append(row)
    return pairs


def _task(be_members=0.8, be_pooled=1.0, single_shift=1.0):
    # One model's shift NLL 1.0 against 0.5 in distribution: a strong shift.
    return {
        "single": ((0.5, 0.02, single_shift), {}),
        "deep_ensemble": ((0.45, 0.02, 0.75), {}),
        "batchensemble": (
            (0.5, 0.02, 0.9),
            {"members": (0.5, 0.02, be_members), "pooled": (0.5, 0.02, be_pooled)},
        ),
    }


def test_every_target_counts_and_the_choice_leaves_the_task_out(rule):
    # On a, b and c, "members" wins under shift and closes the gap; "pooled"
    # ties: the rule picks members for every held-out task.
    pairs = _pairs({"a": _task(), "b": _task(), "c": _task()})
    choices = rule.choose(
        pairs, [("batchensemble", "pooled"), ("batchensemble", "members")]
    )
    assert {task: recipe for task, (recipe, _) in choices.items()} == dict.fromkeys(
        "abc", ("batchensemble", "members")
    )
    scores = choices["a"][1][("a", "mlp")]
    assert all(scores[t] for t in rule.TARGETS)


def test_a_recipe_best_on_one_task_is_not_chosen_for_it(rule):
    # "pooled" is best only on task c; held out, c gets what the others chose.
    pairs = _pairs(
        {"a": _task(), "b": _task(), "c": _task(be_members=1.2, be_pooled=0.8)}
    )
    choices = rule.choose(
        pairs, [("batchensemble", "pooled"), ("batchensemble", "members")]
    )
    recipe, here = choices["c"]
    assert recipe == ("batchensemble", "members")
    assert here[("c", "mlp")]["shift_not_worse"] is False  # scored where not chosen


def test_a_mild_shift_asks_only_not_worse(rule):
    # One model's shift NLL 0.52 against 0.5: mild; a tie meets shift_win.
    pairs = _pairs({"a": _task(be_members=0.52, single_shift=0.52)})
    found = rule.targets(pairs[("a", "mlp")], "batchensemble", "members")
    assert found["strong"] is False
    assert found["shift_win"] is True
