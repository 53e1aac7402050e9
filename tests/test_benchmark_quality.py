"""Tests of ``ensembles-bench --quality``: its data, methods, metrics and output."""

import contextlib
import dataclasses
import json
import random
import socket

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ensembles
from ensembles import uncertainty
from ensembles.benchmark import cli, main
from ensembles.benchmark.quality.calibration import RECOMMENDED, noisy_validation
from ensembles.benchmark.quality.classification.mnist1d import (
    SHIFTS,
    load_quality_data,
)
from ensembles.benchmark.quality.classification.scores import METRICS, evaluate
from ensembles.benchmark.quality.data import SEVERITIES, QualityData
from ensembles.benchmark.quality.methods import (
    EVAL_DRAWS,
    QUALITY_METHODS,
    Trained,
    train_method,
)
from ensembles.benchmark.quality.models import build_quality_model
from ensembles.benchmark.quality.regression.real_tasks import REAL_REGRESSION_TASKS
from ensembles.benchmark.quality.report import MIN_GAP, format_quality, summarize
from ensembles.benchmark.quality.run import split_validation
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


@pytest.mark.slow
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


@pytest.mark.slow
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
        "batchensemble_shift": (3, 7, 10),
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
    # The recipe for shift: the head's shared kernel and fast weights
    # become a kernel per member (biases per member in both).
    head_be, head_own = 256 * 10 + 3 * (256 + 10), 3 * 256 * 10
    shift = trained["batchensemble_shift"].params
    assert shift == trained["batchensemble"].params - head_be + head_own
    # finetuned: the single model converted (the same parameters as BE's).
    assert trained["finetuned"].params == trained["batchensemble"].params
    # rank1 draws its fast weights anew on every call: two predictions differ.
    first = trained["rank1"].predict(data.x_test[:7])
    assert not np.allclose(first, trained["rank1"].predict(data.x_test[:7]))
    # Members differ (fast weights, initialisations, dropout masks).
    for method in (
        "batchensemble",
        "batchensemble_shift",
        "rank1",
        "finetuned",
        "deep_ensemble",
        "mc_dropout",
    ):
        logits = trained[method].predict(data.x_test[:7])
        assert not np.allclose(logits[0], logits[1]), method
    for t in trained.values():
        assert t.train_s > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, options, draws",
    [
        ("single", {}, 1),
        ("mc_dropout", {}, 1),
        ("batchensemble", {}, 1),  # one batch, tiled for every member
        ("batchensemble", {"tiled": False}, 3),  # a batch of its own each
        ("batchensemble_shift", {}, 3),  # the recipe for shift: its own too
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


def test_batch_size_sets_the_rows_of_each_member(data, monkeypatch):
    # E = 8 at B = 50 runs the rows of E = 4 at B = 100 (issue 59's E = 8
    # "at the same rows per step").
    calls = []
    original = ensembles.training.member_batches

    def recording(key, count, *, batch_size, num_members):
        calls.append((batch_size, num_members))
        return original(key, count, batch_size=batch_size, num_members=num_members)

    monkeypatch.setattr(ensembles.training, "member_batches", recording)
    trained = train_method(
        "batchensemble",
        "mlp",
        data.x_train,
        data.y_train,
        num_members=8,
        steps=2,
        tiled=False,
        batch_size=50,
    )
    assert calls == [(50, 8)]
    assert trained.predict(data.x_test[:3]).shape[:2] == (8, 3)


@pytest.mark.parametrize("batch_size", [0, -4, 2.5, True])
def test_a_bad_batch_size_is_refused_by_name(data, batch_size):
    with pytest.raises((ValueError, TypeError), match="batch_size"):
        train_method(
            "single",
            "mlp",
            data.x_train,
            data.y_train,
            num_members=2,
            steps=1,
            batch_size=batch_size,
        )


@pytest.mark.slow
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


@pytest.mark.slow
def test_report_metrics_equal_the_uncertainty_module(data):
    trained = train_method(
        "deep_ensemble", "mlp", data.x_train, data.y_train, num_members=2, steps=5
    )
    x_valid, y_valid = data.x_train[:50], data.y_train[:50]
    result = evaluate(trained, data, x_valid=x_valid, y_valid=y_valid)
    temperature = float(uncertainty.fit_temperature(trained.predict(x_valid), y_valid))
    assert result["temperature"] == pytest.approx(temperature)

    def as_trained(x):
        return trained.predict(x)

    def recalibrated(x):
        return uncertainty.scale_temperature(trained.predict(x), temperature)

    for measured, predict in (
        (result, as_trained),
        (result["recalibrated"], recalibrated),
    ):
        logits = predict(data.x_test)
        for metric in METRICS:
            expected = getattr(uncertainty, metric)(logits, data.y_test)
            assert measured["in_distribution"][metric] == pytest.approx(
                float(expected), rel=1e-5
            )
        for level, severity in zip(measured["shift"], SEVERITIES, strict=True):
            assert level["severity"] == severity
            for metric in METRICS:
                per_family = [
                    float(getattr(uncertainty, metric)(predict(x), y))
                    for x, y in data.shifted[severity].values()
                ]
                assert level[metric] == pytest.approx(np.mean(per_family), rel=1e-5)
        assert measured["shift_mean"]["nll"] == pytest.approx(
            np.mean([level["nll"] for level in measured["shift"]])
        )
        scores = (
            [("entropy", uncertainty.total_entropy)]
            if predict is recalibrated  # pooled: one member, no MI
            else [
                ("entropy", uncertainty.total_entropy),
                ("mi", uncertainty.mutual_information),
            ]
        )
        for name, x in data.ood.items():
            out = predict(x)
            assert sorted(measured["ood"][name]) == sorted(
                f"{kind}_{suffix}"
                for suffix, _ in scores
                for kind in ("auroc", "fpr95")
            )
            for suffix, score in scores:
                expected = uncertainty.auroc(score(logits), score(out))
                assert measured["ood"][name][f"auroc_{suffix}"] == pytest.approx(
                    float(expected)
                )
                expected = uncertainty.fpr_at_tpr(score(logits), score(out), tpr=0.95)
                assert measured["ood"][name][f"fpr95_{suffix}"] == pytest.approx(
                    float(expected)
                )


@pytest.mark.slow
def test_the_temperature_is_fitted_on_held_out_training_data_only(data, monkeypatch):
    # Every fit_temperature call must see the validation split and nothing
    # else: the logits of the held-out training rows and their labels; no
    # method may train on those rows; the test set never enters.
    import ensembles.benchmark.quality.run as quality

    fitted, trained_on = [], []
    original_fit = uncertainty.fit_temperature
    original_train = quality.train_method

    def recording_fit(logits, labels, **kwargs):
        fitted.append((np.asarray(logits), np.asarray(labels)))
        return original_fit(logits, labels, **kwargs)

    def recording_train(method, model, x, y, **kwargs):
        trained_on.append(np.asarray(x))
        trained = original_train(method, model, x, y, **kwargs)
        predicted.append(trained.predict)
        return trained

    predicted = []
    monkeypatch.setattr(uncertainty, "fit_temperature", recording_fit)
    monkeypatch.setattr(quality, "train_method", recording_train)
    rows = quality.run_quality(
        models=["mlp"],
        members=[2],
        methods=["single", "batchensemble"],
        steps=2,
        data=data,
    )
    _, x_valid, y_valid = split_validation(data)
    assert len(x_valid) == 100 and all(
        row["validation_examples"] == 100 for row in rows
    )  # at least MIN_VALIDATION, at most half
    assert all(row["train_examples"] == 100 for row in rows)
    held = {row.tobytes() for row in x_valid}
    train_rows = {row.tobytes() for row in data.x_train}
    test_rows = {row.tobytes() for row in data.x_test}
    assert held <= train_rows and not held & test_rows
    for x in trained_on:  # no method saw a validation example
        assert len(x) == 100 and not {row.tobytes() for row in x} & held
    # Per method: the temperature on the held-out rows, then the one on them
    # and their noisy copies (noise scaled by the training inputs' std
    # alone), then members_noisy_pooled's level: on the held-out rows again,
    # their members rescaled by the temperatures fitted on the noisy set.
    assert len(fitted) == 3 * len(predicted) == 6
    x_noisy, y_noisy = noisy_validation(data.x_train, x_valid, y_valid)
    for i, predict in enumerate(predicted):
        (logits, labels), (noisy_logits, noisy_labels), (rescaled, level_labels) = (
            fitted[3 * i : 3 * i + 3]
        )
        member_t = uncertainty.fit_member_temperatures(noisy_logits, noisy_labels)
        np.testing.assert_allclose(
            rescaled,
            np.asarray(uncertainty.scale_member_temperatures(logits, member_t)),
            rtol=1e-5,
            atol=1e-6,
        )
        np.testing.assert_array_equal(level_labels, y_valid)
        np.testing.assert_array_equal(labels, y_valid)
        np.testing.assert_array_equal(logits, np.asarray(predict(x_valid)))
        np.testing.assert_array_equal(noisy_labels, y_noisy)
        np.testing.assert_allclose(
            noisy_logits, np.asarray(predict(np.asarray(x_noisy))), rtol=1e-6
        )
        row = rows[i]
        assert row["temperature"] == pytest.approx(float(original_fit(logits, labels)))
        assert row["calibrations"]["pooled_noisy"]["temperature"] == pytest.approx(
            float(original_fit(noisy_logits, noisy_labels))
        )
        two_stage = row["calibrations"]["members_noisy_pooled"]["temperature"]
        assert two_stage == pytest.approx(
            float(jnp.mean(member_t) * original_fit(rescaled, level_labels)), rel=1e-5
        )


def test_a_validation_set_of_your_own_is_kept(data):
    mine = dataclasses.replace(data, x_valid=data.x_test[:10], y_valid=data.y_test[:10])
    kept, x_valid, y_valid = split_validation(mine)
    assert kept is mine  # trains on all of x_train
    np.testing.assert_array_equal(x_valid, data.x_test[:10])
    np.testing.assert_array_equal(y_valid, data.y_test[:10])
    with pytest.raises(ValueError, match="`x_valid` and `y_valid` go together"):
        dataclasses.replace(data, x_valid=data.x_test[:10])
    one = dataclasses.replace(data, x_train=data.x_train[:1], y_train=data.y_train[:1])
    with pytest.raises(ValueError, match="holds out 0: at least one"):
        split_validation(one)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, members", [("single", 2), ("batchensemble", 1), ("batchensemble", 2)]
)
def test_mutual_information_auroc_only_with_several_members(data, method, members):
    trained = train_method(
        method, "mlp", data.x_train, data.y_train, num_members=members, steps=2
    )
    result = evaluate(
        trained, data, x_valid=data.x_train[:20], y_valid=data.y_train[:20]
    )
    one_member = method == "single" or members == 1  # MI is 0 everywhere
    for scores in result["ood"].values():
        assert (scores["auroc_mi"] is None) == one_member
        assert (scores["fpr95_mi"] is None) == one_member


