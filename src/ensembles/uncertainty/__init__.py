"""Predictive statistics and metrics of an ensemble, from its members' outputs.

A classifier's functions (:mod:`ensembles.uncertainty.classification`) take
the members' logits as one ``[E, B, C]`` array (members, examples, classes),
the layout :func:`ensembles.untile` gives a model's member-major ``[E*B, C]``
outputs. The ensemble's prediction is the mean of the member softmaxes, the
predictive ``p(y | x) = 1/E sum_k p_k(y | x)``. A regressor's functions
(:mod:`ensembles.uncertainty.regression`) take the members' means and
standard deviations ``[E, B]`` or ``[E, B, D]`` and score their exact
uniform mixture; one-output logits ``[E, B, 1]`` are refused by every
classification function, which would otherwise return a constant (a softmax
over one class), and the error names the regression functions. Both kinds
rank scores with :func:`auroc`, :func:`aupr` and :func:`fpr_at_tpr` and
perturb held-out inputs with :func:`noisy_copies`. Every public name of the
two sub-packages is here too. The rest of this page is about classifiers.

Its uncertainty splits into two parts::

    total_entropy       =  expected_entropy  +  mutual_information
    H[1/E sum_k p_k]    =  1/E sum_k H[p_k]  +  I(y; member)
    (total)                (aleatoric)           (epistemic)

``expected_entropy`` is the noise every member sees in the data (high where the
classes overlap); ``mutual_information`` is how much the members disagree, the
part more data or more training would remove. It is non-negative (entropy is
concave) and is the usual score for out-of-distribution detection, ranked by
:func:`auroc`, :func:`aupr` (average precision) and :func:`fpr_at_tpr` (the
false-positive rate at, say, 95% true positives).

Against labels, :func:`nll`, :func:`accuracy` and :func:`brier` score the
predictive; :func:`ece`, :func:`adaptive_ece` (equal-mass bins) and :func:`mce`
(the worst bin) its calibration; :func:`aurc` and :func:`augrc` its selective
prediction, the risk of answering only the most confident examples.
:func:`fit_temperature` and :func:`scale_temperature` recalibrate the
predictive with one temperature fitted on held-out examples;
:func:`fit_ensemble_temperature` (Mix-n-Match) and
:func:`fit_adaptive_temperature` (a clean and a hard temperature blended by
each example's uncertainty), with their ``scale_`` twins, calibrate for in
distribution and shift at once;
:func:`fit_vector_scaling`, :func:`fit_dirichlet_scaling` and
:func:`fit_isotonic` (with their ``apply_`` twins) go beyond it, of the
pooled predictive or of each member. :func:`fit_conformal_threshold` and
:func:`conformal_sets` give split-conformal prediction sets (LAC, APS,
RAPS), :func:`set_size` and :func:`set_coverage` measure them. Beside the
entropies, :func:`max_probability_score`, :func:`margin_score`,
:func:`max_logit_score` and :func:`energy_score` score each example for
out-of-distribution detection (higher is less sure), and :func:`aurc` and
:func:`augrc` rank by any of them with ``scores=``. Where confidences tie,
the sort-based metrics average over the orders of the tie, so no result
depends on the order of the batch.

Everything is computed in log space (``log_softmax``, ``logsumexp`` over members
minus ``log E``) in at least float32, so bf16 logits and logits of +-1e4 give
finite, accurate results, and ``0 * log 0`` counts as 0. All functions can be
wrapped in :func:`jax.jit`; ``num_bins`` of :func:`ece`, :func:`adaptive_ece` and
:func:`mce` and ``tpr`` of :func:`fpr_at_tpr` are then static.

Bad input never gives a finite answer. An example's logits are *invalid* when
some member's row holds a NaN or a ``+inf``, or is ``-inf`` for every class (no
distribution at all); ``-inf`` for some classes is a valid mask and gives those
classes probability 0. Per-example scores are NaN for exactly the examples with
invalid logits (the other examples are computed as if those were absent); every
metric that aggregates over examples is NaN if any of them is invalid.
Labels may have any integer dtype (``uint8`` labels of 256 classes mean what
their values mean). Out-of-range labels raise a ``ValueError`` when their values
are known and make the metric NaN under :func:`jax.jit`; :func:`auroc`,
:func:`aupr` and :func:`fpr_at_tpr` are NaN if any score is NaN or infinite.
Eager or jitted, the result is the same NaN, never a finite number that looks
like a confident answer. An argument that is not an array at all (``None``, a
string) raises a ``TypeError`` that names it.

>>> import jax.numpy as jnp
>>> from ensembles import uncertainty
>>> sure_and_agreeing = jnp.array([[[9.0, 0.0]], [[9.0, 0.0]]])
>>> sure_and_disagreeing = jnp.array([[[9.0, 0.0]], [[0.0, 9.0]]])
>>> logits = jnp.concatenate([sure_and_agreeing, sure_and_disagreeing], axis=1)
>>> logits.shape  # [E, B, C]
(2, 2, 2)
>>> uncertainty.mutual_information(logits).round(2)
Array([0.  , 0.69], dtype=float32)
"""

