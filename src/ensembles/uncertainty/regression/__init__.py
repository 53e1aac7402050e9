"""A regression ensemble's uncertainty, from its members' means and spreads.

Each name is :mod:`ensembles.uncertainty`'s too;
:mod:`~ensembles.uncertainty.regression.mixture` states the contract.
"""

from __future__ import annotations

from ensembles.uncertainty.regression.calibration import (
    fit_member_std_scales,
    fit_std_scale,
    scale_member_stds,
    scale_std,
)
from ensembles.uncertainty.regression.conformal import (
    conformal_interval,
    conformal_mixture_interval,
    fit_conformal_margin,
    fit_conformal_quantile,
)
from ensembles.uncertainty.regression.metrics import (
    crps,
    interval_coverage,
    interval_score,
    interval_width,
    mae,
    mixture_nll,
    moment_matched_nll,
    pit_calibration_error,
    rmse,
    spread_error_correlation,
)
from ensembles.uncertainty.regression.mixture import (
    aleatoric_variance,
    epistemic_variance,
    mixture_cdf,
    mixture_interval,
    mixture_log_density,
    mixture_mean,
    mixture_quantile,
    mixture_variance,
    pairwise_gaussian_kl,
)
from ensembles.uncertainty.regression.spread_calibration import (
    fit_spread_scales,
    scale_spread,
)

__all__ = [
    "aleatoric_variance",
    "conformal_interval",
    "conformal_mixture_interval",
    "crps",
    "epistemic_variance",
    "fit_conformal_margin",
    "fit_conformal_quantile",
    "fit_member_std_scales",
    "fit_spread_scales",
    "fit_std_scale",
    "interval_coverage",
    "interval_score",
    "interval_width",
    "mae",
    "mixture_cdf",
    "mixture_interval",
    "mixture_log_density",
    "mixture_mean",
    "mixture_nll",
    "mixture_quantile",
    "mixture_variance",
    "moment_matched_nll",
    "pairwise_gaussian_kl",
    "pit_calibration_error",
    "rmse",
    "scale_member_stds",
    "scale_spread",
    "scale_std",
    "spread_error_correlation",
]