@pytest.mark.slow
def test_single_is_trained_once_per_seed_for_every_ensemble_size(data, monkeypatch):
    import ensembles.benchmark.quality.run as quality

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


def _row(method, nll, seed=0, calibrated=None):
    def measured(nll):
        return {
            "in_distribution": {"nll": nll},
            "shift": [{"severity": 1, "nll": 2 * nll}],
            "shift_mean": {"nll": 2 * nll},
        }

    return {
        "method": method,
        "model": "mlp",
        "members": 4,
        "seed": seed,
        "params": 1,
        "train_s": 1.0,
        **measured(nll),
        "ood": {"noise": {"auroc_entropy": 0.5, "auroc_mi": None}},
        "temperature": 1.0,
        "recalibrated": measured(nll if calibrated is None else calibrated),
    }


def test_summary_means_stds_and_gap_closed():
    rows = [
        _row("single", 1.0, 0, calibrated=0.9),
        _row("single", 0.8, 1, calibrated=0.7),
        _row("batchensemble", 0.7, 0, calibrated=0.7),
        _row("batchensemble", 0.7, 1, calibrated=0.7),
        _row("deep_ensemble", 0.5, 0, calibrated=0.5),
        _row("deep_ensemble", 0.5, 1, calibrated=0.5),
    ]
    summary = {entry["method"]: entry for entry in summarize(rows)}
    single = summary["single"]["in_distribution"]["nll"]
    assert single["mean"] == pytest.approx(0.9)
    assert single["std"] == pytest.approx(np.std([1.0, 0.8], ddof=1))
    recalibrated = summary["single"]["recalibrated"]["in_distribution"]["nll"]
    assert recalibrated["mean"] == pytest.approx(0.8)
    assert summary["single"]["temperature"] == {"mean": 1.0, "std": 0.0}
    assert summary["single"]["recalibrated"]["shift"][0]["severity"] == 1
    # Recalibrated: (0.8 - 0.7) / (0.8 - 0.5) of the gap; as trained:
    # (0.9 - 0.7) / (0.9 - 0.5), in distribution and under shift.
    assert summary["batchensemble"]["gap_closed"] == pytest.approx(
        {"in_distribution": 1 / 3, "shift_mean": 1 / 3}
    )
    assert summary["batchensemble"]["gap_closed_as_trained"] == pytest.approx(
        {"in_distribution": 0.5, "shift_mean": 0.5}
    )
    assert "gap_closed" not in summary["single"]


