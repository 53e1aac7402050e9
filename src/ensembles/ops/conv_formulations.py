"""The convolution op's formulations: forward, tangent and backward, as ``jnp``.

The math of :mod:`ensembles.ops.conv` (which decides which formulation runs
and makes these functions the rules of its primitive): ``x`` is the flat,
member-major ``[E*B, *spatial, in]`` batch, already padded for the padding
modes that copy values, and every per-member vector is applied as a per-row
vector (:func:`ensembles.members.per_row`); a member's rows are a contiguous
slice. See :mod:`ensembles.ops.conv` for the formulations' definitions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ensembles.members import per_row
from ensembles.ops.autodiff import Formulation, Needs, accumulation_dtype

__all__ = [
    "ConvConfig",
    "backward",
    "effective_kernel",
    "forward",
    "keeps_product",
    "tangent",
]


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """The static options of the shared convolution (hashable).

    ``padding`` is what ``lax.conv_general_dilated`` takes: the op has already
    applied the padding modes that copy values (circular, reflect, causal).
    ``formulation`` forces one (tests, benchmarks); ``None``: the rule decides.
    """

    strides: tuple[int, ...]
    padding: Any
    input_dilation: tuple[int, ...]
    kernel_dilation: tuple[int, ...]
    feature_group_count: int
    precision: Any
    preferred_element_type: Any
    formulation: Formulation | None = None

    def conv(self, x, kernel):
        """The plain convolution of channels-last ``x`` with ``kernel``."""
        spatial = tuple(range(1, x.ndim - 1))
        lhs = (0, x.ndim - 1, *spatial)
        rhs = (x.ndim - 1, x.ndim - 2, *range(x.ndim - 2))
        return lax.conv_general_dilated(
            x,
            kernel,
            self.strides,
            self.padding,
            lhs_dilation=self.input_dilation,
            rhs_dilation=self.kernel_dilation,
            dimension_numbers=lax.ConvDimensionNumbers(lhs, rhs, lhs),
            feature_group_count=self.feature_group_count,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
        )


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


def _member_kernel(kernel, r_k, s_k, config: ConvConfig):
    """Member ``k``'s effective kernel (:func:`effective_kernel`)."""
    return effective_kernel(
        kernel, r_k, s_k, feature_group_count=config.feature_group_count
    )


def _rows(weights, like):
    return per_row(weights, like.shape[0], like.ndim)


def _member_rows(a, num_members: int, k: int):
    """Member ``k``'s rows of the member-major ``a`` (a contiguous slice)."""
    rows = a.shape[0] // num_members
    return a[k * rows : (k + 1) * rows]


def _output_dtype(x, kernel, r, s, config: ConvConfig):
    """The output's dtype: ``z * s``'s."""
    product = config.preferred_element_type or jnp.result_type(x, r, kernel)
    return jnp.result_type(product, s)


def _product(x, kernel, r, config: ConvConfig):
    """``z = conv(x * r, W)``, the unscaled convolution, ``[E*B, ..., out]``."""
    return config.conv(x * _rows(r, x), kernel)


def forward(x, kernel, r, s, config: ConvConfig, formulation: Formulation):
    """``(y, z)``: the output and (``"scale"``) the unscaled convolution ``z``."""
    dtype = _output_dtype(x, kernel, r, s, config)
    if formulation.forward == "fold":
        num_members = r.shape[0]
        y = jnp.concatenate(
            [
                config.conv(
                    _member_rows(x, num_members, k),
                    _member_kernel(kernel, r[k], s[k], config),
                )
                for k in range(num_members)
            ]
        )
        return y.astype(dtype), None
    z = _product(x, kernel, r, config)
    return (z * _rows(s, z)).astype(dtype), z


def tangent(x, kernel, r, s, z, tangents, config: ConvConfig):
    """``dy``, linear in the tangents of ``(x, kernel, r, s)`` (``None``: none).

    ``dy = (conv(dx * r + x * dr, W) + conv(x * r, dW)) * s + z * ds``.
    """
    dx, dkernel, dr, ds = tangents
    dscaled = None
    if dx is not None:
        dscaled = dx * _rows(r, dx)
    if dr is not None:
        term = x * _rows(dr, x)
        dscaled = term if dscaled is None else dscaled + term
    dz = None if dscaled is None else config.conv(dscaled, kernel)
    if dkernel is not None:
        term = config.conv(x * _rows(r, x), dkernel)
        dz = term if dz is None else dz + term
    dy = None if dz is None else dz * _rows(s, dz)
    if ds is not None:
        if z is None:
            z = _product(x, kernel, r, config)
        term = z * _rows(ds, z)
        dy = term if dy is None else dy + term
    return dy.astype(_output_dtype(x, kernel, r, s, config))


