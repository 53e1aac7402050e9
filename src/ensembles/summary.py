"""``summary``: what a BatchEnsemble model holds, against a deep ensemble."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from ensembles.ensemble import extract_member
from ensembles.layers.base import EnsembleModule
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
      shared_norms: one ``(path, type name, parameters)`` row per Flax norm
        left in the model (``nnx.LayerNorm``, ``nnx.RMSNorm``,
        ``nnx.BatchNorm``, ``nnx.GroupNorm`` or ``nnx.InstanceNorm``, e.g.
        kept by ``to_batch_ensemble(..., norms="shared")``), whose parameters
        and statistics every member shares; ``str()`` lists them after the
        BatchEnsemble layers, with no fast or per-member parameters.
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

    def __str__(self) -> str:
        head = ("layer", "type", "shared", "fast", "per-member")
        norms = tuple((p, t, s, 0, 0) for p, t, s in self.shared_norms)
        rows = [
            head,
            *(
                (p, t, f"{s:,}", f"{f:,}", f"{m:,}")
                for p, t, s, f, m in self.layers + norms
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
      model: a model holding BatchEnsemble layers.

    Returns:
      An :class:`EnsembleSummary`.

    Raises:
      ValueError: if ``model`` holds no BatchEnsemble layer, or layers with
        different numbers of members.
    """
    layers, norms = [], []
    sizes = set()
    for path, node in nnx.iter_graph(model):
        if isinstance(node, _SHARED_NORMS):
            where = "/".join(map(str, path))
            norms.append(
                (where, type(node).__name__, _count(nnx.state(node, nnx.Param)))
            )
        elif isinstance(node, EnsembleModule):
            sizes.add(node.num_members)
            # A layer's kernel is shared by its members, r and s are fast, and
            # everything else (biases, norm scales) has one copy per member.
            flat = nnx.to_flat_state(nnx.state(node, nnx.Param))
            shared = fast = member = 0
            for var_path, variable in flat:
                size = int(np.prod(variable.shape))
                if isinstance(variable, FastWeight):
                    fast += size
                elif var_path[-1] == "kernel":
                    shared += size
                else:
                    member += size
            layers.append(
                ("/".join(map(str, path)), type(node).__name__, shared, fast, member)
            )
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
    single = _count(
        nnx.state(nnx.eval_shape(lambda: extract_member(model, 0)), nnx.Param)
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
    )