@pytest.mark.parametrize("deep", [0.5, 0.6, 0.5 * (1 - MIN_GAP / 2)])
def test_summary_no_gap_when_the_deep_ensemble_is_no_better(deep):
    # No better, worse, or better by less than MIN_GAP of one model's NLL:
    # a ratio over such a gap would print 125% or -1200% of noise.
    # Two seeds alike: a noise rule (one seed gives no ratio at all).
    rows = [
        row
        for seed in (0, 1)
        for row in (
            _row("single", 0.5, seed),
            _row("batchensemble", 0.6, seed),
            _row("deep_ensemble", deep, seed),
        )
    ]
    entry = summarize(rows)[1]
    assert entry["gap_closed"] == {"in_distribution": None, "shift_mean": None}
    text = format_quality(rows)
    assert "No NLL gap to close: the deep ensemble is not better" in text
    assert "%" not in text


@pytest.mark.parametrize("spread, closed", [(0.1, None), (0.01, 0.5)])
def test_summary_no_gap_within_two_standard_errors_over_seeds(spread, closed):
    # Over 3 seeds, one model's NLL 1.0 with std `spread`, the deep ensemble's
    # 0.8 with std 2.5 * spread: the standard error of the difference of the
    # means is spread * sqrt(7.25 / 3), so the gap of 0.2 is 1.3 of them at
    # spread 0.1 (noise: no ratio) and 12.9 at spread 0.01 (BE closes half).
    offsets = (-spread, 0.0, spread)
    rows = [
        row
        for seed, offset in enumerate(offsets)
        for row in (
            _row("single", 1.0 + offset, seed),
            _row("batchensemble", 0.9, seed),
            _row("deep_ensemble", 0.8 + 2.5 * offset, seed),
        )
    ]
    entry = {e["method"]: e for e in summarize(rows)}["batchensemble"]
    expected = None if closed is None else pytest.approx(closed)
    for key in ("gap_closed", "gap_closed_as_trained"):
        assert entry[key] == {"in_distribution": expected, "shift_mean": expected}