def _out_dtype(x, kernel, config: ConvConfig):
    return jax.eval_shape(
        config.conv,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(kernel.shape, kernel.dtype),
    ).dtype


def _input_gradient(like, kernel, gs, config: ConvConfig):
    """``u``: the input cotangent of ``conv(., kernel)`` at output cotangent ``gs``."""
    transpose = jax.linear_transpose(
        lambda a: config.conv(a, kernel), jax.ShapeDtypeStruct(like.shape, like.dtype)
    )
    (u,) = transpose(gs.astype(_out_dtype(like, kernel, config)))
    return u


def _kernel_gradient(x, kernel, g, config: ConvConfig):
    """The kernel cotangent of ``conv(x, .)`` at output cotangent ``g``."""
    transpose = jax.linear_transpose(
        lambda k: config.conv(x, k), jax.ShapeDtypeStruct(kernel.shape, kernel.dtype)
    )
    (m,) = transpose(g.astype(_out_dtype(x, kernel, config)))
    return m


def _sum_per_member(a, num_members: int, config: ConvConfig):
    """``[E*B, ..., C]`` -> ``[E, C]``, accumulated in at least float32."""
    dtype = accumulation_dtype(a, preferred_element_type=config.preferred_element_type)
    per_row_sums = jnp.sum(a, axis=tuple(range(1, a.ndim - 1)), dtype=dtype)
    return per_row_sums.reshape(num_members, -1, a.shape[-1]).sum(axis=1)


def _scaled_activation_gradients(x, kernel, r, s, z, g, config, needs: Needs):
    dx = dkernel = dr = ds = None
    num_members = r.shape[0]
    scaled = x * _rows(r, x)
    gs = g * _rows(s, g)
    if needs.inputs or needs.r:
        u = _input_gradient(scaled, kernel, gs, config)
        if needs.inputs:
            dx = u * _rows(r, u)
        if needs.r:
            dr = _sum_per_member(u * x, num_members, config)
    if needs.kernel:
        dkernel = _kernel_gradient(scaled, kernel, gs, config)
    if needs.s:
        if z is None:
            z = _product(x, kernel, r, config)
        ds = _sum_per_member(g * z, num_members, config)
    return dx, dkernel, dr, ds


def _member_kernel_gradients(x, kernel, r, s, z, g, config, needs: Needs):
    del z  # ds comes from M_k: no activations are saved
    dx = dkernel = dr = ds = None
    num_members = r.shape[0]
    dtype = jnp.result_type(x, r)
    if needs.inputs:
        # dx_k = conv^T(g_k; W_k), per member with its own kernel: E
        # input-gradient convolutions of B rows, no scaling passes.
        dx = jnp.concatenate(
            [
                _input_gradient(
                    _member_rows(x, num_members, k).astype(dtype),
                    _member_kernel(kernel, r[k], s[k], config),
                    _member_rows(g, num_members, k),
                    config,
                )
                for k in range(num_members)
            ]
        )
    # M_k, one kernel-gradient convolution per member on its own B rows (the
    # conv's input in the dtype the forward promoted it to).
    m = [
        _kernel_gradient(
            _member_rows(x, num_members, k).astype(dtype),
            kernel,
            _member_rows(g, num_members, k),
            config,
        )
        for k in range(num_members)
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
    sum_dtype = accumulation_dtype(
        m[0], kernel, r, s, preferred_element_type=config.preferred_element_type
    )

    def per_member(weights_of, keep_axis):
        """``[E, C]``: ``sum(M_k * W * weights_of(k))`` over all axes but one."""
        axes = tuple(a for a in range(kernel.ndim) if a != keep_axis)
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


def keeps_product(formulation: Formulation, needs: Needs) -> bool:
    """Whether the forward's unscaled ``z`` is kept for the backward's ``ds``.

    ``"member_kernels"`` forms ``ds`` from ``M_k`` and saves no activations.
    """
    return needs.s and formulation.backward == "scaled_activations"


def backward(x, kernel, r, s, z, g, config, formulation: Formulation, needs):
    """The cotangents of ``(x, kernel, r, s)`` (``None`` for those not needed)."""
    gradients = {
        "member_kernels": _member_kernel_gradients,
        "scaled_activations": _scaled_activation_gradients,
    }[formulation.backward]
    return gradients(x, kernel, r, s, z, g, config, needs)
