import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ensembles
from ensembles import uncertainty
from tests.tolerances import assert_close

# --------------------------------------------------------------------------------
# Plain float64 numpy references, written the obvious way, one formula at a time.


def ref_member_log_probs(logits):
    x = np.asarray(logits, np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def ref_predictive_log_probs(logits):
    log_probs = ref_member_log_probs(logits)
    top = log_probs.max(axis=0)
    return (
        top + np.log(np.exp(log_probs - top).sum(axis=0)) - np.log(log_probs.shape[0])
    )


def ref_predictive_probs(logits):
    return np.exp(ref_member_log_probs(logits)).mean(axis=0)


def ref_entropy(probs):
    terms = np.zeros_like(probs)
    positive = probs > 0
    terms[positive] = probs[positive] * np.log(probs[positive])
    return -terms.sum(axis=-1)


def ref_total_entropy(logits):
    return ref_entropy(ref_predictive_probs(logits))


def ref_expected_entropy(logits):
    return ref_entropy(np.exp(ref_member_log_probs(logits))).mean(axis=0)


def ref_mutual_information(logits):
    return np.maximum(ref_total_entropy(logits) - ref_expected_entropy(logits), 0.0)


def ref_disagreement(logits):
    member_probs = np.exp(ref_member_log_probs(logits))
    ensemble_class = member_probs.mean(axis=0).argmax(axis=-1)
    num_members, num_examples = member_probs.shape[:2]
    result = np.zeros(num_examples)
    for b in range(num_examples):
        for k in range(num_members):
            result[b] += member_probs[k, b].argmax() != ensemble_class[b]
    return result / num_members


def ref_variance(logits):
    member_probs = np.exp(ref_member_log_probs(logits))
    return np.var(member_probs, axis=0).sum(axis=-1)


def ref_nll(logits, labels):
    log_probs = ref_predictive_log_probs(logits)
    return -np.mean([log_probs[b, y] for b, y in enumerate(labels)])


def ref_accuracy(logits, labels):
    return np.mean(ref_predictive_probs(logits).argmax(axis=-1) == labels)


def ref_brier(logits, labels):
    probs = ref_predictive_probs(logits)
    onehot = np.eye(probs.shape[-1])[labels]
    return np.mean(((probs - onehot) ** 2).sum(axis=-1))


def ref_ece(logits, labels, num_bins):
    probs = ref_predictive_probs(logits)
    confidence = probs.max(axis=-1)
    correct = probs.argmax(axis=-1) == labels
    total = 0.0
    for i in range(num_bins):
        low, high = i / num_bins, (i + 1) / num_bins
        in_bin = (confidence > low) & (confidence <= high)
        if in_bin.any():
            gap = abs(correct[in_bin].mean() - confidence[in_bin].mean())
            total += in_bin.mean() * gap
    return total


def ref_auroc(in_scores, out_scores):
    wins = 0.0
    for out in np.asarray(out_scores, np.float64):
        for inside in np.asarray(in_scores, np.float64):
            wins += 1.0 if out > inside else 0.5 if out == inside else 0.0
    return wins / (len(in_scores) * len(out_scores))


PER_EXAMPLE = {
    "predictive_probs": ref_predictive_probs,
    "total_entropy": ref_total_entropy,
    "expected_entropy": ref_expected_entropy,
    "mutual_information": ref_mutual_information,
    "disagreement": ref_disagreement,
    "variance": ref_variance,
}
METRICS = {
    "nll": ref_nll,
    "accuracy": ref_accuracy,
    "brier": ref_brier,
}
# Tests reuse these shapes where they can: each compiles once per shape.
SHAPES = [(1, 5, 3), (2, 7, 2), (4, 33, 10)]
SHAPE = SHAPES[-1]


def random_logits(seed, shape, scale=3.0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return jnp.asarray(scale * rng.standard_normal(shape), dtype)


def random_labels(seed, shape):
    rng = np.random.default_rng(seed + 1000)
    return jnp.asarray(rng.integers(0, shape[-1], shape[1]), jnp.int32)


# ---------------------------------------------------------------- against numpy


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(PER_EXAMPLE))
def test_per_example_measures_match_numpy(name, shape):
    logits = random_logits(zlib.crc32(f"{name}{shape}".encode()), shape)
    actual = getattr(uncertainty, name)(logits)
    expected = PER_EXAMPLE[name](np.asarray(logits))
    _, num_examples, num_classes = shape
    assert actual.shape == expected.shape
    assert actual.shape == (
        (num_examples, num_classes) if name == "predictive_probs" else (num_examples,)
    )
    assert actual.dtype == jnp.float32
    assert_close(actual, expected)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(METRICS))
