"""Bad input never looks like a good answer (issue 16).

Property tests over random shapes, members and injected NaN/inf, one rule each:

- NaN containment: a score of an example with invalid logits is NaN, and only
  that example's; an aggregate over such an example is NaN; eagerly and under
  jit. Out-of-range labels raise eagerly and give NaN under jit.
- Member independence: NaN/inf in member k's rows of a layer's input reaches
  no other member's output rows (and, for batch norm in training, no other
  member's statistics).
- No mutation on error: a call that raises leaves every Variable of the model
  (running statistics included) and the RngStream counts of the ``rngs`` it
  was given exactly as they were.
"""

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, note, settings
from hypothesis import strategies as st

import ensembles
from ensembles import uncertainty
from tests.reference import assert_same, numpy_normal, snapshot

# Every new shape compiles the functions under test again, which is most of
# what an example costs: 10 random ones per property (20 before). The layer
# properties take 5 random examples plus one explicit example per layer kind
# (`each_kind`), so that every kind is tested whatever hypothesis draws (15
# random ones before). The cheap properties (fixed shapes) keep their 15.
SETTINGS = settings(max_examples=10, deadline=None)
SMALL = settings(max_examples=5, deadline=None)
CHEAP = settings(max_examples=15, deadline=None)

PER_EXAMPLE = [
    "predictive_probs",
    "total_entropy",
    "expected_entropy",
    "mutual_information",
    "disagreement",
    "variance",
]
AGGREGATES = ["nll", "accuracy", "brier", "ece"]

# What a diverged member or an overflowing logit puts into an example.
BREAKAGES = ["nan", "+inf", "all -inf"]


def rngs_counts(rngs):
    return {
        name: int(stream.count[...])
        for name, stream in vars(rngs).items()
        if isinstance(stream, nnx.RngStream)
    }


@st.composite
def broken_logits(draw):
    """``(logits [E, B, C], broken example mask [B])`` with some examples broken."""
    num_members = draw(st.integers(1, 4))
    num_examples = draw(st.integers(2, 6))
    num_classes = draw(st.integers(2, 5))
    seed = draw(st.integers(0, 2**16))
    logits = 3.0 * np.random.default_rng(seed).standard_normal(
        (num_members, num_examples, num_classes)
    ).astype(np.float32)
    # A masked class (-inf next to finite logits) is valid and must stay finite.
    if draw(st.booleans()):
        logits[draw(st.integers(0, num_members - 1)), :, 0] = -np.inf
    broken = np.zeros(num_examples, bool)
    for example in draw(
        st.lists(st.integers(0, num_examples - 1), max_size=num_examples - 1)
    ):
        member = draw(st.integers(0, num_members - 1))
        kind = draw(st.sampled_from(BREAKAGES))
        if kind == "all -inf":
            logits[member, example, :] = -np.inf
        else:
            cls = draw(st.integers(0, num_classes - 1))
            logits[member, example, cls] = np.nan if kind == "nan" else np.inf
        broken[example] = True
    return logits, broken


def call(names, logits, labels=None, jit=False):
    """``{name: result}`` of the uncertainty functions ``names``, as numpy.

    Under ``jit`` one program computes them all (each function traced inside
    it): one compile per shape rather than one per function.
    """

    def run(logits, labels):
        fns = {name: getattr(uncertainty, name) for name in names}
        return {
            name: fn(logits) if labels is None else fn(logits, labels)
            for name, fn in fns.items()
        }

    if jit:
        run = jax.jit(run)
    return {name: np.asarray(value) for name, value in run(logits, labels).items()}


# ------------------------------------------------------------ uncertainty: NaN


