"""Transformer classifiers, for ``ensembles-bench --model`` (own-model costs).

Two pre-norm blocks (``nnx.MultiHeadAttention`` and a 4x MLP) over ``[B, T,
width]`` token features, mean-pooled into 10 classes. ``small_transformer``:
width 64, 4 heads; ``transformer_512``: width 512, 8 heads (the size the
compiled-program benchmark reads at 128 tokens)::

    ensembles-bench --model benchmarks.small_transformer:small_transformer \\
        --input-shape 16,64 --members 4,8
    ensembles-bench --compiled-for h100 --mesh data=8 \\
        --model benchmarks.small_transformer:transformer_512 --input-shape 128,512
"""

from flax import nnx

DEPTH, CLASSES = 2, 10


class Block(nnx.Module):
    """Attention, then an MLP, each behind a LayerNorm and a residual."""

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(width, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
        self.hidden = nnx.Linear(width, 4 * width, rngs=rngs)
        self.out = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.out(nnx.gelu(self.hidden(self.mlp_norm(x))))


class Transformer(nnx.Module):
    """Token features ``[B, T, width]`` -> class logits ``[B, 10]``."""

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.embed = nnx.Linear(width, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, heads, rngs) for _ in range(DEPTH)])
        self.head = nnx.Linear(width, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=1))


def small_transformer(rngs: nnx.Rngs) -> nnx.Module:
    """Width 64, 4 heads: the factory ``ensembles-bench --model`` calls."""
    return Transformer(64, 4, rngs)


def transformer_512(rngs: nnx.Rngs) -> nnx.Module:
    """Width 512, 8 heads (``--input-shape 128,512`` for 128 tokens)."""
    return Transformer(512, 8, rngs)
