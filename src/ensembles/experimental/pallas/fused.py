"""The fused op: padding, per-platform family choice, custom VJP.

``lax.platform_dependent`` picks, when lowering, one kernel family:

* ``cuda``: :mod:`.triton`, compiled.
* ``tpu``: :mod:`.mosaic_tpu`, compiled.
* ``cpu``: Pallas has no compiled CPU backend, so :mod:`.triton` runs in
  Pallas' interpreter (slow; for tests and debugging).
* any other platform (e.g. ROCm, never run): the ``jnp`` formulation
  :func:`dense_reference`.

:mod:`.mosaic_gpu` (Hopper, bfloat16; its backward in
:mod:`.mosaic_gpu_backward`) runs only where asked for (``family="hopper"``):
compiled with ``interpret=False``, in jax's Mosaic GPU interpreter otherwise.
It has not run on a GPU yet, so no platform picks it.

Every family runs on operands zero-padded to its :class:`~.blocks.Tiling`
(:func:`_pad_operands`), and the results are sliced back, so no kernel touches memory
outside an array. The VJP keeps only the operands ``(x, kernel, r, s)`` as
residuals: one kernel computes ``dx`` and per-row-block partials of ``dr``,
another ``dkernel`` and per-in-block partials of ``ds``; ``dbias`` is a sum of
the cotangent over each member's rows. Where the inputs carry no derivative
(a first layer: the VJP is defined with ``symbolic_zeros``, so its forward
rule sees which operands are perturbed), the input-gradient kernel does not
run and the kernel-gradient kernel forms ``dr`` from the per-member tiles it
reduces (:class:`~.common.Wanted`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ensembles.experimental.pallas import (
    budget,
    mosaic_gpu,
    mosaic_gpu_backward,
    mosaic_tpu,
    triton,
)
from ensembles.experimental.pallas.blocks import BlockSizes, pad_to, tiling
from ensembles.experimental.pallas.checks import check_dtypes, check_interpret
from ensembles.experimental.pallas.common import KernelConfig, Wanted

__all__ = ["FAMILIES", "dense_reference", "fused_dense"]

_FAMILIES = {"gpu": triton, "tpu": mosaic_tpu}

#: The kernel families :func:`fused_dense` can be asked for by name
#: (``family=``): ``"gpu"`` (Triton), ``"tpu"`` (Mosaic TPU), ``"hopper"``
#: (Mosaic GPU, bfloat16). ``None`` picks the platform's.
FAMILIES: tuple[str, ...] = ("gpu", "tpu", "hopper")


def dense_reference(x3, kernel, r, s, bias=None, *, precision=None, out_dtype=None):
    """The ``jnp`` formulation on the ``[E, R, in]`` member view.

    It is what the kernels compute, written plainly; it serves platforms without
    a kernel and the VJP's fallback, and documents the math next to the kernels.

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


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Everything static about one call of the fused op."""

    blocks: BlockSizes
    precision: Any
    out_dtype: Any
    # False: per-platform kernels; True: the "gpu" family in the generic
    # interpreter; a pltpu.InterpretParams: the "tpu" family in the simulator.
    interpret: Any
    # None: chosen per platform; "gpu" / "tpu": interpret that family (tests
    # run both families on CPU this way); "hopper": the Mosaic GPU forward,
    # compiled unless `interpret`.
    family: str | None
    has_bias: bool
    # The target is a TPU v2/v3, whose Mosaic matmul takes float32 only.
    float32_matmul: bool = False

    def kernel_config(self, interpret) -> KernelConfig:
        return KernelConfig(
            self.precision, self.out_dtype, interpret, self.float32_matmul
        )


def _tiling(family: str, x3, w, config: FusedConfig):
    return tiling(
        family,
        rows=x3.shape[1],
        in_features=x3.shape[2],
        out_features=w.shape[1],
        blocks=config.blocks,
    )


def _pad_operands(t, x3, w, r, s):
    """The operands zero-padded to the tiling ``t``; ``r``, ``s`` as ``[E, 1, D]``."""
    num_members = x3.shape[0]
    return (
        pad_to(x3, (num_members, t.rows, t.in_features)),
        pad_to(w, (t.in_features, t.out_features)),
        pad_to(r[:, None, :], (num_members, 1, t.in_features)),
        pad_to(s[:, None, :], (num_members, 1, t.out_features)),
    )


def _family_forward(family, x3, w, r, s, bias, config, interpret):
    num_members, rows = x3.shape[:2]
    out_features = w.shape[1]
    t = _tiling(family, x3, w, config)
    bias3 = None
    if bias is not None:
        bias3 = pad_to(bias[:, None, :], (num_members, 1, t.out_features))
    y3 = _FAMILIES[family].forward(
        *_pad_operands(t, x3, w, r, s), bias3, t, config.kernel_config(interpret)
    )
    return y3[:, :rows, :out_features]


def _sliced(array, *extents):
    """``array[:e0, :e1, ...]`` over its last axes, or ``None``."""
    if array is None:
        return None
    return array[(..., *(slice(None, e) for e in extents))]


def _family_backward(family, x3, w, r, s, g3, config, interpret, wanted):
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    t = _tiling(family, x3, w, config)
    g3 = pad_to(g3, (num_members, t.rows, t.out_features))
    dx3, dw, dr, ds = _FAMILIES[family].backward(
        *_pad_operands(t, x3, w, r, s),
        g3,
        t,
        config.kernel_config(interpret),
        wanted,
    )
    return (
        _sliced(dx3, rows, in_features),
        _sliced(dw, in_features, out_features),
        _sliced(dr, in_features),
        _sliced(ds, out_features),
    )


def _reference_forward(x3, w, r, s, bias, config):
    return dense_reference(
        x3, w, r, s, bias, precision=config.precision, out_dtype=config.out_dtype
    )


def _reference_backward(x3, w, r, s, g3, config, wanted):
    """JAX's derivative of the reference, for the gradients ``wanted`` only."""
    if not (wanted.inputs or wanted.params):
        return None, None, None, None

    def forward(x3, w, r, s):
        return _reference_forward(x3, w, r, s, None, config)

    g3 = g3.astype(config.out_dtype)
    dx3 = dw = dr = ds = None
    if wanted.inputs and wanted.params:
        _, vjp = jax.vjp(forward, x3, w, r, s)
        dx3, dw, dr, ds = vjp(g3)
    elif wanted.inputs:
        _, vjp = jax.vjp(lambda x3: forward(x3, w, r, s), x3)
        (dx3,) = vjp(g3)
    else:  # a first layer: JAX's derivative forms no dx
        _, vjp = jax.vjp(lambda w, r, s: forward(x3, w, r, s), w, r, s)
        dw, dr, ds = vjp(g3)
    if wanted.params:
        dr, ds = dr.astype(jnp.float32), ds.astype(jnp.float32)
    return dx3, dw, dr, ds