@pytest.mark.slow
@SETTINGS
@given(case=broken_logits(), jit=st.booleans())
def test_per_example_scores_contain_broken_examples(case, jit):
    logits, broken = case
    all_scores = call(PER_EXAMPLE, jnp.asarray(logits), jit=jit)
    if (~broken).any():
        all_alone = call(PER_EXAMPLE, jnp.asarray(logits[:, ~broken]), jit=jit)
    for name in PER_EXAMPLE:
        scores = all_scores[name]
        # Only the broken examples are NaN, entirely.
        assert np.isnan(scores[broken]).all(), name
        assert np.isfinite(scores[~broken]).all(), name
        # The others score as if the broken ones were not there at all.
        if (~broken).any():
            alone = all_alone[name]
            np.testing.assert_allclose(scores[~broken], alone, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@SETTINGS
@given(case=broken_logits(), jit=st.booleans(), seed=st.integers(0, 100))
def test_metrics_are_nan_if_any_example_is_broken(case, jit, seed):
    logits, broken = case
    labels = np.random.default_rng(seed).integers(0, logits.shape[-1], logits.shape[1])
    values = call(AGGREGATES, jnp.asarray(logits), jnp.asarray(labels), jit=jit)
    for name in AGGREGATES:
        value = values[name]
        if broken.any():
            assert np.isnan(value), (name, value)
        else:
            assert not np.isnan(value), name


@pytest.mark.slow
@SETTINGS
@given(case=broken_logits(), seed=st.integers(0, 100), offset=st.integers(1, 3))
def test_out_of_range_labels_raise_eagerly_and_poison_under_jit(case, seed, offset):
    logits, _ = case
    num_examples, num_classes = logits.shape[1:]
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, num_examples)
    bad = rng.integers(0, num_examples)
    labels[bad] = num_classes - 1 + offset if rng.random() < 0.5 else -offset
    for name in AGGREGATES:
        with pytest.raises(ValueError, match=r"`labels` must lie in \[0, C\)"):
            call([name], jnp.asarray(logits), jnp.asarray(labels))
    values = call(AGGREGATES, jnp.asarray(logits), jnp.asarray(labels), jit=True)
    for name in AGGREGATES:
        assert np.isnan(values[name]), (name, values[name])


@SETTINGS
@given(
    n_in=st.integers(1, 6),
    n_out=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    where=st.sampled_from(["in", "out"]),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
    jit=st.booleans(),
)
def test_auroc_of_unranked_scores_is_nan(n_in, n_out, seed, where, value, jit):
    rng = np.random.default_rng(seed)
    scores = {"in": rng.random(n_in, np.float32), "out": rng.random(n_out, np.float32)}
    clean = uncertainty.auroc(scores["in"], scores["out"])
    assert 0.0 <= float(clean) <= 1.0
    scores[where][rng.integers(0, len(scores[where]))] = value
    fn = jax.jit(uncertainty.auroc) if jit else uncertainty.auroc
    assert np.isnan(fn(scores["in"], scores["out"]))


def test_a_diverged_member_ranks_as_unknown_not_as_confident():
    # The report: a NaN member made an example look maximally certain.
    logits = jnp.array([[[4.0, 0.0], [0.0, 0.1]], [[jnp.nan, 0.0], [0.1, 0.0]]])
    for name in ["total_entropy", "mutual_information", "disagreement"]:
        scores = getattr(uncertainty, name)(logits)
        assert np.isnan(scores[0]) and np.isfinite(scores[1]), name
    assert np.isnan(uncertainty.accuracy(logits, jnp.array([0, 0])))


def test_masked_logits_still_have_nan_free_gradients():
    logits = jnp.array([[[1.0, -jnp.inf, 0.5]], [[0.0, -jnp.inf, 2.0]]])
    grad = jax.grad(lambda x: jnp.sum(uncertainty.mutual_information(x)))(logits)
    assert not np.isnan(grad).any()


# ------------------------------------------------ layers: member independence


# Weights drawn with numpy: every example has new shapes, for which jax.random
# would compile again (the values do not matter here, only that they are not
# special).
DENSE_INITS = {
    "kernel_init": numpy_normal(),
    "r_init": numpy_normal(0.5, mean=1.0),
    "s_init": numpy_normal(0.5, mean=1.0),
}
NORM_INITS = {"scale_init": numpy_normal(0.5, mean=1.0)}


