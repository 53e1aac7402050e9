"""TEMPORARY during the layer rewrite (issue 23): the old shared machinery.

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
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers

from ensembles import initializers as fast_initializers
from ensembles._checks import check_choice, check_num_members
from ensembles.layers import base as _base
from ensembles.variables import FastWeight

__all__ = [
    "WEIGHT_OPTIONS",
    "BatchEnsembleModule",
    "EnsembleModule",
    "ParamSpec",
    "check_member",
    "check_rngs",
    "drawing_from",
    "member_axis_metadata",
    "member_copies",
    "member_slice",
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


class ParamSpec(NamedTuple):
    """How a layer's constructor draws one parameter (see ``_init_module``).

    ``per_member``: the variable has a leading member axis ``[E, *shape]``.
    """

    variable_type: type[nnx.Variable]
    shape: Sequence[int]
    initializer: Callable[..., jax.Array]
    metadata: Mapping[str, Any]
    per_member: bool = True


def member_slice(variable: nnx.Variable, member: int) -> nnx.Variable:
    """Member ``member``'s slice of an ``[E, ...]`` variable, of the same type."""
    metadata = without_member_axis_metadata(variable.get_metadata())
    return type(variable)(variable[member], **metadata)


class EnsembleModule(_base.EnsembleModule):
    """Base of every module with per-member state: the ``member`` view.

    A subclass is the ensemble twin of the Flax module ``flax_module`` and says,
    as data, what the two share; the code that uses it is written once, here:

    - ``_flax_options``: the constructor arguments both take and store under
      the same name (copied by ``from_*`` and :meth:`extract_member`);
    - ``_member_params``: the optional ``[E, ...]`` parameters, each drawn by a
      ``<name>_init`` argument with ``<name>_metadata`` (and, where the Flax
      module has it, switched by ``use_<name>``); a member's slice is the Flax
      module's parameter of the same name;
    - ``_flax_functions``: Flax's injectable functions the twin cannot honour,
      each with its default, ``{name: (default, shown as)}``;
    - ``_plain_arguments``: further arguments of the plain module
      :meth:`extract_member` builds.

    ``_init_module`` sets ``num_members`` and ``member`` (``None``: all members
    on a member-major ``[E*B, ...]`` batch; ``k``: member ``k`` alone on an
    un-tiled ``[B, ...]`` batch); a subclass reads its ``[E, ...]`` arrays
    through ``_members``. See ``docs/architecture.md`` for the recipe.

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

    flax_module: ClassVar[type[nnx.Module]]
    _flax_options: ClassVar[tuple[str, ...]] = ()
    _member_params: ClassVar[tuple[str, ...]] = ()
    _flax_functions: ClassVar[Mapping[str, tuple[Any, str]]] = MappingProxyType({})
    _plain_arguments: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    def _init_module(
        self, options: Mapping[str, Any], **params: ParamSpec | None
    ) -> None:
        """Draws ``params`` and stores the options: a constructor's shared body.

        Args:
          options: the constructor's arguments, ``locals()`` after the layer has
            checked its own (so ``options[name]`` is the checked value). Read:
            ``num_members``, ``rngs``, ``param_dtype`` and ``_flax_options``.
          **params: in drawing order, each parameter's :class:`ParamSpec`, or
            ``None`` for one the layer does not use (it becomes ``None``).
            Every parameter draws its own key from ``rngs.params()``, and
            ``rngs`` is advanced only if every initializer succeeds.
        """
        num_members = check_num_members(options["num_members"])
        with drawing_from(options["rngs"]) as rngs:
            values = {
                name: nnx.data(None)
                if spec is None
                else init_param(
                    spec.variable_type,
                    spec.initializer,
                    rngs.params(),
                    (num_members, *spec.shape) if spec.per_member else spec.shape,
                    options["param_dtype"],
                    spec.metadata,
                    f"{name}_init",
                )
                for name, spec in params.items()
            }
        for name, value in values.items():
            setattr(self, name, value)
        for name in self._flax_options:
            setattr(self, name, options[name])
        self.num_members = num_members
        self.member = None

    @classmethod
    def _check_flax(cls, layer: Any, arg: str) -> None:
        """Checks that ``layer`` (argument ``arg``) is a ``flax_module`` we can copy."""
        if not isinstance(layer, cls.flax_module):
            raise TypeError(
                f"`{arg}` must be an `nnx.{cls.flax_module.__name__}`, got "
                f"{type(layer).__name__}."
            )
        for name, (default, shown) in cls._flax_functions.items():
            custom = getattr(layer, name, None)
            if custom is not None and custom is not default:
                raise ValueError(
                    f"`{arg}.{name}` is a custom function ({custom!r}); "
                    f"{cls.__name__} computes with `{shown}` and would silently "
                    f"change the layer. Convert a layer built with the default "
                    f"`{name}`."
                )

    @classmethod
    def _flax_arguments(cls, layer: nnx.Module) -> dict[str, Any]:
        """The constructor arguments that give every member ``layer``'s state.

        ``layer``'s options and, for every member parameter, an initializer
        copying ``layer``'s parameter to each member.
        """
        arguments = {name: getattr(layer, name) for name in cls._flax_options}
        for name in cls._member_params:
            variable = getattr(layer, name)
            if f"use_{name}" in arguments:
                arguments[f"use_{name}"] = variable is not None
            arguments[f"{name}_init"], arguments[f"{name}_metadata"] = member_copies(
                variable
            )
        return arguments

    @classmethod
    def _from_flax(cls, layer: nnx.Module, arg: str, **arguments: Any):
        """``from_*``'s body: the twin of ``layer``, every member a copy of it.

        ``arg`` names ``layer`` in errors; ``arguments`` are the constructor
        arguments the Flax module does not hold.
        """
        cls._check_flax(layer, arg)
        return cls(**cls._flax_arguments(layer), **arguments)

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

        It maps an un-tiled ``[B, ...]`` batch as ``nnx.view(self,
        member=member)`` does (up to rounding for the weight layers, whose
        plain layer holds the scaled kernel); this module is not changed.

        Args:
          member: the member index k, ``0 <= k < num_members``.

        Returns:
          A new ``flax_module`` holding member k's state.
        """
        if not hasattr(type(self), "flax_module"):
            raise NotImplementedError(
                f"{type(self).__name__} names no `flax_module`: set it (and "
                f"`_flax_options`, `_member_params`) or override extract_member."
            )
        k = check_member(member, self.num_members)
        options = {name: getattr(self, name) for name in self._flax_options}
        options.update(self._plain_arguments)
        return plain_layer(
            lambda: self.flax_module(**options, rngs=nnx.Rngs(0)),
            **self._member_state(k),
        )

    def _member_state(self, member: int) -> dict[str, Any]:
        """What the plain module of :meth:`extract_member` holds: its variables."""
        state = {}
        for name in self._member_params:
            variable = getattr(self, name)
            if variable is not None:
                state[name] = member_slice(variable, member)
        return state

    def _members(self, *arrays: jax.Array | None) -> tuple[int, list]:
        """Returns the ensemble size to run and the ``[E, ...]`` arrays for it.

        In a member view that is member ``k``'s slice ``[k:k+1]`` of each array.
        """
        if self.member is None:
            return self.num_members, list(arrays)
        k = self.member
        return 1, [None if a is None else a[k : k + 1] for a in arrays]

    def _member_arrays(self) -> tuple[int, list]:
        """``_members`` of the ``_member_params`` (``None`` where unused)."""
        return self._members(
            *(
                None if getattr(self, name) is None else getattr(self, name)[...]
                for name in self._member_params
            )
        )


