"""The BatchEnsemble dense op: validation, the formulation rule, the one path.

Member ``k`` of the op maps its rows ``[k*B, (k+1)*B)`` of the member-major batch
as if its kernel were ``kernel * outer(r[k], s[k])``. That is computed without
ever forming per-member kernels::

    y = ((x * r[k]) @ kernel) * s[k] + bias[k]

``impl="xla"`` (the default) is that formula in ``jnp``. On one device it
views the rows as ``[E, B, in]`` (free: a reshape of the row axis) around one
2-D matmul, in the formulation :func:`choose_dense` finds cheapest for the
operands that are differentiated (:mod:`ensembles.ops.dense_formulations` holds
the math). Where a batch can be sharded (more than one device) it never
reshapes the row axis: each row gathers its member's fast weights and bias, so
XLA's SPMD partitioner keeps rows, middle axes and kernel features sharded as
the user placed them, for any E (:func:`rows_may_be_sharded`,
``docs/scaling_out.md``). ``impl="pallas"`` runs the fused GPU/TPU kernel of
:mod:`ensembles.experimental.pallas`, imported only when named.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ensembles._checks import (
    add_batch_axis_fix,
    as_operands,
    check_choice,
    check_member_shapes,
    check_num_members,
)
from ensembles.ops import dense_formulations as math
from ensembles.ops.autodiff import (
    BACKWARDS,
    FORWARDS,
    Formulation,
    Needs,
    Rules,
    define,
    static_precision,
)

__all__ = [
    "DENSE_COSTS",
    "IMPLS",
    "MAX_MEMBER_KERNELS_MEMORY",
    "CostModel",
    "batch_ensemble_dense",
    "choose_dense",
    "estimate",
    "member_kernels_fit",
    "rows_may_be_sharded",
]

#: What ``impl`` may name for the dense-like ops (dense, general, einsum):
#: ``"xla"``, the ``jnp`` formulation (the default, on every backend), and
#: ``"pallas"``, the fused kernel of :mod:`ensembles.experimental.pallas`.
IMPLS: tuple[str, ...] = ("xla", "pallas")


def _check_dense_shapes(inputs, kernel, r, s, bias, num_members: int) -> None:
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
    check_member_shapes(
        inputs.shape[0], r, s, bias, num_members, in_features, out_features
    )


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


# ---------------------------------------------------------------- the rule


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work of each kind, for one backend.

    A formulation's cost is the sum over its work of ``count * constant``; only
    differences between formulations matter, so the work every formulation
    shares (the plain matmul of the forward, ``dx``'s matmul) still counts but
    per-call overheads common to all do not.

    Attributes:
      dot: per multiply-add of a 2-D matmul over ``E*B`` rows.
      batched_dot: per multiply-add of the E-batched matmul of
        ``"member_kernels"``
        (``M_k = x_k^T g_k``).
      fold_dot: per multiply-add of the ``"fold"`` forward's batched matmul
        against the member kernels, including forming them.
      fold_element: per element of ``E x in x out`` when ``"fold"`` forms the
        member kernels (GPU: fused into the matmul, so ~0).
      activation: per element of one elementwise pass over ``[E*B, in]`` or
        ``[E*B, out]`` (a scaling, or a product-and-row-sum).
      kernel_element: per element of one pass over the ``E x in x out`` kernel
        gradients ``M_k`` (a reduction to ``dW``, ``dr`` or ``ds``).
    """

    dot: float
    batched_dot: float
    fold_dot: float
    fold_element: float
    activation: float
    kernel_element: float


#: The measured constants of :func:`choose_dense`, per ``jax.default_backend()``
#: (read when tracing). ``docs/cost.md`` says where, when and how each was
#: measured. A backend without a row runs ``Formulation()``, the formulation
#: plain differentiation of the formula would: no unmeasured choice reaches a
#: user's step.
DENSE_COSTS: dict[str, CostModel] = {
    "cpu": CostModel(
        dot=3.2e-11,
        batched_dot=3.5e-11,
        fold_dot=4.0e-11,
        fold_element=1.5e-9,
        activation=1.0e-9,
        kernel_element=0.5e-9,
    ),
}

#: The most memory the ``"member_kernels"`` backward may take: its ``M_k``
#: (``E x in x out`` values) at most this many times the layer's activations
#: (``E*B x (in + out)``). Every shape measured in ``docs/cost.md`` is within
#: 4; beyond, a step that fits in memory with plain differentiation could stop
#: fitting (``E = 16``, ``B = 64``, ``in = out = 8192``: 4 GiB of ``M_k`` in
#: float32 against 64 MiB of activations), whatever the time model says.
MAX_MEMBER_KERNELS_MEMORY: float = 4.0


