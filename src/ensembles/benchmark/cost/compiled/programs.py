"""What a BatchEnsemble costs on a chip, read from the chip's own compiled program.

For a model, a mode (a forward, or a full optax AdamW train step), an ensemble
size E, B rows per member and a dtype, :func:`compare_programs` compiles the
plain model on all ``E*B`` rows (the same matmuls: the limit) and its
BatchEnsemble conversion for a chip (:mod:`ensembles.benchmark.cost.compiled.chips`:
deviceless for an H100 or a TPU) and reads both programs
(:mod:`ensembles.benchmark.cost.compiled.hlo`): kernels (matmul and convolution kernels
apart), ``while`` loops and their trips, matmul and convolution flops, bytes
through main memory, XLA's temporary memory, the compiler's time, and the
kernels the BatchEnsemble has that the plain model has not, each with its
source line. The figures are deterministic for a given compiler; they are a
structure, not a time (``docs/cost.md`` says what only a device shows).

>>> from ensembles.benchmark.cost.compiled.programs import compare_programs
>>> row = compare_programs("linear", "forward", chip="cpu", num_members=2,
...                        batch=4, width=8)
>>> row.ensemble.flops == row.plain.flops == 2 * (2 * 4) * 8 * 8
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import ensembles
from ensembles.benchmark.cost.compiled import chips, hlo
from ensembles.benchmark.cost.models import build_model, model_inputs
from ensembles.benchmark.cost.steps import merge, optax_module, rest_of, train_loss
from ensembles.benchmark.report import model_name

__all__ = [
    "DTYPES",
    "Comparison",
    "ProgramCost",
    "compare_programs",
    "model_programs",
    "program_cost",
]

#: The dtypes a comparison can run in (parameters, inputs and compute alike).
DTYPES: dict[str, jnp.dtype] = {
    "float32": jnp.dtype(jnp.float32),
    "bfloat16": jnp.dtype(jnp.bfloat16),
}

#: AdamW's learning rate in the compiled train step (any value compiles alike).
LEARNING_RATE = 1e-3


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """One compiled program, counted.

    Attributes:
      chip: the chip it was compiled for.
      program: its kernels and loops
        (:class:`~ensembles.benchmark.cost.compiled.hlo.Program`).
      temp_bytes: XLA's temporary memory (``memory_analysis()``).
      compile_seconds: the chip compiler's time (not tracing or lowering).
    """

    chip: str
    program: hlo.Program
    temp_bytes: int
    compile_seconds: float

    @property
    def launches(self) -> int:
        """Kernel launches of one run, loop trips counted."""
        return self.program.launches

    @property
    def matmul_launches(self) -> int:
        """Matmul and convolution kernel launches (``"pallas"`` ones too)."""
        return self.program.launches_of("gemm", "conv", "pallas")

    @property
    def loops(self) -> int:
        """The number of ``while`` loops."""
        return len(self.program.loops)

    @property
    def loop_trips(self) -> int:
        """The loops' trips, together (an unknown count reads as 1)."""
        return sum(trips or 1 for _, trips in self.program.loops)

    @property
    def flops(self) -> int:
        """Matmul and convolution flops of one run (none inside custom calls)."""
        return self.program.flops

    @property
    def hbm_bytes(self) -> int:
        """Bytes through main memory of one run: each kernel's operands + outputs."""
        return self.program.hbm_bytes

    def as_dict(self) -> dict[str, Any]:
        """The figures, for JSON."""
        return {
            "chip": self.chip,
            "launches": self.launches,
            "matmul_launches": self.matmul_launches,
            "loops": [list(loop) for loop in self.program.loops],
            "flops": self.flops,
            "hbm_bytes": self.hbm_bytes,
            "temp_bytes": self.temp_bytes,
            "compile_seconds": round(self.compile_seconds, 3),
        }


