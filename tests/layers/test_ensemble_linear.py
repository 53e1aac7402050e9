"""EnsembleLinear: a kernel and bias of its own per member (TabM's heads).

Against a per-member loop of ``nnx.Linear`` layers holding each member's
kernel and bias: forward and gradients, every rank, float32 and bfloat16,
eager and jit; the member view and extraction; conversion
(``from_linear``, ``to_batch_ensemble(independent=...)``); errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from ensembles.ops import ensemble_dense
from tests.tolerances import assert_close

E, B, IN, OUT = 3, 4, 5, 2


def _member_linear(layer, k):
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
    linear.kernel[...] = layer.kernel[k]
    linear.bias[...] = layer.bias[k]
    return linear


def _reference(layer, x):
    """Member k's rows through an nnx.Linear holding kernel[k] and bias[k]."""
    rows = x.reshape(E, -1, *x.shape[1:])
    outs = [_member_linear(layer, k)(rows[k]) for k in range(E)]
    return jnp.concatenate(outs)


@pytest.mark.parametrize("middle", [(), (3,), (2, 3)], ids=["rank2", "rank3", "rank4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_matches_a_loop_of_linear_layers(middle, dtype, jit):
    layer = ensembles.EnsembleLinear(
        IN, OUT, num_members=E, param_dtype=dtype, rngs=nnx.Rngs(1)
    )
    layer.bias[...] = jax.random.normal(jax.random.key(2), (E, OUT), dtype)
    x = jax.random.normal(jax.random.key(3), (E * B, *middle, IN), dtype)
    call = nnx.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    y = call(layer, x)
    assert y.shape == (E * B, *middle, OUT) and y.dtype == dtype
    assert_close(y, _reference(layer, x), dtype, scale=4)


def test_gradients_match_the_loop():
    layer = ensembles.EnsembleLinear(IN, OUT, num_members=E, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(3), (E * B, IN))
    cotangent = jax.random.normal(jax.random.key(4), (E * B, OUT))

    def loss(kernel, bias, x):
        y = ensemble_dense(x, kernel, bias, num_members=E)
        return jnp.sum(y * cotangent)

    def reference(kernel, bias, x):
        rows = x.reshape(E, B, IN)
        y = jnp.concatenate([rows[k] @ kernel[k] + bias[k][None] for k in range(E)])
        return jnp.sum(y * cotangent)

    args = (layer.kernel[...], layer.bias[...], x)
    for mine, theirs in zip(
        jax.jit(jax.grad(loss, (0, 1, 2)))(*args),
        jax.grad(reference, (0, 1, 2))(*args),
        strict=True,
    ):
        assert_close(mine, theirs, jnp.float32)


def test_each_member_is_initialised_as_one_linear_layer():
    """Drawn per member: the kernels' spread is nnx.Linear's (fan-in = in),
    not one shrunk by counting the member axis, and the members differ."""
    layer = ensembles.EnsembleLinear(400, 300, num_members=4, rngs=nnx.Rngs(0))
    linear = nnx.Linear(400, 300, rngs=nnx.Rngs(0))
    kernel = np.asarray(layer.kernel[...])
    np.testing.assert_allclose(
        kernel.std(), np.asarray(linear.kernel[...]).std(), rtol=0.02
    )
    assert not np.allclose(kernel[0], kernel[1])
    assert np.all(np.asarray(layer.bias[...]) == 0)


def test_member_view_and_extraction():
    layer = ensembles.EnsembleLinear(IN, OUT, num_members=E, rngs=nnx.Rngs(1))
    layer.bias[...] = jnp.arange(E * OUT, dtype=jnp.float32).reshape(E, OUT)
    x = jax.random.normal(jax.random.key(3), (B, IN))
    for k in range(E):
        expected = _member_linear(layer, k)(x)
        assert_close(nnx.view(layer, member=k)(x), expected, jnp.float32)
        assert_close(nnx.view(layer, member=k)(x[0]), expected[0], jnp.float32)
        extracted = layer.extract_member(k)
        assert type(extracted) is nnx.Linear
        assert_close(extracted(x), expected, jnp.float32)


def test_from_linear_copies_or_draws_afresh():
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
    linear.bias[...] = jnp.ones(OUT)
    x = jax.random.normal(jax.random.key(3), (B, IN))
    copied = ensembles.EnsembleLinear.from_linear(
        linear, num_members=E, rngs=nnx.Rngs(1)
    )
    for k in range(E):
        assert_close(nnx.view(copied, member=k)(x), linear(x), jnp.float32)
    fresh = ensembles.EnsembleLinear.from_linear(
        linear, num_members=E, rngs=nnx.Rngs(1),
        kernel_init=nnx.initializers.lecun_normal(),
    )  # fmt: skip
    assert not np.allclose(fresh.kernel[0], fresh.kernel[1])
    assert not np.allclose(fresh.kernel[0], linear.kernel[...])
    assert np.all(np.asarray(fresh.bias[...]) == 0)
    np.testing.assert_array_equal(linear.bias[...], np.ones(OUT))  # untouched


class Model(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(IN, 8, rngs=rngs)
        self.conv = nnx.Conv(1, 1, (1,), rngs=rngs)
        self.head = nnx.Linear(8, OUT, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.body(x)))


def test_to_batch_ensemble_makes_the_head_independent():
    model = Model(nnx.Rngs(0))
    converted = ensembles.to_batch_ensemble(
        model, num_members=E, rngs=nnx.Rngs(1),
        independent=lambda path, node: path[-1] == "head",
    )  # fmt: skip
    assert type(converted.head) is ensembles.EnsembleLinear
    assert type(converted.body) is ensembles.BatchEnsembleLinear
    # The input layer (the body) still gets random signs as its r.
    assert set(np.unique(np.asarray(converted.body.r[...]))) <= {-1.0, 1.0}
    x = jax.random.normal(jax.random.key(3), (B, IN))
    np.testing.assert_allclose(
        converted.head.kernel[1], model.head.kernel[...], rtol=1e-6
    )  # copied: an exact conversion, member by member
    member = ensembles.extract_member(converted, 2)
    assert type(member.head) is nnx.Linear
    assert_close(member(x), nnx.view(converted, member=2)(x), jnp.float32, scale=4)
    info = ensembles.summary(converted)
    head = next(row for row in info.layers if row[0] == "head")
    assert head[2:] == (0, 0, E * (8 * OUT + OUT))  # all per member


@pytest.mark.parametrize(
    "independent, match",
    [
        (
            lambda path, node: path[-1] == "conv",
            "selects layers that are not nnx.Linear",
        ),
        (lambda path, node: path[-1] == "nothing", "selects none of the layers"),
    ],
)
def test_independent_selects_linear_layers_or_says_why(independent, match):
    model = Model(nnx.Rngs(0))
    rngs = nnx.Rngs(1)
    before = nnx.state(rngs)
    with pytest.raises(ValueError, match=match):
        ensembles.to_batch_ensemble(
            model, num_members=E, rngs=rngs, independent=independent
        )
    assert type(model.head) is nnx.Linear
    assert jax.tree.all(
        jax.tree.map(lambda a, b: bool(jnp.all(a == b)), before, nnx.state(rngs))
    )


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ensembles.EnsembleLinear(0, 2, num_members=2, rngs=nnx.Rngs(0)),
         ValueError, "`in_features`"),
        (lambda: ensembles.EnsembleLinear(3, 2, num_members=0, rngs=nnx.Rngs(0)),
         ValueError, "`num_members`"),
        (lambda: ensembles.EnsembleLinear(
            3, 2, num_members=2, kernel_init=3, rngs=nnx.Rngs(0)),
         TypeError, "`kernel_init`"),
        (lambda: ensembles.EnsembleLinear.from_linear(
            nnx.Conv(1, 1, (1,), rngs=nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(0)),
         TypeError, "`linear` must be an `nnx.Linear`"),
        (lambda: ensemble_dense(jnp.ones((5, 3)), jnp.ones((2, 3, 4)), num_members=2),
         ValueError, r"`inputs.shape\[0\]` \(=5\) must be a multiple"),
        (lambda: ensemble_dense(jnp.ones((4, 3)), jnp.ones((3, 3, 4)), num_members=2),
         ValueError, "`kernel` must have shape"),
        (lambda: ensemble_dense(jnp.ones((4, 3)), jnp.ones((2, 3, 4)), jnp.ones(4),
                                num_members=2), ValueError, "`bias` must have shape"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()
