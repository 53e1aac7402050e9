"""The compile tier on machines of several chips: one model's cost per device, pinned.

For 8 H100s (the CUDA plugin's ``1x1x8`` topology) and TPU slices (v5e and
v4, 4 chips), the default path's compiled programs
(``ensembles.benchmark.cost.compiled.programs``, ``mesh=``) against the plain
model's on the same ``E*B`` rows, placed alike: the rows over the mesh,
parameters replicated (data parallelism) or the BatchEnsemble's per-member
arrays over a ``model`` axis (``to_batch_ensemble(member_axis="model")``,
the rows over it first). E = 3 (rows straddling members: 8 devices of 96
rows, members of 256), 4 and 8. The figures are one device's. A transformer
(``benchmarks/small_transformer.py``) one chip and sharded. What is checked:

* the targets (``docs/cost.md``), relative to the plain program the same
  compiler wrote: flops, matmul and convolution kernels, no loop the plain
  program lacks, the collectives' bytes at most the plain model's plus the
  BatchEnsemble's own parameters' (the fast weights' and per-member biases'
  gradients), and the bytes through main memory within their bounds;
* the figures of each jax version, pinned in
  ``compiled_cost_sharded_pins.json`` (``python -m
  tests.experimental.test_compiled_cost_sharded --write``): exact flops,
  kernels, loops and collectives, bytes to 1%.

And a one-device program compiled on a machine of 8 H100s is the one-device
program. Marked ``compile``: ``tox -e compile-oldest`` / ``compile-newest``.
"""

import json
import pathlib
import sys

import jax
import pytest
from benchmarks.small_transformer import small_transformer, transformer_512
from jax.sharding import NamedSharding, PartitionSpec

from ensembles.benchmark.cost.compiled import chips as compiled_chips
from ensembles.benchmark.cost.compiled import hlo
from ensembles.benchmark.cost.compiled.programs import compare_programs, model_programs
from tests.experimental import chips

pytestmark = pytest.mark.compile

PINS = pathlib.Path(__file__).with_name("compiled_cost_sharded_pins.json")
H100_NODE = {"data": 8}
TPU_SLICE = {"data": 4}
MEMBERS = {"data": 2, "model": 4}
TRANSFORMERS = {
    "transformer": (small_transformer, (16, 64)),
    "transformer_512": (transformer_512, (128, 512)),
}
# (name, model, options, chip, mesh, member_axis, modes, dtypes, members).
# Chosen to keep the tier's time (each case's compiles take 5-70 s here):
# docs/cost.md has the whole grid (E = 3, 4, 8 everywhere, both dtypes).
CASES = [
    ("mlp", "mlp", {"batch": 256}, "h100", H100_NODE, None,
     ("train",), ("float32",), (3, 4, 8)),
    ("mlp", "mlp", {"batch": 256}, "h100", H100_NODE, None,
     ("train",), ("bfloat16",), (3,)),
    ("dense_1024", "linear", {"batch": 256, "width": 1024}, "h100", H100_NODE, None,
     ("train",), ("float32",), (3, 4)),
    ("cnn", "cnn", {"batch": 64}, "h100", H100_NODE, None,
     ("train",), ("float32",), (3, 8)),
    ("mlp_members", "mlp", {"batch": 256}, "h100", MEMBERS, "model",
     ("train",), ("float32",), (4, 8)),
    ("transformer", "transformer", {"batch": 32}, "h100", H100_NODE, None,
     ("train",), ("bfloat16",), (3,)),
    ("transformer_512", "transformer_512", {"batch": 32}, "h100", None, None,
     ("forward", "train"), ("bfloat16",), (4,)),
    ("mlp", "mlp", {"batch": 256}, "v5e", TPU_SLICE, None,
     ("train",), ("float32",), (3,)),
    ("mlp", "mlp", {"batch": 256}, "v4", TPU_SLICE, None,
     ("train",), ("float32",), (3,)),
]  # fmt: skip

# The bounds on the BatchEnsemble's program over the plain one's (one
# device's), by chip kind; (name, E) entries override. docs/cost.md says why
# each override stands where it does.
FLOPS = {"cnn": 1.07}  # the first layer's input-gradient convolution
EXTRA_MATMULS = {("cnn", "train"): 1, ("transformer", "forward"): 4,
                 ("transformer", "train"): 8, ("transformer_512", "forward"): 4,
                 ("transformer_512", "train"): 8}  # fmt: skip
