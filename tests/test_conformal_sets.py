"""Conformal prediction sets: a plain numpy reference, the guarantee, the contract.

The reference scores every class of every example with a loop over the
classes in float64, from the same probabilities; the guarantee is checked
over 1,000 random calibration/test splits of one pool of examples, all
splits in one vmapped program. MAPIE's LAC sets, where MAPIE is installed,
in a slow test.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ensembles import uncertainty
from ensembles.uncertainty._common import conformal_rank

VARIANTS = [
    ("lac", False),
    ("aps", False),
    ("raps", False),
    ("aps", True),
    ("raps", True),
]


# ----------------------------------------------------------------- reference


def ref_scores(probs, score, share, penalty=0.01, free_ranks=1):
    """``[B, C]`` scores; ``share`` is u, a number or ``[B]``."""
    probs = np.asarray(probs, np.float64)
    num_examples, num_classes = probs.shape
    share = np.broadcast_to(np.asarray(share, np.float64), (num_examples,))
    out = np.zeros_like(probs)
    for b in range(num_examples):
        for c in range(num_classes):
            p = probs[b]
            if score == "lac":
                out[b, c] = 1 - p[c]
                continue
            above = [p[j] for j in range(num_classes) if p[j] > p[c]]
            out[b, c] = sum(sorted(above, reverse=True)) + share[b] * p[c]
            if score == "raps":
                rank = len(above) + 1
                out[b, c] += penalty * max(rank - free_ranks, 0)
    return out


def ref_threshold(probs, labels, level, score, share):
    scores = ref_scores(probs, score, share)
    label_scores = scores[np.arange(len(labels)), labels]
    rank = math.ceil((len(labels) + 1) * level - 1e-9)
    return np.inf if rank > len(labels) else np.sort(label_scores)[rank - 1]


def pool(num_members=3, num_examples=1000, num_classes=10, seed=0):
    """Member logits and labels drawn from member 0's softer softmax."""
    keys = jax.random.split(jax.random.key(seed), 3)
    shared = 2.0 * jax.random.normal(keys[0], (1, num_examples, num_classes))
    own = jax.random.normal(keys[1], (num_members, num_examples, num_classes))
    logits = shared + own
    labels = jax.random.categorical(keys[2], logits[0] / 2)
    return logits, labels


def uniforms(key, num_examples):
    return np.asarray(jax.random.uniform(key, (num_examples,), jnp.float32))


# ------------------------------------------------------------------ equality


@pytest.mark.parametrize(("score", "randomised"), VARIANTS)
@pytest.mark.parametrize("members", [False, True])
def test_thresholds_and_sets_equal_the_reference(score, randomised, members):
    logits, labels = pool(num_examples=240, num_classes=6, seed=1)
    fit_logits, fit_labels = logits[:, :150], np.asarray(labels[:150])
    new_logits = logits[:, 150:]
    fit_key = jax.random.key(2) if randomised else None
    set_key = jax.random.key(3) if randomised else None
    threshold = uncertainty.fit_conformal_threshold(
        fit_logits, fit_labels, 0.8, score=score, key=fit_key, members=members
    )
    sets = uncertainty.conformal_sets(new_logits, threshold, score=score, key=set_key)
    member_probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
    groups = member_probs if members else member_probs.mean(axis=0)[None]
    fit_share = uniforms(fit_key, 150) if randomised else 1.0
    set_share = uniforms(set_key, 90) if randomised else 0.0
    for k, probs in enumerate(groups):
        expected = ref_threshold(probs[:150], fit_labels, 0.8, score, fit_share)
        got = np.asarray(threshold).reshape(-1)[k]
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
        new_scores = ref_scores(probs[150:], score, set_share)
        # No class lies within rounding of the threshold: the comparison is
        # not decided by the last bit of float32.
        assert np.abs(new_scores - expected).min() > 1e-5
        expected_sets = (new_scores <= expected).astype(np.float32)
        got_sets = np.asarray(sets)[k] if members else np.asarray(sets)
        np.testing.assert_array_equal(got_sets, expected_sets)
    jitted = jax.jit(
        lambda z, y, z_new: uncertainty.conformal_sets(
            z_new,
            uncertainty.fit_conformal_threshold(
                z, y, 0.8, score=score, key=fit_key, members=members
            ),
            score=score,
            key=set_key,
        )
    )
    np.testing.assert_array_equal(jitted(fit_logits, fit_labels, new_logits), sets)


