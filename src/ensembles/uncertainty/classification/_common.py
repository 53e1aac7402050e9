"""Private helpers shared by :mod:`ensembles.uncertainty`'s scores and metrics.

Input checks (logits, labels, scores), the log-space probability helpers, the
marking of invalid examples (:func:`_split_invalid`) whose results are poisoned
with NaN (:func:`_poison`, :func:`_poison_all`), and the tie-averaged running
count (:func:`_tie_averaged_cumsum`) of the sort-based metrics.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import dtypes

from ensembles._checks import as_array, check_array, check_labels

# --------------------------------------------------------------------------- checks


def _check_logits(logits: jax.Array) -> jax.Array:
    """Returns ``logits`` as an array after checking it is floating ``[E, B, C]``."""
    logits = as_array(logits, "logits")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(
            f"`logits` must be a floating-point array, got dtype {logits.dtype}: "
            "pass the model's raw outputs, or cast them with "
            "`logits.astype(jnp.float32)`."
        )
    shape = tuple(logits.shape)
    if len(shape) != 3:
        if len(shape) == 2:
            fix = (
                "If these are a model's member-major [E*B, C] outputs, split them "
                "with `ensembles.untile(logits, E)`."
            )
        elif len(shape) > 3:
            fix = (
                "Fold the extra axes into the batch axis: "
                f"`logits.reshape({shape[0]}, -1, {shape[-1]})`."
            )
        else:
            fix = "Give one row of class logits per member and example."
        raise ValueError(
            "`logits` must have shape [E, B, C] (members, examples, classes), "
            f"got shape {shape} ({len(shape)}-D). {fix}"
        )
    if 0 in shape:
        raise ValueError(
            "`logits` must have at least one member, example and class, "
            f"got shape {shape} (E={shape[0]}, B={shape[1]}, C={shape[2]})."
        )
    if shape[2] == 1:
        raise ValueError(ONE_OUTPUT_ERROR.format(name="logits", shape=shape))
    return logits


#: What a classification function says of one-output predictions, where a
#: softmax over one "class" is 1 for every member: every score would be a
#: constant (variance and mutual information 0) while the members disagree.
ONE_OUTPUT_ERROR = (
    "`{name}` has one class (shape {shape}): a softmax over one class is 1 for "
    "every member, so every classification score of it would be a constant "
    "(no variance, no disagreement) whatever the members predict. These "
    "functions are for classifiers' logits [E, B, C] with C >= 2. One output "
    "per example is a regression prediction: score the members' means (and "
    "standard deviations) with ensembles.uncertainty's regression functions, "
    "e.g. `uncertainty.epistemic_variance({name}[..., 0])`, "
    "`mixture_variance`, `crps`, `mixture_nll`, `rmse` (docs/regression.md). "
    "A binary classifier's one sigmoid logit: pass two classes, "
    "`jnp.concatenate([jnp.zeros_like({name}), {name}], axis=-1)`."
)


def _float_label_hint(labels) -> str:
    """What to say of float labels: a cast for class indices, else regression."""
    try:
        values = np.asarray(labels)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        values = None
    dtype = getattr(labels, "dtype", None) if values is None else values.dtype
    # jnp's test, not numpy's: numpy does not count bfloat16 as floating.
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return ": for one-hot labels pass `labels.argmax(-1)`"
    if values is not None:
        values = values.astype(np.float64)
    if values is not None and np.all(
        np.isfinite(values) & (values == np.round(values))
    ):
        return (
            ": these hold whole numbers, so if they are class indices pass "
            "`labels.astype(jnp.int32)` (one-hot labels: `labels.argmax(-1)`)"
        )
    return (
        ": these are classification metrics of class indices; real-valued "
        "targets are a regression problem, scored by ensembles.uncertainty's "
        "regression functions (`crps`, `mixture_nll`, `rmse`, ...; "
        "docs/regression.md)"
    )


def _check_labels(labels: jax.Array, logits: jax.Array) -> jax.Array:
    """Returns ``labels`` as an int ``[B]`` array matching ``[E, B, C]`` logits."""
    num_examples, num_classes = logits.shape[1], logits.shape[2]
    # Out-of-range labels would be silently clipped or filled by the gathers
    # below; check_labels raises for them whenever their values are known.
    labels = check_labels(labels, num_classes, hint=_float_label_hint(labels))
    if tuple(labels.shape) != (num_examples,):
        raise ValueError(
            f"`labels` must have shape [B] = ({num_examples},) to match `logits` "
            f"of shape {tuple(logits.shape)} ([E, B, C]), got shape "
            f"{tuple(labels.shape)}."
        )
    return labels


def _check_scores(scores: jax.Array, name: str) -> jax.Array | np.ndarray:
    """Returns ``scores`` as a non-empty real 1-D array, in their own dtype.

    A numpy array (or list) stays numpy: ``jnp.asarray`` would truncate
    64-bit scores without x64, and :func:`_joint_ranks` ranks known scores
    with numpy.
    """
    scores = check_array(scores, name)
    if hasattr(scores, "__jax_array__"):
        scores = jnp.asarray(scores)
    elif not isinstance(scores, jax.Array):
        scores = np.asarray(scores)
    if not (
        jnp.issubdtype(scores.dtype, jnp.floating)
        or jnp.issubdtype(scores.dtype, jnp.integer)
        or jnp.issubdtype(scores.dtype, jnp.bool_)
    ):
        raise TypeError(
            f"`{name}` must hold real-valued scores, got dtype {scores.dtype}."
        )
    if len(scores.shape) != 1:
        raise ValueError(
            f"`{name}` must be a 1-D array of per-example scores, got shape "
            f"{tuple(scores.shape)}: flatten it with `{name}.reshape(-1)`."
        )
    if scores.shape[0] == 0:
        raise ValueError(
            f"`{name}` must hold at least one score, got an empty array: ranking "
            "needs both in-distribution and out-of-distribution examples."
        )
    return scores


def _joint_ranks(
    in_scores: jax.Array | np.ndarray, out_scores: jax.Array | np.ndarray
) -> tuple[jax.Array, jax.Array, jax.Array, np.dtype]:
    """Both sets of scores as int32 ranks in their joint order, exactly.

    A score's rank is the number of scores (of either set) strictly below it,
    so equal scores share a rank and any two scores compare as their ranks
    do: the OOD metrics count with the ranks. Known scores are ranked by
    numpy in the dtype numpy concatenates them to (as scikit-learn compares
    them): integers as integers, float64 as float64, whatever
    ``jax_enable_x64`` says. Traced scores (under :func:`jax.jit`) are ranked
    in the dtype JAX promotes the two arrays to, which is where the two can
    differ: JAX holds 64-bit inputs as 32-bit without x64, and compares int32
    with float32 scores in float32.

    Returns:
      ``(in_ranks, out_ranks, unranked, dtype)``: ``unranked`` is True if some
      score is NaN or infinite; ``dtype`` is the metrics' float dtype (float64
      for float64 scores under x64, else float32).
    """
    dtype = jnp.promote_types(
        jnp.promote_types(
            dtypes.canonicalize_dtype(in_scores.dtype),
            dtypes.canonicalize_dtype(out_scores.dtype),
        ),
        jnp.float32,
    )
    num_in = in_scores.shape[0]
    try:
        parts = [np.asarray(in_scores), np.asarray(out_scores)]
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        parts = None
    if parts is not None:
        # bfloat16 and narrower floats are exact in float32, which numpy sorts.
        parts = [
            p
            if p.dtype == np.bool_ or np.issubdtype(p.dtype, np.number)
            else p.astype(np.float32)
            for p in parts
        ]
        joint = np.concatenate(parts)
        ranks = np.searchsorted(np.sort(joint), joint, side="left").astype(np.int32)
        unranked = not np.isfinite(joint).all()
        return (
            jnp.asarray(ranks[:num_in]),
            jnp.asarray(ranks[num_in:]),
            jnp.asarray(unranked),
            dtype,
        )
    common = jnp.promote_types(in_scores.dtype, out_scores.dtype)
    if common == jnp.bool_:
        common = jnp.int32
    joint = jnp.concatenate([in_scores.astype(common), out_scores.astype(common)])
    ranks = jnp.searchsorted(jnp.sort(joint), joint, side="left").astype(jnp.int32)
    unranked = ~jnp.all(jnp.isfinite(joint))
    return ranks[:num_in], ranks[num_in:], unranked, dtype


# ------------------------------------------------------------------------- helpers

# Each public function validates in Python (shapes, and label values when they
# are known) and then makes one call to a jitted private twin: an eager call
# compiles once per shape instead of dispatching a dozen ops, and under an outer
# jit the twin simply inlines.


def _at_least_float32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _member_log_probs(logits: jax.Array) -> jax.Array:
    """``[E, B, C]`` log-softmax of each member, in at least float32."""
    return jax.nn.log_softmax(_at_least_float32(logits), axis=-1)


def _member_probs(logits: jax.Array) -> jax.Array:
    """``[E, B, C]`` softmax of each member, in at least float32."""
    return jax.nn.softmax(_at_least_float32(logits), axis=-1)


def _predictive_log_probs(member_log_probs: jax.Array) -> jax.Array:
    """``[B, C]`` log of the mean member softmax, never leaving log space."""
    num_members = member_log_probs.shape[0]
    # A class every member rules out (-inf, e.g. a masked logit) is -inf; the
    # where keeps logsumexp's 0/0 out of the gradient for it.
    ruled_out = jnp.all(member_log_probs == -jnp.inf, axis=0)
    safe = jnp.where(ruled_out[None], 0.0, member_log_probs)
    log_probs = jax.nn.logsumexp(safe, axis=0) - math.log(num_members)
    return jnp.where(ruled_out, -jnp.inf, log_probs)


def _invalid_examples(logits: jax.Array) -> jax.Array:
    """``[B]`` booleans: True where some member's logits give no distribution.

    That is a NaN or ``+inf`` anywhere in the member's row (softmax would
    return NaN, or ``exp`` overflow would pick a class by accident), or a row
    that is ``-inf`` for every class. A ``-inf`` next to finite logits is a
    masked class and stays valid.
    """
    broken = jnp.isnan(logits) | (logits == jnp.inf)
    rules_out_all = jnp.all(logits == -jnp.inf, axis=-1)
    return jnp.any(jnp.any(broken, axis=-1) | rules_out_all, axis=0)


def _split_invalid(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns ``(logits with invalid examples zeroed, [B] invalid mask)``.

    Zeroing them keeps NaN out of the valid examples' values and gradients; the
    caller then poisons the invalid examples' results with :func:`_poison`.
    """
    invalid = _invalid_examples(logits)
    return jnp.where(invalid[None, :, None], 0.0, logits), invalid


