"""The ``"xla"`` convolution: two forwards, and kernel gradients per member.

Member ``k`` of a BatchEnsemble convolution computes, on its rows ``x_k``
(padded as the op's padding mode asks)::

    y_k = conv(x_k * r_k, W) * s_k

(the bias is added by the caller). As for the dense op
(:mod:`ensembles.ops.dense_xla`), write ``M_k`` for the gradient of a plain
convolution's kernel on member ``k``'s rows alone (``x_k`` against the output
cotangent ``g_k``, before any scaling). Then, with ``r`` scaling the kernel's
input-channel axis and ``s`` its output-channel axis::

    dW   = sum_k M_k * (r_k (x) s_k)
    dr_k = sum over all but the input-channel axis of M_k * W * s_k
    ds_k = sum over all but the output-channel axis of M_k * W * r_k

Two forward formulations:

* ``"scale"``: one convolution of all ``E*B`` rows scaled by ``r``, then
  ``* s``; keeps the unscaled product ``z`` for the ``"activations"`` ``ds``.
* ``"fold"``: E convolutions of ``B`` rows, member ``k``'s with its own kernel
  ``W * (r_k (x) s_k)`` (:func:`effective_kernel`); no scaling pass over the
  activations.

Two backward formulations:

* ``"activations"``: what plain differentiation of the forward does. ``dW`` is
  one kernel-gradient convolution of ``x * r`` against ``g * s``; ``dr`` needs
  the input-gradient convolution ``u`` (``dr_k = sum x_k * u_k``), which a
  first layer does not otherwise compute; ``ds`` reads the forward's ``z``.
* ``"kernels"``: E kernel-gradient convolutions of ``B`` rows each (the work of
  one over ``E*B`` rows) give every ``M_k``; ``dW``, ``dr`` and ``ds`` are
  reductions over ``E`` kernels. No input-gradient convolution unless ``dx``
  itself is needed, and no activations saved for ``ds``.

Only convolutions with ``feature_group_count == 1`` use ``"kernels"`` (a
grouped kernel's input-channel axis holds ``in/G`` channels, so ``dr`` would
need a regrouping that is not written). Which formulations run is a measured
table per backend (:data:`ensembles.ops.cost.FOLD_MEASURED` and
:data:`~ensembles.ops.cost.KERNELS_MEASURED`, read by
:func:`ensembles.ops.plan.choose_conv`), not a cost model: the CPU numbers do
not follow FLOPs (E convolutions of ``B`` rows run faster on XLA's CPU backend
than one of ``E*B`` rows).
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
)
from ensembles.ops.plan import (
    FORWARDS,
    Formulation,
    can_fold,
    choose_conv,
    runnable,
)

__all__ = [
    "ConvConfig",
    "channels_last_dimension_numbers",
    "conv_by_member",
    "effective_kernel",
]


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """The static options of the shared convolution (hashable).

    ``padding`` is what ``lax.conv_general_dilated`` takes: the op has already
    applied the padding modes that copy values (circular, reflect, causal).
    ``forward`` and ``params`` force a forward or backward formulation
    (tests, benchmarks); ``None`` lets :func:`~ensembles.ops.plan.choose_conv`
    decide.
    """

    strides: tuple[int, ...]
    padding: Any
    input_dilation: tuple[int, ...]
    kernel_dilation: tuple[int, ...]
    feature_group_count: int
    precision: Any
    preferred_element_type: Any
    params: str | None = None
    forward: str | None = None

    def __post_init__(self):
        if self.forward not in (None, *FORWARDS):
            raise ValueError(
                f"`forward` must be None or one of {FORWARDS}, got {self.forward!r}."
            )
        if self.params not in (None, *PARAM_GRADIENTS):
            raise ValueError(
                f"`params` must be None or one of {PARAM_GRADIENTS}, got "
                f"{self.params!r}."
            )

    def conv(self, x, kernel):
        """The plain convolution of channels-last ``x`` with ``kernel``."""
        return lax.conv_general_dilated(
            x,
            kernel,
            self.strides,
            self.padding,
            lhs_dilation=self.input_dilation,
            rhs_dilation=self.kernel_dilation,
            dimension_numbers=channels_last_dimension_numbers(x.ndim),
            feature_group_count=self.feature_group_count,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
        )


def channels_last_dimension_numbers(ndim: int) -> lax.ConvDimensionNumbers:
    """``[N, *spatial, C]`` inputs and outputs, ``[*spatial, in, out]`` kernels."""
    spatial = tuple(range(1, ndim - 1))
    lhs = (0, ndim - 1, *spatial)
    rhs = (ndim - 1, ndim - 2, *range(ndim - 2))
    return lax.ConvDimensionNumbers(lhs, rhs, lhs)


def effective_kernel(
    kernel: jax.Array,
    r: jax.Array,
    s: jax.Array,
    *,
    feature_group_count: int = 1,
    transpose_kernel: bool = False,
) -> jax.Array:
    """Returns one member's effective kernel ``kernel * (r (x) s)``.

    For a grouped convolution (kernel ``[*kernel_size, in/G, out]``) output
    channel ``o`` sees the input channels of its group only, so ``r`` is read
    per group. For a transposed convolution with ``transpose_kernel=True`` the
    kernel is ``[*kernel_size, out, in]``.

    >>> import jax.numpy as jnp
    >>> kernel = jnp.ones((1, 2, 4))            # kernel_size 1, in/G = 2, out = 4
    >>> r = jnp.array([1.0, 2.0, 3.0, 4.0])     # in = 4
    >>> s = jnp.ones(4)
    >>> effective_kernel(kernel, r, s, feature_group_count=2)[0]
    Array([[1., 1., 3., 3.],
           [2., 2., 4., 4.]], dtype=float32)

    Args:
      kernel: the shared kernel, in Flax's layout.
      r: ``[in_features]`` input fast weights of the member.
      s: ``[out_features]`` output fast weights of the member.
      feature_group_count: the number of feature groups G (convolution only).
      transpose_kernel: whether ``kernel`` is ``[*kernel_size, out, in]``.

    Returns:
      An array of ``kernel``'s shape and dtype.
    """
    if transpose_kernel:
        scale = jnp.outer(s, r)
    else:
        groups = feature_group_count
        in_per_group = r.shape[0] // groups
        out_per_group = s.shape[0] // groups
        # [in/G, out]: column o holds r over the input channels of o's group.
        r_columns = jnp.repeat(r.reshape(groups, in_per_group).T, out_per_group, 1)
        scale = r_columns * s[None, :]
    scale = scale.astype(kernel.dtype).reshape((1,) * (kernel.ndim - 2) + scale.shape)
    return kernel * scale


def _per_channel(weights, like):
    """``[E, C]`` -> broadcastable against ``[E, N, *spatial, C]`` ``like``."""
    return weights.reshape(weights.shape[0], *(1,) * (like.ndim - 2), -1)


def _flat(a):
    """``[E, N, ...]`` -> ``[E*N, ...]``."""
    return a.reshape(-1, *a.shape[2:])


def _members(a, num_members: int):
    """``[E*N, ...]`` -> ``[E, N, ...]``."""
    return a.reshape(num_members, -1, *a.shape[1:])


def _output_dtype(x, kernel, r, s, config: ConvConfig):
    """The output's dtype: ``z * s``'s."""
    product = config.preferred_element_type or jnp.result_type(x, r, kernel)
    return jnp.result_type(product, s)


def _product(x, kernel, r, config: ConvConfig):
    """``z = conv(x * r, W)``, the unscaled convolution, ``[E, N, ..., out]``."""
    return _members(config.conv(_flat(x * _per_channel(r, x)), kernel), r.shape[0])


def _effective_kernels(kernel, r, s, config: ConvConfig):
    """Every member's kernel ``kernel * (r_k (x) s_k)``, a list of E."""
    return [
        effective_kernel(
            kernel, r[k], s[k], feature_group_count=config.feature_group_count
        )
        for k in range(r.shape[0])
    ]


