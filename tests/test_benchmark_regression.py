"""``ensembles-bench --quality`` on regression data: tasks, methods, metrics, output.

References: the tasks' generating formulas (the noise they know), numpy
recomputations of the target scaling, the library's scores on hand-built
predictions, and a user's own regression data through ``QualityData``.
"""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ensembles import uncertainty
from ensembles.benchmark import main
from ensembles.benchmark.quality.checks import check_run
from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.methods import MIN_STD, Trained
from ensembles.benchmark.quality.plots import write_quality_plot
from ensembles.benchmark.quality.regression.real_tasks import REAL_REGRESSION_TASKS
from ensembles.benchmark.quality.regression.scores import (
    REGRESSION_METRICS,
    TargetScale,
    evaluate_regression,
)
from ensembles.benchmark.quality.regression.tasks import (
    REGRESSION_TASKS,
    load_concrete,
    load_concrete_data,
    load_cubic_data,
    load_hetero_sine_gap_data,
)
from ensembles.benchmark.quality.report import format_quality, summarize
from ensembles.benchmark.quality.run import run_quality, split_validation

# ------------------------------------------------------------------ the tasks


@pytest.mark.parametrize(
    "name", sorted(set(REGRESSION_TASKS) - set(REAL_REGRESSION_TASKS))
)  # the real tables': tests/test_quality_real_tasks.py
def test_tasks_are_deterministic_finite_regression_data(name):
    first = REGRESSION_TASKS[name].__wrapped__()
    again = REGRESSION_TASKS[name].__wrapped__()
    assert first.regression and first.name == name
    np.testing.assert_array_equal(first.x_train, again.x_train)
    np.testing.assert_array_equal(first.y_test, again.y_test)
    assert first.x_train.dtype == np.float32 and first.y_train.dtype == np.float32
    # Standardised with the training inputs' statistics.
    np.testing.assert_allclose(first.x_train.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(first.x_train.std(axis=0), 1.0, atol=1e-4)
    assert first.ood and len(first.severities) >= 3


def test_cubic_shifts_extrapolate_and_ood_is_far():
    data = load_cubic_data()
    reach = np.abs(data.x_train).max()
    inside = np.abs(data.x_test).max()
    for k in data.severities:
        x, _ = data.shifted[k]["extrapolation"]
        assert np.abs(x).min() > 0.95 * inside  # beyond the training range
    far = np.abs(data.ood["far"])
    assert far.min() > 1.9 * reach
    np.testing.assert_array_equal(data.noise_std, 3.0)


def test_hetero_sine_gap_noise_is_the_stated_one():
    data = load_hetero_sine_gap_data()
    # The test inputs in their own units: x = 5 + standardised x * std; the
    # noise the task states, 0.3 sqrt(1 + x^2), must equal data.noise_std.
    raw = np.sqrt(np.asarray(data.noise_std, np.float64) ** 2 / 0.09 - 1)
    order = np.argsort(data.x_test[:, 0])
    assert np.all(np.diff(raw[order]) >= -1e-3)  # noise grows with x
    # Residuals from the true mean: their spread matches the stated noise.
    residual = data.y_test - raw * np.sin(raw)
    z = residual / data.noise_std
    assert abs(np.std(z) - 1.0) < 0.05 and abs(np.mean(z)) < 0.05
    gap_x = data.shifted[5]["gap"][0][:, 0]
    assert np.all(np.abs(gap_x - np.median(gap_x)) < 0.2)  # the gap's middle


def test_concrete_is_the_bundled_uci_data_split_by_age_and_cement():
    x, y, names = load_concrete()
    assert x.shape == (1030, 8) and names[0] == "cement" and names[-1] == "age"
    assert y.min() > 2.0 and y.max() < 83.0
    data = load_concrete_data()
    assert len(data.x_train) + len(data.x_test) == 611
    assert [len(data.shifted[k]["age"][0]) for k in (1, 2, 3)] == [68, 105, 44]
    assert [len(data.shifted[k]["cement"][0]) for k in (1, 2, 3)] == [69, 33, 36]


# ------------------------------------------------------------------ the data


def test_quality_data_refuses_bad_regression_targets():
    x = np.zeros((10, 2), np.float32)
    y = np.linspace(0, 1, 10).astype(np.float32)
    shifted = {1: {"f": (x, y)}}
    with pytest.raises(TypeError, match="regression=True"):
        QualityData(x, y, x, y, shifted, {})
    bad = y.copy()
    bad[3] = np.nan
    with pytest.raises(ValueError, match="`y_test` must hold finite targets"):
        QualityData(x, y, x, bad, shifted, {}, regression=True)
    with pytest.raises(ValueError, match=r"shape \[N\] or \[N, D\]"):
        QualityData(x, y, x, y[:, None], shifted, {}, regression=True)
    with pytest.raises(ValueError, match="`noise_std` must have"):
        QualityData(x, y, x, y, shifted, {}, regression=True, noise_std=y[:3])
    with pytest.raises(ValueError, match="for regression data"):
        QualityData(
            x,
            y.astype(int),
            x,
            y.astype(int),
            {1: {"f": (x, y.astype(int))}},
            {},
            noise_std=y,
        )
    nan_x = x.copy()
    nan_x[2, 1] = np.nan
    with pytest.raises(
        ValueError, match=r"`x_valid` must hold finite numbers.*x_valid\[2\]"
    ):
        QualityData(x, y, x, y, shifted, {}, x_valid=nan_x, y_valid=y, regression=True)


def test_target_scale_maps_predictions_back_to_the_targets_units():
    targets = np.array([1.0, 3.0, 5.0, 7.0])
    scale = TargetScale(targets)
    assert scale.mean == 4.0 and scale.std == pytest.approx(np.sqrt(5.0))
    np.testing.assert_allclose(
        scale.standardise(targets), (targets - 4) / np.sqrt(5), rtol=1e-6
    )
    outputs = jnp.array([[[0.5, -1.0], [-2.0, 3.0]]])  # [E=1, N=2, 2]
    means, stds = scale.members(outputs)
    np.testing.assert_allclose(
        means, [[4 + 0.5 * np.sqrt(5), 4 - 2 * np.sqrt(5)]], rtol=1e-6
    )
    softplus = np.log1p(np.exp([-1.0, 3.0]))
    np.testing.assert_allclose(stds, [(softplus + MIN_STD) * np.sqrt(5)], rtol=1e-6)


# ------------------------------------------------------------------ evaluation


def _tiny(seed=0, count=160):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (count, 3)).astype(np.float32)
    y = (2 * x[:, 0] + 0.3 * rng.standard_normal(count) + 10).astype(np.float32)
    shifted = {
        s: {"scale": ((x[:40] * (1 + s)).astype(np.float32), y[:40])} for s in (1, 2)
    }
    ood = {"far": (x[:40] + 5).astype(np.float32)}
    return QualityData(
        x[:120], y[:120], x[120:], y[120:], shifted, ood, name="tiny", regression=True
    )


