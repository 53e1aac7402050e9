"""Per-member normalization layers: no statistic or parameter mixes members.

Each layer mirrors its Flax norm, with every parameter (and, for batch norm,
every running statistic) given a leading member axis ``[E, features]``. Member
``k`` normalizes its rows ``[k*B, (k+1)*B)`` of a member-major batch exactly as
the Flax norm holding member ``k``'s parameters would normalize those rows
alone. ``nnx.view(norm, member=k)`` runs member ``k`` alone on an un-tiled
``[B, ...]`` batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.module import first_from
from flax.nnx.nn import dtypes, initializers
from flax.typing import Axes, Dtype, Initializer, PromoteDtypeFn

from ensembles._checks import check_positive_int
from ensembles.layers._legacy import EnsembleModule, ParamSpec, member_slice
from ensembles.ops import normalization

__all__ = ["EnsembleBatchNorm", "EnsembleLayerNorm", "EnsembleRMSNorm"]

default_bias_init = initializers.zeros_init()
default_scale_init = initializers.ones_init()


def _check_mask(mask: Any, x: Any) -> Any:
    """Checks that ``mask`` is boolean and broadcasts to the inputs ``x``."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"`mask` must be a boolean array (True: the entry counts in the "
            f"statistics), got dtype {mask.dtype}: pass `mask.astype(bool)`."
        )
    shape = tuple(jnp.shape(x))
    try:
        broadcast = jnp.broadcast_shapes(tuple(mask.shape), shape)
    except ValueError:
        broadcast = None
    if broadcast != shape:
        raise ValueError(
            f"`mask` must broadcast to the shape of `x` {shape}, got shape "
            f"{tuple(mask.shape)}: give it one entry per input entry (or size-1 "
            f"axes to broadcast)."
        )
    return mask


