"""The pieces of the BatchEnsemble training recipe users would hand-write.

A BatchEnsemble trains on one member-major ``[E*B, ...]`` batch, rows
``[k*B, (k+1)*B)`` member ``k``'s. What each member sees is either the same
``B`` examples (:func:`ensembles.tile`, the standard recipe) or ``B`` examples
of its own (:func:`member_batches`), and the loss is the mean of the members'
losses (:func:`cross_entropy`), so that each member's own parameters get the
gradient of its own loss and the shared ones the average over members. A
model with rank-1 Bayesian fast weights (``posterior="gaussian"``) adds its
:func:`kl_divergence` over the training-set size (``docs/rank1.md``). See
``docs/training.md``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import graph as nnx_graph

from ensembles._checks import (
    as_array,
    check_labels,
    check_member_batch,
    check_num_members,
    check_positive_int,
)
from ensembles.layers.base import BatchEnsembleModule
from ensembles.layers.posterior import layer_kl
from ensembles.members import tile

__all__ = ["cross_entropy", "kl_divergence", "member_batches"]


def cross_entropy(
    logits: jax.Array, labels: jax.Array, *, num_members: int
) -> jax.Array:
    """The mean over members of each member's mean softmax cross entropy.

    ``logits`` are a model's member-major ``[E*B, C]`` outputs, or the
    ``[E, B, C]`` member logits of :class:`ensembles.Ensemble` (or of
    :func:`ensembles.untile`). ``labels`` are either the ``[B]`` labels of a
    tiled batch (every member saw the same examples; they are tiled here, the
    step users forget) or the ``[E*B]`` labels of member-major batches such as
    :func:`member_batches` draws. The loss is computed in at least float32,
    whatever the logits' dtype.

    >>> import jax.numpy as jnp
    >>> import ensembles
    >>> logits = jnp.array([[2.0, 0.0], [0.0, 2.0],     # member 0, B = 2
    ...                     [2.0, 0.0], [2.0, 0.0]])    # member 1
    >>> labels = jnp.array([0, 1])                      # the tiled batch's
    >>> loss = ensembles.training.cross_entropy(logits, labels, num_members=2)
    >>> round(float(loss), 4)   # members' means 0.1269 and 1.1269
    0.6269
    >>> float(ensembles.training.cross_entropy(
    ...     logits.reshape(2, 2, 2), labels, num_members=2)) == float(loss)
    True

    Args:
      logits: ``[E*B, C]`` member-major logits or ``[E, B, C]`` member logits.
      labels: integer class indices of any integer dtype, ``[B]`` (tiled
        batch) or ``[E*B]``.
      num_members: the ensemble size E.

    Returns:
      The scalar loss. Labels outside ``[0, C)`` raise a ``ValueError`` when
      their values are known and make the loss NaN under :func:`jax.jit`.

    Raises:
      ValueError: if the shapes do not match as above, or a known label is out
        of range.
      TypeError: if ``logits`` or ``labels`` are not arrays (e.g. ``None``),
        or ``labels`` not integers.
    """
    num_members = check_num_members(num_members)
    logits = as_array(logits, "logits")
    if logits.ndim == 3:
        if logits.shape[0] != num_members:
            raise ValueError(
                f"`logits` of shape {tuple(logits.shape)} read as [E, B, C] must "
                f"have E = num_members = {num_members} members on axis 0."
            )
        logits = logits.reshape(-1, logits.shape[-1])
    elif logits.ndim != 2:
        raise ValueError(
            f"`logits` must be member-major [E*B, C] or [E, B, C], got shape "
            f"{tuple(logits.shape)}."
        )
    batch = check_member_batch(logits.shape[0], num_members, name="logits.shape[0]")
    labels = check_labels(
        labels, logits.shape[1], hint=": for one-hot labels pass `labels.argmax(-1)`"
    )
    if labels.shape == (batch,) and num_members > 1:
        labels = tile(labels, num_members)
    elif labels.shape != (logits.shape[0],):
        raise ValueError(
            f"`labels` must have shape [B] = ({batch},) (a tiled batch) or "
            f"[E*B] = ({logits.shape[0]},) (member-major batches) to match "
            f"`logits` with num_members={num_members}, got shape "
            f"{tuple(labels.shape)}."
        )
    num_classes = logits.shape[1]
    # Out-of-range labels (negative ones too, which a gather would wrap) pick
    # the fill value: the loss is NaN, never a finite wrong number.
    labels = jnp.where((labels < 0) | (labels >= num_classes), num_classes, labels)
    dtype = jnp.promote_types(logits.dtype, jnp.float32)
    log_probs = jax.nn.log_softmax(logits.astype(dtype), axis=-1)
    picked = jnp.take_along_axis(
        log_probs, labels[:, None], axis=-1, mode="fill", fill_value=jnp.nan
    )[:, 0]
    # Every member has B rows, so the mean over all rows is the mean of the
    # members' means.
    return -jnp.mean(picked)


def member_batches(
    key: jax.Array, num_examples: int, *, batch_size: int, num_members: int
) -> jax.Array:
    """Indices of E independent batches, one per member, member-major.

    Member ``k`` gets ``batch_size`` examples drawn without replacement from
    ``range(num_examples)``, independently of the other members (as each
    member of a deep ensemble would): ``x[indices]`` is an ``[E*B, ...]``
    batch whose rows ``[k*B, (k+1)*B)`` are member ``k``'s. Each member's
    batch is the ``batch_size`` largest of ``num_examples`` uniform random
    keys (``jax.lax.top_k``; a uniformly random subset, in random order), so a
    call costs ``O(E * num_examples)`` and no sort: about 0.4 ms for E = 4 of
    8,000 examples on a 2-core CPU, where one ``jax.random.permutation`` per
    member takes 13 ms.

    >>> import jax
    >>> import ensembles
    >>> indices = ensembles.training.member_batches(
    ...     jax.random.key(0), 10, batch_size=3, num_members=2)
    >>> indices.shape, str(indices.dtype)
    ((6,), 'int32')
    >>> len(set(indices[:3].tolist())), len(set(indices[3:].tolist()))
    (3, 3)

    Args:
      key: a JAX random key.
      num_examples: the size of the data set.
      batch_size: examples per member, B (at most ``num_examples``).
      num_members: the ensemble size E.

    Returns:
      An int32 ``[E*B]`` array of indices.

    Raises:
      ValueError: if ``batch_size`` exceeds ``num_examples`` or a size is
        not a positive int.
      TypeError: if ``key`` is not a JAX random key (e.g. ``None``).
    """
    num_members = check_num_members(num_members)
    num_examples = check_positive_int(num_examples, "num_examples")
    batch_size = check_positive_int(batch_size, "batch_size")
    if batch_size > num_examples:
        raise ValueError(
            f"`batch_size` (={batch_size}) must be at most `num_examples` "
            f"(={num_examples}): each member draws without replacement."
        )
    key = as_array(key, "key", what="a JAX random key (e.g. `jax.random.key(0)`)")
    keys = jax.random.uniform(key, (num_members, num_examples))
    _, indices = jax.lax.top_k(keys, batch_size)
    return indices.reshape(-1).astype(jnp.int32)


def kl_divergence(model: Any) -> jax.Array:
    """The KL divergence of every rank-1 layer's fast weights to their prior.

    The sum, over every BatchEnsemble layer of ``model`` built with a
    ``posterior`` (a layer shared by several paths counted once), of the KL of
    its ``r`` and ``s`` posteriors to the prior centred on 1 with scale
    ``prior_stddev``: exact closed forms for Gaussians and Cauchys (see
    :func:`ensembles.ops.posterior.fast_weight_kl`). Differentiable (take it
    inside ``nnx.grad``); 0 for a model without posteriors. The rank-1 loss
    is ``cross_entropy(...) + kl_divergence(model) / num_train_examples``
    (``docs/rank1.md``).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.BatchEnsembleLinear(
    ...     3, 2, num_members=4, posterior="gaussian", rngs=nnx.Rngs(0))
    >>> float(ensembles.kl_divergence(layer)) > 0
    True
    >>> plain = ensembles.BatchEnsembleLinear(3, 2, num_members=4,
    ...                                       rngs=nnx.Rngs(0))
    >>> float(ensembles.kl_divergence(plain))
    0.0

    Args:
      model: any NNX module (or graph of modules).

    Returns:
      A float32 (float64 for float64 parameters) scalar.

    Raises:
      TypeError: if ``model`` is not an NNX graph node (a module, ``nnx.List``,
        ...).
    """
    if isinstance(model, nnx.Variable) or not nnx_graph.is_graph_node(model):
        raise TypeError(
            f"`model` must be an NNX module (or graph of modules) holding "
            f"BatchEnsemble layers, got {type(model).__name__}."
        )
    terms = [
        layer_kl(node)
        for _, node in nnx.iter_graph(model)
        if isinstance(node, BatchEnsembleModule) and node.posterior is not None
    ]
    return sum(terms, start=jnp.zeros((), jnp.float32))
