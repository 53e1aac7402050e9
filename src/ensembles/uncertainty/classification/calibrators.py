"""Calibrators beyond one temperature: vector scaling and Dirichlet scaling.

One temperature rescales every class alike. These fit a class-wise map of
the log-probabilities ``z = log p``, ``softmax(f(z))``, on held-out
examples by minimising the regularised NLL (a convex problem, solved by
L-BFGS to the dtype's precision):

* vector scaling (Guo et al., 2017): ``f(z)_c = w_c z_c + b_c``, ``2 C``
  parameters;
* Dirichlet scaling (Kull et al., 2019): ``f(z) = W z + b``, the matrix
  scaling of the log-probabilities, ``C (C + 1)`` parameters, with their
  off-diagonal and intercept regularisation (ODIR).

The penalties added to the mean NLL: ``scale_penalty * mean_c (w_c -
1)^2`` (``W``'s diagonal for Dirichlet scaling), ``bias_penalty * mean_c
b_c^2`` and, for Dirichlet scaling, ``off_diagonal_penalty * mean_{i != j}
W_ij^2``. The scale penalty is ours, not Kull et al.'s: on a held-out set
where a class is never wrong the NLL falls without end as its scale grows
(one temperature is bounded for the same reason), and a scale of hundreds
fitted there is a test NLL of tens.

Both start from the identity map (the predictive as it is), and every step of
the fit lowers the objective, so the fitted map is never worse than none on
the examples it was fitted on. ``members=False`` fits one map of the pooled
predictive ``p = 1/E sum_k p_k`` (pool, then calibrate; applied, it returns
one member's log-probabilities ``[1, B, C]``); ``members=True`` one map per
member's softmax (calibrate, then pool; applied, ``[E, B, C]``, which every
function of :mod:`ensembles.uncertainty` pools). The non-parametric
calibrator is :func:`~ensembles.uncertainty.fit_isotonic`.

Classes the predictive rules out (probability 0) stay ruled out. A fit is
NaN if any held-out example has invalid logits (see
:mod:`ensembles.uncertainty`), or a label its predictive rules out; applied,
a map gives NaN rows for invalid examples.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ensembles._checks import as_array, check_bool, check_positive_int, check_real
from ensembles.uncertainty._minimize import minimize
from ensembles.uncertainty.classification._common import (
    _check_labels,
    _check_logits,
    _member_log_probs,
    _predictive_log_probs,
    _split_invalid,
    _split_invalid_labeled,
)

#: The default weights of the penalties (see the module), chosen on the
#: quality benchmark's MNIST-1D (300 held-out examples; four methods' test
#: NLL) and checked on digits, where they keep every fit near one
#: temperature's (without the scale penalty, vector scaling of a nearly
#: separable held-out set drove scales to 500 and the test NLL from 0.07 to 17).
SCALE_PENALTY: float = 0.1
OFF_DIAGONAL_PENALTY: float = 10.0
BIAS_PENALTY: float = 0.1


def calibration_inputs(logits: jax.Array, members: bool) -> jax.Array:
    """``[E, B, C]`` member log-probabilities, or ``[1, B, C]`` the predictive's."""
    member = _member_log_probs(logits)
    return member if members else _predictive_log_probs(member)[None]


def _vector_map(z, scales, biases):
    possible = z > -jnp.inf
    scaled = jnp.where(possible, z, 0.0) * scales[None] + biases[None]
    return jnp.where(possible, scaled, -jnp.inf)


def _dirichlet_map(z, weights, biases):
    possible = z > -jnp.inf
    # A ruled-out class enters the matrix as the log of the smallest normal
    # number, not -inf (which would make every class's output infinite).
    floor = jnp.log(jnp.finfo(z.dtype).tiny)
    mapped = jnp.maximum(z, floor) @ weights.T + biases[None]
    return jnp.where(possible, mapped, -jnp.inf)


def _unpack(kind: str, params: jax.Array, num_classes: int):
    if kind == "vector":
        return params[:num_classes], params[num_classes:]
    split = num_classes * num_classes
    return params[:split].reshape(num_classes, num_classes), params[split:]


def _objective(kind, z, labels, scale_penalty, off_diagonal_penalty, bias_penalty):
    """The regularised mean NLL of one map's flat parameters, on ``[B, C]``."""
    num_classes = z.shape[-1]
    mapping = _vector_map if kind == "vector" else _dirichlet_map
    off_diagonal = 1.0 - jnp.eye(num_classes, dtype=z.dtype)

    def objective(params):
        first, biases = _unpack(kind, params, num_classes)
        mapped = mapping(z, first, biases)
        label_logit = jnp.take_along_axis(mapped, labels[:, None], axis=-1)[:, 0]
        nll = jnp.mean(jax.nn.logsumexp(mapped, axis=-1) - label_logit)
        scales = first if kind == "vector" else jnp.diagonal(first)
        penalty = scale_penalty * jnp.mean(jnp.square(scales - 1))
        penalty += bias_penalty * jnp.mean(jnp.square(biases))
        if kind == "dirichlet" and num_classes > 1:
            square = jnp.sum(jnp.square(first) * off_diagonal)
            penalty += off_diagonal_penalty * square / (num_classes * (num_classes - 1))
        return nll + penalty

    return objective


