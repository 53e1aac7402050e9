"""E fully independent linear layers on one member-major batch."""

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

from ensembles._checks import (
    check_bool,
    check_initializer,
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
    default_bias_init,
    default_kernel_init,
    drawing_from,
    member_copies,
    member_slice,
    new_param,
)
from ensembles.layers.sharding import member_axis_metadata, shard_output
from ensembles.layers.stacking import over_layer_axes
from ensembles.ops.member_dense import check_shapes, ensemble_dense_rows

__all__ = ["EnsembleLinear"]


def _per_member(initializer: Initializer) -> Initializer:
    """``initializer`` drawn for every member apart, as ``nnx.Linear`` draws one.

    Drawn on the whole ``[E, in, out]`` shape, a variance-scaling initializer
    would count the member axis into its fan-in.
    """

    def init(key: jax.Array, shape: Any, dtype: Any = jnp.float32) -> jax.Array:
        keys = jax.random.split(key, shape[0])
        return jax.vmap(lambda k: initializer(k, tuple(shape[1:]), dtype))(keys)

    return init


class EnsembleLinear(EnsembleModule):
    """``nnx.Linear`` with a kernel and a bias of its own for every member.

    Member ``k`` maps its rows ``[k*B, (k+1)*B)`` of a member-major ``[E*B,
    ..., in_features]`` batch as an ``nnx.Linear`` with ``kernel[k]`` and
    ``bias[k]`` would: a deep ensemble's layer on a BatchEnsemble's rows,
    nothing shared (:func:`ensembles.ops.ensemble_dense`). Use it where the
    members should differ most, such as the output layer (TabM's independent
    heads; ``to_batch_ensemble(..., independent=...)`` converts named
    ``nnx.Linear`` layers into it). It costs ``E`` times the parameters of
    the layer, and its matmul the same flops as one ``nnx.Linear`` on all
    ``E*B`` rows.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.EnsembleLinear(3, 4, num_members=2, rngs=nnx.Rngs(0))
    >>> jax.tree.map(jnp.shape, nnx.state(layer))
    State({
      'bias': Param(
        value=(2, 4)
      ),
      'kernel': Param(
        value=(2, 3, 4)
      )
    })
    >>> x = jnp.ones((5, 3))
    >>> layer(ensembles.tile(x, 2)).shape            # [E*B, out]
    (10, 4)
    >>> nnx.view(layer, member=1)(x).shape            # member 1 alone
    (5, 4)

    Args:
      in_features: the number of input features.
      out_features: the number of output features.
      num_members: the ensemble size E (keyword-only, required).
      use_bias: whether to add a bias (default: True).
      dtype: the dtype of the computation (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      precision: numerical precision of the matmul.
      kernel_init: initializer of each member's ``[in, out]`` kernel, drawn
        for every member apart (default: ``nnx.Linear``'s, LeCun normal).
      bias_init: initializer of each member's ``[out]`` bias (default: zeros).
      promote_dtype: Flax's ``promote_dtype`` contract, called on ``(inputs,
        kernel, bias)`` as ``nnx.Linear`` calls it.
      preferred_element_type: accumulation/output dtype of the matmul.
      rngs: rng keys; every member's kernel and bias draw from
        ``rngs.params()``.
      kernel_metadata: metadata of the ``[E, in, out]`` kernel ``Param``.
      bias_metadata: metadata of the ``[E, out]`` bias ``Param``.
    """

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
        promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
        preferred_element_type: Dtype | None = None,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        in_features = check_positive_int(in_features, "in_features")
        out_features = check_positive_int(out_features, "out_features")
        num_members = check_num_members(num_members)
        use_bias = check_bool(use_bias, "use_bias")
        check_initializer(kernel_init, "kernel_init")
        check_initializer(bias_init, "bias_init")
        with drawing_from(rngs) as draw:
            self.kernel = new_param(
                nnx.Param,
                _per_member(kernel_init),
                draw,
                (num_members, in_features, out_features),
                param_dtype,
                kernel_metadata,
                "kernel_init",
            )
            self.bias = (
                new_param(
                    nnx.Param,
                    _per_member(bias_init),
                    draw,
                    (num_members, out_features),
                    param_dtype,
                    bias_metadata,
                    "bias_init",
                )
                if use_bias
                else nnx.data(None)
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

    @classmethod
    def from_linear(
        cls,
        linear: nnx.Linear,
        *,
        num_members: int,
        rngs: nnx.Rngs,
        kernel_init: Initializer | None = None,
    ) -> EnsembleLinear:
        """E independent copies of a pretrained ``nnx.Linear``, or fresh members.

        By default every member starts as ``linear`` (its kernel and bias
        copied: each member computes what ``linear`` does) and trains on its
        own from there. With ``kernel_init``, every member's kernel is drawn
        afresh from it (and the bias set to zeros): members as independent as
        a deep ensemble's, for a model that has not been trained yet.
        ``linear`` itself is never changed.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        >>> layer = ensembles.EnsembleLinear.from_linear(
        ...     linear, num_members=2, rngs=nnx.Rngs(1))
        >>> x = jnp.ones((5, 3))
        >>> bool(jnp.allclose(layer(ensembles.tile(x, 2))[5:], linear(x)))
        True

        Args:
          linear: the layer to copy.
          num_members: the ensemble size E.
          rngs: rng keys (drawn from only with ``kernel_init``).
          kernel_init: ``None`` to copy ``linear``'s kernel to every member,
            or an initializer to draw each member's kernel from.

        Returns:
          The new ``EnsembleLinear``.

        Raises:
          TypeError: if ``linear`` is not an ``nnx.Linear``.
          ValueError: if ``linear`` uses a custom ``dot_general``.
        """
        check_flax_layer(
            linear,
            nnx.Linear,
            "linear",
            cls.__name__,
            dot_general=(lax.dot_general, "jax.lax.dot_general"),
        )
        num_members = check_num_members(num_members)
        use_bias = linear.bias is not None
        options = {
            "num_members": num_members,
            "use_bias": use_bias,
            "dtype": linear.dtype,
            "param_dtype": linear.param_dtype,
            "precision": linear.precision,
            "promote_dtype": linear.promote_dtype,
            "preferred_element_type": linear.preferred_element_type,
        }
        if kernel_init is not None:
            return cls(
                linear.in_features,
                linear.out_features,
                kernel_init=kernel_init,
                rngs=rngs,
                kernel_metadata=member_axis_metadata(linear.kernel.get_metadata()),
                bias_metadata=(
                    member_axis_metadata(linear.bias.get_metadata()) if use_bias else {}
                ),
                **options,
            )
        kernel_copy, kernel_metadata = member_copies(linear.kernel)
        bias_copy, bias_metadata = member_copies(linear.bias)
        return cls(
            linear.in_features,
            linear.out_features,
            kernel_init=_unbatched(kernel_copy),
            bias_init=_unbatched(bias_copy) if use_bias else default_bias_init,
            rngs=rngs,
            kernel_metadata=kernel_metadata,
            bias_metadata=bias_metadata,
            **options,
        )

    @over_layer_axes
    def extract_member(self, member: int) -> nnx.Linear:
        """Returns member ``member`` as a plain ``nnx.Linear``.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import ensembles
        >>> layer = ensembles.EnsembleLinear(3, 4, num_members=2, rngs=nnx.Rngs(0))
        >>> linear = layer.extract_member(1)
        >>> type(linear).__name__, linear.kernel.shape
        ('Linear', (3, 4))
        >>> x = jnp.ones((5, 3))
        >>> bool(jnp.allclose(linear(x), nnx.view(layer, member=1)(x)))
        True

        Args:
          member: the member index k, ``0 <= k < num_members``.

        Returns:
          A new ``nnx.Linear`` holding ``kernel[member]`` and ``bias[member]``.
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
            kernel=member_slice(self.kernel, k),
            bias=member_slice(self.bias, k),
        )

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        """Applies every member (or the viewed member) to its rows of ``inputs``.

        Args:
          inputs: ``[E*B, ..., in_features]`` member-major inputs; in a member
            view an un-tiled ``[B, ..., in_features]`` batch, or one
            ``[in_features]`` example.
          out_sharding: where to place the outputs, as for ``nnx.Linear``.

        Returns:
          ``[E*B, ..., out_features]`` (or the member view's) outputs.
        """
        one_example = self.member is not None and jnp.ndim(inputs) == 1
        if one_example:
            inputs = jnp.asarray(inputs)[None]
        num_members, (kernel, bias) = self._member_operands(
            self.kernel[...], None if self.bias is None else self.bias[...]
        )
        inputs, kernel, bias = self.promote_dtype(
            (inputs, kernel, bias), dtype=self.dtype
        )
        check_shapes(inputs, kernel, bias, num_members)
        outputs = ensemble_dense_rows(
            inputs,
            kernel,
            bias,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
        )
        return shard_output(outputs[0] if one_example else outputs, out_sharding)


def _unbatched(copy: Initializer) -> Initializer:
    """A :func:`member_copies` initializer as :func:`_per_member` calls it.

    The layer draws each member's slice apart; a copy gives every member the
    pretrained value whatever the key.
    """

    def init(key, shape, dtype=jnp.float32):
        return copy(key, (1, *shape), dtype)[0]

    return init
