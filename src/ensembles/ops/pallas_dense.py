"""The fused Pallas BatchEnsemble dense kernel for GPU (Triton) and TPU (Mosaic).

The ``jnp`` formulation of the op (``impl="xla"``) moves the activations through
memory three times: once to scale them by ``r``, once through the matmul, once to
scale the result by ``s`` and add the bias. The kernels here apply ``* r`` to each
input tile right after loading it and ``* s + bias`` to each output tile right
before storing it, so the batch makes one trip::

    y[k*B + b] = ((x[k*B + b] * r[k]) @ kernel) * s[k] + bias[k]

Layout. The member-major ``[E*B, ..., in]`` batch is viewed (for free) as
``[E, R, in]`` with ``R = B * prod(middle axes)`` rows per member. Every grid is
over ``(member, row block within the member, ...)``, so a row block never
straddles two members and its member is the grid index itself. The last row block
of a member may be ragged (any ``R``): its out-of-range rows are never stored and
are masked out of every reduction.

Kernel families. ``lax.platform_dependent`` picks, at lowering time, one of:

* ``"gpu"`` (``cuda``): Triton kernels. All grid programs run in parallel, so each
  reduction is a ``lax.fori_loop`` inside the kernel; blocks are powers of two.
* ``"tpu"`` (``tpu``): Mosaic kernels. The reduction is the last grid axis
  (``"arbitrary"``), accumulated in a float32 VMEM scratch.
* ``cpu``: Pallas has no compiled CPU backend, so the ``"gpu"`` family runs in
  Pallas' interpret mode there (slow; meant for tests and debugging).
* any other platform (e.g. ROCm, unverified): the ``jnp`` reference
  :func:`dense_reference`.

Reductions are zero-padded to a multiple of their block (``in`` in the forward
pass, ``out`` in the input-gradient pass); nothing is copied when the feature
sizes are multiples of the blocks. Gradients come from a ``jax.custom_vjp`` whose
residuals are only ``(x, kernel, r, s)``: one kernel computes ``dx`` and the
per-row-block partials of ``dr``, another ``dkernel`` and the partials of ``ds``;
``dbias`` is a plain sum of the cotangent over each member's rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

__all__ = [
    "SUPPORTED_DTYPES",
    "BlockSizes",
    "check_dtypes",
    "dense_reference",
    "fused_dense",
    "suits_kernel",
]

#: The dtypes the fused kernel computes in (inputs and parameters alike).
SUPPORTED_DTYPES: tuple[jnp.dtype, ...] = (
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.bfloat16),
)

# Triton needs dot operands of at least 16 along every dimension; Mosaic's vector
# lanes are 128 wide (the last block dimension must be a multiple of 128 unless it
# spans the whole array).
_MIN_BLOCK = 16
_TPU_LANES = 128


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _cdiv(value: int, divisor: int) -> int:
    return -(-value // divisor)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the fused kernel.

    Each of the kernels' three matmuls (forward ``[R, in] @ [in, out]``, input
    gradient ``[R, out] @ [out, in]``, kernel gradient ``[in, R] @ [R, out]``)
    computes ``block_b x block_out`` output tiles and steps through its
    reduction ``block_k`` at a time. Every field is a power of two >= 16
    (Triton's constraint). The kernels shrink a block that is larger than the
    dimension it tiles (on GPU to the next power of two, on TPU to the
    dimension itself), and on TPU raise blocks on the vector lane axis to at
    least 128. The defaults are the classic Triton matmul tile; they are not
    tuned on real hardware.

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
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"`BlockSizes.{field.name}` must be an int, got {value!r} of "
                    f"type {type(value).__name__}."
                )
            if value < _MIN_BLOCK or not _is_power_of_two(value):
                raise ValueError(
                    f"`BlockSizes.{field.name}` must be a power of two >= "
                    f"{_MIN_BLOCK}, got {value}. Triton tiles are powers of two and "
                    f"its dot operands need >= {_MIN_BLOCK} along every dimension; "
                    f"e.g. BlockSizes({field.name}="
                    f"{max(_MIN_BLOCK, _next_power_of_two(max(value, 1)))})."
                )


def check_dtypes(inputs, kernel, r, s, bias=None, preferred_element_type=None):
    """Checks that the fused kernel supports the dtypes of its operands.

    Args:
      inputs: the activations.
      kernel: the shared kernel.
      r: the input fast weights.
      s: the output fast weights.
      bias: the per-member bias, or ``None``.
      preferred_element_type: the requested output dtype, or ``None``.

    Returns:
      The common dtype of the operands.

    Raises:
      TypeError: if the operands do not share one dtype, if that dtype is not in
        :data:`SUPPORTED_DTYPES`, or if ``preferred_element_type`` is neither
        ``None``, float32 nor the operands' dtype.

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((2, 3), jnp.bfloat16)
    >>> check_dtypes(x, x, x, x)
    dtype(bfloat16)
    """
    named = {"inputs": inputs, "kernel": kernel, "r": r, "s": s}
    if bias is not None:
        named["bias"] = bias
    dtypes = {name: jnp.dtype(array.dtype) for name, array in named.items()}
    dtype = dtypes["inputs"]
    if len(set(dtypes.values())) > 1:
        shown = ", ".join(f"{name}={d.name}" for name, d in dtypes.items())
        raise TypeError(
            f'impl="pallas" needs inputs, kernel, r, s and bias of one dtype, got '
            f"{shown}. Cast them to one dtype first (the layers do this through "
            f"`promote_dtype`)."
        )
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f'impl="pallas" supports dtypes '
            f"{[d.name for d in SUPPORTED_DTYPES]}, got {dtype.name}. Cast to "
            f'one of them or use impl="xla".'
        )
    if preferred_element_type is not None:
        preferred = jnp.dtype(preferred_element_type)
        if preferred not in (jnp.dtype(jnp.float32), dtype):
            raise TypeError(
                f'impl="pallas" supports `preferred_element_type` None, float32 or '
                f"the operands' dtype ({dtype.name}), got {preferred.name}."
            )
    return dtype


def suits_kernel(rows_per_member: int, in_features: int, out_features: int, dtype):
    """Whether ``impl="auto"`` picks the fused kernel for this shape on GPU/TPU.

    The kernel must support the dtype, and the feature sizes must be multiples of
    128 so that no operand is padded and every TPU tile fills whole vector lanes;
    a member needs at least 8 rows to fill a TPU sublane tile. This is a
    heuristic from the memory-traffic argument, not from measurements on
    accelerators (none was available where it was written).

    Args:
      rows_per_member: rows of one member, ``B`` times the middle axes.
      in_features: the kernel's input features.
      out_features: the kernel's output features.
      dtype: the operands' dtype.

    Returns:
      True if the fused kernel suits the shape.

    >>> import jax.numpy as jnp
    >>> suits_kernel(256, 1024, 1024, jnp.float32)
    True
    >>> suits_kernel(256, 1000, 1024, jnp.float32)
    False
    """
    return (
        jnp.dtype(dtype) in SUPPORTED_DTYPES
        and rows_per_member >= 8
        and in_features % _TPU_LANES == 0
        and out_features % _TPU_LANES == 0
    )


def dense_reference(x3, kernel, r, s, bias=None, *, precision=None, out_dtype=None):
    """The ``jnp`` formulation on the ``[E, R, in]`` member view.

    It is what the kernels compute, written plainly; it serves platforms without
    a kernel and documents the math next to the kernels.

    Args:
      x3: ``[E, R, in]`` inputs, member ``k``'s rows in ``x3[k]``.
      kernel: ``[in, out]`` shared kernel.
      r: ``[E, in]`` input fast weights.
      s: ``[E, out]`` output fast weights.
      bias: ``[E, out]`` bias or ``None``.
      precision: matmul precision.
      out_dtype: output dtype (default: ``x3``'s).

    Returns:
      The ``[E, R, out]`` outputs.

    >>> import jax.numpy as jnp
    >>> dense_reference(jnp.ones((2, 3, 4)), jnp.ones((4, 5)), jnp.ones((2, 4)),
    ...                 2 * jnp.ones((2, 5)))[0, 0]
    Array([8., 8., 8., 8., 8.], dtype=float32)
    """
    out_dtype = x3.dtype if out_dtype is None else out_dtype
    scaled = (x3 * r[:, None, :]).reshape(-1, x3.shape[-1])
    y = lax.dot_general(
        scaled,
        kernel,
        (((1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    ).reshape(*x3.shape[:-1], kernel.shape[1])
    y = y * s[:, None, :].astype(jnp.float32)
    if bias is not None:
        y = y + bias[:, None, :].astype(jnp.float32)
    return y.astype(out_dtype)


# --------------------------------------------------------------------------- #
# Configuration and block fitting
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call of the fused op."""

    blocks: BlockSizes
    precision: Any
    out_dtype: Any
    # False: per-platform kernels; True: the "gpu" family in the generic
    # interpreter; anything else (pltpu.InterpretParams): the "tpu" family in the
    # TPU interpreter.
    interpret: Any
    # None: chosen per platform; "gpu" / "tpu": force a family (tests use it to
    # run both families in interpret mode on CPU).
    family: str | None
    has_bias: bool


@dataclasses.dataclass(frozen=True)
class _Fit:
    """One matmul's extents (M, N, K) and the tile fitted to them.

    Each of the three matmuls (forward ``[R, in] @ [in, out]``, input gradient
    ``[R, out] @ [out, in]``, kernel gradient ``[in, R] @ [R, out]``) uses an
    output tile of ``block_m x block_n`` and steps through its reduction
    ``block_k`` at a time, from the same :class:`BlockSizes`.
    """

    m: int
    n: int
    k: int
    block_m: int
    block_n: int
    block_k: int

    @property
    def padded_k(self) -> int:
        return _round_up(self.k, self.block_k)


def _fit_gpu(m, n, k, blocks: BlockSizes) -> _Fit:
    # Powers of two >= 16, shrunk to the next power of two above small dims.
    def fit(block, dim):
        return min(block, max(_MIN_BLOCK, _next_power_of_two(dim)))

    return _Fit(
        m,
        n,
        k,
        fit(blocks.block_b, m),
        fit(blocks.block_out, n),
        fit(blocks.block_k, k),
    )


def _fit_tpu(m, n, k, blocks: BlockSizes, *, m_on_lanes=False, k_on_lanes=True):
    # A block dimension either spans the whole array dimension or is a multiple
    # of the (8, 128) vector tile: dimensions that end up last in a block (on
    # the 128 lanes) get blocks of at least 128; BlockSizes' powers of two >= 16
    # already suit the others.
    def fit(block, dim, on_lanes):
        block = max(block, _TPU_LANES) if on_lanes else block
        return dim if dim <= block else block

    return _Fit(
        m,
        n,
        k,
        fit(blocks.block_b, m, m_on_lanes),
        fit(blocks.block_out, n, True),
        fit(blocks.block_k, k, k_on_lanes),
    )


def _pad_axis(array, axis: int, size: int):
    if array.shape[axis] == size:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, size - array.shape[axis])
    return jnp.pad(array, widths)


