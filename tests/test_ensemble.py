"""``ensembles.Ensemble`` and whole-model ``extract_member`` (ensemble.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from ensembles import BatchEnsembleLinear
from tests.models import (
    MLP,
    ONES,
    count,
    random_input,
    state_arrays,
)
from tests.reference import assert_trees_equal
from tests.tolerances import assert_close


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
        assert_trees_equal(state_arrays(back), state_arrays(model))

    def test_extracted_model_is_independent(self):
        ensemble = ensembles.to_batch_ensemble(
            MLP(nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(1)
        )
        before = state_arrays(ensemble)
        member = ensembles.extract_member(ensemble, 0)
        member.inp.kernel[...] = jnp.zeros((4, 8))
        assert_trees_equal(before, state_arrays(ensemble))

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
