"""Tests of ``ensembles.training``: the recipe's loss and per-member batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ensembles
from ensembles.training import cross_entropy, member_batches
from tests.tolerances import assert_close

E, B, C = 3, 5, 4


def _reference(logits, labels):
    """Mean over members of each member's mean cross entropy, in float64 numpy."""
    logits = np.asarray(logits).astype(np.float64)
    labels = np.asarray(labels)
    if labels.shape[0] != logits.shape[0]:  # a tiled batch's labels
        labels = np.concatenate([labels] * E)
    member_means = []
    for k in range(E):
        rows = slice(k * B, (k + 1) * B)
        z = logits[rows]
        log_probs = z - z.max(-1, keepdims=True)
        log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
        member_means.append(-log_probs[np.arange(B), labels[rows]].mean())
    return np.mean(member_means)


def _draw(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(3 * rng.standard_normal((E * B, C)), dtype)
    return logits, rng.integers(0, C, B), rng.integers(0, C, E * B)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("layout", ["tiled", "member_major"])
def test_cross_entropy_is_the_mean_of_member_losses(dtype, jit, layout):
    logits, tiled, member_major = _draw(dtype)
    labels = tiled if layout == "tiled" else member_major
    fn = jax.jit(cross_entropy, static_argnames="num_members") if jit else cross_entropy
    loss = fn(logits, labels, num_members=E)
    assert loss.shape == () and loss.dtype == jnp.float32  # at least float32
    assert_close(loss, _reference(logits, labels), dtype=jnp.float32)


def test_cross_entropy_float64(x64):
    logits, tiled, _ = _draw(jnp.float64)
    loss = cross_entropy(logits, tiled, num_members=E)
    assert loss.dtype == jnp.float64
    np.testing.assert_allclose(loss, _reference(logits, tiled), rtol=1e-12)


def test_cross_entropy_tiled_labels_equal_explicitly_tiled_ones():
    logits, tiled, _ = _draw()
    assert cross_entropy(logits, tiled, num_members=E) == cross_entropy(
        logits, ensembles.tile(tiled, E), num_members=E
    )


def test_cross_entropy_of_ensemble_outputs_equals_member_major():
    # [E, B, C] from ensembles.Ensemble is the member-major batch untiled.
    logits, tiled, member_major = _draw()
    for labels in (tiled, member_major):
        assert cross_entropy(
            ensembles.untile(logits, E), labels, num_members=E
        ) == cross_entropy(logits, labels, num_members=E)


def test_cross_entropy_gradient_and_jvp_match_the_formula():
    logits, _, labels = _draw()

    def formula(z):
        log_probs = jax.nn.log_softmax(z.reshape(E, B, C), axis=-1)
        picked = jnp.take_along_axis(log_probs, labels.reshape(E, B, 1), -1)
        return -picked[..., 0].mean(axis=1).mean()

    def loss(z):
        return cross_entropy(z, labels, num_members=E)

    assert_close(jax.grad(loss)(logits), jax.grad(formula)(logits))
    tangent = jnp.asarray(np.random.default_rng(1).standard_normal(logits.shape))
    assert_close(
        jax.jvp(loss, (logits,), (tangent,))[1],
        jax.jvp(formula, (logits,), (tangent,))[1],
    )
    # A member's rows get gradient only from its own loss: scaled 1/(E*B).
    grads = jax.grad(loss)(logits)
    probs = jax.nn.softmax(logits)
    expected = (probs - jax.nn.one_hot(labels, C)) / (E * B)
    assert_close(grads, expected)


def test_cross_entropy_with_one_member_is_the_usual_mean():
    logits, _, labels = _draw()
    expected = -jnp.mean(
        jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], -1)
    )
    assert_close(cross_entropy(logits, labels, num_members=1), expected)


@pytest.mark.parametrize("label", [C, C + 5, -1, -C])
def test_cross_entropy_out_of_range_label_is_nan_under_jit(label):
    logits, tiled, _ = _draw()
    bad = tiled.copy()
    bad[2] = label
    loss = jax.jit(cross_entropy, static_argnames="num_members")(
        logits, bad, num_members=E
    )
    assert np.isnan(loss)


@pytest.mark.parametrize(
    "logits_shape, labels, error, message",
    [
        ((E * B, C), np.zeros(B + 1, int), ValueError, "`labels` must have shape [B]"),
        ((E * B, C), np.zeros((B, 1), int), ValueError, "got shape (5, 1)"),
        ((E * B + 1, C), np.zeros(B, int), ValueError, "`logits.shape[0]` (=16)"),
        ((E + 1, B, C), np.zeros(B, int), ValueError, "must have E = num_members = 3"),
        (
            (E * B, C, 1, 1),
            np.zeros(B, int),
            ValueError,
            "[E, B, C], got shape (15, 4, 1, 1)",
        ),
        ((E * B, C), np.zeros(B), TypeError, "integer class indices, got dtype"),
        (
            (E * B, C),
            np.full(B, -1),
            ValueError,
            "in [0, C) = [0, 4), got labels[0] = -1",
        ),
    ],
)
def test_cross_entropy_bad_input(logits_shape, labels, error, message):
    with pytest.raises(error) as raised:
        cross_entropy(jnp.zeros(logits_shape), labels, num_members=E)
    assert message in str(raised.value)


def test_member_batches_are_independent_draws_without_replacement():
    indices = member_batches(jax.random.key(0), 50, batch_size=10, num_members=4)
    assert indices.shape == (40,) and indices.dtype == jnp.int32
    per_member = np.asarray(indices).reshape(4, 10)
    assert per_member.min() >= 0 and per_member.max() < 50
    for row in per_member:
        assert len(set(row.tolist())) == 10  # no repeat within a member
    # Members draw independently: not four copies of one batch.
    assert len({tuple(sorted(row.tolist())) for row in per_member}) == 4


def test_member_batches_deterministic_and_jittable():
    key = jax.random.key(3)
    eager = member_batches(key, 20, batch_size=5, num_members=2)
    jitted = jax.jit(
        member_batches, static_argnums=1, static_argnames=("batch_size", "num_members")
    )(key, 20, batch_size=5, num_members=2)
    np.testing.assert_array_equal(eager, jitted)
    other = member_batches(jax.random.key(4), 20, batch_size=5, num_members=2)
    assert not np.array_equal(eager, other)


def test_member_batches_cover_every_example_uniformly():
    # Over many draws every example is picked about equally often.
    keys = jax.random.split(jax.random.key(0), 400)
    draws = jax.vmap(lambda k: member_batches(k, 10, batch_size=3, num_members=2))(keys)
    counts = np.bincount(np.asarray(draws).ravel(), minlength=10)
    expected = 400 * 2 * 3 / 10
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"batch_size": 11}, ValueError, "`batch_size` (=11) must be at most"),
        ({"batch_size": 0}, ValueError, "`batch_size` must be an int >= 1, got 0"),
        ({"num_members": 0}, ValueError, "`num_members` must be an int >= 1"),
        ({"num_examples": 2.5}, TypeError, "`num_examples` must be an int >= 1"),
    ],
)
def test_member_batches_bad_input(kwargs, error, message):
    arguments = {"num_examples": 10, "batch_size": 3, "num_members": 2, **kwargs}
    num_examples = arguments.pop("num_examples")
    with pytest.raises(error) as raised:
        member_batches(jax.random.key(0), num_examples, **arguments)
    assert message in str(raised.value)
