"""The fused Pallas BatchEnsemble dense kernel (``impl="pallas"``).

The ``jnp`` formulation (``impl="xla"``) moves the activations through memory
three times: to scale them by ``r``, through the matmul, and to scale the
result by ``s`` and add the bias. The kernels here apply ``* r`` to each input
tile as they load it and ``* s + bias`` to each output tile before they store
it::

    y[k*B + b] = ((x[k*B + b] * r[k]) @ kernel) * s[k] + bias[k]

The member-major ``[E*B, ..., in]`` batch is viewed (for free) as ``[E, R, in]``
with ``R`` rows per member, and every grid runs over (member, row block, ...),
so a tile never straddles two members.

Modules, one concern each:

* :mod:`.blocks`: :class:`BlockSizes`, the fit of blocks to a problem, the
  zero padding that makes every block tile its array, and the one
  ``BlockSpec`` constructor, which rejects a partial block.
* :mod:`.common`: the static kernel configuration and the float32-accumulating
  matmul the families share.
* :mod:`.triton`: the GPU family (Triton), interpreted on CPU.
* :mod:`.mosaic_tpu`: the TPU family (Mosaic).
* :mod:`.budget`: each kernel's shared memory or VMEM, the chips' budgets and
  the target chip; tiles that do not fit are refused when chosen.
* :mod:`.mosaic_gpu`, :mod:`.mosaic_gpu_backward`,
  :mod:`.mosaic_gpu_kernel_grad`: the Hopper family (Mosaic GPU), forward and
  backward, run by ``fused_dense(..., family="hopper")``; no platform picks
  it until it is measured on a GPU.
* :mod:`.checks`: the dtype and interpreter checks.
* :mod:`.fused`: the per-platform family choice, padding and slicing, and
  the ``jax.custom_vjp``.

Nothing runs these kernels unless ``impl="pallas"`` names them (``import
ensembles`` does not even import this package): they become a default only
where a GPU or TPU run measures them correct and faster. A new family
is a new module with ``forward`` and ``backward``, registered in
:mod:`.fused`.
"""

from ensembles.experimental.pallas.blocks import BlockSizes
from ensembles.experimental.pallas.checks import SUPPORTED_DTYPES, check_dtypes
from ensembles.experimental.pallas.fused import FAMILIES, dense_reference, fused_dense

__all__ = [
    "FAMILIES",
    "SUPPORTED_DTYPES",
    "BlockSizes",
    "check_dtypes",
    "dense_reference",
    "fused_dense",
]
