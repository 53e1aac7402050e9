"""On-chip memory of the kernels' tiles, and the chips' budgets for it.

A tile that needs more shared memory (GPU) or VMEM (TPU) than a kernel may use
fails only when XLA compiles the kernel for the chip, deep in the backend
(``RESOURCE_EXHAUSTED: Shared memory size limit exceeded``,
``CompileTimeScopedVmemOom``). :func:`check_tiles` refuses it first, when the
tiles are chosen, with the budget in the message.

The estimates are the compilers' own accounting, read from what they report
when a tile does not fit (deviceless compiles for an H100 and TPU v2-v7x with
jax 0.10.2 and 0.12.0.1, 2026-11-26; ``docs/fused_kernel.md``) and rounded up:
the Triton forward and input-gradient figures are exactly what Triton asked
for in every one of 64 tiles tried, the kernel gradient's three pipeline
stages of both operands are at or above it. The Mosaic figures (blocks
double-buffered, float32 scratch, ``[1, D]`` vectors) are within 0.15 MiB of
what libtpu reported for 27-64 tiles on each of v3, v4, v5e, v6e and 7x; they
may use half the chip's budget, the other half is left to the compiler's
temporaries (register spills: 7.4 MiB beside 9.5 MiB of blocks for a 1024 x
512 bfloat16 kernel-gradient tile on a TPU v2, where the matmul runs in
float32). The compile tier (``tests/experimental/test_compile.py``) compiles
the largest tiles they accept, for each chip.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ensembles.experimental.pallas.blocks import BlockSizes, MatmulBlocks, Tiling

__all__ = [
    "SCOPED_VMEM_BYTES",
    "TRITON_MAX_ACCUMULATOR",
    "TRITON_SHARED_MEMORY_BYTES",
    "Target",
    "check_tiles",
    "mosaic_vmem_bytes",
    "target",
    "tpu_chip",
    "triton_shared_memory_bytes",
]

_MIB = 1 << 20

#: Shared memory one Triton kernel may use on an H100 (sm_90: 227 KiB, the
#: opt-in limit per block; what XLA reports as "available"). Other NVIDIA GPUs
#: have less (an A100 163 KiB): there the compiler is still the check.
TRITON_SHARED_MEMORY_BYTES = 232448

#: The largest ``block_m * block_n`` float32 accumulator a Triton kernel holds
#: in the registers of its 4 warps (128 threads, at most 255 registers each):
#: 128 x 128 takes 128 a thread. Larger tiles spill to local memory: on an H100
#: (128, 256) and (256, 128) tiles ran 10-20x slower than (128, 128)
#: (``shared/notes/gpu.md``), and a (1024, 256) tile did not finish compiling in
#: 10 minutes.
TRITON_MAX_ACCUMULATOR = 128 * 128

#: Mosaic's default scoped VMEM limit per kernel, by TPU chip (what libtpu's
#: compiler reports as the limit; v2-v4 have 16 MiB of VMEM in all).
SCOPED_VMEM_BYTES = {
    "v2": 16 * _MIB,
    "v3": 16 * _MIB,
    "v4": 16 * _MIB,
    "v5e": 16 * _MIB,
    "v5p": 16 * _MIB,
    "v6e": 32 * _MIB,
    "7x": 32 * _MIB,
}

# Chips whose Mosaic matmul takes float32 operands only (libtpu's E2001,
# "Unsupported matmul RHS type on target: vector<128x128xbf16>").
FLOAT32_MATMUL_CHIPS = ("v2", "v3")

_TPU_KINDS = {
    "TPU v2": "v2",
    "TPU v3": "v3",
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU7x": "7x",
}

# Room for Mosaic's internal scratch and the rounding in its reports.
_VMEM_SLACK = 256 * 1024
_TRITON_STAGES = 3  # triton.py's num_stages


def tpu_chip(device_kind: str) -> str | None:
    """The TPU chip of a ``device_kind``, or ``None`` if it is not one known here.

    >>> tpu_chip("TPU v5 lite"), tpu_chip("NVIDIA H100 80GB HBM3")
    ('v5e', None)
    """
    return _TPU_KINDS.get(device_kind)


@dataclasses.dataclass(frozen=True)
class Target:
    """The device a computation is traced for.

    Attributes:
      platform: ``"cuda"`` (an NVIDIA GPU), ``"tpu"``, or another platform
        (``"cpu"``, ``"rocm"``, ...), which runs no compiled kernel here.
      device_kind: the device's ``device_kind``.
      chip: the TPU chip (``"v5e"``, ...), ``None`` elsewhere or if unknown.
    """

    platform: str
    device_kind: str
    chip: str | None = None

    @property
    def float32_matmul(self) -> bool:
        """Whether Mosaic's matmul on this chip takes float32 operands only."""
        return self.chip in FLOAT32_MATMUL_CHIPS


