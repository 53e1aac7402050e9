"""Optimized HLO text, read: computations of instructions, shapes, source lines.

What :mod:`~ensembles.benchmark.cost.compiled.hlo` counts kernels, flops and
bytes from. It reads the text XLA prints for a compiled program
(``compiled.as_text()``): one computation per block, ``ENTRY`` the
program's own, each instruction as ``%name = shape opcode(operands),
attributes``, and the module's tables of source locations
(``stack_frame_id`` in an instruction's metadata), each frame with its
caller's, so a kernel can be named by the model's own line as well as the
op's.

>>> instruction = parse_instruction(
...     "  %d = f32[8,2]{1,0} dot(%x, %w), lhs_contracting_dims={1}")
>>> instruction.opcode, instruction.operands, instruction.shape[0].bytes
('dot', ('x', 'w'), 64)
>>> instruction.attribute("lhs_contracting_dims")
'{1}'
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = [
    "Array",
    "Frame",
    "Instruction",
    "caller_of",
    "computations",
    "parse_instruction",
    "source_of",
    "source_table",
]

_DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "f8e4m3": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
    "c64": 8, "c128": 16, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of a shape: dtype, dimensions, memory space (0: main memory)."""

    dtype: str
    dims: tuple[int, ...]
    memory_space: int

    @property
    def bytes(self) -> int:
        """Its size (an unknown dtype counts 4 bytes an element)."""
        return _DTYPE_BYTES.get(self.dtype, 4) * math.prod(self.dims)


def _arrays(shape_text: str) -> tuple[Array, ...]:
    """Every array of a (possibly tuple) shape, in order."""
    arrays = []
    for dtype, dims, layout in _ARRAY.findall(shape_text):
        space = re.search(r"S\((\d+)\)", layout or "")
        arrays.append(
            Array(
                dtype,
                tuple(int(d) for d in dims.split(",") if d),
                int(space.group(1)) if space else 0,
            )
        )
    return tuple(arrays)


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket group opening at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack: list[str] = []
    i = start
    while i < len(text):
        c = text[i]
        if c == '"':  # a quoted string may hold brackets: skip it
            i += 1
            while i < len(text) and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    return len(text)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its name, opcode, shape, operands and attributes."""

    name: str
    opcode: str
    shape: tuple[Array, ...]
    operands: tuple[str, ...]
    arguments: str
    attributes: str

    def attribute(self, key: str) -> str | None:
        """The text of attribute ``key`` (``calls``, ``kind``, ...), or ``None``."""
        match = re.search(rf"(?:^|, ){re.escape(key)}=", self.attributes)
        if match is None:
            return None
        start = match.end()
        if start < len(self.attributes) and self.attributes[start] in '{("[':
            if self.attributes[start] == '"':
                return self.attributes[
                    start + 1 : self.attributes.index('"', start + 1)
                ]
            return self.attributes[start : _balanced(self.attributes, start)]
        end = self.attributes.find(", ", start)
        return self.attributes[start : end if end >= 0 else None]

    def called(self, key: str) -> list[str]:
        """The computations named by attribute ``key`` (``calls``, ``body``...)."""
        value = self.attribute(key)
        return re.findall(r"%?([\w.\-]+)", value.strip("{}")) if value else []


def parse_instruction(line: str) -> Instruction | None:
    """One line of a computation as an :class:`Instruction`, or ``None``."""
    name = _NAME.match(line)
    if name is None:
        return None
    i = name.end()
    end = _balanced(line, i) if line[i] == "(" else line.index(" ", i)
    shape = _arrays(line[i:end])
    rest = line[end:].lstrip()
    opcode = re.match(r"[\w\-]+", rest).group(0)
    open_paren = len(opcode)
    close = _balanced(rest, open_paren)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[open_paren:close]))
    if not operands and opcode != "constant":  # printed without %: `f32[2] x`
        operands = tuple(
            token.split()[-1]
            for token in rest[open_paren + 1 : close - 1].split(", ")
            if token and not token[0].isdigit()
        )
    attributes = rest[close:].lstrip(", ")
    arguments = rest[open_paren + 1 : close - 1]
    return Instruction(name.group(1), opcode, shape, operands, arguments, attributes)


def computations(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Every computation of a module's text by name, and the entry's name.

    Raises:
      ValueError: if the text holds no ``ENTRY`` computation.
    """
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        instruction = parse_instruction(line)
        if instruction is not None:
            computations[current].append(instruction)
    if entry is None:
        raise ValueError("the HLO text has no ENTRY computation")
    return computations, entry