def _forward(x, kernel, r, s, config: ConvConfig, formulation: Formulation):
    """``(y, z)``: the output and (``"scale"``) the unscaled convolution ``z``."""
    dtype = _output_dtype(x, kernel, r, s, config)
    if formulation.forward == "fold":
        kernels = _effective_kernels(kernel, r, s, config)
        y = jnp.stack([config.conv(x[k], w) for k, w in enumerate(kernels)])
        return y.astype(dtype), None
    z = _product(x, kernel, r, config)
    return (z * _per_channel(s, z)).astype(dtype), z


def _tangent(x, kernel, r, s, z, tangents, config: ConvConfig):
    """``dy``, linear in the tangents of ``(x, kernel, r, s)`` (``None``: none).

    ``dy = (conv(dx * r + x * dr, W) + conv(x * r, dW)) * s + z * ds``.
    """
    dx, dkernel, dr, ds = tangents
    num_members = r.shape[0]
    dscaled = None
    if dx is not None:
        dscaled = dx * _per_channel(r, dx)
    if dr is not None:
        term = x * _per_channel(dr, x)
        dscaled = term if dscaled is None else dscaled + term
    dz = (
        None
        if dscaled is None
        else _members(config.conv(_flat(dscaled), kernel), num_members)
    )
    if dkernel is not None:
        term = _members(
            config.conv(_flat(x * _per_channel(r, x)), dkernel), num_members
        )
        dz = term if dz is None else dz + term
    dy = None if dz is None else dz * _per_channel(s, dz)
    if ds is not None:
        if z is None:
            z = _product(x, kernel, r, config)
        term = z * _per_channel(ds, z)
        dy = term if dy is None else dy + term
    return dy.astype(_output_dtype(x, kernel, r, s, config))


