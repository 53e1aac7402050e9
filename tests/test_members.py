import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ensembles


@pytest.mark.parametrize("shape", [(3,), (3, 2), (3, 2, 4)])
@pytest.mark.parametrize("num_members", [1, 2, 5])
def test_tile_is_member_major(shape, num_members):
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    y = ensembles.tile(x, num_members)
    assert y.shape == (num_members * shape[0], *shape[1:])
    np.testing.assert_array_equal(y, np.concatenate([np.asarray(x)] * num_members))


@pytest.mark.parametrize("num_members", [1, 2, 5])
def test_untile_inverts_tile_and_keeps_member_rows(num_members):
    x = jnp.arange(12.0).reshape(num_members * 0 + 3, 4)
    y = ensembles.untile(ensembles.tile(x, num_members), num_members)
    assert y.shape == (num_members, 3, 4)
    for k in range(num_members):
        np.testing.assert_array_equal(y[k], x)
    rows = jnp.arange(2.0 * num_members)
    np.testing.assert_array_equal(
        ensembles.untile(rows, num_members), np.arange(2.0 * num_members).reshape(-1, 2)
    )


def test_tile_under_jit_and_grad():
    x = jnp.arange(6.0).reshape(3, 2)
    g = jax.grad(lambda x: jnp.sum(jax.jit(ensembles.tile, static_argnums=1)(x, 4)))(x)
    np.testing.assert_array_equal(g, 4.0)


def test_untile_rejects_non_multiple():
    with pytest.raises(
        ValueError,
        match=r"`y.shape\[0\]` \(=5\) must be a multiple "
        r"of `num_members` \(=2\)",
    ):
        ensembles.untile(jnp.ones((5, 3)), 2)


@pytest.mark.parametrize("fn", [ensembles.tile, ensembles.untile])
def test_reject_scalars_and_bad_members(fn):
    with pytest.raises(ValueError, match=r"must have a leading batch axis"):
        fn(jnp.float32(1.0), 2)
    with pytest.raises(ValueError, match=r"`num_members` must be an int >= 1, got 0"):
        fn(jnp.ones((2, 2)), 0)
    with pytest.raises(TypeError, match=r"`num_members` must be an int >= 1"):
        fn(jnp.ones((2, 2)), 2.0)
