"""A small transformer classifier, for ``ensembles-bench --model`` (own-model costs).

Two pre-norm blocks (``nnx.MultiHeadAttention``, 4 heads, and a 4x MLP) over
``[B, 16, 64]`` token features, mean-pooled into 10 classes::

    ensembles-bench --model benchmarks.small_transformer:small_transformer \\
        --input-shape 16,64 --members 4,8
"""

from flax import nnx

WIDTH, HEADS, DEPTH, CLASSES = 64, 4, 2, 10


class Block(nnx.Module):
    """Attention, then an MLP, each behind a LayerNorm and a residual."""

    def __init__(self, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.hidden = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.out = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.out(nnx.gelu(self.hidden(self.mlp_norm(x))))


class SmallTransformer(nnx.Module):
    """Token features ``[B, T, 64]`` -> class logits ``[B, 10]``."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(DEPTH)])
        self.head = nnx.Linear(WIDTH, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=1))


def small_transformer(rngs: nnx.Rngs) -> nnx.Module:
    """The factory ``ensembles-bench --model`` calls."""
    return SmallTransformer(rngs)
