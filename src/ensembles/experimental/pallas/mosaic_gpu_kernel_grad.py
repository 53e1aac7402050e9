"""The Hopper family's kernel-gradient kernel: ``dW``, ``ds`` (and ``dr``) on chip.

Part of the Hopper backward (:mod:`.mosaic_gpu_backward` has the math and the
status: not yet run on a GPU). Per tile of 64 input features and ``2 x
tile_n`` output features, one TMA pipeline streams every member's rows of
``x`` and ``g`` in turn; ``wgmma`` accumulates ``x^T g`` (``x`` read
transposed) and, at the end of each member's rows, the compute warpgroups
read the member's tile ``M_k`` off the accumulator, scale it by ``r`` and
``s``, reduce it against the kernel tile into the ``ds`` (and, for a first
layer, ``dr``) partials, and add it to ``dW``, which stays in shared memory
(float32) until the tile's last member and is stored once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ensembles.experimental.pallas.mosaic_gpu import (
    MEMORY_REGISTERS,
    STAGES,
    TILE_M,
    BackwardTiles,
    interpret_options,
    member_vector,
    num_programs,
    swizzled,
)

__all__ = [
    "SHARED_MEMORY_BYTES",
    "check_members",
    "kernel_grad",
    "kernel_grad_shared_memory_bytes",
]


#: Shared memory of one Hopper kernel (an H100: 227 KiB per block, what Mosaic
#: GPU reports as available).
SHARED_MEMORY_BYTES = 232448
_SMEM_ALIGNMENT = 1024  # Mosaic GPU aligns every SMEM allocation to 1 KiB
_SMEM_MARGIN = 4096


def kernel_grad_shared_memory_bytes(num_members: int, t: BackwardTiles, dtype) -> int:
    """The kernel-gradient kernel's shared memory, in bytes, with a margin.

    Two pipeline buffers of the ``x`` and ``g`` tiles, the kernel tile, the
    float32 ``dW`` tile and every member's ``r`` and ``s`` windows, for each of
    the two compute warpgroups, the partial-sum vectors, and 4 KiB for the
    barriers and reduction scratch (2,128 bytes in Mosaic GPU's count at
    E = 64, 512 x 512: 233,552 bytes in all).

    >>> from ensembles.experimental.pallas import mosaic_gpu
    >>> kernel_grad_shared_memory_bytes(
    ...     64, mosaic_gpu.backward_tiles(64, 64, 512, 512, jnp.bfloat16), jnp.bfloat16)
    235520
    """

    def aligned(elements, itemsize):
        return -(-elements * itemsize // _SMEM_ALIGNMENT) * _SMEM_ALIGNMENT

    size = jnp.dtype(dtype).itemsize
    tile_n = t.out_tile_n
    return (
        aligned(STAGES * t.tile_k * (TILE_M + 2 * tile_n), size)
        + aligned(2 * TILE_M * tile_n, size)  # the kernel tiles
        + aligned(2 * TILE_M * tile_n, 4)  # dW, float32
        + aligned(2 * num_members * TILE_M, size)  # r windows
        + aligned(2 * num_members * tile_n, size)  # s windows
        + aligned(2 * tile_n, 4)  # ds partials
        + aligned(2 * TILE_M, 4)  # dr partials
        + _SMEM_MARGIN
    )


def check_members(num_members: int, t: BackwardTiles, dtype) -> None:
    """A ValueError if the kernel-gradient kernel's tiles overflow shared memory."""
    need = kernel_grad_shared_memory_bytes(num_members, t, dtype)
    if need > SHARED_MEMORY_BYTES:
        raise ValueError(
            f"The Hopper kernel-gradient kernel holds every member's r and s "
            f"windows of a tile in shared memory: num_members={num_members} "
            f"with {t.out_features} output features needs about {need} bytes, "
            f"more than the {SHARED_MEMORY_BYTES} an H100 block has. Use fewer "
            f'members, the default kernel family, or impl="xla".'
        )


