"""The pieces of the BatchEnsemble training recipe users would hand-write.

A BatchEnsemble trains on one member-major ``[E*B, ...]`` batch, rows
``[k*B, (k+1)*B)`` member ``k``'s. What each member sees is either the same
``B`` examples (:func:`ensembles.tile`, the standard recipe) or ``B`` examples
of its own (:func:`member_batches`), and the loss is the mean of the members'
losses (:func:`cross_entropy`; for regression :func:`gaussian_nll` of a
mean-and-spread head, :func:`gaussian_head`, or :func:`mse` of point
members), so that each member's own parameters get the gradient of its own
loss and the shared ones the average over members. A
model with rank-1 Bayesian fast weights (``posterior="gaussian"``) adds its
:func:`kl_divergence` over the training-set size (``docs/rank1.md``). See
``docs/training.md`` and ``docs/regression.md``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import graph as nnx_graph

from ensembles._checks import (
    as_array,
    as_real_array,
    check_labels,
    check_member_batch,
    check_num_members,
    check_positive_int,
    check_real,
)
from ensembles.layers.base import BatchEnsembleModule
from ensembles.layers.posterior import layer_kl
from ensembles.members import tile

__all__ = [
    "cross_entropy",
    "gaussian_head",
    "gaussian_nll",
    "kl_divergence",
    "member_batches",
    "mse",
]


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
    if logits.shape[1] == 1:
        raise ValueError(
            f"`logits` has one class (shape {tuple(logits.shape)}): the softmax "
            f"cross entropy of one class is 0 whatever the model predicts, so it "
            f"has no gradient. For a regression model train on "
            f"`training.gaussian_nll` (a mean-and-spread head, "
            f"`training.gaussian_head`) or `training.mse`; for a binary "
            f"classifier give the head two logits."
        )
    labels = check_labels(
        labels,
        logits.shape[1],
        hint=": for one-hot labels pass `labels.argmax(-1)`; real-valued targets "
        "are a regression problem: train on `training.gaussian_nll` or "
        "`training.mse`",
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


def gaussian_head(outputs: jax.Array, *, min_std: float = 1e-3) -> tuple:
    """Splits a Gaussian head's outputs into means and standard deviations.

    A regression model with a mean-and-spread head ends in a layer of two
    outputs per target (``nnx.Linear(hidden, 2)`` for one target): the last
    axis holds ``(mean, raw spread)``. The standard deviation is
    ``softplus(raw) + min_std``, positive and floored, so that the NLL of an
    overfitting member cannot fall without bound as its variance collapses
    (Lakshminarayanan et al., 2017, add 1e-6 to the variance). Works on a
    model's member-major ``[E*B, ..., 2]`` outputs and on the ``[E, B, ...,
    2]`` outputs of :class:`ensembles.Ensemble` alike; ``to_batch_ensemble``
    converts the head's layer like any other.

    >>> import jax.numpy as jnp
    >>> import ensembles
    >>> outputs = jnp.array([[1.5, 0.0], [-2.0, 10.0]])  # [N, 2]
    >>> means, stds = ensembles.training.gaussian_head(outputs, min_std=0.0)
    >>> means, stds.round(4)  # softplus(0) = log 2
    (Array([ 1.5, -2. ], dtype=float32), Array([ 0.6931, 10.    ], dtype=float32))

    Args:
      outputs: ``[..., 2]``: a mean and a raw spread per target (D targets:
        ``[..., D, 2]``, e.g. ``outputs.reshape(N, D, 2)``).
      min_std: the floor added to every standard deviation, ``>= 0``, in the
        targets' units (the default suits standardised targets).

    Returns:
      ``(means, stds)``, each ``outputs.shape[:-1]``, in the outputs' dtype
      promoted to at least float32.

    Raises:
      ValueError: if the last axis is not of size 2, or ``min_std`` is not
        finite and ``>= 0``.
      TypeError: if ``outputs`` is not a floating-point array.
    """
    outputs = as_array(outputs, "outputs")
    if not jnp.issubdtype(outputs.dtype, jnp.floating):
        raise TypeError(
            f"`outputs` must be a floating-point array, got dtype {outputs.dtype}."
        )
    if outputs.ndim < 1 or outputs.shape[-1] != 2:
        raise ValueError(
            f"`outputs` must end in an axis of size 2, (mean, raw spread), got "
            f"shape {tuple(outputs.shape)}: give the model's head 2 outputs per "
            f"target (`nnx.Linear(hidden, 2)`; for D targets 2 * D outputs, "
            f"reshaped to [..., D, 2])."
        )
    min_std = check_real(min_std, "min_std")
    if not 0 <= min_std < math.inf:
        raise ValueError(
            f"`min_std` must be finite and >= 0, got {min_std}: a floor in the "
            f"targets' units, e.g. 1e-3 for standardised targets."
        )
    outputs = outputs.astype(jnp.promote_types(outputs.dtype, jnp.float32))
    return outputs[..., 0], jax.nn.softplus(outputs[..., 1]) + min_std


def _regression_rows(
    values: Any, name: str, targets: Any, num_members: int
) -> tuple[jax.Array, jax.Array]:
    """``values`` and ``targets`` as member-major ``[E*B(, D)]`` rows.

    The targets say what one example's targets are, ``[]`` or ``[D]``; the
    values are member-major ``[E*B(, D)]`` (as many axes as the targets) or
    ``[E, B(, D)]`` (one more); the targets are ``[B(, D)]`` (a tiled batch:
    tiled here) or ``[E*B(, D)]``.
    """
    values = as_array(values, name)
    targets = as_real_array(targets, "targets", what="an array of real targets")
    if not jnp.issubdtype(values.dtype, jnp.floating):
        raise TypeError(
            f"`{name}` must be a floating-point array, got dtype {values.dtype}."
        )
    if targets.dtype == jnp.bool_ or not (
        jnp.issubdtype(targets.dtype, jnp.floating)
        or jnp.issubdtype(targets.dtype, jnp.integer)
    ):
        raise TypeError(f"`targets` must hold real numbers, got dtype {targets.dtype}.")
    if targets.ndim not in (1, 2):
        raise ValueError(
            f"`targets` must be [B] or [B, D] (a tiled batch's), or [E*B] or "
            f"[E*B, D], got shape {tuple(targets.shape)}."
        )
    example = tuple(targets.shape[1:])
    shape = tuple(values.shape)
    if values.ndim == targets.ndim + 1:
        if shape[0] != num_members or shape[2:] != example:
            ending = (
                f"end in the targets' output axes {example}"
                if example
                else "have no axis after B (the targets have no output axis)"
            )
            raise ValueError(
                f"`{name}` of shape {shape} read as [E, B{', D' if example else ''}] "
                f"must have E = num_members = {num_members} members on axis 0 and "
                f"{ending}."
            )
        values = values.reshape(-1, *example)
    elif values.ndim != targets.ndim or shape[1:] != example:
        raise ValueError(
            f"`{name}` must be member-major [E*B{', D' if example else ''}] or "
            f"[E, B{', D' if example else ''}] to match `targets` of shape "
            f"{tuple(targets.shape)}, got shape {shape}."
        )
    batch = check_member_batch(values.shape[0], num_members, name=f"{name}.shape[0]")
    if targets.shape[0] == batch and num_members > 1:
        targets = tile(targets, num_members)
    elif targets.shape[0] != values.shape[0]:
        raise ValueError(
            f"`targets` must have {batch} rows (a tiled batch) or {values.shape[0]} "
            f"(member-major batches) to match `{name}` with num_members="
            f"{num_members}, got shape {tuple(targets.shape)}."
        )
    dtype = jnp.promote_types(values.dtype, jnp.float32)
    return values.astype(dtype), targets.astype(dtype)


def gaussian_nll(
    means: jax.Array,
    stds: jax.Array,
    targets: jax.Array,
    *,
    num_members: int,
    beta: float = 0.0,
) -> jax.Array:
    """The mean over members of each member's Gaussian NLL: the regression loss.

    Member ``k``'s loss is its mean over examples of ``log sigma + (y -
    mu)^2 / (2 sigma^2) + log(2 pi) / 2`` (summed over D outputs), and the
    loss is the mean over members, as :func:`cross_entropy`'s. With ``beta >
    0`` every term is weighted by ``stop_gradient(sigma^2) ** beta``, the
    beta-NLL of Seitzer et al. (2022): plain NLL (``beta = 0``) lets examples
    of large predicted variance stop contributing to the mean's fit; ``beta =
    1`` gives the mean the gradient of a squared error; 0.5 is their
    recommendation. Means and standard deviations are a model's
    member-major ``[E*B]`` (``[E*B, D]``) outputs or ``[E, B]`` (``[E, B,
    D]``), e.g. from :func:`gaussian_head`; targets are ``[B]`` (``[B, D]``)
    of a tiled batch (tiled here) or ``[E*B]`` of member-major batches.
    Computed in at least float32.

    >>> import jax.numpy as jnp
    >>> import ensembles
    >>> means = jnp.array([0.0, 1.0, 0.0, 3.0])     # E = 2 members, B = 2
    >>> stds = jnp.ones(4)
    >>> targets = jnp.array([0.0, 1.0])              # the tiled batch's
    >>> loss = ensembles.training.gaussian_nll(means, stds, targets, num_members=2)
    >>> round(float(loss), 4)  # log(2 pi) / 2 + (0 + 0 + 0 + 4) / (2 * 4)
    1.4189

    Args:
      means: ``[E*B(, D)]`` member-major or ``[E, B(, D)]`` predicted means.
      stds: their standard deviations, positive, of the same shape.
      targets: ``[B(, D)]`` (tiled batch) or ``[E*B(, D)]`` real targets.
      num_members: the ensemble size E.
      beta: the beta-NLL exponent in ``[0, 1]``; 0 is the plain NLL.

    Returns:
      The scalar loss (NaN if a standard deviation is not positive).

    Raises:
      ValueError: if the shapes do not match as above or ``beta`` is outside
        ``[0, 1]``.
      TypeError: if an argument is not an array of the right kind.
    """
    num_members = check_num_members(num_members)
    beta = check_real(beta, "beta")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(
            f"`beta` must lie in [0, 1] (0: the plain NLL, 0.5: Seitzer et al.'s "
            f"recommendation), got {beta}."
        )
    stds = as_array(stds, "stds")
    if tuple(stds.shape) != tuple(jnp.shape(means)):
        raise ValueError(
            f"`stds` must have the shape of `means`, {tuple(jnp.shape(means))}, got "
            f"{tuple(stds.shape)}."
        )
    means, targets = _regression_rows(means, "means", targets, num_members)
    stds = stds.reshape(means.shape)
    stds = stds.astype(means.dtype)
    safe = jnp.where(stds > 0, stds, 1.0)
    nll = (
        jnp.log(safe)
        + 0.5 * jnp.square((targets - means) / safe)
        + 0.5 * jnp.log(2 * jnp.pi)
    )
    nll = jnp.where(stds > 0, nll, jnp.nan)
    if beta:
        nll = nll * jax.lax.stop_gradient(jnp.square(stds)) ** beta
    per_row = nll if nll.ndim == 1 else jnp.sum(nll, axis=-1)
    return jnp.mean(per_row)


def mse(means: jax.Array, targets: jax.Array, *, num_members: int) -> jax.Array:
    """The mean over members of each member's mean squared error: point members.

    The loss of TabM's recipe (each member fits the targets on its own, "the
    mean loss, not the loss of the mean"): the mean over every member,
    example and output of ``(y - mu_k)^2``. The members' predictive is then
    their empirical distribution (``stds=None`` in
    :mod:`ensembles.uncertainty`), whose only spread is their disagreement.
    Layouts as for :func:`gaussian_nll`; computed in at least float32.

    >>> import jax.numpy as jnp
    >>> import ensembles
    >>> means = jnp.array([0.0, 1.0, 0.0, 3.0])     # E = 2 members, B = 2
    >>> float(ensembles.training.mse(means, jnp.array([0.0, 1.0]), num_members=2))
    1.0

    Args:
      means: ``[E*B(, D)]`` member-major or ``[E, B(, D)]`` predictions.
      targets: ``[B(, D)]`` (tiled batch) or ``[E*B(, D)]`` real targets.
      num_members: the ensemble size E.

    Returns:
      The scalar loss.

    Raises:
      ValueError: if the shapes do not match.
      TypeError: if an argument is not an array of the right kind.
    """
    num_members = check_num_members(num_members)
    means, targets = _regression_rows(means, "means", targets, num_members)
    return jnp.mean(jnp.square(targets - means))


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