def make_layer(kind, num_members, features, rngs):
    if kind == "linear":
        return ensembles.BatchEnsembleLinear(
            features, 3, num_members=num_members, impl="xla", rngs=rngs, **DENSE_INITS
        )
    if kind == "linear_general":
        return ensembles.BatchEnsembleLinearGeneral(
            features,
            (2, 2),
            num_members=num_members,
            impl="xla",
            rngs=rngs,
            **DENSE_INITS,
        )
    if kind == "conv":
        return ensembles.BatchEnsembleConv(
            features,
            3,
            (2,),
            num_members=num_members,
            impl="xla",
            rngs=rngs,
            **DENSE_INITS,
        )
    if kind == "einsum":
        return ensembles.BatchEnsembleEinsum(
            "btf,fo->bto",
            (features, 3),
            (3,),
            num_members=num_members,
            rngs=rngs,
            **DENSE_INITS,
        )
    if kind == "layer_norm":
        return ensembles.EnsembleLayerNorm(
            features, num_members=num_members, rngs=rngs, **NORM_INITS
        )
    if kind == "rms_norm":
        return ensembles.EnsembleRMSNorm(
            features, num_members=num_members, rngs=rngs, **NORM_INITS
        )
    return ensembles.EnsembleBatchNorm(
        features,
        num_members=num_members,
        use_running_average=False,
        rngs=rngs,
        **NORM_INITS,
    )


LAYERS = [
    "linear",
    "linear_general",
    "conv",
    "einsum",
    "layer_norm",
    "rms_norm",
    "batch_norm",
]


def each_kind(arguments):
    """``@example(kind=k, **arguments(i))`` for the i-th layer kind k."""

    def decorate(test):
        for i, kind in reversed(list(enumerate(LAYERS))):
            test = hypothesis.example(kind=kind, **arguments(i))(test)
        return test

    return decorate


@pytest.mark.slow
@SMALL
@given(
    kind=st.sampled_from(LAYERS),
    num_members=st.integers(2, 3),
    batch=st.integers(1, 3),
    features=st.integers(1, 3),
    member=st.integers(0, 2),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
    seed=st.integers(0, 2**16),
)
@each_kind(
    lambda i: {
        "num_members": 2 + i % 2,
        "batch": 1 + i % 3,
        "features": 1 + (i + 1) % 3,
        "member": i % 3,
        "value": [np.nan, np.inf, -np.inf][i % 3],
        "seed": i,
    }
)
def test_a_broken_member_reaches_no_other_member(
    kind, num_members, batch, features, member, value, seed
):
    member %= num_members
    layer = make_layer(kind, num_members, features, nnx.Rngs(seed))
    # [E*B, T=4, features]: a length axis for the conv, any rank for the rest.
    x = (
        np.random.default_rng(seed)
        .standard_normal((num_members * batch, 4, features))
        .astype(np.float32)
    )
    clean = np.asarray(nnx.clone(layer)(jnp.asarray(x)))
    row = member * batch + seed % batch
    x[row, seed % 4, seed % features] = value
    broken = nnx.clone(layer)
    out = np.asarray(broken(jnp.asarray(x)))
    rows = np.arange(num_members * batch) // batch != member
    np.testing.assert_allclose(out[rows], clean[rows], rtol=1e-6, atol=1e-6)
    assert np.isfinite(out[rows]).all()
    if kind == "batch_norm":
        # Per-member statistics: only member k's running averages are poisoned.
        for stat in (broken.mean[...], broken.var[...]):
            others = np.delete(np.asarray(stat), member, axis=0)
            assert np.isfinite(others).all()
        assert not np.isfinite(np.asarray(broken.mean[...])[member]).all()


# ----------------------------------------------------- layers: no mutation


def bad_calls(kind, num_members, batch, features):
    """``(description, inputs, kwargs)`` of calls that must raise."""
    good = jnp.ones((num_members * batch, 4, features))
    calls = [
        ("scalar input", jnp.ones(()), {}),
        ("wrong features", jnp.ones((num_members * batch, 4, features + 1)), {}),
    ]
    if num_members > 1:
        rows = num_members * batch + 1
        calls.append(("rows not a multiple of E", jnp.ones((rows, 4, features)), {}))
    if kind in ("layer_norm", "rms_norm", "batch_norm"):
        calls += [
            ("mask of wrong shape", good, {"mask": jnp.ones((2, 3, 5), bool)}),
            ("float mask", good, {"mask": jnp.ones(good.shape)}),
        ]
    if kind == "batch_norm":
        calls += [
            ("empty batch in training", jnp.ones((0, 4, features)), {}),
            ("non-bool use_running_average", good, {"use_running_average": "no"}),
        ]
    return calls