def _kernel_grad_body(
    *refs, w_smem, dw_smem, r_smem, s_smem, ds_smem, dr_smem, barriers,
    tiles: BackwardTiles, with_dr: bool,
):  # fmt: skip
    # Operands (x and g as [E*R, D]), then dW and the ds partials, then (a
    # first layer) dr's.
    x_gmem, g_gmem, r_gmem, s_gmem, w_gmem, dw_gmem, ds_gmem, *dr_gmem = refs
    num_members = x_gmem.shape[0] // tiles.rows
    tile_n = tiles.out_tile_n
    cta_n = 2 * tile_n
    m_tiles, n_tiles = tiles.in_features // TILE_M, tiles.out_features // cta_n
    steps = tiles.rows // tiles.tile_k  # per member
    dtype = x_gmem.dtype
    wgmma_layout = plgpu.Layout.WGMMA

    def pipeline(body, compute_context):
        # One pipeline over every member's rows, step i: member i // steps.
        def rows(i):
            return (i, 0)

        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(num_members * steps,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec(  # x, read transposed: 64 input features
                    (tiles.tile_k, TILE_M),
                    rows,
                    transforms=swizzled(TILE_M, dtype, "lhs"),
                    memory_space=plgpu.SMEM,
                ),
                plgpu.BlockSpec(
                    (tiles.tile_k, cta_n),
                    rows,
                    transforms=swizzled(tile_n, dtype, "rhs"),
                    memory_space=plgpu.SMEM,
                ),
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
        allocations=pipeline(ignore, ignore).get_allocations(x_gmem, g_gmem),
        collective_axes="wg",
    )
    def _scope(allocations):
        wg = lax.axis_index("wg")
        tile = (TILE_M, tile_n)

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="programs")
        def _tile_loop(info):
            (index,) = info.index
            m_index, n_index = index // n_tiles, index % n_tiles
            in_rows = pl.ds(m_index * TILE_M, TILE_M)
            cta_cols = pl.ds(n_index * cta_n, cta_n)
            wg_cols = pl.ds(wg * tile_n, tile_n)
            cols = pl.ds(n_index * cta_n + wg * tile_n, tile_n)

            def zeros():
                return plgpu.layout_cast(jnp.zeros(tile, jnp.float32), wgmma_layout)

            def compute_context(run_pipeline):
                # The kernel tile and every member's r and s windows, read at
                # each member's end. The kernel's buffer took the last tile's
                # dW: wait until that store has read it.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                copies = (
                    (w_gmem.at[in_rows, cols], w_smem.at[wg]),
                    (r_gmem.at[:, in_rows], r_smem.at[wg]),
                    (s_gmem.at[:, cols], s_smem.at[wg]),
                )
                for j, (src, dst) in enumerate(copies):
                    plgpu.copy_gmem_to_smem(src, dst, barriers.at[3 * wg + j])
                for j in range(len(copies)):
                    plgpu.barrier_wait(barriers.at[3 * wg + j])

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC(tile, jnp.float32))
                def _accumulate(acc_ref):
                    run_pipeline((acc_ref, zeros()))
                    dw = plgpu.layout_cast(dw_smem[wg], wgmma_layout)
                    w_smem[wg] = dw.astype(dw_gmem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(w_smem.at[wg], dw_gmem.at[in_rows, cols])

            def step(indices, x_smem, g_smem, carry):
                (i,) = indices
                member, k = i // steps, i % steps
                # The accumulator runs on over every member's rows: M_k is
                # its growth over member k's (exact to float32 rounding of
                # the running sum; jax's Mosaic GPU interpreter cannot reset
                # an accumulator mid-pipeline).
                acc_ref, before = carry
                plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), g_smem.at[:, wg_cols])
                plgpu.wgmma_wait(0)

                def member_done():
                    running = acc_ref[...]
                    m = running - before  # M_k = x_k^T g_k, this tile
                    r = member_vector(
                        r_smem.at[wg, member], wgmma_layout.reduce(1), tile, [0]
                    )
                    s = member_vector(
                        s_smem.at[wg, member], wgmma_layout.reduce(0), tile, [1]
                    )
                    kernel = plgpu.layout_cast(w_smem[wg], wgmma_layout)
                    kernel = kernel.astype(jnp.float32)
                    grad = m * r

                    # Every store and load of dW is in the WGMMA layout:
                    # each thread reads back what it stored itself.
                    @pl.when(member == 0)
                    def _zero():
                        dw_smem[wg] = zeros()

                    dw_smem[wg] = plgpu.layout_cast(dw_smem[wg], wgmma_layout) + (
                        grad * s
                    )
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    ds_smem[wg] = jnp.sum(kernel * grad, axis=0)
                    if with_dr:
                        dr_smem[wg] = jnp.sum(kernel * m * s, axis=1)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        ds_smem.at[wg], ds_gmem.at[m_index, member, cols]
                    )
                    if with_dr:
                        plgpu.copy_smem_to_gmem(
                            dr_smem.at[wg],
                            dr_gmem[0].at[2 * n_index + wg, member, in_rows],
                        )
                    return running

                before = lax.cond(k == steps - 1, member_done, lambda: before)
                return acc_ref, before

            pipeline(step, compute_context)(
                x_gmem.at[:, in_rows],
                g_gmem.at[:, cta_cols],
                allocations=allocations,
            )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def kernel_grad(x3, w, r, s, g3, tiles: BackwardTiles, interpret, with_dr):
    """``(dW, ds, dr)`` on operands padded to ``tiles``; ``dr`` only ``with_dr``."""
    num_members = x3.shape[0]
    dtype = x3.dtype
    tile_n = tiles.out_tile_n
    in_features, out_features = w.shape
    ds_shape = (in_features // TILE_M, num_members, out_features)
    dr_shape = (out_features // tile_n, num_members, in_features)
    out_type = [
        jax.ShapeDtypeStruct(w.shape, w.dtype),
        jax.ShapeDtypeStruct(ds_shape, jnp.float32),
    ]
    if with_dr:
        out_type.append(jax.ShapeDtypeStruct(dr_shape, jnp.float32))
    kernel = plgpu.kernel(
        functools.partial(_kernel_grad_body, tiles=tiles, with_dr=with_dr),
        out_type=tuple(out_type),
        grid=(num_programs(interpret),),
        grid_names=("programs",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        scratch_types={
            "w_smem": plgpu.SMEM(
                (2, TILE_M, tile_n), dtype, transforms=swizzled(tile_n, dtype, "w")
            ),
            "dw_smem": plgpu.SMEM((2, TILE_M, tile_n), jnp.float32),
            "r_smem": plgpu.SMEM((2, num_members, TILE_M), dtype),
            "s_smem": plgpu.SMEM((2, num_members, tile_n), dtype),
            "ds_smem": plgpu.SMEM((2, tile_n), jnp.float32),
            "dr_smem": plgpu.SMEM((2, TILE_M), jnp.float32),
            "barriers": plgpu.Barrier(num_arrivals=1, num_barriers=6),
        },
        **interpret_options(interpret),
    )
    rows = num_members * tiles.rows
    dw, ds_parts, *dr_parts = kernel(
        x3.reshape(rows, in_features),
        g3.reshape(rows, out_features),
        r,
        s,
        w,
    )
    dr = jnp.sum(dr_parts[0], axis=0) if with_dr else None
    return dw, jnp.sum(ds_parts, axis=0), dr
