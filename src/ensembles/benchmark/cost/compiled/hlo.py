"""What a compiled program does, read from its optimized HLO text.

XLA's cost analysis is missing where it matters (``None`` for a deviceless
H100 compile; on a TPU it counts a ``while`` body once), so this module reads
the program a chip's compiler wrote (``compiled.as_text()``) and counts, per
program: the kernels the chip launches (the entry computation's fusions,
custom calls and other compute instructions, and those of every ``while``
body times its trip count), which of them are matmuls or convolutions, the
loops, the matmul and convolution flops (from the shapes of every ``dot`` and
``convolution``, and of cuDNN's convolution calls in the roles their kind
gives the operands), the collectives and the bytes they carry, and the bytes
each kernel moves through the chip's main memory (HBM): its operands plus its
outputs, the way XLA's own GPU cost model counts them, but only the elements
a fusion reads of an operand it reads through slices or gathers, and leaving
out buffers a TPU keeps on chip (memory spaces ``S(1)`` and up). It is a
structural measure, deterministic for a given compiler: it says nothing of
caches, autotuning or launch latency (``docs/cost.md``).

>>> text = '''HloModule m
... ENTRY %main (x: f32[8,4], w: f32[4,2]) -> f32[8,2] {
...   %x = f32[8,4]{1,0} parameter(0)
...   %w = f32[4,2]{1,0} parameter(1)
...   ROOT %d = f32[8,2]{1,0} dot(%x, %w), lhs_contracting_dims={1}
... }'''
>>> program = parse_program(text)
>>> [(k.category, k.flops, k.hbm_bytes) for k in program.kernels]
[('gemm', 128, 224)]
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

from ensembles.benchmark.cost.compiled import hlo_ops
from ensembles.benchmark.cost.compiled.hlo_text import (
    Instruction,
    caller_of,
    computations,
    source_of,
    source_table,
)

__all__ = ["Kernel", "Program", "parse_program"]

# Instructions that launch nothing: views, tuples, control, parameters, and
# the halves of asynchronous pairs that only wait (every ``...-done``).
_FREE = {
    "parameter", "constant", "bitcast", "get-tuple-element", "tuple",
    "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id",
    "async-update", "domain",
}  # fmt: skip
# Asynchronous copies between memory spaces (a TPU's main memory and its
# on-chip memory): data moved by a DMA engine, not a kernel. Their result is
# (destination, ...): the destination's bytes cross main memory once.
_DMA = {"copy-start": 0, "slice-start": 1}
_LOOP = {"while"}
_CALLS = {"call", "conditional"}
# Collectives, synchronous or as the ``-start`` of an asynchronous pair.
_COLLECTIVES = {
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all",
    "ragged-all-to-all", "collective-permute", "collective-broadcast",
}  # fmt: skip
# Custom-call targets that are matmuls or convolutions (cuBLAS, cuDNN).
_GEMM_TARGETS = ("gemm", "matmul", "cublas")
_CONV_TARGETS = ("conv",)
_PALLAS_TARGETS = ("triton", "tpu_custom_call", "mosaic")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel launch (or ``trips`` launches inside a loop).

    Attributes:
      name: the instruction's name in the program.
      category: ``"gemm"``, ``"conv"``, ``"pallas"`` (a custom kernel),
        ``"collective"`` (an all-reduce, all-gather, reduce-scatter,
        all-to-all or collective-permute), ``"dma"`` (an asynchronous copy
        between memory spaces, no kernel) or ``"other"`` (elementwise work,
        reductions, copies, ...).
      ops: the opcodes of what it computes (a fusion's body), sorted.
      flops: matmul and convolution flops of one launch.
      hbm_bytes: operands plus outputs in main memory, one launch.
      trips: how many times it runs (a loop's trip count, else 1).
      source: the innermost source line its metadata names, if known.
      op_name: the JAX operation its metadata names.
      caller: the model's own line that led to it, the innermost frame
        outside the library's layers and ops, JAX, Flax and optax (where
        ``source`` is the op's line every layer shares), if known.
      collective_bytes: what a collective carries, one launch: its result
        (an all-gather's gathered array), a reduce-scatter's input; 0 for
        every other kernel.
    """

    name: str
    category: str
    ops: tuple[str, ...]
    flops: int
    hbm_bytes: int
    trips: int
    source: str | None
    op_name: str | None
    caller: str | None = None
    collective_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Program:
    """A compiled program's kernels and loops.

    Attributes:
      kernels: every kernel, loop bodies' kernels included (with their trips).
      loops: ``(name, trip count)`` of every ``while`` loop (``None``: unknown).
    """

    kernels: tuple[Kernel, ...]
    loops: tuple[tuple[str, int | None], ...]

    @property
    def launches(self) -> int:
        """Kernel launches of one run of the program (DMAs are no kernels)."""
        return sum(k.trips for k in self.kernels if k.category != "dma")

    def launches_of(self, *categories: str) -> int:
        """Kernel launches of the given categories."""
        return sum(k.trips for k in self.kernels if k.category in categories)

    @property
    def flops(self) -> int:
        """Matmul and convolution flops of one run."""
        return sum(k.flops * k.trips for k in self.kernels)

    @property
    def hbm_bytes(self) -> int:
        """Bytes through main memory of one run (operands plus outputs)."""
        return sum(k.hbm_bytes * k.trips for k in self.kernels)

    @property
    def collectives(self) -> int:
        """Collective launches of one run."""
        return self.launches_of("collective")

    @property
    def collective_bytes(self) -> int:
        """Bytes the collectives of one run carry (:attr:`Kernel.collective_bytes`)."""
        return sum(k.collective_bytes * k.trips for k in self.kernels)


