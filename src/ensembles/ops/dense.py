"""The BatchEnsemble dense op: validation, then the one path that runs.

Member ``k`` of the op maps its rows ``[k*B, (k+1)*B)`` of the member-major batch
as if its kernel were ``kernel * outer(r[k], s[k])``. That is computed without
ever forming per-member kernels::

    y = ((x * r[k]) @ kernel) * s[k] + bias[k]

The ``"xla"`` implementation below is that formula in ``jnp``, in one of two
forms. On one device it splits the members off with reshapes and runs one 2-D
matmul (the 2-D form is what XLA's CPU backend compiles best, forward and
backward: ``docs/cost.md``). Where a batch can be sharded (more than
one device) it never reshapes the row axis: each row gathers its member's fast
weights and bias, so XLA's SPMD partitioner keeps rows, middle axes and kernel
features sharded as the user placed them, for any E (see
:func:`rows_may_be_sharded` and ``docs/scaling_out.md``). Both are the
reference the tests compare every other implementation against. The
``"pallas"`` implementation is the fused GPU/TPU kernel of
:mod:`ensembles.ops.pallas`; which one ``"auto"`` runs is decided by the
measured table of :mod:`ensembles.ops.plan`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from ensembles._checks import check_member_shapes, check_num_members
from ensembles.ops import dense_xla, pallas
from ensembles.ops.plan import auto_impl, check_impl

__all__ = ["batch_ensemble_dense", "rows_may_be_sharded"]


def _check_dense_shapes(inputs, kernel, r, s, bias, num_members: int) -> None:
    if inputs.ndim < 2:
        raise ValueError(
            f"`inputs` must have shape [E*B, ..., in_features] (at least 2 "
            f"dimensions), got shape {inputs.shape}. Add a batch axis, e.g. "
            f"`inputs[None]`, and tile it with `ensembles.tile`."
        )
    if kernel.ndim != 2:
        raise ValueError(
            f"`kernel` must have shape [in_features, out_features], got shape "
            f"{kernel.shape}."
        )
    in_features, out_features = kernel.shape
    if not in_features or not out_features:
        raise ValueError(
            f"`kernel` must have at least one input and one output feature, got "
            f"shape {kernel.shape}."
        )
    if inputs.shape[-1] != in_features:
        raise ValueError(
            f"`inputs.shape[-1]` (={inputs.shape[-1]}) must equal in_features "
            f"(`kernel.shape[0]`={in_features}); got inputs of shape "
            f"{inputs.shape}."
        )
    check_member_shapes(
        inputs.shape[0], r, s, bias, num_members, in_features, out_features
    )


def _explicit_sharding(array) -> jax.sharding.NamedSharding | None:
    """``array``'s sharding if it is placed on an explicit mesh, else ``None``."""
    sharding = getattr(jax.typeof(array), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not mesh.explicit_axes:
        return None
    return sharding


def _row_members(inputs, num_members: int) -> jax.Array:
    """The member index of every row of ``inputs``, sharded as its rows are."""
    num_rows = inputs.shape[0]
    member = lax.broadcasted_iota(jnp.int32, (num_rows,), 0) // (
        num_rows // num_members
    )
    sharding = _explicit_sharding(inputs)
    if sharding is not None and sharding.spec and sharding.spec[0] is not None:
        member = jax.sharding.reshard(
            member, jax.sharding.NamedSharding(sharding.mesh, P(sharding.spec[0]))
        )
    return member


def _per_row(array, member, like) -> jax.Array:
    """``[E, features]`` -> ``[E*B, 1, ..., features]``: each row's member's slice.

    The result is placed as ``like``, the activation it scales, is placed
    (rows and features). Under an automatic mesh the partitioner infers that;
    under an explicit mesh it is spelled out, since a replicated result would
    make every device gather, and differentiate, the whole batch's fast weights.
    """
    sharding = _explicit_sharding(like)
    if sharding is None:
        rows = jnp.take(array, member, axis=0, mode="clip", indices_are_sorted=True)
    else:
        spec = (*sharding.spec, *(None,) * like.ndim)[: like.ndim]
        rows = array.at[member].get(
            mode="clip",
            indices_are_sorted=True,
            out_sharding=jax.sharding.NamedSharding(
                sharding.mesh, P(spec[0], spec[-1])
            ),
        )
    return rows.reshape(member.shape[0], *(1,) * (like.ndim - 2), array.shape[1])