def _input_gradient(scaled_x_like, kernel, gs, config: ConvConfig):
    """``u``: the input cotangent of ``conv(., kernel)`` at output cotangent ``gs``."""
    flat = _flat(scaled_x_like)
    transpose = jax.linear_transpose(
        lambda a: config.conv(a, kernel), jax.ShapeDtypeStruct(flat.shape, flat.dtype)
    )
    (u,) = transpose(_flat(gs).astype(_out_dtype(flat, kernel, config)))
    return _members(u, scaled_x_like.shape[0])


def _kernel_gradient(x_flat, kernel, g_flat, config: ConvConfig):
    """The kernel cotangent of ``conv(x_flat, .)`` at output cotangent ``g_flat``."""
    transpose = jax.linear_transpose(
        lambda k: config.conv(x_flat, k),
        jax.ShapeDtypeStruct(kernel.shape, kernel.dtype),
    )
    (m,) = transpose(g_flat.astype(_out_dtype(x_flat, kernel, config)))
    return m


def _out_dtype(x, kernel, config: ConvConfig):
    return jax.eval_shape(
        config.conv,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(kernel.shape, kernel.dtype),
    ).dtype


def _sum_to_channels(a, config: ConvConfig):
    """``[E, ..., C]`` -> ``[E, C]``, accumulated in at least float32."""
    dtype = accumulation_dtype(a, preferred_element_type=config.preferred_element_type)
    return jnp.sum(a, axis=tuple(range(1, a.ndim - 1)), dtype=dtype)


def _activation_gradients(x, kernel, r, s, z, g, config: ConvConfig, needs: Needs):
    dx = dkernel = dr = ds = None
    scaled = x * _per_channel(r, x)
    gs = g * _per_channel(s, g)
    if needs.inputs or needs.r:
        u = _input_gradient(scaled, kernel, gs, config)
        if needs.inputs:
            dx = u * _per_channel(r, u)
        if needs.r:
            dr = _sum_to_channels(u * x, config)
    if needs.kernel:
        dkernel = _kernel_gradient(_flat(scaled), kernel, _flat(gs), config)
    if needs.s:
        if z is None:
            z = _product(x, kernel, r, config)
        ds = _sum_to_channels(g * z, config)
    return dx, dkernel, dr, ds


