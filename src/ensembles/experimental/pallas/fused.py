"""The fused op: dtype checks, padding, per-platform family choice, custom VJP.

``lax.platform_dependent`` picks, when lowering, one kernel family:

* ``cuda``: :mod:`.triton`, compiled.
* ``tpu``: :mod:`.mosaic_tpu`, compiled.
* ``cpu``: Pallas has no compiled CPU backend, so :mod:`.triton` runs in
  Pallas' interpreter (slow; for tests and debugging).
* any other platform (e.g. ROCm, never run): the ``jnp`` formulation
  :func:`dense_reference`.

:mod:`.mosaic_gpu` (Hopper, bfloat16, forward only) runs only where asked for
(``family="hopper"``): compiled with ``interpret=False``, in jax's Mosaic GPU
interpreter otherwise; its gradient is :func:`dense_reference`'s. It has not
run on a GPU yet, so no platform picks it.

Every family runs on operands zero-padded to its :class:`~.blocks.Tiling`
(:func:`_pad_operands`), and the results are sliced back, so no kernel touches memory
outside an array. The VJP keeps only the operands ``(x, kernel, r, s)`` as
residuals: one kernel computes ``dx`` and per-row-block partials of ``dr``,
another ``dkernel`` and per-in-block partials of ``ds``; ``dbias`` is a sum of
the cotangent over each member's rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ensembles.experimental.pallas import budget, mosaic_gpu, mosaic_tpu, triton
from ensembles.experimental.pallas.blocks import BlockSizes, pad_to, tiling
from ensembles.experimental.pallas.common import KernelConfig

__all__ = [
    "FAMILIES",
    "SUPPORTED_DTYPES",
    "check_dtypes",
    "dense_reference",
    "fused_dense",
]

#: The dtypes the fused kernel computes in (inputs and parameters alike).
SUPPORTED_DTYPES: tuple[jnp.dtype, ...] = (
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.bfloat16),
)

_FAMILIES = {"gpu": triton, "tpu": mosaic_tpu}

#: The kernel families :func:`fused_dense` can be asked for by name
#: (``family=``): ``"gpu"`` (Triton), ``"tpu"`` (Mosaic TPU), ``"hopper"``
#: (Mosaic GPU, forward only). ``None`` picks the platform's.
FAMILIES: tuple[str, ...] = ("gpu", "tpu", "hopper")


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


def _family_backward(family, x3, w, r, s, g3, config, interpret):
    num_members, rows, in_features = x3.shape
    out_features = w.shape[1]
    t = _tiling(family, x3, w, config)
    g3 = pad_to(g3, (num_members, t.rows, t.out_features))
    dx3, dw, dr, ds = _FAMILIES[family].backward(
        *_pad_operands(t, x3, w, r, s), g3, t, config.kernel_config(interpret)
    )
    return (
        dx3[:, :rows, :in_features],
        dw[:in_features, :out_features],
        dr[:, :in_features],
        ds[:, :out_features],
    )


def _reference_forward(x3, w, r, s, bias, config):
    return dense_reference(
        x3, w, r, s, bias, precision=config.precision, out_dtype=config.out_dtype
    )


def _reference_backward(x3, w, r, s, g3, config):
    def forward(x3, w, r, s):
        return _reference_forward(x3, w, r, s, None, config)

    _, vjp = jax.vjp(forward, x3, w, r, s)
    dx3, dw, dr, ds = vjp(g3.astype(config.out_dtype))
    return dx3, dw, dr.astype(jnp.float32), ds.astype(jnp.float32)


def _dispatch(config: FusedConfig, run_family, reference, *args):
    """Runs ``run_family(family, *args, config, interpret)`` for the platform."""
    if config.family == "hopper":
        # Only _fused_bwd gets here: the Hopper family has a forward kernel
        # only, its gradient is the reference's.
        return reference(*args, config)
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


def _check_interpret(interpret, family):
    """A TypeError unless ``interpret`` is one the kernel ``family`` runs in."""
    if isinstance(interpret, bool):
        return
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas import tpu as pltpu

    gpu_params = getattr(plgpu, "InterpretGPUParams", None)
    if isinstance(interpret, pltpu.InterpretParams) and family != "hopper":
        return
    if gpu_params is not None and isinstance(interpret, gpu_params):
        if family == "hopper":
            return
        raise TypeError(
            f"`interpret` {interpret!r} configures jax's Mosaic GPU interpreter, "
            f'which runs family="hopper" only; family={family!r} runs in the TPU '
            f"simulator: pass a `jax.experimental.pallas.tpu.InterpretParams`."
        )
    if family == "hopper":
        raise TypeError(
            f'family="hopper" runs in jax\'s Mosaic GPU interpreter: `interpret` '
            f"must be a bool or a `jax.experimental.pallas.mosaic_gpu."
            f"InterpretGPUParams` (jax >= 0.12), got {interpret!r} of type "
            f"{type(interpret).__name__}."
        )
    raise TypeError(
        f"`interpret` must be a bool or a "
        f"`jax.experimental.pallas.tpu.InterpretParams`, got {interpret!r} "
        f"of type {type(interpret).__name__}."
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


def _fused_fwd(x3, w, r, s, bias, config: FusedConfig):
    # Residuals: the operands only (check_dtypes made every operand share x3's
    # dtype); no activation-sized intermediate is kept.
    return _forward(x3, w, r, s, bias, config), (x3, w, r, s)


def _fused_bwd(config: FusedConfig, residuals, g3):
    x3, w, r, s = residuals
    dx3, dw, dr, ds = _dispatch(
        config, _family_backward, _reference_backward, x3, w, r, s, g3
    )
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
        CPU this way); ``"hopper"`` runs the Mosaic GPU forward kernel of
        :mod:`.mosaic_gpu` (bfloat16; compiled with ``interpret=False``, for a
        Hopper GPU; in jax's Mosaic GPU interpreter otherwise, jax >= 0.12;
        its gradient is :func:`dense_reference`'s). Not yet run on a GPU.

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
    _check_interpret(interpret, family)
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
