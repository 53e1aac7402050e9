"""The TPU kernel family: Mosaic kernels through ``pallas_call``.

A TPU core runs the grid in order, so each reduction is the last grid axis
(``"arbitrary"``), accumulated in a float32 VMEM scratch and stored at its last
step. Operands arrive padded (:mod:`.blocks`): every block tiles its array, the
feature blocks fill whole 128-wide vector lanes, and no load, store or sum
needs a mask. The math is that of :mod:`.triton`. No TPU has run these kernels
yet: they are checked in Pallas' TPU simulator and by lowering for ``tpu``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

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


def _params(*semantics: str):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _matmul_options(config: KernelConfig) -> dict:
    # TPU v2/v3's Mosaic matmul takes float32 operands only (libtpu's E2001 on
    # a bfloat16 tile); the caller reads the chip (budget.Target).
    return {"precision": config.precision, "float32": config.float32_matmul}


def _forward_kernel(x_ref, w_ref, r_ref, s_ref, *rest, precision, float32):
    # Grid (member, row block, out block, in block); in is "arbitrary".
    *bias_ref, o_ref, acc_ref = rest
    k = pl.program_id(3)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += dot(x_ref[...] * r_ref[...], w_ref[...], NN, precision, float32)

    @pl.when(k == pl.num_programs(3) - 1)
    def _store():
        y = acc_ref[...] * s_ref[...].astype(jnp.float32)
        if bias_ref:
            y = y + bias_ref[0][...].astype(jnp.float32)
        o_ref[...] = y.astype(o_ref.dtype)


def forward(x3, w, r3, s3, bias3, tiling: Tiling, config: KernelConfig):
    """``[E, R, in]`` -> ``[E, R, out]`` on padded operands (``r3``: ``[E, 1, in]``)."""
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    blocks = tiling.forward
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    vectors = [s3] + ([] if bias3 is None else [bias3])
    out_shape = (num_members, rows, out_features)
    return pl.pallas_call(
        functools.partial(_forward_kernel, **_matmul_options(config)),
        out_shape=jax.ShapeDtypeStruct(out_shape, config.out_dtype),
        grid=(
            num_members,
            num_blocks(rows, bm),
            num_blocks(out_features, bn),
            num_blocks(in_features, bk),
        ),
        in_specs=[
            exact_block_spec(x3.shape, (None, bm, bk), lambda e, i, j, k: (e, i, k)),
            exact_block_spec(w.shape, (bk, bn), lambda e, i, j, k: (k, j)),
            exact_block_spec(r3.shape, (None, 1, bk), lambda e, i, j, k: (e, 0, k)),
        ]
        + [
            exact_block_spec(v.shape, (None, 1, bn), lambda e, i, j, k: (e, 0, j))
            for v in vectors
        ],
        out_specs=exact_block_spec(
            out_shape, (None, bm, bn), lambda e, i, j, k: (e, i, j)
        ),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=config.interpret,
        name="batch_ensemble_dense_fwd",
    )(x3, w, r3, *vectors)


def _dx_kernel(
    g_ref, w_ref, s_ref, r_ref, x_ref, dx_ref, dr_ref, acc_ref, *, precision, float32
):
    # Grid (member, row block, in block, out block); out is "arbitrary".
    k = pl.program_id(3)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    scaled = g_ref[...].astype(jnp.float32) * s_ref[...].astype(jnp.float32)
    scaled = scaled.astype(x_ref.dtype)
    acc_ref[...] += dot(scaled, w_ref[...], NT, precision, float32)

    @pl.when(k == pl.num_programs(3) - 1)
    def _store():
        dxr = acc_ref[...]
        dx_ref[...] = (dxr * r_ref[...].astype(jnp.float32)).astype(dx_ref.dtype)
        dr_ref[...] = jnp.sum(
            x_ref[...].astype(jnp.float32) * dxr, axis=0, keepdims=True
        )


def _input_grad(x3, w, r3, s3, g3, tiling: Tiling, config: KernelConfig):
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    blocks = tiling.input_grad
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    num_row_blocks = num_blocks(rows, bm)
    dr_shape = (num_members, num_row_blocks, 1, in_features)
    dx3, dr_parts = pl.pallas_call(
        functools.partial(_dx_kernel, **_matmul_options(config)),
        out_shape=(
            jax.ShapeDtypeStruct(x3.shape, x3.dtype),
            jax.ShapeDtypeStruct(dr_shape, jnp.float32),
        ),
        grid=(
            num_members,
            num_row_blocks,
            num_blocks(in_features, bn),
            num_blocks(out_features, bk),
        ),
        in_specs=[
            exact_block_spec(g3.shape, (None, bm, bk), lambda e, i, j, k: (e, i, k)),
            exact_block_spec(w.shape, (bn, bk), lambda e, i, j, k: (j, k)),
            exact_block_spec(s3.shape, (None, 1, bk), lambda e, i, j, k: (e, 0, k)),
            exact_block_spec(r3.shape, (None, 1, bn), lambda e, i, j, k: (e, 0, j)),
            exact_block_spec(x3.shape, (None, bm, bn), lambda e, i, j, k: (e, i, j)),
        ],
        out_specs=(
            exact_block_spec(x3.shape, (None, bm, bn), lambda e, i, j, k: (e, i, j)),
            exact_block_spec(
                dr_shape, (None, None, 1, bn), lambda e, i, j, k: (e, i, 0, j)
            ),
        ),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=config.interpret,
        name="batch_ensemble_dense_dx",
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
    *rest,
    precision,
    float32,
):
    # Grid (in block, out block, member, row block); the last two are
    # "arbitrary": dW accumulates over members, G_k over a member's row blocks.
    # A hidden layer: r_ref (1, bm) scales x as it loads. A first layer (a
    # dr_ref (bm, 1) among the outputs: this out block's partial dr): the
    # unscaled M_k = x_k^T g_k accumulates, r_ref (bm, 1) scales its rows.
    # Program ids are read at the top level: the interpreter cannot discharge
    # them inside a pl.when body.
    *dr_refs, dw_acc_ref, grad_acc_ref = rest
    dr_ref = dr_refs[0] if dr_refs else None
    member, i = pl.program_id(2), pl.program_id(3)
    last_member = member == pl.num_programs(2) - 1
    last_row_block = i == pl.num_programs(3) - 1

    @pl.when((member == 0) & (i == 0))
    def _init_dw():
        dw_acc_ref[...] = jnp.zeros_like(dw_acc_ref)

    @pl.when(i == 0)
    def _init_grad():
        grad_acc_ref[...] = jnp.zeros_like(grad_acc_ref)

    x = x_ref[...]
    if dr_ref is None:
        x = (x * r_ref[...]).astype(x_ref.dtype)
    grad_acc_ref[...] += dot(x, g_ref[...], TN, precision, float32)

    @pl.when(last_row_block)
    def _member_done():
        grad = grad_acc_ref[...]
        w = w_ref[...].astype(jnp.float32)
        s = s_ref[...].astype(jnp.float32)
        if dr_ref is not None:
            dr_ref[...] = jnp.sum(w * grad * s, axis=1, keepdims=True)
            grad = grad * r_ref[...].astype(jnp.float32)
        ds_ref[...] = jnp.sum(w * grad, axis=0, keepdims=True)
        dw_acc_ref[...] += grad * s

    @pl.when(last_member & last_row_block)
    def _store():
        dw_ref[...] = dw_acc_ref[...].astype(dw_ref.dtype)


def _kernel_grad(x3, w, r3, s3, g3, tiling: Tiling, config: KernelConfig, with_dr):
    """``(dW, ds, dr)``; ``dr`` (``None`` unless ``with_dr``) from the same tiles."""
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    blocks = tiling.kernel_grad
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    num_in_blocks = num_blocks(in_features, bm)
    num_out_blocks = num_blocks(out_features, bn)
    ds_shape = (num_in_blocks, num_members, 1, out_features)
    dr_shape = (num_out_blocks, num_members, in_features, 1)
    if with_dr:  # r as a column: it scales the rows of each member's tile
        r3 = r3.reshape(num_members, in_features, 1)
        r_spec = exact_block_spec(r3.shape, (None, bm, 1), lambda i, j, e, k: (e, i, 0))
    else:
        r_spec = exact_block_spec(r3.shape, (None, 1, bm), lambda i, j, e, k: (e, 0, i))
    out_shape = [
        jax.ShapeDtypeStruct(w.shape, w.dtype),
        jax.ShapeDtypeStruct(ds_shape, jnp.float32),
    ]
    out_specs = [
        exact_block_spec(w.shape, (bm, bn), lambda i, j, e, k: (i, j)),
        exact_block_spec(
            ds_shape, (None, None, 1, bn), lambda i, j, e, k: (i, e, 0, j)
        ),
    ]
    if with_dr:
        out_shape.append(jax.ShapeDtypeStruct(dr_shape, jnp.float32))
        out_specs.append(
            exact_block_spec(
                dr_shape, (None, None, bm, 1), lambda i, j, e, k: (j, e, i, 0)
            )
        )
    dw, ds_parts, *dr_parts = pl.pallas_call(
        functools.partial(_dw_kernel, **_matmul_options(config)),
        out_shape=tuple(out_shape),
        grid=(num_in_blocks, num_out_blocks, num_members, num_blocks(rows, bk)),
        in_specs=[
            exact_block_spec(x3.shape, (None, bk, bm), lambda i, j, e, k: (e, k, i)),
            exact_block_spec(g3.shape, (None, bk, bn), lambda i, j, e, k: (e, k, j)),
            r_spec,
            exact_block_spec(s3.shape, (None, 1, bn), lambda i, j, e, k: (e, 0, j)),
            exact_block_spec(w.shape, (bm, bn), lambda i, j, e, k: (i, j)),
        ],
        out_specs=tuple(out_specs),
        scratch_shapes=[
            pltpu.VMEM((bm, bn), jnp.float32),
            pltpu.VMEM((bm, bn), jnp.float32),
        ],
        compiler_params=_params("parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=config.interpret,
        name="batch_ensemble_dense_dw",
    )(x3, g3, r3, s3, w)
    dr = jnp.sum(dr_parts[0], axis=(0, 3)) if with_dr else None
    return dw, jnp.sum(ds_parts, axis=(0, 2)), dr


def backward(x3, w, r3, s3, g3, tiling: Tiling, config: KernelConfig, wanted: Wanted):
    """``(dx3, dW, dr, ds)`` on padded operands; ``dr``, ``ds`` in float32.

    As :func:`ensembles.experimental.pallas.triton.backward`: a gradient not
    ``wanted`` is ``None``; a first layer runs no input-gradient kernel and
    reads ``dr`` off the kernel-gradient tiles.
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
