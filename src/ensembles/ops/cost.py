"""Every measured table, as data: where each was measured, when, and what it showed.

* :data:`COST_MODELS`: the constants of the ``"xla"`` dense op's cost model,
  per backend (which forward and backward formulation runs);
* :data:`KERNELS_MEASURED`: which ``"xla"`` convolution backward runs, per
  backend;
* :data:`AUTO_TABLE`: what ``impl="auto"`` runs for the dense-like ops.

:mod:`ensembles.ops.plan` makes every decision from these tables, and
``docs/cost.md`` / ``docs/fused_kernel.md`` tell the story behind the figures.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ensembles._checks import check_choice
from ensembles.ops.autodiff import PARAM_GRADIENTS

__all__ = [
    "AUTO_TABLE",
    "COST_MODELS",
    "FOLD_MEASURED",
    "KERNELS_MEASURED",
    "MAX_KERNELS_MEMORY",
    "Choice",
    "ConvBackward",
    "ConvForward",
    "CostModel",
]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work of each kind, for one backend.

    A formulation's cost is the sum over its work of ``count * constant``; only
    differences between formulations matter, so the work every formulation
    shares (the plain matmul of the forward, ``dx``'s matmul) still counts but
    per-call overheads common to all do not.

    Attributes:
      dot: per multiply-add of a 2-D matmul over ``E*B`` rows.
      batched_dot: per multiply-add of the E-batched matmul of ``"kernels"``
        (``M_k = x_k^T g_k``).
      fold_dot: per multiply-add of the ``"fold"`` forward's batched matmul
        against the member kernels, including forming them.
      fold_element: per element of ``E x in x out`` when ``"fold"`` forms the
        member kernels (GPU: fused into the matmul, so ~0).
      activation: per element of one elementwise pass over ``[E*B, in]`` or
        ``[E*B, out]`` (a scaling, or a product-and-row-sum).
      kernel_element: per element of one pass over the ``E x in x out`` kernel
        gradients ``M_k`` (a reduction to ``dW``, ``dr`` or ``ds``).
      measured: where, when and how the constants were measured.
      param_gradients: the backward formulations measured on this backend;
        :func:`choose` considers no other (a cost model's guess never puts
        an unmeasured formulation into a user's training step).
    """

    dot: float
    batched_dot: float
    fold_dot: float
    fold_element: float
    activation: float
    kernel_element: float
    measured: str = ""
    param_gradients: tuple[str, ...] = PARAM_GRADIENTS


#: The measured constants, per ``jax.default_backend()``; read when tracing.
#: ``docs/cost.md`` tells how each was measured and what it predicted.
COST_MODELS: dict[str, CostModel] = {
    "cpu": CostModel(
        dot=3.2e-11,
        batched_dot=3.5e-11,
        fold_dot=4.0e-11,
        fold_element=1.5e-9,
        activation=1.0e-9,
        kernel_element=0.5e-9,
        measured=(
            "2-core x86-64 CI CPU, jax 0.10.2, float32, 2026-11-23: medians of "
            "interleaved timings at the shapes of benchmarks/bench_dense.py; a "
            "2-D matmul 3.2e-11 s per multiply-add at (E*B, in, out) = (1024, "
            "1024, 1024) (2.3-6.9e-11 elsewhere), the batched M_k matmul "
            "3.0-3.8e-11 at B >= 64, the fold forward 2.8-6.6e-11, a scaling "
            "pass 1.1-1.6e-9 s per element, the fused dW/dr reductions over M_k "
            "3.8 ms for 2 x 4M elements; the choice is the measured fastest at "
            "all four shapes, forward, first-layer and hidden-layer gradients."
        ),
    ),
    "gpu": CostModel(
        dot=2.9e-15,
        batched_dot=2.9e-15,
        fold_dot=4.7e-15,
        fold_element=0.0,
        activation=3.0e-12,
        kernel_element=3.0e-12,
        measured=(
            "NVIDIA H100 80GB, jax 0.11.2, bfloat16, 2026-11-22, ensembles "
            "bb923f3 (docs/cost.md): fitted to the forward figures, cuBLAS at "
            "~343e12 multiply-adds/s, an activation pass ~3e-12 s per element, "
            "the fused fold matmul ~1.6x slower than cuBLAS at compute-bound "
            "shapes. The kernels backward never ran on a GPU: kernel_element is "
            "assumed, and only the activations backward is allowed."
        ),
        param_gradients=("activations",),
    ),
}
COST_MODELS["tpu"] = dataclasses.replace(
    COST_MODELS["gpu"], measured="Never measured: the GPU row's constants."
)


