"""What ``impl="auto"`` runs, per backend, dtype and shape, as measured data.

:data:`AUTO_TABLE` is the one place the choice lives. A row picks the fused
Pallas kernel only with the measurement that showed it correct and faster
than ``"xla"`` for both the forward pass and the gradient on that backend
(:class:`Choice` refuses a ``"pallas"`` row without one). Today no backend has
such a measurement: the kernel ran on one GPU (an H100), where it was wrong on
ragged shapes (since fixed, not yet re-measured) and slower than ``"xla"`` for
every gradient measured; no TPU has run it. So ``"auto"`` is ``"xla"``
everywhere, and ``impl="pallas"`` (or ``nnx.view(model, impl="pallas")``)
selects the kernel explicitly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ensembles._checks import check_choice

__all__ = ["AUTO_TABLE", "IMPLS", "Choice", "check_impl", "resolve_impl"]

#: The implementations ``batch_ensemble_dense`` accepts as ``impl``.
IMPLS: tuple[str, ...] = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``"auto"`` runs on a backend for some dtypes and shapes, and why.

    Attributes:
      backend: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
      impl: ``"xla"`` or ``"pallas"``.
      measured: where, when and what was measured (device, jax version,
        commit, date, figures), or why nothing was.
      dtypes: the operand dtypes the row covers (names); empty: every dtype.
      min_rows: the fewest rows per member the row covers.
      feature_multiple: the row covers in and out features that are
        multiples of this.
      pallas_over_xla: for a ``"pallas"`` row, the measured time ratios of the
        kernel to ``"xla"``, ``(forward, gradient)``; both must be below 1.

    >>> Choice("gpu", "pallas", measured="nothing")
    Traceback (most recent call last):
    ...
    ValueError: A "pallas" row of AUTO_TABLE needs `pallas_over_xla` ...
    """

    backend: str
    impl: str
    measured: str
    dtypes: tuple[str, ...] = ()
    min_rows: int = 1
    feature_multiple: int = 1
    pallas_over_xla: tuple[float, float] | None = None

    def __post_init__(self):
        check_choice(self.backend, "backend", ("cpu", "gpu", "tpu"))
        check_choice(self.impl, "impl", ("xla", "pallas"))
        if self.impl == "pallas" and (
            self.pallas_over_xla is None or max(self.pallas_over_xla) >= 1
        ):
            raise ValueError(
                f'A "pallas" row of AUTO_TABLE needs `pallas_over_xla` '
                f"(forward, gradient) time ratios measured below 1 on its "
                f"backend, got {self.pallas_over_xla!r}. Measure with "
                f"benchmarks/bench_impls.py first."
            )

    def covers(
        self, backend: str, rows: int, in_features: int, out_features: int, dtype
    ) -> bool:
        """Whether this row decides the given problem."""
        return (
            backend == self.backend
            and (not self.dtypes or jnp.dtype(dtype).name in self.dtypes)
            and rows >= self.min_rows
            and in_features % self.feature_multiple == 0
            and out_features % self.feature_multiple == 0
        )


#: The rows ``resolve_impl("auto", ...)`` consults, first match wins; a problem
#: no row covers runs ``"xla"``.
AUTO_TABLE: tuple[Choice, ...] = (
    Choice(
        "cpu",
        "xla",
        measured="Pallas has no compiled CPU backend: the kernel only interprets.",
    ),
    Choice(
        "gpu",
        "xla",
        measured=(
            "NVIDIA H100 80GB HBM3, jax 0.11.2 + CUDA 13, ensembles bb923f3, "
            "2026-11-22 (docs/fused_kernel.md): the Triton kernel was wrong on "
            "every ragged shape (fixed since, not re-measured); bf16, ratio to a "
            "plain dense layer at 8 shapes, forward pallas 0.96-2.18x vs xla "
            "1.08-2.35x, gradient pallas 1.71-4.18x vs xla 1.03-1.56x; float32 "
            "gradient pallas 2.1-7.5x."
        ),
    ),
    Choice(
        "tpu",
        "xla",
        measured=(
            "Unmeasured: no TPU has run the kernel; it is only lowered for tpu "
            "and run in Pallas' TPU simulator."
        ),
    ),
)


def check_impl(impl: str) -> str:
    """Checks that ``impl`` names an implementation of the dense op.

    Args:
      impl: one of :data:`IMPLS`.

    Returns:
      ``impl`` unchanged.

    Raises:
      ValueError: if ``impl`` is not one of :data:`IMPLS`.

    >>> check_impl("xla")
    'xla'
    """
    return check_choice(impl, "impl", IMPLS)


def resolve_impl(
    impl: str,
    *,
    backend: str | None = None,
    shape: tuple[int, int, int] | None = None,
    dtype: jnp.dtype | None = None,
) -> str:
    """Resolves ``"auto"`` to the implementation that runs on a backend.

    ``"auto"`` takes the first row of :data:`AUTO_TABLE` that covers the
    backend, shape and dtype, and ``"xla"`` where none does or where ``shape``
    or ``dtype`` is not given. The choice is made when tracing, from
    ``jax.default_backend()``; to lower ahead of time for another platform,
    name ``impl`` explicitly. Today every row says ``"xla"`` (see
    :mod:`ensembles.ops.dispatch` for the measurements).

    Args:
      impl: one of :data:`IMPLS`.
      backend: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (default:
        ``jax.default_backend()``).
      shape: ``(rows_per_member, in_features, out_features)`` of the problem.
      dtype: the operands' common dtype (``None`` if they differ).

    Returns:
      The concrete implementation name.

    >>> import jax.numpy as jnp
    >>> resolve_impl("auto")                          # on this CPU
    'xla'
    >>> resolve_impl("auto", backend="gpu", shape=(256, 1024, 1024),
    ...              dtype=jnp.bfloat16)               # measured: xla wins
    'xla'
    >>> resolve_impl("pallas")
    'pallas'
    """
    check_impl(impl)
    if impl != "auto":
        return impl
    backend = jax.default_backend() if backend is None else backend
    if shape is None or dtype is None:
        return "xla"
    for choice in AUTO_TABLE:
        if choice.covers(backend, *shape, dtype):
            return choice.impl
    return "xla"
