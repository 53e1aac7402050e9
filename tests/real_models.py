"""Models in the styles real NNX code is written in (not a test module).

Written here after reading how Flax's examples and jax-ml/bonsai build their
models, none copied: layers stacked with ``nnx.vmap`` and applied with
``nnx.scan``; a decoder with Einsum projections, RoPE on a ``positions``
argument, a mask argument, its own RMSNorm class and a tied embedding used as
the output layer (``Embed.attend``); a ViT with raw ``cls_token`` /
``pos_embeddings`` parameters; a ConvNeXt block with a depthwise convolution
and a layer-scale ``gamma``.
"""

import jax
import jax.numpy as jnp
from flax import nnx

# Drawn with jax.random: numpy initializers cannot run under nnx.vmap.
KERNEL = nnx.initializers.normal(0.3)


class Block(nnx.Module):
    """Linear, BatchNorm, Dropout: the block of Flax's scan-over-layers MLP."""

    def __init__(self, dim, rngs):
        self.linear = nnx.Linear(dim, dim, kernel_init=KERNEL, rngs=rngs)
        self.norm = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return jax.nn.gelu(self.dropout(self.norm(self.linear(x))))


class ScanMLP(nnx.Module):
    """Blocks built once under nnx.vmap, applied with nnx.scan."""

    def __init__(self, rngs, dim=8, num_layers=3, num_classes=3):
        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(axis_size=num_layers)
        def make_blocks(rngs):
            return Block(dim, rngs)

        self.embed = nnx.Linear(4, dim, kernel_init=KERNEL, rngs=rngs)
        self.blocks = make_blocks(rngs)
        self.head = nnx.Linear(dim, num_classes, kernel_init=KERNEL, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return self.head(run(self.embed(x), self.blocks))


class RMSNorm(nnx.Module):
    """A model's own RMSNorm (as Gemma's and Mamba2's are), scale around 1."""

    def __init__(self, dim, rngs):
        del rngs
        self.scale = nnx.Param(jnp.zeros((dim,)))

    def __call__(self, x):
        variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(variance + 1e-6) * (1 + self.scale[...])


def rope(x, positions, base=10_000.0):
    """Rotary embedding of ``x [B, T, H, D]`` at integer ``positions [B, T]``."""
    half = x.shape[-1] // 2
    frequencies = base ** (-jnp.arange(half) / half)
    angles = positions[..., None, None] * frequencies  # [B, T, 1, half]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate(
        [first * cos - second * sin, second * cos + first * sin], axis=-1
    )


class Attention(nnx.Module):
    def __init__(self, dim, heads, rngs):
        head_dim = dim // heads
        self.q = nnx.Einsum(
            "BTD,DNH->BTNH", (dim, heads, head_dim), rngs=rngs, kernel_init=KERNEL
        )
        self.kv = nnx.Einsum(
            "BSD,CDKH->CBSKH", (2, dim, heads, head_dim), rngs=rngs, kernel_init=KERNEL
        )
        self.out = nnx.Einsum(
            "BTNH,NHD->BTD", (heads, head_dim, dim), rngs=rngs, kernel_init=KERNEL
        )

    def __call__(self, x, positions, mask):
        q = rope(self.q(x), positions)
        k, v = self.kv(x)
        k = rope(k, positions)
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / jnp.sqrt(q.shape[-1])
        logits = jnp.where(mask, logits, -1e9)
        return self.out(jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits), v))


class DecoderLayer(nnx.Module):
    def __init__(self, dim, heads, rngs):
        self.pre_attention = RMSNorm(dim, rngs)
        self.attention = Attention(dim, heads, rngs)
        self.pre_mlp = RMSNorm(dim, rngs)
        self.gate = nnx.Linear(
            dim, 2 * dim, use_bias=False, kernel_init=KERNEL, rngs=rngs
        )
        self.up = nnx.Linear(
            dim, 2 * dim, use_bias=False, kernel_init=KERNEL, rngs=rngs
        )
        self.down = nnx.Linear(
            2 * dim, dim, use_bias=False, kernel_init=KERNEL, rngs=rngs
        )

    def __call__(self, x, positions, mask):
        x = x + self.attention(self.pre_attention(x), positions, mask)
        h = self.pre_mlp(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Decoder(nnx.Module):
    """A Gemma/Qwen-style decoder LM: ``model(tokens, positions, mask)``."""

    def __init__(self, rngs, vocab=11, dim=8, heads=2, num_layers=2):
        self.embedder = nnx.Embed(vocab, dim, rngs=rngs)

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(axis_size=num_layers)
        def make_layers(rngs):
            return DecoderLayer(dim, heads, rngs)

        self.layers = make_layers(rngs)
        self.final_norm = RMSNorm(dim, rngs)

    def __call__(self, tokens, positions, mask):
        @nnx.scan(in_axes=(nnx.Carry, 0, None, None), out_axes=nnx.Carry)
        def run(x, layer, positions, mask):
            return layer(x, positions, mask)

        x = run(self.embedder(tokens), self.layers, positions, mask)
        return self.embedder.attend(self.final_norm(x))  # tied output layer


def decoder_inputs(batch=3, length=5, vocab=11, seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    causal = jnp.tril(jnp.ones((length, length), bool))
    mask = jnp.broadcast_to(causal, (batch, 1, length, length))
    return tokens, positions, mask


class ViT(nnx.Module):
    """Patches, a class token and position embeddings held as raw Params."""

    def __init__(self, rngs, dim=8, patch=4, image=8, num_classes=3):
        self.patches = nnx.Conv(
            3,
            dim,
            (patch, patch),
            strides=patch,
            padding="VALID",
            kernel_init=KERNEL,
            rngs=rngs,
        )
        num_patches = (image // patch) ** 2
        self.cls_token = nnx.Param(jnp.zeros((1, 1, dim)))
        self.pos_embeddings = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (1, num_patches + 1, dim))
        )
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            2, dim, decode=False, deterministic=True, kernel_init=KERNEL, rngs=rngs
        )
        self.head = nnx.Linear(dim, num_classes, kernel_init=KERNEL, rngs=rngs)

    def __call__(self, images):
        x = self.patches(images)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        cls = jnp.broadcast_to(self.cls_token[...], (x.shape[0], 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.pos_embeddings[...]
        x = x + self.attention(self.norm(x))
        return self.head(x[:, 0])


class ConvNeXtBlock(nnx.Module):
    """Depthwise conv, LayerNorm, inverted MLP, layer-scale ``gamma``."""

    def __init__(self, rngs, dim=8):
        self.depthwise = nnx.Conv(
            dim, dim, (3, 3), feature_group_count=dim, kernel_init=KERNEL, rngs=rngs
        )
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, kernel_init=KERNEL, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, kernel_init=KERNEL, rngs=rngs)
        self.gamma = nnx.Param(jnp.full((dim,), 0.5))

    def __call__(self, x):
        h = self.down(jax.nn.gelu(self.up(self.norm(self.depthwise(x)))))
        return x + self.gamma[...] * h


class ConvNeXt(nnx.Module):
    def __init__(self, rngs, dim=8, num_classes=3):
        self.stem = nnx.Conv(3, dim, (2, 2), strides=2, kernel_init=KERNEL, rngs=rngs)
        self.blocks = nnx.List([ConvNeXtBlock(rngs, dim) for _ in range(2)])
        self.head = nnx.Linear(dim, num_classes, kernel_init=KERNEL, rngs=rngs)

    def __call__(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))
