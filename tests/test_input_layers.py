"""The input layer of a converted model: random signs for its ``r`` (the recipe).

``to_batch_ensemble`` draws the input layer's ``r`` from ``input_r_init``
(random signs while ``r_init`` is the default) and every other fast weight from
``r_init`` / ``s_init`` (N(1, 0.5) by default).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from ensembles import initializers
from tests.reference import assert_same, snapshot

E = 4


def _is_signs(array):
    return set(np.unique(np.asarray(array)).tolist()) <= {-1.0, 1.0}


def _is_default_normal(array):
    values = np.asarray(array)
    # N(1, 0.5): not signs, within 5 standard errors of the mean and stddev.
    tolerance = 5 * 0.5 / values.size**0.5
    return (
        not _is_signs(values)
        and abs(values.mean() - 1.0) < tolerance
        and abs(values.std() - 0.5) < 5 * 0.5 / (2 * values.size) ** 0.5
    )


class Named(nnx.Module):
    """Its layers are created (and called) in an order their names do not sort in."""

    def __init__(self, rngs):
        self.z_input = nnx.Linear(16, 64, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(64, 64, rngs=rngs) for _ in range(2)])
        self.a_head = nnx.Linear(64, 3, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.z_input(x))
        for block in self.blocks:
            x = nnx.relu(block(x))
        return self.a_head(x)


def test_the_first_layer_of_a_sequential_gets_random_signs():
    model = nnx.Sequential(
        nnx.Linear(32, 64, rngs=nnx.Rngs(0)),
        nnx.relu,
        nnx.Linear(64, 64, rngs=nnx.Rngs(1)),
        nnx.relu,
        nnx.Linear(64, 3, rngs=nnx.Rngs(2)),
    )
    ensemble = ensembles.to_batch_ensemble(model, num_members=E, rngs=nnx.Rngs(3))
    first, hidden, head = ensemble.layers[0], ensemble.layers[2], ensemble.layers[4]
    assert _is_signs(first.r[...])
    assert len(np.unique(np.asarray(first.r[...]))) == 2  # both signs drawn
    for weights in (first.s, hidden.r, hidden.s, head.r, head.s):
        assert _is_default_normal(weights[...])


def test_the_first_layer_created_is_the_input_layer_whatever_its_name():
    ensemble = ensembles.to_batch_ensemble(
        Named(nnx.Rngs(0)), num_members=E, rngs=nnx.Rngs(1)
    )
    assert _is_signs(ensemble.z_input.r[...])  # sorts last, created first
    for layer in (*ensemble.blocks, ensemble.a_head):
        assert _is_default_normal(layer.r[...])


def test_an_explicit_r_init_holds_for_every_layer():
    # ones() everywhere: the conversion is exact, input layer included.
    model = Named(nnx.Rngs(0))
    ones = initializers.ones()
    ensemble = ensembles.to_batch_ensemble(
        model, num_members=E, rngs=nnx.Rngs(1), r_init=ones, s_init=ones
    )
    x = jax.random.normal(jax.random.key(2), (5, 16))
    np.testing.assert_allclose(
        ensembles.untile(ensemble(ensembles.tile(x, E)), E),
        jnp.broadcast_to(model(x), (E, 5, 3)),
        rtol=1e-5,
        atol=1e-5,
    )
    # An explicit input_r_init still applies to the input layer.
    signed = ensembles.to_batch_ensemble(
        model,
        num_members=E,
        rngs=nnx.Rngs(1),
        r_init=ones,
        s_init=ones,
        input_r_init=initializers.random_sign(),
    )
    assert _is_signs(signed.z_input.r[...]) and not np.all(signed.z_input.r[...] == 1)
    assert np.all(signed.a_head.r[...] == 1)


def test_with_only_the_input_layer_is_the_first_converted_layer():
    # The layers before it stay plain and shared: every member reads the same
    # activations there, as an input layer reads the same input (docs/training.md).
    ensemble = ensembles.to_batch_ensemble(
        Named(nnx.Rngs(0)),
        num_members=E,
        rngs=nnx.Rngs(1),
        only=lambda path, node: path[0] != "z_input",
    )
    assert type(ensemble.z_input) is nnx.Linear
    assert _is_signs(ensemble.blocks[0].r[...])
    for layer in (ensemble.blocks[1], ensemble.a_head):
        assert _is_default_normal(layer.r[...])


def test_input_layers_selects_them():
    ensemble = ensembles.to_batch_ensemble(
        Named(nnx.Rngs(0)),
        num_members=E,
        rngs=nnx.Rngs(1),
        input_layers=lambda path, node: path[0] == "blocks",
    )
    assert all(_is_signs(block.r[...]) for block in ensemble.blocks)
    assert _is_default_normal(ensemble.z_input.r[...])


def test_input_layers_that_select_nothing_raise_and_change_nothing():
    model = Named(nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(model))
    rngs = nnx.Rngs(1)
    key = rngs.params.key[...]
    count = rngs.params.count[...]
    with pytest.raises(
        ValueError, match=r"`input_layers` .* selects none of the layers"
    ):
        ensembles.to_batch_ensemble(
            model,
            num_members=E,
            rngs=rngs,
            input_layers=lambda path, node: "decoder" in path,
        )
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model), before)
    assert rngs.params.count[...] == count
    np.testing.assert_array_equal(
        jax.random.key_data(rngs.params.key[...]), jax.random.key_data(key)
    )


def test_an_explicit_r_init_does_not_silence_input_layers_that_select_nothing():
    # The docstring promises the error whatever the initializers: an
    # `input_layers` that selects nothing is a typo either way.
    model = Named(nnx.Rngs(0))
    before = snapshot(model)
    rngs = nnx.Rngs(1)
    with pytest.raises(
        ValueError, match=r"`input_layers` .* selects none of the layers"
    ):
        ensembles.to_batch_ensemble(
            model,
            num_members=E,
            rngs=rngs,
            r_init=initializers.ones(),
            input_layers=lambda path, node: "decoder" in path,
        )
    assert_same(before, snapshot(model))
    assert rngs.params.count[...] == 0


class DictOfLayers(nnx.Module):
    """Its layers in a plain dict, created in an order their keys do not sort in."""

    def __init__(self, rngs):
        self.layers = nnx.data(
            {
                "z_input": nnx.Linear(16, 64, rngs=rngs),
                "m_hidden": nnx.Linear(64, 64, rngs=rngs),
                "a_head": nnx.Linear(64, 3, rngs=rngs),
            }
        )

    def __call__(self, x):
        layers = self.layers
        return layers["a_head"](
            nnx.relu(layers["m_hidden"](nnx.relu(layers["z_input"](x))))
        )


def test_the_first_layer_created_in_a_plain_dict_is_the_input_layer():
    # A dict keeps the order its items were set in; nnx sorts its keys.
    ensemble = ensembles.to_batch_ensemble(
        DictOfLayers(nnx.Rngs(0)), num_members=E, rngs=nnx.Rngs(1)
    )
    assert _is_signs(ensemble.layers["z_input"].r[...])
    for key in ("m_hidden", "a_head"):
        assert _is_default_normal(ensemble.layers[key].r[...])


def _member_r(key, shape, dtype):
    """A wrong input_r_init: one member's ``[in]`` where ``[E, in]`` is asked."""
    del key
    return jnp.full(shape[1:], -1.0, dtype)