def test_format_quality_takes_rows_or_a_summary_and_names_the_best():
    rows = [_row("single", 0.9), _row("batchensemble", 0.6), _row("deep_ensemble", 0.5)]
    text = format_quality(rows)
    assert text == format_quality(summarize(rows))
    lines = text.splitlines()
    best = [line for line in lines if line.startswith("best")]
    assert len(best) == 2  # recalibrated, as trained
    assert "deep_ensemble" in best[0] and "single" not in best[0]


def test_the_first_table_is_every_method_at_the_recommended_calibration():
    # The members' temperatures give other figures than the pooled one: the
    # first table, its best row and the first gap line are theirs.
    def row(method, nll, members_nll, seed):
        measured = _row(method, nll, seed, calibrated=nll + 0.05)
        measured["calibrations"] = {
            RECOMMENDED: {
                "temperature": 1.0 + seed,
                "in_distribution": {"nll": members_nll},
                "shift_mean": {"nll": 2 * members_nll},
            }
        }
        return measured

    rows = [
        row(method, nll, members_nll, seed)
        for seed in (0, 1)
        for method, nll, members_nll in (
            ("single", 0.9, 0.8),
            ("batchensemble", 0.6, 0.75),
            ("deep_ensemble", 0.5, 0.7),
        )
    ]
    entry = {e["method"]: e for e in summarize(rows)}["batchensemble"]
    # (0.8 - 0.75) / (0.8 - 0.7) of the gap at the recommended calibration;
    # (0.95 - 0.65) / (0.95 - 0.55) recalibrated.
    assert entry["gap_closed_recommended"] == pytest.approx(
        {"in_distribution": 0.5, "shift_mean": 0.5}
    )
    assert entry["gap_closed"] == pytest.approx(
        {"in_distribution": 0.75, "shift_mean": 0.75}
    )
    text = format_quality(rows)
    lines = text.splitlines()
    first = lines.index(next(line for line in lines if "recommended cal" in line))
    assert first < lines.index(next(x for x in lines if x.startswith("Recalibrated")))
    table = lines[first + 2 : first + 8]
    assert "mean T" in table[0]
    single = next(line for line in table if line.startswith("single"))
    assert "1.500" in single and "0.800" in single and "1.600" in single
    assert "0.950" not in single  # the pooled temperature's figure
    assert "closes this much of the recommended-calibration NLL gap" in text
    assert "in distribution 50%" in text


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
    assert quick.methods == QUALITY_METHODS  # every method unless --methods
    chosen = cli._parse(["--quality", "--methods", "deep_ensemble,single,single"])
    assert chosen.methods == ("deep_ensemble", "single")
    # --help says what --quick trains on, and that any example shape works.
    text = " ".join(cli.build_parser().format_help().split())
    assert "2,000 training sequences, not 8,000" in text
    assert "a classifier of the task's examples" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quality", "--mode", "train"], "--mode applies only without --quality"),
        (["--quality", "--batch", "4", "--impl", "xla"], "--batch, --impl apply only"),
        (["--steps", "10"], "--steps applies only with --quality"),
        (["--methods", "single"], "--methods applies only with --quality"),
        (
            ["--quality", "--methods", "single,bagging"],
            "unknown 'bagging'; choose from single, batchensemble",
        ),
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
    assert "--task mnist1d needs mnist1d" in capsys.readouterr().err
    # The regression tasks need no mnist1d.
    args = cli._parse(["--quality", "--quick", "--task", "regression"])
    assert args.task == (
        "cubic",
        "hetero_sine_gap",
        "friedman1_hetero",
        "concrete",
        *REAL_REGRESSION_TASKS,
    )


