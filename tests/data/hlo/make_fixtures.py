"""Writes the saved optimized programs ``tests/test_hlo_parser.py`` reads.

Each fixture is a real deviceless compile (docs/cost.md: an H100 from
``jax-cuda12-plugin``/``jax-cuda12-pjrt``, 8 H100s as the CUDA plugin's
``1x1x8`` topology, a TPU v5e 2x2 from libtpu), its ``compiled.as_text()``
cut down to the instructions a test is about: those entry instructions as
printed (less their ``backend_config``, tuning data nothing reads), every
operand they take from an instruction left out turned into a ``parameter``
of the same shape, the computations they call, and the module's stack-frame
tables. Run from the repository root with the compilers installed (tox.ini's
compile envs)::

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 \\
        python tests/data/hlo/make_fixtures.py

The tests' expected figures are worked out by hand from the shapes, so a
fixture written again by another compiler must be checked by hand too.
"""

from __future__ import annotations

import functools
import importlib.resources
import pathlib
import re

import jax
import jax.numpy as jnp
from flax import nnx

HERE = pathlib.Path(__file__).parent
_CALL_KEYS = (
    "calls",
    "to_apply",
    "condition",
    "body",
    "branch_computations",
    "true_computation",
    "false_computation",
)


class Block(nnx.Module):
    """A block whose projections a report must tell apart: query, key, up."""

    def __init__(self, width: int, rngs: nnx.Rngs):
        self.query = nnx.Linear(width, width, rngs=rngs)
        self.key = nnx.Linear(width, width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, rngs=rngs)

    def __call__(self, x):
        q = self.query(x)
        k = self.key(x)
        return self.up(jax.nn.relu(q * k))


def _blocks(text: str) -> tuple[dict[str, list[str]], str, list[str], list[str]]:
    """Computations' lines by name, the entry's name, the header, the tables."""
    from ensembles.benchmark.cost.compiled.hlo_text import _HEADER

    blocks: dict[str, list[str]] = {}
    entry, current, header, tables, in_tables = None, None, [], [], False
    for line in text.splitlines():
        match = _HEADER.match(line)
        if match:
            current, in_tables = match.group(2), False
            blocks[current] = [line]
            entry = current if match.group(1) else entry
        elif current is not None:
            blocks[current].append(line)
            if line.strip() == "}":
                current = None
        elif line == "FileNames" or in_tables:
            in_tables = True
            tables.append(line)
        elif line.startswith("HloModule"):
            header = [line.split(",")[0]]
    while tables and not tables[-1].strip():
        tables.pop()
    return blocks, entry, header, tables


def _shape_text(line: str) -> str:
    """The shape an instruction's line prints, as printed."""
    from ensembles.benchmark.cost.compiled.hlo_text import _balanced

    start = line.index(" = ") + 3
    end = _balanced(line, start) if line[start] == "(" else line.index(" ", start)
    return line[start:end]


def trim(text: str, keep: list[str], note: str) -> str:
    """``text`` cut down to the entry instructions named in ``keep``."""
    from ensembles.benchmark.cost.compiled.hlo_text import parse_instruction

    text = re.sub(r", backend_config=\{.*\}$", "", text, flags=re.M)
    blocks, entry, header, tables = _blocks(text)
    entry_lines = {}
    for line in blocks[entry][1:-1]:
        instruction = parse_instruction(line)
        if instruction is not None:
            entry_lines[instruction.name] = line
    kept = [entry_lines[name].replace("ROOT ", "") for name in keep]
    parameters: dict[str, str] = {}
    needed: list[str] = []
    for line in kept:
        instruction = parse_instruction(line)
        for operand in instruction.operands:
            if operand not in keep and operand not in parameters:
                parameters[operand] = _shape_text(entry_lines[operand])
        for key in _CALL_KEYS:
            needed += instruction.called(key)
    computations, seen = [], set()
    while needed:
        name = needed.pop()
        if name in seen or name not in blocks:
            continue
        seen.add(name)
        computations.insert(0, "\n".join(blocks[name]))
        for line in blocks[name][1:-1]:
            instruction = parse_instruction(line)
            if instruction is not None:
                for key in _CALL_KEYS:
                    needed += instruction.called(key)
    body = [
        f"  %{name} = {shape} parameter({index})"
        for index, (name, shape) in enumerate(parameters.items())
    ] + kept
    return "\n".join(
        [
            *header,
            *(f"// {line.strip()}" for line in note.strip().splitlines()),
            "",
            *tables,
            "",
            "\n\n".join(computations),
            "",
            "ENTRY %main () -> () {",
            *body,
            "}",
            "",
        ]
    )