def _dense_by_row(inputs, kernel, r, s, bias, *, precision, preferred_element_type):
    """The sharding-friendly path: the row axis is never reshaped.

    Each row takes its member's ``r``, ``s`` and bias with a gather by a member
    index computed from an iota, and the matmul contracts the feature axis of
    the inputs as they are. The partitioner then keeps every activation sharded
    however its rows (data parallelism, any E), middle axes (sequence
    parallelism) or the kernel's output features (model parallelism) are split,
    where the reshape to ``[E, rows, in]`` would all-gather rows that do not
    split along member boundaries (and is rejected outright under an explicit
    mesh).
    """
    member = _row_members(inputs, r.shape[0])
    y = lax.dot_general(
        inputs * _per_row(r, member, inputs),
        kernel,
        (((inputs.ndim - 1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    y = y * _per_row(s, member, y)
    if bias is not None:
        y = y + _per_row(bias, member, y)
    return y


def rows_may_be_sharded() -> bool:
    """Whether the dense ops take their sharding-friendly path.

    That is whenever this process sees more than one device (on many hosts:
    more than one in all), since only then can a batch be sharded. On one
    device the ops keep the member reshapes, which are a few percent faster
    to differentiate on CPU (the gather's transpose is a scatter-add).

    >>> rows_may_be_sharded()                        # one CPU device
    False
    """
    return jax.device_count() > 1


def _kernel_dtype(inputs, kernel, r, s, bias, preferred_element_type):
    """The operands' dtype if the Pallas kernel accepts this combination."""
    try:
        return pallas.check_dtypes(inputs, kernel, r, s, bias, preferred_element_type)
    except TypeError:
        return None  # "auto" then keeps the jnp formulation


def _check_pallas_options(impl: str, interpret: Any, block_sizes: Any) -> str:
    """Checks ``interpret`` and ``block_sizes``; ``interpret`` implies Pallas."""
    if not isinstance(interpret, bool | pltpu.InterpretParams):
        raise TypeError(
            f"`interpret` must be a bool or a "
            f"`jax.experimental.pallas.tpu.InterpretParams`, got {interpret!r} of "
            f"type {type(interpret).__name__}."
        )
    if block_sizes is not None and not isinstance(block_sizes, pallas.BlockSizes):
        raise TypeError(
            f"`block_sizes` must be an `ensembles.ops.BlockSizes` or None, got "
            f"{block_sizes!r} of type {type(block_sizes).__name__}."
        )
    uses_pallas = interpret is not False or block_sizes is not None
    if impl == "xla" and uses_pallas:
        name = "interpret" if interpret is not False else "block_sizes"
        raise ValueError(
            f'`{name}` configures the Pallas kernel, but impl="xla" was asked for. '
            f'Use impl="pallas" (or "auto"), or drop `{name}`.'
        )
    # Interpreting only makes sense for the kernel: it selects it under "auto".
    return "pallas" if impl == "auto" and interpret is not False else impl


def batch_ensemble_dense(
    inputs: jax.Array,
    kernel: jax.Array,
    r: jax.Array,
    s: jax.Array,
    bias: jax.Array | None = None,
    *,
    num_members: int,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    impl: str = "auto",
    interpret: bool | pltpu.InterpretParams = False,
    block_sizes: pallas.BlockSizes | None = None,
) -> jax.Array:
    """Applies a BatchEnsemble dense layer to a member-major batch.

    Rows ``[k*B, (k+1)*B)`` of ``inputs`` belong to member ``k``, whose effective
    kernel is ``kernel * outer(r[k], s[k])`` and whose bias is ``bias[k]``. The
    per-member kernels are never materialised: the op scales the inputs by ``r``,
    runs one shared matmul and scales the result by ``s``.

    The op computes in the dtypes it is given (the layers promote their
    parameters and inputs first, as Flax does).

    ``impl="pallas"`` runs the fused kernel (:mod:`ensembles.ops.pallas`):
    Triton on GPU, Mosaic on TPU, chosen when lowering; it applies ``* r`` as
    it loads input tiles and ``* s + bias`` before it stores output tiles, and
    has fused backward kernels. On CPU it can only run in Pallas' interpreter
    (slow; for tests and debugging).

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import batch_ensemble_dense
    >>> x = jnp.ones((2 * 3, 4))                    # E=2 members, B=3 rows each
    >>> kernel = jnp.ones((4, 5))
    >>> r = jnp.stack([jnp.ones(4), 2 * jnp.ones(4)])  # [E, in]
    >>> s = jnp.ones((2, 5))                          # [E, out]
    >>> y = batch_ensemble_dense(x, kernel, r, s, num_members=2)
    >>> y.shape
    (6, 5)
    >>> y[:, 0]
    Array([4., 4., 4., 8., 8., 8.], dtype=float32)
    >>> y_pallas = batch_ensemble_dense(x, kernel, r, s, num_members=2,
    ...                                 impl="pallas", interpret=True)
    >>> bool(jnp.allclose(y_pallas, y))
    True

    Args:
      inputs: ``[E*B, ..., in_features]`` member-major batch; any number of middle
        axes (e.g. tokens or pixels) is allowed.
      kernel: the shared ``[in_features, out_features]`` kernel.
      r: ``[E, in_features]`` input fast weights.
      s: ``[E, out_features]`` output fast weights.
      bias: ``[E, out_features]`` per-member bias, or ``None``.
      num_members: the ensemble size E.
      precision: matmul precision, as for ``jax.lax.dot_general``.
      preferred_element_type: accumulation/output dtype of the matmul, as for
        ``jax.lax.dot_general``.
      impl: ``"xla"`` (the ``jnp`` formulation), ``"pallas"`` (the fused
        Pallas kernel) or ``"auto"``: what the measured table of
        :mod:`ensembles.ops.plan` picks for the backend, shape and dtype
        (today ``"xla"`` everywhere; see
        :func:`ensembles.ops.plan.resolve_impl`).
      interpret: Pallas only. ``True`` runs the kernel in Pallas' interpreter
        on any backend (and selects ``"pallas"`` under ``"auto"``); a
        ``jax.experimental.pallas.tpu.InterpretParams`` runs the TPU kernel in
        Pallas' TPU simulator.
      block_sizes: Pallas only: the kernel's tiles,
        :class:`ensembles.ops.BlockSizes` (default: ``BlockSizes()``).

    Returns:
      The ``[E*B, ..., out_features]`` outputs.

    Raises:
      ValueError: if a shape, ``num_members`` or ``impl`` is invalid, or if
        ``interpret``/``block_sizes`` are given with ``impl="xla"``; the message
        names the argument and the fix.
      TypeError: if ``num_members`` is not an int, if ``interpret`` or
        ``block_sizes`` has the wrong type, or if ``impl="pallas"`` gets dtypes
        the kernel does not support.
    """
    num_members = check_num_members(num_members)
    impl = _check_pallas_options(check_impl(impl), interpret, block_sizes)
    inputs, kernel, r, s = (jnp.asarray(a) for a in (inputs, kernel, r, s))
    bias = None if bias is None else jnp.asarray(bias)
    _check_dense_shapes(inputs, kernel, r, s, bias, num_members)
    if impl == "auto":
        impl = auto_impl(
            shape=(math.prod(inputs.shape[:-1]) // num_members, *kernel.shape),
            dtype=_kernel_dtype(inputs, kernel, r, s, bias, preferred_element_type),
        )
    options = {"precision": precision, "preferred_element_type": preferred_element_type}
    if impl == "pallas":
        return pallas.fused_dense(
            inputs,
            kernel,
            r,
            s,
            bias,
            interpret=interpret,
            block_sizes=block_sizes,
            **options,
        )
    if rows_may_be_sharded():
        return _dense_by_row(inputs, kernel, r, s, bias, **options)
    return dense_xla.dense_by_member(inputs, kernel, r, s, bias, **options)
