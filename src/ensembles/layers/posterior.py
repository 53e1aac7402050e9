"""Rank-1 Bayesian fast weights in a layer: plain functions the layers call.

A weight layer built with ``posterior="gaussian"`` (or ``"cauchy"``) keeps its
fast weights ``r`` and ``s`` as the posterior means and holds, beside them,
``r_unconstrained_stddev`` and ``s_unconstrained_stddev`` (``FastWeight`` objects of
the same shapes; the scales are their softplus) and an rng stream, as
``nnx.Dropout`` holds one; its constructor draws them with its other
parameters (:func:`ensembles.layers.weights.new_weights`), and
:meth:`~ensembles.layers.BatchEnsembleModule._fast_weights` draws on every
call that is not deterministic (and a call whose op raises takes its draw
back, so a failed call leaves the stream as it was). The math lives in
:mod:`ensembles.ops.posterior`.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from ensembles._checks import check_real
from ensembles.initializers import unconstrained_stddev
from ensembles.ops.posterior import POSTERIORS, fast_weight_kl

__all__ = [
    "DEFAULT_PRIOR_STDDEV",
    "check_posterior",
    "check_prior_stddev",
    "check_rng_collection",
    "default_stddev_init",
    "layer_kl",
]

#: The prior N(1, 0.5**2) on every fast weight: the leave-one-task-out choice
#: on MNIST-1D, digits and a tabular task (benchmarks/quality_defaults.py,
#: docs/rank1.md; 0.1, 0.3, 0.5 and 1.0 tried). uncertainty-baselines uses 0.1
#: (CIFAR-10/100, WRN-28-10), the worst of the four there.
DEFAULT_PRIOR_STDDEV = 0.5
default_stddev_init = unconstrained_stddev()


def check_posterior(posterior: Any) -> str | None:
    """Checks a layer's ``posterior``: ``None``, ``"gaussian"`` or ``"cauchy"``."""
    if posterior is None or (isinstance(posterior, str) and posterior in POSTERIORS):
        return posterior
    raise ValueError(
        f"`posterior` must be None (point fast weights: BatchEnsemble) or one of "
        f"{list(POSTERIORS)} (rank-1 Bayesian fast weights), got {posterior!r}."
    )


def check_prior_stddev(prior_stddev: Any) -> float:
    """Checks the prior's scale: a finite real number > 0."""
    prior_stddev = check_real(prior_stddev, "prior_stddev")
    if not (math.isfinite(prior_stddev) and prior_stddev > 0):
        raise ValueError(
            f"`prior_stddev` must be a finite float > 0 (the prior's scale), got "
            f"{prior_stddev!r}; uncertainty-baselines uses 0.1 on CIFAR."
        )
    return prior_stddev


def check_rng_collection(rng_collection: Any) -> str:
    """Checks the name of the rng stream the draws come from."""
    if not isinstance(rng_collection, str):
        raise TypeError(
            f"`rng_collection` must be a str naming an `nnx.Rngs` stream (e.g. "
            f"'posterior'), got {rng_collection!r} of type "
            f"{type(rng_collection).__name__}."
        )
    if not rng_collection:
        raise ValueError(
            "`rng_collection` must name an `nnx.Rngs` stream, got the empty "
            "string ''; pass e.g. 'posterior'."
        )
    return rng_collection


def layer_kl(layer: Any) -> jax.Array:
    """The KL divergence of one rank-1 layer's ``r`` and ``s`` to its prior."""
    return sum(
        fast_weight_kl(
            mean[...],
            unconstrained[...],
            posterior=layer.posterior,
            prior_stddev=layer.prior_stddev,
        )
        for mean, unconstrained in (
            (layer.r, layer.r_unconstrained_stddev),
            (layer.s, layer.s_unconstrained_stddev),
        )
    )