def _fixed(outputs_of):
    """A Trained whose members' raw outputs are a function of the inputs."""
    return Trained(
        method="fixed",
        predict=lambda x: jnp.asarray(outputs_of(np.asarray(x))),
        params=0,
        train_s=0.0,
    )


@pytest.mark.slow
def test_evaluate_regression_scores_the_mixture_in_target_units():
    data = _tiny()
    train, x_valid, y_valid = split_validation(data)
    scale = TargetScale(train.y_train)

    def outputs(x):  # two members: means 2 x0 shifted apart, spread 0.3-ish
        mean = (2 * x[:, 0] + 10 - scale.mean) / scale.std
        raw = np.log(np.expm1(0.3 / scale.std))  # softplus^-1
        return np.stack(
            [np.stack([mean + d, np.full_like(mean, raw)], -1) for d in (-0.1, 0.1)]
        )

    result = evaluate_regression(
        _fixed(outputs), data, x_valid=x_valid, y_valid=y_valid, scale=scale
    )
    means, stds = scale.members(jnp.asarray(outputs(data.x_test)))
    expected = float(uncertainty.mixture_nll(means, stds, data.y_test))
    assert result["in_distribution"]["nll"] == pytest.approx(expected, rel=1e-5)
    assert set(REGRESSION_METRICS) <= set(result["in_distribution"])
    valid_means, valid_stds = scale.members(jnp.asarray(outputs(x_valid)))
    fitted = float(
        uncertainty.fit_std_scale(valid_means, valid_stds, y_valid, bounds=(0.05, 20))
    )
    assert result["std_scale"] == pytest.approx(fitted, rel=1e-5)
    scaled = uncertainty.scale_std(means, stds, fitted)
    assert result["recalibrated"]["in_distribution"]["crps"] == pytest.approx(
        float(uncertainty.crps(*scaled, data.y_test)), rel=1e-5
    )
    assert result["ood"]["far"]["auroc_epistemic"] is not None
    assert len(result["pit_curve"]) == 19 and not result["diverged"]


