"""BatchEnsemble sibling of ``nnx.Einsum``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers
from flax.typing import Dtype, Initializer, PrecisionLike, PromoteDtypeFn

from ensembles._checks import check_positive_int
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
from ensembles.ops import einsum
from ensembles.ops.impls import IMPLS

__all__ = ["BatchEnsembleEinsum"]


def _shape(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, Sequence):
        raise TypeError(f"`{name}` must be a sequence of ints, got {value!r}.")
    return tuple(check_positive_int(v, name) for v in value)


class BatchEnsembleEinsum(BatchEnsembleModule):
    """A BatchEnsemble ``nnx.Einsum``: the projection of Gemma-style models.

    Member ``k`` maps its rows ``[k*B, (k+1)*B)`` of a member-major ``[E*B,
    ...]`` batch as an ``nnx.Einsum`` with the same ``einsum_str`` would,
    holding the effective kernel ``kernel * r[k] * s[k]`` and the bias
    ``bias[k]``. ``r[k]`` spans the kernel's *contracted* axes (letters absent
    from the output) and ``s[k]`` its *kept* axes (letters in the output), so
    the effective kernel is ``W * outer(r_k, s_k)`` of the kernel read as a
    ``[contracted, kept]`` matrix. All members run as one batch through
    :func:`ensembles.ops.batch_ensemble_einsum`.

    The input's first letter names the member-major axis: it must not be in
    the kernel and must be in the output, where member ``k`` owns the slice
    ``[k*B, (k+1)*B)`` along it (``"BSD,CKDH->CBSKH"`` puts it second).

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.BatchEnsembleEinsum(
    ...     "BTD,NDH->BTNH", (2, 8, 4), (2, 4), num_members=3, rngs=nnx.Rngs(0))
    >>> jax.tree.map(jnp.shape, nnx.state(layer))
    State({
      'bias': Param(
        value=(3, 2, 4)
      ),
      'kernel': Param(
        value=(2, 8, 4)
      ),
      'r': FastWeight(
        value=(3, 8)
      ),
      's': FastWeight(
        value=(3, 2, 4)
      )
    })
    >>> x = jnp.ones((5, 7, 8))                       # un-tiled [B, T, D]
    >>> layer(ensembles.tile(x, 3)).shape             # [E*B, T, N, H]
    (15, 7, 2, 4)
    >>> nnx.view(layer, member=2)(x).shape            # member 2 alone
    (5, 7, 2, 4)

    Args:
      einsum_str: ``"<input>,<kernel>-><output>"``, as for ``nnx.Einsum``.
      kernel_shape: the shape of the shared kernel.
      bias_shape: one member's bias shape, as ``nnx.Einsum``'s; ``None`` for no
        bias. The bias is ``[E, *bias_shape]``.
      num_members: the ensemble size E (keyword-only, required).
      dtype: the dtype of the computation (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      precision: numerical precision of the contraction, see
        ``jax.lax.Precision``.
      kernel_init: initializer for the shared kernel (default: LeCun normal).
      bias_init: initializer for the ``[E, *bias_shape]`` bias (default: zeros).
      r_init: initializer for the ``[E, *contracted dims]`` fast weights
        (default: N(1, 0.5)).
      s_init: initializer for the ``[E, *kept dims]`` fast weights (default:
        N(1, 0.5)).
      promote_dtype: Flax's ``promote_dtype`` contract: called on ``(inputs,
        kernel, bias)`` with a ``dtype`` keyword, as the Flax layer calls it;
        ``r`` and ``s`` are then cast to the kernel's dtype (default: Flax's).
      preferred_element_type: accumulation/output dtype of the contraction.
      impl: the dense op implementation: ``"xla"`` (the default) or
        ``"pallas"``; see :func:`ensembles.ops.batch_ensemble_einsum`.
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
      rngs: rng keys; the kernel, r, s and bias each draw from ``rngs.params()``;
        with a posterior the layer also holds a fork of ``rngs[rng_collection]``.
      kernel_metadata: metadata of the kernel ``Param`` (e.g. sharding names).
      bias_metadata: metadata of the ``[E, *bias_shape]`` bias ``Param``.
      fast_weight_metadata: metadata of the ``r`` and ``s`` fast weights.

    ``nnx.Einsum``'s ``einsum_op`` has no counterpart: the layer always
    computes with ``jnp.einsum``'s semantics.
    """

    _impls = IMPLS

    def __init__(
        self,
        einsum_str: str,
        kernel_shape: Sequence[int],
        bias_shape: Sequence[int] | None = None,
        *,
        num_members: int,
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
        kernel_shape = _shape(kernel_shape, "kernel_shape")
        if bias_shape is not None:
            bias_shape = _shape(bias_shape, "bias_shape")
        r_shape, s_shape = einsum.fast_weight_shapes(einsum_str, kernel_shape)
        einsum_str = einsum_str.replace(" ", "")
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
            kernel_shape=kernel_shape,
            r_shape=(num_members, *r_shape),
            s_shape=(num_members, *s_shape),
            bias_shape=None if bias_shape is None else (num_members, *bias_shape),
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
        self.einsum_str = einsum_str
        self.kernel_shape = kernel_shape
        self.bias_shape = bias_shape
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
    def from_einsum(
        cls,
        layer: nnx.Einsum,
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
    ) -> BatchEnsembleEinsum:
        """Builds a BatchEnsemble layer around a pretrained ``nnx.Einsum``.

        The kernel is kept (a new ``Param`` holding the same values; the very
        same ``Param`` with ``share_kernel=True``), and the bias is broadcast to
        every member. With ``r_init = s_init = ones()`` every member computes
        exactly what ``layer`` does. ``layer`` itself is never changed.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> out = nnx.Einsum("BTNH,NHD->BTD", (2, 4, 8), (8,), rngs=nnx.Rngs(0))
        >>> layer = ensembles.BatchEnsembleEinsum.from_einsum(
        ...     out, num_members=3, rngs=nnx.Rngs(1),
        ...     r_init=ensembles.initializers.ones(),
        ...     s_init=ensembles.initializers.ones())
        >>> x = jnp.ones((5, 7, 2, 4))
        >>> # equal up to float32 rounding: XLA may sum in another order
        >>> bool(jnp.allclose(layer(ensembles.tile(x, 3))[10:], out(x), atol=1e-6))
        True

        Args:
          layer: the pretrained ``nnx.Einsum``.
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
          The new ``BatchEnsembleEinsum``.

        Raises:
          TypeError: if ``layer`` is not an ``nnx.Einsum``.
          ValueError: if ``layer`` uses a custom ``einsum_op``, or its
            ``einsum_str`` contracts the input's first axis (which carries the
            members here).
        """
        check_flax_layer(
            layer,
            nnx.Einsum,
            "layer",
            cls.__name__,
            einsum_op=(jnp.einsum, "jnp.einsum"),
        )
        return from_flax_layer(
            cls,
            layer,
            layer.einsum_str,
            layer.kernel_shape,
            layer.bias_shape,
            num_members=num_members,
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
    def extract_member(self, member: int) -> nnx.Einsum:
        """Returns member ``member`` as a plain ``nnx.Einsum``.

        Its kernel is ``kernel * r[member] * s[member]`` and its bias
        ``bias[member]``; it maps an un-tiled batch as ``nnx.view(self,
        member=member)`` does (up to rounding).

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> layer = ensembles.BatchEnsembleEinsum(
        ...     "BTD,NDH->BTNH", (2, 8, 4), (2, 4), num_members=3,
        ...     rngs=nnx.Rngs(0))
        >>> plain = layer.extract_member(1)
        >>> type(plain).__name__, plain.kernel.shape, plain.bias.shape
        ('Einsum', (2, 8, 4), (2, 4))
        >>> x = jnp.ones((5, 7, 8))
        >>> bool(jnp.allclose(plain(x), nnx.view(layer, member=1)(x), atol=1e-5))
        True

        Args:
          member: the member index k, ``0 <= k < num_members``.

        Returns:
          A new ``nnx.Einsum``; this layer is not changed.
        """
        k = check_member_index(member, self.num_members)
        return plain_layer(
            lambda rngs: nnx.Einsum(
                self.einsum_str,
                self.kernel_shape,
                self.bias_shape,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                precision=self.precision,
                # nnx.Einsum keeps no kernel_init, and its default (LeCun
                # normal) refuses a 1-D kernel even abstractly; the kernel is
                # replaced at once anyway.
                kernel_init=initializers.zeros_init(),
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
        return einsum.effective_kernel(
            self.kernel[...],
            self.r[member],
            self.s[member],
            einsum_str=self.einsum_str,
        )

    def __call__(
        self,
        inputs: jax.Array,
        einsum_str: str | None = None,
        out_sharding: Any = None,
        *,
        deterministic: bool | None = None,
    ) -> jax.Array:
        """Applies every member (or the viewed member) to its rows of ``inputs``.

        Args:
          inputs: ``[E*B, ...]`` member-major inputs; in a member view
            (``nnx.view(layer, member=k)``) an un-tiled ``[B, ...]`` batch.
          einsum_str: replaces the layer's ``einsum_str`` for this call, as for
            ``nnx.Einsum``; it must keep the same kernel axes in the output
            (where ``s`` applies) and contract the others (``r``).
          out_sharding: where to place the outputs (a ``PartitionSpec`` or
            ``NamedSharding``), as for ``nnx.Einsum``; ``None`` leaves it to XLA.
          deterministic: replaces the layer's ``deterministic`` for this call,
            as for ``nnx.Dropout`` (with a posterior: True uses the means).

        Returns:
          The outputs, laid out as ``einsum_str``'s output.

        Raises:
          ValueError: if ``einsum_str`` splits the kernel's axes otherwise than
            the layer's, or does not fit ``inputs``.
        """
        # The constructor always holds a checked einsum_str; only a call-time
        # one needs the split compared.
        if einsum_str is None:
            einsum_str = self.einsum_str
        elif einsum.kept_axes(einsum_str) != einsum.kept_axes(self.einsum_str):
            raise ValueError(
                f"`einsum_str` {einsum_str!r} splits the kernel's axes into "
                f"contracted and kept ones unlike the layer's {self.einsum_str!r}, "
                f"which `r` and `s` were made for: keep each kernel letter in (or "
                f"out of) the output as the layer's string does."
            )
        # `einsum_str` fixes the inputs' rank, batch axis included, as for
        # nnx.Einsum: there is no example without it.
        inputs, _ = self._batch_of(inputs, example_ndim=None)
        num_members, inputs, kernel, r, s, bias = self._call_operands(
            inputs, self.kernel[...], deterministic
        )
        try:
            outputs = einsum.batch_ensemble_einsum(
                inputs,
                kernel,
                r,
                s,
                bias,
                einsum_str=einsum_str,
                num_members=num_members,
                precision=self.precision,
                preferred_element_type=self.preferred_element_type,
                impl=self.impl,
            )
            # Inside the try: an `out_sharding` that fails takes the draw back too.
            return shard_output(outputs, out_sharding)
        except Exception:
            self._undraw(deterministic)  # a failed call draws nothing
            raise
