"""BatchEnsemble sibling of ``nnx.LinearGeneral``."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core.frozen_dict import FrozenDict
from flax.nnx.nn import dtypes
from flax.typing import Dtype, Initializer, PrecisionLike, PromoteDtypeFn
from jax import lax

from ensembles._checks import check_bool, check_positive_int
from ensembles.layers.base import (
    BatchEnsembleModule,
    check_flax_layer,
    check_member_index,
    plain_layer,
)
from ensembles.layers.parameters import (
    default_bias_init,
    default_fast_weight_init,
    default_kernel_init,
    flat_copy_of,
    flat_initializer,
    member_slice,
    variable_copy,
)
from ensembles.layers.posterior import DEFAULT_PRIOR_STDDEV, default_stddev_init
from ensembles.layers.sharding import shard_output
from ensembles.layers.stacking import over_layer_axes
from ensembles.layers.weights import check_weight_options, from_flax_layer, new_weights
from ensembles.ops import dense_general
from ensembles.ops.impls import IMPLS

__all__ = ["BatchEnsembleLinearGeneral"]


def _features(value: Any, name: str) -> tuple[int, ...]:
    values = tuple(value) if isinstance(value, Sequence) else (value,)
    if not values:
        raise ValueError(f"`{name}` must hold at least one size, got {value!r}.")
    return tuple(check_positive_int(v, name) for v in values)


def _axes(value: Any) -> tuple[int, ...]:
    values = tuple(value) if isinstance(value, Sequence) else (value,)
    out = []
    for v in values:
        if isinstance(v, bool):
            raise TypeError(f"`axis` must hold ints, got the bool {v!r}.")
        try:
            out.append(operator.index(v))
        except TypeError:
            raise TypeError(
                f"`axis` must hold ints, got {v!r} of type {type(v).__name__}."
            ) from None
    return tuple(out)


class BatchEnsembleLinearGeneral(BatchEnsembleModule):
    """A BatchEnsemble ``nnx.LinearGeneral``: multi-axis features per member.

    Member ``k`` maps its rows ``[k*B, (k+1)*B)`` of a member-major ``[E*B,
    ...]`` batch as an ``nnx.LinearGeneral`` with the same ``axis`` and
    ``batch_axis`` would, holding the effective kernel ``kernel * r[k] * s[k]``
    (``r[k]``, shape ``in_features``, broadcast over the kernel's input feature
    axes; ``s[k]``, shape ``out_features``, over its output feature axes) and
    the bias ``bias[k]``. All members run as one batch through
    :func:`ensembles.ops.batch_ensemble_dense_general`.

    ``axis`` and ``batch_axis`` count the axes of one member's ``[B, ...]``
    rows (the ensemble batch has the same rank). Axis 0 carries the members, so
    ``axis`` must not contain it. With ``batch_axis`` (whose keys Flax requires
    to be ``0, 1, ...``) the kernel has leading batch axes paired with the
    leading axes of each member's rows, so ``batch_axis[0]`` is the per-member
    batch ``B``; ``r`` and ``s`` are shared across those kernel batch axes (one
    rank-one modulation per member, as for the plain layer), while the bias
    keeps them: ``[E, *batch_shape, *out_features]``, as Flax's is
    ``[*batch_shape, *out_features]``.

    The attention shapes of ``nnx.MultiHeadAttention``: its query/key/value
    projections are ``LinearGeneral(features, (heads, head_dim))`` and its
    output projection ``LinearGeneral((heads, head_dim), features, axis=(-2,
    -1))``.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.BatchEnsembleLinearGeneral(
    ...     8, (2, 4), num_members=3, rngs=nnx.Rngs(0))
    >>> jax.tree.map(jnp.shape, nnx.state(layer))
    State({
      'bias': Param(
        value=(3, 2, 4)
      ),
      'kernel': Param(
        value=(8, 2, 4)
      ),
      'r': FastWeight(
        value=(3, 8)
      ),
      's': FastWeight(
        value=(3, 2, 4)
      )
    })
    >>> x = jnp.ones((5, 7, 8))                      # un-tiled [B, T, features]
    >>> layer(ensembles.tile(x, 3)).shape            # [E*B, T, heads, head_dim]
    (15, 7, 2, 4)
    >>> nnx.view(layer, member=2)(x).shape           # member 2 alone
    (5, 7, 2, 4)

    Args:
      in_features: int or tuple with the number of input features.
      out_features: int or tuple with the number of output features.
      num_members: the ensemble size E (keyword-only, required).
      axis: int or tuple of the input axes contracted with the kernel, e.g.
        ``(-2, -1)`` for the last two axes; never 0 (the member axis).
      batch_axis: mapping of leading batch axes (``0, 1, ...``) of each
        member's rows to their sizes; the kernel gets these leading axes.
      use_bias: whether to add a per-member bias (default: True).
      dtype: the dtype of the computation (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      kernel_init: initializer for the shared kernel, called like Flax's with
        the flattened 2-D shape (default: LeCun normal).
      bias_init: initializer for the per-member bias, called with the shape
        ``[E, prod(batch_shape + out_features)]`` (default: zeros).
      r_init: initializer for the ``[E, *in_features]`` fast weights
        (default: N(1, 0.5)).
      s_init: initializer for the ``[E, *out_features]`` fast weights
        (default: N(1, 0.5)).
      precision: numerical precision of the contraction, see
        ``jax.lax.Precision``.
      promote_dtype: Flax's ``promote_dtype`` contract: called on ``(inputs,
        kernel, bias)`` with a ``dtype`` keyword, as the Flax layer calls it;
        ``r`` and ``s`` are then cast to the kernel's dtype (default: Flax's).
      preferred_element_type: accumulation/output dtype of the contraction.
      impl: the dense op implementation: ``"xla"`` (the default) or
        ``"pallas"``; see :func:`ensembles.ops.batch_ensemble_dense`.
      posterior: ``None`` (point fast weights: BatchEnsemble) or
        ``"gaussian"`` / ``"cauchy"``: rank-1 Bayesian fast weights, ``r``
        and ``s`` the posterior means (see ``docs/rank1.md``).
      prior_stddev: the scale of every fast weight's prior, centred on 1
        (default: 0.1, uncertainty-baselines' CIFAR value).
      stddev_init: initializer for ``r_unconstrained_stddev`` and
        ``s_unconstrained_stddev``, the posterior scales before softplus
        (default: :func:`ensembles.initializers.unconstrained_stddev`).
      deterministic: with a posterior, whether calls use the means (True) or
        draw the fast weights (False, training); ``model.eval()`` and
        ``model.train()`` set it.
      rng_collection: the ``rngs`` stream the draws come from (default:
        ``"posterior"``; Flax falls back to ``default`` if ``rngs`` has none).
      rngs: rng keys; the kernel, bias, r and s each draw from ``rngs.params()``;
        with a posterior the layer also holds a fork of ``rngs[rng_collection]``.
      kernel_metadata: metadata of the kernel ``Param`` (e.g. sharding names).
      bias_metadata: metadata of the ``[E, *batch_shape, *out_features]`` bias.
      fast_weight_metadata: metadata of the ``r`` and ``s`` fast weights.
    """

    _impls = IMPLS

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        num_members: int,
        axis: int | Sequence[int] = -1,
        batch_axis: Mapping[int, int] = FrozenDict({}),
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        r_init: Initializer = default_fast_weight_init,
        s_init: Initializer = default_fast_weight_init,
        precision: PrecisionLike = None,
        promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
        preferred_element_type: Dtype | None = None,
        impl: str = "xla",
        posterior: str | None = None,
        prior_stddev: float = DEFAULT_PRIOR_STDDEV,
        stddev_init: Initializer = default_stddev_init,
        deterministic: bool = False,
        rng_collection: str = "posterior",
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        fast_weight_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        in_features = _features(in_features, "in_features")
        out_features = _features(out_features, "out_features")
        axis = _axes(axis)
        if len(axis) != len(in_features):
            raise ValueError(
                f"`in_features` (={in_features}) and `axis` (={axis}) must have "
                f"the same length: one contracted input axis per feature axis."
            )
        if 0 in axis:
            raise ValueError(
                f"`axis` (={axis}) must not contain axis 0: the first input axis "
                f"carries the members (rows [k*B, (k+1)*B) are member k)."
            )
        batch_axis = FrozenDict(
            {
                operator.index(k): check_positive_int(v, "batch_axis")
                for k, v in dict(batch_axis).items()
            }
        )
        if batch_axis and set(batch_axis) != set(range(len(batch_axis))):
            raise ValueError(
                f"`batch_axis` keys {tuple(batch_axis)} must be consecutive "
                f"leading axes starting from 0, as for `nnx.LinearGeneral`."
            )
        if batch_axis and set(batch_axis) & set(axis):
            raise ValueError(
                f"`axis` (={axis}) must not contain a batch axis of `batch_axis` "
                f"(={dict(batch_axis)})."
            )
        batch_shape = tuple(batch_axis[k] for k in range(len(batch_axis)))
        num_members, impl, posterior, prior_stddev, deterministic, rng_collection = (
            check_weight_options(
                num_members,
                impl,
                self._impls,
                posterior,
                prior_stddev,
                deterministic,
                rng_collection,
            )
        )
        use_bias = check_bool(use_bias, "use_bias")
        (
            self.kernel,
            self.r,
            self.s,
            self.bias,
            self.r_unconstrained_stddev,
            self.s_unconstrained_stddev,
            self.rngs,
        ) = new_weights(
            rngs,
            kernel_shape=(*batch_shape, *in_features, *out_features),
            r_shape=(num_members, *in_features),
            s_shape=(num_members, *out_features),
            bias_shape=(num_members, *batch_shape, *out_features) if use_bias else None,
            param_dtype=param_dtype,
            kernel_init=flat_initializer(
                kernel_init, len(batch_shape) + len(in_features), "kernel_init"
            ),
            # Unused without a bias, so anything, as in Flax.
            bias_init=flat_initializer(bias_init, 1, "bias_init") if use_bias else None,
            r_init=r_init,
            s_init=s_init,
            posterior=posterior,
            stddev_init=stddev_init,
            rng_collection=rng_collection,
            kernel_metadata=kernel_metadata,
            bias_metadata=bias_metadata,
            fast_weight_metadata=fast_weight_metadata,
        )
        self.in_features = in_features
        self.out_features = out_features
        self.axis = axis
        self.batch_axis = batch_axis
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.promote_dtype = promote_dtype
        self.preferred_element_type = preferred_element_type
        self.num_members = num_members
        self.member = None
        self.impl = impl
        self.posterior = posterior
        self.prior_stddev = prior_stddev
        self.deterministic = deterministic
        self.rng_collection = rng_collection

    @classmethod
    def from_linear_general(
        cls,
        layer: nnx.LinearGeneral,
        *,
        num_members: int,
        rngs: nnx.Rngs,
        r_init: Initializer = default_fast_weight_init,
        s_init: Initializer = default_fast_weight_init,
        share_kernel: bool = False,
        impl: str = "xla",
        posterior: str | None = None,
        prior_stddev: float = DEFAULT_PRIOR_STDDEV,
        stddev_init: Initializer = default_stddev_init,
    ) -> BatchEnsembleLinearGeneral:
        """Builds a BatchEnsemble layer around a pretrained ``nnx.LinearGeneral``.

        The kernel is kept (a new ``Param`` holding the same values; the very
        same ``Param`` with ``share_kernel=True``), and the bias is broadcast to
        every member. With ``r_init = s_init = ones()`` every member computes
        exactly what ``layer`` does. ``layer`` itself is never changed.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> out = nnx.LinearGeneral((2, 4), 8, axis=(-2, -1), rngs=nnx.Rngs(0))
        >>> layer = ensembles.BatchEnsembleLinearGeneral.from_linear_general(
        ...     out, num_members=3, rngs=nnx.Rngs(1),
        ...     r_init=ensembles.initializers.ones(),
        ...     s_init=ensembles.initializers.ones())
        >>> x = jnp.ones((5, 7, 2, 4))
        >>> # equal up to float32 rounding: XLA may sum in another order
        >>> bool(jnp.allclose(layer(ensembles.tile(x, 3))[10:], out(x), atol=1e-6))
        True

        Args:
          layer: the pretrained ``nnx.LinearGeneral``.
          num_members: the ensemble size E.
          rngs: rng keys for the fast weights (and, with a posterior, the
            stream of its draws: see the class).
          r_init: initializer for ``r`` (default: N(1, 0.5)).
          s_init: initializer for ``s`` (default: N(1, 0.5)).
          share_kernel: if True, the new layer holds ``layer``'s kernel
            ``Param`` itself, so updates to one are seen by the other.
          impl: the op implementation.
          posterior: ``None``, ``"gaussian"`` or ``"cauchy"``: see the class.
          prior_stddev: the prior's scale, with a posterior.
          stddev_init: initializer of the unconstrained posterior scales.

        Returns:
          The new ``BatchEnsembleLinearGeneral``.

        Raises:
          TypeError: if ``layer`` is not an ``nnx.LinearGeneral``.
          ValueError: if ``layer`` uses a custom ``dot_general`` or
            ``dot_general_cls``, which the BatchEnsemble op cannot honour, or
            contracts axis 0.
        """
        check_flax_layer(
            layer,
            nnx.LinearGeneral,
            "layer",
            cls.__name__,
            dot_general=(lax.dot_general, "jax.lax.dot_general"),
            dot_general_cls=(None, "jax.lax.dot_general"),
        )
        return from_flax_layer(
            cls,
            layer,
            layer.in_features,
            layer.out_features,
            # Called flat (see flat_initializer), as Flax's is: the copy is
            # reshaped to the flat shape, then back.
            kernel_init=flat_copy_of,
            num_members=num_members,
            axis=layer.axis,
            batch_axis=layer.batch_axis,
            use_bias=layer.bias is not None,
            dtype=layer.dtype,
            precision=layer.precision,
            r_init=r_init,
            s_init=s_init,
            share_kernel=share_kernel,
            impl=impl,
            posterior=posterior,
            prior_stddev=prior_stddev,
            stddev_init=stddev_init,
            rngs=rngs,
        )

    @over_layer_axes
    def extract_member(self, member: int) -> nnx.LinearGeneral:
        """Returns member ``member`` as a plain ``nnx.LinearGeneral``.

        Its kernel is ``kernel * r[member] * s[member]`` (broadcast over the
        input and output feature axes) and its bias ``bias[member]``; it maps an
        un-tiled ``[B, ...]`` batch as ``nnx.view(self, member=member)`` does
        (up to rounding).

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> layer = ensembles.BatchEnsembleLinearGeneral(
        ...     8, (2, 4), num_members=3, rngs=nnx.Rngs(0))
        >>> plain = layer.extract_member(1)
        >>> type(plain).__name__, plain.kernel.shape, plain.bias.shape
        ('LinearGeneral', (8, 2, 4), (2, 4))
        >>> x = jnp.ones((5, 8))
        >>> bool(jnp.allclose(plain(x), nnx.view(layer, member=1)(x), atol=1e-5))
        True

        Args:
          member: the member index k, ``0 <= k < num_members``.

        Returns:
          A new ``nnx.LinearGeneral``; this layer is not changed.
        """
        k = check_member_index(member, self.num_members)
        return plain_layer(
            lambda rngs: nnx.LinearGeneral(
                self.in_features,
                self.out_features,
                axis=self.axis,
                batch_axis=self.batch_axis,
                use_bias=self.use_bias,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                precision=self.precision,
                promote_dtype=self.promote_dtype,
                preferred_element_type=self.preferred_element_type,
                rngs=rngs,
            ),
            kernel=variable_copy(
                nnx.Param, self._effective_kernel(k), self.kernel.get_metadata()
            ),
            bias=member_slice(self.bias, k),
        )

    def _effective_kernel(self, member: int) -> jax.Array:
        """Member ``member``'s kernel ``kernel * r[member] * s[member]``."""
        num_batch, num_in = len(self.batch_axis), len(self.in_features)
        num_out = len(self.out_features)
        r = self.r[member].reshape((1,) * num_batch + self.in_features + (1,) * num_out)
        s = self.s[member].reshape((1,) * (num_batch + num_in) + self.out_features)
        kernel = self.kernel[...]
        return kernel * (r * s).astype(kernel.dtype)

    def __call__(
        self,
        inputs: jax.Array,
        out_sharding: Any = None,
        *,
        deterministic: bool | None = None,
    ) -> jax.Array:
        """Applies every member (or the viewed member) to its rows of ``inputs``.

        Args:
          inputs: ``[E*B, ...]`` member-major inputs; in a member view
            (``nnx.view(layer, member=k)``) an un-tiled ``[B, ...]`` batch,
            or, without ``batch_axis`` and with negative ``axis``, one example
            whose every axis is contracted (``[*in_features]``), as
            ``nnx.LinearGeneral`` takes it.
          out_sharding: where to place the outputs (a ``PartitionSpec`` or
            ``NamedSharding``), as for ``nnx.Linear``; ``None`` leaves it to XLA.
          deterministic: replaces the layer's ``deterministic`` for this call,
            as for ``nnx.Dropout`` (with a posterior: True uses the means).

        Returns:
          The outputs: the uncontracted axes of ``inputs`` in order, then
          ``out_features``.
        """
        # nnx.LinearGeneral takes one example whose every axis it contracts
        # (counted from the end; batch axes make a batch): so does a member view.
        example_ndim = None
        if not self.batch_axis and all(a < 0 for a in self.axis):
            example_ndim = len(self.axis)
        inputs, one_example = self._batch_of(inputs, example_ndim)
        num_members, inputs, kernel, r, s, bias = self._call_operands(
            inputs, self.kernel[...], deterministic
        )
        try:
            outputs = dense_general.batch_ensemble_dense_general(
                inputs,
                kernel,
                r,
                s,
                bias,
                num_members=num_members,
                axis=self.axis,
                num_batch_axes=len(self.batch_axis),
                precision=self.precision,
                preferred_element_type=self.preferred_element_type,
                impl=self.impl,
            )
            # Inside the try: an `out_sharding` that fails takes the draw back too.
            return shard_output(outputs[0] if one_example else outputs, out_sharding)
        except Exception:
            self._undraw(deterministic)  # a failed call draws nothing
            raise
