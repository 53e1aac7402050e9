"""What every BatchEnsemble layer shares: parameter creation and member views.

Default sharding layout. Every parameter carries the metadata its layer was
given (``kernel_metadata``, ``bias_metadata``, ``fast_weight_metadata``), so
``nnx.get_partition_spec`` and Flax's eager sharding place it as annotated;
unannotated parameters are replicated. The member axis is replicated by
default: the fast weights ``[E, features]`` are small, and members live in the
rows of the ``[E*B, ...]`` batch, which is what to shard for data
parallelism. The shared kernel is sharded as annotated (e.g. its output
features over a ``model`` axis). A bias broadcast from a pretrained layer
(``from_*``) keeps that layer's annotation for its feature axes, behind a
replicated member axis (:func:`member_axis_metadata`). See
``docs/scaling_out.md``.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers

from ensembles import initializers as fast_initializers
from ensembles._checks import check_choice
from ensembles.variables import FastWeight

__all__ = [
    "BatchEnsembleModule",
    "EnsembleModule",
    "check_member",
    "check_rngs",
    "drawing_from",
    "member_axis_metadata",
    "member_copies",
    "shard_output",
    "without_member_axis_metadata",
]

#: The defaults of every BatchEnsemble weight layer: Flax's for the kernel and
#: bias, N(1, 0.5) for the fast weights (uncertainty-baselines' recipe).
default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()
default_fast_weight_init = fast_initializers.normal(1.0, 0.5)

#: Metadata keys that hold one sharding name per array axis: Flax 0.12's
#: ``out_sharding`` and the deprecated names it still accepts (and renames).
_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")


def check_member(member: Any, num_members: int) -> int:
    """Checks a member index ``k`` for ``0 <= k < num_members``."""
    if isinstance(member, bool):
        raise TypeError(f"`member` must be an int, got the bool {member!r}.")
    try:
        index = operator.index(member)
    except TypeError:
        raise TypeError(
            f"`member` must be an int, got {member!r} of type {type(member).__name__}."
        ) from None
    if not 0 <= index < num_members:
        raise ValueError(
            f"`member` must be in [0, num_members) = [0, {num_members}), got {index}."
        )
    return index


def check_rngs(rngs: Any, name: str = "rngs") -> Any:
    """Checks that ``rngs`` is an ``nnx.Rngs`` (what ``rngs.params()`` needs)."""
    if not isinstance(rngs, nnx.Rngs):
        hint = (
            "wrap it: `nnx.Rngs(params=key)`"
            if hasattr(rngs, "dtype")
            else "e.g. `nnx.Rngs(0)`"
        )
        raise TypeError(
            f"`{name}` must be an `nnx.Rngs`, got {rngs!r} of type "
            f"{type(rngs).__name__}: {hint}."
        )
    return rngs


@contextlib.contextmanager
def drawing_from(rngs: Any) -> Iterator[nnx.Rngs]:
    """Yields a copy of ``rngs`` to draw from; ``rngs`` catches up on success.

    A constructor that fails halfway (an initializer returning the wrong shape,
    say) has then drawn nothing from the caller's ``rngs``: its stream counts
    stay as they were, so a retry draws the same keys as a first try would.
    """
    rngs = check_rngs(rngs)
    draw = nnx.clone(rngs)
    yield draw
    nnx.update(rngs, nnx.state(draw))


def member_axis_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Returns variable metadata for ``[E, ...]`` from metadata for ``[...]``.

    Sharding annotations get a leading ``None``: the member axis is replicated
    by default, like the fast weights, which are small.

    >>> member_axis_metadata({"out_sharding": ("model",), "note": 1})
    {'out_sharding': (None, 'model'), 'note': 1}
    """
    out = dict(metadata)
    for key in _SHARDING_KEYS:
        if out.get(key) is not None:
            out[key] = (None, *out[key])
    return out


def member_copies(
    variable: nnx.Variable | None,
) -> tuple[Callable[..., jax.Array] | None, dict[str, Any]]:
    """Initializer and metadata giving every member a copy of a pretrained Variable.

    What ``from_*`` uses to broadcast a pretrained bias (or norm scale) to
    ``[E, ...]``: the initializer broadcasts the value (reshaped to the
    per-member shape, which may be flattened) and the metadata gains a member
    axis (:func:`member_axis_metadata`). ``None`` gives ``(None, {})``.
    """
    if variable is None:
        return None, {}
    value = variable[...]

    def init(key: jax.Array, shape: Sequence[int], dtype: Any) -> jax.Array:
        del key, dtype
        return jnp.broadcast_to(jnp.reshape(value, tuple(shape)[1:]), tuple(shape))

    return init, member_axis_metadata(variable.get_metadata())


def without_member_axis_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`member_axis_metadata`: metadata for one member's slice."""
    out = dict(metadata)
    for key in _SHARDING_KEYS:
        if out.get(key) is not None:
            out[key] = tuple(out[key])[1:]
    return out


def plain_layer(factory: Callable[[], nnx.Module], **params: nnx.Variable):
    """Builds a Flax layer without initialising it, then sets its parameters.

    ``factory`` runs abstractly (``nnx.eval_shape``), so no random kernel is
    drawn only to be overwritten.
    """
    layer = nnx.eval_shape(factory)
    for name, variable in params.items():
        setattr(layer, name, variable)
    return layer


def shard_output(outputs: jax.Array, out_sharding: Any) -> jax.Array:
    """Places a layer's outputs as ``out_sharding`` asks, as Flax's layers do.

    Flax passes ``out_sharding`` to its ``dot_general``; our ops reshape around
    theirs, so the layer reshards the final outputs instead (a no-op for
    ``None``, the default everywhere).
    """
    if out_sharding is None:
        return outputs
    return jax.sharding.reshard(outputs, out_sharding)