def test_metrics_match_numpy(name, shape):
    seed = zlib.crc32(f"{name}{shape}".encode())
    logits, labels = random_logits(seed, shape), random_labels(seed, shape)
    actual = getattr(uncertainty, name)(logits, labels)
    assert actual.shape == ()
    assert_close(actual, METRICS[name](np.asarray(logits), np.asarray(labels)))


@pytest.mark.parametrize("num_bins", [1, 5, 15])
@pytest.mark.parametrize("shape", [(3, 200, 5), (1, 64, 10)])
def test_ece_matches_explicit_bin_loop(shape, num_bins):
    logits = random_logits(num_bins, shape, scale=2.0)
    # Labels that mostly follow the prediction, so the bins are not all wrong.
    rng = np.random.default_rng(num_bins)
    predicted = np.asarray(ref_predictive_probs(logits).argmax(-1))
    labels = np.where(
        rng.random(shape[1]) < 0.7, predicted, rng.integers(0, shape[2], shape[1])
    )
    actual = uncertainty.ece(logits, jnp.asarray(labels), num_bins=num_bins)
    expected = ref_ece(np.asarray(logits), labels, num_bins)
    assert expected > 0.01  # a real calibration gap, not a trivial zero
    assert_close(actual, expected)


def test_ece_of_confident_predictions_and_one_bin():
    sure = jnp.asarray([[[1e4, -1e4], [-1e4, 1e4], [1e4, -1e4]]], jnp.float32)
    # Confidence 1 lands in the last bin (i/M, 1]; right everywhere is 0 ECE.
    assert_close(uncertainty.ece(sure, jnp.array([0, 1, 0])), 0.0)
    assert_close(uncertainty.ece(sure, jnp.array([1, 0, 1])), 1.0)
    assert_close(uncertainty.ece(sure, jnp.array([0, 0, 0])), 1 / 3)
    # Bins are (low, high]: confidence exactly 0.5 (two opposite members)
    # falls in the lower of two bins, apart from a wrong confidence-1 example.
    on_edge = jnp.asarray(
        [[[1e4, -1e4], [-1e4, 1e4]], [[-1e4, 1e4], [-1e4, 1e4]]], jnp.float32
    )
    labels = jnp.array([0, 0])
    expected = ref_ece(np.asarray(on_edge), np.asarray(labels), 2)
    np.testing.assert_allclose(expected, (abs(1 - 0.5) + abs(0 - 1.0)) / 2)
    assert_close(uncertainty.ece(on_edge, labels, num_bins=2), expected)
    # One bin: |accuracy - mean confidence| over the whole batch.
    logits = random_logits(7, (3, 200, 5))
    labels = random_labels(7, (3, 200, 5))
    probs = ref_predictive_probs(np.asarray(logits))
    expected = abs(
        np.mean(probs.argmax(-1) == np.asarray(labels)) - probs.max(-1).mean()
    )
    assert_close(uncertainty.ece(logits, labels, num_bins=1), expected)


def test_total_is_aleatoric_plus_epistemic():
    logits = random_logits(3, SHAPE)
    assert_close(
        uncertainty.total_entropy(logits),
        uncertainty.expected_entropy(logits) + uncertainty.mutual_information(logits),
    )
    assert float(jnp.min(uncertainty.mutual_information(logits))) > 1e-3


def test_predictive_probs_is_a_distribution():
    probs = uncertainty.predictive_probs(random_logits(4, SHAPE))
    assert_close(jnp.sum(probs, axis=-1), np.ones(SHAPE[1]))
    assert float(jnp.min(probs)) > 0