def _dispatch(config: FusedConfig, run_family, reference, *args):
    """Runs ``run_family(family, *args, config, interpret)`` for the platform."""
    if config.family is not None:
        # A named family runs interpreted: in the TPU simulator when given its
        # parameters, in Pallas' generic interpreter otherwise.
        interpret = config.interpret if config.interpret is not False else True
        return run_family(config.family, *args, config, interpret)
    if config.interpret is True:
        return run_family("gpu", *args, config, True)
    if config.interpret is not False:
        return run_family("tpu", *args, config, config.interpret)
    return lax.platform_dependent(
        *args,
        cpu=lambda *a: run_family("gpu", *a, config, True),
        cuda=lambda *a: run_family("gpu", *a, config, False),
        tpu=lambda *a: run_family("tpu", *a, config, False),
        default=lambda *a: reference(*a, config),
    )


def _check_budget(config: FusedConfig, where: budget.Target, dtype, x3_shape, w_shape):
    """Refuses tiles the compiled kernel for ``where`` has no memory for."""
    family = {"cuda": "gpu", "tpu": "tpu"}.get(where.platform)
    if config.interpret is not False or config.family is not None or family is None:
        return  # interpreted (no on-chip memory), or no kernel on that platform
    t = tiling(
        family,
        rows=x3_shape[1],
        in_features=x3_shape[2],
        out_features=w_shape[1],
        blocks=config.blocks,
    )
    budget.check_tiles(family, t, config.blocks, dtype, config.out_dtype, where)