def _dot(a, b, contract, precision):
    return lax.dot_general(
        a,
        b,
        (contract, ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


_NN = ((1,), (0,))  # a @ b
_NT = ((1,), (1,))  # a @ b.T
_TN = ((0,), (0,))  # a.T @ b

_TRITON_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=3)


def _tpu_params(*semantics: str):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _gpu_interpret(config: _Config):
    # The "gpu" family runs compiled under Triton, interpreted everywhere else.
    return config.interpret is True or config.family == "gpu"


def _tpu_interpret(config: _Config):
    # The "tpu" family runs compiled under Mosaic; interpreted when a test forces
    # it (generic interpreter) or when given pltpu.InterpretParams (simulator).
    if config.interpret is False:
        return config.family == "tpu"
    return config.interpret


def _gpu_options(config: _Config):
    interpret = _gpu_interpret(config)
    return {
        "interpret": interpret,
        "compiler_params": None if interpret else _TRITON_PARAMS,
    }


def _row_mask(first_row, shape, rows):
    # True for the rows of a (row block, features) tile that exist (< rows).
    return first_row + lax.broadcasted_iota(jnp.int32, shape, 0) < rows


# --------------------------------------------------------------------------- #
# Forward kernels: M = rows of a member, N = out, K = in
# --------------------------------------------------------------------------- #


def _forward_kernel_gpu(x_ref, w_ref, r_ref, s_ref, *rest, fit, precision, has_bias):
    # Grid (member, row block, out block); loop over in. x_ref (bm, Kp),
    # w_ref (Kp, bn), r_ref (1, Kp), s_ref and b_ref (1, bn).
    b_ref, o_ref = rest if has_bias else (None, *rest)
    block_k = fit.block_k

    def step(k, acc):
        window = pl.ds(k * block_k, block_k)
        scaled = x_ref[:, window] * r_ref[:, window]
        return acc + _dot(scaled, w_ref[window, :], _NN, precision)

    acc = lax.fori_loop(
        0,
        fit.padded_k // block_k,
        step,
        jnp.zeros((fit.block_m, fit.block_n), jnp.float32),
    )
    y = acc * s_ref[...].astype(jnp.float32)
    if has_bias:
        y = y + b_ref[...].astype(jnp.float32)
    o_ref[...] = y.astype(o_ref.dtype)


def _forward_gpu(x3, w, r, s, bias, config: _Config):
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    fit = _fit_gpu(rows, out_features, in_features, config.blocks)
    padded_in = fit.padded_k
    x3 = _pad_axis(x3, 2, padded_in)
    w = _pad_axis(w, 0, padded_in)
    r3 = _pad_axis(r, 1, padded_in)[:, None, :]
    vectors = [s[:, None, :]] + ([bias[:, None, :]] if bias is not None else [])
    bm, bn = fit.block_m, fit.block_n
    vector_spec = pl.BlockSpec((None, 1, bn), lambda e, i, j: (e, 0, j))
    kernel = functools.partial(
        _forward_kernel_gpu,
        fit=fit,
        precision=config.precision,
        has_bias=bias is not None,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(
            (num_members, rows, out_features), config.out_dtype
        ),
        grid=(num_members, _cdiv(rows, bm), _cdiv(out_features, bn)),
        in_specs=[
            pl.BlockSpec((None, bm, padded_in), lambda e, i, j: (e, i, 0)),
            pl.BlockSpec((padded_in, bn), lambda e, i, j: (0, j)),
            pl.BlockSpec((None, 1, padded_in), lambda e, i, j: (e, 0, 0)),
        ]
        + [vector_spec] * len(vectors),
        out_specs=pl.BlockSpec((None, bm, bn), lambda e, i, j: (e, i, j)),
        name="batch_ensemble_dense_fwd",
        **_gpu_options(config),
    )(x3, w, r3, *vectors)


def _forward_kernel_tpu(
    x_ref, w_ref, r_ref, s_ref, *rest, num_k_blocks, precision, has_bias
):
    # Grid (member, row block, out block, in block); in is "arbitrary".
    if has_bias:
        b_ref, o_ref, acc_ref = rest
    else:
        b_ref, (o_ref, acc_ref) = None, rest
    k = pl.program_id(3)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    scaled = x_ref[...] * r_ref[...]
    acc_ref[...] += _dot(scaled, w_ref[...], _NN, precision)

    @pl.when(k == num_k_blocks - 1)
    def _store():
        y = acc_ref[...] * s_ref[...].astype(jnp.float32)
        if has_bias:
            y = y + b_ref[...].astype(jnp.float32)
        o_ref[...] = y.astype(o_ref.dtype)


def _forward_tpu(x3, w, r, s, bias, config: _Config):
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    fit = _fit_tpu(rows, out_features, in_features, config.blocks)
    padded_in = fit.padded_k
    x3 = _pad_axis(x3, 2, padded_in)
    w = _pad_axis(w, 0, padded_in)
    r3 = _pad_axis(r, 1, padded_in)[:, None, :]
    vectors = [s[:, None, :]] + ([bias[:, None, :]] if bias is not None else [])
    bm, bn, bk = fit.block_m, fit.block_n, fit.block_k
    num_k_blocks = padded_in // bk
    vector_spec = pl.BlockSpec((None, 1, bn), lambda e, i, j, k: (e, 0, j))
    kernel = functools.partial(
        _forward_kernel_tpu,
        num_k_blocks=num_k_blocks,
        precision=config.precision,
        has_bias=bias is not None,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(
            (num_members, rows, out_features), config.out_dtype
        ),
        grid=(num_members, _cdiv(rows, bm), _cdiv(out_features, bn), num_k_blocks),
        in_specs=[
            pl.BlockSpec((None, bm, bk), lambda e, i, j, k: (e, i, k)),
            pl.BlockSpec((bk, bn), lambda e, i, j, k: (k, j)),
            pl.BlockSpec((None, 1, bk), lambda e, i, j, k: (e, 0, k)),
        ]
        + [vector_spec] * len(vectors),
        out_specs=pl.BlockSpec((None, bm, bn), lambda e, i, j, k: (e, i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=_tpu_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=_tpu_interpret(config),
        name="batch_ensemble_dense_fwd",
    )(x3, w, r3, *vectors)


# --------------------------------------------------------------------------- #
# Backward kernels
# --------------------------------------------------------------------------- #
# With z = (x * r) @ W and y = z * s + bias, for member k and cotangent g:
#   dx = ((g * s) @ W.T) * r          dr[k] = sum over rows of x * ((g * s) @ W.T)
#   G_k = (x_k * r_k).T @ g_k         dW = sum_k G_k * s_k
#   ds[k] = sum over in of W * G_k    dbias[k] = sum over rows of g_k
# Input gradient: M = rows, N = in, K = out. Kernel gradient: M = in, N = out,
# K = rows (of every member in turn).


def _dx_kernel_gpu(
    g_ref, w_ref, s_ref, r_ref, x_ref, dx_ref, dr_ref, *, fit, precision
):
    # Grid (member, row block, in block); loop over out. g_ref (bm, Kp),
    # w_ref (bn, Kp), s_ref (1, Kp), r_ref (1, bn), x_ref (bm, bn).
    block_k = fit.block_k
    dot_dtype = x_ref.dtype

    def step(k, acc):
        window = pl.ds(k * block_k, block_k)
        scaled = g_ref[:, window].astype(jnp.float32) * s_ref[:, window].astype(
            jnp.float32
        )
        return acc + _dot(scaled.astype(dot_dtype), w_ref[:, window], _NT, precision)

    dxr = lax.fori_loop(
        0,
        fit.padded_k // block_k,
        step,
        jnp.zeros((fit.block_m, fit.block_n), jnp.float32),
    )
    dx_ref[...] = (dxr * r_ref[...].astype(jnp.float32)).astype(dx_ref.dtype)
    valid = _row_mask(pl.program_id(1) * fit.block_m, dxr.shape, fit.m)
    contribution = jnp.where(valid, x_ref[...].astype(jnp.float32) * dxr, 0.0)
    dr_ref[...] = jnp.sum(contribution, axis=0, keepdims=True)


def _dx_gpu(x3, w, r, s, g3, config: _Config):
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    fit = _fit_gpu(rows, in_features, out_features, config.blocks)
    padded_out = fit.padded_k
    g3 = _pad_axis(g3, 2, padded_out)
    w = _pad_axis(w, 1, padded_out)
    s3 = _pad_axis(s, 1, padded_out)[:, None, :]
    bm, bn = fit.block_m, fit.block_n
    num_row_blocks = _cdiv(rows, bm)
    kernel = functools.partial(_dx_kernel_gpu, fit=fit, precision=config.precision)
    dx3, dr_parts = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(x3.shape, x3.dtype),
            jax.ShapeDtypeStruct(
                (num_members, num_row_blocks, 1, in_features), jnp.float32
            ),
        ),
        grid=(num_members, num_row_blocks, _cdiv(in_features, bn)),
        in_specs=[
            pl.BlockSpec((None, bm, padded_out), lambda e, i, j: (e, i, 0)),
            pl.BlockSpec((bn, padded_out), lambda e, i, j: (j, 0)),
            pl.BlockSpec((None, 1, padded_out), lambda e, i, j: (e, 0, 0)),
            pl.BlockSpec((None, 1, bn), lambda e, i, j: (e, 0, j)),
            pl.BlockSpec((None, bm, bn), lambda e, i, j: (e, i, j)),
        ],
        out_specs=(
            pl.BlockSpec((None, bm, bn), lambda e, i, j: (e, i, j)),
            pl.BlockSpec((None, None, 1, bn), lambda e, i, j: (e, i, 0, j)),
        ),
        name="batch_ensemble_dense_dx",
        **_gpu_options(config),
    )(g3, w, s3, r[:, None, :], x3)
    return dx3, jnp.sum(dr_parts, axis=(1, 2))


def _dw_kernel_gpu(
    x_ref, g_ref, r_ref, s_ref, w_ref, dw_ref, ds_ref, *, fit, num_members, precision
):
    # Grid (in block, out block); loops over members and their rows.
    # x_ref (E, Rp, bm), g_ref (E, Rp, bn), r_ref (E, 1, bm), s_ref (E, 1, bn),
    # w_ref (bm, bn); ds_ref (E, 1, bn) holds this in block's partial ds.
    block_k, rows = fit.block_k, fit.k
    tile = (fit.block_m, fit.block_n)
    dot_dtype = x_ref.dtype
    # A row block never reads past the member's rows: the last one starts at
    # rows - block_k instead and masks the rows an earlier block already summed.
    x_row_ids = lax.broadcasted_iota(jnp.int32, (block_k, fit.block_m), 0)
    g_row_ids = lax.broadcasted_iota(jnp.int32, (block_k, fit.block_n), 0)
    in_ids = pl.program_id(0) * fit.block_m + lax.broadcasted_iota(jnp.int32, tile, 0)
    w = w_ref[...].astype(jnp.float32)

    def member_step(member, dw):
        def row_step(i, acc):
            start = jnp.minimum(i * block_k, rows - block_k)
            window = pl.ds(start, block_k)
            x = x_ref[member, window, :] * r_ref[member]
            x = jnp.where(start + x_row_ids >= i * block_k, x, 0).astype(dot_dtype)
            g = g_ref[member, window, :]
            g = jnp.where(start + g_row_ids >= i * block_k, g, 0).astype(dot_dtype)
            return acc + _dot(x, g, _TN, precision)

        grad = lax.fori_loop(
            0, _cdiv(rows, block_k), row_step, jnp.zeros(tile, jnp.float32)
        )
        # Rows of the tile past in_features hold garbage: keep them out of ds.
        products = jnp.where(in_ids < fit.m, w * grad, 0.0)
        ds_ref[member] = jnp.sum(products, axis=0, keepdims=True)
        return dw + grad * s_ref[member].astype(jnp.float32)

    dw = lax.fori_loop(0, num_members, member_step, jnp.zeros(tile, jnp.float32))
    dw_ref[...] = dw.astype(dw_ref.dtype)


def _dw_gpu(x3, w, r, s, g3, config: _Config):
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    # The row loop reads whole row blocks inside the member (see the kernel), so
    # a row block may not exceed the rows: tiny members are padded to 16 rows,
    # and the block is the largest power of two that fits.
    padded_rows = max(rows, _MIN_BLOCK)
    fit = _fit_gpu(in_features, out_features, padded_rows, config.blocks)
    row_block = min(fit.block_k, 1 << (padded_rows.bit_length() - 1))
    fit = dataclasses.replace(fit, block_k=row_block)
    x3 = _pad_axis(x3, 1, padded_rows)
    g3 = _pad_axis(g3, 1, padded_rows)
    bm, bn = fit.block_m, fit.block_n
    num_in_blocks = _cdiv(in_features, bm)
    kernel = functools.partial(
        _dw_kernel_gpu,
        fit=fit,
        num_members=num_members,
        precision=config.precision,
    )
    dw, ds_parts = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(w.shape, w.dtype),
            jax.ShapeDtypeStruct(
                (num_in_blocks, num_members, 1, out_features), jnp.float32
            ),
        ),
        grid=(num_in_blocks, _cdiv(out_features, bn)),
        in_specs=[
            pl.BlockSpec((num_members, padded_rows, bm), lambda i, j: (0, 0, i)),
            pl.BlockSpec((num_members, padded_rows, bn), lambda i, j: (0, 0, j)),
            pl.BlockSpec((num_members, 1, bm), lambda i, j: (0, 0, i)),
            pl.BlockSpec((num_members, 1, bn), lambda i, j: (0, 0, j)),
            pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        ],
        out_specs=(
            pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
            pl.BlockSpec((None, num_members, 1, bn), lambda i, j: (i, 0, 0, j)),
        ),
        name="batch_ensemble_dense_dw",
        **_gpu_options(config),
    )(x3, g3, r[:, None, :], s[:, None, :], w)
    return dw, jnp.sum(ds_parts, axis=(0, 2))