@dataclasses.dataclass(frozen=True)
class Frame:
    """One frame of the module's stack-frame table.

    Attributes:
      file: the source file's path as recorded.
      line: the line of the call.
      function: the function the line is in.
      parent: the frame of the function's caller (0: none).
    """

    file: str
    line: str
    function: str
    parent: int

    def __str__(self) -> str:
        return f"{_short_path(self.file)}:{self.line} ({self.function})"


def source_table(text: str) -> dict[int, Frame]:
    """``stack_frame_id`` -> :class:`Frame`, from the module's tables."""
    sections: dict[str, dict[int, str]] = {}
    section = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            sections[section] = {}
            continue
        if section is None:
            continue
        match = re.match(r"^(\d+) (.*)$", line)
        if match is None:
            if sections.get(section):
                section = None
            continue
        sections[section][int(match.group(1))] = match.group(2)
    files = {k: v.strip('"') for k, v in sections.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in sections.get("FunctionNames", {}).items()}
    locations = {}
    for k, v in sections.get("FileLocations", {}).items():
        fields = dict(re.findall(r"(\w+)=(\d+)", v))
        locations[k] = (
            files.get(int(fields.get("file_name_id", 0)), "?"),
            fields.get("line", "?"),
            functions.get(int(fields.get("function_name_id", 0)), "?"),
        )
    stack = {
        k: {name: int(value) for name, value in re.findall(r"(\w+)=(\d+)", v)}
        for k, v in sections.get("StackFrames", {}).items()
    }
    # XLA (jax 0.10 and 0.12 at least) prints a frame's parent one above
    # its 1-based id (0: none), so frame 1, a root, names itself. A parent
    # precedes its children, so no frame names itself in a table printed
    # plainly (frame 1's parent 0), which is read as printed.
    shift = int(any(f.get("parent_frame_id") == k for k, f in stack.items()))
    frames = {}
    for k, fields in stack.items():
        file, line, function = locations.get(
            fields.get("file_location_id", 0), ("?", "?", "?")
        )
        parent = fields.get("parent_frame_id", 0) - shift
        frames[k] = Frame(file, line, function, parent if 0 < parent < k else 0)
    return frames


def _short_path(path: str) -> str:
    for marker in ("/site-packages/", "/src/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


# Where the library's own code and the frameworks' run: a caller is the
# innermost frame outside them. The benchmark's models and steps
# (ensembles/benchmark/) stand where a user's model would.
_INTERNAL = ("ensembles/", "jax/", "jaxlib/", "flax/", "optax/")
_NOT_INTERNAL = ("ensembles/benchmark/",)


def _internal(path: str) -> bool:
    short = _short_path(path)
    return short.startswith(_INTERNAL) and not short.startswith(_NOT_INTERNAL)


def source_of(metadata: str | None, frames: dict[int, Frame]) -> str | None:
    """The innermost source line an instruction's metadata names, if any."""
    if not metadata:
        return None
    file = re.search(r'source_file="([^"]*)"', metadata)
    line = re.search(r"source_line=(\d+)", metadata)
    if file and line:
        return f"{_short_path(file.group(1))}:{line.group(1)}"
    frame = re.search(r"stack_frame_id=(\d+)", metadata)
    if frame and int(frame.group(1)) in frames:
        return str(frames[int(frame.group(1))])
    return None


def caller_of(metadata: str | None, frames: dict[int, Frame]) -> str | None:
    """The model's own line that led to an instruction, if known.

    The innermost frame of its stack outside the library (its benchmark's
    models aside), JAX, Flax and optax. Where the layers' kernels all share
    one source line (``ops/dense.py``'s formula), this one tells the layers
    apart: ``models.py:57 (Block.__call__)``, the line that called the query
    projection. ``None`` where every frame is internal or none is known.
    """
    if not metadata:
        return None
    frame = re.search(r"stack_frame_id=(\d+)", metadata)
    if frame is None:
        file = re.search(r'source_file="([^"]*)"', metadata)
        source = source_of(metadata, frames)
        return source if file and not _internal(file.group(1)) else None
    current = int(frame.group(1))
    while current in frames:
        if not _internal(frames[current].file):
            return str(frames[current])
        current = frames[current].parent
    return None