@pytest.mark.slow
@SMALL
@given(
    kind=st.sampled_from(LAYERS),
    num_members=st.integers(1, 3),
    batch=st.integers(1, 2),
    features=st.integers(1, 3),
    warm=st.booleans(),
)
@each_kind(
    lambda i: {
        "num_members": 1 + (i + 1) % 3,
        "batch": 1 + i % 2,
        "features": 1 + i % 3,
        "warm": i % 2 == 0,  # batch norm (the last) warm
    }
)
def test_a_call_that_raises_changes_nothing(kind, num_members, batch, features, warm):
    layer = make_layer(kind, num_members, features, nnx.Rngs(0))
    good = jnp.ones((num_members * batch, 4, features))
    if warm:  # running statistics that are not the initial ones
        layer(good + jnp.arange(features, dtype=good.dtype)[None, None, :])
    for description, inputs, kwargs in bad_calls(kind, num_members, batch, features):
        note(description)
        before = snapshot(layer)
        with pytest.raises((ValueError, TypeError)):
            layer(inputs, **kwargs)
        assert_same(before, snapshot(layer))
    # And the layer still works afterwards.
    assert np.isfinite(np.asarray(layer(good))).all()


def wrong_shape(key, shape, dtype):
    return jnp.ones((1,), dtype)


@CHEAP
@given(
    kind=st.sampled_from(LAYERS),
    num_members=st.integers(1, 3),
    which=st.sampled_from(["first", "last"]),
)
def test_a_constructor_that_raises_draws_nothing_from_rngs(kind, num_members, which):
    rngs = nnx.Rngs(params=0, dropout=1)
    before = snapshot(rngs)
    if kind in ("linear", "linear_general", "conv", "einsum"):
        name = "kernel_init" if which == "first" else "s_init"
    elif kind == "rms_norm":
        name = "scale_init"
    else:
        name = "scale_init" if which == "first" else "bias_init"
    factory = {
        "linear": lambda **k: ensembles.BatchEnsembleLinear(3, 2, **k),
        "linear_general": lambda **k: ensembles.BatchEnsembleLinearGeneral(3, 2, **k),
        "conv": lambda **k: ensembles.BatchEnsembleConv(3, 2, (2,), **k),
        "einsum": lambda **k: ensembles.BatchEnsembleEinsum("bf,fo->bo", (3, 2), **k),
        "layer_norm": lambda **k: ensembles.EnsembleLayerNorm(3, **k),
        "rms_norm": lambda **k: ensembles.EnsembleRMSNorm(3, **k),
        "batch_norm": lambda **k: ensembles.EnsembleBatchNorm(3, **k),
    }[kind]
    with pytest.raises(ValueError, match=f"`{name}` returned an array of shape"):
        factory(num_members=num_members, rngs=rngs, **{name: wrong_shape})
    assert_same(before, snapshot(rngs))
    # A successful construction draws as before.
    factory(num_members=num_members, rngs=rngs)
    assert rngs_counts(rngs)["params"] > 0


@pytest.mark.parametrize(
    "rngs", [0, jax.random.key(0), None], ids=["int", "key", "None"]
)
def test_rngs_of_the_wrong_type_are_named(rngs):
    for factory in (
        lambda: ensembles.BatchEnsembleLinear(3, 2, num_members=2, rngs=rngs),
        lambda: ensembles.BatchEnsembleConv(3, 2, (2,), num_members=2, rngs=rngs),
        lambda: ensembles.EnsembleLayerNorm(3, num_members=2, rngs=rngs),
        lambda: ensembles.to_batch_ensemble(
            nnx.Linear(2, 2, rngs=nnx.Rngs(0)), num_members=2, rngs=rngs
        ),
    ):
        with pytest.raises(TypeError, match=r"`rngs` must be an `nnx.Rngs`"):
            factory()


