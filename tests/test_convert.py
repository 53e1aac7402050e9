import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import ensembles
from ensembles import BatchEnsembleLinear, initializers
from tests.tolerances import assert_close

ONES = {"r_init": initializers.ones(), "s_init": initializers.ones()}


def random_input(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


class MLP(nnx.Module):
    """Attributes, an nnx.List, an nnx.Dict and one submodule used twice."""

    def __init__(self, rngs):
        self.inp = nnx.Linear(4, 8, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])
        self.shared = nnx.Linear(8, 8, rngs=rngs)
        self.heads = nnx.Dict(out=nnx.Linear(8, 3, rngs=rngs))

    def __call__(self, x):
        x = nnx.relu(self.inp(x))
        for block in self.blocks:
            x = nnx.relu(block(x))
        x = nnx.relu(self.shared(self.shared(x)))
        return self.heads["out"](x)


def count(model, kind):
    return sum(type(node) is kind for _, node in nnx.iter_graph(model))


def state_arrays(model):
    return jax.tree.map(np.array, nnx.state(model))


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
        jax.tree.map(np.testing.assert_array_equal, before, state_arrays(model))
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
        jax.tree.map(
            np.testing.assert_array_equal, state_arrays(twice), state_arrays(once)
        )
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
        jax.tree.map(np.testing.assert_array_equal, before, state_arrays(model))


