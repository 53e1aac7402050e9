"""benchmarks/shift_targets.py: the targets of issue 59 and the recipe it chose."""

import importlib.util
import json
import pathlib

import pytest

SCRIPT = (
    pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "shift_targets.py"
)
CALIBRATED = ("pooled_noisy", "members", "members_noisy")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("shift_targets", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(task, method, seed, nll, ece, shift, **by_calibration):
    """A benchmark row; ``by_calibration`` overrides (nll, ece, shift)."""

    def part(nll, ece, shift):
        return {
            "in_distribution": {"nll": nll, "ece": ece},
            "shift_mean": {"nll": shift},
        }

    values = {"pooled": (nll, ece, shift), **by_calibration}
    return {
        "task": task,
        "model": "mlp",
        "method": method,
        "seed": seed,
        **part(nll, ece, shift),
        "recalibrated": part(*values["pooled"]),
        "calibrations": {c: part(*values.get(c, values["pooled"])) for c in CALIBRATED},
    }


def _rows(task, be_shift, be_ece=0.02, single_shift=1.0, deep_shift=0.8, spread=0.01):
    """Three seeds of single, batchensemble and deep_ensemble on ``task``."""
    rows = []
    for seed, jitter in enumerate((-spread, 0.0, spread)):
        rows += [
            _row(task, "single", seed, 0.5, 0.02, single_shift + jitter),
            _row(task, "batchensemble", seed, 0.5, be_ece, be_shift + jitter),
            _row(task, "deep_ensemble", seed, 0.45, 0.02, deep_shift + jitter),
        ]
    return rows


def test_a_shift_nll_below_one_model_beyond_noise_is_a_win(script):
    pairs = {("t", "mlp"): {}}
    for row in _rows("t", be_shift=0.85):
        pairs[("t", "mlp")].setdefault(row["method"], []).append(row)
    found = script.check(pairs[("t", "mlp")], "pooled")
    assert found["shift"] == "win"
    assert found["gap"] == pytest.approx((1.0 - 0.85) / (1.0 - 0.8))
    assert found["gap_ok"] and found["nll_ok"] and found["ece_ok"]


def test_within_noise_is_a_tie_and_above_is_a_loss(script):
    for be_shift, expected in ((0.99, "tie"), (1.2, "loss")):
        methods = {}
        for row in _rows("t", be_shift=be_shift):
            methods.setdefault(row["method"], []).append(row)
        assert script.check(methods, "pooled")["shift"] == expected


def test_an_ece_beyond_the_slack_misses(script):
    methods = {}
    for row in _rows("t", be_shift=0.85, be_ece=0.02 + script.ECE_SLACK + 0.001):
        methods.setdefault(row["method"], []).append(row)
    assert script.check(methods, "pooled")["ece_ok"] is False


def test_the_choice_leaves_each_pair_out_and_never_picks_as_trained(
    script, tmp_path, capsys
):
    # Pooled loses under shift on every task; per member wins on every task;
    # as trained would win by more.
    rows = []
    for task in ("a", "b", "c"):
        for row in _rows(task, be_shift=1.2):
            if row["method"] == "batchensemble":
                part = {"in_distribution": {"nll": 0.5, "ece": 0.02}}
                row["calibrations"]["members"] = {**part, "shift_mean": {"nll": 0.85}}
                row["shift_mean"] = {"nll": 0.5}  # as trained: best, not a choice
            rows.append(row)
    path = tmp_path / "cls.json"
    path.write_text(json.dumps({"results": rows}))
    script.main([str(path)])
    out = capsys.readouterr().out
    assert "Every pair's choice: batchensemble + members\n" in out


def test_a_seed_in_two_files_counts_once(script, tmp_path):
    rows = _rows("t", be_shift=0.85)
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"results": rows}))
    study = [
        dict(r, recipe={"deep_ensemble": "deep"}.get(r["method"], r["method"]))
        for r in rows
    ]
    second.write_text(json.dumps(study))
    pairs = script.load([first, second])
    assert [len(v) for v in pairs[("t", "mlp")].values()] == [3, 3, 3]


def test_one_pair_prints_its_tables_and_chooses_nothing(script, tmp_path, capsys):
    # A held-out check has one pair: leaving it out leaves nothing to choose
    # on (the mean rank of no pairs raised StatisticsError).
    path = tmp_path / "check.json"
    path.write_text(json.dumps({"results": _rows("held", be_shift=0.85)}))
    assert script.main([str(path)]) in (None, 0)
    out = capsys.readouterr().out
    assert "| held mlp |" in out
    assert "one pair only: no pair is left to choose on" in out


def test_an_infinite_mean_is_beyond_noise_of_a_finite_one(script):
    # A seed's infinite NLL (a calibrator giving a label probability 0):
    # statistics.stdev raised on it; a finite mean now beats it.
    infinite = script._stats([1.0, float("inf"), 2.0])
    finite = script._stats([1.0, 1.1, 0.9])
    assert script._beyond_noise(finite, infinite) is True
    assert script._beyond_noise(infinite, finite) is False
    assert script._beyond_noise(infinite, infinite) is False
