import os

# Compiling is most of what this suite costs: thousands of small XLA programs,
# each run a few times on arrays of a few dozen elements. XLA's CPU backend
# compiles them about a fifth faster with LLVM's optimisation level 0. The
# results stay IEEE arithmetic (XLA asks LLVM for no fast-math at any level);
# what changes is that LLVM then forms no fused multiply-adds, so a value can
# differ from an optimised build in its last bit, far inside every tolerance
# of tests/tolerances.py. An XLA_FLAGS that sets the level itself wins, e.g.
# XLA_FLAGS=--xla_backend_optimization_level=2 to test XLA's default. (Set
# before jax creates its CPU backend, which reads XLA_FLAGS once.)
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
    ).strip()

import jax
import pytest

# Implicit rank promotion hides shape bugs (an [E, out] bias silently broadcast
# against [E*B, out] outputs, say): make it an error everywhere in the tests.
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _rank_promotion_raise():
    with jax.numpy_rank_promotion("raise"):
        yield


@pytest.fixture
def x64():
    """Enables float64 for one test (and restores the setting)."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)