@pytest.mark.slow
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
    assert "Recalibrated NLL / ECE by shift severity" in printed
    # --quick trains on smaller sets, and says so.
    assert (
        "mnist1d: 2,000 training examples (--quick), 300 of them held out to fit "
        "temperatures; 3 training steps per method"
    ) in printed
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
        assert row["temperature"] > 0
        assert (row["train_examples"], row["validation_examples"]) == (1700, 300)
        recalibrated = row["recalibrated"]
        assert sorted(recalibrated["in_distribution"]) == sorted(METRICS)
        assert [lv["severity"] for lv in recalibrated["shift"]] == list(SEVERITIES)
        assert sorted(row["ood"]) == ["noise", "shuffled"]
        for scores in row["ood"].values():
            assert 0 <= scores["auroc_entropy"] <= 1
            if row["method"] == "single":
                assert scores["auroc_mi"] is None
            else:
                assert 0 <= scores["auroc_mi"] <= 1
    summary = result["summary"]
    assert [entry["method"] for entry in summary] == list(QUALITY_METHODS)
    # One seed: no noise rule, no "gap closed" (the text says why).
    assert "gap_closed" not in summary[1] and "gap_closed_as_trained" not in summary[1]
    assert plot.stat().st_size > 10_000


@pytest.mark.slow
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
            "--methods",
            "finetuned,batchensemble",
            "--json",
            str(out),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert (
        "tabular: 6,000 training examples, 600 of them held out to fit "
        "temperatures; 2 training steps per method; cnn skipped (no use on tabular)"
    ) in printed
    assert "cnn on digits (8x8), E=2, 1 seed" in printed
    rows = json.loads(out.read_text())["results"]
    assert {(row["task"], row["model"]) for row in rows} == {("digits", "cnn")}
    # --methods: those rows only (finetuned's start, single, trains unreported).
    assert [row["method"] for row in rows] == ["finetuned", "batchensemble"]
    for row in rows:
        assert "aurc" in row["in_distribution"]
        for scores in row["ood"].values():
            assert set(scores) == {
                "auroc_entropy",
                "auroc_mi",
                "fpr95_entropy",
                "fpr95_mi",
            }


