"""Optax helpers that treat fast weights apart from shared weights.

The BatchEnsemble training recipe gives the fast weights ``r`` and ``s`` their
own treatment: no weight decay and often a learning-rate multiplier (0.5 on
CIFAR, 0.25 on ImageNet in uncertainty-baselines). These helpers label every
parameter ``"fast"`` or ``"shared"`` so that ``optax.multi_transform`` (or any
mask-taking optax transformation) can do that.

optax is needed only by this module; it is imported when a helper is called.

``nnx.Optimizer`` hands optax the parameters as ``Variable`` objects at ``init``
and as plain arrays at ``update``, so a label must be derivable from the path
alone: a fast weight is a ``FastWeight`` named ``r`` or ``s`` (or, in a rank-1
layer, ``r_unconstrained_stddev`` / ``s_unconstrained_stddev``: the posterior
scales are per-member fast-weight parameters too, regularised by the KL rather
than weight decay). The labels check, whenever they see Variables, that the
names and the types agree.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from ensembles.variables import FastWeight

__all__ = ["fast_weight_labels", "fast_weight_mask", "split_fast_weights"]

FAST = "fast"
SHARED = "shared"
_FAST_NAMES = ("r", "s", "r_unconstrained_stddev", "s_unconstrained_stddev")


def _key_name(entry: Any) -> Any:
    for attribute in ("key", "name", "idx"):
        if hasattr(entry, attribute):
            return getattr(entry, attribute)
    return entry


def _label(path: tuple, leaf: Any) -> str:
    named_fast = bool(path) and _key_name(path[-1]) in _FAST_NAMES
    if isinstance(leaf, nnx.Variable):
        typed_fast = isinstance(leaf, FastWeight)
        if typed_fast != named_fast:
            where = "/".join(str(_key_name(p)) for p in path)
            raise ValueError(
                f"Parameter `{where}` is a {type(leaf).__name__} but its name "
                f"says {'fast' if named_fast else 'shared'}: fast weights must "
                f"be FastWeights named {_FAST_NAMES} and no other parameter may "
                f"use those names, so that the labels stay the same when optax "
                f"sees plain arrays. Rename the parameter."
            )
    return FAST if named_fast else SHARED


def fast_weight_labels(params: Any) -> Any:
    """Labels every parameter ``"fast"`` (``r``, ``s``, their scales) or ``"shared"``.

    Works on ``nnx.State`` of Variables (what ``nnx.Optimizer`` passes to
    ``init``) and on the same tree of plain arrays (what it passes to
    ``update``); Variables are labelled as a whole.

    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.BatchEnsembleLinear(3, 2, num_members=2,
    ...                                       rngs=nnx.Rngs(0))
    >>> labels = ensembles.optim.fast_weight_labels(nnx.state(layer, nnx.Param))
    >>> dict(sorted(labels.items()))
    {'bias': 'shared', 'kernel': 'shared', 'r': 'fast', 's': 'fast'}

    Args:
      params: a pytree of parameters.

    Returns:
      A pytree of the same structure (Variables as leaves) of labels.
    """
    return jax.tree_util.tree_map_with_path(
        _label, params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def fast_weight_mask(params: Any) -> Any:
    """``True`` for fast weights, ``False`` for shared ones.

    Pass ``lambda p: jax.tree.map(lambda m: not m, fast_weight_mask(p))`` as
    ``mask`` to ``optax.add_decayed_weights`` / ``optax.adamw`` to decay the
    shared weights only.

    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.BatchEnsembleLinear(3, 2, num_members=2,
    ...                                       rngs=nnx.Rngs(0))
    >>> mask = ensembles.optim.fast_weight_mask(nnx.state(layer, nnx.Param))
    >>> dict(sorted(mask.items()))
    {'bias': False, 'kernel': False, 'r': True, 's': True}

    Args:
      params: a pytree of parameters.

    Returns:
      A pytree of bools of the same structure.
    """
    return jax.tree.map(lambda label: label == FAST, fast_weight_labels(params))


def split_fast_weights(shared_tx: Any, fast_tx: Any) -> Any:
    """One optax transformation: ``shared_tx`` on shared weights, ``fast_tx`` on fast.

    >>> import optax
    >>> from flax import nnx
    >>> import ensembles
    >>> model = ensembles.BatchEnsembleLinear(3, 2, num_members=2,
    ...                                       rngs=nnx.Rngs(0))
    >>> tx = ensembles.optim.split_fast_weights(
    ...     optax.adamw(1e-3, weight_decay=1e-4),   # shared: with weight decay
    ...     optax.adam(0.5 * 1e-3))                 # fast: half the lr, no decay
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    Args:
      shared_tx: the ``optax.GradientTransformation`` for every parameter that
        is not a fast weight.
      fast_tx: the one for the fast weights ``r`` and ``s``.

    Returns:
      An ``optax.GradientTransformation`` (``optax.multi_transform``).
    """
    import optax

    return optax.multi_transform({SHARED: shared_tx, FAST: fast_tx}, fast_weight_labels)