from __future__ import annotations

from ensembles.uncertainty.classification import (
    accuracy,
    adaptive_ece,
    apply_dirichlet_scaling,
    apply_isotonic,
    apply_vector_scaling,
    augrc,
    aurc,
    brier,
    conformal_sets,
    disagreement,
    ece,
    energy_score,
    expected_entropy,
    fit_adaptive_temperature,
    fit_conformal_threshold,
    fit_dirichlet_scaling,
    fit_ensemble_temperature,
    fit_isotonic,
    fit_member_temperatures,
    fit_temperature,
    fit_vector_scaling,
    margin_score,
    max_logit_score,
    max_probability_score,
    mce,
    mutual_information,
    nll,
    pairwise_disagreement,
    pairwise_kl,
    predictive_probs,
    scale_adaptive_temperature,
    scale_ensemble_temperature,
    scale_member_temperatures,
    scale_temperature,
    set_coverage,
    set_size,
    total_entropy,
    variance,
)
from ensembles.uncertainty.ood import (
    aupr,
    auroc,
    fpr_at_tpr,
)
from ensembles.uncertainty.perturbations import noisy_copies
from ensembles.uncertainty.regression import (
    aleatoric_variance,
    conformal_interval,
    conformal_mixture_interval,
    crps,
    epistemic_variance,
    fit_conformal_margin,
    fit_conformal_quantile,
    fit_member_std_scales,
    fit_spread_scales,
    fit_std_scale,
    interval_coverage,
    interval_score,
    interval_width,
    mae,
    mixture_cdf,
    mixture_interval,
    mixture_log_density,
    mixture_mean,
    mixture_nll,
    mixture_quantile,
    mixture_variance,
    moment_matched_nll,
    pairwise_gaussian_kl,
    pit_calibration_error,
    rmse,
    scale_member_stds,
    scale_spread,
    scale_std,
    spread_error_correlation,
)

__all__ = [
    "accuracy",
    "adaptive_ece",
    "aleatoric_variance",
    "apply_dirichlet_scaling",
    "apply_isotonic",
    "apply_vector_scaling",
    "augrc",
    "aupr",
    "aurc",
    "auroc",
    "brier",
    "conformal_interval",
    "conformal_mixture_interval",
    "conformal_sets",
    "crps",
    "disagreement",
    "ece",
    "energy_score",
    "epistemic_variance",
    "expected_entropy",
    "fit_adaptive_temperature",
    "fit_conformal_margin",
    "fit_conformal_quantile",
    "fit_conformal_threshold",
    "fit_dirichlet_scaling",
    "fit_ensemble_temperature",
    "fit_isotonic",
    "fit_member_std_scales",
    "fit_member_temperatures",
    "fit_spread_scales",
    "fit_std_scale",
    "fit_temperature",
    "fit_vector_scaling",
    "fpr_at_tpr",
    "interval_coverage",
    "interval_score",
    "interval_width",
    "mae",
    "margin_score",
    "max_logit_score",
    "max_probability_score",
    "mce",
    "mixture_cdf",
    "mixture_interval",
    "mixture_log_density",
    "mixture_mean",
    "mixture_nll",
    "mixture_quantile",
    "mixture_variance",
    "moment_matched_nll",
    "mutual_information",
    "nll",
    "noisy_copies",
    "pairwise_disagreement",
    "pairwise_gaussian_kl",
    "pairwise_kl",
    "pit_calibration_error",
    "predictive_probs",
    "rmse",
    "scale_adaptive_temperature",
    "scale_ensemble_temperature",
    "scale_member_stds",
    "scale_member_temperatures",
    "scale_spread",
    "scale_std",
    "scale_temperature",
    "set_coverage",
    "set_size",
    "spread_error_correlation",
    "total_entropy",
    "variance",
]
