"""Functional BatchEnsemble kernels; they know nothing of ``nnx``.

Each op validates its arguments (an array argument that is not an array, such
as ``None``, raises a ``TypeError`` naming it) and then runs its ``jnp``
formula (``impl="xla"``, the default on every backend), differentiated by JAX
except where a measured backward beats JAX's own (the dense and convolution
ops' per-member weight gradients, ``docs/cost.md``). The dense-like ops also
take ``impl="pallas"``: the fused kernels of
:mod:`ensembles.experimental.pallas`, imported only when named.
"""

from ensembles.ops.conv import batch_ensemble_conv
from ensembles.ops.conv_transpose import batch_ensemble_conv_transpose
from ensembles.ops.dense import batch_ensemble_dense
from ensembles.ops.dense_general import batch_ensemble_dense_general
from ensembles.ops.einsum import batch_ensemble_einsum
from ensembles.ops.impls import IMPLS
from ensembles.ops.member_dense import ensemble_dense
from ensembles.ops.normalization import (
    ensemble_batch_norm,
    ensemble_batch_statistics,
    ensemble_layer_norm,
    ensemble_rms_norm,
)

__all__ = [
    "IMPLS",
    "batch_ensemble_conv",
    "batch_ensemble_conv_transpose",
    "batch_ensemble_dense",
    "batch_ensemble_dense_general",
    "batch_ensemble_einsum",
    "ensemble_batch_norm",
    "ensemble_batch_statistics",
    "ensemble_dense",
    "ensemble_layer_norm",
    "ensemble_rms_norm",
]
