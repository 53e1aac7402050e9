"""BatchEnsemble transposed convolution layer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.typing import Dtype, Initializer, PaddingLike, PrecisionLike, PromoteDtypeFn

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
from ensembles.layers.stacking import over_layer_axes
from ensembles.layers.weights import check_weight_options, from_flax_layer, new_weights
from ensembles.ops import conv, conv_options, conv_transpose
from ensembles.ops.impls import CONV_IMPLS

__all__ = ["BatchEnsembleConvTranspose"]


class BatchEnsembleConvTranspose(BatchEnsembleModule):
    """A BatchEnsemble transposed convolution: ``nnx.ConvTranspose`` per member.

    Member ``k`` maps its rows ``[k*B, (k+1)*B)`` of a member-major,
    channels-last ``[E*B, *spatial, in_features]`` batch as an
    ``nnx.ConvTranspose`` with kernel ``kernel * (r[k] (x) s[k])`` over the
    channel axes (``r`` over input, ``s`` over output channels) and bias
    ``bias[k]`` would. All members run as one batch through
    :func:`ensembles.ops.batch_ensemble_conv_transpose`.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.BatchEnsembleConvTranspose(3, 8, (3, 3), 2,
    ...                                              num_members=4,
    ...                                              rngs=nnx.Rngs(0))
    >>> jax.tree.map(jnp.shape, nnx.state(layer))
    State({
      'bias': Param(
        value=(4, 8)
      ),
      'kernel': Param(
        value=(3, 3, 3, 8)
      ),
      'r': FastWeight(
        value=(4, 3)
      ),
      's': FastWeight(
        value=(4, 8)
      )
    })
    >>> x = jnp.ones((5, 8, 8, 3))                    # an un-tiled batch, B=5
    >>> layer(ensembles.tile(x, 4)).shape             # [E*B, 2H, 2W, out]
    (20, 16, 16, 8)
    >>> nnx.view(layer, member=1)(x).shape            # member 1 alone
    (5, 16, 16, 8)

    Args:
      in_features: the number of input channels.
      out_features: the number of output channels.
      kernel_size: the spatial shape of the kernel (an int for 1-D).
      strides: an int or one int per spatial dimension (default: 1).
      num_members: the ensemble size E (keyword-only, required).
      padding: ``'SAME'``, ``'SAME_LOWER'``, ``'VALID'`` (any case),
        ``'CIRCULAR'``, an int, or one int or ``(low, high)`` pair per spatial
        dimension, as for ``nnx.ConvTranspose``. (``'CAUSAL'`` and
        ``'REFLECT'`` raise a ``ValueError`` here: ``nnx.ConvTranspose`` does
        not implement them either.)
      kernel_dilation: an int or one int per spatial dimension (default: 1).
      use_bias: whether to add a per-member bias (default: True).
      mask: an optional array of the kernel's shape multiplied into the kernel.
      dtype: the dtype of the computation (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      precision: numerical precision of the convolution.
      kernel_init: initializer for the shared ``[*kernel_size, in, out]``
        kernel (``[*kernel_size, out, in]`` with ``transpose_kernel=True``).
      bias_init: initializer for the ``[E, out]`` bias (default: zeros).
      r_init: initializer for the ``[E, in]`` fast weights (default: N(1, 0.5)).
      s_init: initializer for the ``[E, out]`` fast weights (default: N(1, 0.5)).
      transpose_kernel: if True, flip the kernel's spatial axes and swap its
        channel axes, as ``jax.lax.conv_transpose`` does.
      promote_dtype: Flax's ``promote_dtype`` contract: called on ``(inputs,
        kernel, bias)`` with a ``dtype`` keyword, as the Flax layer calls it;
        ``r`` and ``s`` are then cast to the kernel's dtype (default: Flax's).
      preferred_element_type: accumulation/output dtype of the convolution.
      impl: the op implementation, ``"xla"`` (the one).
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
      kernel_metadata: metadata of the kernel ``Param``.
      bias_metadata: metadata of the ``[E, out]`` bias ``Param``.
      fast_weight_metadata: metadata of the ``r`` and ``s`` fast weights.
    """

    _impls = CONV_IMPLS

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | Sequence[int],
        strides: int | Sequence[int] | None = None,
        *,
        num_members: int,
        padding: PaddingLike = "SAME",
        kernel_dilation: int | Sequence[int] | None = None,
        use_bias: bool = True,
        mask: jax.Array | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike | None = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        r_init: Initializer = default_fast_weight_init,
        s_init: Initializer = default_fast_weight_init,
        transpose_kernel: bool = False,
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
        # The options are checked here, once, and held in the canonical form
        # the op takes.
        kernel_size = conv_options.check_kernel_size(kernel_size)
        rank = len(kernel_size)
        strides = conv_options.spatial_tuple(strides, "strides", rank)
        kernel_dilation = conv_options.spatial_tuple(
            kernel_dilation, "kernel_dilation", rank
        )
        padding = conv_options.check_padding(padding, rank, transpose=True)
        transpose_kernel = check_bool(transpose_kernel, "transpose_kernel")
        if transpose_kernel:
            channels = (out_features, in_features)
        else:
            channels = (in_features, out_features)
        kernel_shape = (*kernel_size, *channels)
        conv_options.check_mask(mask, kernel_shape)
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
            kernel_shape=kernel_shape,
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
        self.kernel_size = kernel_size
        self.strides = strides
        self.padding = padding
        self.kernel_dilation = kernel_dilation
        self.use_bias = use_bias
        self.mask = mask
        self.transpose_kernel = transpose_kernel
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
        self.kernel_shape = kernel_shape

    @classmethod
    def from_conv_transpose(
        cls,
        layer: nnx.ConvTranspose,
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
    ) -> BatchEnsembleConvTranspose:
        """Builds a BatchEnsemble layer around a pretrained ``nnx.ConvTranspose``.

        The kernel is kept (copied; the very same ``Param`` with
        ``share_kernel=True``), the bias is broadcast to every member and every
        option is copied. With ``r_init = s_init = ones()`` every member
        computes exactly what ``layer`` does. ``layer`` is never changed.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> pretrained = nnx.ConvTranspose(3, 4, (3, 3), 2, rngs=nnx.Rngs(0))
        >>> layer = ensembles.BatchEnsembleConvTranspose.from_conv_transpose(
        ...     pretrained, num_members=2, rngs=nnx.Rngs(1),
        ...     r_init=ensembles.initializers.ones(),
        ...     s_init=ensembles.initializers.ones())
        >>> x = jnp.ones((5, 8, 8, 3))
        >>> bool(jnp.allclose(layer(ensembles.tile(x, 2))[5:], pretrained(x)))
        True

        Args:
          layer: the pretrained ``nnx.ConvTranspose``.
          num_members: the ensemble size E.
          rngs: rng keys for the fast weights (and, with a posterior, the
            stream of its draws: see the class).
          r_init: initializer for ``r`` (default: N(1, 0.5)).
          s_init: initializer for ``s`` (default: N(1, 0.5)).
          share_kernel: if True, the new layer holds ``layer``'s kernel
            ``Param`` itself.
          impl: the op implementation.
          posterior: ``None``, ``"gaussian"`` or ``"cauchy"``: see the class.
          prior_stddev: the prior's scale, with a posterior.
          stddev_init: initializer of the unconstrained posterior scales.

        Returns:
          The new ``BatchEnsembleConvTranspose``.

        Raises:
          TypeError: if ``layer`` is not an ``nnx.ConvTranspose``.
        """
        check_flax_layer(layer, nnx.ConvTranspose, "layer", cls.__name__)
        return from_flax_layer(
            cls,
            layer,
            layer.in_features,
            layer.out_features,
            layer.kernel_size,
            layer.strides,
            num_members=num_members,
            padding=layer.padding,
            kernel_dilation=layer.kernel_dilation,
            use_bias=layer.bias is not None,
            mask=layer.mask,
            dtype=layer.dtype,
            precision=layer.precision,
            transpose_kernel=layer.transpose_kernel,
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
    def extract_member(self, member: int) -> nnx.ConvTranspose:
        """Returns member ``member`` as a plain ``nnx.ConvTranspose``.

        Its kernel is member ``member``'s effective kernel and its bias
        ``bias[member]``; every option is copied. It maps an un-tiled batch as
        ``nnx.view(self, member=member)`` does, up to rounding.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> layer = ensembles.BatchEnsembleConvTranspose(
        ...     3, 4, (3,), num_members=2, transpose_kernel=True,
        ...     rngs=nnx.Rngs(0))
        >>> plain = layer.extract_member(0)
        >>> type(plain).__name__, plain.kernel.shape, plain.bias.shape
        ('ConvTranspose', (3, 4, 3), (4,))
        >>> x = jnp.ones((5, 8, 3))
        >>> bool(jnp.allclose(plain(x), nnx.view(layer, member=0)(x), atol=1e-5))
        True

        Args:
          member: the member index k, ``0 <= k < num_members``.

        Returns:
          A new ``nnx.ConvTranspose``; this layer is not changed.
        """
        k = check_member_index(member, self.num_members)
        return plain_layer(
            lambda rngs: nnx.ConvTranspose(
                self.in_features,
                self.out_features,
                self.kernel_size,
                self.strides,
                padding=self.padding,
                kernel_dilation=self.kernel_dilation,
                use_bias=self.use_bias,
                mask=self.mask,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                precision=self.precision,
                transpose_kernel=self.transpose_kernel,
                promote_dtype=self.promote_dtype,
                preferred_element_type=self.preferred_element_type,
                rngs=rngs,
            ),
            kernel=variable_copy(
                nnx.Param, self._effective_kernel(k), self.kernel.get_metadata()
            ),
            bias=member_slice(self.bias, k),
            # eval_shape leaves the plain layer's mask abstract: set the real one.
            mask=self.mask,
        )

    def _effective_kernel(self, member: int) -> jax.Array:
        """Member ``member``'s kernel: :func:`ensembles.ops.conv.effective_kernel`."""
        return conv.effective_kernel(
            self.kernel[...],
            self.r[member],
            self.s[member],
            transpose_kernel=self.transpose_kernel,
        )

    def __call__(
        self, inputs: jax.Array, *, deterministic: bool | None = None
    ) -> jax.Array:
        """Applies every member (or the viewed member) to its rows of ``inputs``.

        Args:
          inputs: ``[E*B, ..., *spatial, in_features]`` member-major inputs
            (channels last); in a member view an un-tiled batch, or one
            ``[*spatial, in_features]`` example, as ``nnx.ConvTranspose``
            takes it (its outputs then have no batch axis either).
          deterministic: replaces the layer's ``deterministic`` for this call,
            as for ``nnx.Dropout`` (with a posterior: True uses the means).

        Returns:
          The ``[E*B, ..., *out_spatial, out_features]`` (or ``[B, ...]``)
          outputs.
        """
        kernel = self.kernel[...]
        if self.mask is not None:
            # As nnx.ConvTranspose: mask before promotion, so dtypes follow Flax's.
            kernel = kernel * self.mask
        # One [*spatial, in] example, in a member view, as nnx.ConvTranspose
        # takes it.
        inputs, one_example = self._batch_of(
            inputs, example_ndim=len(self.kernel_size) + 1
        )
        num_members, inputs, kernel, r, s, bias = self._call_operands(
            inputs, kernel, deterministic
        )
        try:
            outputs = conv_transpose.conv_transpose_rows(
                inputs,
                kernel,
                r,
                s,
                bias,
                num_members=num_members,
                strides=self.strides,
                padding=self.padding,
                kernel_dilation=self.kernel_dilation,
                transpose_kernel=self.transpose_kernel,
                precision=self.precision,
                preferred_element_type=self.preferred_element_type,
            )
        except Exception:
            self._undraw(deterministic)  # a failed call draws nothing
            raise
        return outputs[0] if one_example else outputs