def program_cost(
    chip: str,
    fn: Callable[..., Any],
    specs: Sequence[Any],
    *,
    donate_argnums: Sequence[int] = (),
) -> ProgramCost:
    """Compiles ``fn`` for ``chip`` and counts its program.

    >>> import jax, jax.numpy as jnp
    >>> spec = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    >>> cost = program_cost("cpu", lambda a, b: a @ b.T, [spec, spec])
    >>> cost.flops, cost.matmul_launches
    (256, 1)

    Args:
      chip: one of :data:`ensembles.benchmark.cost.compiled.chips.CHIPS`.
      fn: the function; its arguments' shapes and dtypes are ``specs``.
      specs: ``jax.ShapeDtypeStruct`` leaves (any pytree), one per argument.
      donate_argnums: arguments whose buffers the program may reuse.

    Returns:
      The :class:`ProgramCost`.
    """
    compiled, seconds = chips.compile_for(
        chip, fn, specs, donate_argnums=donate_argnums
    )
    memory = compiled.memory_analysis()
    return ProgramCost(
        chip=chip,
        program=hlo.parse_program(compiled.as_text()),
        temp_bytes=int(getattr(memory, "temp_size_in_bytes", 0) or 0),
        compile_seconds=seconds,
    )


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A BatchEnsemble's program against the plain model's on the same rows.

    Attributes:
      model: the model's name.
      mode: ``"forward"`` or ``"train"``.
      dtype: the dtype's name.
      num_members: E.
      batch: B, rows per member.
      ensemble: the BatchEnsemble's program.
      plain: the plain model's program on all ``E*B`` rows.
    """

    model: str
    mode: str
    dtype: str
    num_members: int
    batch: int
    ensemble: ProgramCost
    plain: ProgramCost

    @property
    def chip(self) -> str:
        """The chip both programs were compiled for."""
        return self.ensemble.chip

    def ratio(self, figure: str) -> float:
        """The BatchEnsemble's ``figure`` over the plain model's (``inf`` over 0)."""
        ensemble, plain = getattr(self.ensemble, figure), getattr(self.plain, figure)
        if plain == 0:
            return 1.0 if ensemble == 0 else float("inf")
        return ensemble / plain

    def extra_kernels(self) -> list[hlo.Kernel]:
        """The BatchEnsemble's kernels beyond the plain model's.

        Each plain kernel, in program order, is matched to the unmatched
        BatchEnsemble kernel of its category (matmul, convolution, other,
        DMA) that computes the most alike: the largest share of operations in
        common, then the nearest bytes. What is left, loop trips counted, is
        what the BatchEnsemble adds: its scalings' own kernels, a loop's
        body, a matmul more.
        """
        left = [[kernel, kernel.trips] for kernel in self.ensemble.program.kernels]
        for kernel in self.plain.program.kernels:
            trips = kernel.trips
            while trips:
                candidates = [
                    entry
                    for entry in left
                    if entry[1] and entry[0].category == kernel.category
                ]
                if not candidates:
                    break
                best = max(candidates, key=lambda entry: _likeness(entry[0], kernel))
                taken = min(trips, best[1])
                best[1] -= taken
                trips -= taken
        return [
            dataclasses.replace(kernel, trips=trips) for kernel, trips in left if trips
        ]

    def as_dict(self) -> dict[str, Any]:
        """The comparison, for JSON."""
        return {
            "model": self.model,
            "mode": self.mode,
            "dtype": self.dtype,
            "num_members": self.num_members,
            "batch": self.batch,
            "chip": self.chip,
            "batchensemble": self.ensemble.as_dict(),
            "single": self.plain.as_dict(),
            "extra_kernels": [
                {
                    "category": k.category,
                    "ops": list(k.ops),
                    "trips": k.trips,
                    "hbm_bytes": k.hbm_bytes,
                    "source": k.source,
                }
                for k in self.extra_kernels()
            ],
        }


def _likeness(a: hlo.Kernel, b: hlo.Kernel) -> tuple[float, float]:
    """How alike two kernels are: shared operations, then nearness in bytes."""
    ops_a, ops_b = set(a.ops), set(b.ops)
    shared = len(ops_a & ops_b) / max(len(ops_a | ops_b), 1)
    return shared, -abs(a.hbm_bytes - b.hbm_bytes)


def _abstract(model: Any, dtype: jnp.dtype) -> tuple[Any, Any, Any]:
    """``model`` split into graph, parameters and rest, as specs in ``dtype``."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def spec(leaf):
        leaf_dtype = leaf.dtype
        if jnp.issubdtype(leaf_dtype, jnp.floating):
            leaf_dtype = dtype
        return jax.ShapeDtypeStruct(leaf.shape, leaf_dtype)

    return graphdef, jax.tree.map(spec, params), jax.tree.map(spec, rest)


def _forward(graphdef):
    """The forward of a split model: ``(params, rest, x) -> outputs``."""

    def forward(params, rest, x):
        return merge(graphdef, params, rest)(x)

    return forward