# ------------------------------------------------------- a user's own data


def _user_data(severities=(1, 4, 6, 7), classes=3, n=120):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = (np.argmax(x[:, :classes], axis=1)).astype(np.int32)
    shifted = {
        s: {
            "noise": (x + 0.3 * s * rng.standard_normal(x.shape), y),
            **({"offset": (x + 0.2 * s, y)} if s != 4 else {}),
        }
        for s in severities
    }
    return QualityData(
        x[:80], y[:80], x[80:], y[80:], shifted, ood={"far": x[80:] + 10.0}
    )


def _tiny(rngs):
    from flax import nnx

    return nnx.Sequential(nnx.Linear(6, 3, rngs=rngs))


@pytest.mark.slow
def test_a_users_severities_and_families_are_all_reported(tmp_path):
    # Severities other than 1..5 (and a severity with one family less): every
    # one in the rows, in order, in the means, the tables and the plot.
    from ensembles.benchmark import run_quality, write_quality_plot

    data = _user_data()
    rows = run_quality(
        models=[_tiny],
        members=[2],
        steps=3,
        data=data,
        methods=["single", "batchensemble", "deep_ensemble"],
    )
    for row in rows:
        for measured in (row, row["recalibrated"]):
            assert [lv["severity"] for lv in measured["shift"]] == [1, 4, 6, 7]
            assert measured["shift_mean"]["nll"] == pytest.approx(
                np.mean([lv["nll"] for lv in measured["shift"]])
            )
    trained = train_method(
        "single", _tiny, data.x_train, data.y_train, num_members=1, steps=3
    )
    level = evaluate(trained, data, x_valid=data.x_train, y_valid=data.y_train)[
        "shift"
    ][1]
    x, y = data.shifted[4]["noise"]
    assert level["nll"] == pytest.approx(
        float(uncertainty.nll(trained.predict(x), y)), rel=1e-5
    )
    text = format_quality(rows)
    assert "shift 1" in text and "shift 6" in text and "shift 7" in text
    json.dumps(summarize(rows))  # the JSON of the command
    write_quality_plot(rows, str(tmp_path / "mine.png"))
    assert (tmp_path / "mine.png").stat().st_size > 10_000


def _bad_data(**changes):
    data = _user_data()
    return {**dataclasses.asdict(data), **changes}


@pytest.mark.parametrize(
    "changes, error, message",
    [
        ({"shifted": {}}, ValueError, "`shifted` must map at least one severity"),
        ({"shifted": {1: {}}}, ValueError, "`shifted[1]` must map at least one"),
        ({"shifted": {(1,): None}}, TypeError, "severities (keys of `shifted`)"),
        ({"x_test": None}, TypeError, "`x_test` must be a numpy (or JAX) array"),
        ({"y_train": np.zeros(80, np.float32)}, TypeError, "integer class indices"),
        ({"y_test": np.zeros(3, np.int32)}, ValueError, "`y_test` must have shape"),
        ({"x_test": np.zeros((40, 7))}, ValueError, "examples of shape (7,)"),
        ({"y_train": -np.ones(80, np.int32)}, ValueError, "labels >= 0, got -1"),
        ({"ood": [np.zeros((4, 6))]}, TypeError, "`ood` must be a dict"),
        ({"ood": {"far": np.zeros((4, 5))}}, ValueError, "`ood['far']` holds"),
        ({"name": 3}, TypeError, "`name` must be a str"),
    ],
)
def test_quality_data_is_checked_when_built(changes, error, message):
    with pytest.raises(error) as raised:
        QualityData(**_bad_data(**changes))
    assert message in str(raised.value)


def test_shifted_pairs_are_checked():
    x, y = np.zeros((4, 6), np.float32), np.zeros(4, np.int32)
    with pytest.raises(ValueError, match=r"`shifted\[2\]\['noise'\]\[1\]` must have"):
        QualityData(**_bad_data(shifted={2: {"noise": (x, y[:3])}}))
    with pytest.raises(ValueError, match="must be a pair"):
        QualityData(**_bad_data(shifted={2: {"noise": x}}))


