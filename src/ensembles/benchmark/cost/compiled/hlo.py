"""What a compiled program does, read from its optimized HLO text.

XLA's cost analysis is missing where it matters (``None`` for a deviceless
H100 compile; on a TPU it counts a ``while`` body once), so this module reads
the program a chip's compiler wrote (``compiled.as_text()``) and counts, per
program: the kernels the chip launches (the entry computation's fusions,
custom calls and other compute instructions, and those of every ``while``
body times its trip count), which of them are matmuls or convolutions, the
loops, the matmul and convolution flops (from the shapes of every ``dot`` and
``convolution``), and the bytes each kernel moves through the chip's main
memory (HBM): its operands plus its outputs, the way XLA's own GPU cost model
counts them, leaving out buffers a TPU keeps on chip (memory spaces ``S(1)``
and up). It is a structural measure, deterministic for a given compiler: it
says nothing of caches, autotuning or launch latency (``docs/cost.md``).

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
import math
import re
from collections.abc import Iterator

from ensembles.benchmark.cost.compiled.hlo_text import (
    Array,
    Instruction,
    computations,
    source_of,
    source_table,
)

__all__ = ["Kernel", "Program", "parse_program"]

# Instructions that launch nothing: views, tuples, control, parameters, and
# the halves of asynchronous pairs that only wait.
_FREE = {
    "parameter", "constant", "bitcast", "get-tuple-element", "tuple",
    "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id",
    "copy-done", "slice-done", "all-reduce-done", "all-gather-done",
    "collective-permute-done", "async-done", "async-update", "send-done",
    "recv-done", "domain",
}  # fmt: skip
# Asynchronous copies between memory spaces (a TPU's main memory and its
# on-chip memory): data moved by a DMA engine, not a kernel. Their result is
# (destination, ...): the destination's bytes cross main memory once.
_DMA = {"copy-start": 0, "slice-start": 1}
_LOOP = {"while"}
_CALLS = {"call", "conditional"}
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
        ``"dma"`` (an asynchronous copy between memory spaces, no kernel) or
        ``"other"`` (elementwise work, reductions, copies, ...).
      ops: the opcodes of what it computes (a fusion's body), sorted.
      flops: matmul and convolution flops of one launch.
      hbm_bytes: operands plus outputs in main memory, one launch.
      trips: how many times it runs (a loop's trip count, else 1).
      source: the innermost source line its metadata names, if known.
      op_name: the JAX operation its metadata names.
    """

    name: str
    category: str
    ops: tuple[str, ...]
    flops: int
    hbm_bytes: int
    trips: int
    source: str | None
    op_name: str | None


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


def _dot_flops(instruction: Instruction, shapes: dict[str, tuple[Array, ...]]) -> int:
    lhs = shapes.get(instruction.operands[0], ())
    if not lhs or not instruction.shape:
        return 0
    contracting = instruction.attribute("lhs_contracting_dims") or "{}"
    dims = [int(d) for d in re.findall(r"\d+", contracting)]
    size = math.prod(lhs[0].dims[d] for d in dims)
    return 2 * math.prod(instruction.shape[0].dims) * size


def _window_taps(
    window: str | None, output_dims: list[int], input_extents: list[int]
) -> tuple[int, bool]:
    """Input taps a convolution's window reads over all output positions.

    Counts, per spatial dimension, the (output position, window tap) pairs
    that land on a real input element (not padding, not a hole of
    ``lhs_dilate``), and multiplies them; so a batched matmul a TPU writes as
    a base-dilated convolution counts one tap per output. Also says whether
    no output position reads more than one tap (a matmul, not a convolution).
    """
    if not window or not output_dims:
        return 1, True
    fields = dict(re.findall(r"(\w+)=([\w_x\-]+)", window.strip("{}")))
    rank = len(fields.get("size", "").split("x")) if "size" in fields else 0

    def field(name, default):
        values = fields.get(name)
        return [default] * rank if values is None else values.split("x")

    sizes = [int(v) for v in field("size", 1)]
    strides = [int(v) for v in field("stride", 1)]
    lhs_dilate = [int(v) for v in field("lhs_dilate", 1)]
    rhs_dilate = [int(v) for v in field("rhs_dilate", 1)]
    pads = [tuple(int(p) for p in v.split("_")) for v in field("pad", "0_0")]
    taps, matmul = 1, True
    for d in range(rank):
        out_size = output_dims[d]
        count = 0
        for o in range(out_size):
            for t in range(sizes[d]):
                p = o * strides[d] + t * rhs_dilate[d] - pads[d][0]
                if p >= 0 and p % lhs_dilate[d] == 0 and p <= input_extents[d]:
                    count += 1
        taps *= count
        matmul = matmul and count <= out_size
    return taps, matmul