def estimate(
    formulation: Formulation,
    num_members: int,
    rows: int,
    in_features: int,
    out_features: int,
    needs: Needs,
    model: CostModel,
) -> float:
    """The modelled time of ``formulation`` (forward, and backward for ``needs``).

    >>> cpu = DENSE_COSTS["cpu"]
    >>> first_layer = Needs(kernel=True, r=True, s=True)
    >>> kernels = estimate(Formulation("scale", "member_kernels"), 4, 256, 1024,
    ...                    1024, first_layer, cpu)
    >>> activations = estimate(Formulation("scale", "scaled_activations"), 4,
    ...                        256, 1024, 1024, first_layer, cpu)
    >>> kernels < activations      # one matmul fewer in the backward
    True

    Args:
      formulation: the formulation to cost.
      num_members: E.
      rows: rows per member B (middle axes included).
      in_features: in.
      out_features: out.
      needs: which operands are differentiated.
      model: the backend's constants.

    Returns:
      Seconds, in the model.
    """
    members_rows = num_members * rows
    macs = members_rows * in_features * out_features
    activations_in = members_rows * in_features
    activations_out = members_rows * out_features
    member_kernels = num_members * in_features * out_features
    if formulation.forward == "scale":
        cost = model.dot * macs + model.activation * (activations_in + activations_out)
    else:
        cost = model.fold_dot * macs + model.fold_element * member_kernels
    activation_dr = needs.r and formulation.backward == "scaled_activations"
    if needs.inputs or activation_dr:
        # u = (g * s) @ W^T, then dx = u * r and/or dr = rowsum(u * x).
        passes = 1 + needs.inputs + activation_dr
        cost += model.dot * macs + model.activation * (
            activations_out + (passes - 1) * activations_in
        )
    if formulation.backward == "scaled_activations":
        if needs.kernel:
            cost += model.dot * macs + model.activation * (
                activations_in + activations_out
            )
        if needs.s:
            cost += model.activation * activations_out
    elif needs.params:
        # M_k (one extra pass to write it), then one reduction over it per
        # gradient; ds reads z instead where the "scale" forward saved it.
        s_from_kernels = needs.s and formulation.forward == "fold"
        passes = 1 + needs.kernel + needs.r + s_from_kernels
        cost += model.batched_dot * macs + model.kernel_element * (
            passes * member_kernels
        )
        if needs.s and not s_from_kernels:
            cost += model.activation * activations_out
    return cost


def member_kernels_fit(
    num_members: int, rows: int, in_features: int, out_features: int
) -> bool:
    """Whether ``"member_kernels"`` stays within :data:`MAX_MEMBER_KERNELS_MEMORY`.

    >>> member_kernels_fit(4, 256, 1024, 1024)
    True
    >>> member_kernels_fit(16, 64, 8192, 8192)
    False
    """
    member_kernels = num_members * in_features * out_features
    activations = num_members * rows * (in_features + out_features)
    return member_kernels <= MAX_MEMBER_KERNELS_MEMORY * activations


def choose_dense(
    num_members: int,
    rows: int,
    in_features: int,
    out_features: int,
    needs: Needs,
    *,
    backend: str | None = None,
) -> Formulation:
    """The dense op's rule: the formulation its backend's cost model finds cheapest.

    ``"fold"`` with a ``"scaled_activations"`` backward is no candidate when
    ``ds`` is differentiated (that ``ds`` reads the ``"scale"`` forward's
    unscaled product); ``"member_kernels"`` only where
    :func:`member_kernels_fit` (memory, not time). A backend with no row in
    :data:`DENSE_COSTS` gets ``Formulation()``.

    >>> choose_dense(4, 256, 1024, 1024, Needs(kernel=True, r=True, s=True),
    ...              backend="cpu")
    Formulation(forward='scale', backward='member_kernels')
    >>> choose_dense(4, 256, 1024, 1024, Needs(True, True, True, True),
    ...              backend="cpu")
    Formulation(forward='scale', backward='scaled_activations')

    Args:
      num_members: E.
      rows: rows per member B (middle axes included).
      in_features: in.
      out_features: out.
      needs: which operands are differentiated.
      backend: a key of :data:`DENSE_COSTS`; default ``jax.default_backend()``.

    Returns:
      The cheapest :class:`~ensembles.ops.Formulation`.
    """
    model = DENSE_COSTS.get(backend or jax.default_backend())
    if model is None:
        return Formulation()
    candidates = [
        Formulation(forward, backward)
        for forward in FORWARDS
        for backward in (BACKWARDS if needs.params else ("scaled_activations",))
        if not (forward == "fold" and backward == "scaled_activations" and needs.s)
        and not (
            backward == "member_kernels"
            and not member_kernels_fit(num_members, rows, in_features, out_features)
        )
    ]
    return min(
        candidates,
        key=lambda f: estimate(
            f, num_members, rows, in_features, out_features, needs, model
        ),
    )


def _plan(x3, kernel, r, s, config: math.DenseConfig, needs: Needs) -> Formulation:
    num_members, rows, in_features = x3.shape
    formulation = config.formulation or choose_dense(
        num_members, rows, in_features, kernel.shape[1], needs
    )
    return formulation.runnable(needs, x3, kernel, r, s)


