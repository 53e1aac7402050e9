"""What one instruction of an optimized HLO costs: flops, and reads.

The arithmetic :mod:`~ensembles.benchmark.cost.compiled.hlo` counts a
program's kernels with: a ``dot``'s and a ``convolution``'s flops (a cuDNN
convolution call's from the convolution its kind computes: a backward call's
operands play other roles than a forward's), and the share of each of a
fusion's operands its outputs need, which is what it reads of them (a slice
or gather reads only what it takes).

>>> from ensembles.benchmark.cost.compiled.hlo_text import parse_instruction
>>> dot = parse_instruction(
...     "  %d = f32[8,2]{1,0} dot(%x, %w), lhs_contracting_dims={1}")
>>> x = parse_instruction("  %x = f32[8,4]{1,0} parameter(0)")
>>> dot_flops(dot, {"x": x.shape})
128
"""

from __future__ import annotations

import math
import re

from ensembles.benchmark.cost.compiled.hlo_text import Array, Instruction

__all__ = [
    "PARTIAL_READS",
    "conv_cost",
    "cudnn_conv_cost",
    "dot_flops",
    "elements",
    "fusion_demand",
]

# Reads of part of their first operand: the elements of their result.
PARTIAL_READS = {"slice", "dynamic-slice", "gather"}
# Ops that read their operands whole, whichever of their elements are needed
# (where an operand's size is the result's, any other op reads of it what is
# needed of the result).
_WHOLE_READS = {
    "dot", "convolution", "sort", "scatter", "fft", "custom-call",
    "reduce-window", "select-and-scatter", "cholesky", "triangular-solve",
    "fusion", "call", "while", "conditional", "rng", "rng-bit-generator",
}  # fmt: skip


def dot_flops(instruction: Instruction, shapes: dict[str, tuple[Array, ...]]) -> int:
    """A ``dot``'s (or a cuBLAS call's) flops: 2 x output x contracted size."""
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


def conv_cost(
    labels: str | None,
    window: str | None,
    lhs: tuple[Array, ...],
    rhs: tuple[Array, ...],
    out: tuple[Array, ...],
) -> tuple[int, bool]:
    """A convolution's flops, and whether it is a matmul in disguise.

    ``lhs``, ``rhs`` and ``out`` are the shapes of the convolution
    ``dim_labels`` and ``window`` describe: its input, its kernel, its output.
    """
    if not labels or not lhs or not rhs or not out:
        return 0, True
    lhs_labels, rest = labels.split("_", 1)
    rhs_labels, out_labels = rest.split("->")
    if len(rhs[0].dims) != len(rhs_labels) or len(out[0].dims) != len(out_labels):
        return 0, True
    spatial = [c for c in out_labels if c.isdigit()]
    out_spatial = [out[0].dims[out_labels.index(c)] for c in spatial]
    in_spatial = [lhs[0].dims[lhs_labels.index(c)] for c in spatial]
    lhs_dilate = re.search(r"lhs_dilate=([\dx]+)", window or "")
    dilation = (
        [int(v) for v in lhs_dilate.group(1).split("x")]
        if lhs_dilate
        else [1] * len(spatial)
    )
    extents = [(n - 1) * d for n, d in zip(in_spatial, dilation, strict=True)]
    taps, matmul = _window_taps(window, out_spatial, extents)
    per_output = rhs[0].dims[rhs_labels.index("i")]
    others = out[0].dims[out_labels.index("b")] * out[0].dims[out_labels.index("f")]
    return 2 * others * per_output * taps, matmul


def cudnn_conv_cost(
    instruction: Instruction, shapes: dict[str, tuple[Array, ...]]
) -> tuple[int, bool]:
    """A cuDNN convolution call's flops, from the convolution it computes.

    The call's ``dim_labels`` and ``window`` are those of the forward
    convolution (input, kernel -> output) in every kind; what the kind
    changes is which of the call's operands and result is which: a
    backward-filter call takes (input, output gradient) and returns the
    kernel's gradient, a backward-input call takes (output gradient, kernel)
    and returns the input's. Each costs the forward convolution's flops.
    """
    target = (instruction.attribute("custom_call_target") or "").lower()
    operands = [shapes.get(name, ()) for name in instruction.operands[:2]]
    if len(operands) < 2:
        return 0, True
    result = instruction.shape[:1]
    if "backwardfilter" in target:
        lhs, rhs, out = operands[0], result, operands[1]
    elif "backwardinput" in target:
        lhs, rhs, out = result, operands[1], operands[0]
    else:  # the forward, fused with a bias, activation or side input or not
        lhs, rhs, out = operands[0], operands[1], result
    return conv_cost(
        instruction.attribute("dim_labels"),
        instruction.attribute("window"),
        lhs,
        rhs,
        out,
    )


def elements(arrays: tuple[Array, ...]) -> int:
    """The elements of a (possibly tuple) shape; 1 for none."""
    return sum(math.prod(a.dims) for a in arrays) or 1


def fusion_demand(body: list[Instruction]) -> dict[str, float]:
    """The share of each instruction's elements a fusion's outputs need.

    Its root's (and a multi-output root's parts') elements are all needed;
    from each user to its operands, users first: a slice, dynamic slice or
    gather needs of its first operand the elements of its result; a
    reduction, a view or an elementwise op (an operand of the result's
    size) needs the share of it that is needed of its result; the buffer
    that the root's ``dynamic-update-slice`` updates in place is not read;
    any other operand (a dot's, a broadcast's, a gather's indices...) is
    needed whole. Shares of several users add up.
    """
    if not body:
        return {}
    by_name = {i.name: i for i in body}
    root = body[-1]
    order: list[Instruction] = []  # operands before their users
    seen: set[str] = set()
    stack = [(root, False)]
    while stack:
        instruction, visited = stack.pop()
        if visited:
            order.append(instruction)
        elif instruction.name not in seen:
            seen.add(instruction.name)
            stack.append((instruction, True))
            operands = [by_name[o] for o in instruction.operands if o in by_name]
            stack.extend((operand, False) for operand in operands)
    in_place = {root.name, *(root.operands if root.opcode == "tuple" else ())}
    need = {root.name: 1.0}
    for instruction in reversed(order):
        share_of_result = min(need.get(instruction.name, 0.0), 1.0)
        if share_of_result == 0.0:
            continue
        size = elements(instruction.shape)
        inputs = len(instruction.operands) // 2  # a reduce's arrays, then inits
        for index, operand in enumerate(instruction.operands):
            if operand not in by_name:
                continue
            count = elements(by_name[operand].shape)
            if instruction.opcode in PARTIAL_READS and index == 0:
                share = share_of_result * size / count
            elif instruction.opcode == "dynamic-update-slice" and index == 0:
                share = 0.0 if instruction.name in in_place else share_of_result
            elif (instruction.opcode == "reduce" and index < inputs) or (
                instruction.opcode not in _WHOLE_READS and count == size
            ):
                share = share_of_result
            else:
                share = 1.0
            need[operand] = need.get(operand, 0.0) + share
    return need