def _dx_kernel_tpu(
    g_ref, w_ref, s_ref, r_ref, x_ref, dx_ref, dr_ref, acc_ref, *, fit, precision
):
    # Grid (member, row block, in block, out block); out is "arbitrary".
    # Program ids are read at the top level: the interpreter cannot discharge
    # them inside a pl.when body.
    k, last_k = pl.program_id(3), pl.num_programs(3) - 1
    first_row = pl.program_id(1) * fit.block_m

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    scaled = g_ref[...].astype(jnp.float32) * s_ref[...].astype(jnp.float32)
    acc_ref[...] += _dot(scaled.astype(x_ref.dtype), w_ref[...], _NT, precision)

    @pl.when(k == last_k)
    def _store():
        dxr = acc_ref[...]
        dx_ref[...] = (dxr * r_ref[...].astype(jnp.float32)).astype(dx_ref.dtype)
        valid = _row_mask(first_row, dxr.shape, fit.m)
        contribution = jnp.where(valid, x_ref[...].astype(jnp.float32) * dxr, 0.0)
        dr_ref[...] = jnp.sum(contribution, axis=0, keepdims=True)


def _dx_tpu(x3, w, r, s, g3, config: _Config):
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    fit = _fit_tpu(rows, in_features, out_features, config.blocks)
    padded_out = fit.padded_k
    g3 = _pad_axis(g3, 2, padded_out)
    w = _pad_axis(w, 1, padded_out)
    s3 = _pad_axis(s, 1, padded_out)[:, None, :]
    bm, bn, bk = fit.block_m, fit.block_n, fit.block_k
    num_row_blocks = _cdiv(rows, bm)
    kernel = functools.partial(_dx_kernel_tpu, fit=fit, precision=config.precision)
    dx3, dr_parts = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(x3.shape, x3.dtype),
            jax.ShapeDtypeStruct(
                (num_members, num_row_blocks, 1, in_features), jnp.float32
            ),
        ),
        grid=(num_members, num_row_blocks, _cdiv(in_features, bn), padded_out // bk),
        in_specs=[
            pl.BlockSpec((None, bm, bk), lambda e, i, j, k: (e, i, k)),
            pl.BlockSpec((bn, bk), lambda e, i, j, k: (j, k)),
            pl.BlockSpec((None, 1, bk), lambda e, i, j, k: (e, 0, k)),
            pl.BlockSpec((None, 1, bn), lambda e, i, j, k: (e, 0, j)),
            pl.BlockSpec((None, bm, bn), lambda e, i, j, k: (e, i, j)),
        ],
        out_specs=(
            pl.BlockSpec((None, bm, bn), lambda e, i, j, k: (e, i, j)),
            pl.BlockSpec((None, None, 1, bn), lambda e, i, j, k: (e, i, 0, j)),
        ),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=_tpu_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=_tpu_interpret(config),
        name="batch_ensemble_dense_dx",
    )(g3, w, s3, r[:, None, :], x3)
    return dx3, jnp.sum(dr_parts, axis=(1, 2))


