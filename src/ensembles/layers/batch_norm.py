"""Per-member batch normalization: no statistic or parameter mixes members.

:class:`EnsembleBatchNorm` mirrors ``nnx.BatchNorm``, with every parameter and
every running statistic given a leading member axis ``[E, features]``. Member
``k`` normalizes its rows ``[k*B, (k+1)*B)`` of a member-major batch exactly as
the Flax norm holding member ``k``'s parameters and statistics would normalize
those rows alone. ``nnx.view(norm, member=k)`` runs member ``k`` alone on an
un-tiled ``[B, ...]`` batch. The per-sample norms, and what the norms share, are
in :mod:`ensembles.layers.normalization`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.module import first_from
from flax.nnx.nn import dtypes
from flax.typing import Dtype, Initializer, PromoteDtypeFn

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
from ensembles.layers.normalization import default_bias_init, default_scale_init
from ensembles.layers.parameters import (
    check_norm_initializers,
    drawing_from,
    member_copies,
    member_slice,
    norm_param,
)
from ensembles.layers.stacking import over_layer_axes
from ensembles.ops.normalization import ensemble_batch_norm, ensemble_batch_statistics

__all__ = ["EnsembleBatchNorm"]


class EnsembleBatchNorm(EnsembleModule):
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
        num_members = check_num_members(num_members)
        use_running_average = check_bool(
            use_running_average, "use_running_average", optional=True
        )
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
        self.use_running_average = use_running_average
        self.axis = axis
        self.momentum = momentum
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_bias = use_bias
        self.use_scale = use_scale
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype
        self.num_members = num_members
        self.member = None
        # Float32 whatever `param_dtype` is, as Flax's running averages.
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
        check_flax_layer(norm, nnx.BatchNorm, "norm", cls.__name__)
        scale_init, scale_metadata = member_copies(norm.scale)
        bias_init, bias_metadata = member_copies(norm.bias)
        ensemble = cls(
            norm.num_features,
            num_members=num_members,
            use_running_average=norm.use_running_average,
            axis=norm.axis,
            momentum=norm.momentum,
            epsilon=norm.epsilon,
            dtype=norm.dtype,
            param_dtype=norm.param_dtype,
            use_bias=norm.bias is not None,
            use_scale=norm.scale is not None,
            bias_init=bias_init,
            scale_init=scale_init,
            axis_name=norm.axis_name,
            axis_index_groups=norm.axis_index_groups,
            use_fast_variance=norm.use_fast_variance,
            promote_dtype=norm.promote_dtype,
            rngs=nnx.Rngs(0),
            bias_metadata=bias_metadata,
            scale_metadata=scale_metadata,
        )
        shape = ensemble.mean.shape
        # set_value, not [...] =: the statistics keep the source's dtype (a
        # model cast to bfloat16 keeps bfloat16 running averages).
        ensemble.mean.set_value(jnp.broadcast_to(norm.mean[...], shape))
        ensemble.var.set_value(jnp.broadcast_to(norm.var[...], shape))
        return ensemble

    @over_layer_axes
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
        k = check_member_index(member, self.num_members)
        return plain_layer(
            lambda rngs: nnx.BatchNorm(
                self.num_features,
                use_running_average=self.use_running_average,
                axis=self.axis,
                momentum=self.momentum,
                epsilon=self.epsilon,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                use_bias=self.use_bias,
                use_scale=self.use_scale,
                axis_name=self.axis_name,
                axis_index_groups=self.axis_index_groups,
                use_fast_variance=self.use_fast_variance,
                promote_dtype=self.promote_dtype,
                rngs=rngs,
            ),
            mean=member_slice(self.mean, k),
            var=member_slice(self.var, k),
            scale=member_slice(self.scale, k),
            bias=member_slice(self.bias, k),
        )

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
        use_running_average = check_bool(
            use_running_average, "use_running_average", optional=True
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
        use_running_average = check_bool(use_running_average, "use_running_average")
        x = as_array(x, "x")
        mask = check_norm_mask(mask, x)
        if not use_running_average and jnp.size(x) == 0:
            raise ValueError(
                f"`x` has shape {tuple(jnp.shape(x))}: an empty batch has no "
                f"batch statistics, and training on it would write NaN into the "
                f"running averages. Skip the call, or pass "
                f"use_running_average=True."
            )
        scale = None if self.scale is None else self.scale[...]
        bias = None if self.bias is None else self.bias[...]
        num_members, (scale, bias, running_mean, running_var) = self._member_operands(
            scale, bias, self.mean[...], self.var[...]
        )
        x, mean, var, scale, bias = self.promote_dtype(
            (x, running_mean, running_var, scale, bias), dtype=self.dtype
        )
        if not use_running_average:
            mean, var = ensemble_batch_statistics(
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
        y = ensemble_batch_norm(
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
