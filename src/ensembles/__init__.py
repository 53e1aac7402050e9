"""BatchEnsemble layers for Flax NNX.

One shared weight ``W`` plus per-member rank-one fast weights ``r_k``, ``s_k``:
member ``k`` behaves as if its weight were ``W * outer(r_k, s_k)``, and all members
run as one member-major ``[E*B, ...]`` batch.
"""

from ensembles import initializers, multihost, ops, optim, training, uncertainty
from ensembles.convert import extract_member, to_batch_ensemble
from ensembles.ensemble import Ensemble
from ensembles.layers import (
    BatchEnsembleConv,
    BatchEnsembleConvTranspose,
    BatchEnsembleEinsum,
    BatchEnsembleLinear,
    BatchEnsembleLinearGeneral,
    EnsembleBatchNorm,
    EnsembleLayerNorm,
    EnsembleLinear,
    EnsembleRMSNorm,
)
from ensembles.members import tile, untile
from ensembles.summary import EnsembleSummary, summary
from ensembles.training import kl_divergence
from ensembles.variables import FastWeight

__version__ = "0.1.0.dev0"

__all__ = [
    "BatchEnsembleConv",
    "BatchEnsembleConvTranspose",
    "BatchEnsembleEinsum",
    "BatchEnsembleLinear",
    "BatchEnsembleLinearGeneral",
    "Ensemble",
    "EnsembleBatchNorm",
    "EnsembleLayerNorm",
    "EnsembleLinear",
    "EnsembleRMSNorm",
    "EnsembleSummary",
    "FastWeight",
    "__version__",
    "extract_member",
    "initializers",
    "kl_divergence",
    "multihost",
    "ops",
    "optim",
    "summary",
    "tile",
    "to_batch_ensemble",
    "training",
    "uncertainty",
    "untile",
]