def _no_training(monkeypatch):
    import ensembles.benchmark.quality.run as quality

    def refuse(*args, **kwargs):
        raise AssertionError("a method trained before every check ran")

    monkeypatch.setattr(quality, "train_method", refuse)


def test_a_model_with_too_few_outputs_is_refused_before_training(monkeypatch):
    from flax import nnx

    from ensembles.benchmark import run_quality

    _no_training(monkeypatch)
    methods = ["single", "batchensemble"]

    def two_logits(rngs):
        return nnx.Sequential(nnx.Linear(6, 2, rngs=rngs))

    with pytest.raises(ValueError) as raised:
        run_quality(models=[two_logits], data=_user_data(), steps=2, methods=methods)
    assert "gives 2 logits per example, but the data has 3 classes" in str(raised.value)

    def flat(rngs):
        linear = nnx.Linear(6, 3, rngs=rngs)
        return lambda x: linear(x).reshape(-1)

    with pytest.raises(ValueError, match=r"to logits \[N, classes\]; on N = 2 it gave"):
        run_quality(models=[flat], data=_user_data(), steps=2, methods=methods)

    def wrong_input(rngs):
        return nnx.Sequential(nnx.Linear(40, 3, rngs=rngs))

    with pytest.raises(ValueError, match="fails on a batch of the data's examples"):
        run_quality(models=[wrong_input], data=_user_data(), steps=2, methods=methods)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"methods": ["single", "bagging"]}, "`methods` must be names from"),
        ({"methods": ["single", "mc_dropout"]}, "must take a `dropout` keyword"),
        ({"models": ["resnet"]}, "`model` must be one of"),
        ({"data": "mnist1d"}, "`data` must be an `ensembles.benchmark.QualityData`"),
    ],
)
def test_every_check_runs_before_any_training(monkeypatch, kwargs, message):
    from ensembles.benchmark import run_quality

    _no_training(monkeypatch)
    options = {"models": [_tiny], "data": _user_data(), "steps": 2, **kwargs}
    with pytest.raises((ValueError, TypeError)) as raised:
        run_quality(**options)
    assert message in str(raised.value)


