"""Chips this machine may lack, as compile targets: compile-only devices.

``jax.experimental.topologies`` describes a chip's devices without the chip:
an H100 node (``1x1xN``: N GPUs) from ``jax-cuda12-plugin`` and
``jax-cuda12-pjrt`` (no NVIDIA libraries needed) with a GPU target config
(``ensembles/benchmark/data/h100_target_config.txtpb``), TPUs from
``libtpu`` (what ``jax[tpu]`` installs: slices such as ``v5e:2x2``). Under
``jax.set_mesh`` over one of them or several, ``jax.jit(f).trace(*specs)
.lower().compile()`` runs the chip's own compilers (XLA GPU with Triton, XLA
TPU with Mosaic; for a mesh of several, XLA's SPMD partitioner first) and
returns the program each device would run. Nothing may run eagerly under
such a mesh: every model and argument is built abstractly
(``nnx.eval_shape``, ``jax.ShapeDtypeStruct``). ``"cpu"`` is this
machine's own backend, compiled as usual. libtpu allows one process at a
time.

>>> CHIPS[:3]
('cpu', 'h100', 'v2')
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

__all__ = [
    "CHIPS",
    "TPU_SLICES",
    "TPU_TOPOLOGIES",
    "chip_mesh",
    "compile_for",
    "platform_of",
    "start_compilers",
]

# What the chips' compilers print when they start on a machine without the
# chip (the CUDA plugin's stub, libtpu's search for a TPU host), straight to
# the process's stderr from native code: expected, and nothing to act on.
_START_UP_NOISE = re.compile(
    r"cudart_stub\.cc|Could not find cuda drivers|absl::InitializeLog|"
    r"Logging before InitGoogle|TPU_ACCELERATOR_TYPE|TPU_WORKER_HOSTNAMES|"
    r"host bounds for accelerator|=== Source Location Trace|libtpu_init_utils"
)

#: The smallest slice of each TPU that libtpu describes (a 1x1 v5e is refused).
TPU_TOPOLOGIES: dict[str, str] = {
    "v2": "v2:2x2",
    "v3": "v3:2x2",
    "v4": "v4:2x2x1",
    "v5e": "v5e:2x2",
    "v5p": "v5p:2x2x1",
    "v6e": "v6e:2x2",
    "7x": "tpu7x:2x2x1",
}

#: The chips a program can be compiled for: this machine's CPU, an H100, TPUs.
CHIPS: tuple[str, ...] = ("cpu", "h100", *TPU_TOPOLOGIES)

_INSTALL = {
    "h100": "pip install jax-cuda12-plugin==JAX jax-cuda12-pjrt==JAX",
    "tpu": 'pip install "jax[tpu]==JAX"',
}


def platform_of(chip: str) -> str:
    """The JAX platform a chip's programs are lowered for.

    >>> platform_of("h100"), platform_of("v5e"), platform_of("cpu")
    ('cuda', 'tpu', 'cpu')
    """
    _check_chip(chip)
    if chip == "cpu":
        return "cpu"
    return "cuda" if chip == "h100" else "tpu"


def _check_chip(chip: str) -> None:
    if chip not in CHIPS:
        raise ValueError(f"`chip` must be one of {list(CHIPS)}, got {chip!r}.")


#: Larger TPU slices, by the devices a mesh needs (the smallest that holds it).
TPU_SLICES: dict[str, tuple[str, ...]] = {
    "v2": ("v2:2x2", "v2:4x4"),
    "v3": ("v3:2x2", "v3:4x4"),
    "v4": ("v4:2x2x1", "v4:2x2x2", "v4:2x2x4"),
    "v5e": ("v5e:2x2", "v5e:2x4", "v5e:4x4"),
    "v5p": ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4"),
    "v6e": ("v6e:2x2", "v6e:2x4", "v6e:4x4"),
    "7x": ("tpu7x:2x2x1", "tpu7x:2x2x2", "tpu7x:2x2x4"),
}


@functools.cache
def _topology_devices(chip: str, num_devices: int) -> tuple[Any, ...]:
    """``num_devices`` compile-only devices of ``chip``: an H100 node, a TPU slice."""
    from jax.experimental import topologies

    if chip == "h100":
        config = (
            importlib.resources.files("ensembles.benchmark")
            / "data"
            / "h100_target_config.txtpb"
        ).read_text()
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=f"1x1x{num_devices}"
        )
        return tuple(topology.devices)
    for name in TPU_SLICES[chip]:
        topology = topologies.get_topology_desc(name, platform="tpu")
        if len(topology.devices) >= num_devices:
            return tuple(topology.devices[:num_devices])
    raise ValueError(
        f"the largest {chip} slice described here ({TPU_SLICES[chip][-1]}) has "
        f"fewer than {num_devices} devices: ask for a smaller mesh."
    )


def _check_axes(axes: Mapping[str, int] | None) -> dict[str, int]:
    if axes is None:
        return {"x": 1}
    if not axes or not all(
        isinstance(name, str) and isinstance(size, int) and size >= 1
        for name, size in axes.items()
    ):
        raise ValueError(
            f"`mesh` must map axis names to positive sizes, e.g. {{'data': 8}}, "
            f"got {axes!r}."
        )
    return dict(axes)


def chip_mesh(chip: str, axes: Mapping[str, int] | None = None) -> Mesh | None:
    """A mesh of ``chip``'s devices to compile for; ``None`` for one CPU device.

    >>> chip_mesh("cpu") is None
    True

    Args:
      chip: one of :data:`CHIPS`.
      axes: the mesh's axes and their sizes (``{"data": 8}``: 8 H100s of one
        node, or a TPU slice of 8 chips); ``None``: one device.

    Returns:
      The mesh (``None``: this machine's CPU, one device, compiled without
      one). Its axes are automatic (``jax.sharding.AxisType.Auto``): XLA's
      partitioner places what the arguments' shardings leave open.

    Raises:
      ValueError: if ``chip`` or ``axes`` is invalid, or this machine (CPU)
        has fewer devices than the mesh needs (the message says how to get
        them).
      RuntimeError: if this machine lacks the chip's compiler; the message
        says what to install (``JAX_PLATFORMS=cpu`` must be set for an H100
        without a GPU: the CUDA plugin refuses to start otherwise).
    """
    _check_chip(chip)
    axes = _check_axes(axes)
    num_devices = math.prod(axes.values())
    if chip == "cpu":
        if num_devices == 1:
            return None
        devices = jax.devices("cpu")
        if len(devices) < num_devices:
            raise ValueError(
                f"a CPU mesh of {num_devices} devices needs as many devices; this "
                f"process has {len(devices)}. Start it with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices}."
            )
        devices = tuple(devices[:num_devices])
    else:
        try:
            devices = _topology_devices(chip, num_devices)
        except ValueError:
            raise
        except Exception as error:  # a missing plugin or libtpu: any error type
            install = _INSTALL["h100" if chip == "h100" else "tpu"]
            raise RuntimeError(
                f"cannot compile for {chip} here ({type(error).__name__}: "
                f"{str(error)[:300]}). Install its compiler at jax's version: "
                f"{install.replace('JAX', jax.__version__)}"
                + (
                    ", and run with JAX_PLATFORMS=cpu on a machine without a GPU."
                    if chip == "h100"
                    else "."
                )
            ) from error
    shape = tuple(axes.values())
    return Mesh(
        np.asarray(devices, dtype=object).reshape(shape),
        tuple(axes),
        axis_types=(AxisType.Auto,) * len(shape),
    )


@contextlib.contextmanager
def _without_start_up_noise():
    """Native writes to stderr in the block, less the compilers' start-up lines.

    Captured at the file descriptor (the plugins write there from C++, not
    through ``sys.stderr``) and written back when the block ends, every line
    but :data:`_START_UP_NOISE`'s: an error of the compilers' own still shows.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = [
                line
                for line in text.splitlines(keepends=True)
                if not _START_UP_NOISE.search(line)
            ]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def start_compilers(
    chips: Sequence[str], mesh: Mapping[str, int] | None = None
) -> None:
    """Starts each chip's compiler once, its start-up lines kept off stderr.

    On a machine without the chips, the CUDA plugin and libtpu print about a
    dozen lines when they start (no CUDA driver, no TPU host found), from
    native code, even under ``JAX_PLATFORMS=cpu``: expected, and nothing to
    act on. ``ensembles-bench --compiled-for`` starts them here first, so
    that its output is its own; any other line they print still shows.

    Args:
      chips: names of :data:`CHIPS`.
      mesh: the mesh each will be compiled for (:func:`chip_mesh`).

    Raises:
      As :func:`chip_mesh`.
    """
    with _without_start_up_noise():
        jax.devices()  # the plugins load with the backends
        for chip in chips:
            chip_mesh(chip, mesh)