#: The most memory the ``"kernels"`` backward may take: its ``M_k``
#: (``E x in x out`` values) at most this many times the layer's activations
#: (``E*B x (in + out)``). Every shape measured in ``docs/cost.md`` is within
#: 4; beyond, a step that fits in memory with plain differentiation could stop
#: fitting (``E = 16``, ``B = 64``, ``in = out = 8192``: 4 GiB of ``M_k`` in
#: float32 against 64 MiB of activations), whatever the time model says.
MAX_KERNELS_MEMORY: float = 4.0


@dataclasses.dataclass(frozen=True)
class ConvBackward:
    """Whether the ``"kernels"`` convolution backward is measured faster.

    Attributes:
      first: for a first layer (parameters differentiated, inputs not).
      hidden: for a hidden layer (inputs too).
      measured: where, when and what was measured.
    """

    first: bool
    hidden: bool
    measured: str


@dataclasses.dataclass(frozen=True)
class ConvForward:
    """Whether the ``"fold"`` convolution forward is measured faster.

    Attributes:
      fold: whether E convolutions of each member's rows with its own kernel
        ``W * (r_k (x) s_k)`` beat one convolution of the scaled activations.
      measured: where, when and what was measured.
    """

    fold: bool
    measured: str


#: The convolution forward per backend: ``"fold"`` where it measured faster
#: than ``"scale"`` (unmeasured backends keep ``"scale"``).
FOLD_MEASURED: dict[str, ConvForward] = {
    "cpu": ConvForward(
        fold=True,
        measured=(
            "2-core CPU, jax 0.10.2, 2026-11-23, float32, the benchmark CNN's "
            "3x3 layers (32x32 3->16, 32x32 16->32 and 16x16 32->32 stride 2; "
            "B=128 per member), E=1/4/8, interleaved medians: forward "
            "0.56-0.91x of 'scale' (E=1: 0.86-0.88x), first-layer gradient "
            "0.75-1.03x."
        ),
    ),
    "gpu": ConvForward(fold=False, measured="Never measured."),
    "tpu": ConvForward(fold=False, measured="Never measured."),
}


#: The convolution backward per backend: ``"kernels"`` where it measured faster
#: than ``"activations"`` (a table, not a cost model: XLA's CPU convolutions do
#: not follow FLOPs).
KERNELS_MEASURED: dict[str, ConvBackward] = {
    "cpu": ConvBackward(
        first=True,
        hidden=True,
        measured=(
            "2-core x86-64 CI CPU, jax 0.10.2, float32, 2026-11-23, "
            "benchmarks/bench_conv.py: BatchEnsembleConv gradient / nnx.Conv "
            "gradient on the same rows, 3x3 kernels, 0.62-0.80 with kernels "
            "against 1.00-1.19 with activations."
        ),
    ),
    "gpu": ConvBackward(
        first=False,
        hidden=False,
        measured=(
            "Never measured with kernels; activations (plain differentiation) "
            "measured at 1.38-1.47x one model in a CNN train step on an NVIDIA "
            "H100, jax 0.11.2, 2026-11-22."
        ),
    ),
    "tpu": ConvBackward(first=False, hidden=False, measured="Never measured."),
}


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