_dense = define(
    Rules(
        name="batch_ensemble_dense",
        plan=_plan,
        keeps_product=math.keeps_product,
        forward=math.forward,
        tangent=math.tangent,
        backward=math.backward,
    )
)


def _dense_by_member(inputs, kernel, r, s, bias, config: math.DenseConfig):
    """The one-device path: the rows split into members by a free reshape."""
    num_members, in_features = r.shape
    y = _dense(inputs.reshape(num_members, -1, in_features), kernel, r, s, config)
    if bias is not None:
        y = y + bias[:, None, :]
    return y.reshape(*inputs.shape[:-1], kernel.shape[1])


# ----------------------------------------------------------------- the op


def _check_pallas_options(impl: str, interpret: Any, block_sizes: Any) -> None:
    """``interpret`` and ``block_sizes`` configure the kernel: ``impl="pallas"``."""
    for name, value, unset in (
        ("interpret", interpret, False),
        ("block_sizes", block_sizes, None),
    ):
        if value is not unset and impl != "pallas":
            raise ValueError(
                f"`{name}` configures the Pallas kernel, but impl={impl!r} was "
                f'asked for. Use impl="pallas", or drop `{name}`.'
            )
    if impl == "pallas" and not isinstance(interpret, bool):
        from jax.experimental.pallas import tpu as pltpu

        if not isinstance(interpret, pltpu.InterpretParams):
            raise TypeError(
                f"`interpret` must be a bool or a "
                f"`jax.experimental.pallas.tpu.InterpretParams`, got {interpret!r} "
                f"of type {type(interpret).__name__}."
            )
    if block_sizes is not None:
        from ensembles.experimental.pallas import BlockSizes

        if not isinstance(block_sizes, BlockSizes):
            raise TypeError(
                f"`block_sizes` must be an "
                f"`ensembles.experimental.pallas.BlockSizes` or None, got "
                f"{block_sizes!r} of type {type(block_sizes).__name__}."
            )


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
    formulation: Formulation | None = None,
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
      precision: matmul precision, as for ``jax.lax.dot_general``.
      preferred_element_type: accumulation/output dtype of the matmul, as for
        ``jax.lax.dot_general``.
      impl: ``"xla"`` (the ``jnp`` formulation, the default) or ``"pallas"``:
        the fused kernel of :mod:`ensembles.experimental.pallas` (Triton on
        GPU, Mosaic on TPU; on CPU only with ``interpret=True``, slow: for
        tests). Opt-in: it is imported only when named.
      formulation: ``"xla"`` on one device only: a
        :class:`~ensembles.ops.Formulation` to run instead of the one
        :func:`choose_dense` picks (tests, benchmarks); it still falls back to
        ``"scale"`` where ``"fold"`` cannot run.
      interpret: ``"pallas"`` only: ``True`` runs the kernel in Pallas'
        interpreter on any backend; a
        ``jax.experimental.pallas.tpu.InterpretParams`` runs the TPU kernel in
        Pallas' TPU simulator.
      block_sizes: ``"pallas"`` only: the kernel's tiles,
        :class:`ensembles.experimental.pallas.BlockSizes`.

    Returns:
      The ``[E*B, ..., out_features]`` outputs.

    Raises:
      ValueError: if a shape, ``num_members`` or ``impl`` is invalid, if
        ``interpret``/``block_sizes`` are given without ``impl="pallas"``, or
        ``formulation`` with ``impl="pallas"`` or on more than one device;
        the message names the argument and the fix.
      TypeError: if ``num_members`` is not an int, if ``formulation``,
        ``interpret`` or ``block_sizes`` has the wrong type, or if
        ``impl="pallas"`` gets dtypes the kernel does not support.
    """
    num_members = check_num_members(num_members)
    impl = check_choice(impl, "impl", IMPLS)
    _check_pallas_options(impl, interpret, block_sizes)
    if formulation is not None and not isinstance(formulation, Formulation):
        raise TypeError(
            f"`formulation` must be an `ensembles.ops.Formulation` or None, got "
            f"{formulation!r} of type {type(formulation).__name__}."
        )
    if formulation is not None and (impl == "pallas" or rows_may_be_sharded()):
        raise ValueError(
            f'`formulation` forces one of the one-device "xla" formulations, but '
            f"this call runs "
            f"{'the Pallas kernel' if impl == 'pallas' else 'the sharded-rows path'}"
            f" ({jax.device_count()} devices): drop `formulation`."
        )
    inputs, kernel, r, s, bias = as_operands(inputs, kernel, r, s, bias)
    _check_dense_shapes(inputs, kernel, r, s, bias, num_members)
    options = {"precision": precision, "preferred_element_type": preferred_element_type}
    if impl == "pallas":
        from ensembles.experimental import pallas  # opt-in: imported when named

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
        return math.dense_by_row(inputs, kernel, r, s, bias, **options)
    config = math.DenseConfig(
        static_precision(precision), preferred_element_type, formulation
    )
    return _dense_by_member(inputs, kernel, r, s, bias, config)
