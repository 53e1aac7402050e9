"""Whole-model conversion: ``to_batch_ensemble`` (convert.py)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import ensembles
from ensembles import BatchEnsembleLinear
from tests.models import (
    CNN,
    MLP,
    MODELS,
    ONES,
    TransformerBlock,
    count,
    random_input,
    state_arrays,
    trained_like,
)
from tests.reference import assert_trees_equal
from tests.tolerances import assert_close


class TestToBatchEnsemble:
    def test_layer_counts_and_shared_submodule_stays_shared(self):
        model = MLP(nnx.Rngs(0))
        ensemble = ensembles.to_batch_ensemble(model, num_members=3, rngs=nnx.Rngs(1))
        assert count(ensemble, nnx.Linear) == 0
        assert count(ensemble, BatchEnsembleLinear) == 5  # shared counted once
        assert isinstance(ensemble.blocks, nnx.List)
        assert isinstance(ensemble.heads, nnx.Dict)
        assert type(ensemble) is MLP

    def test_ones_reproduce_the_original_for_every_member(self):
        model = MLP(nnx.Rngs(0))
        ensemble = ensembles.to_batch_ensemble(
            model, num_members=3, rngs=nnx.Rngs(1), **ONES
        )
        x = random_input(0, (5, 4))
        y = ensembles.untile(ensemble(ensembles.tile(x, 3)), 3)
        for k in range(3):
            assert_close(y[k], model(x))

    def test_original_is_bit_identical_and_independent(self):
        model = MLP(nnx.Rngs(0))
        before = state_arrays(model)
        ensemble = ensembles.to_batch_ensemble(model, num_members=2, rngs=nnx.Rngs(1))
        ensemble.inp.kernel[...] = jnp.zeros((4, 8))
        assert_trees_equal(before, state_arrays(model))
        assert type(model.inp) is nnx.Linear

    def test_share_weights_holds_the_original_variables(self):
        model = MLP(nnx.Rngs(0))
        ensemble = ensembles.to_batch_ensemble(
            model, num_members=2, rngs=nnx.Rngs(1), share_weights=True
        )
        assert ensemble.inp.kernel is model.inp.kernel
        assert type(model.inp) is nnx.Linear  # the structure is still a copy

    def test_converting_twice_is_a_no_op(self):
        model = MLP(nnx.Rngs(0))
        once = ensembles.to_batch_ensemble(model, num_members=2, rngs=nnx.Rngs(1))
        twice = ensembles.to_batch_ensemble(once, num_members=2, rngs=nnx.Rngs(2))
        assert count(twice, BatchEnsembleLinear) == 5
        assert_trees_equal(state_arrays(twice), state_arrays(once))
        x = ensembles.tile(random_input(0, (3, 4)), 2)
        np.testing.assert_array_equal(twice(x), once(x))

    def test_other_ensemble_size_is_refused_and_nothing_changes(self):
        once = ensembles.to_batch_ensemble(
            MLP(nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(1)
        )
        rngs = nnx.Rngs(2)
        count_before = int(rngs.params.count[...])
        with pytest.raises(
            ValueError,
            match=r"`num_members` \(=3\) differs from "
            r"the ensemble size.*num_members=2",
        ):
            ensembles.to_batch_ensemble(once, num_members=3, rngs=rngs)
        assert int(rngs.params.count[...]) == count_before

    @pytest.mark.parametrize(
        ("first", "second", "match"),
        [
            ({}, {"posterior": "gaussian"}, r"`posterior` \(='gaussian'\) differs"),
            ({"posterior": "gaussian"}, {}, r"`posterior` \(=None\) differs"),
            (
                {"posterior": "gaussian"},
                {"posterior": "cauchy"},
                r"`posterior` \(='cauchy'\) differs.*'gaussian'",
            ),
            (
                {"posterior": "gaussian", "prior_stddev": 0.05},
                {"posterior": "gaussian"},
                r"`prior_stddev` \(=0.5\) differs.*prior_stddev=0.05",
            ),
        ],
    )
    def test_a_second_conversion_never_drops_a_posterior(self, first, second, match):
        once = ensembles.to_batch_ensemble(
            MLP(nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(1), **first
        )
        before = jax.tree.map(np.array, nnx.state(once, nnx.Param))
        rngs = nnx.Rngs(2)
        with pytest.raises(ValueError, match=match):
            ensembles.to_batch_ensemble(once, num_members=2, rngs=rngs, **second)
        assert_trees_equal(before, jax.tree.map(np.array, nnx.state(once, nnx.Param)))
        assert int(rngs.params.count[...]) == 0
        # The same arguments again: a no-op that keeps the posterior.
        twice = ensembles.to_batch_ensemble(once, num_members=2, rngs=rngs, **first)
        assert twice.inp.posterior == first.get("posterior")
        assert float(ensembles.kl_divergence(twice)) == float(
            ensembles.kl_divergence(once)
        )

    def test_random_fast_weights_make_members_differ(self):
        model = MLP(nnx.Rngs(0))
        ensemble = ensembles.to_batch_ensemble(model, num_members=3, rngs=nnx.Rngs(1))
        y = ensembles.untile(ensemble(ensembles.tile(random_input(0, (5, 4)), 3)), 3)
        assert not np.allclose(y[0], y[1]) and not np.allclose(y[1], y[2])
        # ... and every fresh layer drew its own keys.
        assert not np.allclose(ensemble.blocks[0].r[...], ensemble.blocks[1].r[...])

    def test_only_filter(self):
        model = MLP(nnx.Rngs(0))
        head_only = ensembles.to_batch_ensemble(
            model,
            num_members=2,
            rngs=nnx.Rngs(1),
            only=lambda path, node: "heads" in path,
        )
        assert type(head_only.heads["out"]) is BatchEnsembleLinear
        assert type(head_only.inp) is nnx.Linear
        assert count(head_only, BatchEnsembleLinear) == 1

    def test_nothing_to_convert(self):
        with pytest.raises(ValueError, match=r"found no layer to convert in Dropout"):
            ensembles.to_batch_ensemble(
                nnx.Dropout(0.5), num_members=2, rngs=nnx.Rngs(0)
            )

    @pytest.mark.parametrize(
        "kwargs, error, match",
        [
            ({"num_members": 0}, ValueError, r"`num_members` must be an int >= 1"),
            ({"norms": "per-member"}, ValueError, r"`norms` must be one of"),
        ],
    )
    def test_bad_arguments(self, kwargs, error, match):
        model = MLP(nnx.Rngs(0))
        before = state_arrays(model)
        with pytest.raises(error, match=match):
            ensembles.to_batch_ensemble(
                model, rngs=nnx.Rngs(0), **{"num_members": 2, **kwargs}
            )
        assert_trees_equal(before, state_arrays(model))


def test_orbax_checkpoint_roundtrip_is_bit_exact(tmp_path):
    model = ensembles.to_batch_ensemble(
        MLP(nnx.Rngs(0)), num_members=3, rngs=nnx.Rngs(1)
    )
    x = ensembles.tile(random_input(0, (5, 4)), 3)
    expected = model(x)
    _, state = nnx.split(model)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()

    fresh = ensembles.to_batch_ensemble(
        MLP(nnx.Rngs(5)), num_members=3, rngs=nnx.Rngs(6)
    )
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: fresh))
    restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    np.testing.assert_array_equal(nnx.merge(graphdef, restored)(x), expected)


# The transformer block runs in the slow tier, the CNN in the quick one.
MODEL_NAMES = [
    pytest.param(name, marks=pytest.mark.slow) if name == "transformer" else name
    for name in MODELS
]


@pytest.mark.parametrize("name", MODEL_NAMES)
class TestRealModels:
    def build(self, name):
        cls, shape = MODELS[name]
        return trained_like(cls(nnx.Rngs(0))), random_input(1, shape)

    def test_layer_counts(self, name):
        model, _ = self.build(name)
        shared = ensembles.to_batch_ensemble(model, num_members=2, rngs=nnx.Rngs(1))
        member = ensembles.to_batch_ensemble(
            model, num_members=2, rngs=nnx.Rngs(1), norms="member"
        )
        if name == "cnn":
            assert count(shared, ensembles.BatchEnsembleConv) == 2
            assert count(shared, BatchEnsembleLinear) == 1
            assert count(shared, nnx.BatchNorm) == 2
            assert count(member, ensembles.EnsembleBatchNorm) == 2
            assert count(member, nnx.BatchNorm) == 0
        else:
            assert count(shared, ensembles.BatchEnsembleLinearGeneral) == 4
            assert count(shared, BatchEnsembleLinear) == 2
            assert count(shared, nnx.LayerNorm) == 2
            assert count(member, ensembles.EnsembleLayerNorm) == 2
            assert type(shared.attention) is nnx.MultiHeadAttention
        for converted in (shared, member):
            assert count(converted, nnx.Linear) + count(converted, nnx.Conv) == 0
            assert count(converted, nnx.LinearGeneral) == 0

    @pytest.mark.parametrize("norms", ["shared", "member"])
    def test_ones_reproduce_the_original_and_original_untouched(self, name, norms):
        model, x = self.build(name)
        model.eval()
        before = state_arrays(model)
        ensemble = ensembles.to_batch_ensemble(
            model, num_members=3, rngs=nnx.Rngs(1), norms=norms, **ONES
        )
        y = ensembles.untile(ensemble(ensembles.tile(x, 3)), 3)
        expected = model(x)
        for k in range(3):
            assert_close(y[k], expected, scale=10)
        assert_trees_equal(before, state_arrays(model))
        again = ensembles.to_batch_ensemble(
            ensemble, num_members=3, rngs=nnx.Rngs(2), norms=norms
        )
        tiled = ensembles.tile(x, 3)
        np.testing.assert_array_equal(again(tiled), ensemble(tiled))

    def test_members_differ_and_extract_equals_view_equals_rows(self, name):
        model, x = self.build(name)
        ensemble = ensembles.to_batch_ensemble(
            model, num_members=3, rngs=nnx.Rngs(1), norms="member"
        )
        ensemble.eval()
        full = ensembles.untile(ensemble(ensembles.tile(x, 3)), 3)
        assert not np.allclose(full[0], full[1])
        for k in range(3):
            plain = ensembles.extract_member(ensemble, k)
            assert count(plain, ensembles.layers.EnsembleModule) == 0
            assert_close(plain(x), full[k], scale=10)
            assert_close(nnx.view(ensemble, member=k)(x), full[k], scale=10)
        wrapped = ensembles.Ensemble(ensemble, num_members=3)
        assert_close(wrapped(x), full, scale=10)


@pytest.mark.parametrize("norms", ["shared", "member"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_a_model_cast_to_bfloat16_stays_bfloat16(name, norms):
    """Cast after building (its param_dtype still says float32): stays bf16."""
    cls, shape = MODELS[name]
    model = trained_like(cls(nnx.Rngs(0)))
    model.eval()
    nnx.update(model, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(model)))
    x = random_input(1, shape).astype(jnp.bfloat16)
    expected = model(x)
    assert expected.dtype == jnp.bfloat16
    ensemble = ensembles.to_batch_ensemble(
        model, num_members=2, rngs=nnx.Rngs(1), norms=norms, **ONES
    )
    dtypes = {a.dtype for a in jax.tree.leaves(nnx.state(ensemble))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}, dtypes
    y = ensemble(ensembles.tile(x, 2))
    assert y.dtype == jnp.bfloat16
    for k in range(2):
        np.testing.assert_array_equal(ensembles.untile(y, 2)[k], expected)


def test_member_batch_norm_keeps_statistics_apart():
    model = CNN(nnx.Rngs(0))
    ensemble = ensembles.to_batch_ensemble(
        model, num_members=2, rngs=nnx.Rngs(1), norms="member", **ONES
    )
    x0, x1 = random_input(0, (4, 8, 8, 3)), 3.0 + random_input(1, (4, 8, 8, 3))
    ensemble(jnp.concatenate([x0, x1]))  # a training step: updates statistics
    mean = np.asarray(ensemble.bn1.mean[...])
    assert not np.allclose(mean[0], mean[1])
    # Member k's statistics are exactly those the original BatchNorm would keep
    # after seeing member k's rows alone.
    for k, xk in enumerate((x0, x1)):
        original = nnx.clone(model)
        original(xk)
        assert_close(mean[k], original.bn1.mean[...])
        assert_close(ensemble.bn1.var[...][k], original.bn1.var[...])


def test_member_norms_excluded_by_only_are_an_error_not_a_silent_no():
    model = TransformerBlock(nnx.Rngs(0))
    rngs = nnx.Rngs(1)
    with pytest.raises(ValueError, match=r'`norms="member"` would convert no norm'):
        ensembles.to_batch_ensemble(
            model, num_members=2, rngs=rngs, only=nnx.Linear, norms="member"
        )
    assert int(rngs.params.count[...]) == 0
    # Selecting the norms too converts them; `only` still leaves attention alone.
    converted = ensembles.to_batch_ensemble(
        model,
        num_members=2,
        rngs=rngs,
        only=(nnx.Linear, nnx.LayerNorm),
        norms="member",
    )
    assert count(converted, ensembles.EnsembleLayerNorm) == 2
    assert count(converted, nnx.LinearGeneral) == 4


class ScaledLinear(nnx.Linear):
    """A user's subclass of a Flax layer: it computes something else."""

    def __call__(self, x):
        return 2.0 * super().__call__(x)


class WithSubclass(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(4, 8, rngs=rngs)
        self.head = ScaledLinear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.body(x)))


def test_a_subclass_of_a_flax_layer_stays_shared_and_is_named():
    model = WithSubclass(nnx.Rngs(0))
    ones = ensembles.initializers.ones()
    with pytest.warns(UserWarning, match=r"head \(ScaledLinear\)") as caught:
        ensemble = ensembles.to_batch_ensemble(
            model, num_members=2, rngs=nnx.Rngs(1), r_init=ones, s_init=ones
        )
    assert "left these subclasses of them shared" in str(caught[0].message)
    assert type(ensemble.body) is BatchEnsembleLinear
    assert type(ensemble.head) is ScaledLinear  # its own __call__ kept
    x = jax.random.normal(jax.random.key(2), (3, 4))
    np.testing.assert_allclose(
        ensembles.untile(ensemble(ensembles.tile(x, 2)), 2),
        jnp.broadcast_to(model(x), (2, 3, 3)),
        rtol=1e-5,
        atol=1e-6,
    )
    # Left out with `only`, it is not named.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ensembles.to_batch_ensemble(
            model,
            num_members=2,
            rngs=nnx.Rngs(1),
            only=lambda path, node: path[0] != "head",
        )