def _dw_kernel_tpu(
    x_ref,
    g_ref,
    r_ref,
    s_ref,
    w_ref,
    dw_ref,
    ds_ref,
    dw_acc_ref,
    grad_acc_ref,
    *,
    fit,
    precision,
):
    # Grid (in block, out block, member, row block); the last two are
    # "arbitrary": dw accumulates over members, G_k over a member's row blocks.
    # Program ids are read at the top level (see _dx_kernel_tpu).
    member, i = pl.program_id(2), pl.program_id(3)
    last_member = pl.num_programs(2) - 1
    last_row_block = pl.num_programs(3) - 1
    first_in = pl.program_id(0) * fit.block_m

    @pl.when((member == 0) & (i == 0))
    def _init_dw():
        dw_acc_ref[...] = jnp.zeros_like(dw_acc_ref)

    @pl.when(i == 0)
    def _init_grad():
        grad_acc_ref[...] = jnp.zeros_like(grad_acc_ref)

    first_row = i * fit.block_k
    x = x_ref[...] * r_ref[...]
    x = jnp.where(_row_mask(first_row, x.shape, fit.k), x, 0).astype(x_ref.dtype)
    g = g_ref[...]
    g = jnp.where(_row_mask(first_row, g.shape, fit.k), g, 0).astype(x_ref.dtype)
    grad_acc_ref[...] += _dot(x, g, _TN, precision)

    @pl.when(i == last_row_block)
    def _member_done():
        grad = grad_acc_ref[...]
        in_ids = first_in + lax.broadcasted_iota(jnp.int32, grad.shape, 0)
        products = jnp.where(in_ids < fit.m, w_ref[...].astype(jnp.float32) * grad, 0.0)
        ds_ref[...] = jnp.sum(products, axis=0, keepdims=True)
        dw_acc_ref[...] += grad * s_ref[...].astype(jnp.float32)

    @pl.when((member == last_member) & (i == last_row_block))
    def _store():
        dw_ref[...] = dw_acc_ref[...].astype(dw_ref.dtype)