# ------------------------------------------------------------------------ AUROC


@pytest.mark.parametrize(
    ("num_in", "num_out", "ties"),
    [(1, 1, False), (7, 3, False), (50, 80, False), (40, 25, True), (9, 9, True)],
)
def test_auroc_matches_pair_counting(num_in, num_out, ties):
    rng = np.random.default_rng(num_in * 100 + num_out)
    if ties:  # few distinct values: many ties, within and across the two sets
        in_scores = rng.integers(0, 4, num_in).astype(np.float32)
        out_scores = rng.integers(1, 5, num_out).astype(np.float32)
    else:
        in_scores = rng.standard_normal(num_in).astype(np.float32)
        out_scores = (rng.standard_normal(num_out) + 0.7).astype(np.float32)
    actual = uncertainty.auroc(jnp.asarray(in_scores), jnp.asarray(out_scores))
    assert actual.shape == ()
    assert_close(actual, ref_auroc(in_scores, out_scores))


def test_auroc_matches_sklearn():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(11)
    in_scores = np.round(rng.standard_normal(300), 1).astype(np.float32)
    out_scores = np.round(rng.standard_normal(200) + 0.5, 1).astype(np.float32)
    labels = np.concatenate([np.zeros(300), np.ones(200)])
    expected = metrics.roc_auc_score(labels, np.concatenate([in_scores, out_scores]))
    assert_close(uncertainty.auroc(in_scores, out_scores), expected)


def test_auroc_extremes_and_int_scores():
    assert_close(uncertainty.auroc(jnp.array([0, 1]), jnp.array([2, 3])), 1.0)
    assert_close(uncertainty.auroc(jnp.array([2.0, 3.0]), jnp.array([0.0, 1.0])), 0.0)
    assert_close(uncertainty.auroc(jnp.full(5, 0.3), jnp.full(4, 0.3)), 0.5)
    assert_close(uncertainty.auroc([1, 3], [2.0, 3.0]), 0.625)


def test_auroc_separates_by_mutual_information():
    # The intended use: OOD examples are where the members disagree.
    rng = np.random.default_rng(5)
    shared = rng.standard_normal((1, 30, 5))
    agreeing = jnp.asarray(3 * shared + 0.1 * rng.standard_normal((4, 30, 5)))
    disagreeing = jnp.asarray(3 * rng.standard_normal((4, 30, 5)))
    score = uncertainty.mutual_information
    assert float(uncertainty.auroc(score(agreeing), score(disagreeing))) > 0.95


# ------------------------------------------------------------------- edge cases


def test_single_member_has_no_epistemic_uncertainty():
    logits = random_logits(8, SHAPES[0])
    np.testing.assert_array_equal(uncertainty.mutual_information(logits), 0.0)
    np.testing.assert_array_equal(uncertainty.disagreement(logits), 0.0)
    np.testing.assert_array_equal(uncertainty.variance(logits), 0.0)
    assert_close(
        uncertainty.total_entropy(logits), uncertainty.expected_entropy(logits)
    )
    assert_close(uncertainty.total_entropy(logits), ref_total_entropy(logits))


def test_identical_members_have_no_epistemic_uncertainty():
    _, num_examples, num_classes = SHAPE
    logits = jnp.broadcast_to(random_logits(9, (1, num_examples, num_classes)), SHAPE)
    assert_close(uncertainty.mutual_information(logits), np.zeros(num_examples))
    assert float(jnp.min(uncertainty.mutual_information(logits))) >= 0.0
    np.testing.assert_array_equal(uncertainty.disagreement(logits), 0.0)
    assert_close(uncertainty.variance(logits), np.zeros(num_examples))
    assert_close(uncertainty.predictive_probs(logits), ref_predictive_probs(logits[:1]))