def test_deterministic_aps_always_holds_the_most_probable_class():
    logits, labels = pool(num_examples=300, seed=4)
    for score in ("aps", "raps"):
        threshold = uncertainty.fit_conformal_threshold(
            logits[:, :100], labels[:100], 0.5, score=score
        )
        sets = uncertainty.conformal_sets(logits[:, 100:], threshold, score=score)
        top = jnp.argmax(uncertainty.predictive_probs(logits[:, 100:]), axis=-1)
        assert bool(jnp.all(sets[jnp.arange(200), top] == 1)), score


def test_ties_share_a_rank_and_enter_together():
    probs = jnp.array([[[0.4, 0.2, 0.2, 0.2]]])
    for threshold in (0.39, 0.41, 0.79, 0.99):
        sets = uncertainty.conformal_sets(jnp.log(probs), threshold, score="aps")
        inside = np.asarray(sets)[0, 1:]
        assert len(set(inside.tolist())) == 1, (threshold, inside)


def test_raps_penalises_ranks_beyond_free_ranks():
    logits = jnp.log(jnp.array([[[0.4, 0.3, 0.2, 0.1]]]))
    plain = uncertainty.conformal_sets(logits, 0.95, score="aps")
    penalised = uncertainty.conformal_sets(
        logits, 0.95, score="raps", penalty=0.1, free_ranks=2
    )
    # Masses above: 0, .4, .7, .9; RAPS adds 0, 0, .1, .2 (u = 0 in the sets).
    np.testing.assert_array_equal(plain[0], [1, 1, 1, 1])
    np.testing.assert_array_equal(penalised[0], [1, 1, 1, 0])


def test_too_few_examples_give_an_infinite_threshold_and_full_sets():
    logits, labels = pool(num_examples=5, seed=5)
    threshold = uncertainty.fit_conformal_threshold(logits, labels, 0.9)  # 6*.9 > 5
    assert float(threshold) == np.inf
    assert float(uncertainty.set_size(uncertainty.conformal_sets(logits, threshold)))
    assert conformal_rank(9, 0.7) == 7  # not 8: 10 * 0.7 is 7.000000000000001
    assert conformal_rank(104, 0.9) == 95


# ------------------------------------------------------------------ guarantee


# The threshold method in the quick tier; the other scores (3 s each to
# compile and run their 1,000 splits) in the slow tier.
@pytest.mark.parametrize(
    ("score", "randomised"),
    [
        VARIANTS[0],
        *(pytest.param(*v, marks=pytest.mark.slow) for v in VARIANTS[1:]),
        pytest.param("lac", "members", marks=pytest.mark.slow),
    ],
)
def test_coverage_over_a_thousand_random_splits(score, randomised):
    # (n + 1) level = 94.5 falls midway between two ranks, so the exact
    # expected coverage 95 / 105 sits midway in [level, level + 1 / (n + 1)]:
    # 4.8e-3 from either end, about five of the mean's standard errors over
    # 1,000 splits.
    logits, labels = pool(num_examples=1000, seed=6)
    num_fit, level, splits = 104, 0.9, 1000
    members = randomised == "members"
    randomised = randomised is True

    def coverage(key):
        keys = jax.random.split(key, 3)
        order = jax.random.permutation(keys[0], labels.shape[0])
        fit, new = order[:num_fit], order[num_fit:]
        threshold = uncertainty.fit_conformal_threshold(
            logits[:, fit],
            labels[fit],
            level,
            score=score,
            key=keys[1] if randomised else None,
            members=members,
        )
        sets = uncertainty.conformal_sets(
            logits[:, new], threshold, score=score, key=keys[2] if randomised else None
        )
        return uncertainty.set_coverage(sets, labels[new])

    keys = jax.random.split(jax.random.key(7), splits)
    covered = np.asarray(
        jax.jit(lambda k: jax.lax.map(coverage, k, batch_size=100))(keys)
    )
    mean = covered.mean(axis=0)
    standard_error = covered.std(axis=0) / np.sqrt(splits)
    assert np.all(mean >= level), (mean, standard_error)
    if score == "lac" or randomised:
        assert np.all(mean <= level + 1 / (num_fit + 1)), (mean, standard_error)
        exact = conformal_rank(num_fit, level) / (num_fit + 1)
        assert np.all(np.abs(mean - exact) < 4 * standard_error + 1e-4), mean