def _dw_tpu(x3, w, r, s, g3, config: _Config):
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    # in is the last (lane) dimension of the x blocks; rows are not.
    fit = _fit_tpu(
        in_features,
        out_features,
        rows,
        config.blocks,
        m_on_lanes=True,
        k_on_lanes=False,
    )
    bm, bn, bk = fit.block_m, fit.block_n, fit.block_k
    num_in_blocks = _cdiv(in_features, bm)
    kernel = functools.partial(_dw_kernel_tpu, fit=fit, precision=config.precision)
    dw, ds_parts = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(w.shape, w.dtype),
            jax.ShapeDtypeStruct(
                (num_in_blocks, num_members, 1, out_features), jnp.float32
            ),
        ),
        grid=(num_in_blocks, _cdiv(out_features, bn), num_members, _cdiv(rows, bk)),
        in_specs=[
            pl.BlockSpec((None, bk, bm), lambda i, j, e, k: (e, k, i)),
            pl.BlockSpec((None, bk, bn), lambda i, j, e, k: (e, k, j)),
            pl.BlockSpec((None, 1, bm), lambda i, j, e, k: (e, 0, i)),
            pl.BlockSpec((None, 1, bn), lambda i, j, e, k: (e, 0, j)),
            pl.BlockSpec((bm, bn), lambda i, j, e, k: (i, j)),
        ],
        out_specs=(
            pl.BlockSpec((bm, bn), lambda i, j, e, k: (i, j)),
            pl.BlockSpec((None, None, 1, bn), lambda i, j, e, k: (i, e, 0, j)),
        ),
        scratch_shapes=[
            pltpu.VMEM((bm, bn), jnp.float32),
            pltpu.VMEM((bm, bn), jnp.float32),
        ],
        compiler_params=_tpu_params("parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=_tpu_interpret(config),
        name="batch_ensemble_dense_dw",
    )(x3, g3, r[:, None, :], s[:, None, :], w)
    return dw, jnp.sum(ds_parts, axis=(0, 2))


