"""BatchEnsemble ``nnx`` layers: parameters plus a call into ``ensembles.ops``."""

from ensembles.layers.base import BatchEnsembleModule
from ensembles.layers.linear import BatchEnsembleLinear

__all__ = ["BatchEnsembleLinear", "BatchEnsembleModule"]