#: The options every BatchEnsemble weight layer shares with its Flax layer.
WEIGHT_OPTIONS = (
    "dtype",
    "param_dtype",
    "precision",
    "promote_dtype",
    "preferred_element_type",
)


class BatchEnsembleModule(EnsembleModule, _base.BatchEnsembleModule):
    """Base of the BatchEnsemble weight layers: ``member`` and ``impl`` views.

    A weight layer holds a shared ``kernel``, the fast weights ``r`` and ``s``
    and an optional per-member ``bias``. Besides ``EnsembleModule``'s data it
    sets ``_impls`` (the ``impl`` values its op accepts) and implements
    ``_member_kernel`` (member k's effective kernel, what
    :meth:`extract_member` stores).

    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.BatchEnsembleLinear(3, 2, num_members=4,
    ...                                       rngs=nnx.Rngs(0))
    >>> view = nnx.view(layer, member=1, impl="xla")
    >>> view.member, view.impl, layer.member
    (1, 'xla', None)
    """

    impl: str
    _impls: ClassVar[tuple[str, ...]]
    _member_params = ("bias",)

    def _init_weights(
        self,
        options: Mapping[str, Any],
        *,
        kernel_shape: Sequence[int],
        r_shape: Sequence[int],
        s_shape: Sequence[int],
        bias_shape: Sequence[int] | None,
        kernel_init: Callable[..., jax.Array] | None = None,
        bias_init: Callable[..., jax.Array] | None = None,
    ) -> None:
        """Creates ``kernel``, ``r``, ``s`` and ``bias`` and stores the options.

        Args:
          options: the constructor's ``locals()`` (see ``_init_module``); also
            read: ``impl`` and the ``*_init`` and ``*_metadata`` arguments.
          kernel_shape: the shared kernel's shape.
          r_shape: one member's ``r`` (``[E, *r_shape]`` in all).
          s_shape: one member's ``s``.
          bias_shape: one member's bias, or ``None`` for no bias.
          kernel_init: replaces ``options["kernel_init"]`` (e.g. a wrapper).
          bias_init: replaces ``options["bias_init"]``.
        """
        impl = check_choice(options["impl"], "impl", self._impls)
        fast_metadata = options["fast_weight_metadata"]
        self._init_module(
            options,
            kernel=ParamSpec(
                nnx.Param,
                kernel_shape,
                kernel_init or options["kernel_init"],
                options["kernel_metadata"],
                per_member=False,
            ),
            r=ParamSpec(FastWeight, r_shape, options["r_init"], fast_metadata),
            s=ParamSpec(FastWeight, s_shape, options["s_init"], fast_metadata),
            bias=None
            if bias_shape is None
            else ParamSpec(
                nnx.Param,
                bias_shape,
                bias_init or options["bias_init"],
                options["bias_metadata"],
            ),
        )
        self.impl = impl

    @classmethod
    def _flax_arguments(cls, layer: nnx.Module) -> dict[str, Any]:
        kernel = layer.kernel
        return {
            **super()._flax_arguments(layer),
            # The dtype the parameters are held in: a model cast after it was
            # built (its state to bfloat16, say) keeps a stale `param_dtype`,
            # and new fast weights drawn in it would promote every member's
            # computation back to float32.
            "param_dtype": kernel.dtype,
            "kernel_init": lambda key, shape, dtype: kernel[...],
            "kernel_metadata": kernel.get_metadata(),
        }

    @classmethod
    def _convert(
        cls, layer, arg, num_members, rngs, r_init, s_init, share_kernel, impl
    ):
        """``from_*``'s body for a weight layer: see e.g. ``from_linear``."""
        new = cls._from_flax(
            layer,
            arg,
            num_members=num_members,
            rngs=rngs,
            r_init=r_init,
            s_init=s_init,
            impl=impl,
        )
        if share_kernel:
            new.kernel = layer.kernel
        return new

    def _member_kernel(self, member: int) -> jax.Array:
        """Member ``member``'s effective kernel (what the plain layer holds)."""
        raise NotImplementedError

    def _member_state(self, member: int) -> dict[str, Any]:
        kernel = nnx.Param(self._member_kernel(member), **self.kernel.get_metadata())
        return {"kernel": kernel, **super()._member_state(member)}

    def _apply(
        self, op: Callable[..., jax.Array], inputs: jax.Array, kernel=None, **options
    ) -> jax.Array:
        """Runs ``op`` on the promoted operands of every member (or the viewed one).

        ``kernel`` replaces the stored kernel (e.g. masked); ``options`` are the
        op's own keyword arguments.
        """
        kernel = self.kernel[...] if kernel is None else kernel
        bias = None if self.bias is None else self.bias[...]
        num_members, (r, s, bias) = self._members(self.r[...], self.s[...], bias)
        operands = self.promote_dtype((inputs, kernel, r, s, bias), dtype=self.dtype)
        return op(
            *operands,
            num_members=num_members,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
            impl=self.impl,
            **options,
        )

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