# --------------------------------------------------------------------------- #
# custom_vjp and backend dispatch
# --------------------------------------------------------------------------- #


def _backward_family(x3, w, r, s, g3, config, dx_fn, dw_fn):
    dx3, dr = dx_fn(x3, w, r, s, g3, config)
    dw, ds = dw_fn(x3, w, r, s, g3, config)
    return dx3, dw, dr, ds


def _backward_reference(x3, w, r, s, g3, config):
    def forward(x3, w, r, s):
        return dense_reference(
            x3, w, r, s, precision=config.precision, out_dtype=config.out_dtype
        )

    _, vjp = jax.vjp(forward, x3, w, r, s)
    dx3, dw, dr, ds = vjp(g3.astype(config.out_dtype))
    return dx3, dw, dr.astype(jnp.float32), ds.astype(jnp.float32)


def _forward(x3, w, r, s, bias, config: _Config):
    bias_args = () if bias is None else (bias,)

    def run(forward_fn):
        def branch(x3, w, r, s, *rest):
            *bias_args, branch_config = rest
            bias = bias_args[0] if bias_args else None
            return forward_fn(x3, w, r, s, bias, branch_config)

        return branch

    def reference(x3, w, r, s, *rest):
        *bias_args, branch_config = rest
        bias = bias_args[0] if bias_args else None
        return dense_reference(
            x3,
            w,
            r,
            s,
            bias,
            precision=branch_config.precision,
            out_dtype=branch_config.out_dtype,
        )

    return _dispatch_with_config(
        config,
        (x3, w, r, s, *bias_args),
        gpu=run(_forward_gpu),
        tpu=run(_forward_tpu),
        reference=reference,
    )