@pytest.mark.parametrize("make", ["plain", "stacked"])
def test_an_input_r_init_of_the_wrong_shape_is_named_and_changes_nothing(make):
    # A stacked layer used to broadcast it silently into every member, and a
    # plain one blamed `r_init`.
    model = Named(nnx.Rngs(0)) if make == "plain" else Scanned(nnx.Rngs(0))
    before = snapshot(model)
    rngs = nnx.Rngs(1)
    with pytest.raises(
        ValueError,
        match=r"`input_r_init` returned an array of shape \(\d+,\), but .* needs "
        r"shape \(4, \d+\)",
    ):
        ensembles.to_batch_ensemble(
            model, num_members=E, rngs=rngs, input_r_init=_member_r
        )
    assert_same(before, snapshot(model))
    assert rngs.params.count[...] == 0


def test_input_r_init_must_be_an_initializer():
    with pytest.raises(TypeError, match="`input_r_init` must be an initializer"):
        ensembles.to_batch_ensemble(
            Named(nnx.Rngs(0)), num_members=E, rngs=nnx.Rngs(1), input_r_init=-1.0
        )


@nnx.split_rngs(splits=3)
@nnx.vmap(axis_size=3)
def _stack_of_three(rngs):
    return nnx.Linear(8, 8, rngs=rngs)


class Scanned(nnx.Module):
    """A stack of three layers built under nnx.vmap for nnx.scan, then a head."""

    def __init__(self, rngs):
        self.body = _stack_of_three(rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x, layer):
            return nnx.relu(layer(x))

        return self.head(step(x, self.body))


def test_only_the_first_layer_of_a_stack_gets_signs():
    model = Scanned(nnx.Rngs(0))
    ensemble = ensembles.to_batch_ensemble(model, num_members=E, rngs=nnx.Rngs(1))
    r = np.asarray(ensemble.body.r[...])  # [layers, E, in]
    assert r.shape == (3, E, 8)
    assert _is_signs(r[0]) and not _is_signs(r[1]) and not _is_signs(r[2])
    x = jax.random.normal(jax.random.key(0), (6, 8))
    assert ensemble(ensembles.tile(x, E)).shape == (E * 6, 2)


def test_a_converted_model_converts_again_unchanged():
    ensemble = ensembles.to_batch_ensemble(
        Named(nnx.Rngs(0)), num_members=E, rngs=nnx.Rngs(1)
    )
    again = ensembles.to_batch_ensemble(ensemble, num_members=E, rngs=nnx.Rngs(2))
    jax.tree.map(
        np.testing.assert_array_equal,
        nnx.state(again, ensembles.FastWeight),
        nnx.state(ensemble, ensembles.FastWeight),
    )
