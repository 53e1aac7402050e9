"""``Ensemble``: run a BatchEnsemble model on an un-tiled batch."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
from flax import nnx

from ensembles._checks import check_num_members
from ensembles.layers.base import EnsembleModule, check_member_index
from ensembles.members import tile, untile

__all__ = ["Ensemble", "extract_member"]

M = TypeVar("M")


class Ensemble(nnx.Module):
    """Wraps a BatchEnsemble model: ``[B, ...]`` in, ``[E, B, ...]`` out.

    ``__call__`` tiles its first argument for every member, runs the model on
    the member-major ``[E*B, ...]`` batch and splits every output leaf into
    ``[E, B, ...]``. Other arguments are passed through unchanged. In a member
    view (``nnx.view(ensemble, member=k)``) the model runs member ``k`` alone
    and the output is that member's ``[B, ...]``, as the plain model's would be.

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

    Raises:
      ValueError: if a BatchEnsemble layer in ``model`` has another size, or
        ``model`` holds none (its E "members" would be E identical copies,
        whose agreement would look like certainty).
    """

    def __init__(self, model: Any, *, num_members: int):
        num_members = check_num_members(num_members)
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
        self.member: int | None = None

    def __call__(self, inputs: jax.Array, *args: Any, **kwargs: Any) -> Any:
        """Runs every member on ``inputs`` and returns ``[E, B, ...]`` outputs.

        Args:
          inputs: an un-tiled ``[B, ...]`` batch.
          *args: passed to the model unchanged.
          **kwargs: passed to the model unchanged.

        Returns:
          The model's outputs with every leaf split to ``[E, B, ...]`` (in a
          member view: the member's ``[B, ...]`` outputs).
        """
        if self.member is not None:
            return self.model(inputs, *args, **kwargs)
        outputs = self.model(tile(inputs, self.num_members), *args, **kwargs)
        return jax.tree.map(lambda y: untile(y, self.num_members), outputs)

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
