"""Interleaved timing: machine drift hits every method alike."""

import statistics
import time
from collections.abc import Callable

import jax


def interleaved_times(
    fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Runs each function in turn, `repeats` rounds, and returns its wall times."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median of the per-round ratios: robust to drift between rounds."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))
