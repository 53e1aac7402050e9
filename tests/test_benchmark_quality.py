"""Tests of ``ensembles-bench --quality``: its data, methods, metrics and output."""

import contextlib
import dataclasses
import json
import random
import socket

import jax
import numpy as np
import pytest

import ensembles
from ensembles import uncertainty
from ensembles.benchmark import cli, main
from ensembles.benchmark.quality import METRICS, evaluate, summarize
from ensembles.benchmark.quality_data import (
    SEVERITIES,
    SHIFTS,
    load_quality_data,
)
from ensembles.benchmark.quality_methods import (
    EVAL_DRAWS,
    QUALITY_METHODS,
    train_method,
)
from ensembles.benchmark.quality_models import build_quality_model
from tests.tolerances import assert_close

pytest.importorskip("mnist1d")

SMALL = {"num_train": 200, "num_test": 100, "num_shifted": 30}


@pytest.fixture(scope="module")
def data():
    return load_quality_data(**SMALL)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Fails the test if anything tries the network or mnist1d's downloader.

    Every attempt is recorded and checked at teardown, so a caller that
    swallows the exception (mnist1d's ``get_dataset`` wraps its download in a
    bare ``except:``) cannot hide it. Runs in an empty directory, where
    ``get_dataset`` would leave its pickle.
    """
    import mnist1d.data
    import requests

    attempts = []

    def refuse(name):
        def refused(*args, **kwargs):
            attempts.append((name, args))
            raise OSError(f"offline test: {name} called")

        return refused

    monkeypatch.setattr(socket.socket, "connect", refuse("socket.connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("socket.connect_ex"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    monkeypatch.setattr(requests, "get", refuse("requests.get"))
    monkeypatch.setattr(requests.Session, "request", refuse("requests.request"))
    monkeypatch.setattr(mnist1d.data, "get_dataset", refuse("mnist1d get_dataset"))
    monkeypatch.chdir(tmp_path)
    yield attempts
    assert attempts == [], f"the network was touched: {attempts}"
    assert not list(tmp_path.glob("*.pkl")), "mnist1d wrote its download cache"


def test_offline_fixture_records_a_swallowed_download(offline):
    # What mnist1d's get_dataset does: a download inside a bare except.
    import requests

    with contextlib.suppress(Exception):
        requests.get("https://example.invalid/mnist1d_data.pkl")
    assert offline == [("requests.get", ("https://example.invalid/mnist1d_data.pkl",))]
    offline.clear()  # (else the fixture's teardown fails this test)


# ---------------------------------------------------------------- data


def _arrays(data):
    return jax.tree.leaves(dataclasses.asdict(data))


def test_data_is_offline_deterministic_and_leaves_no_trace(offline, tmp_path):
    np.random.seed(123)  # noqa: NPY002 (the global state mnist1d touches)
    random.seed(123)
    numpy_state = np.random.get_state()  # noqa: NPY002
    python_state = random.getstate()
    load_quality_data.cache_clear()
    first = load_quality_data(num_train=100, num_test=50, num_shifted=20)
    load_quality_data.cache_clear()
    again = load_quality_data(num_train=100, num_test=50, num_shifted=20)
    assert first is not again
    for a, b in zip(_arrays(first), _arrays(again), strict=True):
        np.testing.assert_array_equal(a, b)
    assert list(tmp_path.iterdir()) == []
    # The caller's global random state is as it was.
    assert random.getstate() == python_state
    restored = np.random.get_state()  # noqa: NPY002
    np.testing.assert_array_equal(restored[1], numpy_state[1])
    assert restored[2:] == numpy_state[2:]


def test_data_shapes_labels_and_sets(data):
    assert data.x_train.shape == (200, 40) and data.x_train.dtype == np.float32
    assert data.y_train.shape == (200,) and data.y_train.dtype == np.int32
    assert data.x_test.shape == (100, 40)
    assert set(np.unique(data.y_train)) == set(range(10))
    assert sorted(data.shifted) == list(SEVERITIES)
    for level in data.shifted.values():
        assert sorted(level) == sorted(SHIFTS)
        for x, y in level.values():
            assert x.shape == (30, 40) and y.shape == (30,)
    assert {name: x.shape for name, x in data.ood.items()} == {
        "shuffled": (100, 40),
        "noise": (100, 40),
    }
    # Train and test are disjoint draws; sets of different severities differ.
    assert not np.isin(data.x_test[:, 0], data.x_train[:, 0]).any()
    x1 = data.shifted[1]["shear"][0]
    x5 = data.shifted[5]["shear"][0]
    assert not np.array_equal(x1, x5)
    assert np.all(np.isfinite(data.x_train))


def test_severity_shifts_the_data_away_from_the_test_set(data):
    # A nearest-neighbour classifier on the training set does worse as the
    # severity grows: the shifts are shifts.
    def nn_accuracy(x, y):
        distances = ((x[:, None, :] - data.x_train[None]) ** 2).sum(-1)
        return np.mean(data.y_train[distances.argmin(1)] == y)

    noisy = [nn_accuracy(*data.shifted[s]["iid_noise"]) for s in (1, 5)]
    assert noisy[1] < noisy[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_train": 105}, "`num_train` must be a multiple of 10 (MNIST-1D"),
        ({"num_test": 0}, "`num_test` must be an int >= 1, got 0"),
    ],
)
def test_data_bad_sizes(kwargs, message):
    with pytest.raises(ValueError) as raised:
        load_quality_data(**{**SMALL, **kwargs})
    assert message in str(raised.value)


# ---------------------------------------------------------------- methods


@pytest.mark.parametrize(
    ("input_shape", "num_classes"), [((40,), 10), ((8, 8), 10), ((20,), 5)]
)
@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_models_fit_every_task(name, input_shape, num_classes):
    from flax import nnx

    # (A CNN over a tabular row's 20 features builds; the CLI skips it.)
    model = build_quality_model(
        name, input_shape=input_shape, num_classes=num_classes, rngs=nnx.Rngs(0)
    )
    assert model(np.ones((3, *input_shape), np.float32)).shape == (3, num_classes)
    if name == "cnn":
        convs = [m for m in model.layers if isinstance(m, nnx.Conv)]
        assert all(len(c.kernel_size) == len(input_shape) for c in convs)
    with pytest.raises(ValueError, match="the 'cnn' convolves the axes of 1-D or 2-D"):
        build_quality_model("cnn", input_shape=(2, 3, 4), rngs=nnx.Rngs(0))


def test_rank1_draws_several_predictions_per_member(data):
    trained = train_method(
        "rank1",
        "mlp",
        data.x_train,
        data.y_train,
        num_members=2,
        steps=2,
        eval_draws=3,
        prior_stddev=0.3,
    )
    logits = trained.predict(data.x_test[:5])
    assert logits.shape == (6, 5, 10)  # E * draws "members"
    assert not np.allclose(logits[0], logits[2])  # member 0, draws 1 and 2
    layer = trained.model.layers[1]
    assert layer.prior_stddev == 0.3


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_models_and_dropout(name):
    from flax import nnx

    plain = build_quality_model(name, rngs=nnx.Rngs(0))
    dropped = build_quality_model(name, dropout=0.5, rngs=nnx.Rngs(0))
    x = np.ones((3, 40), np.float32)
    assert plain(x).shape == (3, 10)
    assert sum(isinstance(m, nnx.Dropout) for m in dropped.layers) == (
        3 if name == "cnn" else 2
    )
    # Dropout masks in training mode, none in evaluation mode.
    assert not np.allclose(dropped(x), dropped(x))
    dropped.eval()
    assert_close(dropped(x), dropped(x))


def test_methods_are_what_they_claim(data):
    trained = {}
    for method in QUALITY_METHODS:  # "single" first: "finetuned" starts from it
        start = trained["single"].model if method == "finetuned" else None
        trained[method] = train_method(
            method,
            "mlp",
            data.x_train,
            data.y_train,
            num_members=3,
            steps=3,
            start=start,
        )
    shapes = {m: t.predict(data.x_test[:7]).shape for m, t in trained.items()}
    assert shapes == {
        "single": (1, 7, 10),
        "batchensemble": (3, 7, 10),
        "rank1": (3 * EVAL_DRAWS, 7, 10),  # every draw a member
        "finetuned": (3, 7, 10),
        "deep_ensemble": (3, 7, 10),
        "mc_dropout": (3, 7, 10),
    }
    single = trained["single"].params
    assert trained["deep_ensemble"].params == 3 * single
    assert trained["mc_dropout"].params == single
    # BatchEnsemble: the shared kernels + per-member r, s and biases.
    assert single < trained["batchensemble"].params < 2 * single
    # rank1: BatchEnsemble + a posterior scale per fast weight.
    fast = sum(3 * (i + o) for i, o in ((40, 256), (256, 256), (256, 10)))
    assert trained["rank1"].params == trained["batchensemble"].params + fast
    # finetuned: the single model converted (the same parameters as BE's).
    assert trained["finetuned"].params == trained["batchensemble"].params
    # rank1 draws its fast weights anew on every call: two predictions differ.
    first = trained["rank1"].predict(data.x_test[:7])
    assert not np.allclose(first, trained["rank1"].predict(data.x_test[:7]))
    # Members differ (fast weights, initialisations, dropout masks).
    for method in (
        "batchensemble",
        "rank1",
        "finetuned",
        "deep_ensemble",
        "mc_dropout",
    ):
        logits = trained[method].predict(data.x_test[:7])
        assert not np.allclose(logits[0], logits[1]), method
    for t in trained.values():
        assert t.train_s > 0


@pytest.mark.parametrize(
    "method, options, draws",
    [
        ("single", {}, 1),
        ("mc_dropout", {}, 1),
        ("batchensemble", {}, 1),  # one batch, tiled for every member
        ("batchensemble", {"tiled": False}, 3),  # a batch of its own each
        ("rank1", {}, 1),
        ("deep_ensemble", {}, 3),
    ],
)
def test_what_each_member_sees(data, monkeypatch, method, options, draws):
    calls = []
    original = ensembles.training.member_batches

    def recording(key, count, *, batch_size, num_members):
        calls.append((count, batch_size, num_members))
        return original(key, count, batch_size=batch_size, num_members=num_members)

    monkeypatch.setattr(ensembles.training, "member_batches", recording)
    train_method(
        method, "mlp", data.x_train, data.y_train, num_members=3, steps=2, **options
    )
    assert calls == [(200, 100, draws)]  # traced once, B = 100 per member


def test_training_reduces_the_loss_and_is_seeded(data):
    def nll(seed, steps):
        trained = train_method(
            "batchensemble",
            "cnn",
            data.x_train,
            data.y_train,
            num_members=2,
            steps=steps,
            seed=seed,
        )
        return float(uncertainty.nll(trained.predict(data.x_train), data.y_train))

    assert nll(0, 60) < 0.5 * nll(0, 1)
    assert nll(1, 5) == nll(1, 5)


def test_unknown_method_and_model():
    with pytest.raises(ValueError, match="`method` must be one of"):
        train_method(
            "bagging", "mlp", np.zeros((10, 40)), np.zeros(10, int), num_members=2
        )
    with pytest.raises(ValueError, match="`name` must be one of"):
        build_quality_model("resnet", rngs=None)


# ---------------------------------------------------------------- metrics


def test_report_metrics_equal_the_uncertainty_module(data):
    trained = train_method(
        "deep_ensemble", "mlp", data.x_train, data.y_train, num_members=2, steps=5
    )
    result = evaluate(trained, data)
    logits = trained.predict(data.x_test)
    for metric in METRICS:
        expected = getattr(uncertainty, metric)(logits, data.y_test)
        assert result["in_distribution"][metric] == pytest.approx(float(expected))
    for level, severity in zip(result["shift"], SEVERITIES, strict=True):
        assert level["severity"] == severity
        for metric in METRICS:
            per_family = [
                float(getattr(uncertainty, metric)(trained.predict(x), y))
                for x, y in data.shifted[severity].values()
            ]
            assert level[metric] == pytest.approx(np.mean(per_family))
    assert result["shift_mean"]["nll"] == pytest.approx(
        np.mean([level["nll"] for level in result["shift"]])
    )
    for name, x in data.ood.items():
        out = trained.predict(x)
        for suffix, score in (
            ("entropy", uncertainty.total_entropy),
            ("mi", uncertainty.mutual_information),
        ):
            expected = uncertainty.auroc(score(logits), score(out))
            assert result["ood"][name][f"auroc_{suffix}"] == pytest.approx(
                float(expected)
            )
            expected = uncertainty.fpr_at_tpr(score(logits), score(out), tpr=0.95)
            assert result["ood"][name][f"fpr95_{suffix}"] == pytest.approx(
                float(expected)
            )


@pytest.mark.parametrize(
    "method, members", [("single", 2), ("batchensemble", 1), ("batchensemble", 2)]
)
def test_mutual_information_auroc_only_with_several_members(data, method, members):
    trained = train_method(
        method, "mlp", data.x_train, data.y_train, num_members=members, steps=2
    )
    result = evaluate(trained, data)
    one_member = method == "single" or members == 1  # MI is 0 everywhere
    for scores in result["ood"].values():
        assert (scores["auroc_mi"] is None) == one_member
        assert (scores["fpr95_mi"] is None) == one_member


def test_single_is_trained_once_per_seed_for_every_ensemble_size(data, monkeypatch):
    import ensembles.benchmark.quality as quality

    trained = []
    original = quality.train_method

    def counting(method, *args, **kwargs):
        trained.append((method, kwargs["num_members"]))
        return original(method, *args, **kwargs)

    monkeypatch.setattr(quality, "train_method", counting)
    rows = quality.run_quality(
        models=["mlp"],
        members=[2, 3],
        methods=["single", "batchensemble"],
        steps=2,
        data=data,
    )
    # single is trained once (as one model: num_members=1), for every E.
    assert trained == [("single", 1), ("batchensemble", 2), ("batchensemble", 3)]
    singles = [row for row in rows if row["method"] == "single"]
    assert [row["members"] for row in singles] == [2, 3]
    assert singles[0]["in_distribution"] == singles[1]["in_distribution"]


def _row(method, nll, seed=0):
    return {
        "method": method,
        "model": "mlp",
        "members": 4,
        "seed": seed,
        "params": 1,
        "train_s": 1.0,
        "in_distribution": {"nll": nll},
        "shift": [{"severity": 1, "nll": 2 * nll}],
        "shift_mean": {"nll": 2 * nll},
        "ood": {"noise": {"auroc_entropy": 0.5, "auroc_mi": None}},
    }


def test_summary_means_stds_and_gap_closed():
    rows = [
        _row("single", 1.0, 0),
        _row("single", 0.8, 1),
        _row("batchensemble", 0.7, 0),
        _row("batchensemble", 0.7, 1),
        _row("deep_ensemble", 0.5, 0),
        _row("deep_ensemble", 0.5, 1),
    ]
    summary = {entry["method"]: entry for entry in summarize(rows)}
    single = summary["single"]["in_distribution"]["nll"]
    assert single["mean"] == pytest.approx(0.9)
    assert single["std"] == pytest.approx(np.std([1.0, 0.8], ddof=1))
    # (0.9 - 0.7) / (0.9 - 0.5) of the gap, in distribution and under shift.
    assert summary["batchensemble"]["gap_closed"] == pytest.approx(
        {"in_distribution": 0.5, "shift_mean": 0.5}
    )
    assert "gap_closed" not in summary["single"]


def test_summary_no_gap_when_the_deep_ensemble_is_no_better():
    rows = [_row("single", 0.5), _row("batchensemble", 0.6), _row("deep_ensemble", 0.5)]
    entry = summarize(rows)[1]
    assert entry["gap_closed"] == {"in_distribution": None, "shift_mean": None}


# ---------------------------------------------------------------- command


def test_quality_defaults_and_quick():
    args = cli._parse(["--quality"])
    assert (args.model, args.members, args.seeds, args.steps, args.task) == (
        ("cnn", "mlp"),
        (4,),
        3,
        None,  # per task: TASK_STEPS
        ("mnist1d",),
    )
    quick = cli._parse(["--quality", "--quick"])
    assert (quick.model, quick.seeds, quick.steps) == (("cnn",), 1, None)
    tasks = cli._parse(["--quality", "--task", "digits,tabular", "--steps", "7"])
    assert (tasks.task, tasks.steps) == (("digits", "tabular"), 7)
    assert cli._parse(["--quality", "--seed", "5", "--seeds", "2"]).seed == 5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quality", "--mode", "train"], "--mode applies only without --quality"),
        (["--quality", "--batch", "4", "--impl", "xla"], "--batch, --impl apply only"),
        (["--steps", "10"], "--steps applies only with --quality"),
        (
            ["--quality", "--model", "linear"],
            "--model linear: choose from cnn, mlp (MNIST-1D classifiers)",
        ),
        (["--quality", "--seeds", "0"], "must be an integer >= 1, got 0"),
    ],
)
def test_quality_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


def test_quality_without_mnist1d(capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "mnist1d", None)
    with pytest.raises(SystemExit) as raised:
        main(["--quality", "--quick"])
    assert raised.value.code == 2
    assert "--quality needs mnist1d" in capsys.readouterr().err


def test_quick_run_json_has_every_method_and_field(capsys, tmp_path, offline):
    # The --quick path (the CNN, one seed, every method, the standard data),
    # with a few steps instead of 2,000.
    out, plot = tmp_path / "out.json", tmp_path / "out.png"
    status = main(
        [
            "--quality",
            "--quick",
            "--steps",
            "3",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert "cnn on MNIST-1D, E=4, 1 seed" in printed
    assert "NLL / ECE by shift severity" in printed
    result = json.loads(out.read_text())
    assert result["config"]["quality"] is True
    assert result["versions"]["mnist1d"]
    rows = result["results"]
    assert [row["method"] for row in rows] == list(QUALITY_METHODS)
    for row in rows:
        # finetuned counts its fine-tuning steps only: a quarter of 3, at least 1.
        steps = 1 if row["method"] == "finetuned" else 3
        assert (row["model"], row["members"], row["seed"], row["steps"]) == (
            "cnn",
            4,
            0,
            steps,
        )
        assert row["params"] > 0 and row["train_s"] > 0
        assert sorted(row["in_distribution"]) == sorted(METRICS)
        assert [level["severity"] for level in row["shift"]] == list(SEVERITIES)
        assert all(
            sorted(level) == sorted([*METRICS, "severity"]) for level in row["shift"]
        )
        assert sorted(row["shift_mean"]) == sorted(METRICS)
        assert sorted(row["ood"]) == ["noise", "shuffled"]
        for scores in row["ood"].values():
            assert 0 <= scores["auroc_entropy"] <= 1
            if row["method"] == "single":
                assert scores["auroc_mi"] is None
            else:
                assert 0 <= scores["auroc_mi"] <= 1
    summary = result["summary"]
    assert [entry["method"] for entry in summary] == list(QUALITY_METHODS)
    assert "gap_closed" in summary[1]
    assert plot.stat().st_size > 10_000


def test_every_task_runs_through_the_command(tmp_path, capsys):
    pytest.importorskip("sklearn")
    out = tmp_path / "tasks.json"
    status = cli.main(
        [
            "--quality",
            "--task",
            "digits,tabular",
            "--model",
            "cnn",
            "--members",
            "2",
            "--seeds",
            "1",
            "--steps",
            "2",
            "--json",
            str(out),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert "tabular: 2 training steps per method; cnn skipped (no use on tabular)" in (
        printed
    )
    assert "cnn on digits (8x8), E=2, 1 seed" in printed
    rows = json.loads(out.read_text())["results"]
    assert {(row["task"], row["model"]) for row in rows} == {("digits", "cnn")}
    for row in rows:
        assert "aurc" in row["in_distribution"]
        for scores in row["ood"].values():
            assert set(scores) == {
                "auroc_entropy",
                "auroc_mi",
                "fpr95_entropy",
                "fpr95_mi",
            }
