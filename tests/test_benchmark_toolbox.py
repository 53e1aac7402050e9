"""The quality benchmark's toolbox figures equal ensembles.uncertainty's own.

No training: a "trained" method whose members are fixed linear maps, so
every figure of evaluate() can be recomputed here with the public functions
(calibrators fitted on the held-out examples, conformal sets, OOD scores,
selective prediction by score; a regressor's conformal intervals), and the
tables show them.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from ensembles import uncertainty
from ensembles.benchmark import QualityData, format_quality
from ensembles.benchmark.quality.classification.scores import evaluate
from ensembles.benchmark.quality.classification.toolbox import (
    CALIBRATORS,
    OOD_SCORES,
    SELECTIVE_SCORES,
    SET_LEVEL,
    SET_VARIANTS,
)
from ensembles.benchmark.quality.methods import Trained
from ensembles.benchmark.quality.regression.scores import (
    TargetScale,
    evaluate_regression,
)


def _classification(num_members):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((360, 5)).astype(np.float32)
    y = np.argmax(x[:, :3] + 0.5 * rng.standard_normal((360, 3)), axis=1)
    weights = jnp.asarray(
        2 * np.eye(5, 3)[None] + 0.5 * rng.standard_normal((num_members, 5, 3)),
        jnp.float32,
    )

    def predict(inputs):
        return jnp.einsum("nf,efc->enc", jnp.asarray(inputs, jnp.float32), weights)

    shifted = {
        s: {"noise": (x[300:] + s * rng.standard_normal((60, 5)), y[300:])}
        for s in (0.5, 1.0)
    }
    data = QualityData(
        x[:200], y[:200], x[300:], y[300:], shifted, ood={"far": 3 * x[300:] + 4}
    )
    trained = Trained("batchensemble", predict, params=1, train_s=0.0)
    return trained, data, x[200:300], y[200:300]


# The slow tier: each compiles the whole toolbox's figures (10 s); the quick
# tier runs it through run_quality's doctest, without this comparison.
@pytest.mark.slow
@pytest.mark.parametrize("num_members", [1, 3])
def test_classifier_toolbox_figures_equal_the_uncertainty_module(num_members):
    trained, data, x_valid, y_valid = _classification(num_members)
    result = evaluate(trained, data, x_valid=x_valid, y_valid=y_valid)
    valid, test = trained.predict(x_valid), trained.predict(data.x_test)
    # Calibrators: fitted on the held-out examples alone.
    assert set(result["calibrators"]) == set(CALIBRATORS)
    for name, (fit, apply, members) in CALIBRATORS.items():
        calibrated = apply(test, *fit(valid, y_valid, members=members))
        figures = result["calibrators"][name]["in_distribution"]
        assert figures["nll"] == pytest.approx(
            float(uncertainty.nll(calibrated, data.y_test)), rel=1e-5
        ), name
        assert figures["ece"] == pytest.approx(
            float(uncertainty.ece(calibrated, data.y_test)), rel=1e-5, abs=1e-7
        ), name
    # Conformal sets at 90%, fitted on the held-out examples.
    for name, (score, randomised, members) in SET_VARIANTS.items():
        if randomised:
            continue  # its uniforms are the benchmark's own
        threshold = uncertainty.fit_conformal_threshold(
            valid, y_valid, SET_LEVEL, score=score, members=members
        )
        sets = uncertainty.conformal_sets(test, threshold, score=score)
        measured = result["sets"]["in_distribution"]
        assert measured[f"size_{name}"] == pytest.approx(
            float(jnp.mean(uncertainty.set_size(sets))), rel=1e-6
        )
        assert measured[f"coverage_{name}"] == pytest.approx(
            float(jnp.mean(uncertainty.set_coverage(sets, data.y_test))), rel=1e-6
        )
    assert set(result["sets"]["shift_mean"]) == set(result["sets"]["in_distribution"])
    # OOD scores, as trained.
    out = trained.predict(data.ood["far"])
    for name, score in OOD_SCORES.items():
        assert result["ood_scores"]["far"][f"auroc_{name}"] == pytest.approx(
            float(uncertainty.auroc(score(test), score(out)))
        )
    # Selective prediction by score; one member has no mutual information.
    for name, score in SELECTIVE_SCORES.items():
        measured = result["selective"]["in_distribution"][name]
        if name == "mutual_information" and num_members == 1:
            assert measured is None
            continue
        scores = None if score is None else score(test)
        assert measured == pytest.approx(
            float(uncertainty.aurc(test, data.y_test, scores=scores)), rel=1e-6
        )
    # The tables show them all.
    row = {
        "method": "batchensemble",
        "model": "linear",
        "members": num_members,
        "seed": 0,
        "params": 1,
        "train_s": 0.0,
        **result,
    }
    text = format_quality([row])
    for caption in (
        "one temperature beside the calibrators that go beyond it",
        "Conformal sets at 90%",
        "Out-of-distribution detection by score, AUROC",
        "Selective prediction by score, AURC",
    ):
        assert caption in text, caption
    assert "members: Dirichlet" in text and "far energy" in text


def test_a_diverged_classifier_has_nan_toolbox_figures():
    trained, data, x_valid, y_valid = _classification(2)

    def diverged(inputs):
        return trained.predict(inputs).at[0, 0, 0].set(jnp.nan)

    result = evaluate(
        Trained("batchensemble", diverged, params=1, train_s=0.0),
        data,
        x_valid=x_valid,
        y_valid=y_valid,
    )
    assert result["diverged"]
    for figures in result["calibrators"].values():
        assert all(math.isnan(v) for v in figures["in_distribution"].values())
    assert all(math.isnan(v) for v in result["sets"]["shift_mean"].values())
    assert all(math.isnan(v) for v in result["selective"]["in_distribution"].values())
    assert math.isnan(result["ood_scores"]["far"]["auroc_energy"])


@pytest.mark.slow
def test_regressor_conformal_intervals_equal_the_uncertainty_module():
    rng = np.random.default_rng(1)
    x = rng.uniform(-2, 2, (300, 1)).astype(np.float32)
    y = (x[:, 0] + (0.2 + np.abs(x[:, 0])) * rng.standard_normal(300)).astype(
        np.float32
    )
    scale = TargetScale(y[:150])

    def predict(inputs):
        inputs = jnp.asarray(inputs, jnp.float32)
        means = jnp.stack([inputs[:, 0], 1.1 * inputs[:, 0]])
        spread = jnp.log(jnp.expm1(0.5 + 0.3 * jnp.abs(inputs[:, 0])))
        return jnp.stack(
            [(means - scale.mean) / scale.std, jnp.stack([spread, spread])], axis=-1
        )

    shifted = {1: {"wider": (2 * x[250:], y[250:])}}
    data = QualityData(
        x[:150], y[:150], x[250:], y[250:], shifted, ood={}, regression=True
    )
    trained = Trained("batchensemble", predict, params=1, train_s=0.0)
    result = evaluate_regression(
        trained, data, x_valid=x[150:250], y_valid=y[150:250], scale=scale
    )
    valid = scale.members(predict(x[150:250]))
    margin = uncertainty.fit_conformal_margin(*valid, y[150:250], 0.9)
    assert result["conformal_margin"] == pytest.approx(float(margin), rel=1e-6)
    lower, upper = uncertainty.conformal_mixture_interval(
        *scale.members(predict(data.x_test)), margin, 0.9
    )
    inside = (data.y_test >= np.asarray(lower)) & (data.y_test <= np.asarray(upper))
    measured = result["in_distribution"]
    assert measured["coverage90_cqr"] == pytest.approx(float(np.mean(inside)))
    assert measured["width90_cqr"] == pytest.approx(
        float(np.mean(np.asarray(upper) - np.asarray(lower))), rel=1e-6
    )
    assert {"coverage90_conformal", "width90_conformal"} <= set(measured)
    row = {
        "method": "batchensemble",
        "model": "linear",
        "members": 2,
        "seed": 0,
        "params": 1,
        "train_s": 0.0,
        "regression": True,
        **result,
    }
    text = format_quality([row])
    assert "conformal mixture (CQR)" in text and "90% intervals as trained" in text