def test_batch_norm_empty_batch_in_training_is_refused_and_eval_is_fine():
    norm = ensembles.EnsembleBatchNorm(3, num_members=2, rngs=nnx.Rngs(0))
    before = snapshot(norm)
    with pytest.raises(ValueError, match=r"`x` has shape \(0, 3\): an empty batch"):
        norm(jnp.ones((0, 3)))
    assert_same(before, snapshot(norm))
    assert norm(jnp.ones((0, 3)), use_running_average=True).shape == (0, 3)


# -------------------------------------------------- convert: shared layers


class Shared(nnx.Module):
    """One Linear under two attributes (and twice in a list), one on its own."""

    def __init__(self, rngs):
        shared = nnx.Linear(3, 3, rngs=rngs)
        self.first = shared
        self.second = shared
        self.stack = nnx.List([shared, nnx.Linear(3, 3, rngs=rngs)])
        self.norm = nnx.LayerNorm(3, rngs=rngs)
        self.norm_again = self.norm

    def __call__(self, x):
        return self.stack[1](self.norm_again(self.second(self.first(x))))


@pytest.mark.parametrize(
    "only",
    [
        nnx.PathContains("first"),
        nnx.PathContains("second"),
        lambda path, node: path == ("stack", 0),
    ],
    ids=["first-path", "second-path", "list-path"],
)
def test_a_shared_layer_is_selected_by_any_of_its_paths(only):
    model = Shared(nnx.Rngs(0))
    ensemble = ensembles.to_batch_ensemble(
        model, num_members=2, rngs=nnx.Rngs(1), only=only
    )
    assert type(ensemble.first) is ensembles.BatchEnsembleLinear
    assert ensemble.first is ensemble.second is ensemble.stack[0]
    assert type(ensemble.stack[1]) is nnx.Linear
    layers = [
        n
        for _, n in nnx.iter_graph(ensemble)
        if isinstance(n, ensembles.BatchEnsembleLinear)
    ]
    assert len(layers) == 1  # converted once


def test_a_shared_norm_is_selected_by_its_second_path():
    model = Shared(nnx.Rngs(0))
    ensemble = ensembles.to_batch_ensemble(
        model,
        num_members=2,
        rngs=nnx.Rngs(1),
        norms="member",
        only=nnx.Any(nnx.PathContains("norm_again"), nnx.PathContains("first")),
    )
    assert type(ensemble.norm) is ensembles.EnsembleLayerNorm
    assert ensemble.norm is ensemble.norm_again


def test_failed_conversion_changes_neither_model_nor_rngs():
    model = Shared(nnx.Rngs(0))
    rngs = nnx.Rngs(1)
    before = snapshot(model, rngs)
    with pytest.raises(ValueError, match="`s_init` returned an array"):
        ensembles.to_batch_ensemble(model, num_members=2, rngs=rngs, s_init=wrong_shape)
    assert_same(before, snapshot(model, rngs))
    ensembles.to_batch_ensemble(model, num_members=2, rngs=rngs)
    assert rngs_counts(rngs)["default"] > 0


@CHEAP
@given(
    num_members=st.integers(1, 3),
    bad=st.sampled_from(["member", "num_members", "plain model", "norms"]),
)
def test_whole_model_calls_that_raise_change_nothing(num_members, bad):
    model = Shared(nnx.Rngs(0))
    ensemble = ensembles.to_batch_ensemble(
        model, num_members=num_members, rngs=nnx.Rngs(1)
    )
    rngs = nnx.Rngs(2)
    before = snapshot(model, ensemble, rngs)
    with pytest.raises((ValueError, TypeError)):
        if bad == "member":
            ensembles.extract_member(ensemble, num_members)
        elif bad == "num_members":
            ensembles.Ensemble(ensemble, num_members=num_members + 1)
        elif bad == "plain model":
            ensembles.Ensemble(model, num_members=num_members)
        else:
            ensembles.to_batch_ensemble(
                model, num_members=num_members, rngs=rngs, norms="members"
            )
    assert_same(before, snapshot(model, ensemble, rngs))


def test_ensemble_of_a_plain_model_is_refused():
    with pytest.raises(ValueError, match=r"`model` \(Linear\) holds no BatchEnsemble"):
        ensembles.Ensemble(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), num_members=3)
