"""Chips this machine may lack, as compile targets: one compile-only device each.

``jax.experimental.topologies`` describes a chip's devices without the chip:
an H100 from ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` (no NVIDIA
libraries needed) with a GPU target config
(``ensembles/benchmark/data/h100_target_config.txtpb``), TPUs from
``libtpu`` (what ``jax[tpu]`` installs). Under ``jax.set_mesh`` over one of
them, ``jax.jit(f).trace(*specs).lower().compile()`` runs the chip's own
compilers (XLA GPU with Triton, XLA TPU with Mosaic) and returns the program
the chip would run. Nothing may run eagerly under such a mesh: every model
and argument is built abstractly (``nnx.eval_shape``,
``jax.ShapeDtypeStruct``). ``"cpu"`` is this machine's own backend, compiled
as usual. libtpu allows one process at a time.

>>> CHIPS[:3]
('cpu', 'h100', 'v2')
"""

from __future__ import annotations

import functools
import importlib.resources
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["CHIPS", "TPU_TOPOLOGIES", "chip_mesh", "compile_for", "platform_of"]

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


@functools.cache
def _topology_mesh(chip: str) -> Mesh:
    from jax.experimental import topologies

    if chip == "h100":
        config = (
            importlib.resources.files("ensembles.benchmark")
            / "data"
            / "h100_target_config.txtpb"
        ).read_text()
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=config, topology="1x1x1"
        )
    else:
        topology = topologies.get_topology_desc(TPU_TOPOLOGIES[chip], platform="tpu")
    return Mesh(topology.devices[:1], ("x",))


def chip_mesh(chip: str) -> Mesh | None:
    """A one-device mesh of ``chip`` to compile for; ``None`` for ``"cpu"``.

    Args:
      chip: one of :data:`CHIPS`.

    Returns:
      The mesh (``None``: this machine's CPU, compiled without one).

    Raises:
      ValueError: if ``chip`` is unknown.
      RuntimeError: if this machine lacks the chip's compiler; the message
        says what to install (``JAX_PLATFORMS=cpu`` must be set for an H100
        without a GPU: the CUDA plugin refuses to start otherwise).
    """
    _check_chip(chip)
    if chip == "cpu":
        return None
    try:
        return _topology_mesh(chip)
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


def compile_for(
    chip: str,
    fn: Callable[..., Any],
    specs: Sequence[jax.ShapeDtypeStruct],
    *,
    donate_argnums: Sequence[int] = (),
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

    Returns:
      ``(compiled, seconds)``: ``compiled.as_text()`` is the optimized HLO;
      the seconds are the chip's compiler's (tracing and lowering apart).
    """
    mesh = chip_mesh(chip)
    jitted = jax.jit(fn, donate_argnums=tuple(donate_argnums))
    if mesh is None:
        lowered = jitted.trace(*specs).lower()
        start = time.perf_counter()
        return lowered.compile(), time.perf_counter() - start
    replicated = NamedSharding(mesh, PartitionSpec())
    placed = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), specs
    )
    with jax.set_mesh(mesh):
        lowered = jitted.trace(*placed).lower()
        start = time.perf_counter()
        compiled = lowered.compile()
    return compiled, time.perf_counter() - start
