import jax
import pytest

# Implicit rank promotion hides shape bugs (an [E, out] bias silently broadcast
# against [E*B, out] outputs, say): make it an error everywhere in the tests.
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _rank_promotion_raise():
    with jax.numpy_rank_promotion("raise"):
        yield
