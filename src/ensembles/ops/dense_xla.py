"""The ``"xla"`` dense formulations, their derivative rule and the cost model.

Member ``k`` of a BatchEnsemble dense layer computes, on its rows ``x_k``::

    y_k = ((x_k * r_k) @ W) * s_k  =  x_k @ (W * outer(r_k, s_k))

(the bias is added by the caller). Two forward formulations compute that:

* ``"scale"``: scale the activations, one 2-D matmul over all ``E*B`` rows,
  scale again. Extra work: two passes over the activations.
* ``"fold"``: materialise the member kernels ``W_k = W * outer(r_k, s_k)`` and
  run one batched matmul. Extra work: one pass over ``E x in x out`` (which XLA's
  GPU backend fuses into its Triton matmul).

For the gradients write ``M_k = x_k^T g_k`` for member ``k``'s block of the
kernel gradient before any scaling (``g_k`` its output cotangent). Then::

    dW   = sum_k M_k * outer(r_k, s_k)
    dr_k = sum_j (M_k * W)[:, j] s_k[j]
    ds_k = sum_i (M_k * W)[i, :] r_k[i]

so the gradients of the parameters can be formed in two ways:

* ``"activations"``: ``dW = (x * r)^T (g * s)`` (one 2-D matmul),
  ``dr_k = sum_b x_k * ((g_k * s_k) @ W^T)`` (needs the input-gradient matmul
  ``u = (g * s) @ W^T``, which ``dx = u * r`` shares), ``ds_k = sum_b g_k * z_k``
  with ``z = (x * r) @ W`` saved by the ``"scale"`` forward.
* ``"kernels"``: one batched matmul forms every ``M_k``; ``dW``, ``dr`` and
  ``ds`` are reductions over ``E x in x out``. No input-gradient matmul: a layer
  whose inputs need no gradient (a first layer) does exactly the matmuls of a
  plain dense layer, and ``dx`` (when it is needed) is ``((g * s) @ W^T) * r``.

The op is a primitive pair of :mod:`ensembles.ops.autodiff`: its forward-mode
rule sees which of ``x``, ``W``, ``r``, ``s`` are differentiated, picks the
formulation with :func:`choose` for exactly that case and emits a linear
tangent whose transpose (reverse mode) runs the chosen backward. Forward mode
(``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``, ``jax.linearize``) evaluates
that tangent: ``(((dx * r + x * dr) @ W + (x * r) @ dW) * s + z * ds``. Every
matmul runs at the op's ``precision`` and ``preferred_element_type``; the
reductions into ``dr`` and ``ds`` accumulate in at least float32 (float64
stays float64). The math of each formulation is written once, in
:func:`_forward`, :func:`_tangent` and the two gradient functions; the
per-member loop of ``tests/reference.py`` is the reference every formulation
is tested against.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ensembles.ops.autodiff import (
    PARAM_GRADIENTS,
    Needs,
    Rules,
    accumulation_dtype,
    define,
    static_precision,
)

__all__ = [
    "COST_MODELS",
    "CostModel",
    "Formulation",
    "Needs",
    "choose",
    "dense_by_member",
    "estimate",
    "kernels_fit",
]

FORWARDS: tuple[str, ...] = ("scale", "fold")


@dataclasses.dataclass(frozen=True)
class Formulation:
    """How the op computes its output and the gradients of its parameters.

    Attributes:
      forward: ``"scale"`` or ``"fold"`` (see the module docstring).
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


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work of each kind, for one backend.

    A formulation's cost is the sum over its work of ``count * constant``; only
    differences between formulations matter, so the work every formulation
    shares (the plain matmul of the forward, ``dx``'s matmul) still counts but
    per-call overheads common to all do not.

    Attributes:
      dot: per multiply-add of a 2-D matmul over ``E*B`` rows.
      batched_dot: per multiply-add of the E-batched matmul of ``"kernels"``
        (``M_k = x_k^T g_k``).
      fold_dot: per multiply-add of the ``"fold"`` forward's batched matmul
        against the member kernels, including forming them.
      fold_element: per element of ``E x in x out`` when ``"fold"`` forms the
        member kernels (GPU: fused into the matmul, so ~0).
      activation: per element of one elementwise pass over ``[E*B, in]`` or
        ``[E*B, out]`` (a scaling, or a product-and-row-sum).
      kernel_element: per element of one pass over the ``E x in x out`` kernel
        gradients ``M_k`` (a reduction to ``dW``, ``dr`` or ``ds``).
      where: where and when the constants were measured.
      param_gradients: the backward formulations measured on this backend;
        :func:`choose` considers no other (a cost model's guess never puts
        an unmeasured formulation into a user's training step).
    """

    dot: float
    batched_dot: float
    fold_dot: float
    fold_element: float
    activation: float
    kernel_element: float
    where: str = ""
    param_gradients: tuple[str, ...] = PARAM_GRADIENTS


#: The measured constants, per ``jax.default_backend()``; read when tracing.
#:
#: ``cpu``: measured on this project's 2-core machine (jax 0.10.2, float32,
#: 2026-11-23): medians of interleaved timings of a 2-D matmul (3.2e-11 s per
#: multiply-add at (E*B, in, out) = (1024, 1024, 1024), 2.3-6.9e-11 elsewhere),
#: the batched ``M_k`` matmul (3.0-3.8e-11 at B >= 64), the fold forward
#: (2.8-6.6e-11), a scaling pass over activations (1.1-1.6e-9 s/element) and
#: the fused ``dW``/``dr`` reductions over ``M_k`` (3.8 ms for 2 x 4M elements),
#: at the shapes of ``benchmarks/bench_dense.py``; then checked against the
#: whole formulations there (the choice is the measured fastest at all four
#: shapes, forward, first-layer and hidden-layer gradients).
#: ``gpu``: fitted to the H100 measurements of ``shared/notes/gpu.md``
#: (2026-11-22, jax 0.11.2, bfloat16): cuBLAS at ~343e12 multiply-adds/s, an
#: activation pass at ~3e-12 s/element (the "scale" forward's overhead at
#: (4,1024,4096,4096) and (8,2048,1024,4096)), the fused "fold" matmul ~1.6x
#: slower than cuBLAS at compute-bound shapes (and its kernel scaling fused
#: away). The table picks "fold" at the four shapes where the notes measured
#: its forward faster and "scale" at the fifth. The "kernels" backward was
#: never run on a GPU, so the row allows only "activations" (``param_gradients``)
#: and training keeps the measured "scale"/"activations" step; ``kernel_element``
#: (assumed equal to ``activation``) is what a device run of
#: ``benchmarks/bench_dense.py`` must measure before "kernels" is allowed there.
#: ``tpu``: never measured; the GPU row, a guess.
COST_MODELS: dict[str, CostModel] = {
    "cpu": CostModel(
        dot=3.2e-11,
        batched_dot=3.5e-11,
        fold_dot=4.0e-11,
        fold_element=1.5e-9,
        activation=1.0e-9,
        kernel_element=0.5e-9,
        where="2-core CI CPU, jax 0.10.2, float32, 2026-11-23",
    ),
    "gpu": CostModel(
        dot=2.9e-15,
        batched_dot=2.9e-15,
        fold_dot=4.7e-15,
        fold_element=0.0,
        activation=3.0e-12,
        kernel_element=3.0e-12,
        where="H100 80GB, jax 0.11.2, bfloat16, 2026-11-22 (shared/notes/gpu.md)",
        # The H100 run measured the forwards and plain differentiation of the
        # "scale" forward (what "activations" computes), never "kernels".
        param_gradients=("activations",),
    ),
}
COST_MODELS["tpu"] = dataclasses.replace(
    COST_MODELS["gpu"], where="never measured: the GPU constants"
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


#: The most memory the ``"kernels"`` backward may take: its ``M_k``
#: (``E x in x out`` values) at most this many times the layer's activations
#: (``E*B x (in + out)``). Every shape measured in ``docs/cost.md`` is within
#: 4; beyond, a step that fits in memory with plain differentiation could stop
#: fitting (``E = 16``, ``B = 64``, ``in = out = 8192``: 4 GiB of ``M_k`` in
#: float32 against 64 MiB of activations), whatever the time model says.
MAX_KERNELS_MEMORY: float = 4.0


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


@dataclasses.dataclass(frozen=True)
class _Config:
    precision: Any
    preferred_element_type: Any
    formulation: Formulation | None  # None: the cost model decides

    def dot(self, lhs, rhs, dimension_numbers, preferred_element_type=None):
        """``lax.dot_general`` at the op's precision and accumulation dtype."""
        return lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision=self.precision,
            preferred_element_type=preferred_element_type
            or self.preferred_element_type,
        )

    def sum_dtype(self, *operands):
        """The dtype a reduction of ``operands`` into ``dr``/``ds`` runs in."""
        return accumulation_dtype(
            *operands, preferred_element_type=self.preferred_element_type
        )


_FLAT = (((1,), (0,)), ((), ()))  # [rows, in] @ [in, out]
_BATCHED = (((2,), (1,)), ((0,), (0,)))  # [E, B, in] @ [E, in, out]


def _matmul(x3, kernel, config: _Config):
    """``[E, B, in] @ [in, out]`` as one 2-D matmul over the flat rows."""
    num_members, _, in_features = x3.shape
    y = config.dot(x3.reshape(-1, in_features), kernel, _FLAT)
    return y.reshape(num_members, -1, kernel.shape[1])


def _member_kernels(kernel, r, s):
    """``[E, in, out]``: ``kernel * outer(r_k, s_k)`` for every member."""
    return kernel[None] * (r[:, :, None] * s[:, None, :])


def _output_dtype(x3, kernel, r, s, config: _Config):
    """The output's dtype, the same for every formulation: ``z * s``'s."""
    product = config.preferred_element_type or jnp.result_type(x3, r, kernel)
    return jnp.result_type(product, s)


def _product(x3, kernel, r, config: _Config):
    """``z = (x * r) @ W``, the unscaled product, ``[E, B, out]``."""
    # Scale in the [E, B, in] view, multiply in the flat [E*B, in] view: XLA
    # fuses each scaling into one loop and keeps a single 2-D dot, measurably
    # cheaper (forward and backward) than a 3-D einsum (docs/cost.md).
    return _matmul(x3 * r[:, None, :], kernel, config)


def _forward(x3, kernel, r, s, config: _Config, formulation: Formulation):
    """``(y, z)``: the output and, for ``"scale"``, the unscaled product ``z``."""
    dtype = _output_dtype(x3, kernel, r, s, config)
    if formulation.forward == "fold":
        y = config.dot(x3, _member_kernels(kernel, r, s), _BATCHED)
        return y.astype(dtype), None
    z = _product(x3, kernel, r, config)
    return (z * s[:, None, :]).astype(dtype), z


def _tangent(x3, kernel, r, s, z, tangents, config: _Config):
    """``dy``, linear in the tangents of ``(x, kernel, r, s)`` (``None``: none).

    ``dy = (((dx * r + x * dr) @ W + (x * r) @ dW) * s + z * ds``.
    """
    dx, dkernel, dr, ds = tangents
    dscaled = None
    if dx is not None:
        dscaled = dx * r[:, None, :]
    if dr is not None:
        term = x3 * dr[:, None, :]
        dscaled = term if dscaled is None else dscaled + term
    dz = None if dscaled is None else _matmul(dscaled, kernel, config)
    if dkernel is not None:
        term = _matmul(x3 * r[:, None, :], dkernel, config)
        dz = term if dz is None else dz + term
    dy = None if dz is None else dz * s[:, None, :]
    if ds is not None:
        if z is None:
            z = _product(x3, kernel, r, config)
        term = z * ds[:, None, :]
        dy = term if dy is None else dy + term
    return dy.astype(_output_dtype(x3, kernel, r, s, config))


def _input_gradient(g, kernel, s, config: _Config):
    """``u = (g * s) @ W^T``, ``[E, B, in]``: ``dx = u * r``, ``dr = sum_b u * x``."""
    num_members, _, out_features = g.shape
    scaled = (g * s[:, None, :]).reshape(-1, out_features)
    u = config.dot(scaled, kernel, (((1,), (1,)), ((), ())))
    return u.reshape(num_members, -1, kernel.shape[0])


def _sum_rows(a, b, config: _Config):
    """``sum_b a * b`` per member and feature: ``[E, B, D]`` x2 -> ``[E, D]``."""
    return config.dot(a, b, (((1,), (1,)), ((0, 2), (0, 2))), config.sum_dtype(a, b))


def _activation_gradients(x3, kernel, r, s, z, g, config: _Config, needs: Needs):
    """Parameter (and input) gradients formed in the activations' space."""
    dx = dkernel = dr = ds = None
    if needs.inputs or needs.r:
        u = _input_gradient(g, kernel, s, config)
        if needs.inputs:
            dx = u * r[:, None, :]
        if needs.r:
            dr = _sum_rows(u, x3, config)
    if needs.kernel:
        in_features, out_features = kernel.shape
        dkernel = config.dot(
            (x3 * r[:, None, :]).reshape(-1, in_features),
            (g * s[:, None, :]).reshape(-1, out_features),
            (((0,), (0,)), ((), ())),
        )
    if needs.s:
        if z is None:
            z = _product(x3, kernel, r, config)
        ds = _sum_rows(g, z, config)
    return dx, dkernel, dr, ds


def _kernel_gradients(x3, kernel, r, s, z, g, config: _Config, needs: Needs):
    """Parameter gradients from the per-member kernel gradients ``M_k``."""
    dx = dkernel = dr = ds = None
    if needs.inputs:
        dx = _input_gradient(g, kernel, s, config) * r[:, None, :]
    if needs.params:
        # M_k = x_k^T g_k, [E, in, out]: one batched matmul, the FLOPs of dW.
        m = config.dot(x3, g, (((1,), (1,)), ((0,), (0,))))
        if needs.kernel:
            # A sum over the leading axis of [E, in, out] is a slow strided
            # reduction on XLA's CPU backend; E slices added in one fused loop
            # are not.
            dkernel = sum(
                m[k] * (r[k][:, None] * s[k][None, :]) for k in range(m.shape[0])
            )
        if needs.r:
            # A reduction over the minor axis, which XLA fuses with the dW loop
            # above; over a middle axis (or as a batched matrix-vector product)
            # it runs 2-10x slower on XLA's CPU backend.
            dr = jnp.sum(
                m * (kernel[None] * s[:, None, :]),
                axis=2,
                dtype=config.sum_dtype(m, kernel, s),
            )
        if needs.s:
            if z is not None:  # the "scale" forward kept z, [E, B, out]
                ds = _sum_rows(g, z, config)
            else:
                ds = config.dot(
                    m * kernel[None],
                    r,
                    (((1,), (1,)), ((0,), (0,))),
                    config.sum_dtype(m, kernel, r),
                )
    return dx, dkernel, dr, ds


def _can_fold(x3, kernel, r, s) -> bool:
    return len({jnp.dtype(a.dtype) for a in (x3, kernel, r, s)}) == 1


def _plan(x3, kernel, r, s, config: _Config, needs: Needs) -> Formulation:
    num_members, rows, in_features = x3.shape
    can_fold = _can_fold(x3, kernel, r, s)
    if config.formulation is not None:
        formulation = config.formulation
        if formulation.forward == "fold" and not can_fold:
            formulation = dataclasses.replace(formulation, forward="scale")
    else:
        formulation = choose(
            num_members, rows, in_features, kernel.shape[1], needs, can_fold=can_fold
        )
    if formulation.params == "activations" and needs.s:
        # Its ds reads z, which only the "scale" forward computes.
        formulation = dataclasses.replace(formulation, forward="scale")
    return formulation


def _keeps_product(formulation: Formulation, needs: Needs) -> bool:
    # ds reads z where the "scale" forward computed it.
    return needs.s and formulation.forward == "scale"


def _backward(x3, kernel, r, s, z, g, config, formulation: Formulation, needs):
    gradients = {
        "kernels": _kernel_gradients,
        "activations": _activation_gradients,
    }[formulation.params]
    return gradients(x3, kernel, r, s, z, g, config, needs)


_dense = define(
    Rules(
        name="batch_ensemble_dense",
        plan=_plan,
        keeps_product=_keeps_product,
        forward=_forward,
        tangent=_tangent,
        backward=_backward,
    )
)


def dense_by_member(
    inputs,
    kernel,
    r,
    s,
    bias,
    *,
    precision=None,
    preferred_element_type=None,
    formulation: Formulation | None = None,
):
    """The one-device ``"xla"`` formulation of ``batch_ensemble_dense``.

    The rows are split into members by reshapes. ``formulation`` forces one
    (tests, benchmarks); ``None`` lets :func:`choose` decide when tracing.

    Args:
      inputs: ``[E*B, ..., in]`` member-major activations.
      kernel: ``[in, out]``.
      r: ``[E, in]``.
      s: ``[E, out]``.
      bias: ``[E, out]`` or ``None``.
      precision: as for ``lax.dot_general``.
      preferred_element_type: as for ``lax.dot_general``.
      formulation: a :class:`Formulation`, or ``None``.

    Returns:
      ``[E*B, ..., out]``.
    """
    num_members, in_features = r.shape
    out_features = kernel.shape[1]
    x3 = inputs.reshape(num_members, -1, in_features)
    config = _Config(static_precision(precision), preferred_element_type, formulation)
    y = _dense(x3, kernel, r, s, config)
    if bias is not None:
        y = y + bias[:, None, :]
    return y.reshape(*inputs.shape[:-1], out_features)