BYTES = {"h100": 1.30, "tpu": 1.05}
# The collectives may carry the BatchEnsemble's own parameters this many
# times beyond the plain model's (once: their gradients). Members over a
# `model` axis of 4 with the rows over 8 devices: each device also gathers
# the fast weights it scales its groups by, 0.12 MB (the partitioner cannot
# see that its groups' members are its own; docs/cost.md).
OWN_PARAMETER_TRIPS = {("mlp_members", 4): 2.5}
# On jax 0.12 the one all-reduce carries the fast weights' gradients twice
# (read off the programs, 2026-11-29: 8.46 MB against the plain 8.40 MB for
# the 1024 x 1024 dense layer at E = 3, 2 x 32 KB; jax 0.10.2 carries them
# once), and members over `model` 3.1 times: not met, docs/cost.md.
OWN_PARAMETER_TRIPS_JAX_0_12 = {("mlp_members", 4): 3.1}
BYTES_CASES = {
    # Each device forms its 3 groups' kernel gradients (E=3 on 8: 24 groups).
    ("dense_1024", 3): 1.60,
    ("cnn", 3): 1.45,
    ("cnn", 8): 1.32,
    # The blocks' hidden dense layers' reductions (docs/cost.md): 1.33-1.36x
    # on jax 0.10.2, 1.45x on jax 0.12 (not met: the target is 1.30x).
    ("transformer", None): 1.40,
    ("transformer_512", None): 1.46,
}


def _kind(chip):
    return "h100" if chip == "h100" else "tpu"


def _version():
    return ".".join(jax.__version__.split(".")[:2])


def _own_parameter_trips(name, num_members):
    """How many times the collectives may carry the BatchEnsemble's own parameters."""
    if tuple(int(part) for part in _version().split(".")) >= (0, 12):
        return OWN_PARAMETER_TRIPS_JAX_0_12.get((name, num_members), 2)
    return OWN_PARAMETER_TRIPS.get((name, num_members), 1)


def _layout(mesh, member_axis):
    if mesh is None:
        return "one"
    axes = ",".join(f"{a}={n}" for a, n in mesh.items())
    return axes + (f"+members:{member_axis}" if member_axis else "")


def _key(name, chip, mesh, member_axis, mode, dtype, num_members):
    return f"{chip}/{_layout(mesh, member_axis)}/{name}/{mode}/{dtype}/E{num_members}"


def _model(name):
    if name in TRANSFORMERS:
        factory, shape = TRANSFORMERS[name]
        return factory, {"input_shape": shape}
    return name, {}


def _own_parameter_bytes(model, options, dtype, num_members):
    """The bytes of the BatchEnsemble's parameters beyond the plain model's."""
    factory, extra = _model(model)
    programs = model_programs(
        factory, "forward", num_members=num_members, dtype=dtype, **options, **extra
    )

    def size(specs):
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(specs))

    return size(programs["batchensemble"][1][0]) - size(programs["single"][1][0])


def _compare(case, mode, dtype, num_members):
    _, model, options, chip, mesh, member_axis, *_ = case
    chips.mesh(chip)  # skips (fails in the tier) without the chip's compiler
    factory, extra = _model(model)
    return compare_programs(
        factory,
        mode,
        chip=chip,
        dtype=dtype,
        num_members=num_members,
        mesh=mesh,
        member_axis=member_axis,
        **{**options, **extra},
    )


def _figures(comparison):
    ensemble, plain = comparison.ensemble, comparison.plain
    return {
        "flops": ensemble.flops,
        "launches": ensemble.launches,
        "matmul_launches": ensemble.matmul_launches,
        "loops": ensemble.loops,
        "hbm_bytes": ensemble.hbm_bytes,
        "collectives": ensemble.collectives,
        "collective_bytes": ensemble.collective_bytes,
        "plain_flops": plain.flops,
        "plain_matmul_launches": plain.matmul_launches,
        "plain_hbm_bytes": plain.hbm_bytes,
        "plain_collectives": plain.collectives,
        "plain_collective_bytes": plain.collective_bytes,
    }


def _pins():
    return json.loads(PINS.read_text()).get(_version(), {}) if PINS.exists() else {}


