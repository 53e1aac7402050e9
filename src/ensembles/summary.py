"""``summary``: what a BatchEnsemble model holds, against a deep ensemble."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import graph as nnx_graph

from ensembles.ensemble import extract_member
from ensembles.layers.base import BatchEnsembleModule, EnsembleModule
from ensembles.variables import FastWeight

__all__ = ["EnsembleSummary", "summary"]


#: The Flax norms that, left in a BatchEnsemble model, keep one copy of their
#: parameters (and BatchNorm statistics) for all members.
_SHARED_NORMS = (
    nnx.LayerNorm,
    nnx.RMSNorm,
    nnx.BatchNorm,
    nnx.GroupNorm,
    nnx.InstanceNorm,
)


def _count(state: Any) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(state)))


def is_norm_like(node: Any) -> bool:
    """A Flax norm, or a module of the user's whose class name says it is one.

    Custom norms (Gemma's and Mamba2's own ``RMSNorm`` classes, say) are not
    converted by ``norms="member"``; this is how they are found to be named.
    """
    return isinstance(node, _SHARED_NORMS) or (
        isinstance(node, nnx.Module)
        and not isinstance(node, EnsembleModule)
        and "norm" in type(node).__name__.lower()
    )


def is_embedding(node: Any) -> bool:
    """``nnx.Embed``, or a module holding a Variable named ``embedding``."""
    return isinstance(node, nnx.Embed) or isinstance(
        getattr(node, "embedding", None), nnx.Variable
    )


def shared_rows(model: Any) -> tuple[tuple[str, str, int, str], ...]:
    """``(path, type, parameters, kind)`` of every parameter that stayed shared.

    Every module outside the ensemble layers that holds ``nnx.Param`` entries
    of its own (not through a submodule) gets a row: Flax layers
    (``nnx.Embed``, norms, a layer ``only`` left out), the user's norms and
    embeddings (by :func:`is_norm_like` / :func:`is_embedding`), each counted
    as a module; any other module's own parameters (a ViT's ``cls_token``, a
    layer-scale ``gamma``) get one row per Variable, typed by its class.
    ``kind`` is ``"norm"``, ``"embedding"``, ``"layer"`` or ``"parameter"``.
    """
    ensemble_paths = [
        tuple(path)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, EnsembleModule)
    ]
    rows = []
    for path, node in nnx.iter_graph(model):
        path = tuple(path)
        if isinstance(node, nnx.Variable) or any(
            path[: len(p)] == p for p in ensemble_paths
        ):
            continue
        node_impl = nnx_graph.get_node_impl(node)
        if node_impl is None:
            continue
        own = [
            (name, value)
            for name, value in node_impl.node_dict(node).items()
            if isinstance(value, nnx.Param)
        ]
        if not own:
            continue
        where = "/".join(map(str, path))
        flax_layer = type(node).__module__.startswith("flax.")
        if is_norm_like(node):
            kind = "norm"
        elif is_embedding(node):
            kind = "embedding"
        elif flax_layer:
            kind = "layer"
        else:
            for name, value in own:
                rows.append(
                    (
                        "/".join(filter(None, (where, str(name)))),
                        type(value).__name__,
                        int(np.prod(value.shape)),
                        "parameter",
                    )
                )
            continue
        count = sum(int(np.prod(v.shape)) for _, v in own)
        rows.append((where, type(node).__name__, count, kind))
    return tuple(rows)


@dataclasses.dataclass(frozen=True)
class EnsembleSummary:
    """Parameter counts of a BatchEnsemble model; ``str()`` renders a table.

    Every count is of ``nnx.Param`` entries (fast weights included); running
    statistics (``nnx.BatchStat``) are not parameters and are not counted.

    Attributes:
      num_members: the ensemble size E.
      layers: one ``(path, type name, shared, fast, per-member)`` row per
        BatchEnsemble layer (per-member norms included).
      shared_params: parameters every member uses (kernels, unconverted layers,
        shared norms).
      fast_params: fast-weight parameters (``r``, ``s``) of all members.
      member_params: other per-member parameters (biases, member norms).
      total_params: everything: shared + fast + per-member.
      single_params: the parameters of one member alone, the plain model
        ``extract_member(model, 0)``: every shared parameter once (each kernel
        with the member's ``r_k`` and ``s_k`` folded into it, so the fast
        weights add nothing) plus one member's biases and per-member norm
        parameters.
      deep_ensemble_params: E independent copies: ``E * single_params``.
      shared_norms: one ``(path, type name, parameters)`` row per norm left
        in the model (a Flax norm, e.g. kept by ``to_batch_ensemble(...,
        norms="shared")``, or a norm class of the user's, which
        ``norms="member"`` does not convert), whose parameters and statistics
        every member shares.
      shared: one ``(path, type name, parameters)`` row for everything else
        outside the BatchEnsemble layers that holds parameters, every member
        using the same copy: embeddings, unconverted layers, and a module's
        own parameters (one row per Variable, e.g. ``vit/cls_token``).
        ``str()`` lists the norms and these after the BatchEnsemble layers,
        and names the embeddings: one tied to the output layer (``attend``)
        makes the output layer shared too.
    """

    num_members: int
    layers: tuple[tuple[str, str, int, int, int], ...]
    shared_params: int
    fast_params: int
    member_params: int
    total_params: int
    single_params: int
    deep_ensemble_params: int
    shared_norms: tuple[tuple[str, str, int], ...] = ()
    shared: tuple[tuple[str, str, int], ...] = ()
    embeddings: tuple[str, ...] = ()

    def __str__(self) -> str:
        head = ("layer", "type", "shared", "fast", "per-member")
        rest = tuple((p, t, s, 0, 0) for p, t, s in self.shared_norms + self.shared)
        rows = [
            head,
            *(
                (p, t, f"{s:,}", f"{f:,}", f"{m:,}")
                for p, t, s, f, m in self.layers + rest
            ),
        ]
        widths = [max(len(str(row[i])) for row in rows) for i in range(5)]
        lines = [
            "  ".join(
                str(c).ljust(w) if i < 2 else str(c).rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        ]
        ratio = self.total_params / self.deep_ensemble_params
        lines += [
            "",
            f"members: {self.num_members}",
            f"total parameters: {self.total_params:,} (shared {self.shared_params:,}"
            f", fast {self.fast_params:,}, per-member {self.member_params:,})",
            f"one member alone: {self.single_params:,}",
            f"deep ensemble of {self.num_members}: {self.deep_ensemble_params:,} "
            f"(this model holds {ratio:.1%} of that)",
        ]
        if self.embeddings:
            lines.append(
                f"shared embeddings: {', '.join(self.embeddings)} (one tied to the "
                f"output layer, e.g. through `attend`, makes the output layer "
                f"shared by every member too)"
            )
        return "\n".join(lines)


def summary(model: Any) -> EnsembleSummary:
    """Counts what a BatchEnsemble model holds and what a deep ensemble would.

    The table has one row per BatchEnsemble layer and one per shared norm (a
    Flax norm every member uses; see :attr:`EnsembleSummary.shared_norms`).
    "one member alone" is the parameter count of the plain model
    ``extract_member(model, 0)``: each kernel once, with ``r_0`` and ``s_0``
    folded into it, one member's biases and per-member norm parameters, and
    every other parameter (shared norms, unconverted layers) once. A deep
    ensemble is E such models.

    >>> from flax import nnx
    >>> import ensembles
    >>> model = ensembles.to_batch_ensemble(
    ...     nnx.Sequential(nnx.Linear(10, 20, rngs=nnx.Rngs(0)),
    ...                    nnx.LayerNorm(20, rngs=nnx.Rngs(0))),
    ...     num_members=4, rngs=nnx.Rngs(1))
    >>> info = ensembles.summary(model)
    >>> info.shared_params, info.fast_params, info.member_params
    (240, 120, 80)
    >>> info.shared_norms
    (('layers/1', 'LayerNorm', 40),)
    >>> info.single_params                           # kernel, bias, norm
    260
    >>> info.deep_ensemble_params                    # 4 * (200 + 20 + 40)
    1040
    >>> print(info)                                  # doctest: +ELLIPSIS
    layer     type                 shared  fast  per-member
    layers/0  BatchEnsembleLinear     200   120          80
    layers/1  LayerNorm                40     0           0
    ...
    one member alone: 260
    deep ensemble of 4: 1,040 (this model holds 42.3% of that)

    Args:
      model: a model holding BatchEnsemble layers; an abstract one (built
        with ``nnx.eval_shape``, nothing allocated) is counted alike.

    Returns:
      An :class:`EnsembleSummary`.

    Raises:
      ValueError: if ``model`` holds no BatchEnsemble layer, or layers with
        different numbers of members.
    """
    layers = []
    sizes = set()
    for path, node in nnx.iter_graph(model):
        if isinstance(node, EnsembleModule):
            sizes.add(node.num_members)
            # A BatchEnsemble layer's kernel is shared by its members, r and s
            # are fast, and everything else (biases, norm scales, and every
            # parameter of an EnsembleLinear) has one copy per member.
            flat = nnx.to_flat_state(nnx.state(node, nnx.Param))
            shared = fast = member = 0
            for var_path, variable in flat:
                size = int(np.prod(variable.shape))
                if isinstance(variable, FastWeight):
                    fast += size
                elif var_path[-1] == "kernel" and isinstance(node, BatchEnsembleModule):
                    shared += size
                else:
                    member += size
            layers.append(
                ("/".join(map(str, path)), type(node).__name__, shared, fast, member)
            )
    rows = shared_rows(model)
    norms = [row[:3] for row in rows if row[3] == "norm"]
    others = [row[:3] for row in rows if row[3] != "norm"]
    embeddings = [row[0] for row in rows if row[3] == "embedding"]
    if not layers:
        raise ValueError(
            f"`model` ({type(model).__name__}) holds no BatchEnsemble layer; "
            f"convert it with `ensembles.to_batch_ensemble` first."
        )
    if len(sizes) > 1:
        raise ValueError(f"`model` mixes ensemble sizes {sorted(sizes)}.")
    (num_members,) = sizes
    total = _count(nnx.state(model, nnx.Param))
    fast = sum(row[3] for row in layers)
    member = sum(row[4] for row in layers)
    # The model as an argument, not a constant: an abstract one (made by
    # nnx.eval_shape, its values shapes) is counted alike.
    single = _count(
        nnx.state(nnx.eval_shape(lambda m: extract_member(m, 0), model), nnx.Param)
    )
    return EnsembleSummary(
        num_members=num_members,
        layers=tuple(layers),
        shared_params=total - fast - member,
        fast_params=fast,
        member_params=member,
        total_params=total,
        single_params=single,
        deep_ensemble_params=num_members * single,
        shared_norms=tuple(norms),
        shared=tuple(others),
        embeddings=tuple(embeddings),
    )