def _poison(values: jax.Array, invalid: jax.Array) -> jax.Array:
    """NaN where ``invalid`` ([B], broadcast over trailing axes) is True."""
    invalid = invalid.reshape(invalid.shape + (1,) * (values.ndim - invalid.ndim))
    return jnp.where(invalid, jnp.nan, values)


def _poison_all(value: jax.Array, invalid: jax.Array) -> jax.Array:
    """``value`` (an aggregate over examples), or NaN if any example is invalid."""
    return jnp.where(jnp.any(invalid), jnp.nan, value)


def _split_invalid_labeled(
    logits: jax.Array, labels: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`_split_invalid`, also marking out-of-range labels invalid.

    Out-of-range labels raise eagerly (:func:`_check_labels`); under ``jit``
    their values are unknown, so they reach here and poison the metric. They
    are replaced by class 0 so that no gather clips or fills them silently.
    """
    logits, invalid = _split_invalid(logits)
    bad_label = (labels < 0) | (labels >= logits.shape[-1])
    return logits, jnp.where(bad_label, 0, labels), invalid | bad_label


def _entropy(log_probs: jax.Array) -> jax.Array:
    """Entropy over the last axis, with ``0 * log 0 = 0`` (also in gradients)."""
    probs = jnp.exp(log_probs)
    positive = probs > 0
    # The inner where keeps -inf out of the product, so that neither the value
    # nor its gradient becomes 0 * inf = nan for classes of probability zero.
    safe_log_probs = jnp.where(positive, log_probs, 0.0)
    return -jnp.sum(jnp.where(positive, probs * safe_log_probs, 0.0), axis=-1)


def _predictive_probs_unchecked(logits: jax.Array) -> jax.Array:
    return jnp.mean(_member_probs(logits), axis=0)


def _confidence_and_correct(
    logits: jax.Array, labels: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns ``[B]`` confidences, ``[B]`` int32 correctness, ``[B]`` invalid.

    The confidence is the predictive's largest probability, correct where its
    argmax is the label; the mask is :func:`_split_invalid_labeled`'s.
    """
    logits, labels, invalid = _split_invalid_labeled(logits, labels)
    probs = _predictive_probs_unchecked(logits)
    correct = (jnp.argmax(probs, axis=-1) == labels).astype(jnp.int32)
    return jnp.max(probs, axis=-1), correct, invalid


def _tie_averaged_cumsum(
    sorted_keys: jax.Array, counts: jax.Array, dtype: jnp.dtype
) -> jax.Array:
    """Running sum of ``counts`` along ascending ``sorted_keys``, ties averaged.

    Entry ``i`` is the mean, over every order of the examples whose keys tie,
    of ``sum(counts[:i + 1])``: the exact integer sum up to the start of
    ``i``'s tie group plus a linear share of the group's total. It depends on
    the keys and on each group's total only, never on the order within a tie.
    """
    num = sorted_keys.shape[0]
    start = jnp.searchsorted(sorted_keys, sorted_keys, side="left")
    end = jnp.searchsorted(sorted_keys, sorted_keys, side="right")
    through = jnp.concatenate([jnp.zeros(1, counts.dtype), jnp.cumsum(counts)])
    before, group_total = through[start], through[end] - through[start]
    taken = jnp.arange(1, num + 1) - start  # of the group, up to and with i
    share = taken.astype(dtype) * group_total.astype(dtype) / (end - start)
    return before.astype(dtype) + share


def conformal_rank(count: int, level: float) -> int:
    """The split-conformal order statistic: ``ceil((count + 1) level)``.

    The product is rounded to 9 decimals first, so that a level meant
    exactly (``0.7`` of ``count + 1 = 10`` is 7, where float64 gives
    ``7.000000000000001``) is not one example more conservative.
    """
    return math.ceil(round((count + 1) * level, 9))