def _default_device():
    device = jax.config.jax_default_device
    if isinstance(device, str):
        return jax.devices(device)[0]
    return device if device is not None else jax.devices()[0]


def target() -> Target:
    """The device code traced now compiles for: the mesh's, else the default device.

    Under ``jax.set_mesh`` (or ``jax.sharding.use_abstract_mesh``) the mesh's
    device, which is how a compile for a chip this machine lacks names it;
    otherwise the default device.

    >>> target().platform
    'cpu'
    """
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is None:
        device = _default_device()
    kind = device.device_kind
    platform = device.platform
    if platform in ("gpu", "cuda") and kind.startswith("NVIDIA"):
        platform = "cuda"
    chip = tpu_chip(kind) if platform == "tpu" else None
    return Target(platform=platform, device_kind=kind, chip=chip)


def _kernels(t: Tiling) -> dict[str, MatmulBlocks]:
    return {
        "forward": t.forward,
        "input-gradient": t.input_grad,
        "kernel-gradient": t.kernel_grad,
    }


def triton_shared_memory_bytes(t: Tiling, dtype) -> dict[str, int]:
    """Shared memory of each Triton kernel of the tiling ``t``, in bytes.

    The forward and input gradient pipeline their two operand tiles and the
    ``r`` (``s``) window through two stages and keep a third copy of the
    kernel tile (exactly what Triton asked for in every tile measured); the
    kernel gradient is counted with three stages of both operand tiles (at or
    above what Triton asked for).

    >>> from ensembles.experimental.pallas.blocks import tiling
    >>> t = tiling("gpu", rows=512, in_features=512, out_features=512,
    ...            blocks=BlockSizes(256, 256, 256))
    >>> triton_shared_memory_bytes(t, jnp.float32)["forward"]
    1312768
    """
    size = jnp.dtype(dtype).itemsize
    out = {}
    for name, b in _kernels(t).items():
        m, n, k = b.block_m, b.block_n, b.block_k
        if name == "kernel-gradient":
            out[name] = _TRITON_STAGES * (k * m + k * n) * size
        else:
            pipelined = (_TRITON_STAGES - 1) * (m * k + k * n) + k * n
            out[name] = pipelined * size + (_TRITON_STAGES - 1) * k * 4
    return out


def mosaic_vmem_bytes(t: Tiling, dtype, out_dtype) -> dict[str, int]:
    """VMEM of each Mosaic TPU kernel's blocks and scratch for tiling ``t``, in bytes.

    Every block double-buffered, the float32 scratch accumulators, the
    ``[1, D]`` vectors padded to 8 sublanes, and 256 KiB of slack; not the
    compiler's temporaries (:func:`check_tiles` leaves them half the budget).

    >>> from ensembles.experimental.pallas.blocks import tiling
    >>> t = tiling("tpu", rows=1024, in_features=1024, out_features=1024,
    ...            blocks=BlockSizes(1024, 1024, 1024))
    >>> mosaic_vmem_bytes(t, jnp.float32, jnp.float32)["forward"] / 2**20
    28.4375
    """
    size = jnp.dtype(dtype).itemsize
    out_size = jnp.dtype(out_dtype).itemsize

    def vector(width):  # a double-buffered [1, width] block, 8 sublanes of f32
        return 2 * 8 * width * 4

    out = {}
    for name, b in _kernels(t).items():
        m, n, k = b.block_m, b.block_n, b.block_k
        tile = m * n
        total = 2 * (m * k + k * n) * size + 4 * tile  # operands; accumulator
        if name == "forward":
            total += 2 * tile * out_size + vector(k) + 2 * vector(n)
        elif name == "input-gradient":  # x in, dx out
            total += 4 * tile * size + vector(k) + 2 * vector(n)
        else:  # the kernel in, its gradient out; a second accumulator
            total += 4 * tile * size + 4 * tile + vector(m) + 2 * vector(n)
        out[name] = total + _VMEM_SLACK
    return out


