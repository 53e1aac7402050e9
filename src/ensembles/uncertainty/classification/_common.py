"""Private helpers of :mod:`ensembles.uncertainty.classification`.

Input checks (logits, labels), the log-space probability helpers, the marking
of invalid examples (:func:`_split_invalid`) whose results are poisoned with
NaN (:func:`_poison`; an aggregate's: the shared ``poison_all``), and the
tie-averaged running count (:func:`_tie_averaged_cumsum`) of the sort-based
metrics.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import as_array, check_labels

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


def _probabilities(logits: jax.Array, members: bool) -> jax.Array:
    """``[E, B, C]`` member softmaxes, or ``[B, C]`` the predictive."""
    probs = _member_probs(logits)
    return probs if members else jnp.mean(probs, axis=0)
