"""The OOD scores of uncertainty.classification.ood_scores, and aurc/augrc by one.

References: float64 numpy, one formula at a time, member by member.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ensembles import uncertainty

SCORES = ("max_probability_score", "margin_score", "max_logit_score", "energy_score")


def ref_member_probs(logits):
    x = np.asarray(logits, np.float64)
    shifted = np.exp(x - x.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def ref_logsumexp(x):
    top = x.max(axis=-1)
    return top + np.log(np.exp(x - top[..., None]).sum(axis=-1))


def ref_score(name, logits, members):
    x = np.asarray(logits, np.float64)
    num_members, num_examples, _ = x.shape
    probs = ref_member_probs(x)
    if not members:
        probs = probs.mean(axis=0)[None]
    if name == "max_probability_score":
        result = -probs.max(axis=-1)
    elif name == "margin_score":
        ordered = np.sort(probs, axis=-1)
        result = ordered[..., -2] - ordered[..., -1]
    elif name == "max_logit_score":
        result = np.array(
            [[-x[k, b].max() for b in range(num_examples)] for k in range(num_members)]
        )
    else:
        result = np.array(
            [
                [-ref_logsumexp(x[k, b]) for b in range(num_examples)]
                for k in range(num_members)
            ]
        )
    if name in ("max_logit_score", "energy_score") and not members:
        result = result.mean(axis=0, keepdims=True)
    return result if members else result[0]


def random_logits(shape, seed=0, scale=3.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(
        np.float32
    )


@pytest.mark.parametrize("name", SCORES)
@pytest.mark.parametrize("members", [False, True])
def test_scores_match_numpy_and_run_under_jit(name, members):
    logits = random_logits((3, 7, 5))
    fn = getattr(uncertainty, name)
    eager = fn(logits, members=members)
    jitted = jax.jit(lambda z: fn(z, members=members))(logits)
    expected = ref_score(name, logits, members)
    assert eager.shape == expected.shape
    np.testing.assert_allclose(eager, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(eager, jitted)


def test_higher_is_less_sure_and_auroc_takes_them_as_they_are():
    # Members that are sure in distribution, flat out of it.
    rng = np.random.default_rng(1)
    sure = rng.standard_normal((4, 50, 6)).astype(np.float32)
    sure[..., 0] += 8.0
    flat = 0.1 * rng.standard_normal((4, 50, 6)).astype(np.float32)
    for name in SCORES:
        fn = getattr(uncertainty, name)
        assert float(uncertainty.auroc(fn(sure), fn(flat))) == 1.0, name


def test_the_ensemble_scores_are_of_the_predictive_and_means_of_logit_scores():
    logits = random_logits((4, 6, 3), seed=2)
    pooled = uncertainty.scale_temperature(logits, 1.0)  # log predictive [1, B, C]
    for name in ("max_probability_score", "margin_score"):
        fn = getattr(uncertainty, name)
        np.testing.assert_allclose(fn(logits), fn(pooled)[...], rtol=1e-6, atol=1e-7)
    for name in ("max_logit_score", "energy_score"):
        fn = getattr(uncertainty, name)
        np.testing.assert_allclose(
            fn(logits), jnp.mean(fn(logits, members=True), axis=0), rtol=1e-6
        )


def test_energy_lies_between_max_logit_and_max_logit_less_log_classes():
    logits = random_logits((2, 9, 4), seed=3)
    energy = uncertainty.energy_score(logits, members=True)
    max_logit = uncertainty.max_logit_score(logits, members=True)
    assert bool(jnp.all(energy <= max_logit + 1e-6))
    assert bool(jnp.all(energy >= max_logit - np.log(4) - 1e-6))


def test_masked_classes_bf16_and_extreme_logits():
    logits = np.array([[[0.0, -np.inf, 2.0]], [[1.0, -np.inf, 1.0]]], np.float32)
    assert np.isfinite(np.asarray(uncertainty.energy_score(logits))).all()
    np.testing.assert_allclose(
        uncertainty.margin_score(logits, members=True), [[-0.7615942], [0.0]], rtol=1e-6
    )
    big = jnp.array([[[1e4, 0.0]], [[0.0, 1e4]]], jnp.bfloat16)
    for name in SCORES:
        value = getattr(uncertainty, name)(big)
        assert value.dtype == jnp.float32, name
        assert bool(jnp.all(jnp.isfinite(value))), name
    assert float(uncertainty.max_probability_score(big)[0]) == -0.5


@pytest.mark.parametrize("name", SCORES)
@pytest.mark.parametrize("members", [False, True])
def test_nan_in_nan_out_for_exactly_the_broken_examples(name, members):
    logits = random_logits((2, 4, 3), seed=4)
    logits[1, 0, 2] = np.nan  # one member's row
    logits[0, 2] = -np.inf  # a member ruling out every class
    logits[1, 3, 0] = np.inf
    fn = getattr(uncertainty, name)
    for value in (
        fn(logits, members=members),
        jax.jit(fn, static_argnames="members")(logits, members=members),
    ):
        value = np.asarray(value).reshape(-1, 4)
        assert np.isnan(value[:, [0, 2, 3]]).all(), name
        assert np.isfinite(value[:, 1]).all(), name


@pytest.mark.parametrize("name", SCORES)
def test_bad_inputs_raise_clearly(name):
    fn = getattr(uncertainty, name)
    with pytest.raises(ValueError, match=r"\[E, B, C\].*untile"):
        fn(jnp.ones((8, 3)))
    with pytest.raises(ValueError, match="one class"):
        fn(jnp.ones((2, 3, 1)))
    with pytest.raises(TypeError, match="floating-point"):
        fn(jnp.ones((2, 3, 4), jnp.int32))
    with pytest.raises(TypeError, match="`members` must be a bool"):
        fn(jnp.ones((2, 3, 4)), members="yes")
    with pytest.raises(TypeError, match="`logits`"):
        fn(None)


# ------------------------------------------------------------ aurc by a score


def ref_aurc_by(scores, correct):
    """Mean over k of the error rate among the k lowest scores (no ties)."""
    order = np.argsort(scores, kind="stable")
    wrong = 1 - np.asarray(correct)[order]
    errors = np.cumsum(wrong)
    k = np.arange(1, len(wrong) + 1)
    return np.mean(errors / k), np.mean(errors) / len(wrong)


def test_aurc_and_augrc_rank_by_any_uncertainty():
    logits = random_logits((3, 40, 4), seed=5, scale=1.0)
    labels = np.random.default_rng(6).integers(0, 4, 40)
    correct = np.asarray(uncertainty.predictive_probs(logits)).argmax(-1) == labels
    for scores in (
        uncertainty.mutual_information(logits),
        uncertainty.energy_score(logits),
        uncertainty.margin_score(logits),
    ):
        aurc, augrc = ref_aurc_by(np.asarray(scores, np.float64), correct)
        np.testing.assert_allclose(
            uncertainty.aurc(logits, labels, scores=scores), aurc, rtol=1e-6
        )
        np.testing.assert_allclose(
            uncertainty.augrc(logits, labels, scores=scores), augrc, rtol=1e-6
        )
        jitted = jax.jit(lambda z, y, s: uncertainty.aurc(z, y, scores=s))
        np.testing.assert_allclose(jitted(logits, labels, scores), aurc, rtol=1e-6)
    # Ranked by minus the confidence, it is the default order.
    minus_confidence = uncertainty.max_probability_score(logits)
    np.testing.assert_allclose(
        uncertainty.aurc(logits, labels, scores=minus_confidence),
        uncertainty.aurc(logits, labels),
        rtol=1e-6,
    )


def test_aurc_by_scores_nan_and_bad_scores():
    logits = random_logits((2, 5, 3), seed=7)
    labels = np.array([0, 1, 2, 0, 1])
    scores = np.arange(5.0)
    scores[3] = np.nan
    assert np.isnan(float(uncertainty.aurc(logits, labels, scores=scores)))
    assert np.isnan(float(uncertainty.augrc(logits, labels, scores=scores)))
    with pytest.raises(ValueError, match=r"one uncertainty per example.*\(5,\)"):
        uncertainty.aurc(logits, labels, scores=np.arange(4.0))
    with pytest.raises(ValueError, match="1-D"):
        uncertainty.augrc(logits, labels, scores=np.ones((5, 1)))
    with pytest.raises(TypeError, match="`scores`"):
        uncertainty.aurc(logits, labels, scores="energy")