def _kernel_gradients(x, kernel, r, s, z, g, config: ConvConfig, needs: Needs):
    del z  # ds comes from M_k: no activations are saved
    dx = dkernel = dr = ds = None
    if needs.inputs:
        scaled = x * _per_channel(r, x)
        u = _input_gradient(scaled, kernel, g * _per_channel(s, g), config)
        dx = u * _per_channel(r, u)
    # M_k, one kernel-gradient convolution per member on its own B rows (the
    # conv's input in the dtype the forward promoted it to).
    dtype = jnp.result_type(x, r)
    m = [
        _kernel_gradient(x[k].astype(dtype), kernel, g[k], config)
        for k in range(r.shape[0])
    ]
    # [in] and [out] as kernel-shaped [1, ..., in, 1] and [1, ..., 1, out].
    ones = (1,) * (kernel.ndim - 2)

    def along_in(v):
        return v.reshape(*ones, -1, 1)

    def along_out(v):
        return v.reshape(*ones, 1, -1)

    if needs.kernel:
        dkernel = sum(
            m_k * (along_in(r[k]) * along_out(s[k])) for k, m_k in enumerate(m)
        )

    def per_member(weights_of, keep_axis):
        """``[E, C]``: ``sum(M_k * W * weights_of(k))`` over all axes but one."""
        axes = tuple(a for a in range(kernel.ndim) if a != keep_axis)
        sum_dtype = accumulation_dtype(
            m[0], kernel, r, s, preferred_element_type=config.preferred_element_type
        )
        return jnp.stack(
            [
                jnp.sum(m_k * kernel * weights_of(k), axis=axes, dtype=sum_dtype)
                for k, m_k in enumerate(m)
            ]
        )

    if needs.r:
        dr = per_member(lambda k: along_out(s[k]), kernel.ndim - 2)
    if needs.s:
        ds = per_member(lambda k: along_in(r[k]), kernel.ndim - 1)
    return dx, dkernel, dr, ds


def _plan(x, kernel, r, s, config: ConvConfig, needs: Needs) -> Formulation:
    foldable = can_fold(x, kernel, r, s)
    chosen = choose_conv(needs, config.feature_group_count, can_fold=foldable)
    forward = config.forward or chosen.forward
    params = config.params or chosen.params
    if params == "kernels" and config.feature_group_count != 1:
        params = "activations"
    return runnable(Formulation(forward, params), needs, foldable)


def _keeps_product(formulation: Formulation, needs: Needs) -> bool:
    # "kernels" forms ds from M_k and saves no activations.
    return needs.s and formulation.params == "activations"


def _backward(x, kernel, r, s, z, g, config, formulation: Formulation, needs):
    gradients = {
        "kernels": _kernel_gradients,
        "activations": _activation_gradients,
    }[formulation.params]
    return gradients(x, kernel, r, s, z, g, config, needs)


_conv = define(
    Rules(
        name="batch_ensemble_conv",
        plan=_plan,
        keeps_product=_keeps_product,
        forward=_forward,
        tangent=_tangent,
        backward=_backward,
    )
)


def conv_by_member(x, kernel, r, s, config: ConvConfig):
    """``conv(x_k * r_k, W) * s_k`` for every member, with the rule above.

    >>> import jax.numpy as jnp
    >>> config = ConvConfig((1,), "VALID", (1,), (1,), 1, None, None)
    >>> x = jnp.ones((2 * 3, 5, 4))              # E=2, B=3, length 5, in=4
    >>> y = conv_by_member(x, jnp.ones((3, 4, 2)), jnp.ones((2, 4)),
    ...                    jnp.ones((2, 2)), config)
    >>> y.shape, float(y[0, 0, 0])
    ((6, 3, 2), 12.0)

    Args:
      x: ``[E*N, *spatial, in]`` member-major, channels-last inputs, already
        padded for the padding modes that copy values.
      kernel: ``[*kernel_size, in/G, out]``.
      r: ``[E, in]``.
      s: ``[E, out]``.
      config: the convolution's static options.

    Returns:
      ``[E*N, *out_spatial, out]``.
    """
    y = _conv(_members(x, r.shape[0]), kernel, r, s, config)
    return _flat(y)