def compile_for(
    chip: str,
    fn: Callable[..., Any],
    specs: Sequence[Any],
    *,
    donate_argnums: Sequence[int] = (),
    mesh: Mapping[str, int] | None = None,
    partitions: Sequence[Any] | None = None,
) -> tuple[Any, float]:
    """Compiles ``fn`` at ``specs`` for ``chip``: the program and the seconds it took.

    >>> import jax, jax.numpy as jnp
    >>> compiled, seconds = compile_for(
    ...     "cpu", jnp.sin, [jax.ShapeDtypeStruct((3,), jnp.float32)])
    >>> "sine" in compiled.as_text()
    True

    Args:
      chip: one of :data:`CHIPS`.
      fn: the function, traced with ``jax.jit``.
      specs: the shape and dtype of each positional argument (leaves of any
        pytree structure are fine, as for ``jax.jit``).
      donate_argnums: arguments whose buffers the program may reuse.
      mesh: the devices' mesh axes (:func:`chip_mesh`); ``None``: one
        device. The program is traced with the mesh set, as a user's is
        under ``jax.set_mesh``, and is the program of one device of it.
      partitions: with ``mesh``, where each argument lies: per argument,
        ``None`` (replicated) or a ``PartitionSpec``, or a pytree of them
        matching the argument's (``None`` leaves replicated).

    Returns:
      ``(compiled, seconds)``: ``compiled.as_text()`` is the optimized HLO;
      the seconds are the chip's compiler's (tracing and lowering apart).
    """
    devices = chip_mesh(chip, mesh)
    jitted = jax.jit(fn, donate_argnums=tuple(donate_argnums))
    if devices is None:
        lowered = jitted.trace(*specs).lower()
        start = time.perf_counter()
        return lowered.compile(), time.perf_counter() - start
    if partitions is None:
        partitions = [None] * len(specs)

    def placed(spec, partition=None):
        sharding = NamedSharding(devices, partition or PartitionSpec())
        return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)

    def place(spec, partition):
        if partition is None or isinstance(partition, PartitionSpec):
            return jax.tree.map(lambda leaf: placed(leaf, partition), spec)
        return jax.tree.map(placed, spec, partition, is_leaf=lambda x: x is None)

    arguments = [
        place(spec, partition)
        for spec, partition in zip(specs, partitions, strict=True)
    ]
    with jax.set_mesh(devices):
        lowered = jitted.trace(*arguments).lower()
        start = time.perf_counter()
        compiled = lowered.compile()
    return compiled, time.perf_counter() - start
