"""Functional BatchEnsemble kernels; they know nothing of ``nnx``."""

from ensembles.ops.conv import batch_ensemble_conv
from ensembles.ops.conv_transpose import batch_ensemble_conv_transpose
from ensembles.ops.dense import batch_ensemble_dense
from ensembles.ops.dense_general import batch_ensemble_dense_general
from ensembles.ops.einsum import batch_ensemble_einsum
from ensembles.ops.normalization import (
    ensemble_batch_norm,
    ensemble_batch_statistics,
    ensemble_layer_norm,
    ensemble_rms_norm,
)
from ensembles.ops.pallas import BlockSizes
from ensembles.ops.plan import IMPLS, resolve_impl

__all__ = [
    "IMPLS",
    "BlockSizes",
    "batch_ensemble_conv",
    "batch_ensemble_conv_transpose",
    "batch_ensemble_dense",
    "batch_ensemble_dense_general",
    "batch_ensemble_einsum",
    "ensemble_batch_norm",
    "ensemble_batch_statistics",
    "ensemble_layer_norm",
    "ensemble_rms_norm",
    "resolve_impl",
]
