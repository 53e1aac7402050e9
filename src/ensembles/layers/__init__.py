"""BatchEnsemble ``nnx`` layers: parameters plus a call into ``ensembles.ops``."""

from ensembles.layers.base import BatchEnsembleModule, EnsembleModule
from ensembles.layers.batch_norm import EnsembleBatchNorm
from ensembles.layers.conv import BatchEnsembleConv
from ensembles.layers.conv_transpose import BatchEnsembleConvTranspose
from ensembles.layers.einsum import BatchEnsembleEinsum
from ensembles.layers.ensemble_linear import EnsembleLinear
from ensembles.layers.linear import BatchEnsembleLinear
from ensembles.layers.linear_general import BatchEnsembleLinearGeneral
from ensembles.layers.member_axis import shard_members
from ensembles.layers.normalization import EnsembleLayerNorm, EnsembleRMSNorm

__all__ = [
    "BatchEnsembleConv",
    "BatchEnsembleConvTranspose",
    "BatchEnsembleEinsum",
    "BatchEnsembleLinear",
    "BatchEnsembleLinearGeneral",
    "BatchEnsembleModule",
    "EnsembleBatchNorm",
    "EnsembleLayerNorm",
    "EnsembleLinear",
    "EnsembleModule",
    "EnsembleRMSNorm",
    "shard_members",
]
