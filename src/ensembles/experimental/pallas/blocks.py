"""Tiles of the fused kernels: block sizes, their fit to a problem, padding.

Every kernel here runs on operands that its blocks tile exactly: the wrappers
zero-pad each ragged dimension (rows of a member, input features, output
features) up to a multiple of every block that tiles it, and slice the results
back. No kernel therefore reads or writes outside an array, whatever a backend
does with a partial block (Pallas' Triton lowering masks none: a partial block
reads and writes the neighbouring rows, members or buffers), and zero padding
leaves every sum exact (a padded row, input or output feature contributes
zero to each product it enters). :func:`exact_block_spec` enforces this: every
``BlockSpec`` of the kernels is built through it and rejects a block that does
not tile its array.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence

import jax.numpy as jnp
from jax.experimental import pallas as pl

__all__ = ["BlockSizes", "Tiling", "exact_block_spec", "pad_to", "tiling"]

# Triton needs dot operands of at least 16 along every dimension and blocks that
# are powers of two; Mosaic's vector lanes are 128 wide, and its sublane tiles
# (8 rows, 16 for bfloat16) divide any power of two >= 16.
MIN_BLOCK = 16
TPU_LANES = 128


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``.

    >>> round_up(130, 128)
    256
    """
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the fused kernel.

    Each of the kernels' three matmuls (forward ``[R, in] @ [in, out]``, input
    gradient ``[R, out] @ [out, in]``, kernel gradient ``[in, R] @ [R, out]``)
    computes ``block_b x block_out`` output tiles and steps through its
    reduction ``block_k`` at a time. Every field is a power of two >= 16
    (Triton's constraint). A block larger than the dimension it tiles shrinks
    to the next power of two (at least 16); on TPU a block on the vector lane
    axis is at least 128. The defaults are the classic Triton matmul tile;
    they are not tuned on real hardware (``docs/fused_kernel.md``).

    >>> BlockSizes()
    BlockSizes(block_b=128, block_out=128, block_k=32)
    >>> BlockSizes(block_b=64, block_out=256, block_k=64).block_out
    256
    >>> BlockSizes(block_b=24)
    Traceback (most recent call last):
    ...
    ValueError: `BlockSizes.block_b` must be a power of two >= 16, got 24. ...

    Attributes:
      block_b: output tile rows: rows of one member (forward, input gradient),
        input features (kernel gradient).
      block_out: output tile columns: output features (forward, kernel
        gradient), input features (input gradient).
      block_k: reduction step: input features (forward), output features
        (input gradient), rows of one member (kernel gradient).
    """

    block_b: int = 128
    block_out: int = 128
    block_k: int = 32

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            try:
                if isinstance(value, bool):
                    raise TypeError
                value = operator.index(value)
            except TypeError:
                raise TypeError(
                    f"`BlockSizes.{field.name}` must be an int, got {value!r} of "
                    f"type {type(value).__name__}."
                ) from None
            # A frozen dataclass: store the plain int (numpy ints hash apart).
            object.__setattr__(self, field.name, value)
            if value < MIN_BLOCK or not _is_power_of_two(value):
                raise ValueError(
                    f"`BlockSizes.{field.name}` must be a power of two >= "
                    f"{MIN_BLOCK}, got {value}. Triton tiles are powers of two and "
                    f"its dot operands need >= {MIN_BLOCK} along every dimension; "
                    f"e.g. BlockSizes({field.name}="
                    f"{max(MIN_BLOCK, _next_power_of_two(max(value, 1)))})."
                )


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    """One matmul's tile: ``block_m x block_n`` outputs, ``block_k`` per step."""

    block_m: int
    block_n: int
    block_k: int


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The padded extents of one problem and the tile of each of its matmuls.

    ``rows``, ``in_features`` and ``out_features`` are the padded extents: each
    is a multiple of every block that tiles it in any of the three matmuls.

    >>> t = tiling("gpu", rows=130, in_features=100, out_features=48,
    ...            blocks=BlockSizes())
    >>> (t.rows, t.in_features, t.out_features)
    (256, 128, 64)
    >>> t.forward
    MatmulBlocks(block_m=128, block_n=64, block_k=32)
    """

    rows: int
    in_features: int
    out_features: int
    forward: MatmulBlocks  # M = rows, N = out, K = in
    input_grad: MatmulBlocks  # M = rows, N = in, K = out
    kernel_grad: MatmulBlocks  # M = in, N = out, K = rows


def tiling(
    family: str, *, rows: int, in_features: int, out_features: int, blocks: BlockSizes
) -> Tiling:
    """Fits ``blocks`` to a problem for a kernel family and pads its extents.

    Args:
      family: ``"gpu"`` (Triton) or ``"tpu"`` (Mosaic).
      rows: rows of one member.
      in_features: the kernel's input features.
      out_features: the kernel's output features.
      blocks: the requested tile sizes.

    Returns:
      The :class:`Tiling`.
    """
    # On TPU the feature axes are the last (lane) axis of some block in every
    # kernel; rows never are.
    feature_min = TPU_LANES if family == "tpu" else MIN_BLOCK

    def fit(block: int, dim: int, minimum: int) -> int:
        return min(max(block, minimum), max(minimum, _next_power_of_two(dim)))

    def r(block):
        return fit(block, rows, MIN_BLOCK)

    def i(block):
        return fit(block, in_features, feature_min)

    def o(block):
        return fit(block, out_features, feature_min)

    b, n, k = blocks.block_b, blocks.block_out, blocks.block_k
    forward = MatmulBlocks(r(b), o(n), i(k))
    input_grad = MatmulBlocks(r(b), i(n), o(k))
    kernel_grad = MatmulBlocks(i(b), o(n), r(k))
    # Blocks are powers of two, so the largest on an axis is a multiple of all.
    return Tiling(
        rows=round_up(rows, max(forward.block_m, kernel_grad.block_k)),
        in_features=round_up(
            in_features,
            max(forward.block_k, input_grad.block_n, kernel_grad.block_m),
        ),
        out_features=round_up(
            out_features,
            max(forward.block_n, input_grad.block_k, kernel_grad.block_n),
        ),
        forward=forward,
        input_grad=input_grad,
        kernel_grad=kernel_grad,
    )


def pad_to(array, shape: Sequence[int]):
    """Zero-pads ``array`` at the end of each axis to ``shape`` (no copy if equal).

    >>> pad_to(jnp.ones((2, 3)), (2, 4))
    Array([[1., 1., 1., 0.],
           [1., 1., 1., 0.]], dtype=float32)
    """
    if tuple(array.shape) == tuple(shape):
        return array
    return jnp.pad(
        array, [(0, size - dim) for dim, size in zip(array.shape, shape, strict=True)]
    )


def exact_block_spec(
    array_shape: Sequence[int],
    block_shape: Sequence[int | None],
    index_map: Callable,
) -> pl.BlockSpec:
    """A ``BlockSpec`` whose blocks tile ``array_shape`` exactly.

    ``None`` in ``block_shape`` squeezes an axis (one element, always in
    bounds). The kernels build every spec here, so a partial block, whose
    contents and stores no backend defines alike, cannot reach a kernel.

    Args:
      array_shape: the shape of the operand the spec maps.
      block_shape: the block, as for ``pl.BlockSpec``.
      index_map: the grid-to-block map, as for ``pl.BlockSpec``.

    Returns:
      The ``pl.BlockSpec``.

    Raises:
      ValueError: if a block does not divide its axis (a bug in the caller,
        which must pad first).

    >>> exact_block_spec((2, 256, 128), (None, 128, 64), lambda e, i, j: (e, i, j))
    BlockSpec(...)
    >>> exact_block_spec((2, 130, 128), (None, 128, 64), lambda e, i, j: (e, i, j))
    Traceback (most recent call last):
    ...
    ValueError: block (None, 128, 64) does not tile an array of shape (2, 130, 128)...
    """
    if len(block_shape) != len(array_shape) or any(
        block is not None and dim % block
        for dim, block in zip(array_shape, block_shape, strict=False)
    ):
        raise ValueError(
            f"block {tuple(block_shape)} does not tile an array of shape "
            f"{tuple(array_shape)}: pad the operand to a multiple of the block "
            f"first (ensembles.experimental.pallas.blocks.pad_to). This is a bug in "
            f"ensembles; please report it."
        )
    return pl.BlockSpec(tuple(block_shape), index_map)


def num_blocks(dim: int, block: int) -> int:
    """How many blocks tile ``dim`` (``dim`` is a multiple of ``block``).

    >>> num_blocks(256, 128)
    2
    """
    return dim // block