def test_a_factory_module_in_the_working_directory_is_found(tmp_path, monkeypatch):
    import sys

    from ensembles.benchmark.arguments import load_factory

    (tmp_path / "my_model_here.py").write_text(
        "from flax import nnx\n"
        "def build(rngs):\n"
        "    return nnx.Sequential(nnx.Linear(40, 10, rngs=rngs))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    assert load_factory("my_model_here:build").__name__ == "build"
    with pytest.raises(ValueError, match="add its folder to PYTHONPATH"):
        load_factory("not_a_module_anywhere:build")


@pytest.mark.slow
def test_a_temperature_the_validation_set_cannot_identify_is_flagged():
    # On held-out examples without a single error the NLL falls as T -> 0:
    # the fit ends at its lower bound, and the row and the table say so.
    data = _user_data()
    # 150 steps: 60 left the tiny ensemble below chance under the N(1, 0.5)
    # fast weights, where the fair fit rightly ends at the upper bound.
    trained = train_method(
        "batchensemble", _tiny, data.x_train, data.y_train, num_members=2, steps=150
    )
    pooled = np.asarray(trained.predict(data.x_train)).mean(axis=0)
    right = pooled.argmax(-1) == data.y_train
    assert 10 < right.sum() < len(right)
    flagged = evaluate(
        trained, data, x_valid=data.x_train[right], y_valid=data.y_train[right]
    )
    assert flagged["temperature"] == pytest.approx(0.05, rel=1e-3)
    assert flagged["temperature_at_bound"] is True
    fair = evaluate(trained, data, x_valid=data.x_train, y_valid=data.y_train)
    assert fair["temperature_at_bound"] is False
    row = {"method": "batchensemble", "model": "tiny", "members": 2, "seed": 0}
    rows = [{**row, "params": 1, "train_s": 1.0, **flagged}]
    text = format_quality(rows)
    assert "the held-out examples did not identify it" in text
    assert any(
        line.startswith("batchensemble") and "*" in line for line in text.splitlines()
    )


def test_a_diverged_classifier_is_marked_and_the_others_stand(data):
    # A method whose logits are NaN (training diverged) crashed the whole run
    # after training, in the temperature fit; now its row says so.
    def nan_logits(x):
        return np.full((2, len(x), 10), np.nan, np.float32)

    broken = Trained(method="single", predict=nan_logits, params=0, train_s=0.0)

    _, x_valid, y_valid = split_validation(data)
    result = evaluate(broken, data, x_valid=x_valid, y_valid=y_valid)
    assert result["diverged"] and np.isnan(result["temperature"])
    assert np.isnan(result["recalibrated"]["in_distribution"]["nll"])
    rows = [
        row
        for seed in (0, 1)
        for row in (
            {**_row("single", 0.5, seed), "diverged": True,
             "in_distribution": {"nll": np.nan}},
            {**_row("batchensemble", 0.4, seed), "diverged": False},
            {**_row("deep_ensemble", 0.3, seed), "diverged": False},
        )
    ]  # fmt: skip
    text = format_quality(rows)
    assert "single (diverged)" in text
    # The best cell is filled although the first method's value is NaN.
    best = next(line for line in text.splitlines() if line.startswith("best"))
    assert "deep_ensemble" in best
    assert summarize(rows)[1]["gap_closed_as_trained"]["in_distribution"] is None


def test_the_recipe_for_shift_has_a_head_per_member():
    # batchensemble_shift: docs/training.md's recipe for shift, an
    # EnsembleLinear output layer drawn afresh per member (the benchmark
    # measures its per-member calibration for every method).
    x = np.random.default_rng(0).standard_normal((40, 40)).astype(np.float32)
    y = np.arange(40) % 10
    trained = train_method("batchensemble_shift", "mlp", x, y, num_members=3, steps=2)
    head = trained.model.layers[-1]
    assert type(head) is ensembles.EnsembleLinear
    kinds = [type(layer) for layer in trained.model.layers]
    assert kinds.count(ensembles.BatchEnsembleLinear) == 2  # the hidden ones
    kernel = np.asarray(head.kernel[...])
    assert not np.allclose(kernel[0], kernel[1])
    assert trained.predict(x[:5]).shape == (3, 5, 10)


def test_an_independent_head_is_drawn_afresh_per_member():
    x = np.random.default_rng(0).standard_normal((40, 40)).astype(np.float32)
    y = np.arange(40) % 10
    trained = train_method(
        "batchensemble", "mlp", x, y, num_members=3, steps=2, independent_head=True
    )
    head = trained.model.layers[-1]
    assert type(head) is ensembles.EnsembleLinear
    kernel = np.asarray(head.kernel[...])
    assert kernel.shape[0] == 3 and not np.allclose(kernel[0], kernel[1])
    assert trained.predict(x[:5]).shape == (3, 5, 10)


@pytest.mark.parametrize(
    "method", ["single", "deep_ensemble", "mc_dropout", "finetuned"]
)
def test_an_independent_head_is_refused_where_no_model_is_converted(method):
    """It was silently ignored: a row labelled with a head it did not have
    (issue 67). Refused before anything is built or trained."""
    x, y = np.zeros((8, 40), np.float32), np.arange(8) % 10
    start = object() if method == "finetuned" else None  # refused before it is read
    with pytest.raises(ValueError, match=rf"`independent_head=True`.*{method!r}"):
        train_method(method, "mlp", x, y, num_members=2, steps=1, start=start,
                     independent_head=True)  # fmt: skip


def test_an_infinite_figure_in_a_seed_aggregates_without_raising():
    # A calibrator that gives a label probability 0 makes that seed's NLL
    # infinite: the summary says so (mean inf, spread undefined), and no
    # gap is claimed from it; statistics.stdev raised on it.
    import math

    from ensembles.benchmark.quality import report

    found = report._mean_std([1.0, math.inf, 2.0])
    assert found["mean"] == math.inf and math.isnan(found["std"])
    figures = {"nll": {"mean": math.inf, "std": math.nan}}
    finite = {"nll": {"mean": 1.0, "std": 0.1}}
    assert report._gap_closed(finite, figures, finite, (3, 3), "nll") is None