@functools.partial(jax.jit, static_argnames=("kind", "members", "iterations"))
def _fit(logits, labels, penalties, kind, members, iterations):
    logits, labels, invalid = _split_invalid_labeled(logits, labels)
    inputs = calibration_inputs(logits, members)  # [M, B, C]
    num_classes = inputs.shape[-1]
    dtype = inputs.dtype
    if kind == "vector":
        start = jnp.concatenate([jnp.ones(num_classes, dtype), jnp.zeros(num_classes)])
    else:
        start = jnp.concatenate(
            [jnp.eye(num_classes, dtype=dtype).reshape(-1), jnp.zeros(num_classes)]
        )
    penalties = [jnp.asarray(penalty, dtype) for penalty in penalties]

    def fit_one(z):
        objective = _objective(kind, z, labels, *penalties)
        return minimize(objective, start.astype(dtype), iterations)

    params = jax.vmap(fit_one)(inputs)  # [M, P]
    label_possible = jnp.take_along_axis(inputs, labels[None, :, None], axis=-1) > (
        -jnp.inf
    )
    bad = jnp.any(invalid) | ~jnp.all(label_possible, axis=(1, 2))  # [M]
    params = jnp.where(bad[:, None], jnp.nan, params)
    first, biases = jax.vmap(lambda p: _unpack(kind, p, num_classes))(params)
    if not members:
        first, biases = first[0], biases[0]
    return first, biases


def _check_penalty(value: Any, name: str) -> float:
    value = check_real(value, name)
    if not 0 <= value < float("inf"):
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value}.")
    return value


def _fit_checked(logits, labels, members, iterations):
    logits = _check_logits(logits)
    labels = _check_labels(labels, logits)
    members = check_bool(members, "members")
    iterations = check_positive_int(iterations, "iterations")
    return logits, labels, members, iterations


def fit_vector_scaling(
    logits: jax.Array,
    labels: jax.Array,
    *,
    members: bool = False,
    scale_penalty: float = SCALE_PENALTY,
    bias_penalty: float = BIAS_PENALTY,
    iterations: int = 200,
) -> tuple[jax.Array, jax.Array]:
    """Vector scaling's ``(scales, biases)``: ``softmax(w * log p + b)``.

    Fitted on held-out examples (never the test set you report) by
    minimising the NLL plus ``scale_penalty * mean_c (w_c - 1)^2 +
    bias_penalty * mean_c b_c^2``, from ``w = 1, b = 0``; apply it with
    :func:`apply_vector_scaling`. See
    :mod:`~ensembles.uncertainty.classification.calibrators`.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> keys = jax.random.split(jax.random.key(0), 2)
    >>> logits = 3 * jax.random.normal(keys[0], (4, 500, 3))  # E=4, B=500, C=3
    >>> labels = jax.random.categorical(keys[1], logits.mean(0) / 3)
    >>> scales, biases = uncertainty.fit_vector_scaling(logits, labels)
    >>> scales.shape, biases.shape
    ((3,), (3,))
    >>> scaled = uncertainty.apply_vector_scaling(logits, scales, biases)
    >>> scaled.shape  # the calibrated predictive, as one member's [1, B, C]
    (1, 500, 3)
    >>> bool(uncertainty.nll(scaled, labels) < uncertainty.nll(logits, labels))
    True

    Args:
      logits: held-out member logits ``[E, B, C]``.
      labels: their integer classes ``[B]``, in ``[0, C)``.
      members: one map per member, of its own softmax (static under
        :func:`jax.jit`).
      scale_penalty: the weight of the scales' mean square distance from 1,
        ``>= 0``.
      bias_penalty: the weight of the biases' mean square, ``>= 0``.
      iterations: the most L-BFGS steps (static); the fit stops sooner once
        converged.

    Returns:
      ``(scales, biases)``, each ``[C]`` (``[E, C]`` with ``members``), in
      the logits' compute dtype (at least float32); NaN if a held-out example
      has invalid logits, a label its predictive rules out or, under
      :func:`jax.jit`, a label outside ``[0, C)``.

    Raises:
      ValueError: if the shapes do not match ``[E, B, C]`` and ``[B]``, a known
        label lies outside ``[0, C)``, or an option is out of range.
      TypeError: if ``logits`` is not floating-point, ``labels`` not integer,
        or an option of the wrong type.
    """
    logits, labels, members, iterations = _fit_checked(
        logits, labels, members, iterations
    )
    penalties = (
        _check_penalty(scale_penalty, "scale_penalty"),
        0.0,
        _check_penalty(bias_penalty, "bias_penalty"),
    )
    return _fit(logits, labels, penalties, "vector", members, iterations)