@functools.cache
def _topology(name: str):
    from jax.experimental import topologies

    if name.startswith("h100"):
        config = (
            importlib.resources.files("ensembles.benchmark")
            / "data"
            / "h100_target_config.txtpb"
        ).read_text()
        return topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=name.split(":")[1]
        )
    return topologies.get_topology_desc(name, platform="tpu")


def _compile(fn, specs, topology: str, devices: int = 1, sharding=None) -> str:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(_topology(topology).devices[:devices], ("d",))
    sharding = sharding or (lambda spec: PartitionSpec())
    placed = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=NamedSharding(mesh, sharding(s))
        ),
        specs,
    )
    with jax.set_mesh(mesh):
        return jax.jit(fn).trace(*placed).lower().compile().as_text()


def _benchmark(model: str, mode: str, method: str, **options) -> str:
    """A program of ``ensembles-bench --compiled-for h100``, as the tier's."""
    from ensembles.benchmark.cost.compiled import chips
    from ensembles.benchmark.cost.compiled.programs import model_programs

    fn, specs, donate, _ = model_programs(model, mode, **options)[method]
    compiled, _ = chips.compile_for("h100", fn, specs, donate_argnums=donate)
    return compiled.as_text()


def convolutions() -> None:
    """The plain CNN's train step, H100: cuDNN's forward and backward calls."""
    text = _benchmark("cnn", "train", "single", num_members=4, batch=64)
    keep = [
        line.split(" = ")[0].strip().lstrip("%")
        for line in text.splitlines()
        if "custom-call(" in line and "__cudnn$conv" in line
    ]
    note = """
    The benchmark's plain CNN (3x3 convs 3->16, 16->32 stride 2, 32->32
    stride 2 on 32x32 images), an AdamW train step of 256 rows, float32,
    compiled for an H100 (jax 0.10.2): its cuDNN convolution calls only.
    """
    (HERE / "h100_cnn_train_convolutions.hlo").write_text(trim(text, keep, note))


def loss_gathers() -> None:
    """The dense layer's train step, H100: the loss fusion's gather, both models."""
    for method, name in (("single", "plain"), ("batchensemble", "batchensemble")):
        text = _benchmark(
            "linear", "train", method, num_members=4, batch=256, width=1024
        )
        note = f"""
        ensembles-bench's dense layer (1024 x 1024, E4 B256: 1024 rows),
        {name}, an AdamW train step, float32, compiled for an H100 (jax
        0.10.2): the loss fusion that reads each row's logit at its label
        (take_along_axis: a gather) of the layer's output.
        """
        (HERE / f"h100_dense_train_loss_{name}.hlo").write_text(
            trim(text, ["loop_subtract_fusion"], note)
        )