def _check_use_running_average(value: Any) -> bool:
    """Checks the resolved ``use_running_average`` of a call: a Python bool."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(
            f"`use_running_average` must be a bool, got {value!r} of type "
            f"{type(value).__name__}: any other value would be read as its "
            f"truthiness. Pass True (evaluation) or False (training)."
        )
    return bool(value)


class _Norm(EnsembleModule):
    """What the per-member norms share: their ``[E, num_features]`` parameters."""

    def _init_norm(self, options: Mapping[str, Any]) -> None:
        """Draws the used ``_member_params`` and stores the options.

        ``options`` is the constructor's ``locals()`` (see ``_init_module``).
        """
        shape = (options["num_features"],)
        self._init_module(
            options,
            **{
                name: ParamSpec(
                    nnx.Param,
                    shape,
                    options[f"{name}_init"],
                    options[f"{name}_metadata"],
                )
                if options[f"use_{name}"]
                else None
                for name in self._member_params
            },
        )


#: The options LayerNorm and RMSNorm share with their Flax norms.
_SAMPLE_NORM_OPTIONS = (
    "num_features",
    "epsilon",
    "dtype",
    "param_dtype",
    "reduction_axes",
    "feature_axes",
    "axis_name",
    "axis_index_groups",
    "use_fast_variance",
    "promote_dtype",
)


class _SampleNorm(_Norm):
    """LayerNorm and RMSNorm: per-sample statistics, per-member parameters."""

    def _normalize(self, op, x: jax.Array, mask: jax.Array | None) -> jax.Array:
        mask = _check_mask(mask, x)
        num_members, params = self._member_arrays()
        x, *params = self.promote_dtype((x, *params), dtype=self.dtype)
        return op(
            x,
            *params,
            num_members=num_members,
            epsilon=self.epsilon,
            dtype=self.dtype,
            reduction_axes=self.reduction_axes,
            feature_axes=self.feature_axes,
            axis_name=self.axis_name,
            axis_index_groups=self.axis_index_groups,
            use_fast_variance=self.use_fast_variance,
            mask=mask,
        )


class EnsembleLayerNorm(_SampleNorm):
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

    flax_module = nnx.LayerNorm
    _flax_options = (*_SAMPLE_NORM_OPTIONS, "use_bias", "use_scale")
    _member_params = ("scale", "bias")

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
        self._init_norm(locals())

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
        return cls._from_flax(norm, "norm", num_members=num_members, rngs=nnx.Rngs(0))

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
        return super().extract_member(member)

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
        return self._normalize(normalization.ensemble_layer_norm, x, mask)


class EnsembleRMSNorm(_SampleNorm):
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

    flax_module = nnx.RMSNorm
    _flax_options = (*_SAMPLE_NORM_OPTIONS, "use_scale")
    _member_params = ("scale",)

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
        self._init_norm(locals())

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
        return cls._from_flax(norm, "norm", num_members=num_members, rngs=nnx.Rngs(0))

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
        return super().extract_member(member)

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
        return self._normalize(normalization.ensemble_rms_norm, x, mask)


class EnsembleBatchNorm(_Norm):
    """``nnx.BatchNorm`` with per-member statistics, running averages and params.

    In training (``use_running_average=False``) member ``k``'s rows
    ``[k*B, (k+1)*B)`` are normalized with their own batch statistics, and
    only member ``k``'s running averages ``mean[k]``, ``var[k]`` (``nnx.BatchStat``,
    ``[E, num_features]``) move towards them. In evaluation the running
    averages of each member are used. ``model.eval()`` / ``model.train()`` and
    ``nnx.view(model, use_running_average=True)`` work as for ``nnx.BatchNorm``;
    ``nnx.view(norm, member=k)`` runs (and, in training, updates) member ``k``
    alone on an un-tiled ``[B, ...]`` batch.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import ensembles
    >>> norm = ensembles.EnsembleBatchNorm(6, num_members=3, rngs=nnx.Rngs(0))
    >>> jax.tree.map(jnp.shape, nnx.state(norm))
    State({
      'bias': Param(
        value=(3, 6)
      ),
      'mean': BatchStat(
        value=(3, 6)
      ),
      'scale': Param(
        value=(3, 6)
      ),
      'var': BatchStat(
        value=(3, 6)
      )
    })
    >>> x = jax.random.normal(jax.random.key(0), (3 * 4, 6))
    >>> y = norm(x)                                   # training: updates mean, var
    >>> bool(jnp.all(norm.mean[...] != 0))
    True
    >>> norm.eval()                                   # use the running averages
    >>> norm.use_running_average
    True

    Args:
      num_features: the number of input features.
      num_members: the ensemble size E (keyword-only, required).
      use_running_average: if True, the stored running averages are used
        instead of the batch statistics.
      axis: the feature axis of the input.
      momentum: decay rate of the exponential moving averages.
      epsilon: a small float added to the variance to avoid dividing by zero.
      dtype: the dtype of the result (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      use_bias: if True, a per-member bias is added.
      use_scale: if True, multiply by a per-member scale.
      bias_init: initializer for the ``[E, num_features]`` bias (default: zeros).
      scale_init: initializer for the ``[E, num_features]`` scale (default: ones).
      axis_name: the mapped axis to average the batch statistics over.
      axis_index_groups: groups of axis indices within ``axis_name``.
      use_fast_variance: if True, use the faster, less stable variance formula.
      promote_dtype: function promoting ``(inputs, mean, var, scale, bias)`` to
        a common dtype, called with a ``dtype`` keyword (default: Flax's).
      rngs: rng keys; the scale and bias each draw from ``rngs.params()``.
      bias_metadata: metadata of the bias ``Param``.
      scale_metadata: metadata of the scale ``Param``.
    """

    flax_module = nnx.BatchNorm
    _flax_options = (
        "num_features",
        "use_running_average",
        "axis",
        "momentum",
        "epsilon",
        "dtype",
        "param_dtype",
        "use_bias",
        "use_scale",
        "axis_name",
        "axis_index_groups",
        "use_fast_variance",
        "promote_dtype",
    )
    _member_params = ("scale", "bias")

    def __init__(
        self,
        num_features: int,
        *,
        num_members: int,
        use_running_average: bool | None = False,
        axis: int = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-5,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Initializer = default_bias_init,
        scale_init: Initializer = default_scale_init,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
        rngs: nnx.Rngs,
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        num_features = check_positive_int(num_features, "num_features")
        self._init_norm(locals())
        shape = (self.num_members, num_features)
        self.mean = nnx.BatchStat(jnp.zeros(shape, jnp.float32))
        self.var = nnx.BatchStat(jnp.ones(shape, jnp.float32))

    @classmethod
    def from_batch_norm(
        cls, norm: nnx.BatchNorm, *, num_members: int
    ) -> EnsembleBatchNorm:
        """Builds a per-member norm from a pretrained ``nnx.BatchNorm``.

        Every member starts with a copy of ``norm``'s scale, bias and running
        averages, so in evaluation each member computes exactly what ``norm``
        does; ``norm`` is not changed.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> norm = nnx.BatchNorm(4, use_running_average=True, rngs=nnx.Rngs(0))
        >>> norm.mean[...] = jnp.arange(4.0)
        >>> ensemble = ensembles.EnsembleBatchNorm.from_batch_norm(
        ...     norm, num_members=2)
        >>> ensemble.mean.shape
        (2, 4)
        >>> x = jnp.ones((3, 4))
        >>> bool(jnp.allclose(ensemble(ensembles.tile(x, 2))[3:], norm(x)))
        True

        Args:
          norm: the pretrained ``nnx.BatchNorm``.
          num_members: the ensemble size E.

        Returns:
          The new ``EnsembleBatchNorm``.

        Raises:
          TypeError: if ``norm`` is not an ``nnx.BatchNorm``.
        """
        ensemble = cls._from_flax(
            norm, "norm", num_members=num_members, rngs=nnx.Rngs(0)
        )
        shape = ensemble.mean.shape
        # set_value, not [...] =: the statistics keep the source's dtype (a
        # model cast to bfloat16 keeps bfloat16 running averages).
        ensemble.mean.set_value(jnp.broadcast_to(norm.mean[...], shape))
        ensemble.var.set_value(jnp.broadcast_to(norm.var[...], shape))
        return ensemble

    def extract_member(self, member: int) -> nnx.BatchNorm:
        """Returns member ``member`` as a plain ``nnx.BatchNorm``.

        It holds member k's scale, bias and running averages, and the same
        ``use_running_average``.

        >>> from flax import nnx
        >>> import ensembles
        >>> norm = ensembles.EnsembleBatchNorm(4, num_members=2, rngs=nnx.Rngs(0))
        >>> plain = norm.extract_member(1)
        >>> type(plain).__name__, plain.mean.shape, plain.scale.shape
        ('BatchNorm', (4,), (4,))

        Args:
          member: the member index k, ``0 <= k < num_members``.

        Returns:
          A new ``nnx.BatchNorm``; this norm is not changed.
        """
        return super().extract_member(member)

    def _member_state(self, member: int) -> dict[str, Any]:
        return {
            "mean": member_slice(self.mean, member),
            "var": member_slice(self.var, member),
            **super()._member_state(member),
        }

    def set_view(
        self,
        member: int | None = None,
        use_running_average: bool | None = None,
    ):
        """Class method used by ``nnx.view``.

        Args:
          member: if an int ``k``, the norm runs member ``k`` alone on an
            un-tiled ``[B, ...]`` batch with member ``k``'s parameters and
            running averages (and, in training, updates only those). ``None``
            leaves the view unchanged.
          use_running_average: if True, the stored running averages are used
            instead of the batch statistics. ``None`` leaves it unchanged.
        """
        # Check everything before setting anything: a failed view mutates nothing.
        if use_running_average is not None and not isinstance(
            use_running_average, bool
        ):
            raise TypeError(
                f"`use_running_average` must be a bool or None, got "
                f"{use_running_average!r}."
            )
        super().set_view(member=member)
        if use_running_average is not None:
            self.use_running_average = use_running_average

    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """Normalizes each member's rows with its own statistics.

        Args:
          x: the ``[E*B, ...]`` member-major inputs; in a member view an
            un-tiled ``[B, ...]`` batch.
          use_running_average: overrides the attribute of the same name for
            this call.
          mask: booleans broadcastable to ``x``: the entries the batch
            statistics count. A member with no True entry gets NaN batch
            statistics and, in training, NaN running averages, as in Flax:
            they stay NaN, so the mistake shows.

        Returns:
          The normalized inputs, of the same shape.

        Raises:
          ValueError: if neither the argument nor the attribute
            ``use_running_average`` is set, if ``mask`` does not broadcast to
            ``x``, or if ``x`` is empty in training (no rows to take batch
            statistics from). The running averages are unchanged then.
          TypeError: if ``use_running_average`` is not a bool or ``mask`` not
            boolean.
        """
        use_running_average = first_from(
            use_running_average,
            self.use_running_average,
            error_msg=(
                "No `use_running_average` was given to EnsembleBatchNorm: pass it "
                "to the constructor or the call, or use `nnx.view(model, "
                "use_running_average=True/False)`."
            ),
        )
        use_running_average = _check_use_running_average(use_running_average)
        mask = _check_mask(mask, x)
        if not use_running_average and jnp.size(x) == 0:
            raise ValueError(
                f"`x` has shape {tuple(jnp.shape(x))}: an empty batch has no "
                f"batch statistics, and training on it would write NaN into the "
                f"running averages. Skip the call, or pass "
                f"use_running_average=True."
            )
        num_members, (scale, bias) = self._member_arrays()
        _, (running_mean, running_var) = self._members(self.mean[...], self.var[...])
        x, mean, var, scale, bias = self.promote_dtype(
            (x, running_mean, running_var, scale, bias), dtype=self.dtype
        )
        if not use_running_average:
            mean, var = normalization.ensemble_batch_statistics(
                x,
                num_members=num_members,
                axis=self.axis,
                dtype=self.dtype,
                axis_name=self.axis_name,
                axis_index_groups=self.axis_index_groups,
                use_fast_variance=self.use_fast_variance,
                mask=mask,
                num_features=self.num_features,
            )
        y = normalization.ensemble_batch_norm(
            x,
            mean,
            var,
            scale,
            bias,
            num_members=num_members,
            axis=self.axis,
            epsilon=self.epsilon,
            dtype=self.dtype,
        )
        # Only once everything is checked and computed: errors mutate nothing.
        if not use_running_average:
            self._update(self.mean, running_mean, mean)
            self._update(self.var, running_var, var)
        return y

    def _update(self, variable, running, batch):
        """Moves the running average (member k's row in a view) towards ``batch``."""
        new = jax.lax.stop_gradient(
            self.momentum * running + (1 - self.momentum) * batch
        )
        if self.member is None:
            variable[...] = new
        else:
            k = self.member
            variable[...] = variable[...].at[k : k + 1].set(new)