def test_a_diverged_method_is_marked_and_the_others_stand():
    data = _tiny()
    train, x_valid, y_valid = split_validation(data)
    scale = TargetScale(train.y_train)

    def row(method, outputs_of):
        measured = evaluate_regression(
            _fixed(outputs_of), data, x_valid=x_valid, y_valid=y_valid, scale=scale
        )
        return {
            "task": "tiny",
            "regression": True,
            "method": method,
            "model": "m",
            "members": 2,
            "seed": 0,
            "params": 1,
            "train_s": 0.0,
            **measured,
        }

    def fine(spread):  # two members near the truth, of a given spread
        def outputs(x):
            mean = (2 * x[:, 0] + 10 - scale.mean) / scale.std
            raw = np.full_like(mean, np.log(np.expm1(spread)))
            return np.stack([np.stack([mean + d, raw], -1) for d in (-0.05, 0.05)])

        return outputs

    rows = [row("single", fine(0.2)), row("deep_ensemble", fine(0.15))]
    broken = evaluate_regression(
        _fixed(lambda x: np.full((2, len(x), 2), np.nan, np.float32)),
        data,
        x_valid=x_valid,
        y_valid=y_valid,
        scale=scale,
    )
    assert broken["diverged"] and math.isnan(broken["std_scale"])
    assert math.isnan(broken["recalibrated"]["in_distribution"]["nll"])
    rows.append({**rows[0], **broken, "method": "batchensemble"})
    text = format_quality(rows)
    assert "batchensemble (diverged)" in text
    best = next(line for line in text.split("\n") if line.startswith("best"))
    assert "batchensemble" not in best and best.split()[1:]  # the best cells are filled


# ------------------------------------------------------------------ end to end


def _mlp(rngs, dropout=0.0):
    layers = [nnx.Linear(3, 16, rngs=rngs), nnx.relu]
    if dropout:
        layers.append(nnx.Dropout(dropout, rngs=rngs))
    return nnx.Sequential(*layers, nnx.Linear(16, 2, rngs=rngs))


@pytest.mark.slow
def test_a_users_regression_data_runs_every_method(tmp_path):
    data = _tiny()
    rows = run_quality(models=[_mlp], members=[2], steps=5, data=data)
    assert [row["method"] for row in rows] == [
        "single",
        "batchensemble",
        "batchensemble_shift",
        "rank1",
        "finetuned",
        "deep_ensemble",
        "mc_dropout",
    ]
    for row in rows:
        assert row["regression"] and row["validation_examples"] == 50
        assert row["std_scale"] > 0 and not row["diverged"]
        for metric in REGRESSION_METRICS:
            assert math.isfinite(row["in_distribution"][metric]), (
                row["method"],
                metric,
            )
        assert [level["severity"] for level in row["shift"]] == [1, 2]
    summary = summarize(rows)
    be = next(e for e in summary if e["method"] == "batchensemble")
    # One seed has no spread to tell a gap from noise: no "gap closed".
    assert "gap_closed_crps" not in be and "gap_closed" not in be
    text = format_quality(rows, markdown=True)
    assert "**_mlp on tiny, E=2, 1 seed**" in text and "| shift CRPS |" in text
    assert "No CRPS gap closed is given: it needs at least two seeds" in text
    json.dumps(rows)
    write_quality_plot(rows, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_check_run_wants_two_outputs_per_target():
    data = _tiny()

    def three(rngs):
        return nnx.Sequential(nnx.Linear(3, 3, rngs=rngs))

    with pytest.raises(ValueError, match="needs 2: a mean and a raw spread per target"):
        check_run([three], ["single"], data)


@pytest.mark.slow
def test_the_command_runs_a_regression_task(tmp_path, capsys):
    out, plot = tmp_path / "out.json", tmp_path / "out.png"
    status = main(
        [
            "--quality",
            "--quick",
            "--task",
            "cubic",
            "--steps",
            "3",
            "--methods",
            "single,batchensemble,deep_ensemble",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert (
        "cubic: 20 training examples, 20 more held out to fit spread scales" in printed
    )
    assert "mlp on cubic" in printed and "shift CRPS" in printed
    rows = json.loads(out.read_text())["results"]
    assert [row["method"] for row in rows] == [
        "single",
        "batchensemble",
        "deep_ensemble",
    ]
    assert "bands" in rows[0] and plot.stat().st_size > 10_000
