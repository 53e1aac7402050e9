"""The GPU kernel family: Triton kernels through ``pallas_call``.

All grid programs of a Triton kernel run in parallel, so every reduction is a
``lax.fori_loop`` inside the kernel over ``pl.ds`` windows of a block that
spans the whole reduction axis. Operands arrive padded (:mod:`.blocks`): every
block tiles its array, no load or store needs a mask. Off a GPU this family
runs in Pallas' interpreter (tests, debugging).

With ``z = (x * r) @ W`` and ``y = z * s + bias`` for member ``k``, the kernels
compute::

    forward:      y = ((x * r[k]) @ W) * s[k] + bias[k]
    input grad:   dxr = (g * s[k]) @ W.T;  dx = dxr * r[k];  dr[k] = sum_rows x * dxr
    kernel grad:  G_k = (x_k * r[k]).T @ g_k;  dW = sum_k G_k * s[k]
                  ds[k] = sum_in W * G_k

A first layer (inputs without a derivative) runs no input-gradient kernel: the
kernel-gradient kernel reduces the unscaled ``M_k = x_k.T @ g_k`` instead and
reads ``dr[k] = sum_out W * M_k * s[k]`` off it beside ``G_k = M_k * r[k]``
(``r`` as a column scaling the tile's rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ensembles.experimental.pallas.blocks import Tiling, exact_block_spec, num_blocks
from ensembles.experimental.pallas.common import (
    NN,
    NT,
    TN,
    KernelConfig,
    Wanted,
    dot,
)

__all__ = ["backward", "forward"]

# Not tuned: docs/fused_kernel.md has what was measured on an H100.
_COMPILER_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=3)


def _options(config: KernelConfig) -> dict:
    compiled = config.interpret is False
    return {
        "interpret": config.interpret,
        "compiler_params": _COMPILER_PARAMS if compiled else None,
    }


def _forward_kernel(x_ref, w_ref, r_ref, s_ref, *rest, blocks, steps, precision):
    # Grid (member, row block, out block). x_ref (bm, in), w_ref (in, bn),
    # r_ref (1, in), s_ref and the bias (1, bn).
    *bias_ref, o_ref = rest
    block_k = blocks.block_k

    def step(k, acc):
        window = pl.ds(k * block_k, block_k)
        scaled = x_ref[:, window] * r_ref[:, window]
        return acc + dot(scaled, w_ref[window, :], NN, precision)

    acc = jnp.zeros((blocks.block_m, blocks.block_n), jnp.float32)
    y = lax.fori_loop(0, steps, step, acc) * s_ref[...].astype(jnp.float32)
    if bias_ref:
        y = y + bias_ref[0][...].astype(jnp.float32)
    o_ref[...] = y.astype(o_ref.dtype)


def forward(x3, w, r3, s3, bias3, tiling: Tiling, config: KernelConfig):
    """``[E, R, in]`` -> ``[E, R, out]`` on padded operands (``r3``: ``[E, 1, in]``)."""
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    blocks = tiling.forward
    bm, bn = blocks.block_m, blocks.block_n
    vectors = [s3] + ([] if bias3 is None else [bias3])
    kernel = functools.partial(
        _forward_kernel,
        blocks=blocks,
        steps=num_blocks(in_features, blocks.block_k),
        precision=config.precision,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(
            (num_members, rows, out_features), config.out_dtype
        ),
        grid=(num_members, num_blocks(rows, bm), num_blocks(out_features, bn)),
        in_specs=[
            exact_block_spec(
                x3.shape, (None, bm, in_features), lambda e, i, j: (e, i, 0)
            ),
            exact_block_spec(w.shape, (in_features, bn), lambda e, i, j: (0, j)),
            exact_block_spec(
                r3.shape, (None, 1, in_features), lambda e, i, j: (e, 0, 0)
            ),
        ]
        + [
            exact_block_spec(v.shape, (None, 1, bn), lambda e, i, j: (e, 0, j))
            for v in vectors
        ],
        out_specs=exact_block_spec(
            (num_members, rows, out_features), (None, bm, bn), lambda e, i, j: (e, i, j)
        ),
        name="batch_ensemble_dense_fwd",
        **_options(config),
    )(x3, w, r3, *vectors)


def _dx_kernel(
    g_ref, w_ref, s_ref, r_ref, x_ref, dx_ref, dr_ref, *, blocks, steps, precision
):
    # Grid (member, row block, in block); loop over out. g_ref (bm, out),
    # w_ref (bn, out), s_ref (1, out), r_ref (1, bn), x_ref (bm, bn).
    block_k = blocks.block_k

    def step(k, acc):
        window = pl.ds(k * block_k, block_k)
        scaled = g_ref[:, window].astype(jnp.float32) * s_ref[:, window].astype(
            jnp.float32
        )
        return acc + dot(scaled.astype(x_ref.dtype), w_ref[:, window], NT, precision)

    acc = jnp.zeros((blocks.block_m, blocks.block_n), jnp.float32)
    dxr = lax.fori_loop(0, steps, step, acc)
    dx_ref[...] = (dxr * r_ref[...].astype(jnp.float32)).astype(dx_ref.dtype)
    dr_ref[...] = jnp.sum(x_ref[...].astype(jnp.float32) * dxr, axis=0, keepdims=True)


def _input_grad(x3, w, r3, s3, g3, tiling: Tiling, config: KernelConfig):
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    blocks = tiling.input_grad
    bm, bn = blocks.block_m, blocks.block_n
    num_row_blocks = num_blocks(rows, bm)
    dr_shape = (num_members, num_row_blocks, 1, in_features)
    kernel = functools.partial(
        _dx_kernel,
        blocks=blocks,
        steps=num_blocks(out_features, blocks.block_k),
        precision=config.precision,
    )
    dx3, dr_parts = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(x3.shape, x3.dtype),
            jax.ShapeDtypeStruct(dr_shape, jnp.float32),
        ),
        grid=(num_members, num_row_blocks, num_blocks(in_features, bn)),
        in_specs=[
            exact_block_spec(
                g3.shape, (None, bm, out_features), lambda e, i, j: (e, i, 0)
            ),
            exact_block_spec(w.shape, (bn, out_features), lambda e, i, j: (j, 0)),
            exact_block_spec(
                s3.shape, (None, 1, out_features), lambda e, i, j: (e, 0, 0)
            ),
            exact_block_spec(r3.shape, (None, 1, bn), lambda e, i, j: (e, 0, j)),
            exact_block_spec(x3.shape, (None, bm, bn), lambda e, i, j: (e, i, j)),
        ],
        out_specs=(
            exact_block_spec(x3.shape, (None, bm, bn), lambda e, i, j: (e, i, j)),
            exact_block_spec(
                dr_shape, (None, None, 1, bn), lambda e, i, j: (e, i, 0, j)
            ),
        ),
        name="batch_ensemble_dense_dx",
        **_options(config),
    )(g3, w, s3, r3, x3)
    return dx3, jnp.sum(dr_parts, axis=(1, 2))


def _dw_kernel(
    x_ref,
    g_ref,
    r_ref,
    s_ref,
    w_ref,
    dw_ref,
    ds_ref,
    *dr_refs,
    blocks,
    steps,
    num_members,
    precision,
):
    # Grid (in block, out block); loops over members and their rows.
    # x_ref (E, R, bm), g_ref (E, R, bn), s_ref (E, 1, bn), w_ref (bm, bn);
    # ds_ref (E, 1, bn) holds this in block's partial ds. A hidden layer:
    # r_ref (E, 1, bm), scaling x as it loads. A first layer (dr_ref, (E, bm,
    # 1): this out block's partial dr): r_ref (E, bm, 1) scales the unscaled
    # tile M_k = x_k^T g_k after it is reduced, since dr needs M_k itself.
    dr_ref = dr_refs[0] if dr_refs else None
    block_k = blocks.block_k
    tile = (blocks.block_m, blocks.block_n)
    w = w_ref[...].astype(jnp.float32)

    def member_step(member, dw):
        def row_step(i, acc):
            window = pl.ds(i * block_k, block_k)
            x = x_ref[member, window, :]
            if dr_ref is None:
                x = (x * r_ref[member]).astype(x_ref.dtype)
            return acc + dot(x, g_ref[member, window, :], TN, precision)

        grad = lax.fori_loop(0, steps, row_step, jnp.zeros(tile, jnp.float32))
        s = s_ref[member].astype(jnp.float32)
        if dr_ref is not None:
            dr_ref[member] = jnp.sum(w * grad * s, axis=1, keepdims=True)
            grad = grad * r_ref[member].astype(jnp.float32)
        ds_ref[member] = jnp.sum(w * grad, axis=0, keepdims=True)
        return dw + grad * s

    dw = lax.fori_loop(0, num_members, member_step, jnp.zeros(tile, jnp.float32))
    dw_ref[...] = dw.astype(dw_ref.dtype)


def _kernel_grad(x3, w, r3, s3, g3, tiling: Tiling, config: KernelConfig, with_dr):
    """``(dW, ds, dr)``; ``dr`` (``None`` unless ``with_dr``) from the same tiles."""
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    blocks = tiling.kernel_grad
    bm, bn = blocks.block_m, blocks.block_n
    num_in_blocks = num_blocks(in_features, bm)
    num_out_blocks = num_blocks(out_features, bn)
    ds_shape = (num_in_blocks, num_members, 1, out_features)
    dr_shape = (num_out_blocks, num_members, in_features, 1)
    if with_dr:  # r as a column: it scales the rows of each member's tile
        r3 = r3.reshape(num_members, in_features, 1)
        r_spec = exact_block_spec(
            r3.shape, (num_members, bm, 1), lambda i, j: (0, i, 0)
        )
    else:
        r_spec = exact_block_spec(
            r3.shape, (num_members, 1, bm), lambda i, j: (0, 0, i)
        )
    kernel = functools.partial(
        _dw_kernel,
        blocks=blocks,
        steps=num_blocks(rows, blocks.block_k),
        num_members=num_members,
        precision=config.precision,
    )
    out_shape = [
        jax.ShapeDtypeStruct(w.shape, w.dtype),
        jax.ShapeDtypeStruct(ds_shape, jnp.float32),
    ]
    out_specs = [
        exact_block_spec(w.shape, (bm, bn), lambda i, j: (i, j)),
        exact_block_spec(
            ds_shape, (None, num_members, 1, bn), lambda i, j: (i, 0, 0, j)
        ),
    ]
    if with_dr:
        out_shape.append(jax.ShapeDtypeStruct(dr_shape, jnp.float32))
        out_specs.append(
            exact_block_spec(
                dr_shape, (None, num_members, bm, 1), lambda i, j: (j, 0, i, 0)
            )
        )
    dw, ds_parts, *dr_parts = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(num_in_blocks, num_out_blocks),
        in_specs=[
            exact_block_spec(x3.shape, (num_members, rows, bm), lambda i, j: (0, 0, i)),
            exact_block_spec(g3.shape, (num_members, rows, bn), lambda i, j: (0, 0, j)),
            r_spec,
            exact_block_spec(s3.shape, (num_members, 1, bn), lambda i, j: (0, 0, j)),
            exact_block_spec(w.shape, (bm, bn), lambda i, j: (i, j)),
        ],
        out_specs=tuple(out_specs),
        name="batch_ensemble_dense_dw",
        **_options(config),
    )(x3, g3, r3, s3, w)
    dr = jnp.sum(dr_parts[0], axis=(0, 3)) if with_dr else None
    return dw, jnp.sum(ds_parts, axis=(0, 2)), dr


def backward(x3, w, r3, s3, g3, tiling: Tiling, config: KernelConfig, wanted: Wanted):
    """``(dx3, dW, dr, ds)`` on padded operands; ``dr``, ``ds`` in float32.

    A gradient ``wanted`` does not ask for is ``None``, and a kernel that
    would form only those does not run: without ``wanted.inputs`` (a first
    layer) the input-gradient kernel does not run and ``dr`` comes from the
    kernel-gradient kernel's tiles.
    """
    dx3 = dw = dr = ds = None
    if wanted.inputs:
        dx3, dr = _input_grad(x3, w, r3, s3, g3, tiling, config)
    if wanted.params:
        dw, ds, tiles_dr = _kernel_grad(
            x3, w, r3, s3, g3, tiling, config, with_dr=not wanted.inputs
        )
        dr = dr if wanted.inputs else tiles_dr
    else:
        dr = None
    return dx3, dw, dr, ds