def init_param(
    variable_type: type[nnx.Variable],
    initializer: Callable[..., jax.Array],
    key: jax.Array,
    shape: Sequence[int],
    dtype: Any,
    metadata: Mapping[str, Any],
    name: str,
) -> nnx.Variable:
    """Runs ``initializer`` and checks it made the shape the layer needs."""
    value = initializer(key, tuple(shape), dtype)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"`{name}` returned an array of shape {tuple(value.shape)}, but the "
            f"layer needs shape {tuple(shape)}: pass an initializer that honours "
            f"its `shape` argument."
        )
    return variable_type(value, **metadata)


class EnsembleModule(nnx.Module):
    """Base of every module with per-member state: the ``member`` view.

    Subclasses set ``num_members`` and ``member`` (``None``: all members on a
    member-major ``[E*B, ...]`` batch; ``k``: member ``k`` alone on an un-tiled
    ``[B, ...]`` batch), read their ``[E, ...]`` arrays through
    ``_members``, and implement :meth:`extract_member`.

    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.BatchEnsembleLinear(3, 2, num_members=4,
    ...                                       rngs=nnx.Rngs(0))
    >>> isinstance(layer, ensembles.layers.EnsembleModule)
    True
    >>> nnx.view(layer, member=3).member
    3
    """

    num_members: int
    member: int | None

    def set_view(self, member: int | None = None):
        """Class method used by ``nnx.view``.

        Args:
          member: if an int ``k``, the module runs member ``k`` alone on an
            un-tiled ``[B, ...]`` batch, as the plain Flax module with member
            ``k``'s parameters would. ``None`` leaves the view unchanged.
        """
        if member is not None:
            self.member = check_member(member, self.num_members)

    def extract_member(self, member: int) -> nnx.Module:
        """Returns member ``member`` as the plain Flax module it behaves as.

        Subclasses implement it; the result maps an un-tiled ``[B, ...]`` batch
        exactly as ``nnx.view(self, member=member)`` does.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not implement extract_member."
        )

    def _members(self, *arrays: jax.Array | None) -> tuple[int, list]:
        """Returns the ensemble size to run and the ``[E, ...]`` arrays for it.

        In a member view that is member ``k``'s slice ``[k:k+1]`` of each array.
        """
        if self.member is None:
            return self.num_members, list(arrays)
        k = self.member
        return 1, [None if a is None else a[k : k + 1] for a in arrays]


class BatchEnsembleModule(EnsembleModule):
    """Base of the BatchEnsemble weight layers: ``member`` and ``impl`` views.

    Subclasses also set ``impl`` and the tuple ``_impls`` their op accepts.

    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.BatchEnsembleLinear(3, 2, num_members=4,
    ...                                       rngs=nnx.Rngs(0))
    >>> view = nnx.view(layer, member=1, impl="xla")
    >>> view.member, view.impl, layer.member
    (1, 'xla', None)
    """

    impl: str
    _impls: tuple[str, ...]

    def _init_weights(
        self,
        *,
        kernel_shape: Sequence[int],
        r_shape: Sequence[int],
        s_shape: Sequence[int],
        bias_shape: Sequence[int],
        use_bias: bool,
        param_dtype: Any,
        kernel_init: Callable[..., jax.Array],
        bias_init: Callable[..., jax.Array],
        r_init: Callable[..., jax.Array],
        s_init: Callable[..., jax.Array],
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any],
        bias_metadata: Mapping[str, Any],
        fast_weight_metadata: Mapping[str, Any],
    ) -> None:
        """Creates ``kernel``, ``r``, ``s`` and ``bias`` (``None`` without bias).

        Each draws its own key from ``rngs.params()``, in that order, and each
        initializer's result is checked against the shape the layer needs.
        ``rngs`` is advanced only if all of them succeed.
        """
        with drawing_from(rngs) as rngs:
            self.kernel = init_param(
                nnx.Param,
                kernel_init,
                rngs.params(),
                kernel_shape,
                param_dtype,
                kernel_metadata,
                "kernel_init",
            )
            self.r = init_param(
                FastWeight,
                r_init,
                rngs.params(),
                r_shape,
                param_dtype,
                fast_weight_metadata,
                "r_init",
            )
            self.s = init_param(
                FastWeight,
                s_init,
                rngs.params(),
                s_shape,
                param_dtype,
                fast_weight_metadata,
                "s_init",
            )
            self.bias: nnx.Param[jax.Array] | None
            if use_bias:
                self.bias = init_param(
                    nnx.Param,
                    bias_init,
                    rngs.params(),
                    bias_shape,
                    param_dtype,
                    bias_metadata,
                    "bias_init",
                )
            else:
                self.bias = nnx.data(None)

    def set_view(self, member: int | None = None, impl: str | None = None):
        """Class method used by ``nnx.view``.

        Args:
          member: if an int ``k``, the layer runs member ``k`` alone on an
            un-tiled ``[B, ...]`` batch, as the plain layer with member ``k``'s
            effective weights would. ``None`` leaves the view unchanged.
          impl: the op implementation, e.g. ``"xla"`` or ``"auto"``. ``None``
            leaves it unchanged.
        """
        # Check everything before setting anything: a failed view mutates nothing.
        if impl is not None:
            impl = check_choice(impl, "impl", self._impls)
        super().set_view(member=member)
        if impl is not None:
            self.impl = impl
