"""Interleaved timing: machine drift hits every method alike.

Each round runs every function once, in turn, so a slow stretch of a shared
machine slows all methods of that round alike. ``ensembles-bench`` reports the
median of each method and ratios of those medians, so every ratio it prints
agrees with the times it prints; :func:`paired_ratio` (the median of per-round
ratios, more robust to drift) is there for scripts that want it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax

__all__ = ["interleaved_times", "median", "paired_ratio", "quartiles"]


def interleaved_times(
    fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Runs each function in turn, ``repeats`` rounds, and returns its wall times.

    Every call is followed by ``jax.block_until_ready`` on its result, so a time
    covers the whole computation and not just its dispatch. The ``warmup``
    calls of every function (compilation, caches) come first and are not timed.

    >>> import jax.numpy as jnp
    >>> from ensembles.benchmark import interleaved_times
    >>> x = jnp.ones((8, 8))
    >>> times = interleaved_times({"a": lambda: x @ x, "b": lambda: x + x}, 3)
    >>> sorted(times), len(times["a"]), min(times["b"]) > 0
    (['a', 'b'], 3, True)

    Args:
      fns: name -> a function of no arguments returning JAX arrays (a pytree).
      repeats: the number of timed rounds.
      warmup: untimed calls of every function before the first round.

    Returns:
      name -> the ``repeats`` wall times in seconds, in round order.
    """
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    """The median of ``values``.

    >>> from ensembles.benchmark import median
    >>> median([3.0, 1.0, 2.0])
    2.0

    Args:
      values: a non-empty list of numbers.

    Returns:
      The median.
    """
    return statistics.median(values)


def quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values`` (the spread around the median).

    >>> from ensembles.benchmark import quartiles
    >>> quartiles([1.0, 2.0, 3.0, 4.0, 5.0])
    (2.0, 4.0)

    Args:
      values: a non-empty list of numbers.

    Returns:
      ``(q1, q3)``; both equal the value for a single value.
    """
    if len(values) == 1:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median of the per-round ratios: robust to drift between rounds.

    >>> from ensembles.benchmark import paired_ratio
    >>> paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0])
    2.0

    Args:
      numerator: times of one method, in round order.
      denominator: times of another method, same rounds.

    Returns:
      The median over rounds of ``numerator[i] / denominator[i]``.
    """
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))