def _forward(x3, w, r, s, bias, config: FusedConfig):
    # The bias is closed over, not passed: it may be None, and
    # platform_dependent's branches take arrays only.
    if config.family == "hopper":
        kernel_config = config.kernel_config(config.interpret)
        return mosaic_gpu.forward(x3, w, r, s, bias, kernel_config)

    def family_forward(family, x3, w, r, s, config, interpret):
        return _family_forward(family, x3, w, r, s, bias, config, interpret)

    def reference(x3, w, r, s, config):
        return _reference_forward(x3, w, r, s, bias, config)

    return _dispatch(config, family_forward, reference, x3, w, r, s)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused(x3, w, r, s, bias, config: FusedConfig):
    return _forward(x3, w, r, s, bias, config)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["operands"],
    meta_fields=["wanted", "bias_wanted"],
)
@dataclasses.dataclass(frozen=True)
class _Residuals:
    """The VJP's residuals: the operands, and which gradients are wanted."""

    operands: tuple  # (x3, kernel, r, s): no activation-sized intermediate
    wanted: Wanted
    bias_wanted: bool


def _fused_fwd(x3, w, r, s, bias, config: FusedConfig):
    # symbolic_zeros: each operand arrives as a CustomVJPPrimal, whose
    # `perturbed` says whether it carries a derivative. Inputs that do not
    # (a first layer) need no input gradient, so its kernel does not run;
    # the xla path asks the same of its tangents (ops/dense_batched.py).
    wanted = Wanted(
        inputs=x3.perturbed, params=w.perturbed or r.perturbed or s.perturbed
    )
    operands = (x3.value, w.value, r.value, s.value)
    bias_value = None if bias is None else bias.value
    residuals = _Residuals(
        operands, wanted, bias_wanted=bias is not None and bias.perturbed
    )
    return _forward(*operands, bias_value, config), residuals


def _fused_bwd(config: FusedConfig, residuals: _Residuals, g3):
    if type(g3) is SymbolicZero:  # the output carries no cotangent
        return None, None, None, None, None
    x3, w, r, s = residuals.operands
    wanted = residuals.wanted
    if config.family == "hopper":
        kernel_config = config.kernel_config(config.interpret)
        dx3, dw, dr, ds = mosaic_gpu_backward.backward(
            x3, w, r, s, g3, kernel_config, wanted
        )
        return _cotangents(residuals, g3, dx3, dw, dr, ds)

    def family_backward(family, x3, w, r, s, g3, config, interpret):
        return _family_backward(family, x3, w, r, s, g3, config, interpret, wanted)

    def reference(x3, w, r, s, g3, config):
        return _reference_backward(x3, w, r, s, g3, config, wanted)

    dx3, dw, dr, ds = _dispatch(config, family_backward, reference, x3, w, r, s, g3)
    return _cotangents(residuals, g3, dx3, dw, dr, ds)


