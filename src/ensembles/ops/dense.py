"""The BatchEnsemble dense op: its checks, the ``jnp`` formula, one custom derivative.

Member ``k`` of the op maps its rows ``[k*B, (k+1)*B)`` of the member-major batch
as if its kernel were ``kernel * outer(r[k], s[k])``. That is computed without
ever forming per-member kernels::

    y = ((x * r[k]) @ kernel) * s[k] + bias[k]

On one device the rows are viewed as ``[E, B, in]`` (a free reshape), scaled
by ``r``, multiplied by the kernel in one 2-D matmul over the flat rows,
scaled by ``s``; JAX differentiates that formula, which compiles to what a
plain dense layer's program does plus the elementwise scalings, in every
mode, with one exception. A layer whose inputs carry no derivative (a first
layer) would form ``dr`` through the input-gradient matmul ``(g * s) @ W^T``
that a plain dense layer's first-layer backward never does. There, given
enough rows per member (:data:`MEMBER_BACKWARD_MIN_ROWS`), the derivative is
written member by member (:func:`_member_tangent`), so that reverse mode forms
each member's kernel gradient ``M_k = x_k^T g_k`` in turn and reads ``dW``,
``dr_k`` and ``ds_k`` off it: the matmuls of a plain dense layer, and never an
``[E, in, out]`` array (``docs/cost.md`` has the measurements). It is a
``jax.custom_jvp``, so forward mode, ``hessian``, ``linear_transpose`` and
``vmap`` keep working.

Where the program may split the rows over devices
(:func:`ensembles.ops.groups.row_shards`), the rows are viewed as groups that
each device holds whole (:func:`dense_groups`, ``docs/scaling_out.md``).
``impl="pallas"`` runs the fused kernel of :mod:`ensembles.experimental.pallas`,
imported only when named.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ensembles._checks import (
    add_batch_axis_fix,
    as_operands,
    check_choice,
    check_member_batch,
    check_member_params,
    check_num_members,
)
from ensembles.ops import groups, platform
from ensembles.ops.dense_batched import member_matmul
from ensembles.ops.impls import IMPLS

__all__ = [
    "MEMBER_BACKWARD_MIN_ROWS",
    "batch_ensemble_dense",
    "check_shapes",
    "dense_groups",
    "dense_rows",
]

_FLAT = (((1,), (0,)), ((), ()))  # [rows, in] @ [in, out]

#: The fewest rows per member (``B`` times any middle axes) for which a first
#: layer's backward runs member by member (:func:`_member_tangent`). Its
#: reductions pass over ``E x in x out`` values where JAX's own backward does
#: an input-gradient matmul of ``E*B x in x out`` multiply-adds: measured on a
#: 2-core x86-64 CPU (``docs/cost.md``), the per-member backward wins from
#: about 64 rows (512 x 512) or 128 rows (1024 x 1024, 2048 x 2048) per member
#: and loses up to 2x below (32 rows: 2.7x against 1.4x a plain layer's).
MEMBER_BACKWARD_MIN_ROWS: int = 128


def check_shapes(inputs, kernel, r, s, bias, num_members: int) -> None:
    """Checks the dense op's array shapes (the message names the argument).

    Raises:
      ValueError: if a shape does not fit the others.
    """
    if inputs.ndim < 2:
        raise ValueError(
            f"`inputs` must have shape [E*B, ..., in_features] (at least 2 "
            f"dimensions), got shape {inputs.shape}. " + add_batch_axis_fix(num_members)
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
    check_member_batch(inputs.shape[0], num_members)
    check_member_params(
        r,
        s,
        bias,
        r_shape=(num_members, in_features),
        s_shape=(num_members, out_features),
        bias_shape=(num_members, out_features),
    )


# ------------------------------------------------------------ one device


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _scaled_matmul(x3, kernel, r, s, precision, preferred_element_type):
    """``((x * r) @ kernel) * s`` on the ``[E, B, in]`` view, one 2-D matmul."""
    num_members, _, in_features = x3.shape
    # Scale in the [E, B, in] view, multiply in the flat [E*B, in] view: XLA
    # fuses each scaling into one loop around a single 2-D dot, measurably
    # cheaper (forward and backward) than a 3-D einsum (docs/cost.md).
    z = lax.dot_general(
        (x3 * r[:, None, :]).reshape(-1, in_features),
        kernel,
        _FLAT,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    return z.reshape(num_members, -1, kernel.shape[1]) * s[:, None, :]


def _outer(a, b, precision, pet):
    """``outer(a, b)`` as a matmul: its transpose is a matrix-vector product."""
    return lax.dot_general(
        a[:, None], b[None, :], _FLAT, precision=precision, preferred_element_type=pet
    )


def _member_tangent(x3, kernel, r, s, dkernel, dr, ds, precision, pet):
    """The tangent of a layer whose inputs carry none, one member at a time.

    ``dy_k = x_k @ T_k`` with ``T_k`` the tangent of member ``k``'s kernel
    ``W * outer(r_k, s_k)``, in a ``lax.scan`` over the members. Its transpose
    (reverse mode) is a scan that forms ``M_k = x_k^T g_k`` for one member,
    adds ``M_k * outer(r_k, s_k)`` to ``dW`` and reads ``dr_k`` and ``ds_k``
    off ``M_k * W`` by two matrix-vector products, then moves on: the matmuls
    of a plain dense layer, and never more than one ``[in, out]`` gradient at
    a time (unrolled, XLA keeps all E alive). Every known factor it saves for
    the backward is a vector or ``W`` itself (``lax.mul`` broadcasts size-1
    axes: ``dkernel * r_k[:, None]`` saves ``[in, 1]``), never an ``[in, out]``
    product of primals, which the scan would stack into ``[E, in, out]``.
    """

    def member(_, operands):
        x_k, r_k, s_k, dr_k, ds_k = operands
        tangent = []
        if dkernel is not None:
            tangent.append((dkernel * r_k[:, None]) * s_k[None, :])
        if dr_k is not None:
            tangent.append(kernel * _outer(dr_k, s_k, precision, pet))
        if ds_k is not None:
            tangent.append(kernel * _outer(r_k, ds_k, precision, pet))
        return None, lax.dot_general(
            x_k, sum(tangent), _FLAT, precision=precision, preferred_element_type=pet
        )

    return lax.scan(member, None, (x3, r, s, dr, ds))[1]


def _scaled_matmul_jvp(precision, pet, primals, tangents):
    live = [type(t) is not SymbolicZero for t in tangents]
    rows = primals[0].shape[1]
    if not live[0] and any(live[1:]) and rows >= MEMBER_BACKWARD_MIN_ROWS:
        y = _scaled_matmul.fun(*primals, precision, pet)
        dkernel, dr, ds = (
            t if on else None for t, on in zip(tangents[1:], live[1:], strict=True)
        )
        dy = _member_tangent(*primals, dkernel, dr, ds, precision, pet)
        return y, dy.astype(y.dtype)

    def formula(*differentiated):
        operands = iter(differentiated)
        args = [
            next(operands) if on else a for a, on in zip(primals, live, strict=True)
        ]
        return _scaled_matmul.fun(*args, precision, pet)

    return jax.jvp(
        formula,
        [a for a, on in zip(primals, live, strict=True) if on],
        [t for t, on in zip(tangents, live, strict=True) if on],
    )


_scaled_matmul.defjvp(_scaled_matmul_jvp, symbolic_zeros=True)


# ------------------------------------------------------------ sharded rows


def dense_groups(
    inputs, kernel, r, s, bias, *, num_groups: int, precision, preferred_element_type
):
    """The op on the ``[G, R, ..., in]`` view: rows the program may shard.

    The rows are viewed as ``G`` groups (:mod:`ensembles.ops.groups`), each
    inside one member and each device's rows whole groups, and the members'
    vectors repeated to the groups; then the accelerators' formulation, one
    matmul batched over the groups (:func:`~ensembles.ops.dense_batched.member_matmul`),
    on every platform. Each device runs the groups it holds: the matmuls of
    a plain dense layer on its rows, a first layer's kernel gradients formed
    group by group where the rows are; what crosses devices is the shared
    kernel's gradient, as for a plain layer, and the fast weights'. Middle
    axes (tokens) are kept, so they may be sharded too.
    """
    x = inputs.reshape(num_groups, -1, *inputs.shape[1:])
    if isinstance(precision, list):  # a custom_jvp's static argument must hash
        precision = tuple(precision)
    y = member_matmul(
        x,
        kernel,
        groups.group_weights(r, num_groups, x),
        groups.group_weights(s, num_groups, x),
        precision,
        preferred_element_type,
    )
    if bias is not None:
        bias = groups.group_weights(bias, num_groups, x)
        y = y + bias.reshape(num_groups, *(1,) * (y.ndim - 2), -1)
    return y.reshape(*inputs.shape[:-1], kernel.shape[1])


# ----------------------------------------------------------------- the op


def dense_rows(
    inputs,
    kernel,
    r,
    s,
    bias,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
    impl: str = "xla",
    interpret: Any = False,
    block_sizes: Any = None,
) -> jax.Array:
    """The dense op on operands already checked (:func:`check_shapes`).

    What :func:`batch_ensemble_dense` runs after its checks, and what the
    layers (and the general and einsum ops) call with the options they
    checked once: the Pallas kernel where ``impl="pallas"``, the grouped view
    where the program may split the rows over devices (:func:`dense_groups`,
    :func:`ensembles.ops.groups.row_shards`), else one device's formulation
    for the platform the program is lowered for (the CPU's formula on the
    ``[E, B, in]`` view with its custom derivative, or the accelerators'
    :func:`~ensembles.ops.dense_batched.member_matmul`).

    Args:
      inputs: ``[E*B, ..., in_features]`` member-major batch.
      kernel: ``[in_features, out_features]``.
      r: ``[E, in_features]``; E is read from it.
      s: ``[E, out_features]``.
      bias: ``[E, out_features]`` or ``None``.
      precision: of every matmul, forward and backward.
      preferred_element_type: of every matmul, forward and backward.
      impl: ``"xla"`` or ``"pallas"`` (checked by the caller).
      interpret: ``"pallas"`` only (else a ``ValueError`` names it).
      block_sizes: ``"pallas"`` only (else a ``ValueError`` names it).

    Returns:
      The ``[E*B, ..., out_features]`` outputs.
    """
    if impl == "pallas":
        from ensembles.experimental import pallas  # opt-in: imported when named

        return pallas.fused_dense(
            inputs,
            kernel,
            r,
            s,
            bias,
            precision=precision,
            preferred_element_type=preferred_element_type,
            interpret=interpret,
            block_sizes=block_sizes,
        )
    if interpret is not False or block_sizes is not None:
        name = "interpret" if interpret is not False else "block_sizes"
        raise ValueError(
            f"`{name}` configures the Pallas kernel, but impl={impl!r} was asked "
            f'for. Use impl="pallas", or drop `{name}`.'
        )
    num_members, in_features = r.shape
    shards = groups.row_shards(inputs)
    if shards is not None:
        return dense_groups(
            inputs,
            kernel,
            r,
            s,
            bias,
            num_groups=groups.member_groups(
                num_rows=inputs.shape[0], num_members=num_members, shards=shards
            ),
            precision=precision,
            preferred_element_type=preferred_element_type,
        )
    if isinstance(precision, list):  # a custom_jvp's static argument must hash
        precision = tuple(precision)
    options = (precision, preferred_element_type)
    y = platform.by_platform(
        inputs.reshape(num_members, -1, in_features),
        kernel,
        r,
        s,
        cpu=lambda *operands: _scaled_matmul(*operands, *options),
        accelerator=lambda *operands: member_matmul(*operands, *options),
    )
    if bias is not None:
        y = y + bias[:, None, :]
    return y.reshape(*inputs.shape[:-1], kernel.shape[1])


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
    impl: str = "xla",
    interpret: Any = False,
    block_sizes: Any = None,
) -> jax.Array:
    """Applies a BatchEnsemble dense layer to a member-major batch.

    Rows ``[k*B, (k+1)*B)`` of ``inputs`` belong to member ``k``, whose effective
    kernel is ``kernel * outer(r[k], s[k])`` and whose bias is ``bias[k]``. The
    per-member kernels are never materialised: the op scales the inputs by ``r``,
    runs one shared matmul and scales the result by ``s``. It computes in the
    dtypes it is given (the layers promote their parameters and inputs first,
    as Flax does).

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

    Args:
      inputs: ``[E*B, ..., in_features]`` member-major batch; any number of middle
        axes (e.g. tokens or pixels) is allowed.
      kernel: the shared ``[in_features, out_features]`` kernel.
      r: ``[E, in_features]`` input fast weights.
      s: ``[E, out_features]`` output fast weights.
      bias: ``[E, out_features]`` per-member bias, or ``None``.
      num_members: the ensemble size E.
      precision: precision of every matmul, forward and backward, as for
        ``jax.lax.dot_general``.
      preferred_element_type: accumulation/output dtype of every matmul, as
        for ``jax.lax.dot_general``.
      impl: ``"xla"`` (the ``jnp`` formula, the default) or ``"pallas"``: the
        fused kernel of :mod:`ensembles.experimental.pallas` (Triton on GPU,
        Mosaic on TPU; on CPU only with ``interpret=True``, slow: for tests).
        Opt-in: it is imported only when named.
      interpret: ``"pallas"`` only: see
        :func:`ensembles.experimental.pallas.fused_dense`.
      block_sizes: ``"pallas"`` only: the kernel's tiles,
        :class:`ensembles.experimental.pallas.BlockSizes`.

    Returns:
      The ``[E*B, ..., out_features]`` outputs.

    Raises:
      ValueError: if a shape, ``num_members`` or ``impl`` is invalid, or if
        ``interpret``/``block_sizes`` are given without ``impl="pallas"``;
        the message names the argument and the fix.
      TypeError: if ``num_members`` is not an int, if ``interpret`` or
        ``block_sizes`` has the wrong type, or if ``impl="pallas"`` gets
        dtypes the kernel does not support.
    """
    num_members = check_num_members(num_members)
    impl = check_choice(impl, "impl", IMPLS)
    inputs, kernel, r, s, bias = as_operands(inputs, kernel, r, s, bias)
    check_shapes(inputs, kernel, r, s, bias, num_members)
    return dense_rows(
        inputs,
        kernel,
        r,
        s,
        bias,
        precision=precision,
        preferred_element_type=preferred_element_type,
        impl=impl,
        interpret=interpret,
        block_sizes=block_sizes,
    )