def _mib(value: int) -> str:
    return f"{value / _MIB:.2f} MiB"


def check_tiles(
    family: str, t: Tiling, blocks: BlockSizes, dtype, out_dtype, where: Target
) -> None:
    """Raises a ``ValueError`` if a kernel's tiles do not fit the chip ``where``.

    Args:
      family: ``"gpu"`` (Triton, checked against an H100's shared memory and
        register file) or ``"tpu"`` (Mosaic: blocks and scratch against half
        the chip's scoped VMEM).
      t: the tiling of the problem (the blocks fitted to it).
      blocks: the :class:`BlockSizes` asked for (named in the message).
      dtype: the operands' dtype.
      out_dtype: the forward output's dtype.
      where: the target; a TPU chip not in :data:`SCOPED_VMEM_BYTES` is not
        checked.

    Raises:
      ValueError: naming the kernel, its tile, what it needs and the budget.

    >>> from ensembles.experimental.pallas.blocks import tiling
    >>> blocks = BlockSizes(256, 256, 256)
    >>> t = tiling("gpu", rows=512, in_features=512, out_features=512, blocks=blocks)
    >>> check_tiles("gpu", t, blocks, jnp.float32, jnp.float32,
    ...             Target("cuda", "NVIDIA H100 80GB HBM3"))
    Traceback (most recent call last):
    ...
    ValueError: `block_sizes` BlockSizes(block_b=256, block_out=256, block_k=256) ...
    """
    dtype_name = jnp.dtype(dtype).name
    asked = f"`block_sizes` {blocks!r}"
    fix = (
        'Use smaller blocks (BlockSizes() fits every chip), or impl="xla"; '
        "tiles larger than a problem shrink to it."
    )
    if family == "gpu":
        for name, b in _kernels(t).items():
            if b.block_m * b.block_n > TRITON_MAX_ACCUMULATOR:
                raise ValueError(
                    f"{asked} gives the Triton {name} kernel a {b.block_m} x "
                    f"{b.block_n} float32 accumulator ({b.block_m * b.block_n} "
                    f"values), more than the {TRITON_MAX_ACCUMULATOR} (128 x 128) "
                    f"that 4 warps hold in registers: larger tiles spill (10-20x "
                    f"slower on an H100). Keep block_b * block_out <= "
                    f"{TRITON_MAX_ACCUMULATOR}. {fix}"
                )
        for name, need in triton_shared_memory_bytes(t, dtype).items():
            if need > TRITON_SHARED_MEMORY_BYTES:
                b = _kernels(t)[name]
                raise ValueError(
                    f"{asked} needs {need} bytes of shared memory in the Triton "
                    f"{name} kernel ({dtype_name} tiles {b.block_m} x {b.block_n}, "
                    f"steps of {b.block_k}, {_TRITON_STAGES} pipeline stages), "
                    f"more than the {TRITON_SHARED_MEMORY_BYTES} bytes a kernel "
                    f"may use on an H100 ({where.device_kind}). {fix}"
                )
        return
    budget = SCOPED_VMEM_BYTES.get(where.chip)
    if budget is None:
        return
    for name, need in mosaic_vmem_bytes(t, dtype, out_dtype).items():
        if need > budget // 2:
            b = _kernels(t)[name]
            raise ValueError(
                f"{asked} needs {_mib(need)} of VMEM for the blocks and scratch of "
                f"the Mosaic {name} kernel ({dtype_name} tiles {b.block_m} x "
                f"{b.block_n}, steps of {b.block_k}, double-buffered), more than "
                f"half the {_mib(budget)} a kernel may use on a TPU {where.chip} "
                f"(Mosaic's scoped VMEM limit; the other half is left to the "
                f"compiler's temporaries). {fix}"
            )