def _ids():
    return [f"{c[3]}-{_layout(c[4], c[5])}-{c[0]}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=_ids())
def test_one_model_per_device(case):
    """The targets and the pins of one case: its modes, dtypes and sizes."""
    name, model, options, chip, mesh, member_axis, modes, dtypes, members = case
    pins = _pins()
    unpinned = {}
    for mode in modes:
        for dtype in dtypes:
            for num_members in members:
                comparison = _compare(case, mode, dtype, num_members)
                where = _key(name, chip, mesh, member_axis, mode, dtype, num_members)
                flops = comparison.ratio("flops")
                assert flops <= FLOPS.get(name, 1.01), (where, flops)
                extra = EXTRA_MATMULS.get((name, mode), 0)
                assert (
                    comparison.ensemble.matmul_launches
                    == comparison.plain.matmul_launches + extra
                ), (where, comparison.ensemble.matmul_launches)
                assert comparison.ensemble.loops <= comparison.plain.loops, where
                if mesh is not None and mode == "train":
                    own = _own_parameter_bytes(model, options, dtype, num_members)
                    own *= _own_parameter_trips(name, num_members)
                    carried = comparison.ensemble.collective_bytes
                    assert carried <= comparison.plain.collective_bytes + own, (
                        where,
                        carried,
                        comparison.plain.collective_bytes,
                        own,
                    )
                bound = BYTES_CASES.get(
                    (name, num_members if mesh else None), BYTES[_kind(chip)]
                )
                ratio = comparison.ratio("hbm_bytes")
                assert ratio <= bound, (where, ratio)
                figures = _figures(comparison)
                pinned = pins.get(where)
                if pinned is None:
                    unpinned[where] = figures
                    continue
                for key in ("flops", "matmul_launches", "loops", "collectives"):
                    assert figures[key] == pinned[key], (where, key, figures[key])
                assert figures["launches"] <= pinned["launches"], (where, figures)
                for key in ("hbm_bytes", "collective_bytes"):
                    assert figures[key] <= pinned[key] * 1.01, (where, key, figures)
    if unpinned:
        print(f"unpinned for jax {_version()}: {json.dumps(unpinned, indent=1)}")


def test_a_one_device_program_on_eight_h100s_is_the_one_device_program():
    # Compiled with no mesh in context, its arguments on one GPU of a node of
    # 8: the ops see one device's program (ops/groups.py), and so does the
    # compiler; the figures equal a one-GPU compile's.
    chips.mesh("h100")
    node = compiled_chips._topology_devices("h100", 8)
    fn, specs, donate, _ = model_programs(
        "mlp", "train", num_members=3, batch=256, dtype="bfloat16"
    )["batchensemble"]
    one_gpu = NamedSharding(jax.sharding.Mesh(node[:1], ("x",)), PartitionSpec())
    placed = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one_gpu), specs
    )
    compiled = jax.jit(fn, donate_argnums=donate).trace(*placed).lower().compile()
    on_node = hlo.parse_program(compiled.as_text())
    alone, _ = compiled_chips.compile_for("h100", fn, specs, donate_argnums=donate)
    alone = hlo.parse_program(alone.as_text())
    assert on_node.collectives == 0
    assert on_node.flops == alone.flops
    assert on_node.launches == alone.launches
    assert on_node.launches_of("gemm") == alone.launches_of("gemm")
    assert on_node.hbm_bytes == alone.hbm_bytes


def write_pins():
    """Compiles every case and writes this jax version's figures to the pins."""
    everything = json.loads(PINS.read_text()) if PINS.exists() else {}
    figures = {}
    for case in CASES:
        name, _, _, chip, mesh, member_axis, modes, dtypes, members = case
        for mode in modes:
            for dtype in dtypes:
                for num_members in members:
                    comparison = _compare(case, mode, dtype, num_members)
                    key = _key(name, chip, mesh, member_axis, mode, dtype, num_members)
                    figures[key] = {
                        **_figures(comparison),
                        "compile_seconds": round(
                            comparison.ensemble.compile_seconds
                            + comparison.plain.compile_seconds,
                            1,
                        ),
                    }
                    print(key, json.dumps(figures[key]), flush=True)
    everything[_version()] = figures
    PINS.write_text(json.dumps(everything, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__" and "--write" in sys.argv:
    write_pins()