def test_opposite_one_hot_members():
    logits = jnp.asarray([[[1e4, -1e4]], [[-1e4, 1e4]]], jnp.float32)
    assert_close(uncertainty.mutual_information(logits), [math.log(2)])
    assert_close(uncertainty.total_entropy(logits), [math.log(2)])
    assert_close(uncertainty.expected_entropy(logits), [0.0])
    assert_close(uncertainty.predictive_probs(logits), [[0.5, 0.5]])
    # The 50/50 predictive ties and picks class 0: the second member dissents.
    assert_close(uncertainty.disagreement(logits), [0.5])
    assert_close(uncertainty.variance(logits), [0.5])
    assert_close(uncertainty.nll(logits, jnp.array([1])), math.log(2))


def test_many_one_hot_members_reach_log_num_members():
    num_members = 4
    logits = jnp.asarray(2e4 * np.eye(num_members)[:, None, :] - 1e4, jnp.float32)
    assert_close(uncertainty.mutual_information(logits), [math.log(num_members)])
    assert_close(uncertainty.variance(logits), [1 - 1 / num_members])
    assert_close(uncertainty.disagreement(logits), [1 - 1 / num_members])


def test_extreme_logits_are_finite_and_accurate():
    rng = np.random.default_rng(12)
    logits = jnp.asarray(rng.choice([-1e4, 0.0, 1e4], SHAPE), jnp.float32)
    labels = random_labels(12, SHAPE)
    for name, ref in PER_EXAMPLE.items():
        actual = getattr(uncertainty, name)(logits)
        assert np.isfinite(np.asarray(actual)).all(), name
        assert_close(actual, ref(np.asarray(logits)))
    for name, ref in METRICS.items():
        actual = getattr(uncertainty, name)(logits, labels)
        assert np.isfinite(float(actual)), name
        assert_close(actual, ref(np.asarray(logits), np.asarray(labels)), scale=10)
    assert np.isfinite(float(uncertainty.ece(logits, labels)))


def test_nll_stays_in_log_space_when_every_member_is_sure_and_wrong():
    logits = jnp.asarray([[[1e4, -1e4]], [[1e4, -1e4]]], jnp.float32)
    # mean(softmax) underflows to exactly 0 for class 1; log-space does not.
    assert_close(uncertainty.nll(logits, jnp.array([1])), 2e4)


def test_masked_classes_and_gradients_stay_finite():
    # A class masked out with -inf has probability exactly 0 in that member
    # (class 1 of member 0) or in all of them (class 3 of the first examples):
    # 0 * log 0 must count as 0, in values and in gradients.
    logits = random_logits(13, SHAPE).at[0, :, 1].set(-jnp.inf)
    logits = logits.at[:, :5, 3].set(-jnp.inf).at[1, :3, 2].set(1e4)
    labels = jnp.zeros(SHAPE[1], jnp.int32)
    for name, ref in PER_EXAMPLE.items():
        actual = getattr(uncertainty, name)(logits)
        assert np.isfinite(np.asarray(actual)).all(), name
        assert_close(actual, ref(np.asarray(logits)))

    def loss(x):  # a nan in any term's gradient would show in the sum's
        return (
            jnp.sum(uncertainty.mutual_information(x))
            + jnp.sum(uncertainty.total_entropy(x))
            + uncertainty.nll(x, labels)
        )

    grad = np.asarray(jax.jit(jax.grad(loss))(logits))
    assert np.isfinite(grad).all()
    assert np.abs(grad).max() > 0.01


@jax.jit
def report_all(logits, labels):
    per_example = {name: getattr(uncertainty, name)(logits) for name in PER_EXAMPLE}
    metrics = {name: getattr(uncertainty, name)(logits, labels) for name in METRICS}
    metrics["ece"] = uncertainty.ece(logits, labels, num_bins=10)
    score = per_example["mutual_information"]
    half = logits.shape[1] // 2
    metrics["auroc"] = uncertainty.auroc(score[:half], score[half:])
    return per_example, metrics


