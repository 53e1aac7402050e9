"""The Hopper family's backward: two Mosaic GPU kernels, every reduction on chip.

Status: **not yet run on a GPU.** Like the forward (:mod:`.mosaic_gpu`), it
runs in jax's Mosaic GPU interpreter on CPU (jax >= 0.12, poisoned memory,
out-of-bounds reads raising, races detected) and compiles for an H100 without
one (the compile tier); neither proves it right or fast on the chip.

With ``z = (x * r) @ W``, ``y = z * s + bias`` and the cotangent ``g``, for
member ``k`` (``M_k = x_k^T g_k``, ``in x out``, never written out)::

    input gradient:  dxr = (g * s[k]) @ W^T;  dx = dxr * r[k]
                     dr[k] = sum_rows x * dxr            (a hidden layer)
    kernel gradient: dW = sum_k (M_k * r[k]^T) * s[k]
                     ds[k] = sum_in W * M_k * r[k]^T
                     dr[k] = sum_out W * M_k * s[k]      (a first layer)

* The **input-gradient kernel** walks output tiles ``(member, 64 rows, 2 x
  tile_n input features)`` as the forward walks its own: a memory warpgroup
  streams ``g``, the kernel (``W`` rows, read transposed by ``wgmma``) and the
  ``s`` window through a TMA pipeline; each compute warpgroup scales its ``g``
  tile by ``s`` in the operands' dtype (the forward's ``x * r``), runs
  ``wgmma``, and in its epilogue multiplies by the ``r`` window (``dx``) and
  sums ``x * dxr`` over the tile's rows (a partial ``dr`` per 64 rows).
* The **kernel-gradient kernel** walks tiles ``(64 input features, 2 x
  tile_n output features)`` and, for each, every member: a pipeline over the
  member's rows accumulates ``M_k`` (``x`` read transposed by ``wgmma``, no
  prologue), then the compute warpgroups scale it by ``r`` and ``s`` on chip,
  reduce it against the kernel tile into ``ds`` (and, for a first layer,
  ``dr``) partials, and add it to ``dW``, which stays in shared memory (float32)
  until the last member and is then stored once. No ``[E, in, out]`` array
  and no ``dx`` of a first layer reach memory.

The partial sums (``dr`` per 64 rows or per ``tile_n`` output features, ``ds``
per 64 input features) are small and are added up with ``jnp``. Operands are
zero-padded to whole tiles here and the results sliced back, as in the
forward: no copy touches memory outside an array. bfloat16 only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ensembles.experimental.pallas.blocks import pad_to
from ensembles.experimental.pallas.common import KernelConfig, Wanted
from ensembles.experimental.pallas.mosaic_gpu import (
    EPILOGUE_N,
    MEMORY_REGISTERS,
    STAGES,
    TILE_M,
    BackwardTiles,
    backward_tiles,
    interpret_options,
    member_vector,
    num_programs,
    store_tile,
    swizzled,
)
from ensembles.experimental.pallas.mosaic_gpu_kernel_grad import (
    check_members,
    kernel_grad,
)

__all__ = ["backward"]


# ------------------------------------------------------- the input gradient


def _input_grad_body(
    g_gmem, w_gmem, s_gmem, r_gmem, x_gmem, dx_gmem, dr_gmem,
    gs_smem, x_smem, r_smem, dr_smem, out_smem, barriers,
    *, tiles: BackwardTiles,
):  # fmt: skip
    num_members = g_gmem.shape[0]
    tile_n, tile_k = tiles.in_tile_n, tiles.tile_k
    cta_n = 2 * tile_n
    m_tiles, n_tiles = tiles.rows // TILE_M, tiles.in_features // cta_n
    dtype = g_gmem.dtype

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(tiles.out_features // tile_k,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec(
                    (TILE_M, tile_k),
                    lambda k: (0, k),
                    transforms=swizzled(tile_k, dtype, "lhs"),
                    memory_space=plgpu.SMEM,
                ),
                plgpu.BlockSpec(  # kernel rows, read transposed
                    (cta_n, tile_k),
                    lambda k: (0, k),
                    transforms=swizzled(tile_k, dtype, "rhs"),
                    memory_space=plgpu.SMEM,
                ),
                plgpu.BlockSpec((tile_k,), lambda k: (k,), memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=STAGES,
            compute_context=compute_context,
        )

    def ignore(*_, **__):
        return None

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(
            g_gmem.at[0], w_gmem, s_gmem.at[0]
        ),
        collective_axes="wg",
    )
    def _scope(allocations):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((num_members * m_tiles * n_tiles,), collective_axes="programs")
        def _tile_loop(info):
            (index,) = info.index
            member = index // (m_tiles * n_tiles)
            m_index = (index // n_tiles) % m_tiles
            n_index = index % n_tiles
            rows = pl.ds(m_index * TILE_M, TILE_M)
            cta_cols = pl.ds(n_index * cta_n, cta_n)
            wg_cols = pl.ds(wg * tile_n, tile_n)
            cols = pl.ds(n_index * cta_n + wg * tile_n, tile_n)

            def compute_context(run_pipeline):
                # The epilogue's r window and x tile arrive while the loop runs.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.copy_gmem_to_smem(
                    r_gmem.at[member, cols], r_smem.at[wg], barriers.at[2 * wg]
                )
                plgpu.copy_gmem_to_smem(
                    x_gmem.at[member, rows, cols],
                    x_smem.at[wg],
                    barriers.at[2 * wg + 1],
                )

                @functools.partial(
                    pl.run_scoped, acc_ref=plgpu.ACC((TILE_M, tile_n), jnp.float32)
                )
                def _accumulate(acc_ref):
                    run_pipeline(acc_ref)
                    dxr = acc_ref[...]
                    plgpu.barrier_wait(barriers.at[2 * wg])
                    r = member_vector(
                        r_smem.at[wg], plgpu.Layout.WGMMA.reduce(0), dxr.shape, [1]
                    )
                    plgpu.barrier_wait(barriers.at[2 * wg + 1])
                    x = plgpu.layout_cast(x_smem[wg], plgpu.Layout.WGMMA)
                    dr_smem[wg] = jnp.sum(x.astype(jnp.float32) * dxr, axis=0)
                    store_tile(
                        out_smem,
                        wg,
                        (dxr * r).astype(dx_gmem.dtype),
                        dx_gmem.at[member, rows, cta_cols].at[:, wg_cols],
                    )
                    plgpu.copy_smem_to_gmem(
                        dr_smem.at[wg], dr_gmem.at[member, m_index, cols]
                    )

            def step(_, g_smem, w_smem, s_smem, acc_ref):
                g = g_smem[...]
                gs_smem[wg] = g * lax.broadcast_in_dim(s_smem[...], g.shape, [1])
                plgpu.commit_smem()  # visible to wgmma; a warpgroup barrier
                plgpu.wgmma(
                    acc_ref, gs_smem.at[wg], w_smem.at[wg_cols].transpose((1, 0))
                )
                plgpu.wgmma_wait(0)  # gs_smem is rewritten by the next step
                return acc_ref

            pipeline(step, compute_context)(
                g_gmem.at[member, rows, :],
                w_gmem.at[cta_cols, :],
                s_gmem.at[member],
                allocations=allocations,
            )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _input_grad(x3, w, r, s, g3, tiles: BackwardTiles, interpret):
    num_members = x3.shape[0]
    dtype = x3.dtype
    tile_n = tiles.in_tile_n
    dr_shape = (num_members, tiles.rows // TILE_M, tiles.in_features)
    kernel = plgpu.kernel(
        functools.partial(_input_grad_body, tiles=tiles),
        out_type=(
            jax.ShapeDtypeStruct(x3.shape, dtype),
            jax.ShapeDtypeStruct(dr_shape, jnp.float32),
        ),
        grid=(num_programs(interpret),),
        grid_names=("programs",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        scratch_types={
            "gs_smem": plgpu.SMEM(
                (2, TILE_M, tiles.tile_k),
                dtype,
                transforms=swizzled(tiles.tile_k, dtype, "lhs"),
            ),
            "x_smem": plgpu.SMEM(
                (2, TILE_M, tile_n), dtype, transforms=swizzled(tile_n, dtype, "x")
            ),
            "r_smem": plgpu.SMEM((2, tile_n), dtype),
            "dr_smem": plgpu.SMEM((2, tile_n), jnp.float32),
            "out_smem": plgpu.SMEM(
                (2, 2, TILE_M, EPILOGUE_N),
                dtype,
                transforms=swizzled(EPILOGUE_N, dtype, "out"),
            ),
            "barriers": plgpu.Barrier(num_arrivals=1, num_barriers=4),
        },
        **interpret_options(interpret),
    )
    dx3, dr_parts = kernel(g3, w, s, r, x3)
    return dx3, jnp.sum(dr_parts, axis=1)


def backward(x3, w, r, s, g3, config: KernelConfig, wanted: Wanted):
    """``(dx3, dW, dr, ds)``; pads to whole tiles and slices back.

    Args:
      x3: ``[E, R, in]`` inputs.
      w: ``[in, out]`` shared kernel.
      r: ``[E, in]`` input fast weights.
      s: ``[E, out]`` output fast weights.
      g3: ``[E, R, out]`` cotangent (cast to the operands' dtype: ``wgmma``
        takes bfloat16).
      config: ``interpret`` as for :func:`~.mosaic_gpu.forward`.
      wanted: the gradients to form; the others are ``None``. Without
        ``wanted.inputs`` (a first layer) the input-gradient kernel does not
        run and the kernel-gradient kernel forms ``dr``.

    Returns:
      ``dx3`` in the inputs' dtype, ``dW`` in the kernel's, ``dr`` and ``ds``
      in float32.
    """
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    t = backward_tiles(num_members, rows, in_features, out_features, x3.dtype)
    if wanted.params:
        check_members(num_members, t, x3.dtype)
    x3p = pad_to(x3, (num_members, t.rows, t.in_features))
    wp = pad_to(w, (t.in_features, t.out_features))
    rp = pad_to(r, (num_members, t.in_features))
    sp = pad_to(s, (num_members, t.out_features))
    g3p = pad_to(g3.astype(x3.dtype), (num_members, t.rows, t.out_features))
    dx3 = dw = dr = ds = None
    if wanted.inputs:
        dx3, dr = _input_grad(x3p, wp, rp, sp, g3p, t, config.interpret)
        dx3, dr = dx3[:, :rows, :in_features], dr[:, :in_features]
    if wanted.params:
        dw, ds, tiles_dr = kernel_grad(
            x3p, wp, rp, sp, g3p, t, config.interpret, with_dr=not wanted.inputs
        )
        dw, ds = dw[:in_features, :out_features], ds[:, :out_features]
        dr = dr if wanted.inputs else tiles_dr[:, :in_features]
    else:
        dr = None
    return dx3, dw, dr, ds