def fit_dirichlet_scaling(
    logits: jax.Array,
    labels: jax.Array,
    *,
    members: bool = False,
    scale_penalty: float = SCALE_PENALTY,
    off_diagonal_penalty: float = OFF_DIAGONAL_PENALTY,
    bias_penalty: float = BIAS_PENALTY,
    iterations: int = 200,
) -> tuple[jax.Array, jax.Array]:
    """Dirichlet scaling's ``(weights, biases)``: ``softmax(W log p + b)``.

    Dirichlet calibration (Kull et al., 2019), fitted on held-out examples by
    minimising the NLL plus its ODIR regularisation,
    ``off_diagonal_penalty * mean_{i != j} W_ij^2 + bias_penalty * mean_c
    b_c^2``, and ``scale_penalty * mean_c (W_cc - 1)^2``, from ``W = I, b =
    0``; apply it with :func:`apply_dirichlet_scaling`. Its ``C^2`` weights
    can learn which classes the model confuses; the penalties keep them from
    fitting noise where held-out examples are few.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> keys = jax.random.split(jax.random.key(0), 2)
    >>> logits = 3 * jax.random.normal(keys[0], (4, 500, 3))
    >>> labels = jax.random.categorical(keys[1], logits.mean(0) / 3)
    >>> weights, biases = uncertainty.fit_dirichlet_scaling(logits, labels)
    >>> weights.shape, biases.shape
    ((3, 3), (3,))
    >>> calibrated = uncertainty.apply_dirichlet_scaling(logits, weights, biases)
    >>> bool(uncertainty.nll(calibrated, labels) < uncertainty.nll(logits, labels))
    True

    Args:
      logits: held-out member logits ``[E, B, C]``.
      labels: their integer classes ``[B]``, in ``[0, C)``.
      members: one map per member, of its own softmax (static under
        :func:`jax.jit`).
      scale_penalty: the weight of the diagonal's mean square distance
        from 1, ``>= 0``.
      off_diagonal_penalty: the weight of the off-diagonal weights' mean
        square, ``>= 0``.
      bias_penalty: the weight of the biases' mean square, ``>= 0``.
      iterations: the most L-BFGS steps (static); the fit stops sooner once
        converged.

    Returns:
      ``(weights, biases)``, ``[C, C]`` and ``[C]`` (``[E, C, C]`` and
      ``[E, C]`` with ``members``); NaN where :func:`fit_vector_scaling`'s
      would be.

    Raises:
      ValueError: as :func:`fit_vector_scaling`.
      TypeError: as :func:`fit_vector_scaling`.
    """
    logits, labels, members, iterations = _fit_checked(
        logits, labels, members, iterations
    )
    penalties = (
        _check_penalty(scale_penalty, "scale_penalty"),
        _check_penalty(off_diagonal_penalty, "off_diagonal_penalty"),
        _check_penalty(bias_penalty, "bias_penalty"),
    )
    return _fit(logits, labels, penalties, "dirichlet", members, iterations)


def check_fitted(
    logits: jax.Array,
    arrays: tuple[tuple[Any, str, tuple[int, ...]], ...],
    fit: str,
) -> tuple[list[jax.Array], bool]:
    """A fitted calibrator's arrays checked against ``logits``, as floats.

    Each of ``arrays`` is ``(value, name, trailing shape)``: its shape must be
    the trailing shape (a pooled fit) or ``[E, *trailing]`` (``members=True``),
    the same for all. Known values must be finite.

    Returns:
      The arrays in the logits' compute dtype, and whether they are per member.
    """
    num_members = logits.shape[0]
    compute = jnp.promote_types(logits.dtype, jnp.float32)
    checked, per_member = [], set()
    for value, name, trailing in arrays:
        array = as_array(value, name, what=f"what `{fit}` returns")
        if array.dtype == jnp.bool_ or not (
            jnp.issubdtype(array.dtype, jnp.floating)
            or jnp.issubdtype(array.dtype, jnp.integer)
        ):
            raise TypeError(f"`{name}` must be real numbers, got dtype {array.dtype}.")
        shape = tuple(array.shape)
        if shape not in (trailing, (num_members, *trailing)):
            raise ValueError(
                f"`{name}` must have shape {trailing} (a pooled fit) or "
                f"{(num_members, *trailing)} (members=True) for `logits` of shape "
                f"{tuple(logits.shape)}, got {shape}: pass what `{fit}` returns "
                f"for logits of these classes and members."
            )
        per_member.add(shape != trailing)
        try:
            values = np.asarray(array, np.float64)
        except (
            jax.errors.TracerArrayConversionError,
            jax.errors.ConcretizationTypeError,
        ):
            values = None
        if values is not None and not np.isfinite(values).all():
            bad = int(values.size - np.isfinite(values).sum())
            raise ValueError(
                f"`{name}` must be finite, got {bad} non-finite entries: the fit "
                f"(`{fit}`) saw invalid logits or labels."
            )
        checked.append(array.astype(compute))
    if len(per_member) > 1:
        raise ValueError(
            f"{', '.join(f'`{name}`' for _, name, _ in arrays)} must all be pooled "
            f"or all per member (members=True): pass what one `{fit}` returned."
        )
    return checked, per_member.pop()