def test_bfloat16_logits():
    logits = random_logits(14, SHAPE)
    labels = random_labels(14, SHAPE)
    low = logits.astype(jnp.bfloat16)
    per_example, metrics = report_all(low, labels)
    for name, ref in PER_EXAMPLE.items():
        actual = per_example[name]
        # Computed in float32 (so accurate for the rounded inputs), and within
        # bf16 rounding of the full-precision result.
        assert actual.dtype == jnp.float32
        assert_close(actual, ref(np.asarray(low.astype(jnp.float32))))
        if name != "disagreement":  # an argmax may flip when inputs round
            assert_close(actual, ref(np.asarray(logits)), dtype=jnp.bfloat16)
    for name, ref in METRICS.items():
        actual = metrics[name]
        assert_close(actual, ref(np.asarray(logits), np.asarray(labels)), jnp.bfloat16)
    assert_close(
        metrics["ece"],
        ref_ece(np.asarray(low.astype(jnp.float32)), np.asarray(labels), 10),
    )


def test_everything_under_an_outer_jit():
    logits, labels = random_logits(16, SHAPE), random_labels(16, SHAPE)
    per_example, metrics = report_all(logits, labels)
    numpy_logits, numpy_labels = np.asarray(logits), np.asarray(labels)
    for name, ref in PER_EXAMPLE.items():
        assert_close(per_example[name], ref(numpy_logits))
    for name, ref in METRICS.items():
        assert_close(metrics[name], ref(numpy_logits, numpy_labels))
    assert_close(metrics["ece"], ref_ece(numpy_logits, numpy_labels, 10))
    score = ref_mutual_information(numpy_logits)
    half = SHAPE[1] // 2
    assert_close(metrics["auroc"], ref_auroc(score[:half], score[half:]))


def test_accepts_untiled_model_outputs_and_traced_labels():
    num_members, batch, classes = 3, 6, 4
    flat = random_logits(15, (num_members * batch, classes))
    logits = ensembles.untile(flat, num_members)
    labels = random_labels(15, (num_members, batch, classes))

    @jax.jit
    def report(flat, labels):
        logits = ensembles.untile(flat, num_members)
        return uncertainty.nll(logits, labels), uncertainty.ece(logits, labels)

    nll, ece = report(flat, labels)
    assert_close(nll, ref_nll(np.asarray(logits), np.asarray(labels)))
    assert_close(ece, ref_ece(np.asarray(logits), np.asarray(labels), 15))


def test_module_is_exported():
    assert "uncertainty" in ensembles.__all__
    assert ensembles.uncertainty is uncertainty
    for name in uncertainty.__all__:
        assert callable(getattr(uncertainty, name))


#: ``ensembles.uncertainty.__all__`` before the package was split by task kind
#: (issue 70): the flat face every user program imports from, unchanged.
FLAT_FACE = [
    "accuracy",
    "adaptive_ece",
    "aleatoric_variance",
    "apply_dirichlet_scaling",
    "apply_isotonic",
    "apply_vector_scaling",
    "augrc",
    "aupr",
    "aurc",
    "auroc",
    "brier",
    "conformal_interval",
    "conformal_mixture_interval",
    "conformal_sets",
    "crps",
    "disagreement",
    "ece",
    "energy_score",
    "epistemic_variance",
    "expected_entropy",
    "fit_adaptive_temperature",
    "fit_conformal_margin",
    "fit_conformal_quantile",
    "fit_conformal_threshold",
    "fit_dirichlet_scaling",
    "fit_ensemble_temperature",
    "fit_isotonic",
    "fit_member_std_scales",
    "fit_member_temperatures",
    "fit_spread_scales",
    "fit_std_scale",
    "fit_temperature",
    "fit_vector_scaling",
    "fpr_at_tpr",
    "interval_coverage",
    "interval_score",
    "interval_width",
    "mae",
    "margin_score",
    "max_logit_score",
    "max_probability_score",
    "mce",
    "mixture_cdf",
    "mixture_interval",
    "mixture_log_density",
    "mixture_mean",
    "mixture_nll",
    "mixture_quantile",
    "mixture_variance",
    "moment_matched_nll",
    "mutual_information",
    "nll",
    "noisy_copies",
    "pairwise_disagreement",
    "pairwise_gaussian_kl",
    "pairwise_kl",
    "pit_calibration_error",
    "predictive_probs",
    "rmse",
    "scale_adaptive_temperature",
    "scale_ensemble_temperature",
    "scale_member_stds",
    "scale_member_temperatures",
    "scale_spread",
    "scale_std",
    "scale_temperature",
    "set_coverage",
    "set_size",
    "spread_error_correlation",
    "total_entropy",
    "variance",
]


