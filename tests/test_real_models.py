"""Real-style NNX models convert, summarise, extract, view and train.

The models (tests/real_models.py) are written the way Flax's examples and
bonsai write theirs: stacked layers under ``nnx.scan``, extra call arguments
(positions, masks), a tied embedding, custom norms, raw parameters.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import ensembles
from ensembles import BatchEnsembleEinsum, BatchEnsembleLinear
from tests.models import ONES, random_input
from tests.real_models import ConvNeXt, Decoder, ScanMLP, ViT, decoder_inputs
from tests.tolerances import assert_close

E = 2


@pytest.fixture(autouse=True)
def _users_rank_promotion():
    # Real model code broadcasts implicitly (`gamma * x`, `scale * x`), as
    # JAX's default allows; the rest of the suite raises on it.
    with jax.numpy_rank_promotion("allow"):
        yield


CASES = {
    "scan_mlp": (ScanMLP, lambda: (random_input(0, (3, 4)),)),
    "decoder": (Decoder, decoder_inputs),
    "vit": (ViT, lambda: (random_input(1, (3, 8, 8, 3)),)),
    "convnext": (ConvNeXt, lambda: (random_input(2, (3, 8, 8, 3)),)),
}


# The quick tier runs the smallest model; the slow tier the three others.
NAMES = [
    name if name == "scan_mlp" else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(CASES)
]


def _model(name):
    make, inputs = CASES[name]
    model = make(nnx.Rngs(0))
    model.eval()
    return model, inputs()


@pytest.mark.parametrize("name", NAMES)
def test_ones_reproduce_the_model_for_every_member(name):
    model, inputs = _model(name)
    converted = ensembles.to_batch_ensemble(
        model, num_members=E, rngs=nnx.Rngs(1), **ONES
    )
    outputs = ensembles.Ensemble(converted, num_members=E)(*inputs)
    expected = model(*inputs)
    for k in range(E):
        assert_close(outputs[k], expected, scale=10)


@pytest.mark.parametrize("name", NAMES)
def test_members_differ_and_extract_equals_view_equals_rows(name):
    model, inputs = _model(name)
    converted = ensembles.to_batch_ensemble(model, num_members=E, rngs=nnx.Rngs(1))
    ensemble = ensembles.Ensemble(converted, num_members=E)
    outputs = ensemble(*inputs)
    assert not np.allclose(outputs[0], outputs[1])
    for k in range(E):
        plain = ensembles.extract_member(converted, k)
        assert not any(
            isinstance(node, ensembles.layers.EnsembleModule)
            for _, node in nnx.iter_graph(plain)
        )
        assert_close(plain(*inputs), outputs[k], scale=10)
        assert_close(nnx.view(ensemble, member=k)(*inputs), outputs[k], scale=10)


def test_stacked_layers_convert_layer_by_layer():
    model, _ = _model("scan_mlp")
    converted = ensembles.to_batch_ensemble(model, num_members=E, rngs=nnx.Rngs(1))
    linear = converted.blocks.linear
    assert isinstance(linear, BatchEnsembleLinear)
    assert linear.kernel.shape == (3, 8, 8) and linear.r.shape == (3, E, 8)
    assert linear.bias.shape == (3, E, 8)
    np.testing.assert_array_equal(linear.kernel[...], model.blocks.linear.kernel[...])
    # Every layer drew its own fast weights.
    r = np.asarray(linear.r[...])
    assert not np.allclose(r[0], r[1]) and not np.allclose(r[1], r[2])
    # The member comes back as the stack the model's scan expects.
    plain = ensembles.extract_member(converted, 1)
    assert type(plain.blocks.linear) is nnx.Linear
    assert plain.blocks.linear.kernel.shape == (3, 8, 8)
    np.testing.assert_allclose(
        plain.blocks.linear.kernel[...][2],
        linear.kernel[...][2] * np.outer(r[2, 1], linear.s[...][2, 1]),
        rtol=1e-6,
    )
    # A stack passed to from_* directly is refused with the way out.
    with pytest.raises(ValueError, match=r"`linear` is a stack of layers.*\(3, 8, 8\)"):
        BatchEnsembleLinear.from_linear(
            model.blocks.linear, num_members=E, rngs=nnx.Rngs(0)
        )


def test_stacked_layers_keep_their_axis_names_and_member_norms():
    meta = {"out_sharding": (None, "model"), "eager_sharding": False}

    @nnx.split_rngs(splits=3)
    @nnx.vmap(axis_size=3, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return nnx.Sequential(
            nnx.Linear(4, 4, kernel_metadata=meta, rngs=rngs),
            nnx.LayerNorm(4, rngs=rngs),
        )

    stack = nnx.Dict(layers=make(nnx.Rngs(0)))
    converted = ensembles.to_batch_ensemble(
        stack, num_members=E, rngs=nnx.Rngs(1), norms="member"
    )
    linear, norm = converted["layers"].layers
    assert linear.kernel.get_metadata()["out_sharding"] == ("layers", None, "model")
    assert linear.bias.shape == (3, E, 4)
    assert isinstance(norm, ensembles.EnsembleLayerNorm)
    assert norm.scale.shape == (3, E, 4)
    plain = ensembles.extract_member(converted, 0)
    kernel = plain["layers"].layers[0].kernel
    assert kernel.get_metadata()["out_sharding"] == ("layers", None, "model")
    assert type(plain["layers"].layers[1]) is nnx.LayerNorm


@pytest.mark.slow
def test_rank1_stacked_layers_draw_per_layer_and_call():
    model, (x,) = _model("scan_mlp")
    converted = ensembles.to_batch_ensemble(
        model, num_members=E, rngs=nnx.Rngs(1), posterior="gaussian"
    )
    converted.train()
    ensemble = ensembles.Ensemble(converted, num_members=E)
    first, second = ensemble(x), ensemble(x)
    assert not np.allclose(first, second)
    assert converted.blocks.linear.r_unconstrained_stddev.shape == (3, E, 8)
    assert np.isfinite(float(ensembles.kl_divergence(converted)))


@pytest.mark.slow
def test_ensemble_tiles_positions_and_masks():
    model, inputs = _model("decoder")
    converted = ensembles.to_batch_ensemble(model, num_members=E, rngs=nnx.Rngs(1))
    ensemble = ensembles.Ensemble(converted, num_members=E)
    tokens, positions, mask = inputs
    logits = ensemble(tokens, positions, mask=mask)
    assert logits.shape == (E, 3, 5, 11)
    rows = converted(
        ensembles.tile(tokens, E), ensembles.tile(positions, E), ensembles.tile(mask, E)
    )
    np.testing.assert_array_equal(logits, ensembles.untile(rows, E))


def test_ensemble_untiled_arguments_and_outputs_of_other_sizes():
    seen = {}

    class Probe(nnx.Module):
        def __init__(self, rngs):
            self.linear = BatchEnsembleLinear(3, 2, num_members=E, rngs=rngs)

        def __call__(self, x, table, scale=1.0, *, extra):
            seen.update(table=table.shape, extra=extra.shape)
            y = self.linear(x) * scale
            return {"y": y, "aux": jnp.sum(y)}

    ensemble = ensembles.Ensemble(Probe(nnx.Rngs(0)), num_members=E, untiled=[1])
    out = ensemble(jnp.ones((4, 3)), jnp.ones((4, 7)), 2.0, extra=jnp.ones((4, 1)))
    assert seen == {"table": (4, 7), "extra": (E * 4, 1)}
    assert out["y"].shape == (E, 4, 2) and out["aux"].shape == ()
    by_name = ensembles.Ensemble(Probe(nnx.Rngs(0)), num_members=E, untiled="extra")
    by_name(jnp.ones((4, 3)), jnp.ones((4, 7)), extra=jnp.ones((4, 1)))
    assert seen == {"table": (E * 4, 7), "extra": (4, 1)}
    with pytest.raises(ValueError, match=r"`untiled` must hold positions >= 1"):
        ensembles.Ensemble(Probe(nnx.Rngs(0)), num_members=E, untiled=[0])
    with pytest.raises(TypeError, match=r"`untiled` must hold argument names"):
        ensembles.Ensemble(Probe(nnx.Rngs(0)), num_members=E, untiled=[1.5])


@pytest.mark.slow
def test_summary_names_everything_that_stayed_shared():
    decoder, _ = _model("decoder")
    info = ensembles.summary(
        ensembles.to_batch_ensemble(decoder, num_members=E, rngs=nnx.Rngs(1))
    )
    norms = {path: kind for path, kind, _ in info.shared_norms}
    assert norms == {
        "layers/pre_attention": "RMSNorm",
        "layers/pre_mlp": "RMSNorm",
        "final_norm": "RMSNorm",
    }
    assert ("embedder", "Embed", 11 * 8) in info.shared
    assert info.embeddings == ("embedder",)
    assert "tied to the output layer" in str(info)
    layer_types = {kind for _, kind, *_ in info.layers}
    assert layer_types == {"BatchEnsembleEinsum", "BatchEnsembleLinear"}
    # Stacked norms count every layer: 2 layers x 8 features.
    assert dict((p, n) for p, _, n in info.shared_norms)["layers/pre_mlp"] == 16

    vit, _ = _model("vit")
    info = ensembles.summary(
        ensembles.to_batch_ensemble(vit, num_members=E, rngs=nnx.Rngs(1))
    )
    assert ("cls_token", "Param", 8) in info.shared
    assert ("pos_embeddings", "Param", 5 * 8) in info.shared
    assert ("norm", "LayerNorm", 16) in info.shared_norms
    text = str(info)
    assert re.search(r"cls_token\s+Param\s+8\s+0\s+0", text)

    convnext, _ = _model("convnext")
    info = ensembles.summary(
        ensembles.to_batch_ensemble(convnext, num_members=E, rngs=nnx.Rngs(1))
    )
    assert ("blocks/0/gamma", "Param", 8) in info.shared
    assert ("blocks/1/gamma", "Param", 8) in info.shared
    total = sum(n for *_, n in info.shared) + sum(n for *_, n in info.shared_norms)
    kernels = sum(row[2] for row in info.layers)
    assert info.shared_params == total + kernels


@pytest.mark.slow
def test_member_norms_warn_about_norms_they_cannot_convert():
    decoder, _ = _model("decoder")
    with pytest.warns(UserWarning, match=r"left these norm-like modules shared") as w:
        ensembles.to_batch_ensemble(
            decoder, num_members=E, rngs=nnx.Rngs(1), norms="member"
        )
    message = str(w[0].message)
    for path in ("layers/pre_attention (RMSNorm)", "final_norm (RMSNorm)"):
        assert path in message
    vit, _ = _model("vit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Flax's LayerNorm converts: no warning
        ensembles.to_batch_ensemble(
            vit, num_members=E, rngs=nnx.Rngs(1), norms="member"
        )


def test_a_conversion_error_names_the_layer_path():
    class Upsample(nnx.Module):
        def __init__(self, rngs):
            self.convs = nnx.List(
                [nnx.Conv(3, 3, (3, 3), padding="SAME", input_dilation=2, rngs=rngs)]
            )

    with pytest.raises(
        ValueError,
        match=r"could not convert `convs/0` \(Conv, parameters \{.*'kernel': "
        r"\(3, 3, 3, 3\).*`padding='SAME'` is not defined with `input_dilation`",
    ):
        ensembles.to_batch_ensemble(
            Upsample(nnx.Rngs(0)), num_members=E, rngs=nnx.Rngs(1)
        )


def _flat_params(module):
    return {
        "/".join(map(str, path)): np.array(variable[...])
        for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param))
    }


@pytest.mark.parametrize("name", NAMES)
def test_a_train_step_moves_fast_and_shared_weights(name):
    model, inputs = _model(name)
    converted = ensembles.to_batch_ensemble(model, num_members=E, rngs=nnx.Rngs(1))
    converted.train()
    ensemble = ensembles.Ensemble(converted, num_members=E)
    optimizer = nnx.Optimizer(ensemble, optax.adam(1e-2), wrt=nnx.Param)
    before = _flat_params(ensemble)

    @nnx.jit
    def step(ensemble, optimizer, inputs):
        def loss_fn(ensemble):
            logits = ensemble(*inputs)
            labels = jnp.zeros(logits.shape[1:-1], jnp.int32).reshape(-1)
            flat = logits.reshape(E, -1, logits.shape[-1])
            return ensembles.training.cross_entropy(flat, labels, num_members=E)

        loss, grads = nnx.value_and_grad(loss_fn)(ensemble)
        optimizer.update(ensemble, grads)
        return loss

    loss = step(ensemble, optimizer, inputs)
    assert np.isfinite(float(loss))
    after = _flat_params(ensemble)
    moved = {p for p, v in before.items() if not np.allclose(v, after[p])}
    assert any(p.endswith("/r") for p in moved), moved
    assert any(p.endswith("/kernel") for p in moved), moved
    assert any(
        isinstance(n, (BatchEnsembleLinear, BatchEnsembleEinsum))
        for _, n in nnx.iter_graph(converted)
    )
