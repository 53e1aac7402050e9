"""What runs: every decision an op makes, from the tables of :mod:`.cost`.

* :func:`resolve_impl`: which implementation (``"xla"`` or the fused
  ``"pallas"`` kernel) a dense-like op runs for ``impl="auto"``;
* :func:`choose`: which ``"xla"`` dense :class:`Formulation` (forward and
  backward) runs, for exactly the operands that are differentiated;
* :func:`choose_conv`: which ``"xla"`` convolution forward and backward run
  (the backward from :func:`choose_conv_backward`).

Each is made once per call (the formulations when the op is differentiated,
see :mod:`ensembles.ops.autodiff`), here and nowhere else.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ensembles._checks import check_choice
from ensembles.ops.autodiff import PARAM_GRADIENTS, Needs
from ensembles.ops.cost import (
    AUTO_TABLE,
    COST_MODELS,
    FOLD_MEASURED,
    KERNELS_MEASURED,
    MAX_KERNELS_MEMORY,
    CostModel,
)

__all__ = [
    "CONV_IMPLS",
    "FORWARDS",
    "IMPLS",
    "Formulation",
    "auto_impl",
    "can_fold",
    "check_impl",
    "choose",
    "choose_conv",
    "choose_conv_backward",
    "estimate",
    "kernels_fit",
    "resolve_impl",
    "runnable",
]

#: The implementations the dense-like ops (dense, general, einsum) accept as
#: ``impl``; the convolutions accept :data:`CONV_IMPLS`.
IMPLS: tuple[str, ...] = ("auto", "xla", "pallas")
CONV_IMPLS: tuple[str, ...] = ("auto", "xla")


def check_impl(impl: str, impls: tuple[str, ...] = IMPLS) -> str:
    """Returns ``impl`` if it is one of ``impls``; a ValueError naming it if not.

    >>> check_impl("xla")
    'xla'
    """
    return check_choice(impl, "impl", impls)


def resolve_impl(
    impl: str,
    *,
    backend: str | None = None,
    shape: tuple[int, int, int] | None = None,
    dtype: jnp.dtype | None = None,
    impls: tuple[str, ...] = IMPLS,
) -> str:
    """Checks ``impl`` and resolves ``"auto"`` to what runs on a backend.

    ``"auto"`` takes the first row of :data:`AUTO_TABLE` that covers the
    backend, shape and dtype, and ``"xla"`` where none does or where ``shape``
    or ``dtype`` is not given (the convolutions give neither). The choice is
    made when tracing, from ``jax.default_backend()``; to lower ahead of time
    for another platform, name ``impl`` explicitly.

    >>> import jax.numpy as jnp
    >>> resolve_impl("auto")                          # on this CPU
    'xla'
    >>> resolve_impl("auto", backend="gpu", shape=(256, 1024, 1024),
    ...              dtype=jnp.bfloat16)               # measured: xla wins
    'xla'
    >>> resolve_impl("pallas")
    'pallas'

    Args:
      impl: one of ``impls``.
      backend: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (default:
        ``jax.default_backend()``).
      shape: ``(rows_per_member, in_features, out_features)`` of the problem.
      dtype: the operands' common dtype (``None`` if they differ).
      impls: the implementations the op accepts (:data:`IMPLS` or
        :data:`CONV_IMPLS`).

    Returns:
      The concrete implementation name.
    """
    check_impl(impl, impls)
    if impl != "auto":
        return impl
    return auto_impl(backend=backend, shape=shape, dtype=dtype)


def auto_impl(
    *,
    backend: str | None = None,
    shape: tuple[int, int, int] | None = None,
    dtype: jnp.dtype | None = None,
) -> str:
    """What ``impl="auto"`` runs: the first :data:`~.cost.AUTO_TABLE` row's choice.

    ``"xla"`` where no row covers the problem, or where ``shape`` or ``dtype``
    is not given. Arguments as for :func:`resolve_impl`.

    >>> auto_impl(backend="cpu", shape=(256, 1024, 1024), dtype="float32")
    'xla'
    """
    backend = jax.default_backend() if backend is None else backend
    if shape is None or dtype is None:
        return "xla"
    for choice in AUTO_TABLE:
        if choice.covers(backend, *shape, dtype):
            return choice.impl
    return "xla"


#: The forward formulations of the ``"xla"`` dense op: scale the activations
#: around one shared matmul, or fold ``W * outer(r_k, s_k)`` into E kernels.
FORWARDS: tuple[str, ...] = ("scale", "fold")


@dataclasses.dataclass(frozen=True)
class Formulation:
    """How the op computes its output and the gradients of its parameters.

    Attributes:
      forward: ``"scale"`` or ``"fold"`` (see :mod:`ensembles.ops.dense_xla`).
      params: ``"activations"`` or ``"kernels"``: how ``dW``, ``dr`` and ``ds``
        are formed. Irrelevant when no parameter is differentiated.
    """

    forward: str = "scale"
    params: str = "activations"

    def __post_init__(self):
        if self.forward not in FORWARDS:
            raise ValueError(
                f"`forward` must be one of {FORWARDS}, got {self.forward!r}."
            )
        if self.params not in PARAM_GRADIENTS:
            raise ValueError(
                f"`params` must be one of {PARAM_GRADIENTS}, got {self.params!r}."
            )


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

    >>> cpu = COST_MODELS["cpu"]
    >>> first_layer = Needs(kernel=True, r=True, s=True)
    >>> kernels = estimate(Formulation("scale", "kernels"), 4, 256, 1024, 1024,
    ...                    first_layer, cpu)
    >>> activations = estimate(Formulation("scale", "activations"), 4, 256,
    ...                        1024, 1024, first_layer, cpu)
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
    activation_dr = needs.r and formulation.params == "activations"
    if needs.inputs or activation_dr:
        # u = (g * s) @ W^T, then dx = u * r and/or dr = rowsum(u * x).
        passes = 1 + needs.inputs + activation_dr
        cost += model.dot * macs + model.activation * (
            activations_out + (passes - 1) * activations_in
        )
    if formulation.params == "activations":
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


def kernels_fit(
    num_members: int, rows: int, in_features: int, out_features: int
) -> bool:
    """Whether the ``"kernels"`` backward stays within :data:`MAX_KERNELS_MEMORY`.

    >>> kernels_fit(4, 256, 1024, 1024), kernels_fit(16, 64, 8192, 8192)
    (True, False)
    """
    member_kernels = num_members * in_features * out_features
    activations = num_members * rows * (in_features + out_features)
    return member_kernels <= MAX_KERNELS_MEMORY * activations


def choose(
    num_members: int,
    rows: int,
    in_features: int,
    out_features: int,
    needs: Needs,
    *,
    can_fold: bool = True,
    backend: str | None = None,
) -> Formulation:
    """The formulation the cost model of ``backend`` finds cheapest.

    ``"fold"`` is only a candidate when ``can_fold`` (the operands share one
    dtype); ``"activations"`` needs the ``"scale"`` forward when ``ds`` is
    differentiated (its ``ds`` reads the forward's unscaled product);
    ``"kernels"`` only where :func:`kernels_fit` (memory, not time).

    >>> choose(4, 256, 1024, 1024, Needs(kernel=True, r=True, s=True),
    ...        backend="cpu")
    Formulation(forward='scale', params='kernels')
    >>> choose(4, 256, 1024, 1024, Needs(inputs=True, kernel=True, r=True, s=True),
    ...        backend="cpu")
    Formulation(forward='scale', params='activations')

    Args:
      num_members: E.
      rows: rows per member B (middle axes included).
      in_features: in.
      out_features: out.
      needs: which operands are differentiated.
      can_fold: whether ``"fold"`` may be used.
      backend: a key of :data:`COST_MODELS`; default ``jax.default_backend()``
        (unknown backends use the CPU row).

    Returns:
      The cheapest :class:`Formulation`.
    """
    model = COST_MODELS.get(backend or jax.default_backend(), COST_MODELS["cpu"])
    candidates = [
        Formulation(forward, params)
        for forward in (FORWARDS if can_fold else ("scale",))
        for params in (model.param_gradients if needs.params else ("activations",))
        if not (forward == "fold" and params == "activations" and needs.s)
        and not (
            params == "kernels"
            and not kernels_fit(num_members, rows, in_features, out_features)
        )
    ]
    return min(
        candidates,
        key=lambda f: estimate(
            f, num_members, rows, in_features, out_features, needs, model
        ),
    )


def choose_conv_backward(
    needs: Needs, feature_group_count: int, backend: str | None = None
) -> str:
    """``"activations"`` or ``"kernels"``: the measured-faster conv backward.

    >>> choose_conv_backward(Needs(kernel=True, r=True, s=True), 1, backend="cpu")
    'kernels'
    >>> choose_conv_backward(Needs(kernel=True, r=True, s=True), 2,
    ...                      backend="cpu")  # grouped
    'activations'

    Args:
      needs: which operands are differentiated.
      feature_group_count: the convolution's G; only G = 1 can use
        ``"kernels"`` (a grouped kernel's ``dr`` would need a regrouping that
        is not written).
      backend: a key of :data:`KERNELS_MEASURED`; default
        ``jax.default_backend()`` (an unknown backend gets ``"activations"``).

    Returns:
      The name of the backward formulation.
    """
    if not needs.params or feature_group_count != 1:
        return "activations"
    row = KERNELS_MEASURED.get(backend or jax.default_backend())
    if row is None:
        return "activations"
    return "kernels" if (row.hidden if needs.inputs else row.first) else "activations"


def choose_conv(
    needs: Needs,
    feature_group_count: int,
    *,
    can_fold: bool = True,
    backend: str | None = None,
) -> Formulation:
    """The measured-faster convolution :class:`Formulation`, forward and backward.

    The forward is ``"fold"`` where :data:`~.cost.FOLD_MEASURED` says so and
    the operands share one dtype (``can_fold``), except where the backward is
    ``"activations"`` with ``ds`` differentiated (it reads the ``"scale"``
    forward's unscaled product); the backward is
    :func:`choose_conv_backward`'s.

    >>> choose_conv(Needs(kernel=True, r=True, s=True), 1, backend="gpu")
    Formulation(forward='scale', params='activations')

    Args:
      needs: which operands are differentiated.
      feature_group_count: the convolution's G.
      can_fold: whether ``"fold"`` may be used.
      backend: a key of the tables; default ``jax.default_backend()``.

    Returns:
      The formulation.
    """
    backend = backend or jax.default_backend()
    params = choose_conv_backward(needs, feature_group_count, backend)
    row = FOLD_MEASURED.get(backend)
    fold = can_fold and row is not None and row.fold
    return runnable(Formulation("fold" if fold else "scale", params), needs, can_fold)


def can_fold(*operands) -> bool:
    """Whether ``"fold"`` may run: the operands share one dtype.

    >>> import jax.numpy as jnp
    >>> can_fold(jnp.ones(2), jnp.ones(2, jnp.bfloat16))
    False

    Args:
      *operands: the op's arrays (inputs, kernel, r, s).

    Returns:
      ``True`` if every operand has the same dtype.
    """
    return len({jnp.dtype(a.dtype) for a in operands}) == 1


def runnable(formulation: Formulation, needs: Needs, can_fold: bool) -> Formulation:
    """``formulation`` as it can run: ``"scale"`` where ``"fold"`` cannot.

    ``"fold"`` cannot run for operands of mixed dtypes (``can_fold`` false),
    nor with an ``"activations"`` backward that differentiates ``s`` (its
    ``ds`` reads the ``"scale"`` forward's unscaled product).

    >>> runnable(Formulation("fold", "activations"), Needs(s=True), True)
    Formulation(forward='scale', params='activations')

    Args:
      formulation: the chosen or forced formulation.
      needs: which operands are differentiated.
      can_fold: whether the operands share one dtype.

    Returns:
      The formulation that runs.
    """
    blocked = formulation.params == "activations" and needs.s
    if formulation.forward == "fold" and (blocked or not can_fold):
        return Formulation("scale", formulation.params)
    return formulation
