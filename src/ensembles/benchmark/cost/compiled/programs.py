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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flax import nnx

from ensembles.benchmark.cost.compiled import chips, hlo
from ensembles.benchmark.cost.compiled.builds import (
    DTYPES,
    layout_name,
    model_programs,
)
from ensembles.benchmark.report import model_name

__all__ = [
    "DTYPES",
    "Comparison",
    "ProgramCost",
    "compare_programs",
    "layout_name",
    "model_programs",
    "program_cost",
]


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

    @property
    def collectives(self) -> int:
        """Collectives of one run (all-reduces, all-gathers, ...), trips counted."""
        return self.program.collectives

    @property
    def collective_bytes(self) -> int:
        """Bytes the collectives of one run carry."""
        return self.program.collective_bytes

    def as_dict(self) -> dict[str, Any]:
        """The figures, for JSON."""
        return {
            "chip": self.chip,
            "launches": self.launches,
            "matmul_launches": self.matmul_launches,
            "loops": [list(loop) for loop in self.program.loops],
            "flops": self.flops,
            "hbm_bytes": self.hbm_bytes,
            "collectives": self.collectives,
            "collective_bytes": self.collective_bytes,
            "temp_bytes": self.temp_bytes,
            "compile_seconds": round(self.compile_seconds, 3),
        }


def program_cost(
    chip: str,
    fn: Callable[..., Any],
    specs: Sequence[Any],
    *,
    donate_argnums: Sequence[int] = (),
    mesh: Mapping[str, int] | None = None,
    partitions: Sequence[Any] | None = None,
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
      mesh: the devices' mesh axes; ``None``: one device. The figures are
        then one device's (each runs the same partitioned program).
      partitions: with ``mesh``: where each argument lies
        (:func:`~ensembles.benchmark.cost.compiled.chips.compile_for`).

    Returns:
      The :class:`ProgramCost`.
    """
    compiled, seconds = chips.compile_for(
        chip,
        fn,
        specs,
        donate_argnums=donate_argnums,
        mesh=mesh,
        partitions=partitions,
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
      layout: where the rows and parameters lie (:func:`layout_name`):
        ``"one device"``, or a mesh's axes (``"data=8"``), both programs
        placed alike but for the members' axis of a BatchEnsemble's
        per-member arrays (``"data=2,model=4 members:model"``). The
        figures are then one device's.
    """

    model: str
    mode: str
    dtype: str
    num_members: int
    batch: int
    ensemble: ProgramCost
    plain: ProgramCost
    layout: str = "one device"

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

        Kernels as the table's ``kernels`` column counts them: every launch
        but the DMAs (copies between memory spaces, which launch nothing).
        Each plain kernel, in program order, is matched to the unmatched
        BatchEnsemble kernel of its family that computes the most alike (the
        largest share of operations in common, then the nearest bytes): the
        matmul and convolution kernels are one family, as in the
        ``matmul/conv`` column (a chip may write one side's matmul as a
        convolution), collectives another, the rest a third. A plain kernel
        whose family the BatchEnsemble has run out of takes the most alike
        of what is left. What is left, loop trips counted, is what the
        BatchEnsemble adds (its scalings' own kernels, a loop's body, a
        matmul more): as many launches as the ``kernels`` column's
        difference, none where the BatchEnsemble has fewer.
        """
        left = [
            [kernel, kernel.trips]
            for kernel in self.ensemble.program.kernels
            if kernel.category != "dma"
        ]
        unmatched = []
        for kernel in self.plain.program.kernels:
            if kernel.category != "dma":
                trips = _match(left, kernel, kernel.trips, _family(kernel))
                if trips:
                    unmatched.append((kernel, trips))
        for kernel, trips in unmatched:
            _match(left, kernel, trips, None)
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
            "layout": self.layout,
            "batchensemble": self.ensemble.as_dict(),
            "single": self.plain.as_dict(),
            "extra_kernels": [
                {
                    "category": k.category,
                    "ops": list(k.ops),
                    "trips": k.trips,
                    "hbm_bytes": k.hbm_bytes,
                    "source": k.source,
                    "caller": k.caller,
                }
                for k in self.extra_kernels()
            ],
        }


def _family(kernel: hlo.Kernel) -> str:
    """A kernel's family for matching: matmuls and convolutions are one."""
    return (
        "matmul" if kernel.category in ("gemm", "conv", "pallas") else kernel.category
    )


def _match(
    left: list[list[Any]], kernel: hlo.Kernel, trips: int, family: str | None
) -> int:
    """Takes ``trips`` of ``kernel``'s from the most alike in ``left``.

    ``left`` holds ``[kernel, trips not yet matched]`` entries; only those of
    ``family`` are candidates (``None``: any). Returns the trips no
    candidate was left for.
    """
    while trips:
        candidates = [
            entry
            for entry in left
            if entry[1] and (family is None or _family(entry[0]) == family)
        ]
        if not candidates:
            break
        best = max(candidates, key=lambda entry: _likeness(entry[0], kernel))
        taken = min(trips, best[1])
        best[1] -= taken
        trips -= taken
    return trips


def _likeness(a: hlo.Kernel, b: hlo.Kernel) -> tuple[float, float]:
    """How alike two kernels are: shared operations, then nearness in bytes."""
    ops_a, ops_b = set(a.ops), set(b.ops)
    shared = len(ops_a & ops_b) / max(len(ops_a | ops_b), 1)
    return shared, -abs(a.hbm_bytes - b.hbm_bytes)


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
    mesh: Mapping[str, int] | None = None,
    member_axis: str | None = None,
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
      mesh: see :func:`model_programs`; the figures are one device's.
      member_axis: see :func:`model_programs`.

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
        mesh=mesh,
        member_axis=member_axis,
    )
    costs = {
        method: program_cost(
            chip,
            fn,
            specs,
            donate_argnums=donate,
            mesh=mesh,
            partitions=partitions,
        )
        for method, (fn, specs, donate, partitions) in programs.items()
    }
    return Comparison(
        model=model_name(model),
        mode=mode,
        dtype=dtype,
        num_members=num_members,
        batch=batch,
        ensemble=costs["batchensemble"],
        plain=costs["single"],
        layout=layout_name(mesh, member_axis),
    )