def _hbm(arrays) -> int:
    return sum(a.bytes for a in arrays if a.memory_space == 0)


class _Reader:
    def __init__(self, text: str):
        self.computations, self.entry = computations(text)
        self.frames = source_table(text)
        self.shapes = {
            computation: {i.name: i.shape for i in instructions}
            for computation, instructions in self.computations.items()
        }

    def body_ops(self, computation: str) -> Iterator[tuple[str, Instruction]]:
        """Every instruction of ``computation`` and of the fusions it calls."""
        for instruction in self.computations.get(computation, []):
            yield computation, instruction
            for called in instruction.called("calls"):
                yield from self.body_ops(called)

    def collective(self, instruction: Instruction) -> str | None:
        """The collective an instruction runs (``"all-gather"``...), if any."""
        opcode = instruction.opcode.removesuffix("-start")
        if opcode in _COLLECTIVES:
            return opcode
        if instruction.opcode == "async-start" and instruction.called("calls"):
            body = self.computations.get(instruction.called("calls")[0], [])
            if body and body[-1].opcode in _COLLECTIVES:
                return body[-1].opcode
        return None

    def describe(
        self, computation: str, instruction: Instruction, trips: int
    ) -> Kernel:
        ops, flops, category = set(), 0, "other"
        inner = (
            list(self.body_ops(instruction.called("calls")[0]))
            if instruction.opcode == "fusion" and instruction.called("calls")
            else [(computation, instruction)]
        )
        for where, op in inner:
            if op.opcode in ("parameter", "bitcast", "get-tuple-element", "tuple"):
                continue
            if op.opcode == "fusion":
                continue
            ops.add(op.opcode)
            if op.opcode == "dot":
                flops += hlo_ops.dot_flops(op, self.shapes[where])
                category = "gemm"
            elif op.opcode == "convolution":
                shapes = self.shapes[where]
                conv_flops, matmul = hlo_ops.conv_cost(
                    op.attribute("dim_labels"),
                    op.attribute("window"),
                    shapes.get(op.operands[0], ()) if op.operands else (),
                    shapes.get(op.operands[1], ()) if len(op.operands) > 1 else (),
                    op.shape,
                )
                flops += conv_flops
                if category != "gemm":
                    category = "gemm" if matmul else "conv"
        if instruction.opcode == "custom-call":
            target = (instruction.attribute("custom_call_target") or "").lower()
            ops = {f"custom-call:{target}"}
            shapes = self.shapes[computation]
            if any(t in target for t in _CONV_TARGETS):
                flops, matmul = hlo_ops.cudnn_conv_cost(instruction, shapes)
                category = "gemm" if matmul else "conv"
            elif any(t in target for t in _GEMM_TARGETS):
                category, flops = "gemm", hlo_ops.dot_flops(instruction, shapes)
            elif any(t in target for t in _PALLAS_TARGETS):
                category = "pallas"
        if instruction.opcode in _DMA:
            category = "dma"
        collective = self.collective(instruction)
        if collective is not None:
            category = "collective"
        op_name = re.search(r'op_name="([^"]*)"', instruction.attributes)
        metadata = instruction.attribute("metadata")
        hbm_bytes, carried = (
            self.collective_bytes(computation, instruction, collective)
            if collective is not None
            else (self.hbm_bytes(computation, instruction), 0)
        )
        return Kernel(
            name=instruction.name,
            category=category,
            ops=tuple(sorted(ops)),
            flops=flops,
            hbm_bytes=hbm_bytes,
            trips=trips,
            source=source_of(metadata, self.frames),
            op_name=op_name.group(1) if op_name else None,
            caller=caller_of(metadata, self.frames),
            collective_bytes=carried,
        )

    def collective_bytes(
        self, computation: str, instruction: Instruction, collective: str
    ) -> tuple[int, int]:
        """A collective's main-memory bytes and the bytes it carries.

        A ``-start``'s shape is ``((operands...), (results...), context...)``
        but an all-reduce's, which is its results; a synchronous one's is its
        results. It reads its operands and writes its results once.
        """
        shapes = self.shapes[computation]
        operands = [a for name in instruction.operands for a in shapes.get(name, ())]
        results = list(instruction.shape)
        if instruction.opcode.endswith("-start") and instruction.opcode != (
            "all-reduce-start"
        ):
            results = results[len(operands) : 2 * len(operands)]
        carried = operands if collective == "reduce-scatter" else results
        return _hbm(operands) + _hbm(results), sum(a.bytes for a in carried)

    def hbm_bytes(self, computation: str, instruction: Instruction) -> int:
        shapes = self.shapes[computation]
        operands = [shapes.get(name, ()) for name in instruction.operands]
        outputs = list(instruction.shape)
        if instruction.opcode == "custom-call" and len(outputs) > 1:
            outputs = [a for a in outputs if a.dtype not in ("u8", "s8")]  # workspace
        if instruction.opcode in _DMA:
            # The bytes moved, once, if either end is main memory.
            moved = instruction.shape[_DMA[instruction.opcode]]
            ends = [a.memory_space for a in operands[0]] + [moved.memory_space]
            return moved.bytes if 0 in ends else 0
        partial = self._partial_reads(computation, instruction)
        total = 0
        for index, operand in enumerate(operands):
            total += round(_hbm(operand) * partial.get(index, 1.0))
        root = self._fusion_root(instruction)
        if root is not None and root.opcode == "dynamic-update-slice":
            # In place: the update is written, not the whole buffer (which
            # fusion_demand counts as not read).
            update = self.shapes[instruction.called("calls")[0]].get(root.operands[1])
            return total + _hbm(update or ())
        return total + _hbm(outputs)

    def _fusion_root(self, instruction: Instruction) -> Instruction | None:
        if instruction.opcode != "fusion" or not instruction.called("calls"):
            return None
        body = self.computations.get(instruction.called("calls")[0], [])
        return body[-1] if body else None

    def _partial_reads(
        self, computation: str, instruction: Instruction
    ) -> dict[int, float]:
        """Operands read in part: operand index -> the share of it read.

        A fusion computes the elements its outputs need, so it reads of each
        operand only what they need (``hlo_ops.fusion_demand``): a
        ``slice``, ``dynamic-slice`` or ``gather`` of an operand, after any
        view or elementwise op, reads the elements of its result; slices of
        one operand add up, an operand that is also used whole is read
        whole, once. A lone slice or gather (not fused) reads its first operand the
        same way.
        """
        if instruction.opcode in hlo_ops.PARTIAL_READS:
            operand = self.shapes[computation].get(instruction.operands[0], ())
            share = hlo_ops.elements(instruction.shape) / hlo_ops.elements(operand)
            return {0: min(share, 1.0)}
        if instruction.opcode != "fusion" or not instruction.called("calls"):
            return {}
        body = self.computations.get(instruction.called("calls")[0], [])
        need = hlo_ops.fusion_demand(body)
        return {
            int(i.arguments): min(need.get(i.name, 0.0), 1.0)
            for i in body
            if i.opcode == "parameter" and need.get(i.name, 0.0) < 1.0
        }

    def trip_count(self, instruction: Instruction) -> int | None:
        """A ``while`` loop's trips, or ``None`` if unknown.

        The GPU compiler's ``known_trip_count``, else the constant the loop's
        condition compares the counter with (counters start at 0 and step by
        1 in JAX's loops).
        """
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.attributes)
        if known:
            return int(known.group(1))
        condition = instruction.called("condition")
        return self._bound(condition[0], {}) if condition else None

    def _bound(self, computation: str, arguments: dict[int, int | None]) -> int | None:
        """The constant a ``compare(..., direction=LT)`` of ``computation`` meets.

        Fusions it calls are searched too; ``arguments`` are the values of its
        parameters that are known constants.
        """
        body = self.computations.get(computation, [])
        values: dict[str, int | None] = {}
        for i in body:
            if i.opcode == "constant" and re.fullmatch(r"-?\d+", i.arguments):
                values[i.name] = int(i.arguments)
            elif i.opcode == "parameter" and i.arguments.isdigit():
                values[i.name] = arguments.get(int(i.arguments))
        for i in body:
            if i.opcode == "compare" and "direction=LT" in i.attributes:
                for operand in i.operands[1:]:
                    if values.get(operand) is not None:
                        return values[operand]
            if i.opcode == "fusion" and i.called("calls"):
                passed = {k: values.get(name) for k, name in enumerate(i.operands)}
                found = self._bound(i.called("calls")[0], passed)
                if found is not None:
                    return found
        return None

    def kernels(self, computation: str, trips: int, loops: list) -> list[Kernel]:
        found = []
        for instruction in self.computations.get(computation, []):
            if instruction.opcode in _FREE or instruction.opcode.endswith("-done"):
                continue
            if instruction.opcode in _LOOP:
                count = self.trip_count(instruction)
                loops.append((instruction.name, count))
                for body in instruction.called("body"):
                    found += self.kernels(body, trips * (count or 1), loops)
                continue
            if instruction.opcode in _CALLS:
                for key in ("to_apply", "branch_computations", "true_computation",
                            "false_computation"):  # fmt: skip
                    for called in instruction.called(key):
                        found += self.kernels(called, trips, loops)
                continue
            found.append(self.describe(computation, instruction, trips))
        return found


def parse_program(text: str) -> Program:
    """Reads a compiled program's kernels and loops from its HLO text.

    Args:
      text: the optimized HLO of one program (``compiled.as_text()``).

    Returns:
      A :class:`Program`.

    Raises:
      ValueError: if ``text`` holds no ``ENTRY`` computation.
    """
    reader = _Reader(text)
    loops: list[tuple[str, int | None]] = []
    kernels = reader.kernels(reader.entry, 1, loops)
    return Program(tuple(kernels), tuple(loops))