def test_the_flat_face_is_unchanged_and_the_kinds_split_it():
    assert uncertainty.__all__ == FLAT_FACE
    kinds = (uncertainty.classification, uncertainty.regression)
    shared = {"auroc", "aupr", "fpr_at_tpr", "noisy_copies"}
    for kind in kinds:
        assert kind.__all__ == sorted(kind.__all__)
        for name in kind.__all__:
            assert getattr(kind, name) is getattr(uncertainty, name), name
    names = [name for kind in kinds for name in kind.__all__]
    assert sorted([*names, *shared]) == FLAT_FACE  # each name in one place


# ------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize("name", sorted(PER_EXAMPLE))
def test_rejects_bad_logits(name):
    fn = getattr(uncertainty, name)
    with pytest.raises(ValueError, match=r"got shape \(12, 4\) \(2-D\).*untile"):
        fn(jnp.ones((12, 4)))
    with pytest.raises(ValueError, match=r"reshape\(2, -1, 4\)"):
        fn(jnp.ones((2, 3, 5, 4)))
    with pytest.raises(ValueError, match=r"\[E, B, C\].*got shape \(4,\)"):
        fn(jnp.ones(4))
    with pytest.raises(ValueError, match=r"E=0, B=3, C=4"):
        fn(jnp.ones((0, 3, 4)))
    with pytest.raises(ValueError, match=r"E=2, B=3, C=0"):
        fn(jnp.ones((2, 3, 0)))
    with pytest.raises(TypeError, match=r"`logits` must be a floating-point.*int32"):
        fn(jnp.ones((2, 3, 4), jnp.int32))


@pytest.mark.parametrize("name", [*sorted(METRICS), "ece"])
def test_rejects_bad_labels(name):
    fn = getattr(uncertainty, name)
    logits = jnp.zeros((2, 3, 4))
    with pytest.raises(TypeError, match=r"`labels` must be integer.*float32"):
        fn(logits, jnp.zeros(3))
    with pytest.raises(ValueError, match=r"shape \[B\] = \(3,\).*got shape \(4,\)"):
        fn(logits, jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match=r"got shape \(3, 1\)"):
        fn(logits, jnp.zeros((3, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"\[0, 4\), got labels\[1\] = 4"):
        fn(logits, jnp.array([0, 4, 1]))
    with pytest.raises(ValueError, match=r"got labels\[2\] = -1"):
        fn(logits, np.array([0, 3, -1]))
    with pytest.raises(ValueError, match=r"`logits` must have shape \[E, B, C\]"):
        fn(jnp.zeros((6, 4)), jnp.zeros(6, jnp.int32))


def test_rejects_bad_num_bins():
    logits, labels = jnp.zeros((2, 3, 4)), jnp.zeros(3, jnp.int32)
    with pytest.raises(ValueError, match=r"`num_bins` must be an int >= 1, got 0"):
        uncertainty.ece(logits, labels, num_bins=0)
    with pytest.raises(TypeError, match=r"`num_bins` must be an int >= 1, got 2.5"):
        uncertainty.ece(logits, labels, num_bins=2.5)


def test_rejects_bad_scores():
    with pytest.raises(ValueError, match=r"`in_scores` must hold at least one"):
        uncertainty.auroc(jnp.zeros(0), jnp.ones(3))
    with pytest.raises(ValueError, match=r"`out_scores` must hold at least one"):
        uncertainty.auroc(jnp.ones(3), [])
    with pytest.raises(ValueError, match=r"`out_scores` must be a 1-D.*\(2, 3\)"):
        uncertainty.auroc(jnp.ones(3), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"`in_scores` must be a 1-D.*got shape \(\)"):
        uncertainty.auroc(jnp.float32(1.0), jnp.ones(3))
    with pytest.raises(TypeError, match=r"`in_scores` must hold real-valued.*complex"):
        uncertainty.auroc(jnp.ones(3, jnp.complex64), jnp.ones(3))
