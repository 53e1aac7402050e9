"""Selective, calibration and OOD metrics against float64 numpy / sklearn."""

import itertools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ensembles import uncertainty
from tests.tolerances import assert_close

# --------------------------------------------------------------------------------
# Plain float64 numpy references.


def ref_probs(logits):
    x = np.asarray(jnp.asarray(logits, jnp.float32), np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    member = np.exp(x) / np.exp(x).sum(axis=-1, keepdims=True)
    return member.mean(axis=0)


def ref_confidence_and_wrong(logits, labels):
    probs = ref_probs(logits)
    return probs.max(axis=-1), probs.argmax(axis=-1) != np.asarray(labels)


def strict_areas(wrong, order):
    """(AURC, AUGRC) for one order of the examples, most confident first."""
    errors = np.cumsum(wrong[order])
    return np.mean(errors / np.arange(1, len(order) + 1)), np.mean(errors) / len(order)


def tie_orders(confidence):
    """Every order of the examples, most confident first, ties permuted."""
    groups = [
        np.flatnonzero(confidence == value) for value in np.unique(confidence)[::-1]
    ]
    for parts in itertools.product(*(itertools.permutations(g) for g in groups)):
        yield np.concatenate(parts)


def assert_no_ties(confidence):
    assert len(np.unique(confidence)) == len(confidence)


def ref_adaptive_ece(confidence, correct, num_bins):
    # Tied examples share their correctness (the documented convention).
    correct = np.asarray(correct, np.float64)
    shared = correct.copy()
    for value in np.unique(confidence):
        tied = confidence == value
        shared[tied] = correct[tied].mean()
    order = np.argsort(confidence, kind="stable")
    total = 0.0
    for members in np.array_split(order, num_bins):
        if len(members):
            gap = abs(shared[members].mean() - confidence[members].mean())
            total += len(members) / len(order) * gap
    return total


def ref_mce(confidence, correct, num_bins):
    worst = 0.0
    for i in range(num_bins):
        in_bin = (confidence > i / num_bins) & (confidence <= (i + 1) / num_bins)
        if in_bin.any():
            gap = abs(correct[in_bin].mean() - confidence[in_bin].mean())
            worst = max(worst, gap)
    return worst


def sklearn_inputs(in_scores, out_scores):  # out of distribution is positive
    y_true = np.concatenate([np.zeros(len(in_scores)), np.ones(len(out_scores))])
    return y_true, np.concatenate([in_scores, out_scores]).astype(np.float64)


def sklearn_aupr(in_scores, out_scores):
    metrics = pytest.importorskip("sklearn.metrics")
    return metrics.average_precision_score(*sklearn_inputs(in_scores, out_scores))


def sklearn_fpr_at_tpr(in_scores, out_scores, tpr):
    metrics = pytest.importorskip("sklearn.metrics")
    fpr, tpr_curve, _ = metrics.roc_curve(
        *sklearn_inputs(in_scores, out_scores), drop_intermediate=False
    )
    return fpr[np.searchsorted(tpr_curve, tpr, side="left")]


# -------------------------------------------------------------------- inputs


SHAPES = [(1, 1, 3), (1, 5, 3), (2, 7, 2), (4, 33, 10), (3, 200, 5)]


def random_case(seed, shape, dtype=jnp.float32, right=0.7):
    """Moderate logits (confidences far apart) and labels that are mostly right."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(1.5 * rng.standard_normal(shape), dtype)
    predicted = ref_probs(logits).argmax(-1)
    labels = np.where(
        rng.random(shape[1]) < right, predicted, rng.integers(0, shape[2], shape[1])
    )
    return logits, jnp.asarray(labels, jnp.int32)


def tied_case(seed, num_examples=8, num_distinct=3, num_classes=3):
    """Logits drawn from a few distinct rows, so confidences tie exactly."""
    rng = np.random.default_rng(seed)
    pool = 1.5 * rng.standard_normal((2, num_distinct, num_classes))
    pick = rng.integers(0, num_distinct, num_examples)
    logits = jnp.asarray(pool[:, pick], jnp.float32)
    labels = jnp.asarray(rng.integers(0, num_classes, num_examples), jnp.int32)
    return logits, labels


LABELED = ["aurc", "augrc", "adaptive_ece", "mce"]


def reference(name, logits, labels, num_bins=15):
    confidence, wrong = ref_confidence_and_wrong(logits, labels)
    if name in ("aurc", "augrc"):  # the mean over every order of the ties
        areas = [strict_areas(wrong, order) for order in tie_orders(confidence)]
        return np.mean(areas, axis=0)[0 if name == "aurc" else 1]
    if name == "adaptive_ece":
        return ref_adaptive_ece(confidence, ~wrong, num_bins)
    return ref_mce(confidence, ~wrong, num_bins)


def call(name, logits, labels, num_bins=15):
    fn = getattr(uncertainty, name)
    if name in ("adaptive_ece", "mce"):
        return fn(logits, labels, num_bins=num_bins)
    return fn(logits, labels)


# ---------------------------------------------------------------- against numpy


@pytest.mark.parametrize("shape", SHAPES)
def test_aurc_and_augrc_match_numpy(shape):
    logits, labels = random_case(zlib.crc32(f"rc{shape}".encode()), shape)
    confidence, wrong = ref_confidence_and_wrong(logits, labels)
    assert_no_ties(confidence)  # so the reference's order is the only one
    expected_aurc, expected_augrc = strict_areas(wrong, np.argsort(-confidence))
    jitted = jax.jit(lambda x, y: (uncertainty.aurc(x, y), uncertainty.augrc(x, y)))
    for aurc, augrc in [
        (uncertainty.aurc(logits, labels), uncertainty.augrc(logits, labels)),
        jitted(logits, labels),
    ]:
        assert aurc.shape == augrc.shape == ()
        assert aurc.dtype == augrc.dtype == jnp.float32
        assert_close(aurc, expected_aurc)
        assert_close(augrc, expected_augrc)
    if shape[1] > 30:  # a ranking that is neither perfect nor all wrong
        assert 0.0 < expected_aurc < 1.0


@pytest.mark.parametrize("seed", range(4))
def test_ties_average_over_every_order(seed):
    logits, labels = tied_case(seed)
    confidence, wrong = ref_confidence_and_wrong(logits, labels)
    assert len(np.unique(confidence)) < len(confidence)  # really tied
    assert 0 < wrong.sum() < len(wrong)
    # The result is the mean over every order of the ties, and so does not
    # change when the batch is shuffled.
    perm = np.random.default_rng(seed).permutation(len(wrong))
    for name in LABELED:
        expected = reference(name, logits, labels, num_bins=3)
        assert_close(call(name, logits, labels, num_bins=3), expected, err_msg=name)
        shuffled = call(name, logits[:, perm], labels[perm], num_bins=3)
        assert_close(shuffled, expected, err_msg=name)
    # A stable sort would not do: orders of the ties give different areas.
    areas = {strict_areas(wrong, order) for order in tie_orders(confidence)}
    assert len(areas) > 1


@pytest.mark.parametrize("num_bins", [1, 4, 15, 40])
@pytest.mark.parametrize("shape", [(1, 64, 10), (3, 200, 5), (2, 7, 2)])
def test_adaptive_ece_matches_array_split_bins(shape, num_bins):
    logits, labels = random_case(num_bins + shape[1], shape)
    confidence, wrong = ref_confidence_and_wrong(logits, labels)
    assert_no_ties(confidence)
    expected = ref_adaptive_ece(confidence, ~wrong, num_bins)
    actual = uncertainty.adaptive_ece(logits, labels, num_bins=num_bins)
    assert actual.dtype == jnp.float32
    assert_close(actual, expected)
    jitted = jax.jit(uncertainty.adaptive_ece, static_argnames="num_bins")
    assert_close(jitted(logits, labels, num_bins=num_bins), expected)
    if shape[1] > 10:
        assert expected > 0.01  # a real calibration gap, not a trivial zero


def test_adaptive_ece_puts_the_extra_example_in_the_first_bin():
    # Confidences .55 .6 .7 | .8 .9 (array_split: 3 then 2), right, right,
    # wrong | wrong, right: (3 * |2/3 - .6167| + 2 * |1/2 - .85|) / 5 = .17.
    # (Bins of 2 then 3 would give .45, one bin |.6 - .71| = .11.)
    confidence = np.array([0.55, 0.6, 0.7, 0.8, 0.9])
    logits = jnp.asarray(np.log(np.stack([confidence, 1 - confidence], -1))[None])
    labels = jnp.array([0, 0, 1, 1, 0])
    assert_close(uncertainty.adaptive_ece(logits, labels, num_bins=2), 0.17)
    assert_close(uncertainty.adaptive_ece(logits, labels, num_bins=1), 0.11)
    # One example a bin (and empty bins past B): the mean |correct - conf|.
    expected = np.mean(np.abs([0.45, 0.4, 0.7, 0.8, 0.1]))
    for num_bins in [5, 9]:
        actual = uncertainty.adaptive_ece(logits, labels, num_bins=num_bins)
        assert_close(actual, expected)


@pytest.mark.parametrize("num_bins", [1, 5, 15])
@pytest.mark.parametrize("shape", [(1, 64, 10), (3, 200, 5), (1, 1, 3)])
def test_mce_matches_explicit_bin_loop(shape, num_bins):
    logits, labels = random_case(num_bins * 7 + shape[1], shape)
    confidence, wrong = ref_confidence_and_wrong(logits, labels)
    expected = ref_mce(confidence, ~wrong, num_bins)
    actual = uncertainty.mce(logits, labels, num_bins=num_bins)
    assert actual.dtype == jnp.float32
    assert_close(actual, expected)
    jitted = jax.jit(uncertainty.mce, static_argnames="num_bins")
    assert_close(jitted(logits, labels, num_bins=num_bins), expected)
    # The worst bin is at least the weighted mean of the bins.
    assert float(actual) >= float(uncertainty.ece(logits, labels, num_bins)) - 1e-6


def test_mce_bins_are_those_of_ece():
    # Confidence exactly 0.5 falls in the lower of two bins (0, .5], right;
    # confidence 1 in (.5, 1], wrong: bins of gaps .5 and 1.
    logits = jnp.asarray(
        [[[1e4, -1e4], [-1e4, 1e4]], [[-1e4, 1e4], [-1e4, 1e4]]], jnp.float32
    )
    labels = jnp.array([0, 0])
    assert_close(uncertainty.mce(logits, labels, num_bins=2), 1.0)
    assert_close(uncertainty.mce(logits, jnp.array([0, 1]), num_bins=2), 0.5)
    # One bin holding both, both right: |1 - 3/4|.
    assert_close(uncertainty.mce(logits, jnp.array([0, 1]), num_bins=1), 0.25)


def test_bfloat16_logits_compute_in_float32():
    logits, labels = random_case(21, (3, 60, 5))
    low = logits.astype(jnp.bfloat16)
    rounded = low.astype(jnp.float32)  # what the metrics compute from
    assert_no_ties(ref_confidence_and_wrong(rounded, labels)[0])
    for name in LABELED:
        actual = call(name, low, labels)
        assert actual.dtype == jnp.float32, name
        assert_close(actual, reference(name, rounded, labels), err_msg=name)


def test_float64_logits_under_x64(x64):
    logits, labels = random_case(22, (2, 40, 4))
    logits = jnp.asarray(np.asarray(logits, np.float64))
    assert logits.dtype == jnp.float64
    for name in LABELED:
        actual = call(name, logits, labels)
        assert actual.dtype == jnp.float64, name
        np.testing.assert_allclose(
            float(actual), reference(name, logits, labels), rtol=1e-12, err_msg=name
        )
    in_scores = jnp.asarray(np.linspace(0.0, 1.0, 7))
    out_scores = jnp.asarray(np.linspace(0.5, 1.5, 5))
    assert uncertainty.aupr(in_scores, out_scores).dtype == jnp.float64
    assert uncertainty.fpr_at_tpr(in_scores, out_scores).dtype == jnp.float64


# ------------------------------------------------------------- selective edges


@pytest.mark.parametrize("shape", [(1, 1, 3), (2, 9, 4)])
def test_all_right_and_all_wrong(shape):
    logits, _ = random_case(23, shape)
    predicted = jnp.asarray(ref_probs(logits).argmax(-1), jnp.int32)
    wrong = (predicted + 1) % shape[2]
    num = shape[1]
    assert_close(uncertainty.aurc(logits, predicted), 0.0)
    assert_close(uncertainty.augrc(logits, predicted), 0.0)
    assert_close(uncertainty.aurc(logits, wrong), 1.0)
    assert_close(uncertainty.augrc(logits, wrong), (num + 1) / (2 * num))


def test_errors_ranked_last_give_the_least_area():
    # Four examples of distinct confidence; the one error least confident.
    probs = np.array([[0.95, 0.05], [0.85, 0.15], [0.75, 0.25], [0.65, 0.35]])
    logits = jnp.asarray(np.log(probs)[None], jnp.float32)
    best, worst = jnp.array([0, 0, 0, 1]), jnp.array([1, 0, 0, 0])
    assert_close(uncertainty.aurc(logits, best), (0 + 0 + 0 + 1 / 4) / 4)
    assert_close(uncertainty.augrc(logits, best), (0 + 0 + 0 + 1) / 16)
    assert_close(uncertainty.aurc(logits, worst), (1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    assert_close(uncertainty.augrc(logits, worst), 4 / 16)


# ----------------------------------------------------------------------- OOD


@pytest.mark.parametrize(
    ("num_in", "num_out", "ties"),
    [
        (1, 1, False),
        (7, 3, False),
        pytest.param(50, 80, False, marks=pytest.mark.slow),
        pytest.param(40, 25, True, marks=pytest.mark.slow),
        (9, 9, True),
    ],
)
def test_aupr_and_fpr_at_tpr_match_sklearn(num_in, num_out, ties):
    rng = np.random.default_rng(num_in * 100 + num_out)
    if ties:  # few distinct values: many ties, within and across the two sets
        in_scores = rng.integers(0, 4, num_in).astype(np.float32)
        out_scores = rng.integers(1, 5, num_out).astype(np.float32)
    else:
        in_scores = rng.standard_normal(num_in).astype(np.float32)
        out_scores = (rng.standard_normal(num_out) + 0.7).astype(np.float32)
    jitted_fpr = jax.jit(uncertainty.fpr_at_tpr, static_argnames="tpr")
    expected = sklearn_aupr(in_scores, out_scores)
    for fn in [uncertainty.aupr, jax.jit(uncertainty.aupr)]:
        actual = fn(in_scores, out_scores)
        assert actual.shape == () and actual.dtype == jnp.float32
        assert_close(actual, expected)
    # Exact boundaries k / N_out included: >= must hold at equality.
    rates = {0.95, 1.0, 1e-3, 0.5, 0.9, 1 / num_out, (num_out - 1) / num_out or 1.0}
    for tpr in sorted(rates):
        expected = sklearn_fpr_at_tpr(in_scores, out_scores, tpr)
        actual = uncertainty.fpr_at_tpr(in_scores, out_scores, tpr=tpr)
        assert actual.shape == () and actual.dtype == jnp.float32
        assert_close(actual, expected, err_msg=f"tpr={tpr}")
        assert_close(jitted_fpr(in_scores, out_scores, tpr=tpr), expected)


def test_fpr_at_tpr_on_float_boundaries():
    # k / N_out compared with tpr as numpy compares them, in float64. For
    # N_out = 25 and 41 some (k / N_out) * N_out round above k.
    rng = np.random.default_rng(3)
    in_scores = rng.standard_normal(100)
    for num_out in [3, 20, 25, 41]:
        out_scores = rng.standard_normal(num_out) + 1.0
        for k in range(1, num_out + 1):
            tpr = k / num_out
            for rate in [tpr, np.nextafter(tpr, 0.0), np.nextafter(tpr, 2.0)]:
                if not 0.0 < rate <= 1.0:
                    continue
                expected = sklearn_fpr_at_tpr(in_scores, out_scores, rate)
                actual = uncertainty.fpr_at_tpr(in_scores, out_scores, tpr=rate)
                assert_close(actual, expected, err_msg=f"{num_out=} {rate=}")


def test_ood_extremes():
    low, high = jnp.array([0.0, 1.0, 2.0]), jnp.array([3.0, 4.0])
    assert_close(uncertainty.aupr(low, high), 1.0)
    assert_close(uncertainty.fpr_at_tpr(low, high), 0.0)
    assert_close(uncertainty.fpr_at_tpr(low, high, tpr=1), 0.0)
    # Reversed: the positives are flagged last, with every negative.
    assert_close(uncertainty.fpr_at_tpr(high, low, tpr=1 / 3), 1.0)
    assert_close(uncertainty.aupr(high, low), sklearn_aupr(high, low))
    # Identical scores: one threshold flags everything.
    same_in, same_out = jnp.full(5, 0.3), jnp.full(4, 0.3)
    assert_close(uncertainty.aupr(same_in, same_out), 4 / 9)
    assert_close(uncertainty.fpr_at_tpr(same_in, same_out, tpr=0.1), 1.0)
    # Integer and bool scores.
    assert_close(uncertainty.aupr([1, 3], [2, 3]), sklearn_aupr([1, 3], [2, 3]))
    assert_close(uncertainty.fpr_at_tpr(jnp.array([False]), jnp.array([True])), 0.0)


def sklearn_ood(in_scores, out_scores, tpr=0.95):
    """scikit-learn's AUROC, AUPR and FPR at ``tpr``, on the scores as they are.

    No cast: scikit-learn compares int64 and float64 scores exactly.
    """
    metrics = pytest.importorskip("sklearn.metrics")
    in_scores, out_scores = np.asarray(in_scores), np.asarray(out_scores)
    y_true = np.concatenate([np.zeros(len(in_scores)), np.ones(len(out_scores))])
    y_score = np.concatenate([in_scores, out_scores])
    fpr, tpr_curve, _ = metrics.roc_curve(y_true, y_score, drop_intermediate=False)
    return {
        "auroc": metrics.roc_auc_score(y_true, y_score),
        "aupr": metrics.average_precision_score(y_true, y_score),
        "fpr_at_tpr": fpr[np.searchsorted(tpr_curve, tpr, side="left")],
    }


def close_scores(base, step, dtype, seed=0, size=40):
    """In- and out-of-distribution scores ``base + k * step`` that float32 merges.

    The ``size`` values are distinct in ``dtype`` but lie closer than float32's
    spacing at ``base``, shuffled between the two sets.
    """
    order = np.random.default_rng(seed).permutation(size)
    if np.issubdtype(dtype, np.integer):
        values = np.asarray(base, dtype) + order.astype(dtype) * np.asarray(step, dtype)
    else:
        values = (np.float64(base) + order * np.float64(step)).astype(dtype)
    assert len(np.unique(values)) == size
    assert len(np.unique(values.astype(np.float32))) < size
    return values[: size // 2], values[size // 2 :]


CLOSE_SCORES = {
    "int32 above 2**24": (2**24, 1, np.int32),
    "int64 above 2**31": (2**40, 1, np.int64),
    "int64 above 2**53": (2**53, 1, np.int64),
    "uint64 above 2**63": (2**63 + 2**32 - 60, 3, np.uint64),
    "float64 within float32 spacing": (1.0, 1e-12, np.float64),
}
OOD = ["auroc", "aupr", "fpr_at_tpr"]


@pytest.mark.parametrize("case", CLOSE_SCORES)
def test_ood_metrics_rank_scores_in_their_own_dtype(case):
    # Ranked in float32, these scores became ties (and, as JAX arrays without
    # x64, int64 ones wrapped around): issue 41 (5).
    in_scores, out_scores = close_scores(*CLOSE_SCORES[case])
    expected = sklearn_ood(in_scores, out_scores)
    in_float32 = in_scores.astype(np.float32), out_scores.astype(np.float32)
    assert expected["auroc"] != sklearn_ood(*in_float32)["auroc"]
    for name in OOD:
        actual = getattr(uncertainty, name)(in_scores, out_scores)
        assert actual.dtype == jnp.float32
        assert_close(actual, expected[name], err_msg=name)
        # Lists of Python ints too: numpy holds them as they are.
        if in_scores.dtype == np.int64:
            as_lists = in_scores.tolist(), out_scores.tolist()
            assert_close(getattr(uncertainty, name)(*as_lists), expected[name])


def test_ood_metrics_rank_int32_scores_exactly_in_and_out_of_jit():
    in_scores, out_scores = close_scores(2**30, 1, np.int32, seed=1)
    expected = sklearn_ood(in_scores, out_scores)
    in_scores, out_scores = jnp.asarray(in_scores), jnp.asarray(out_scores)
    for name in OOD:
        fn = getattr(uncertainty, name)
        assert_close(fn(in_scores, out_scores), expected[name], err_msg=name)
        assert_close(jax.jit(fn)(in_scores, out_scores), expected[name])


def test_ood_metrics_rank_float64_scores_exactly_under_x64(x64):
    in_scores, out_scores = close_scores(1.0, 1e-12, np.float64, seed=2)
    expected = sklearn_ood(in_scores, out_scores)
    in_scores, out_scores = jnp.asarray(in_scores), jnp.asarray(out_scores)
    assert in_scores.dtype == jnp.float64
    for name in OOD:
        fn = getattr(uncertainty, name)
        for result in [fn(in_scores, out_scores), jax.jit(fn)(in_scores, out_scores)]:
            assert result.dtype == jnp.float64
            np.testing.assert_allclose(
                float(result), expected[name], rtol=1e-12, err_msg=name
            )


def test_traced_scores_compare_in_the_dtype_jax_promotes_them_to():
    # The documented bound (auroc's note): under jit, int32 against float32
    # scores compare in float32, where 2**24 + 1 rounds to 2**24; known
    # scores compare as numpy (and scikit-learn) compare them.
    in_scores = jnp.array([2**24 + 1], jnp.int32)
    out_scores = jnp.array([2**24], jnp.float32)
    expected = sklearn_ood(in_scores, out_scores, tpr=1.0)
    for name in OOD:
        eager = getattr(uncertainty, name)(in_scores, out_scores)
        assert_close(eager, expected[name], err_msg=name)
    assert_close(uncertainty.auroc(in_scores, out_scores), 0.0)
    assert_close(jax.jit(uncertainty.auroc)(in_scores, out_scores), 0.5)
    # Either kind alone is exact under jit too.
    for dtype in [jnp.int32, jnp.float32]:
        low = jnp.array([2**24, 2**24 + 2], dtype)
        high = jnp.array([2**24 + 2, 2**24 + 4], dtype)
        assert_close(jax.jit(uncertainty.auroc)(low, high), 0.875)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_unranked_scores_give_nan(bad):
    good = jnp.array([0.1, 0.2, 0.3])
    broken = good.at[1].set(bad)
    jitted_aupr = jax.jit(uncertainty.aupr)
    jitted_fpr = jax.jit(uncertainty.fpr_at_tpr)
    for in_scores, out_scores in [(broken, good), (good, broken)]:
        for fn in [uncertainty.aupr, uncertainty.fpr_at_tpr, jitted_aupr, jitted_fpr]:
            assert math.isnan(float(fn(in_scores, out_scores)))


# ----------------------------------------------------------- invalid examples


@pytest.mark.parametrize(
    "poison",
    [
        lambda x: x.at[1, 2, 0].set(jnp.nan),
        lambda x: x.at[0, 4, 1].set(jnp.inf),
        lambda x: x.at[1, 0, :].set(-jnp.inf),
    ],
    ids=["nan", "inf", "all-masked"],
)
def test_invalid_logits_give_nan(poison):
    logits, labels = random_case(24, (2, 6, 3))
    broken = poison(logits)
    jitted = jax.jit(lambda x, y: [call(name, x, y) for name in LABELED])
    eager = [call(name, broken, labels) for name in LABELED]
    for values in [eager, jitted(broken, labels)]:
        for name, value in zip(LABELED, values, strict=True):
            assert math.isnan(float(value)), name
    # A masked class (-inf beside finite logits) is valid.
    masked = logits.at[:, :, 2].set(-jnp.inf)
    masked_labels = jnp.minimum(labels, 1)
    for name in LABELED:
        expected = reference(name, masked, masked_labels)
        assert_close(call(name, masked, masked_labels), expected, err_msg=name)


def test_out_of_range_traced_labels_give_nan():
    logits, labels = random_case(25, (2, 6, 3))
    jitted = jax.jit(lambda x, y: [call(name, x, y) for name in LABELED])
    good = jitted(logits, labels)
    for name, value in zip(LABELED, good, strict=True):
        assert_close(value, reference(name, logits, labels), err_msg=name)
    for bad in [3, -1]:
        values = jitted(logits, labels.at[2].set(bad))
        for name, value in zip(LABELED, values, strict=True):
            assert math.isnan(float(value)), (name, bad)


def test_narrow_label_dtypes():
    logits, labels = random_case(26, (2, 20, 4))
    for name in LABELED:
        expected = reference(name, logits, labels)
        for dtype in [np.uint8, np.int8, np.int16]:
            actual = call(name, logits, np.asarray(labels).astype(dtype))
            assert_close(actual, expected, err_msg=f"{name} {dtype}")


# ------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize("name", LABELED)
def test_rejects_bad_logits_and_labels(name):
    fn = getattr(uncertainty, name)
    logits = jnp.zeros((2, 3, 4))
    with pytest.raises(ValueError, match=r"got shape \(12, 4\) \(2-D\).*untile"):
        fn(jnp.ones((12, 4)), jnp.zeros(4, jnp.int32))
    with pytest.raises(TypeError, match=r"`logits` must be a floating-point.*int32"):
        fn(jnp.ones((2, 3, 4), jnp.int32), jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match=r"`labels` must be integer.*float32"):
        fn(logits, jnp.zeros(3))
    with pytest.raises(ValueError, match=r"shape \[B\] = \(3,\).*got shape \(4,\)"):
        fn(logits, jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match=r"\[0, 4\), got labels\[1\] = 4"):
        fn(logits, jnp.array([0, 4, 1]))
    with pytest.raises(ValueError, match=r"got labels\[2\] = -1"):
        fn(logits, np.array([0, 3, -1]))


@pytest.mark.parametrize("name", ["adaptive_ece", "mce"])
def test_rejects_bad_num_bins(name):
    fn = getattr(uncertainty, name)
    logits, labels = jnp.zeros((2, 3, 4)), jnp.zeros(3, jnp.int32)
    with pytest.raises(ValueError, match=r"`num_bins` must be an int >= 1, got 0"):
        fn(logits, labels, num_bins=0)
    with pytest.raises(TypeError, match=r"`num_bins` must be an int >= 1, got 2.5"):
        fn(logits, labels, num_bins=2.5)


@pytest.mark.parametrize("name", ["aupr", "fpr_at_tpr"])
def test_rejects_bad_scores(name):
    fn = getattr(uncertainty, name)
    with pytest.raises(ValueError, match=r"`in_scores` must hold at least one"):
        fn(jnp.zeros(0), jnp.ones(3))
    with pytest.raises(ValueError, match=r"`out_scores` must hold at least one"):
        fn(jnp.ones(3), [])
    with pytest.raises(ValueError, match=r"`out_scores` must be a 1-D.*\(2, 3\)"):
        fn(jnp.ones(3), jnp.ones((2, 3)))
    with pytest.raises(TypeError, match=r"`in_scores` must hold real-valued.*complex"):
        fn(jnp.ones(3, jnp.complex64), jnp.ones(3))


def test_rejects_bad_tpr():
    scores = jnp.ones(3)
    for bad in [0, 0.0, -0.5, 1.0000001, 2, float("nan")]:
        with pytest.raises(ValueError, match=r"`tpr` must lie in \(0, 1\]"):
            uncertainty.fpr_at_tpr(scores, scores, tpr=bad)
    for bad in [True, "0.95", jnp.ones(2)]:
        with pytest.raises(TypeError, match=r"`tpr` must be a real number"):
            uncertainty.fpr_at_tpr(scores, scores, tpr=bad)
    with pytest.raises(TypeError, match=r"`tpr` must be a concrete number"):
        jax.jit(uncertainty.fpr_at_tpr)(scores, scores, 0.9)
    # numpy and 0-d JAX scalars are concrete.
    for tpr in [np.float32(0.5), jnp.float32(0.5)]:
        assert_close(uncertainty.fpr_at_tpr(scores, scores, tpr=tpr), 1.0)


def test_exported():
    assert {*LABELED, "aupr", "fpr_at_tpr"} <= set(uncertainty.__all__)