def _dispatch_with_config(config, args, *, gpu, tpu, reference):
    # Branch functions take the config as their last argument, so that the CPU
    # branch can run the GPU family with the interpreter switched on.
    if config.family == "gpu" or config.interpret is True:
        return gpu(*args, config)
    if config.family == "tpu" or config.interpret is not False:
        return tpu(*args, config)
    cpu_config = dataclasses.replace(config, family="gpu")
    return lax.platform_dependent(
        *args,
        cpu=lambda *a: gpu(*a, cpu_config),
        cuda=lambda *a: gpu(*a, config),
        tpu=lambda *a: tpu(*a, config),
        default=lambda *a: reference(*a, config),
    )


def _backward(x3, w, r, s, g3, config: _Config):
    return _dispatch_with_config(
        config,
        (x3, w, r, s, g3),
        gpu=lambda *a: _backward_family(*a, _dx_gpu, _dw_gpu),
        tpu=lambda *a: _backward_family(*a, _dx_tpu, _dw_tpu),
        reference=_backward_reference,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused(x3, w, r, s, bias, config: _Config):
    return _forward(x3, w, r, s, bias, config)


def _fused_fwd(x3, w, r, s, bias, config: _Config):
    # Residuals: the operands only (bias presence is in the static config, and
    # check_dtypes made every operand share x3's dtype); no activation-sized
    # intermediate is kept.
    return _forward(x3, w, r, s, bias, config), (x3, w, r, s)


def _fused_bwd(config: _Config, residuals, g3):
    x3, w, r, s = residuals
    dx3, dw, dr, ds = _backward(x3, w, r, s, g3, config)
    dbias = None
    if config.has_bias:
        dbias = jnp.sum(g3.astype(jnp.float32), axis=1).astype(x3.dtype)
    return dx3, dw, dr.astype(r.dtype), ds.astype(s.dtype), dbias


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_dense(
    inputs: jax.Array,
    kernel: jax.Array,
    r: jax.Array,
    s: jax.Array,
    bias: jax.Array | None = None,
    *,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    interpret: Any = False,
    block_sizes: BlockSizes | None = None,
    _family: str | None = None,
) -> jax.Array:
    """The Pallas implementation of ``batch_ensemble_dense(..., impl="pallas")``.

    Call :func:`ensembles.ops.batch_ensemble_dense` rather than this: it
    validates the shapes (``num_members`` is read from ``r`` here). This
    function checks the dtypes and block sizes and runs the fused kernel with
    its custom VJP.

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((2 * 3, 4))                    # E=2 members, B=3 rows each
    >>> r = jnp.stack([jnp.ones(4), 2 * jnp.ones(4)])
    >>> y = fused_dense(x, jnp.ones((4, 5)), r, jnp.ones((2, 5)), interpret=True)
    >>> y[:, 0]
    Array([4., 4., 4., 8., 8., 8.], dtype=float32)

    Args:
      inputs: ``[E*B, ..., in_features]`` member-major batch.
      kernel: the shared ``[in_features, out_features]`` kernel.
      r: ``[E, in_features]`` input fast weights.
      s: ``[E, out_features]`` output fast weights.
      bias: ``[E, out_features]`` bias, or ``None``.
      precision: matmul precision inside the kernels.
      preferred_element_type: output dtype: ``None`` (the operands' dtype) or
        float32. The kernels always accumulate in float32.
      interpret: ``False`` runs the compiled kernel of the platform (Triton on
        GPU, Mosaic on TPU; CPU, which has no compiled Pallas backend,
        interprets the GPU kernel). ``True`` runs the GPU kernel in Pallas'
        interpreter on any platform. A ``pltpu.InterpretParams(...)`` runs the
        TPU kernel in Pallas' TPU simulator.
      block_sizes: tile sizes, :class:`BlockSizes` (default: ``BlockSizes()``).
      _family: tests only: ``"gpu"`` or ``"tpu"`` interprets that kernel family.

    Returns:
      The ``[E*B, ..., out_features]`` outputs.

    Raises:
      TypeError: for unsupported dtypes or a ``block_sizes`` that is not a
        :class:`BlockSizes`.
    """
    if block_sizes is None:
        block_sizes = BlockSizes()
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(
            f"`block_sizes` must be an `ensembles.ops.pallas_dense.BlockSizes` or "
            f"None, got {block_sizes!r} of type {type(block_sizes).__name__}."
        )
    if _family not in (None, "gpu", "tpu"):
        raise ValueError(f"`_family` must be None, 'gpu' or 'tpu', got {_family!r}.")
    dtype = check_dtypes(inputs, kernel, r, s, bias, preferred_element_type)
    config = _Config(
        blocks=block_sizes,
        precision=precision,
        out_dtype=jnp.dtype(preferred_element_type or dtype),
        interpret=interpret,
        family=_family,
        has_bias=bias is not None,
    )
    num_members, in_features = r.shape
    out_features = kernel.shape[1]
    x3 = inputs.reshape(num_members, -1, in_features)
    y3 = _fused(x3, kernel, r, s, bias, config)
    return y3.reshape(*inputs.shape[:-1], out_features)
