"""Functional BatchEnsemble kernels; they know nothing of ``nnx``."""

from ensembles.ops.dense import IMPLS, batch_ensemble_dense

__all__ = ["IMPLS", "batch_ensemble_dense"]
