"""Fast-weight optimizer recipes (optim.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import ensembles
from ensembles import BatchEnsembleLinear
from tests.models import (
    MLP,
    random_input,
    state_arrays,
)


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
