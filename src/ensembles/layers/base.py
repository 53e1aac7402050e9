"""What every ensemble layer is: an ``nnx.Module`` with member (and impl) views.

The base classes hold no parameters and no constructor logic: each layer's
``__init__`` creates its parameters and stores its options itself, as Flax's
layers do. What they share is the view ``nnx.view(layer, member=k)`` (and, for
the weight layers, ``impl=...`` and ``deterministic=...``), the operands of
the viewed member (``_member_operands``), the fast weights of a call (the
means, or a draw from a rank-1 posterior that a failed call takes back:
``_draws``, ``_fast_weights``, ``_undraw``), and two plain functions for the
Flax twins: :func:`check_flax_layer` (may a Flax layer be converted?) and
:func:`plain_layer` (one member as the Flax layer it behaves as).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ensembles._checks import as_array, check_bool, check_choice
from ensembles.layers.stacking import layer_axes, reference_parameter
from ensembles.ops.impls import IMPLS
from ensembles.ops.posterior import sample_fast_weights

__all__ = [
    "BatchEnsembleModule",
    "EnsembleModule",
    "check_flax_layer",
    "check_member_index",
    "plain_layer",
]


def check_member_index(member: Any, num_members: int) -> int:
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


def check_flax_layer(
    layer: Any,
    flax_module: type[nnx.Module],
    arg: str,
    cls_name: str,
    **functions: tuple[Any, str],
) -> None:
    """Checks that ``layer`` (argument ``arg``) is a ``flax_module`` we can copy.

    Args:
      layer: the pretrained layer given to a ``from_*`` classmethod.
      flax_module: the Flax class it must be.
      arg: the argument's name, for the errors.
      cls_name: the BatchEnsemble class converting it, for the errors.
      **functions: Flax's injectable functions the twin cannot honour, each
        ``name=(default, shown as)``: a layer holding another is refused.

    Raises:
      TypeError: if ``layer`` is not a ``flax_module``.
      ValueError: if ``layer`` holds a custom function of ``functions``, or
        is a stack of layers (:mod:`ensembles.layers.stacking`).
    """
    if not isinstance(layer, flax_module):
        raise TypeError(
            f"`{arg}` must be an `nnx.{flax_module.__name__}`, got "
            f"{type(layer).__name__}."
        )
    if layer_axes(layer):
        variable, ndim = reference_parameter(layer)
        raise ValueError(
            f"`{arg}` is a stack of layers: its parameters have "
            f"{layer_axes(layer)} leading layer axes (shape "
            f"{tuple(variable.shape)} where one layer's has {ndim} axes), as "
            f"`nnx.vmap` builds them for `nnx.scan`; {cls_name} converts one "
            f"layer. Convert the model with `ensembles.to_batch_ensemble`, which "
            f"converts a stack layer by layer, or call this inside `nnx.vmap`."
        )
    for name, (default, shown) in functions.items():
        custom = getattr(layer, name, None)
        if custom is not None and custom is not default:
            raise ValueError(
                f"`{arg}.{name}` is a custom function ({custom!r}); "
                f"{cls_name} computes with `{shown}` and would silently "
                f"change the layer. Convert a layer built with the default "
                f"`{name}`."
            )


def plain_layer(
    factory: Callable[[nnx.Rngs], nnx.Module], **variables: nnx.Variable | None
) -> nnx.Module:
    """Builds a Flax layer without initialising it, then sets its variables.

    ``factory(rngs)`` runs abstractly (``nnx.eval_shape``), so no random kernel
    is drawn only to be overwritten; ``None`` variables are left as the
    factory made them (e.g. no bias).
    """
    layer = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
    for name, variable in variables.items():
        if variable is not None:
            setattr(layer, name, variable)
    return layer


class EnsembleModule(nnx.Module):
    """Base of every module with per-member state: the ``member`` view.

    A subclass's constructor sets ``num_members`` and ``member`` (``None``: all
    members on a member-major ``[E*B, ...]`` batch; ``k``: member ``k`` alone on
    an un-tiled ``[B, ...]`` batch, set by ``nnx.view(module, member=k)``).

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
    #: The Variables all members share (every other one has a member axis).
    shared_variables: tuple[str, ...] = ()

    def set_view(self, member: int | None = None):
        """Class method used by ``nnx.view``.

        Args:
          member: if an int ``k``, the module runs member ``k`` alone on an
            un-tiled ``[B, ...]`` batch, as the plain Flax module with member
            ``k``'s parameters would. ``None`` leaves the view unchanged.
        """
        if member is not None:
            self.member = check_member_index(member, self.num_members)

    def extract_member(self, member: int) -> nnx.Module:
        """Returns member ``member`` as the plain Flax module it behaves as.

        Every layer of this library implements it (whole models:
        :func:`ensembles.extract_member`); a subclass of your own must too.

        Args:
          member: the member index k, ``0 <= k < num_members``.

        Raises:
          NotImplementedError: always, here.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not implement `extract_member`: define "
            f"it to return member k as the plain Flax module it behaves as (see "
            f"`BatchEnsembleLinear.extract_member`)."
        )

    def _member_operands(self, *arrays: jax.Array | None) -> tuple[int, list]:
        """The ensemble size to run and the ``[E, ...]`` arrays for it.

        In a member view that is 1 and member ``k``'s slice ``[k:k+1]`` of each
        array (``None`` stays ``None``).
        """
        if self.member is None:
            return self.num_members, list(arrays)
        k = self.member
        return 1, [None if a is None else a[k : k + 1] for a in arrays]


class BatchEnsembleModule(EnsembleModule):
    """Base of the BatchEnsemble weight layers: views and the fast weights' draw.

    A weight layer holds a shared ``kernel``, the fast weights ``r`` and ``s``,
    an optional per-member ``bias`` and its op's ``impl``; its class attribute
    ``_impls`` lists the ``impl`` values its op accepts. With a ``posterior``
    (rank-1 Bayesian fast weights) it also holds ``r_unconstrained_stddev``,
    ``s_unconstrained_stddev``, ``prior_stddev`` and an rng stream ``rngs``
    (see :mod:`ensembles.layers.posterior`); ``deterministic`` says whether a
    call uses the posterior means or draws.

    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.BatchEnsembleLinear(3, 2, num_members=4,
    ...                                       rngs=nnx.Rngs(0))
    >>> view = nnx.view(layer, member=1, impl="xla")
    >>> view.member, view.impl, layer.member
    (1, 'xla', None)
    """

    shared_variables = ("kernel",)
    impl: str
    _impls: tuple[str, ...]
    posterior: str | None
    deterministic: bool

    def set_view(
        self,
        member: int | None = None,
        impl: str | None = None,
        deterministic: bool | None = None,
    ):
        """Class method used by ``nnx.view``.

        Args:
          member: if an int ``k``, the layer runs member ``k`` alone on an
            un-tiled ``[B, ...]`` batch (or on one example without the batch
            axis, where the Flax layer takes one), as the plain layer with
            member ``k``'s effective weights would. ``None`` leaves the view
            unchanged.
          impl: the op implementation, ``"xla"`` or ``"pallas"``; a
            layer whose op does not have it (``"pallas"`` on a convolution)
            keeps its own, so that ``nnx.view(model, impl=...)`` sets it in
            every layer that supports it and leaves the rest (use ``only=`` to
            pick layers). A name no op knows raises. ``None`` leaves it
            unchanged.
          deterministic: if True, a layer with a ``posterior`` uses the means
            of its fast weights; if False, it draws them on every call (no
            effect without a posterior). ``None`` leaves it unchanged.
        """
        # Check everything before setting anything: a failed view mutates nothing.
        if impl is not None:
            impl = check_choice(impl, "impl", IMPLS)
            if impl not in self._impls:
                impl = None  # another op's implementation: keep this layer's
        if deterministic is not None:
            deterministic = check_bool(deterministic, "deterministic")
        super().set_view(member=member)
        if impl is not None:
            self.impl = impl
        if deterministic is not None:
            self.deterministic = deterministic

    def _batch_of(
        self, inputs: Any, example_ndim: int | None
    ) -> tuple[jax.Array, bool]:
        """``inputs`` as an array, one example made a batch of one in a member view.

        Flax's layers take one example without a batch axis: ``nnx.Linear``
        an ``[in]`` vector, ``nnx.Conv`` an ``[*spatial, in]`` image.
        ``example_ndim`` is the rank of such an example for this layer
        (``None`` where the Flax layer takes none). A member view runs it as a
        batch of one, and the caller drops the outputs' batch axis again, so
        that ``nnx.view(layer, member=k)`` takes what the Flax layer holding
        member ``k``'s weights takes. The whole ensemble needs the member
        axis: there the op says how to add it.

        Returns:
          ``(inputs, one_example)``: the array to run and whether it was one
          example (whose outputs are ``outputs[0]``).

        Raises:
          TypeError: if ``inputs`` is not an array (e.g. ``None``).
        """
        if not isinstance(inputs, jax.Array):
            inputs = as_array(inputs, "inputs")
        if self.member is not None and inputs.ndim == example_ndim:
            return inputs[None], True
        return inputs, False

    def _call_operands(
        self,
        inputs: jax.Array,
        kernel: jax.Array,
        deterministic: bool | None,
    ) -> tuple[int, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """The ensemble size and the promoted operands of one call.

        The layer's ``promote_dtype`` called as Flax's layers call it, on
        ``(inputs, kernel, bias)`` (the bias sliced to the viewed member,
        :meth:`~EnsembleModule._member_operands`), so a custom function
        written to Flax's contract works unchanged; then the fast weights of
        this call, sliced alike and cast to the dtype it gives the kernel:
        ``r`` and ``s``, or a draw (:meth:`_draws`, :meth:`_fast_weights`).
        The draw comes last, so a call that fails here draws nothing; a layer
        whose op then raises takes its draw back (:meth:`_undraw`).

        Returns:
          ``(num_members, inputs, kernel, r, s, bias)``.
        """
        bias = None if self.bias is None else self.bias[...]
        num_members, (r, s, bias) = self._member_operands(
            self.r[...], self.s[...], bias
        )
        inputs, kernel, bias = self.promote_dtype(
            (inputs, kernel, bias), dtype=self.dtype
        )
        if self._draws(deterministic):
            _, (r, s) = self._member_operands(*self._fast_weights())
        r, s = (jnp.asarray(w, kernel.dtype) for w in (r, s))
        return num_members, inputs, kernel, r, s, bias

    def _draws(self, deterministic: bool | None) -> bool:
        """Whether a call draws its fast weights (a posterior, not deterministic).

        ``deterministic`` is the call's (checked); ``None`` takes the layer's.
        """
        if deterministic is None:
            deterministic = self.deterministic
        else:
            deterministic = check_bool(deterministic, "deterministic")
        return self.posterior is not None and not deterministic

    def _undraw(self, deterministic: bool | None) -> None:
        """Takes a failed call's draw back: the stream's count as it was.

        The weight layers call it when their op raises after
        :meth:`_call_operands` drew, so that nothing is mutated by a call
        that raises and the next call draws what it would have drawn.
        """
        if self._draws(deterministic):
            self.rngs.count[...] -= 1

    def _fast_weights(self) -> tuple[jax.Array, jax.Array]:
        """One draw of the ``[E, ...]`` fast weights from the posterior.

        One reparameterised draw of all members' ``r`` and ``s`` from the
        layer's stream, per member and per call, for a call that draws
        (:meth:`_draws`; see ``docs/rank1.md``). A member view slices the same
        draw, so member ``k`` alone sees what it sees in the ensemble.
        """
        r, s = self.r[...], self.s[...]
        r_key, s_key = jax.random.split(self.rngs())
        return (
            sample_fast_weights(
                r_key, r, self.r_unconstrained_stddev[...], posterior=self.posterior
            ),
            sample_fast_weights(
                s_key, s, self.s_unconstrained_stddev[...], posterior=self.posterior
            ),
        )
