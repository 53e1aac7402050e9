"""Parameter counts of a BatchEnsemble model (summary.py)."""

import jax
import numpy as np
import pytest
from flax import nnx

import ensembles
from tests.models import (
    CNN,
    MLP,
    TransformerBlock,
)


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

    @pytest.mark.parametrize("norms", ["shared", "member"])
    def test_an_abstract_model_counts_alike(self, norms):
        """Built by ``nnx.eval_shape`` (what ``ensembles-bench`` checks a
        user's model on, allocating nothing): the same summary."""

        def build():
            rngs = nnx.Rngs(0)
            model = nnx.Sequential(
                nnx.Linear(3, 8, rngs=rngs),
                nnx.BatchNorm(8, rngs=rngs),
                nnx.Embed(5, 8, rngs=rngs),
            )
            return ensembles.to_batch_ensemble(
                model, num_members=4, rngs=nnx.Rngs(1), norms=norms
            )

        assert ensembles.summary(nnx.eval_shape(build)) == ensembles.summary(build())

    def test_plain_model(self):
        with pytest.raises(ValueError, match=r"holds no BatchEnsemble layer"):
            ensembles.summary(MLP(nnx.Rngs(0)))


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