def test_lac_sets_are_the_smallest_and_aps_grows_where_the_predictive_is_spread():
    logits, labels = pool(num_examples=1000, seed=8)
    sizes = {}
    for score in ("lac", "aps"):
        threshold = uncertainty.fit_conformal_threshold(
            logits[:, :500], labels[:500], 0.9, score=score
        )
        sizes[score] = uncertainty.conformal_sets(
            logits[:, 500:], threshold, score=score
        )
    assert float(uncertainty.set_size(sizes["lac"])) < float(
        uncertainty.set_size(sizes["aps"])
    )
    spread = uncertainty.total_entropy(logits[:, 500:])
    aps_size = jnp.sum(sizes["aps"], axis=-1)
    assert np.corrcoef(spread, aps_size)[0, 1] > 0.5


# ------------------------------------------------------------------- contract


def test_nan_in_nan_out():
    logits, labels = pool(num_examples=50, num_classes=4, seed=9)
    broken = logits.at[1, 3, 2].set(jnp.nan)
    for score, key in (("lac", None), ("aps", jax.random.key(0))):
        assert np.isnan(
            float(
                uncertainty.fit_conformal_threshold(
                    broken, labels, score=score, key=key
                )
            )
        )
        members = uncertainty.fit_conformal_threshold(
            broken, labels, score=score, key=key, members=True
        )
        assert np.isnan(np.asarray(members)).all()
        sets = uncertainty.conformal_sets(broken, 0.5, score=score, key=key)
        assert np.isnan(np.asarray(sets[3])).all()
        assert not np.isnan(np.asarray(sets[jnp.arange(50) != 3])).any()
        assert np.isnan(float(uncertainty.set_size(sets)))
        assert np.isnan(float(uncertainty.set_coverage(sets, labels)))
    # Under jit: a NaN threshold gives NaN sets, an out-of-range label a NaN fit.
    nan_sets = jax.jit(lambda z, t: uncertainty.conformal_sets(z, t))(logits, jnp.nan)
    assert np.isnan(np.asarray(nan_sets)).all()
    bad_labels = labels.at[0].set(7)
    assert np.isnan(
        float(jax.jit(uncertainty.fit_conformal_threshold)(logits, bad_labels))
    )
    assert np.isnan(
        float(jax.jit(uncertainty.set_coverage)(jnp.ones((50, 4)), bad_labels))
    )
    per_member = uncertainty.conformal_sets(logits, jnp.array([0.5, jnp.inf, 0.2]))
    assert per_member.shape == (3, 50, 4)
    assert float(uncertainty.set_size(per_member)[1]) == 4.0


def test_sets_as_boolean_masks_and_per_member_metrics():
    sets = jnp.array([[[True, False], [True, True]], [[False, True], [True, False]]])
    np.testing.assert_allclose(uncertainty.set_size(sets), [1.5, 1.0])
    np.testing.assert_allclose(
        uncertainty.set_coverage(sets, jnp.array([0, 1])), [1, 0]
    )