class TestExtractMember:
    def test_extract_equals_view_equals_rows(self):
        ensemble = ensembles.to_batch_ensemble(
            MLP(nnx.Rngs(0)), num_members=3, rngs=nnx.Rngs(1)
        )
        x = random_input(0, (5, 4))
        full = ensembles.untile(ensemble(ensembles.tile(x, 3)), 3)
        for k in range(3):
            member = ensembles.extract_member(ensemble, k)
            assert count(member, BatchEnsembleLinear) == 0
            assert count(member, nnx.Linear) == 5
            assert member.shared is member.blocks[0] or count(member, nnx.Linear) == 5
            assert_close(member(x), full[k])
            assert_close(nnx.view(ensemble, member=k)(x), full[k])

    def test_ones_roundtrip_gives_back_the_original(self):
        model = MLP(nnx.Rngs(0))
        ensemble = ensembles.to_batch_ensemble(
            model, num_members=2, rngs=nnx.Rngs(1), **ONES
        )
        back = ensembles.extract_member(ensemble, 1)
        jax.tree.map(
            np.testing.assert_array_equal, state_arrays(back), state_arrays(model)
        )

    def test_extracted_model_is_independent(self):
        ensemble = ensembles.to_batch_ensemble(
            MLP(nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(1)
        )
        before = state_arrays(ensemble)
        member = ensembles.extract_member(ensemble, 0)
        member.inp.kernel[...] = jnp.zeros((4, 8))
        jax.tree.map(np.testing.assert_array_equal, before, state_arrays(ensemble))

    def test_errors(self):
        with pytest.raises(ValueError, match=r"holds no BatchEnsemble layer"):
            ensembles.extract_member(MLP(nnx.Rngs(0)), 0)
        ensemble = ensembles.to_batch_ensemble(
            MLP(nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(1)
        )
        with pytest.raises(ValueError, match=r"`member` must be in \[0, num_members\)"):
            ensembles.extract_member(ensemble, 2)


class TestEnsemble:
    def test_call_tiles_and_untiles(self):
        model = ensembles.to_batch_ensemble(
            MLP(nnx.Rngs(0)), num_members=3, rngs=nnx.Rngs(1)
        )
        ensemble = ensembles.Ensemble(model, num_members=3)
        x = random_input(0, (5, 4))
        y = ensemble(x)
        assert y.shape == (3, 5, 3)
        np.testing.assert_array_equal(
            y, ensembles.untile(model(ensembles.tile(x, 3)), 3)
        )
        y_jit = nnx.jit(lambda m, x: m(x))(ensemble, x)
        assert_close(y_jit, y)

    def test_member_view_and_extract(self):
        model = ensembles.to_batch_ensemble(
            MLP(nnx.Rngs(0)), num_members=3, rngs=nnx.Rngs(1)
        )
        ensemble = ensembles.Ensemble(model, num_members=3)
        x = random_input(0, (5, 4))
        y = ensemble(x)
        assert_close(nnx.view(ensemble, member=2)(x), y[2])
        assert_close(ensembles.extract_member(ensemble, 1)(x), y[1])
        assert type(ensembles.extract_member(ensemble, 1)) is MLP
        assert_close(ensemble.extract_member(0)(x), y[0])

    def test_pytree_outputs(self):
        class TwoHeads(nnx.Module):
            def __init__(self, rngs):
                self.a = BatchEnsembleLinear(4, 2, num_members=2, rngs=rngs)
                self.b = BatchEnsembleLinear(4, 1, num_members=2, rngs=rngs)

            def __call__(self, x):
                return {"a": self.a(x), "b": self.b(x)}

        out = ensembles.Ensemble(TwoHeads(nnx.Rngs(0)), num_members=2)(
            random_input(0, (3, 4))
        )
        assert out["a"].shape == (2, 3, 2) and out["b"].shape == (2, 3, 1)

    def test_size_mismatch(self):
        model = ensembles.to_batch_ensemble(
            MLP(nnx.Rngs(0)), num_members=3, rngs=nnx.Rngs(1)
        )
        with pytest.raises(
            ValueError,
            match=r"`num_members` \(=2\) must match.*"
            r"num_members=3",
        ):
            ensembles.Ensemble(model, num_members=2)


class TestOptim:
    def test_split_applies_different_updates_by_hand(self):
        model = ensembles.to_batch_ensemble(
            MLP(nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(1)
        )
        shared_lr, fast_lr = 0.1, 0.025
        tx = ensembles.optim.split_fast_weights(
            optax.sgd(shared_lr), optax.sgd(fast_lr)
        )
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        x = random_input(0, (6, 4))
        before = state_arrays(model)

        def loss_fn(model):
            return jnp.mean(model(x) ** 2)

        grads = nnx.grad(loss_fn)(model)
        nnx.jit(lambda m, o, g: o.update(m, g))(model, optimizer, grads)
        after = state_arrays(model)
        grads = jax.tree.map(np.array, grads)
        for name, lr in [
            ("kernel", shared_lr),
            ("bias", shared_lr),
            ("r", fast_lr),
            ("s", fast_lr),
        ]:
            expected = before["inp"][name] - lr * grads["inp"][name]
            np.testing.assert_allclose(
                after["inp"][name], expected, rtol=1e-6, atol=1e-7
            )

    def test_weight_decay_only_on_shared_weights(self):
        model = BatchEnsembleLinear(3, 2, num_members=2, rngs=nnx.Rngs(0))
        tx = ensembles.optim.split_fast_weights(
            optax.add_decayed_weights(0.5), optax.identity()
        )
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        before = state_arrays(model)
        zero_grads = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
        optimizer.update(model, zero_grads)
        # add_decayed_weights returns +0.5 * param as the update; apply_updates adds it.
        np.testing.assert_allclose(model.kernel[...], 1.5 * before["kernel"], rtol=1e-6)
        np.testing.assert_array_equal(model.r[...], before["r"])

    def test_labels_and_mask(self):
        model = BatchEnsembleLinear(3, 2, num_members=2, rngs=nnx.Rngs(0))
        params = nnx.state(model, nnx.Param)
        labels = ensembles.optim.fast_weight_labels(params)
        assert dict(labels) == {
            "kernel": "shared",
            "bias": "shared",
            "r": "fast",
            "s": "fast",
        }
        pure = ensembles.optim.fast_weight_labels(nnx.as_pure(params))
        assert dict(pure) == dict(labels)

    def test_name_clash_is_reported(self):
        class Clash(nnx.Module):
            def __init__(self):
                self.r = nnx.Param(jnp.ones(3))

        with pytest.raises(ValueError, match=r"Parameter `r` is a Param but its name"):
            ensembles.optim.fast_weight_labels(nnx.state(Clash(), nnx.Param))


class TestSummary:
    def test_counts(self):
        model = ensembles.to_batch_ensemble(
            MLP(nnx.Rngs(0)), num_members=4, rngs=nnx.Rngs(1)
        )
        info = ensembles.summary(model)
        kernels = 4 * 8 + 8 * 8 * 3 + 8 * 3
        biases = 8 + 8 * 3 + 3
        fast = 4 * ((4 + 8) + 3 * (8 + 8) + (8 + 3))
        assert info.num_members == 4 and len(info.layers) == 5
        assert info.shared_params == kernels
        assert info.fast_params == fast
        assert info.member_params == 4 * biases
        assert info.total_params == kernels + fast + 4 * biases
        assert info.single_params == kernels + biases
        assert info.deep_ensemble_params == 4 * (kernels + biases)
        text = str(info)
        assert "blocks/0" in text and "deep ensemble of 4" in text
        assert info.shared_norms == ()

    @pytest.mark.parametrize("norms", ["shared", "member"])
    def test_norms(self, norms):
        model = ensembles.to_batch_ensemble(
            CNN(nnx.Rngs(0)), num_members=4, rngs=nnx.Rngs(1), norms=norms
        )
        info = ensembles.summary(model)
        kernels = 3 * 3 * 3 * 8 + 3 * 3 * 8 * 8 + 8 * 5
        biases = 8 + 8 + 5
        norm_params = 2 * (8 + 8)  # bn1, bn2: scale and bias; no statistics
        # One member alone: kernels (r, s folded in), one member's biases and
        # one copy of the norm parameters, whether shared or per member.
        assert info.single_params == kernels + biases + norm_params
        assert info.deep_ensemble_params == 4 * info.single_params
        if norms == "shared":
            assert info.shared_norms == (
                ("bn1", "BatchNorm", 16),
                ("bn2", "BatchNorm", 16),
            )
            assert info.shared_params == kernels + norm_params
            assert info.member_params == 4 * biases
            rows = str(info).splitlines()
            assert rows[4].split() == ["bn1", "BatchNorm", "16", "0", "0"]
            assert rows[5].split() == ["bn2", "BatchNorm", "16", "0", "0"]
        else:
            assert info.shared_norms == ()
            assert info.shared_params == kernels
            assert info.member_params == 4 * (biases + norm_params)

    def test_plain_model(self):
        with pytest.raises(ValueError, match=r"holds no BatchEnsemble layer"):
            ensembles.summary(MLP(nnx.Rngs(0)))


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


class CNN(nnx.Module):
    """Conv + BatchNorm + pooling + Linear head."""

    def __init__(self, rngs):
        self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (3, 3), strides=2, rngs=rngs)
        self.bn2 = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 5, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
        x = nnx.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(axis=(1, 2)))


class TransformerBlock(nnx.Module):
    """Pre-norm block: LayerNorm, MultiHeadAttention, LayerNorm, MLP."""

    def __init__(self, rngs, features=8, heads=2):
        self.norm1 = nnx.LayerNorm(features, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            heads, features, decode=False, deterministic=True, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(features, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(features, 16, rngs=rngs),
            nnx.gelu,
            nnx.Linear(16, features, rngs=rngs),
        )

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


MODELS = {
    "cnn": (CNN, (4, 8, 8, 3)),
    "transformer": (TransformerBlock, (4, 5, 8)),
}


def trained_like(model):
    """Non-trivial norm statistics and biases, as a trained model would have."""
    rng = np.random.default_rng(42)
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.BatchStat)):
        variable[...] = jnp.asarray(rng.uniform(0.5, 1.5, variable.shape), jnp.float32)
    return model


@pytest.mark.parametrize("name", list(MODELS))
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
        jax.tree.map(np.testing.assert_array_equal, before, state_arrays(model))
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
@pytest.mark.parametrize("name", list(MODELS))
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


def test_summary_counts_member_norms():
    ensemble = ensembles.to_batch_ensemble(
        TransformerBlock(nnx.Rngs(0)), num_members=4, rngs=nnx.Rngs(1), norms="member"
    )
    info = ensembles.summary(ensemble)
    types = {row[1] for row in info.layers}
    assert {"EnsembleLayerNorm", "BatchEnsembleLinearGeneral"} <= types
    norm_rows = [row for row in info.layers if row[1] == "EnsembleLayerNorm"]
    assert all(row[2] == 0 and row[3] == 0 and row[4] == 4 * 16 for row in norm_rows)
    single = ensembles.extract_member(ensemble, 0)
    single_count = sum(
        int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(single, nnx.Param))
    )
    assert info.single_params == single_count
    assert info.deep_ensemble_params == 4 * single_count
    assert info.total_params == (
        info.shared_params + info.fast_params + info.member_params
    )
    assert info.total_params < info.deep_ensemble_params


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
