"""Models and helpers the whole-model tests share (not a test module)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ensembles import initializers
from tests.reference import numpy_normal

ONES = {"r_init": initializers.ones(), "s_init": initializers.ones()}
# The models' kernels, drawn with numpy (jax.random would compile per shape).
KERNEL = numpy_normal(0.3)


def random_input(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


class MLP(nnx.Module):
    """Attributes, an nnx.List, an nnx.Dict and one submodule used twice."""

    def __init__(self, rngs):
        self.inp = nnx.Linear(4, 8, kernel_init=KERNEL, rngs=rngs)
        self.blocks = nnx.List(
            [nnx.Linear(8, 8, kernel_init=KERNEL, rngs=rngs) for _ in range(2)]
        )
        self.shared = nnx.Linear(8, 8, kernel_init=KERNEL, rngs=rngs)
        self.heads = nnx.Dict(out=nnx.Linear(8, 3, kernel_init=KERNEL, rngs=rngs))

    def __call__(self, x):
        x = nnx.relu(self.inp(x))
        for block in self.blocks:
            x = nnx.relu(block(x))
        x = nnx.relu(self.shared(self.shared(x)))
        return self.heads["out"](x)


def count(model, kind):
    return sum(type(node) is kind for _, node in nnx.iter_graph(model))


def state_arrays(model):
    return jax.tree.map(np.array, nnx.state(model))


class CNN(nnx.Module):
    """Conv + BatchNorm + pooling + Linear head."""

    def __init__(self, rngs):
        self.conv1 = nnx.Conv(3, 8, (3, 3), kernel_init=KERNEL, rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (3, 3), strides=2, kernel_init=KERNEL, rngs=rngs)
        self.bn2 = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 5, kernel_init=KERNEL, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
        x = nnx.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(axis=(1, 2)))


class TransformerBlock(nnx.Module):
    """Pre-norm block: LayerNorm, MultiHeadAttention, LayerNorm, MLP."""

    def __init__(self, rngs, features=8, heads=2):
        self.norm1 = nnx.LayerNorm(features, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            heads,
            features,
            decode=False,
            deterministic=True,
            kernel_init=KERNEL,
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(features, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(features, 16, kernel_init=KERNEL, rngs=rngs),
            nnx.gelu,
            nnx.Linear(16, features, kernel_init=KERNEL, rngs=rngs),
        )

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


MODELS = {
    "cnn": (CNN, (4, 8, 8, 3)),
    "transformer": (TransformerBlock, (4, 5, 8)),
}


def trained_like(model):
    """Non-trivial norm statistics and biases, as a trained model would have."""
    rng = np.random.default_rng(42)
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.BatchStat)):
        variable[...] = jnp.asarray(rng.uniform(0.5, 1.5, variable.shape), jnp.float32)
    return model