def test_bad_inputs_raise_clearly_and_mutate_nothing():
    logits, labels = pool(num_examples=20, num_classes=4, seed=10)
    fit = uncertainty.fit_conformal_threshold
    with pytest.raises(ValueError, match="`level` must lie strictly between 0 and 1"):
        fit(logits, labels, 1.0)
    with pytest.raises(ValueError, match=r"`score` must be one of \['lac', 'aps'"):
        fit(logits, labels, score="thr")
    with pytest.raises(ValueError, match="'lac' score has nothing to randomise"):
        fit(logits, labels, key=jax.random.key(0))
    with pytest.raises(TypeError, match="`key` must be one JAX random key"):
        fit(logits, labels, score="aps", key=0)
    with pytest.raises(ValueError, match=r"`penalty`.*>= 0"):
        fit(logits, labels, score="raps", penalty=-0.1)
    with pytest.raises(ValueError, match=r"`free_ranks`.*>= 0, got -1"):
        fit(logits, labels, score="raps", free_ranks=-1)
    with pytest.raises(TypeError, match="`free_ranks`"):
        fit(logits, labels, score="raps", free_ranks=True)
    with pytest.raises(TypeError, match="`members` must be a bool"):
        fit(logits, labels, members=1)
    with pytest.raises(ValueError, match=r"`labels` must lie in \[0, C\) = \[0, 4\)"):
        fit(logits, labels.at[2].set(4))
    with pytest.raises(ValueError, match=r"\[E, B, C\]"):
        fit(logits[0], labels)
    sets_of = uncertainty.conformal_sets
    with pytest.raises(ValueError, match=r"scalar, or \[E\] = \(3,\)"):
        sets_of(logits, jnp.ones(2))
    with pytest.raises(ValueError, match="must not be NaN"):
        sets_of(logits, np.nan)
    with pytest.raises(TypeError, match="`threshold`"):
        sets_of(logits, None)
    with pytest.raises(ValueError, match=r"hold 1 \(in the set\), 0 \(not\) or NaN"):
        uncertainty.set_size(jnp.full((3, 4), 0.5))
    with pytest.raises(ValueError, match=r"\[B, C\] or \[E, B, C\]"):
        uncertainty.set_size(jnp.ones(4))
    with pytest.raises(ValueError, match=r"`labels` must have shape \[B\] = \(3,\)"):
        uncertainty.set_coverage(jnp.ones((3, 4)), jnp.zeros(2, jnp.int32))
    # Nothing mutated by a refused call.
    before = np.asarray(logits).copy()
    with pytest.raises(ValueError):
        fit(logits, labels, 2.0)
    np.testing.assert_array_equal(logits, before)


# ------------------------------------------------------------------ MAPIE


@pytest.mark.slow  # an optional reference (never a dependency): skipped without it
def test_lac_sets_equal_mapies():
    mapie = pytest.importorskip("mapie.classification")
    from sklearn.base import BaseEstimator, ClassifierMixin

    class Table(ClassifierMixin, BaseEstimator):
        """A fitted classifier whose probabilities are a table, row by X[:, 0]."""

        def __init__(self, probs=None):
            self.probs = probs

        def fit(self, x, y):
            self.classes_ = np.arange(self.probs.shape[1])
            return self

        def predict_proba(self, x):
            return self.probs[np.asarray(x)[:, 0].astype(int)]

        def predict(self, x):
            return self.predict_proba(x).argmax(-1)

    logits, labels = pool(num_examples=2000, seed=11)
    labels = np.asarray(labels)
    probs = np.asarray(uncertainty.predictive_probs(logits), np.float64)
    x = np.arange(len(labels), dtype=np.float64)[:, None]
    for level in (0.8, 0.9, 0.95):
        conformal = mapie.SplitConformalClassifier(
            estimator=Table(probs).fit(x, labels),
            confidence_level=level,
            conformity_score="lac",
            prefit=True,
        )
        conformal.conformalize(x[:1000], labels[:1000])
        _, theirs = conformal.predict_set(x[1000:])
        threshold = uncertainty.fit_conformal_threshold(
            logits[:, :1000], labels[:1000], level
        )
        ours = uncertainty.conformal_sets(logits[:, 1000:], threshold)
        np.testing.assert_array_equal(np.asarray(ours) == 1, theirs[:, :, 0])