def _train_step(graphdef, labels):
    """An AdamW step of a split model, and the optax transformation.

    ``(params, opt_state, rest, x, y) -> (params, opt_state, rest, loss)``;
    the loss is :func:`~ensembles.benchmark.cost.steps.train_loss`'s for ``labels``,
    of the outputs in float32.
    """
    _, loss_of = train_loss(labels)
    optax = optax_module()
    tx = optax.adamw(LEARNING_RATE)

    def loss_fn(params, rest, x, y):
        model = merge(graphdef, params, rest)
        loss = loss_of(model(x).astype(jnp.float32), y)
        return loss, rest_of(model)

    def train(params, opt_state, rest, x, y):
        (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, rest, x, y
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, rest, loss

    return train, tx


def model_programs(
    model: str | Callable[[nnx.Rngs], nnx.Module],
    mode: str,
    *,
    num_members: int,
    batch: int,
    dtype: str = "float32",
    width: int | None = None,
    image_size: int = 32,
    input_shape: Sequence[int] | None = None,
    impl: str = "xla",
    norms: str = "shared",
) -> dict[str, tuple[Callable[..., Any], list[Any], tuple[int, ...]]]:
    """The plain and the BatchEnsemble program of a model, built abstractly.

    Args:
      model: one of :data:`~ensembles.benchmark.MODELS` or a factory ``rngs ->
        nnx.Module`` (with ``input_shape``).
      mode: ``"forward"`` or ``"train"`` (softmax cross-entropy, or the
        squared error for one output, and an ``optax.adamw`` update).
      num_members: E.
      batch: B, rows per member; both programs see ``E*B`` rows.
      dtype: a key of :data:`DTYPES`: parameters, inputs and compute.
      width: as for :func:`~ensembles.benchmark.build_model`.
      image_size: the CNN's image height and width.
      input_shape: a factory's example shape.
      impl: the BatchEnsemble layers' ``impl``.
      norms: how the conversion treats the model's norms, as
        :func:`ensembles.to_batch_ensemble`'s ``norms``.

    Returns:
      ``{"single": (fn, specs, donate_argnums), "batchensemble": (...)}``.
    """
    if mode not in ("forward", "train"):
        raise ValueError(f"`mode` must be 'forward' or 'train', got {mode!r}.")
    if dtype not in DTYPES:
        raise ValueError(f"`dtype` must be one of {list(DTYPES)}, got {dtype!r}.")
    x, labels = model_inputs(
        model,
        num_members * batch,
        width=width,
        image_size=image_size,
        input_shape=input_shape,
    )
    x_spec = jax.ShapeDtypeStruct(x.shape, DTYPES[dtype])
    y_spec = jax.ShapeDtypeStruct(labels.shape, labels.dtype)

    def plain():
        return build_model(model, width=width, rngs=nnx.Rngs(0))

    def converted():
        ensemble = ensembles.to_batch_ensemble(
            plain(), num_members=num_members, rngs=nnx.Rngs(1), norms=norms
        )
        return nnx.view(ensemble, impl=impl)

    programs = {}
    for method, build in (("single", plain), ("batchensemble", converted)):
        graphdef, params, rest = _abstract(nnx.eval_shape(build), DTYPES[dtype])
        if mode == "forward":
            programs[method] = (_forward(graphdef), [params, rest, x_spec], ())
        else:
            train, tx = _train_step(graphdef, labels)
            opt_state = jax.eval_shape(tx.init, params)
            specs = [params, opt_state, rest, x_spec, y_spec]
            programs[method] = (train, specs, (0, 1, 2))
    return programs


def compare_programs(
    model: str | Callable[[nnx.Rngs], nnx.Module],
    mode: str,
    *,
    chip: str,
    num_members: int,
    batch: int,
    dtype: str = "float32",
    width: int | None = None,
    image_size: int = 32,
    input_shape: Sequence[int] | None = None,
    impl: str = "xla",
    norms: str = "shared",
) -> Comparison:
    """Compiles a model and its BatchEnsemble for ``chip`` and compares them.

    Args:
      model: see :func:`model_programs`.
      mode: ``"forward"`` or ``"train"``.
      chip: one of :data:`ensembles.benchmark.cost.compiled.chips.CHIPS`.
      num_members: E.
      batch: B, rows per member.
      dtype: a key of :data:`DTYPES`.
      width: see :func:`model_programs`.
      image_size: see :func:`model_programs`.
      input_shape: see :func:`model_programs`.
      impl: the BatchEnsemble layers' ``impl``.
      norms: see :func:`model_programs`.

    Returns:
      The :class:`Comparison`.

    Raises:
      ValueError: if an argument is invalid.
      RuntimeError: if this machine lacks the chip's compiler (the message
        says what to install).
    """
    programs = model_programs(
        model,
        mode,
        num_members=num_members,
        batch=batch,
        dtype=dtype,
        width=width,
        image_size=image_size,
        input_shape=input_shape,
        impl=impl,
        norms=norms,
    )
    costs = {
        method: program_cost(chip, fn, specs, donate_argnums=donate)
        for method, (fn, specs, donate) in programs.items()
    }
    return Comparison(
        model=model_name(model),
        mode=mode,
        dtype=dtype,
        num_members=num_members,
        batch=batch,
        ensemble=costs["batchensemble"],
        plain=costs["single"],
    )
