"""Per-member normalization layers: no statistic or parameter mixes members.

Each layer mirrors its Flax norm, with every parameter (and, for batch norm, every
running statistic) given a leading member axis ``[E, features]``. Member ``k``
normalizes its rows ``[k*B, (k+1)*B)`` of a member-major batch exactly as the Flax
norm holding member ``k``'s parameters would normalize those rows alone.
``nnx.view(norm, member=k)`` runs member ``k`` alone on an un-tiled ``[B, ...]``
batch. ``EnsembleBatchNorm`` is in :mod:`ensembles.layers.batch_norm`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers
from flax.typing import Axes, Dtype, Initializer, PromoteDtypeFn

from ensembles._checks import (
    as_array,
    check_bool,
    check_norm_mask,
    check_num_members,
    check_positive_int,
)
from ensembles.layers.base import (
    EnsembleModule,
    check_flax_layer,
    check_member_index,
    plain_layer,
)
from ensembles.layers.parameters import (
    check_norm_initializers,
    drawing_from,
    member_copies,
    member_slice,
    norm_param,
)
from ensembles.layers.stacking import over_layer_axes
from ensembles.ops.normalization import ensemble_layer_norm, ensemble_rms_norm

__all__ = ["EnsembleLayerNorm", "EnsembleRMSNorm"]

default_bias_init = initializers.zeros_init()
default_scale_init = initializers.ones_init()


def _sample_norm(
    op: Callable[..., jax.Array],
    norm: EnsembleLayerNorm | EnsembleRMSNorm,
    x: jax.Array,
    mask: Any,
    *params: nnx.Param | None,
) -> jax.Array:
    """Calls ``op`` as ``norm`` does, on ``x`` and ``params`` (in ``op``'s order)."""
    x = as_array(x, "x")
    mask = check_norm_mask(mask, x)
    size, arrays = norm._member_operands(*(v if v is None else v[...] for v in params))
    x, *arrays = norm.promote_dtype((x, *arrays), dtype=norm.dtype)
    return op(
        x,
        *arrays,
        num_members=size,
        epsilon=norm.epsilon,
        dtype=norm.dtype,
        reduction_axes=norm.reduction_axes,
        feature_axes=norm.feature_axes,
        axis_name=norm.axis_name,
        axis_index_groups=norm.axis_index_groups,
        use_fast_variance=norm.use_fast_variance,
        mask=mask,
    )


class EnsembleLayerNorm(EnsembleModule):
    """``nnx.LayerNorm`` with a per-member scale and bias ``[E, num_features]``.

    Statistics are per sample, exactly as Flax's; member ``k``'s rows
    ``[k*B, (k+1)*B)`` get ``scale[k]`` and ``bias[k]``. The axes count the
    axes of one member's ``[B, ...]`` rows (the ensemble batch has the same
    rank); ``reduction_axes`` containing 0 reduces over each member's own rows.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import ensembles
    >>> norm = ensembles.EnsembleLayerNorm(6, num_members=3, rngs=nnx.Rngs(0))
    >>> jax.tree.map(jnp.shape, nnx.state(norm))
    State({
      'bias': Param(
        value=(3, 6)
      ),
      'scale': Param(
        value=(3, 6)
      )
    })
    >>> x = jnp.ones((4, 5, 6))                       # un-tiled [B, T, features]
    >>> norm(ensembles.tile(x, 3)).shape
    (12, 5, 6)
    >>> nnx.view(norm, member=1)(x).shape             # member 1 alone
    (4, 5, 6)

    Args:
      num_features: the number of input features.
      num_members: the ensemble size E (keyword-only, required).
      epsilon: a small float added to the variance to avoid dividing by zero.
      dtype: the dtype of the result (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      use_bias: if True, a per-member bias is added.
      use_scale: if True, multiply by a per-member scale.
      bias_init: initializer for the ``[E, num_features]`` bias (default: zeros).
      scale_init: initializer for the ``[E, num_features]`` scale (default: ones).
      reduction_axes: axes for computing the normalization statistics.
      feature_axes: feature axes for the learned bias and scale.
      axis_name: the mapped axis to average the statistics over (``pmean``).
      axis_index_groups: groups of axis indices within ``axis_name``.
      use_fast_variance: if True, use the faster, less stable variance formula.
      promote_dtype: function promoting ``(inputs, scale, bias)`` to a common
        dtype, called with a ``dtype`` keyword (default: Flax's).
      rngs: rng keys; the scale and bias each draw from ``rngs.params()``.
      bias_metadata: metadata of the bias ``Param``.
      scale_metadata: metadata of the scale ``Param``.
    """

    def __init__(
        self,
        num_features: int,
        *,
        num_members: int,
        epsilon: float = 1e-6,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Initializer = default_bias_init,
        scale_init: Initializer = default_scale_init,
        reduction_axes: Axes = -1,
        feature_axes: Axes = -1,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
        rngs: nnx.Rngs,
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        num_features = check_positive_int(num_features, "num_features")
        num_members = check_num_members(num_members)
        use_bias = check_bool(use_bias, "use_bias")
        use_scale = check_bool(use_scale, "use_scale")
        use_fast_variance = check_bool(use_fast_variance, "use_fast_variance")
        check_norm_initializers(use_scale, scale_init, use_bias, bias_init)
        shape = (num_members, num_features)
        with drawing_from(rngs) as draw:
            self.scale = norm_param(
                use_scale, scale_init, draw, shape, param_dtype, scale_metadata, "scale"
            )
            self.bias = norm_param(
                use_bias, bias_init, draw, shape, param_dtype, bias_metadata, "bias"
            )
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.reduction_axes = reduction_axes
        self.feature_axes = feature_axes
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype
        self.use_bias = use_bias
        self.use_scale = use_scale
        self.num_members = num_members
        self.member = None

    @classmethod
    def from_layer_norm(
        cls, norm: nnx.LayerNorm, *, num_members: int
    ) -> EnsembleLayerNorm:
        """Builds a per-member norm from a pretrained ``nnx.LayerNorm``.

        Every member starts with a copy of ``norm``'s scale and bias, so each
        member computes exactly what ``norm`` does; ``norm`` is not changed.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> norm = nnx.LayerNorm(4, rngs=nnx.Rngs(0))
        >>> norm.scale[...] = jnp.arange(4.0)
        >>> ensemble = ensembles.EnsembleLayerNorm.from_layer_norm(
        ...     norm, num_members=2)
        >>> x = jnp.arange(12.0).reshape(3, 4)
        >>> bool(jnp.allclose(ensemble(ensembles.tile(x, 2))[3:], norm(x)))
        True

        Args:
          norm: the pretrained ``nnx.LayerNorm``.
          num_members: the ensemble size E.

        Returns:
          The new ``EnsembleLayerNorm``.

        Raises:
          TypeError: if ``norm`` is not an ``nnx.LayerNorm``.
        """
        check_flax_layer(norm, nnx.LayerNorm, "norm", cls.__name__)
        scale_init, scale_metadata = member_copies(norm.scale)
        bias_init, bias_metadata = member_copies(norm.bias)
        return cls(
            norm.num_features,
            num_members=num_members,
            epsilon=norm.epsilon,
            dtype=norm.dtype,
            param_dtype=norm.param_dtype,
            use_bias=norm.bias is not None,
            use_scale=norm.scale is not None,
            bias_init=bias_init,
            scale_init=scale_init,
            reduction_axes=norm.reduction_axes,
            feature_axes=norm.feature_axes,
            axis_name=norm.axis_name,
            axis_index_groups=norm.axis_index_groups,
            use_fast_variance=norm.use_fast_variance,
            promote_dtype=norm.promote_dtype,
            rngs=nnx.Rngs(0),
            bias_metadata=bias_metadata,
            scale_metadata=scale_metadata,
        )

    @over_layer_axes
    def extract_member(self, member: int) -> nnx.LayerNorm:
        """Returns member ``member`` as a plain ``nnx.LayerNorm``.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> norm = ensembles.EnsembleLayerNorm(
        ...     4, num_members=2, scale_init=nnx.initializers.normal(1.0),
        ...     rngs=nnx.Rngs(0))
        >>> plain = norm.extract_member(1)
        >>> type(plain).__name__, plain.scale.shape
        ('LayerNorm', (4,))
        >>> x = jnp.arange(8.0).reshape(2, 4)
        >>> bool(jnp.allclose(plain(x), nnx.view(norm, member=1)(x)))
        True

        Args:
          member: the member index k, ``0 <= k < num_members``.

        Returns:
          A new ``nnx.LayerNorm`` holding member k's scale and bias; this norm
          is not changed.
        """
        k = check_member_index(member, self.num_members)
        return plain_layer(
            lambda rngs: nnx.LayerNorm(
                self.num_features,
                epsilon=self.epsilon,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                use_bias=self.use_bias,
                use_scale=self.use_scale,
                reduction_axes=self.reduction_axes,
                feature_axes=self.feature_axes,
                axis_name=self.axis_name,
                axis_index_groups=self.axis_index_groups,
                use_fast_variance=self.use_fast_variance,
                promote_dtype=self.promote_dtype,
                rngs=rngs,
            ),
            scale=member_slice(self.scale, k),
            bias=member_slice(self.bias, k),
        )

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalizes each member's rows with its own scale and bias.

        Args:
          x: the ``[E*B, ...]`` member-major inputs; in a member view an
            un-tiled ``[B, ...]`` batch.
          mask: booleans broadcastable to ``x``: the entries the statistics
            count. A row with no True entry gets NaN statistics, as in Flax.

        Returns:
          The normalized inputs, of the same shape.

        Raises:
          TypeError: if ``mask`` is not boolean.
          ValueError: if ``mask`` does not broadcast to ``x``.
        """
        return _sample_norm(ensemble_layer_norm, self, x, mask, self.scale, self.bias)


class EnsembleRMSNorm(EnsembleModule):
    """``nnx.RMSNorm`` with a per-member scale ``[E, num_features]``.

    Statistics are per sample, exactly as Flax's; member ``k``'s rows
    ``[k*B, (k+1)*B)`` get ``scale[k]``.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import ensembles
    >>> norm = ensembles.EnsembleRMSNorm(6, num_members=3, rngs=nnx.Rngs(0))
    >>> jax.tree.map(jnp.shape, nnx.state(norm))
    State({
      'scale': Param(
        value=(3, 6)
      )
    })
    >>> x = jnp.ones((4, 6))
    >>> norm(ensembles.tile(x, 3)).shape, nnx.view(norm, member=2)(x).shape
    ((12, 6), (4, 6))

    Args:
      num_features: the number of input features.
      num_members: the ensemble size E (keyword-only, required).
      epsilon: a small float added to the mean square to avoid dividing by zero.
      dtype: the dtype of the result (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      use_scale: if True, multiply by a per-member scale.
      scale_init: initializer for the ``[E, num_features]`` scale (default: ones).
      reduction_axes: axes for computing the normalization statistics.
      feature_axes: feature axes for the learned scale.
      axis_name: the mapped axis to average the statistics over (``pmean``).
      axis_index_groups: groups of axis indices within ``axis_name``.
      use_fast_variance: accepted for parity with ``nnx.RMSNorm``.
      promote_dtype: function promoting ``(inputs, scale)`` to a common dtype,
        called with a ``dtype`` keyword (default: Flax's).
      rngs: rng keys; the scale draws from ``rngs.params()``.
      scale_metadata: metadata of the scale ``Param``.
    """

    def __init__(
        self,
        num_features: int,
        *,
        num_members: int,
        epsilon: float = 1e-6,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_scale: bool = True,
        scale_init: Initializer = initializers.ones,
        reduction_axes: Axes = -1,
        feature_axes: Axes = -1,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
        rngs: nnx.Rngs,
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        num_features = check_positive_int(num_features, "num_features")
        num_members = check_num_members(num_members)
        use_scale = check_bool(use_scale, "use_scale")
        use_fast_variance = check_bool(use_fast_variance, "use_fast_variance")
        check_norm_initializers(use_scale, scale_init, False, None)
        shape = (num_members, num_features)
        with drawing_from(rngs) as draw:
            self.scale = norm_param(
                use_scale, scale_init, draw, shape, param_dtype, scale_metadata, "scale"
            )
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.reduction_axes = reduction_axes
        self.feature_axes = feature_axes
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype
        self.use_scale = use_scale
        self.num_members = num_members
        self.member = None

    @classmethod
    def from_rms_norm(cls, norm: nnx.RMSNorm, *, num_members: int) -> EnsembleRMSNorm:
        """Builds a per-member norm from a pretrained ``nnx.RMSNorm``.

        Every member starts with a copy of ``norm``'s scale; ``norm`` is not
        changed.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> norm = nnx.RMSNorm(4, rngs=nnx.Rngs(0))
        >>> ensemble = ensembles.EnsembleRMSNorm.from_rms_norm(norm, num_members=2)
        >>> x = jnp.arange(12.0).reshape(3, 4)
        >>> bool(jnp.allclose(ensemble(ensembles.tile(x, 2))[:3], norm(x)))
        True

        Args:
          norm: the pretrained ``nnx.RMSNorm``.
          num_members: the ensemble size E.

        Returns:
          The new ``EnsembleRMSNorm``.

        Raises:
          TypeError: if ``norm`` is not an ``nnx.RMSNorm``.
        """
        check_flax_layer(norm, nnx.RMSNorm, "norm", cls.__name__)
        scale_init, scale_metadata = member_copies(norm.scale)
        return cls(
            norm.num_features,
            num_members=num_members,
            epsilon=norm.epsilon,
            dtype=norm.dtype,
            param_dtype=norm.param_dtype,
            use_scale=norm.scale is not None,
            scale_init=scale_init,
            reduction_axes=norm.reduction_axes,
            feature_axes=norm.feature_axes,
            axis_name=norm.axis_name,
            axis_index_groups=norm.axis_index_groups,
            use_fast_variance=norm.use_fast_variance,
            promote_dtype=norm.promote_dtype,
            rngs=nnx.Rngs(0),
            scale_metadata=scale_metadata,
        )

    @over_layer_axes
    def extract_member(self, member: int) -> nnx.RMSNorm:
        """Returns member ``member`` as a plain ``nnx.RMSNorm``.

        >>> from flax import nnx
        >>> import ensembles
        >>> norm = ensembles.EnsembleRMSNorm(4, num_members=2, rngs=nnx.Rngs(0))
        >>> plain = norm.extract_member(0)
        >>> type(plain).__name__, plain.scale.shape
        ('RMSNorm', (4,))

        Args:
          member: the member index k, ``0 <= k < num_members``.

        Returns:
          A new ``nnx.RMSNorm`` holding member k's scale; this norm is not
          changed.
        """
        k = check_member_index(member, self.num_members)
        return plain_layer(
            lambda rngs: nnx.RMSNorm(
                self.num_features,
                epsilon=self.epsilon,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                use_scale=self.use_scale,
                reduction_axes=self.reduction_axes,
                feature_axes=self.feature_axes,
                axis_name=self.axis_name,
                axis_index_groups=self.axis_index_groups,
                use_fast_variance=self.use_fast_variance,
                promote_dtype=self.promote_dtype,
                rngs=rngs,
            ),
            scale=member_slice(self.scale, k),
        )

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """Normalizes each member's rows with its own scale.

        Args:
          x: the ``[E*B, ...]`` member-major inputs; in a member view an
            un-tiled ``[B, ...]`` batch.
          mask: booleans broadcastable to ``x``: the entries the statistics
            count. A row with no True entry gets NaN statistics, as in Flax.

        Returns:
          The normalized inputs, of the same shape.

        Raises:
          TypeError: if ``mask`` is not boolean.
          ValueError: if ``mask`` does not broadcast to ``x``.
        """
        return _sample_norm(ensemble_rms_norm, self, x, mask, self.scale)