def attention_slices() -> None:
    """Flax's attention, H100: q, k and v from one GEMM, read a third each."""

    class Attention(nnx.Module):
        def __init__(self, rngs):
            self.attention = nnx.MultiHeadAttention(4, 64, decode=False, rngs=rngs)

        def __call__(self, x):
            return self.attention(x)

    graphdef, params = nnx.split(nnx.eval_shape(lambda: Attention(nnx.Rngs(0))))
    specs = [
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params),
        jax.ShapeDtypeStruct((8, 16, 64), jnp.float32),
    ]
    text = _compile(lambda p, x: nnx.merge(graphdef, p)(x), specs, "h100:1x1x1")
    gemm = re.search(r"%(gemm_fusion_dot[.\d]*) = f32\[4,128,192\]", text).group(1)
    readers = re.findall(
        rf"%([\w.\-]+) = f32\[8,4,16,16\]\S* fusion\([^)]*%{re.escape(gemm)}\b", text
    )
    note = """
    nnx.MultiHeadAttention (4 heads of 16, width 64) on [8, 16, 64], forward,
    float32, compiled for an H100 (jax 0.10.2): XLA merges the q, k and v
    projections into one GEMM (split in 4 along k: [4, 128, 192] partials)
    and each of three fusions reduces and slices its third of it.
    """
    (HERE / "h100_attention_qkv.hlo").write_text(trim(text, [gemm, *readers], note))


def _collectives_program(topology: str, devices: int) -> str:
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(_topology(topology).devices[:devices], ("d",))
    ring = [(i, (i + 1) % devices) for i in range(devices)]

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P("d"), P("d")),
        out_specs=(P(), P("d"), P("d"), P("d"), P()),
    )
    def step(x, w):
        full_w = jax.lax.all_gather(w, "d", tiled=True)
        y = x @ full_w[:128]
        return (
            jax.lax.psum(jnp.sum(y, 0), "d"),
            jax.lax.psum_scatter(y, "d", tiled=True),
            jax.lax.all_to_all(y, "d", 0, 0, tiled=True),
            jax.lax.ppermute(y, "d", ring),
            jax.lax.psum(jnp.sum(x), "d"),
        )

    specs = [
        jax.ShapeDtypeStruct((devices * 64, 128), jnp.float32),
        jax.ShapeDtypeStruct((devices * 128, 128), jnp.float32),
    ]
    return _compile(step, specs, topology, devices, lambda s: P("d"))


def collectives() -> None:
    """Every collective, on 8 H100s and a v5e 2x2: shard_map's, whole."""
    for topology, devices, name in (
        ("h100:1x1x8", 8, "h100x8"),
        ("v5e:2x2", 4, "v5e2x2"),
    ):
        text = _collectives_program(topology, devices)
        note = f"""
        A shard_map over {devices} devices ({name}, jax 0.10.2) of x [64, 128]
        and w [128, 128] a device: all_gather(w) (tiled), y = x @ w_all[:128],
        psum(sum(y, 0)), psum_scatter(y), all_to_all(y), ppermute(y) (a
        ring), psum(sum(x)). The whole program.
        """
        blocks, entry, _, _ = _blocks(text)
        keep = [
            line.split(" = ")[0].strip().removeprefix("ROOT ").lstrip("%")
            for line in blocks[entry][1:-1]
            if " parameter(" not in line
        ]
        (HERE / f"{name}_collectives.hlo").write_text(trim(text, keep, note))


def callers() -> None:
    """A converted block's forward, H100: three projections, one source line."""
    import ensembles

    def build():
        return ensembles.to_batch_ensemble(
            Block(64, nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(1)
        )

    graphdef, params = nnx.split(nnx.eval_shape(build))
    specs = [
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params),
        jax.ShapeDtypeStruct((16, 64), jnp.float32),
    ]
    text = _compile(lambda p, x: nnx.merge(graphdef, p)(x), specs, "h100:1x1x1")
    blocks, entry, _, _ = _blocks(text)
    keep = [
        line.split(" = ")[0].strip().removeprefix("ROOT ").lstrip("%")
        for line in blocks[entry][1:-1]
        if " parameter(" not in line
    ]
    note = """
    make_fixtures.Block (query, key: 64 -> 64; up: 64 -> 128 of relu(q * k))
    converted with to_batch_ensemble(num_members=2), forward of [16, 64],
    float32, compiled for an H100 (jax 0.10.2): the whole program.
    """
    (HERE / "h100_block_callers.hlo").write_text(trim(text, keep, note))


if __name__ == "__main__":
    convolutions()
    loss_gathers()
    attention_slices()
    collectives()
    callers()
