"""Scores of a regression ensemble's predictive against targets, in their units.

Each takes the members' means and standard deviations ``[E, B]`` or
``[E, B, D]`` (``stds=None``: point members) and the targets ``[B]`` or
``[B, D]``, scores the members' exact mixture
(:mod:`~ensembles.uncertainty.regression.mixture`) and returns one number, the mean
over examples (and outputs), or NaN if any entry is invalid:

- accuracy of its mean: :func:`rmse`, :func:`mae`;
- proper scores of the whole predictive: :func:`mixture_nll` (and, labelled
  as such, :func:`moment_matched_nll`, the NLL of the Gaussian with the
  mixture's mean and variance), :func:`crps` (closed form, in the targets'
  units);
- calibration: :func:`pit_calibration_error` (how far the targets' PIT
  values are from uniform, for any mixture, no quantile function needed);
- intervals at a level: :func:`interval_coverage`, :func:`interval_width`,
  :func:`interval_score` (Winkler's);
- ranking: :func:`spread_error_correlation`, how well the predicted spread
  orders the errors.

See :mod:`ensembles.uncertainty` for the contract they share.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ensembles.uncertainty._common import check_level, poison_all
from ensembles.uncertainty.regression import _common as reg


def _checked(means, stds, targets):
    means, stds = reg.check_members(means, stds)
    return means, stds, reg.check_targets(targets, means)


@jax.jit
def _mixture_nll(means, stds, targets):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    return poison_all(-jnp.mean(reg.mixture_log_density(means, stds, targets)), invalid)


def mixture_nll(means: jax.Array, stds: jax.Array, targets: jax.Array) -> jax.Array:
    """Negative log-likelihood of the targets under the ensemble's exact mixture.

    ``-1/B sum_b log(1/E sum_k N(y_b; mu_kb, sigma_kb^2))``, by ``logsumexp``
    (:func:`~ensembles.uncertainty.mixture_log_density`; D outputs: their
    joint density). In nats, in the targets' units: standardised targets
    give an NLL lower by ``D log(std of y)``.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.array([[0.0], [0.0]]), jnp.array([[1.0], [1.0]])
    >>> uncertainty.mixture_nll(means, stds, jnp.array([0.0]))  # log sqrt(2 pi)
    Array(0.91893..., dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations (point members have no density: use
        :func:`moment_matched_nll` or :func:`crps`).
      targets: ``[B]`` or ``[B, D]``.

    Returns:
      The mean NLL, a scalar; NaN if any entry is invalid.

    Raises:
      ValueError: if the shapes do not match, or ``stds`` is ``None``.
      TypeError: if an argument is not a real array.
    """
    means, stds = reg.check_members(means, stds, "mixture_nll")
    return _mixture_nll(means, stds, reg.check_targets(targets, means))


@jax.jit
def _moment_matched_nll(means, stds, targets):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    # From the standard deviation, never the variance: spreads of 1e-25 have
    # a variance below float32's range.
    mean, sd = reg.mixture_std(means, stds)
    degenerate = sd <= 0
    safe = jnp.where(degenerate, 1.0, sd)
    z = (targets - mean) / safe
    nll = 0.5 * math.log(2 * math.pi) + jnp.log(safe) + 0.5 * jnp.square(z)
    nll = jnp.where(degenerate, jnp.inf, nll)
    per_example = nll if nll.ndim == 1 else jnp.sum(nll, axis=-1)
    return poison_all(jnp.mean(per_example), invalid)


def moment_matched_nll(
    means: jax.Array, stds: jax.Array | None, targets: jax.Array
) -> jax.Array:
    """NLL under the Gaussian with the mixture's mean and variance (not the mixture).

    The approximation of Lakshminarayanan et al. (2017): ``N(mu, v)`` with
    ``mu`` the mixture mean and ``v`` the :func:`mixture_variance`, each output
    on its own (D outputs: the sum of their NLLs). It is what peers report as
    an ensemble's NLL; :func:`mixture_nll` is the exact one (lower or higher:
    the mixture's shape matters where members disagree). Point members
    (``stds=None``) get a Gaussian of their disagreement.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.array([[-1.0], [1.0]]), jnp.array([[1.0], [1.0]])
    >>> targets = jnp.array([0.0])
    >>> uncertainty.moment_matched_nll(means, stds, targets).round(4)  # N(0, 2)
    Array(1.2655, dtype=float32)
    >>> uncertainty.mixture_nll(means, stds, targets).round(4)  # the mixture
    Array(1.4189, dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      targets: ``[B]`` or ``[B, D]``.

    Returns:
      The mean NLL, a scalar (``inf`` where the variance is 0: point members
      that agree); NaN if any entry is invalid.

    Raises:
      ValueError: if the shapes do not match.
      TypeError: if an argument is not a real array.
    """
    return _moment_matched_nll(*_checked(means, stds, targets))


@jax.jit
def _crps(means, stds, targets):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    return poison_all(jnp.mean(reg.mixture_crps(means, stds, targets)), invalid)


def crps(means: jax.Array, stds: jax.Array | None, targets: jax.Array) -> jax.Array:
    """Continuous ranked probability score of the exact mixture, in target units.

    ``CRPS(F, y) = int (F(t) - 1{y <= t})^2 dt = E|Y - y| - 1/2 E|Y - Y'|``
    in closed form for the uniform mixture of Gaussians (Grimit et al., 2006;
    for one member, Gneiting et al. 2005's Gaussian formula), for point
    members the CRPS of their empirical distribution. Lower is better; 0 only
    for a point mass on the target. It costs ``O(E^2)`` per entry.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> # One standard Gaussian at its mean: (sqrt(2) - 1) / sqrt(pi).
    >>> uncertainty.crps(jnp.zeros((1, 1)), jnp.ones((1, 1)), jnp.zeros(1))
    Array(0.23369..., dtype=float32)
    >>> uncertainty.crps(jnp.array([[0.0], [2.0]]), None, jnp.array([0.0]))
    Array(0.5, dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      targets: ``[B]`` or ``[B, D]``.

    Returns:
      The mean CRPS over examples and outputs, a scalar; NaN if any entry is
      invalid.

    Raises:
      ValueError: if the shapes do not match.
      TypeError: if an argument is not a real array.
    """
    return _crps(*_checked(means, stds, targets))


@functools.partial(jax.jit, static_argnames="squared")
def _error(means, stds, targets, squared):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    error = targets - jnp.mean(means, axis=0)
    if squared:
        value = reg.root_mean_square(error.reshape(-1), axis=0)
    else:
        value = jnp.mean(jnp.abs(error))
    return poison_all(value, invalid)


def rmse(means: jax.Array, stds: jax.Array | None, targets: jax.Array) -> jax.Array:
    """Root mean squared error of the mixture mean.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means = jnp.array([[0.0, 2.0], [2.0, 2.0]])  # mixture means 1, 2
    >>> uncertainty.rmse(means, None, jnp.array([0.0, 0.0]))  # sqrt((1 + 4) / 2)
    Array(1.58113..., dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None``; used only to mark
        invalid entries.
      targets: ``[B]`` or ``[B, D]``.

    Returns:
      The RMSE over examples and outputs, a scalar; NaN if any entry is
      invalid.

    Raises:
      ValueError: if the shapes do not match.
      TypeError: if an argument is not a real array.
    """
    return _error(*_checked(means, stds, targets), squared=True)


def mae(means: jax.Array, stds: jax.Array | None, targets: jax.Array) -> jax.Array:
    """Mean absolute error of the mixture mean.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means = jnp.array([[0.0, 2.0], [2.0, 2.0]])  # mixture means 1, 2
    >>> uncertainty.mae(means, None, jnp.array([0.0, 0.0]))
    Array(1.5, dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None``; used only to mark
        invalid entries.
      targets: ``[B]`` or ``[B, D]``.

    Returns:
      The MAE over examples and outputs, a scalar; NaN if any entry is
      invalid.

    Raises:
      ValueError: if the shapes do not match.
      TypeError: if an argument is not a real array.
    """
    return _error(*_checked(means, stds, targets), squared=False)


@jax.jit
def _pit_calibration_error(means, stds, targets):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    pit = jnp.sort(reg.mixture_cdf(means, stds, targets).reshape(-1))
    count = pit.shape[0]
    # The PIT values' empirical CDF is i/n on [u_(i), u_(i+1)) (u_(0) = 0,
    # u_(n+1) = 1); int_a^b |p - c| dp = G(b) - G(a) with G(x) = (x - c)|x - c|/2.
    edges = jnp.concatenate([jnp.zeros(1, pit.dtype), pit, jnp.ones(1, pit.dtype)])
    level = jnp.arange(count + 1, dtype=pit.dtype) / count

    def antiderivative(x):
        return 0.5 * (x - level) * jnp.abs(x - level)

    area = jnp.sum(antiderivative(edges[1:]) - antiderivative(edges[:-1]))
    return poison_all(area, invalid)


def pit_calibration_error(
    means: jax.Array, stds: jax.Array | None, targets: jax.Array
) -> jax.Array:
    """How far the targets' PIT values are from uniform: the miscalibration area.

    The area between the PIT values' empirical CDF and the diagonal,
    ``int_0^1 |P(F(y) <= p) - p| dp``, exactly (no bins): the share of
    targets below each predicted quantile against the quantile's level, over
    all levels, for any mixture (it needs only the CDF,
    :func:`~ensembles.uncertainty.mixture_cdf`). 0 for a calibrated predictive
    on infinitely many examples; at most 1/2. The limit of
    uncertainty-toolbox's mean absolute calibration error over ever more
    quantile levels. Entries of D outputs are pooled.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> targets = jax.random.normal(jax.random.key(0), (4000,))
    >>> means, right = jnp.zeros((1, 4000)), jnp.ones((1, 4000))
    >>> float(uncertainty.pit_calibration_error(means, right, targets)) < 0.01
    True
    >>> float(uncertainty.pit_calibration_error(means, 0.5 * right, targets)) > 0.1
    True

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      targets: ``[B]`` or ``[B, D]``.

    Returns:
      The area, a scalar in ``[0, 1/2]``; NaN if any entry is invalid.

    Raises:
      ValueError: if the shapes do not match.
      TypeError: if an argument is not a real array.
    """
    return _pit_calibration_error(*_checked(means, stds, targets))


@functools.partial(jax.jit, static_argnames=("level", "part"))
def _interval_metric(means, stds, targets, level, part):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    lower, upper = reg.central_interval(means, stds, level)
    if part == "coverage":
        value = jnp.mean(((targets >= lower) & (targets <= upper)).astype(lower.dtype))
    elif part == "width":
        value = jnp.mean(upper - lower)
    else:  # Winkler's interval score
        alpha = 1 - level
        below = jnp.maximum(lower - targets, 0.0)
        above = jnp.maximum(targets - upper, 0.0)
        value = jnp.mean(upper - lower + (2 / alpha) * (below + above))
    return poison_all(value, invalid)


def interval_coverage(
    means: jax.Array, stds: jax.Array | None, targets: jax.Array, level: float = 0.9
) -> jax.Array:
    """Share of targets inside the mixture's central interval at ``level``.

    The interval is :func:`~ensembles.uncertainty.mixture_interval`'s; a
    calibrated predictive covers ``level`` of the targets (the PICP of the
    literature).

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.zeros((1, 3)), jnp.ones((1, 3))
    >>> targets = jnp.array([0.0, 1.0, 3.0])  # the 90% interval: +-1.645
    >>> uncertainty.interval_coverage(means, stds, targets, level=0.9)
    Array(0.6666667, dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      targets: ``[B]`` or ``[B, D]``.
      level: the interval's share of the predictive, in ``(0, 1)``.

    Returns:
      The share, a scalar in ``[0, 1]``; NaN if any entry is invalid.

    Raises:
      ValueError: if the shapes do not match or ``level`` is not in ``(0, 1)``.
      TypeError: if an argument is not a real array.
    """
    level = check_level(level, reg.LEVEL_OF)
    return _interval_metric(*_checked(means, stds, targets), level, "coverage")


def interval_width(
    means: jax.Array, stds: jax.Array | None, level: float = 0.9
) -> jax.Array:
    """Mean width of the mixture's central intervals at ``level``: sharpness.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> uncertainty.interval_width(jnp.zeros((1, 2)), jnp.ones((1, 2)), level=0.9)
    Array(3.28970..., dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      level: the intervals' share of the predictive, in ``(0, 1)``.

    Returns:
      The mean width, a scalar in the targets' units; NaN if any entry is
      invalid.

    Raises:
      ValueError: if the shapes do not match or ``level`` is not in ``(0, 1)``.
      TypeError: if an argument is not a real array.
    """
    level = check_level(level, reg.LEVEL_OF)
    means, stds = reg.check_members(means, stds)
    return _interval_metric(means, stds, None, level, "width")


def interval_score(
    means: jax.Array, stds: jax.Array | None, targets: jax.Array, level: float = 0.9
) -> jax.Array:
    """Winkler's interval score of the central intervals at ``level``.

    ``(u - l) + 2/alpha (l - y) 1{y < l} + 2/alpha (y - u) 1{y > u}`` with
    ``alpha = 1 - level`` (Gneiting & Raftery, 2007): a proper score of an
    interval, rewarding narrow intervals and penalising misses by their
    distance. Lower is better, in the targets' units.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.zeros((1, 1)), jnp.ones((1, 1))  # interval +-1.645
    >>> uncertainty.interval_score(means, stds, jnp.array([2.0]), level=0.9)
    Array(10.3926..., dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      targets: ``[B]`` or ``[B, D]``.
      level: the intervals' share of the predictive, in ``(0, 1)``.

    Returns:
      The mean score, a scalar; NaN if any entry is invalid.

    Raises:
      ValueError: if the shapes do not match or ``level`` is not in ``(0, 1)``.
      TypeError: if an argument is not a real array.
    """
    level = check_level(level, reg.LEVEL_OF)
    return _interval_metric(*_checked(means, stds, targets), level, "score")


def _average_ranks(values: jax.Array) -> jax.Array:
    """Ranks 0..n-1 of ``values``, ties given the mean of their ranks."""
    ordered = jnp.sort(values)
    below = jnp.searchsorted(ordered, values, side="left")
    through = jnp.searchsorted(ordered, values, side="right")
    return (below + through - 1).astype(values.dtype) / 2


@jax.jit
def _spread_error_correlation(means, stds, targets):
    means, stds, targets, invalid = reg.split_invalid(means, stds, targets)
    mean, sd = reg.mixture_std(means, stds)  # ranks as the variance, unsquared
    spread = _average_ranks(sd.reshape(-1))
    error = _average_ranks(jnp.abs(targets - mean).reshape(-1))
    spread, error = spread - jnp.mean(spread), error - jnp.mean(error)
    # Each sum of squared ranks is about n^3 / 12: their product overflows
    # float32 beyond about 4 million entries, their roots' product does not.
    denominator = jnp.sqrt(jnp.sum(jnp.square(spread))) * jnp.sqrt(
        jnp.sum(jnp.square(error))
    )
    correlation = jnp.where(
        denominator > 0,
        jnp.sum(spread * error) / jnp.where(denominator > 0, denominator, 1.0),
        jnp.nan,
    )
    correlation = jnp.clip(correlation, -1.0, 1.0)  # the roots' rounding
    return poison_all(correlation, invalid)


def spread_error_correlation(
    means: jax.Array, stds: jax.Array | None, targets: jax.Array
) -> jax.Array:
    """Spearman's rank correlation of the predicted spread with the absolute error.

    The spread is the mixture's standard deviation (its variance ranks the
    same), the error ``|y - mixture mean|``; ties get the mean of their ranks,
    as in ``scipy.stats.spearmanr``. 1: the larger the predicted spread, the
    larger the error, always; around 0: the spread says nothing about which
    predictions to trust. Entries of D outputs are pooled.

    >>> import jax.numpy as jnp
    >>> from ensembles import uncertainty
    >>> means, stds = jnp.zeros((1, 3)), jnp.array([[1.0, 2.0, 3.0]])
    >>> uncertainty.spread_error_correlation(means, stds, jnp.array([0.1, -0.5, 2.0]))
    Array(1., dtype=float32)

    Args:
      means: the members' means, ``[E, B]`` or ``[E, B, D]``.
      stds: their standard deviations, or ``None`` (point members).
      targets: ``[B]`` or ``[B, D]``.

    Returns:
      The correlation, a scalar in ``[-1, 1]``; NaN if any entry is invalid
      or either the spreads or the errors are all equal.

    Raises:
      ValueError: if the shapes do not match.
      TypeError: if an argument is not a real array.
    """
    return _spread_error_correlation(*_checked(means, stds, targets))