def _conv_cost(
    instruction: Instruction, shapes: dict[str, tuple[Array, ...]]
) -> tuple[int, bool]:
    """A convolution's flops, and whether it is a matmul in disguise."""
    labels = instruction.attribute("dim_labels")
    if not labels or len(instruction.operands) < 2 or not instruction.shape:
        return 0, True
    lhs_labels, rest = labels.split("_", 1)
    rhs_labels, out_labels = rest.split("->")
    lhs = shapes.get(instruction.operands[0], ())
    rhs = shapes.get(instruction.operands[1], ())
    out = instruction.shape[0].dims
    if not lhs or not rhs or len(rhs[0].dims) != len(rhs_labels):
        return 0, True
    spatial = [c for c in out_labels if c.isdigit()]
    out_spatial = [out[out_labels.index(c)] for c in spatial]
    in_spatial = [lhs[0].dims[lhs_labels.index(c)] for c in spatial]
    lhs_dilate = re.search(
        r"lhs_dilate=([\dx]+)", instruction.attribute("window") or ""
    )
    dilation = (
        [int(v) for v in lhs_dilate.group(1).split("x")]
        if lhs_dilate
        else [1] * len(spatial)
    )
    extents = [(n - 1) * d for n, d in zip(in_spatial, dilation, strict=True)]
    taps, matmul = _window_taps(instruction.attribute("window"), out_spatial, extents)
    per_output = rhs[0].dims[rhs_labels.index("i")]
    others = out[out_labels.index("b")] * out[out_labels.index("f")]
    return 2 * others * per_output * taps, matmul


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
                flops += _dot_flops(op, self.shapes[where])
                category = "gemm"
            elif op.opcode == "convolution":
                conv_flops, matmul = _conv_cost(op, self.shapes[where])
                flops += conv_flops
                if category != "gemm":
                    category = "gemm" if matmul else "conv"
        if instruction.opcode == "custom-call":
            target = (instruction.attribute("custom_call_target") or "").lower()
            ops = {f"custom-call:{target}"}
            shapes = self.shapes[computation]
            if any(t in target for t in _CONV_TARGETS):
                flops, matmul = _conv_cost(instruction, shapes)
                category = "gemm" if matmul else "conv"
            elif any(t in target for t in _GEMM_TARGETS):
                category, flops = "gemm", _dot_flops(instruction, shapes)
            elif any(t in target for t in _PALLAS_TARGETS):
                category = "pallas"
        if instruction.opcode in _DMA:
            category = "dma"
        op_name = re.search(r'op_name="([^"]*)"', instruction.attributes)
        return Kernel(
            name=instruction.name,
            category=category,
            ops=tuple(sorted(ops)),
            flops=flops,
            hbm_bytes=self.hbm_bytes(computation, instruction),
            trips=trips,
            source=source_of(instruction.attribute("metadata"), self.frames),
            op_name=op_name.group(1) if op_name else None,
        )

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
        sliced = self._sliced_parameters(instruction)
        total = 0
        for index, operand in enumerate(operands):
            if index in sliced:
                total += sliced[index]
            else:
                total += sum(a.bytes for a in operand if a.memory_space == 0)
        root = self._fusion_root(instruction)
        if root is not None and root.opcode == "dynamic-update-slice":
            # In place: the update is written, not the whole buffer (which
            # _sliced_parameters counts as not read).
            update = self.shapes[instruction.called("calls")[0]].get(root.operands[1])
            return total + sum(a.bytes for a in update or () if a.memory_space == 0)
        return total + sum(a.bytes for a in outputs if a.memory_space == 0)

    def _fusion_root(self, instruction: Instruction) -> Instruction | None:
        if instruction.opcode != "fusion" or not instruction.called("calls"):
            return None
        body = self.computations.get(instruction.called("calls")[0], [])
        return body[-1] if body else None

    def _sliced_parameters(self, instruction: Instruction) -> dict[int, int]:
        """Fusion operands read only through ``dynamic-slice``: bytes read."""
        if instruction.opcode != "fusion" or not instruction.called("calls"):
            return {}
        body = self.computations.get(instruction.called("calls")[0], [])
        parameters = {i.name: int(i.arguments) for i in body if i.opcode == "parameter"}
        users: dict[str, list[Instruction]] = {}
        for i in body:
            for operand in i.operands:
                users.setdefault(operand, []).append(i)
        sliced = {}
        for name, index in parameters.items():
            uses = users.get(name, [])
            if uses and all(
                u.opcode == "dynamic-slice" and u.operands[0] == name for u in uses
            ):
                sliced[index] = sum(
                    a.bytes for u in uses for a in u.shape if a.memory_space == 0
                )
            elif uses and all(
                u.opcode == "dynamic-update-slice" and u.operands[0] == name
                for u in uses
            ):
                sliced[index] = 0  # the in-place buffer: counted with the update
        return sliced

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
            if instruction.opcode in _FREE:
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
