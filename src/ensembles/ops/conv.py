"""The BatchEnsemble convolution op: its rule, its formulations, the one path.

Member ``k`` of :func:`batch_ensemble_conv` maps its rows ``[k*B, (k+1)*B)`` of
a member-major, channels-last batch as a convolution with kernel ``kernel *
(r[k] (x) s[k])`` would (per feature group, :func:`effective_kernel`). Because
``r`` scales input channels and ``s`` output channels, that is computed without
forming per-member kernels::

    y = conv(x * r_rows, W) * s_rows + bias_rows

with one ``lax.conv_general_dilated`` over the flat ``[E*B, ...]`` batch, each
per-member vector applied as a per-row vector ``[E*B, 1, ..., C]``
(:func:`ensembles.members.per_row`) in the convolution's own layout. (Viewing
the activations as ``[E, B, ..., C]`` instead made XLA's CPU backend copy them
around every convolution: a BE CNN's forward at 3x one model's; see
``docs/cost.md``.) Padding that copies input values (``CIRCULAR``,
``REFLECT``) commutes with the per-channel scaling by ``r``.

As for the dense op, write ``M_k`` for the gradient of a plain convolution's
kernel on member ``k``'s rows alone (``x_k`` against the output cotangent
``g_k``, before any scaling). Then::

    dW   = sum_k M_k * (r_k (x) s_k)
    dr_k = sum over all but the input-channel axis of M_k * W * s_k
    ds_k = sum over all but the output-channel axis of M_k * W * r_k

The forward is ``"scale"`` (above; keeps the unscaled ``z`` for ``ds``) or
``"fold"`` (E convolutions of ``B`` rows, member ``k``'s with its own kernel);
the gradients of the parameters come ``"scaled_activations"`` (one
kernel-gradient convolution of ``x * r`` against ``g * s``; ``dr`` from the
input-gradient convolution, ``ds`` from ``z``) or from the ``"member_kernels"``
(E kernel-gradient convolutions of ``B`` rows each give every ``M_k``; no
input-gradient convolution unless ``dx`` itself is needed). Grouped
convolutions use ``"scaled_activations"`` (a grouped kernel's input-channel
axis holds ``in/G`` channels: ``dr`` would need a regrouping not written).
Which runs is :func:`choose_conv`'s measured table, next to it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from ensembles._checks import (
    as_operands,
    check_choice,
    check_num_members,
    check_positive_int,
)
from ensembles.members import per_row
from ensembles.ops import conv_formulations as math
from ensembles.ops.autodiff import (
    Formulation,
    Needs,
    Rules,
    define,
    static_precision,
)
from ensembles.ops.conv_formulations import ConvConfig, effective_kernel
from ensembles.ops.conv_options import (
    IntOrSequence,
    PaddingLike,
    check_padding,
    check_shapes,
    flatten_batch,
    spatial_tuple,
)

__all__ = [
    "CONV_FORMULATIONS",
    "IMPLS",
    "ConvConfig",
    "ConvRule",
    "batch_ensemble_conv",
    "choose_conv",
    "effective_kernel",
]

#: What ``impl`` may name for the convolutions: the ``jnp`` formulation.
IMPLS: tuple[str, ...] = ("xla",)

# ------------------------------------------------------------------ the rule


@dataclasses.dataclass(frozen=True)
class ConvRule:
    """The convolution's measured formulations on one backend.

    Attributes:
      forward: the forward (``"scale"`` or ``"fold"``).
      first_layer: the backward of a layer whose inputs need no gradient.
      hidden_layer: the backward of one whose inputs do.
    """

    forward: str
    first_layer: str
    hidden_layer: str


#: The measured rule per ``jax.default_backend()``. A table, not a cost
#: model: XLA's CPU convolutions do not follow FLOPs (``"fold"``'s E
#: convolutions of ``B`` rows run faster than one of ``E*B`` in a layer alone,
#: and 2x slower inside a whole model). ``docs/cost.md`` says where, when and
#: how each entry was measured; a backend without a row runs
#: ``Formulation()``, what plain differentiation of the formula does.
CONV_FORMULATIONS: dict[str, ConvRule] = {
    "cpu": ConvRule("scale", "member_kernels", "member_kernels"),
}


def choose_conv(
    needs: Needs, feature_group_count: int, *, backend: str | None = None
) -> Formulation:
    """The convolution's rule: its backend's measured formulation.

    >>> first = Needs(kernel=True, r=True, s=True)
    >>> choose_conv(first, 1, backend="cpu")
    Formulation(forward='scale', backward='member_kernels')
    >>> choose_conv(first, 2, backend="cpu")    # grouped
    Formulation(forward='scale', backward='scaled_activations')
    >>> choose_conv(first, 1, backend="gpu")    # not measured
    Formulation(forward='scale', backward='scaled_activations')

    Args:
      needs: which operands are differentiated.
      feature_group_count: the convolution's G (grouped: no
        ``"member_kernels"``).
      backend: a key of :data:`CONV_FORMULATIONS`; default
        ``jax.default_backend()``.

    Returns:
      The :class:`~ensembles.ops.Formulation`.
    """
    rule = CONV_FORMULATIONS.get(backend or jax.default_backend())
    if rule is None:
        return Formulation()
    backward = rule.hidden_layer if needs.inputs else rule.first_layer
    if feature_group_count != 1 or not needs.params:
        backward = "scaled_activations"
    return Formulation(rule.forward, backward)


def _plan(x, kernel, r, s, config: ConvConfig, needs: Needs) -> Formulation:
    formulation = config.formulation or choose_conv(needs, config.feature_group_count)
    if config.feature_group_count != 1:
        formulation = Formulation(formulation.forward, "scaled_activations")
    return formulation.runnable(needs, x, kernel, r, s)


_conv = define(
    Rules(
        name="batch_ensemble_conv",
        plan=_plan,
        keeps_product=math.keeps_product,
        forward=math.forward,
        tangent=math.tangent,
        backward=math.backward,
    )
)


# ------------------------------------------------------------------- the op


def _pad(x, padding, kernel_size, kernel_dilation):
    """Applies Flax's padding modes that copy values; lax's ``padding`` for the rest."""
    if padding in ("CIRCULAR", "REFLECT"):
        # As nnx.Conv: pad by the dilated kernel's half-widths, then VALID.
        dilated = [
            (k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation, strict=True)
        ]
        pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
        mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding]
        return jnp.pad(x, pads, mode=mode), "VALID"
    if padding == "CAUSAL":
        left = kernel_dilation[0] * (kernel_size[0] - 1)
        return jnp.pad(x, [(0, 0), (left, 0), (0, 0)]), "VALID"
    return x, padding


def conv_rows(
    inputs, kernel, r, s, bias, config: ConvConfig, padding, *, num_members: int
) -> jax.Array:
    """The convolution, its options already checked; the arrays' shapes checked.

    What :func:`batch_ensemble_conv` runs after checking its options, and what
    the layers call with the options they checked at construction.

    Args:
      inputs: ``[E*B, ..., *spatial, in]`` member-major, channels-last.
      kernel: ``[*kernel_size, in/G, out]``.
      r: ``[E, in]``.
      s: ``[E, out]``.
      bias: ``[E, out]`` or ``None``.
      config: the static options, ``padding`` aside.
      padding: the canonical padding (:func:`~.conv_options.check_padding`).
      num_members: the ensemble size E (1 in a member view).

    Returns:
      ``[E*B, ..., *out_spatial, out]``.

    Raises:
      ValueError: if a shape does not fit the others (the message says which).
    """
    rank = check_shapes(
        inputs,
        kernel,
        r,
        s,
        bias,
        num_members,
        feature_group_count=config.feature_group_count,
    )
    batch_shape = inputs.shape[: -rank - 1]
    x, padding = _pad(
        flatten_batch(inputs, rank),
        padding,
        kernel.shape[:rank],
        config.kernel_dilation,
    )
    y = _conv(x, kernel, r, s, dataclasses.replace(config, padding=padding))
    if bias is not None:
        y = y + per_row(bias, y.shape[0], y.ndim)
    return y.reshape(*batch_shape, *y.shape[1:])


def batch_ensemble_conv(
    inputs: jax.Array,
    kernel: jax.Array,
    r: jax.Array,
    s: jax.Array,
    bias: jax.Array | None = None,
    *,
    num_members: int,
    strides: IntOrSequence = 1,
    padding: PaddingLike = "SAME",
    input_dilation: IntOrSequence = 1,
    kernel_dilation: IntOrSequence = 1,
    feature_group_count: int = 1,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    impl: str = "xla",
    formulation: Formulation | None = None,
) -> jax.Array:
    """Applies a BatchEnsemble convolution to a member-major, channels-last batch.

    Rows ``[k*B, (k+1)*B)`` of ``inputs`` belong to member ``k``, which
    convolves them as ``nnx.Conv`` with kernel ``effective_kernel(kernel, r[k],
    s[k], feature_group_count=G)`` and bias ``bias[k]`` would. The op scales
    the input channels by ``r``, runs one convolution shared by all members and
    scales the output channels by ``s``. Every argument after ``num_members``
    means what it means for ``nnx.Conv``.

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import batch_ensemble_conv
    >>> x = jnp.ones((2 * 3, 8, 8, 4))               # E=2, B=3, 8x8 pixels, 4 channels
    >>> kernel = jnp.ones((3, 3, 4, 5))              # 3x3, in=4, out=5
    >>> r = jnp.stack([jnp.ones(4), 2 * jnp.ones(4)])  # [E, in]
    >>> s = jnp.ones((2, 5))                           # [E, out]
    >>> y = batch_ensemble_conv(x, kernel, r, s, num_members=2, padding="VALID")
    >>> y.shape
    (6, 6, 6, 5)
    >>> y[:, 0, 0, 0]
    Array([36., 36., 36., 72., 72., 72.], dtype=float32)

    Args:
      inputs: ``[E*B, ..., *spatial, in_features]`` member-major batch; extra
        batch axes after the first are flattened, as ``nnx.Conv`` does.
      kernel: the shared ``[*kernel_size, in_features/G, out_features]`` kernel
        (1, 2 or 3 spatial dimensions).
      r: ``[E, in_features]`` input fast weights.
      s: ``[E, out_features]`` output fast weights.
      bias: ``[E, out_features]`` per-member bias, or ``None``.
      num_members: the ensemble size E.
      strides: an int or one int per spatial dimension.
      padding: ``'SAME'``, ``'SAME_LOWER'``, ``'VALID'`` (any case),
        ``'CIRCULAR'``, ``'REFLECT'``, ``'CAUSAL'`` (1-D only), an int, or one
        int or ``(low, high)`` pair per spatial dimension
        (:func:`~ensembles.ops.conv_options.check_padding`).
      input_dilation: an int or one int per spatial dimension.
      kernel_dilation: an int or one int per spatial dimension.
      feature_group_count: the number of feature groups G; it must divide
        ``in_features`` and ``out_features``.
      precision: convolution precision, as for ``jax.lax.conv_general_dilated``.
      preferred_element_type: accumulation/output dtype of the convolution.
      impl: ``"xla"``, the one implementation.
      formulation: a :class:`~ensembles.ops.Formulation` to run instead of the
        one :func:`choose_conv` picks (tests, benchmarks).

    Returns:
      The ``[E*B, ..., *out_spatial, out_features]`` outputs.

    Raises:
      ValueError: if a shape, ``num_members``, an option or ``impl`` is
        invalid; the message names the argument and the fix.
      TypeError: if ``num_members``, an option or ``formulation`` has the wrong
        type.
    """
    num_members = check_num_members(num_members)
    check_choice(impl, "impl", IMPLS)
    if formulation is not None and not isinstance(formulation, Formulation):
        raise TypeError(
            f"`formulation` must be an `ensembles.ops.Formulation` or None, got "
            f"{formulation!r} of type {type(formulation).__name__}."
        )
    groups = check_positive_int(feature_group_count, "feature_group_count")
    inputs, kernel, r, s, bias = as_operands(inputs, kernel, r, s, bias)
    if kernel.ndim < 3:
        raise ValueError(
            f"`kernel` must have shape [*kernel_size, in, out] with at least one "
            f"spatial dimension, got shape {kernel.shape}."
        )
    rank = kernel.ndim - 2
    input_dilation = spatial_tuple(input_dilation, "input_dilation", rank)
    padding = check_padding(padding, rank, input_dilation=input_dilation)
    config = ConvConfig(
        strides=spatial_tuple(strides, "strides", rank),
        padding=None,
        input_dilation=input_dilation,
        kernel_dilation=spatial_tuple(kernel_dilation, "kernel_dilation", rank),
        feature_group_count=groups,
        precision=static_precision(precision),
        preferred_element_type=preferred_element_type,
        formulation=formulation,
    )
    return conv_rows(
        inputs, kernel, r, s, bias, config, padding, num_members=num_members
    )