@functools.partial(jax.jit, static_argnames=("kind", "members"))
def _apply(logits, first, biases, kind, members):
    logits, invalid = _split_invalid(logits)
    inputs = calibration_inputs(logits, members)
    if not members:
        first, biases = first[None], biases[None]
    mapping = _vector_map if kind == "vector" else _dirichlet_map
    mapped = jax.vmap(mapping)(inputs, first, biases)
    log_probs = jax.nn.log_softmax(mapped, axis=-1)
    broken = ~(jnp.all(jnp.isfinite(first)) & jnp.all(jnp.isfinite(biases)))
    return jnp.where(broken | invalid[None, :, None], jnp.nan, log_probs)


def apply_vector_scaling(
    logits: jax.Array, scales: jax.Array, biases: jax.Array
) -> jax.Array:
    """The log-probabilities of a fitted vector scaling, ``log_softmax(w z + b)``.

    ``z`` is the pooled predictive's log-probabilities for a pooled fit, or
    each member's for one fitted with ``members=True`` (told by the shapes).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25]]]))  # E=1, B=1, C=3
    >>> scaled = uncertainty.apply_vector_scaling(
    ...     logits, jnp.array([2.0, 1.0, 1.0]), jnp.zeros(3))
    >>> jnp.exp(scaled).round(3)  # 0.25 : 0.25 : 0.25 renormalised
    Array([[[0.333, 0.333, 0.333]]], dtype=float32)

    Args:
      logits: member logits ``[E, B, C]``.
      scales: ``[C]`` from :func:`fit_vector_scaling` (``[E, C]`` per member).
      biases: ``[C]`` (``[E, C]``).

    Returns:
      ``[1, B, C]`` log-probabilities of the calibrated predictive (``[E, B,
      C]``, each member calibrated, for a per-member fit), in at least
      float32; NaN rows for invalid examples, and all NaN for a non-finite
      parameter under :func:`jax.jit`.

    Raises:
      ValueError: if the shapes do not fit ``[E, B, C]`` logits or (when
        known) a parameter is not finite.
      TypeError: if ``logits`` is not floating-point or a parameter not real.
    """
    logits = _check_logits(logits)
    num_classes = logits.shape[-1]
    (scales, biases), members = check_fitted(
        logits,
        (
            (scales, "scales", (num_classes,)),
            (biases, "biases", (num_classes,)),
        ),
        "fit_vector_scaling",
    )
    return _apply(logits, scales, biases, "vector", members)


def apply_dirichlet_scaling(
    logits: jax.Array, weights: jax.Array, biases: jax.Array
) -> jax.Array:
    """The log-probabilities of a fitted Dirichlet scaling, ``log_softmax(W z + b)``.

    ``z`` as for :func:`apply_vector_scaling`; a class the predictive rules
    out stays ruled out, and enters the product as the log of the dtype's
    smallest normal number.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25]]]))
    >>> swap = jnp.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    >>> calibrated = uncertainty.apply_dirichlet_scaling(logits, swap, jnp.zeros(3))
    >>> jnp.exp(calibrated).round(3)  # classes 0 and 1 swapped
    Array([[[0.25, 0.5 , 0.25]]], dtype=float32)

    Args:
      logits: member logits ``[E, B, C]``.
      weights: ``[C, C]`` from :func:`fit_dirichlet_scaling` (``[E, C, C]``
        per member).
      biases: ``[C]`` (``[E, C]``).

    Returns:
      As :func:`apply_vector_scaling`.

    Raises:
      ValueError: as :func:`apply_vector_scaling`.
      TypeError: as :func:`apply_vector_scaling`.
    """
    logits = _check_logits(logits)
    num_classes = logits.shape[-1]
    (weights, biases), members = check_fitted(
        logits,
        (
            (weights, "weights", (num_classes, num_classes)),
            (biases, "biases", (num_classes,)),
        ),
        "fit_dirichlet_scaling",
    )
    return _apply(logits, weights, biases, "dirichlet", members)
