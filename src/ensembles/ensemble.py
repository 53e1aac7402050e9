"""``Ensemble``: run a BatchEnsemble model on an un-tiled batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ensembles._checks import check_num_members
from ensembles.layers.base import EnsembleModule, check_member_index
from ensembles.members import tile, untile

__all__ = ["Ensemble", "extract_member"]

M = TypeVar("M")


class Ensemble(nnx.Module):
    """Wraps a BatchEnsemble model: ``[B, ...]`` in, ``[E, B, ...]`` out.

    ``__call__`` tiles its batch for every member, runs the model on the
    member-major ``[E*B, ...]`` batch and splits every output leaf whose
    leading axis is ``E*B`` into ``[E, B, ...]`` (other leaves, a scalar
    auxiliary loss say, are returned as they are). The batch is the first
    argument and every other array argument (or array leaf of a pytree
    argument, positional or keyword) whose leading axis has the first
    argument's size ``B``: a language model's positions ``[B, T]`` and
    attention mask ``[B, 1, T, T]`` are tiled with its tokens. Arguments named
    in ``untiled`` reach the model as they are, as do non-array arguments and
    arrays of another leading size; name an argument there when its leading
    axis only happens to equal ``B`` (a ``[T]`` table when ``T == B``). In a
    member view (``nnx.view(ensemble, member=k)``) nothing is tiled: the model
    runs member ``k`` alone and the output is that member's ``[B, ...]``, as
    the plain model's would be.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import ensembles
    >>> model = ensembles.to_batch_ensemble(
    ...     nnx.Sequential(nnx.Linear(3, 2, rngs=nnx.Rngs(0))),
    ...     num_members=4, rngs=nnx.Rngs(1))
    >>> ensemble = ensembles.Ensemble(model, num_members=4)
    >>> ensemble(jnp.ones((5, 3))).shape
    (4, 5, 2)
    >>> nnx.view(ensemble, member=1)(jnp.ones((5, 3))).shape
    (5, 2)

    Args:
      model: a model whose BatchEnsemble layers all have ``num_members``
        members.
      num_members: the ensemble size E.
      untiled: arguments of ``__call__`` passed to the model unchanged even
        when their leading axis is ``B``: keyword names (``"cache"``) or
        positions (``2``: the second argument after the batch).

    Raises:
      ValueError: if a BatchEnsemble layer in ``model`` has another size, or
        ``model`` holds none (its E "members" would be E identical copies,
        whose agreement would look like certainty), or ``untiled`` names
        position 0 (the batch is always tiled).
      TypeError: if an entry of ``untiled`` is neither a str nor an int.
    """

    def __init__(
        self, model: Any, *, num_members: int, untiled: Sequence[int | str] = ()
    ):
        num_members = check_num_members(num_members)
        untiled = _check_untiled(untiled)
        found = False
        for path, node in nnx.iter_graph(model):
            if not isinstance(node, EnsembleModule):
                continue
            found = True
            size = node.num_members
            if size != num_members:
                where = "/".join(map(str, path))
                raise ValueError(
                    f"`num_members` (={num_members}) must match the model's "
                    f"layers, but `{where}` ({type(node).__name__}) has "
                    f"num_members={size}."
                )
        if not found:
            raise ValueError(
                f"`model` ({type(model).__name__}) holds no BatchEnsemble layer: "
                f"its {num_members} members would all compute the same thing. "
                f"Convert it with `ensembles.to_batch_ensemble(model, "
                f"num_members={num_members}, rngs=...)` first."
            )
        self.model = model
        self.num_members = num_members
        self.untiled = untiled
        self.member: int | None = None

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs every member on ``inputs`` and returns ``[E, B, ...]`` outputs.

        Args:
          inputs: an un-tiled ``[B, ...]`` batch (or a pytree of them).
          *args: passed to the model; array leaves with leading axis ``B``
            are tiled unless their position is in ``untiled``.
          **kwargs: passed to the model; array leaves with leading axis ``B``
            are tiled unless their name is in ``untiled``.

        Returns:
          The model's outputs, every leaf with leading axis ``E*B`` split to
          ``[E, B, ...]`` (in a member view: the member's own outputs).
        """
        if self.member is not None:
            return self.model(inputs, *args, **kwargs)
        num_members = self.num_members
        leaves = jax.tree.leaves(inputs)
        if not leaves or jnp.ndim(leaves[0]) < 1:
            raise ValueError(
                f"`inputs` must be a [B, ...] batch (or a pytree of them), got "
                f"{inputs!r}."
            )
        batch = jnp.shape(leaves[0])[0]

        def tile_batch(tree):
            return jax.tree.map(
                lambda x: tile(x, num_members) if _leading(x) == batch else x, tree
            )

        args = tuple(
            a if i in self.untiled else tile_batch(a) for i, a in enumerate(args, 1)
        )
        kwargs = {
            k: v if k in self.untiled else tile_batch(v) for k, v in kwargs.items()
        }
        outputs = self.model(
            jax.tree.map(lambda x: tile(x, num_members), inputs), *args, **kwargs
        )
        rows = num_members * batch
        return jax.tree.map(
            lambda y: untile(y, num_members) if _leading(y) == rows else y, outputs
        )

    def set_view(self, member: int | None = None):
        """Class method used by ``nnx.view``.

        Args:
          member: if an int ``k``, ``__call__`` runs member ``k`` alone and
            returns its ``[B, ...]`` outputs. ``None`` leaves it unchanged.
        """
        if member is not None:
            self.member = check_member_index(member, self.num_members)

    def extract_member(self, member: int) -> Any:
        """Returns member ``member`` of the wrapped model as a plain Flax model.

        It maps an un-tiled ``[B, ...]`` batch as ``nnx.view(self,
        member=member)`` does, up to rounding (see
        :func:`ensembles.extract_member`).

        Args:
          member: the member index k.

        Returns:
          ``ensembles.extract_member(self.model, member)``.
        """
        return extract_member(self.model, member)


