"""A classifier ensemble's uncertainty, from its members' logits ``[E, B, C]``.

Each name is :mod:`ensembles.uncertainty`'s too, whose page states the contract.
"""

from __future__ import annotations

from ensembles.uncertainty.classification.calibration import (
    fit_member_temperatures,
    fit_temperature,
    scale_member_temperatures,
    scale_temperature,
)
from ensembles.uncertainty.classification.calibrators import (
    apply_dirichlet_scaling,
    apply_vector_scaling,
    fit_dirichlet_scaling,
    fit_vector_scaling,
)
from ensembles.uncertainty.classification.conformal_sets import (
    conformal_sets,
    fit_conformal_threshold,
    set_coverage,
    set_size,
)
from ensembles.uncertainty.classification.ensemble_calibration import (
    fit_adaptive_temperature,
    fit_ensemble_temperature,
    scale_adaptive_temperature,
    scale_ensemble_temperature,
)
from ensembles.uncertainty.classification.isotonic import (
    apply_isotonic,
    fit_isotonic,
)
from ensembles.uncertainty.classification.metrics import (
    accuracy,
    adaptive_ece,
    augrc,
    aurc,
    brier,
    ece,
    mce,
    nll,
)
from ensembles.uncertainty.classification.ood_scores import (
    energy_score,
    margin_score,
    max_logit_score,
    max_probability_score,
)
from ensembles.uncertainty.classification.scores import (
    disagreement,
    expected_entropy,
    mutual_information,
    pairwise_disagreement,
    pairwise_kl,
    predictive_probs,
    total_entropy,
    variance,
)

__all__ = [
    "accuracy",
    "adaptive_ece",
    "apply_dirichlet_scaling",
    "apply_isotonic",
    "apply_vector_scaling",
    "augrc",
    "aurc",
    "brier",
    "conformal_sets",
    "disagreement",
    "ece",
    "energy_score",
    "expected_entropy",
    "fit_adaptive_temperature",
    "fit_conformal_threshold",
    "fit_dirichlet_scaling",
    "fit_ensemble_temperature",
    "fit_isotonic",
    "fit_member_temperatures",
    "fit_temperature",
    "fit_vector_scaling",
    "margin_score",
    "max_logit_score",
    "max_probability_score",
    "mce",
    "mutual_information",
    "nll",
    "pairwise_disagreement",
    "pairwise_kl",
    "predictive_probs",
    "scale_adaptive_temperature",
    "scale_ensemble_temperature",
    "scale_member_temperatures",
    "scale_temperature",
    "set_coverage",
    "set_size",
    "total_entropy",
    "variance",
]
