"""Interleaved timing: machine drift hits every method alike.

Each round runs every function once, in turn, so a slow stretch of a shared
machine slows all methods of that round alike. ``ensembles-bench`` reports the
median of each method and ratios of those medians, so every ratio it prints
agrees with the times it prints; :func:`paired_ratio` (the median of per-round
ratios, more robust to drift) is there for scripts that want it.

On CPU the C library's allocator can be what is timed: XLA's runtime allocates
a program's temporaries on every call and frees them after, and glibc's malloc
hands a large request a fresh ``mmap`` and unmaps it when freed, so a program
whose temporaries pass that size page-faults on every page of them on every
call. :func:`reuse_freed_memory` turns that off (``ensembles-bench`` and the
``benchmarks/`` scripts call it first) and :func:`page_faults_per_call` shows
whether it took.
"""

from __future__ import annotations

import ctypes
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import jax

__all__ = [
    "interleaved_times",
    "median",
    "page_faults_per_call",
    "paired_ratio",
    "quartiles",
    "reuse_freed_memory",
]

# glibc's mallopt parameters (malloc.h) and what reuse_freed_memory sets them to.
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_KEEP_FREED = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 1 << 30))


def reuse_freed_memory() -> bool:
    """Makes glibc's malloc keep freed memory for the next call; True where it did.

    XLA's CPU runtime allocates a compiled program's temporaries on every call
    and frees them after. glibc's malloc serves a request above its mmap
    threshold (at most 32 MiB), or one a thread's own arena cannot hold (64
    MiB), with a fresh ``mmap`` and unmaps it when it is freed: every call of
    such a program then page-faults on every page of its temporaries. Which
    programs cross the line depends on the model, E and B, so without this a
    comparison partly times the allocator: on this project's 2-core machine a
    small transformer's BatchEnsemble train step (E = 4, 45 MiB of
    temporaries) page-faulted 11,600 times a step and took 1.67x one model's
    (29 MiB, no faults), 1.31x without the faults (``docs/cost.md``). This
    sets one arena, no ``mmap`` and a trim threshold of 1 GiB, as
    ``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824``
    in the environment of a new process would: freed memory stays in the
    process for the next call (after the first few calls of a program, while
    the heap grows to fit it).

    It changes the allocator of the whole process, and memory once used is not
    given back to the system until the process ends. One arena has a price:
    XLA's threads take turns in ``malloc``, which made every step slower
    without page faults, about alike for every method (measured: 4-8% on the
    MLP's train steps, 20-42% on the small transformer's, whose many small
    kernels allocate more often); one arena is what keeps a thread's large
    request (over 64 MiB, a CNN's) off a fresh ``mmap``. On a GPU or TPU it
    changes only the host's allocations. Call it first thing in a fresh
    process, before JAX runs anything: a thread that has allocated keeps its
    own arena, and its large requests are mapped afresh whatever is set later
    (called after JAX has started, it warns). ``ensembles-bench`` (the speed
    benchmark, unless ``--default-malloc``) and the ``benchmarks/`` scripts
    call it first.

    >>> import subprocess, sys
    >>> first_thing = "import ensembles.benchmark as b; print(b.reuse_freed_memory())"
    >>> done = subprocess.run([sys.executable, "-c", first_thing],
    ...                       capture_output=True, text=True, check=True)
    >>> done.stdout.strip() in ("True", "False")  # True on Linux with glibc
    True

    Returns:
      True if glibc accepted every setting; False, with nothing changed, where
      the C library is not glibc (macOS, Windows, musl).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    if _jax_has_started():
        warnings.warn(
            "reuse_freed_memory() was called after JAX started: threads that "
            "have allocated keep their own malloc arenas, and their large "
            "requests are still mapped afresh (page faults). Call it first "
            "thing, or start Python with MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 "
            "MALLOC_TRIM_THRESHOLD_=1073741824.",
            stacklevel=2,
        )
    accepted = [mallopt(option, value) == 1 for option, value in _KEEP_FREED]
    return all(accepted)


def _jax_has_started() -> bool:
    """Whether JAX's backends (and their threads) exist in this process."""
    from jax._src import xla_bridge  # no public query for it

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started and started())


def page_faults_per_call(
    fn: Callable[[], object], calls: int = 3, warmup: int = 1
) -> float | None:
    """The page faults of one call of ``fn``, on average over ``calls`` calls.

    Minor faults of the whole process (every thread) while ``fn`` runs, its
    result waited for, after ``warmup`` uncounted calls (compilation, and a
    first call that grows the heap after other programs ran): a step that
    still page-faults thousands of times gets fresh memory from the system on
    every call (see :func:`reuse_freed_memory`).

    >>> import jax.numpy as jnp
    >>> from ensembles.benchmark import page_faults_per_call
    >>> x = jnp.ones((8, 8))
    >>> faults = page_faults_per_call(lambda: x @ x)
    >>> faults is None or faults >= 0
    True

    Args:
      fn: a function of no arguments returning JAX arrays (a pytree).
      calls: how many calls to average over.
      warmup: calls before the counted ones.

    Returns:
      Faults per call, or ``None`` where the system does not count them (no
      ``resource`` module: Windows).
    """
    for _ in range(warmup):
        jax.block_until_ready(fn())
    before = _minor_faults()
    for _ in range(calls):
        jax.block_until_ready(fn())
    return None if before is None else (_minor_faults() - before) / calls


def interleaved_times(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 2,
    page_faults: dict[str, list[int]] | None = None,
) -> dict[str, list[float]]:
    """Runs each function in turn, ``repeats`` rounds, and returns its wall times.

    Every call is followed by ``jax.block_until_ready`` on its result, so a time
    covers the whole computation and not just its dispatch. The ``warmup``
    calls of every function (compilation, caches) come first and are not timed.

    >>> import jax.numpy as jnp
    >>> from ensembles.benchmark import interleaved_times
    >>> x = jnp.ones((8, 8))
    >>> faults = {}
    >>> times = interleaved_times({"a": lambda: x @ x, "b": lambda: x + x}, 3,
    ...                           page_faults=faults)
    >>> sorted(times), len(times["a"]), min(times["b"]) > 0
    (['a', 'b'], 3, True)
    >>> sorted(faults) == sorted(times) and len(faults["a"]) in (0, 3)
    True

    Args:
      fns: name -> a function of no arguments returning JAX arrays (a pytree).
      repeats: the number of timed rounds.
      warmup: untimed calls of every function before the first round.
      page_faults: if a dict, filled with name -> the minor page faults of the
        process during each timed call (empty lists where the system does not
        count them: Windows); thousands a call mean the step got fresh memory
        from the system (see :func:`reuse_freed_memory`).

    Returns:
      name -> the ``repeats`` wall times in seconds, in round order.
    """
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    if page_faults is not None:
        page_faults.update({name: [] for name in fns})
    for _ in range(repeats):
        for name, fn in fns.items():
            before = None if page_faults is None else _minor_faults()
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
            if before is not None:
                page_faults[name].append(_minor_faults() - before)
    return times


def _minor_faults() -> int | None:
    """The process's minor page faults so far (every thread), or ``None``."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


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
