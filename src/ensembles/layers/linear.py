"""BatchEnsemble linear layers."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
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
    member_slice,
    variable_copy,
)
from ensembles.layers.posterior import DEFAULT_PRIOR_STDDEV, default_stddev_init
from ensembles.layers.sharding import shard_output
from ensembles.layers.stacking import over_layer_axes
from ensembles.layers.weights import check_weight_options, from_flax_layer, new_weights
from ensembles.ops import dense
from ensembles.ops.impls import IMPLS

__all__ = ["BatchEnsembleLinear"]


class BatchEnsembleLinear(BatchEnsembleModule):
    """A BatchEnsemble linear layer: ``nnx.Linear`` with per-member fast weights.

    Member ``k`` maps its rows ``[k*B, (k+1)*B)`` of a member-major
    ``[E*B, ..., in_features]`` batch as an ``nnx.Linear`` with kernel
    ``kernel * outer(r[k], s[k])`` and bias ``bias[k]`` would. All members run as
    one batch through :func:`ensembles.ops.batch_ensemble_dense`.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.BatchEnsembleLinear(3, 4, num_members=2, rngs=nnx.Rngs(0))
    >>> jax.tree.map(jnp.shape, nnx.state(layer))
    State({
      'bias': Param(
        value=(2, 4)
      ),
      'kernel': Param(
        value=(3, 4)
      ),
      'r': FastWeight(
        value=(2, 3)
      ),
      's': FastWeight(
        value=(2, 4)
      )
    })
    >>> x = jnp.ones((5, 3))                         # an un-tiled batch, B=5
    >>> layer(ensembles.tile(x, 2)).shape           # [E*B, out]
    (10, 4)
    >>> nnx.view(layer, member=1)(x).shape           # member 1 alone, [B, out]
    (5, 4)
    >>> nnx.view(layer, member=1)(x[0]).shape        # one example, as nnx.Linear
    (4,)

    Args:
      in_features: the number of input features.
      out_features: the number of output features.
      num_members: the ensemble size E (keyword-only, required).
      use_bias: whether to add a per-member bias (default: True).
      dtype: the dtype of the computation (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      precision: numerical precision of the matmul, see ``jax.lax.Precision``.
      kernel_init: initializer for the shared ``[in, out]`` kernel (default:
        ``nnx.Linear``'s, LeCun normal).
      bias_init: initializer for the ``[E, out]`` bias (default: zeros).
      r_init: initializer for the ``[E, in]`` fast weights (default: N(1, 0.5)).
      s_init: initializer for the ``[E, out]`` fast weights (default: N(1, 0.5)).
      promote_dtype: Flax's ``promote_dtype`` contract: called on ``(inputs,
        kernel, bias)`` with a ``dtype`` keyword, as the Flax layer calls it;
        ``r`` and ``s`` are then cast to the kernel's dtype (default: Flax's).
      preferred_element_type: accumulation/output dtype of the matmul, see
        ``jax.lax.dot_general``.
      impl: the op implementation: ``"xla"`` (the default) or ``"pallas"`` (the
        fused GPU/TPU kernel, opt-in); see
        :func:`ensembles.ops.batch_ensemble_dense`.
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
      bias_metadata: metadata of the ``[E, out]`` bias ``Param``.
      fast_weight_metadata: metadata of the ``r`` and ``s`` fast weights.
    """

    _impls = IMPLS

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        num_members: int,
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        r_init: Initializer = default_fast_weight_init,
        s_init: Initializer = default_fast_weight_init,
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
        in_features = check_positive_int(in_features, "in_features")
        out_features = check_positive_int(out_features, "out_features")
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
            kernel_shape=(in_features, out_features),
            r_shape=(num_members, in_features),
            s_shape=(num_members, out_features),
            bias_shape=(num_members, out_features) if use_bias else None,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            bias_init=bias_init,
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
    def from_linear(
        cls,
        linear: nnx.Linear,
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
    ) -> BatchEnsembleLinear:
        """Builds a BatchEnsemble layer around a pretrained ``nnx.Linear``.

        The kernel is kept (a new ``Param`` holding the same values, so training
        one layer never changes the other; the very same ``Param`` with
        ``share_kernel=True``), and the bias is broadcast to every member. With
        ``r_init = s_init = ones()`` every member computes exactly what
        ``linear`` does. ``linear`` itself is never changed.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        >>> layer = ensembles.BatchEnsembleLinear.from_linear(
        ...     linear, num_members=2, rngs=nnx.Rngs(1),
        ...     r_init=ensembles.initializers.ones(),
        ...     s_init=ensembles.initializers.ones())
        >>> x = jnp.ones((5, 3))
        >>> bool(jnp.allclose(layer(ensembles.tile(x, 2))[5:], linear(x)))
        True

        Args:
          linear: the pretrained layer.
          num_members: the ensemble size E.
          rngs: rng keys for the fast weights (and, with a posterior, the
            stream of its draws: see the class).
          r_init: initializer for ``r`` (default: N(1, 0.5)).
          s_init: initializer for ``s`` (default: N(1, 0.5)).
          share_kernel: if True, the new layer holds ``linear``'s kernel
            ``Param`` itself, so updates to one are seen by the other.
          impl: the op implementation.
          posterior: ``None``, ``"gaussian"`` or ``"cauchy"``: see the class.
          prior_stddev: the prior's scale, with a posterior.
          stddev_init: initializer of the unconstrained posterior scales.

        Returns:
          The new ``BatchEnsembleLinear``.

        Raises:
          TypeError: if ``linear`` is not an ``nnx.Linear``.
          ValueError: if ``linear`` uses a custom ``dot_general``, which the
            BatchEnsemble op cannot honour.
        """
        check_flax_layer(
            linear,
            nnx.Linear,
            "linear",
            cls.__name__,
            dot_general=(lax.dot_general, "jax.lax.dot_general"),
        )
        return from_flax_layer(
            cls,
            linear,
            linear.in_features,
            linear.out_features,
            num_members=num_members,
            use_bias=linear.bias is not None,
            dtype=linear.dtype,
            precision=linear.precision,
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
    def extract_member(self, member: int) -> nnx.Linear:
        """Returns member ``member`` as a plain ``nnx.Linear``.

        Its kernel is ``kernel * outer(r[member], s[member])`` and its bias
        ``bias[member]``; it maps an un-tiled ``[B, ..., in]`` batch as
        ``nnx.view(self, member=member)`` does (up to rounding: the member view
        scales activations, the plain layer holds the scaled kernel).

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> layer = ensembles.BatchEnsembleLinear(3, 4, num_members=2,
        ...                                       rngs=nnx.Rngs(0))
        >>> linear = layer.extract_member(1)
        >>> type(linear).__name__, linear.kernel.shape, linear.bias.shape
        ('Linear', (3, 4), (4,))
        >>> x = jnp.ones((5, 3))
        >>> bool(jnp.allclose(linear(x), nnx.view(layer, member=1)(x), atol=1e-6))
        True

        Args:
          member: the member index k, ``0 <= k < num_members``.

        Returns:
          A new ``nnx.Linear``; this layer is not changed.
        """
        k = check_member_index(member, self.num_members)
        return plain_layer(
            lambda rngs: nnx.Linear(
                self.in_features,
                self.out_features,
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
        """Member ``member``'s kernel ``kernel * outer(r[member], s[member])``."""
        outer = jnp.outer(self.r[member], self.s[member])
        return self.kernel[...] * outer.astype(self.kernel.dtype)

    def __call__(
        self,
        inputs: jax.Array,
        out_sharding: Any = None,
        *,
        deterministic: bool | None = None,
    ) -> jax.Array:
        """Applies every member (or the viewed member) to its rows of ``inputs``.

        Args:
          inputs: ``[E*B, ..., in_features]`` member-major inputs; in a member
            view (``nnx.view(layer, member=k)``) an un-tiled ``[B, ...,
            in_features]`` batch, or one ``[in_features]`` example, as
            ``nnx.Linear`` takes it.
          out_sharding: where to place the outputs (a ``PartitionSpec`` or
            ``NamedSharding``), as for ``nnx.Linear``; ``None`` leaves it to XLA.
          deterministic: replaces the layer's ``deterministic`` for this call,
            as for ``nnx.Dropout`` (with a posterior: True uses the means).

        Returns:
          The ``[E*B, ..., out_features]`` (or ``[B, ..., out_features]``, or
          for one example ``[out_features]``) outputs.
        """
        # One [in] example, in a member view, as nnx.Linear takes it.
        inputs, one_example = self._batch_of(inputs, example_ndim=1)
        num_members, inputs, kernel, r, s, bias = self._call_operands(
            inputs, self.kernel[...], deterministic
        )
        try:
            dense.check_shapes(inputs, kernel, r, s, bias, num_members)
            outputs = dense.dense_rows(
                inputs,
                kernel,
                r,
                s,
                bias,
                precision=self.precision,
                preferred_element_type=self.preferred_element_type,
                impl=self.impl,
            )
            # Inside the try: an `out_sharding` that fails takes the draw back too.
            return shard_output(outputs[0] if one_example else outputs, out_sharding)
        except Exception:
            self._undraw(deterministic)  # a failed call draws nothing
            raise