def _cotangents(residuals: _Residuals, g3, dx3, dw, dr, ds):
    """The five cotangents in the operands' dtypes; ``dbias`` a sum over rows."""
    x3, _, r, s = residuals.operands
    dbias = None
    if residuals.bias_wanted:
        dbias = jnp.sum(g3.astype(jnp.float32), axis=1).astype(x3.dtype)
    if dr is not None:
        dr, ds = dr.astype(r.dtype), ds.astype(s.dtype)
    return dx3, dw, dr, ds, dbias


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


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
    family: str | None = None,
) -> jax.Array:
    """The Pallas implementation of ``batch_ensemble_dense(..., impl="pallas")``.

    Call :func:`ensembles.ops.batch_ensemble_dense` with ``impl="pallas"``
    rather than this: it validates the shapes (``num_members`` is read from
    ``r`` here). This function checks its own options and the dtypes and runs
    the fused kernel with its custom VJP.

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
        interprets the GPU kernel). ``True`` runs the GPU kernel (or the named
        ``family``) in Pallas' interpreter on any platform. A
        ``pltpu.InterpretParams(...)`` runs the TPU kernel (or the named
        ``family``: the Triton kernels run in it unchanged) in Pallas' TPU
        simulator, whose defaults raise on an out-of-bounds read and fill
        uninitialised memory with NaN. ``family="hopper"`` takes ``True`` or a
        ``plgpu.InterpretGPUParams(...)`` (jax's Mosaic GPU interpreter).
      block_sizes: tile sizes, :class:`BlockSizes` (default: ``BlockSizes()``).
        Compiled for a GPU or TPU (the default device, or the device of the
        mesh set while tracing), tiles that do not fit its shared memory or
        VMEM are refused here (``docs/fused_kernel.md``).
      family: one of :data:`FAMILIES` to run that kernel family instead of the
        platform's: ``"gpu"`` or ``"tpu"`` interprets it (tests run both on
        CPU this way); ``"hopper"`` runs the Mosaic GPU kernels of
        :mod:`.mosaic_gpu` and :mod:`.mosaic_gpu_backward` (bfloat16;
        compiled with ``interpret=False``, for a Hopper GPU; in jax's Mosaic
        GPU interpreter otherwise, jax >= 0.12). Not yet run on a GPU.

    Returns:
      The ``[E*B, ..., out_features]`` outputs.

    Raises:
      ValueError: if ``family`` is not one of :data:`FAMILIES`, or if the
        tiles do not fit the target chip's on-chip memory.
      TypeError: for unsupported dtypes, or an ``interpret`` or
        ``block_sizes`` of the wrong type.
    """
    if block_sizes is None:
        block_sizes = BlockSizes()
    elif not isinstance(block_sizes, BlockSizes):
        raise TypeError(
            f"`block_sizes` must be an `ensembles.experimental.pallas.BlockSizes` "
            f"or None, got {block_sizes!r} of type {type(block_sizes).__name__}."
        )
    if family is not None and family not in FAMILIES:
        raise ValueError(
            f"`family` must be None or one of {list(FAMILIES)}, got {family!r}."
        )
    check_interpret(interpret, family)
    dtype = check_dtypes(inputs, kernel, r, s, bias, preferred_element_type)
    if family == "hopper":
        mosaic_gpu.check_dtype(dtype)
    where = budget.target()
    config = FusedConfig(
        blocks=block_sizes,
        precision=precision,
        out_dtype=jnp.dtype(preferred_element_type or dtype),
        interpret=interpret,
        family=family,
        has_bias=bias is not None,
        float32_matmul=where.float32_matmul,
    )
    num_members, in_features = r.shape
    out_features = kernel.shape[1]
    if inputs.size == 0:
        # No rows: no kernel to launch (a zero-size grid), every output (none)
        # and every gradient (zero) known; the "xla" path agrees.
        return jnp.zeros((*inputs.shape[:-1], out_features), config.out_dtype)
    x3 = inputs.reshape(num_members, -1, in_features)
    _check_budget(config, where, dtype, x3.shape, kernel.shape)
    y3 = _fused(x3, kernel, r, s, bias, config)
    return y3.reshape(*inputs.shape[:-1], out_features)
