"""benchmarks/diversity_study.py: the rule that chose the fast-weight defaults."""

import importlib.util
import inspect
import json
import pathlib

import pytest

SCRIPT = (
    pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "diversity_study.py"
)


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("diversity_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Recalibrated NLL per task (both measures alike, so each counts twice): B is
# best everywhere but more underconfident as trained than the deep ensemble,
# so it is never chosen. Ranks among A, B, C, D by hand: MNIST-1D B1 A2 C3
# D4, digits B1 C2 A3 D4, tabular B1 D2 C3 A4. Leaving MNIST-1D out, digits +
# tabular give A 3.5, C 2.5, D 3.0: C; its score is printed as 2.50.
NLL = {
    "mnist1d": {"A": 1.0, "B": 0.5, "C": 2.0, "D": 3.0},
    "digits": {"A": 2.0, "B": 0.5, "C": 1.0, "D": 3.0},
    "tabular": {"A": 3.0, "B": 0.5, "C": 2.0, "D": 1.0},
}


def _row(task, recipe, nll, ece, seed=10):
    measured = {"nll": nll, "ece": ece, "accuracy": 0.9}
    return {
        "task": task,
        "model": "mlp",
        "members": 1 if recipe == "single" else 4,
        "seed": seed,
        "recipe": recipe,
        "temperature": 1.0,
        "in_distribution": measured,
        "shift_mean": measured,
        "recalibrated": {"in_distribution": measured, "shift_mean": measured},
    }


def _rows(deep_ece=0.1):
    rows = []
    for task, values in NLL.items():
        rows.append(_row(task, "single", 5.0, 0.05))
        rows.append(_row(task, "deep", 0.1, deep_ece))
        for name, nll in values.items():
            rows.append(_row(task, name, nll, 0.2 if name == "B" else 0.05))
    return rows


def test_leave_one_task_out_skips_an_underconfident_recipe(script, tmp_path, capsys):
    path = tmp_path / "study.json"
    path.write_text(json.dumps(_rows()))
    script.main(["--report", str(path)])
    out = capsys.readouterr().out
    assert "- mnist1d: C (rank 2.50 on the others)" in out
    # B ranks first on every task, 0.1 above the deep ensemble's ECE.
    assert "| B | 1.00 / +0.100 | 1.00 / +0.100 | 1.00 / +0.100 |" in out
    assert "- digits: B" not in out and "- tabular: B" not in out
    assert "| single | 5.000 |" in out  # the baselines' own rows


def test_the_report_says_when_no_recipe_is_as_confident_as_deep(
    script, tmp_path, capsys
):
    path = tmp_path / "study.json"
    path.write_text(json.dumps(_rows(deep_ece=0.0)))  # all more underconfident
    script.report([str(path)])
    out = capsys.readouterr().out
    assert "none is as confident as the deep ensemble" in out
    assert "- mnist1d: B" in out  # then the ranks alone decide


def test_every_candidate_names_train_method_arguments(script):
    from ensembles.benchmark.quality.methods import train_method

    accepted = set(inspect.signature(train_method).parameters)
    for name, recipe in script.CANDIDATES.items():
        unknown = set(recipe) - accepted - {"method", "steps_factor", "members"}
        assert not unknown, (name, unknown)
    with pytest.raises(SystemExit):
        script.main(["--recipes", "no such recipe", "--json", "unused.json"])


def test_a_candidate_of_more_members_runs_them_at_the_same_rows(
    script, tmp_path, monkeypatch
):
    # "independent head member batches E8": 8 members of B/2 rows each, the
    # rows of the study's E = 4 per step; its row says 8 members.
    calls = []

    class Trained:
        train_s = 0.0

    def fake_train(method, model, x, y, *, num_members, **options):
        calls.append((method, num_members, options.get("batch_size")))
        return Trained()

    measured = {"nll": 1.0, "ece": 0.1, "accuracy": 0.5}
    monkeypatch.setattr(script, "train_method", fake_train)
    monkeypatch.setattr(
        script,
        "evaluate",
        lambda *a, **k: {
            "recalibrated": {"in_distribution": measured, "shift_mean": measured}
        },
    )
    path = tmp_path / "study.json"
    script.main(
        [
            "--json",
            str(path),
            "--tasks",
            "tabular",
            "--seeds",
            "0",
            "--recipes",
            "independent head member batches E8",
        ]
    )
    assert calls == [
        ("single", 1, None),
        ("deep_ensemble", 4, None),
        ("batchensemble", 8, script.BATCH_SIZE // 2),
    ]
    rows = json.loads(path.read_text())
    assert [row["members"] for row in rows] == [1, 4, 8]