def _leading(x: Any) -> int | None:
    """The leading axis of an array leaf, or ``None`` (scalars, non-arrays)."""
    if isinstance(x, jax.Array | np.ndarray) and x.ndim >= 1:
        return x.shape[0]
    return None


def _check_untiled(untiled: Any) -> tuple[int | str, ...]:
    """Checks :class:`Ensemble`'s ``untiled``: argument names and positions."""
    if isinstance(untiled, str | int):
        untiled = (untiled,)
    out = []
    for entry in untiled:
        if isinstance(entry, bool) or not isinstance(entry, int | str):
            raise TypeError(
                f"`untiled` must hold argument names (str) or positions (int), "
                f"got {entry!r} of type {type(entry).__name__}."
            )
        if isinstance(entry, int) and entry < 1:
            raise ValueError(
                f"`untiled` must hold positions >= 1 (1: the first argument "
                f"after the batch, which is always tiled), got {entry}."
            )
        out.append(entry)
    return tuple(out)


def extract_member(model: M, member: int) -> M:
    """Returns member ``member`` of a BatchEnsemble model as a plain Flax model.

    Every BatchEnsemble layer is replaced by the original Flax layer holding the
    member's effective weights (``nnx.Linear`` with kernel
    ``kernel * outer(r_k, s_k)`` and bias ``bias_k``; per-member norms by the
    Flax norm with member ``k``'s scale, bias and statistics). The result maps
    an un-tiled ``[B, ...]`` batch as member ``k`` does, and as
    ``nnx.view(model, member=k)`` does, up to rounding: its layers hold the
    product ``kernel * outer(r_k, s_k)``, where the ensemble and the view
    compute with ``kernel``, ``r_k`` and ``s_k``, so the outputs need not be
    bit-exact. ``model`` is not changed and shares no Variables with the
    result.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import ensembles
    >>> model = nnx.Sequential(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    >>> ensemble = ensembles.to_batch_ensemble(model, num_members=4,
    ...                                        rngs=nnx.Rngs(1))
    >>> member = ensembles.extract_member(ensemble, 2)
    >>> type(member.layers[0]).__name__
    'Linear'
    >>> x = jnp.ones((5, 3))
    >>> full = ensembles.untile(ensemble(ensembles.tile(x, 4)), 4)
    >>> bool(jnp.allclose(member(x), full[2], atol=1e-5))
    True

    Args:
      model: a model holding BatchEnsemble layers (e.g. from
        :func:`to_batch_ensemble`); an :class:`ensembles.Ensemble` is unwrapped.
      member: the member index k.

    Returns:
      The plain model of member ``k``.

    Raises:
      ValueError: if ``model`` holds no BatchEnsemble layer or ``member`` is out
        of range for one of them.
    """
    found: list[str] = []

    def extract(path, node):
        if isinstance(node, Ensemble):
            # Its model was extracted already (the walk is bottom-up).
            return node.model
        if isinstance(node, EnsembleModule):
            found.append("/".join(map(str, path)))
            return node.extract_member(member)
        return node

    result = nnx.recursive_map(extract, nnx.clone(model), graph=True)
    if not found:
        raise ValueError(
            f"`model` ({type(model).__name__}) holds no BatchEnsemble layer: "
            f"there is no member to extract. Convert it with "
            f"`ensembles.to_batch_ensemble` first."
        )
    return result
