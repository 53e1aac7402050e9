"""A regressor's Gaussian head: its outputs read as means and spreads.

Every regressor of the quality benchmark ends in ``2 D`` outputs, a mean and
a raw spread per target (:func:`gaussian_pairs`), read by
:func:`ensembles.training.gaussian_head` with the floor :data:`MIN_STD`; it
trains on targets standardised by :class:`TargetScale`, which maps its
predictions back to the targets' units before anything is scored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ensembles import training

__all__ = ["BETA", "MIN_STD", "TargetScale", "gaussian_pairs"]

#: The beta-NLL exponent of every method's loss (Seitzer et al., 2022; 0 is
#: the plain NLL) and the floor of the predicted standard deviations, in
#: standardised target units (``docs/regression.md``).
BETA: float = 0.5
MIN_STD: float = 1e-3


def gaussian_pairs(outputs: jax.Array, target_shape: tuple[int, ...]) -> jax.Array:
    """A regressor's ``[..., 2 D]`` outputs as ``[..., (D,) 2]`` pairs."""
    return outputs.reshape(*outputs.shape[:-1], *target_shape, 2)


class TargetScale:
    """The training targets' mean and standard deviation (per output).

    The methods train on standardised targets; their predictions are mapped
    back to the targets' units before anything is scored.

    Args:
      targets: ``[N]`` or ``[N, D]`` training targets.
    """

    def __init__(self, targets: np.ndarray):
        targets = np.asarray(targets, np.float64)
        self.mean = targets.mean(axis=0)
        self.std = np.maximum(targets.std(axis=0), 1e-12)
        self.shape = targets.shape[1:]

    def standardise(self, targets: np.ndarray) -> np.ndarray:
        """``(targets - mean) / std``, float32."""
        return np.asarray((np.asarray(targets) - self.mean) / self.std, np.float32)

    def members(self, outputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """A method's ``[E, N, 2 D]`` outputs as means and stds in target units."""
        means, stds = training.gaussian_head(
            gaussian_pairs(outputs, self.shape), min_std=MIN_STD
        )
        mean = jnp.asarray(self.mean, jnp.float32)
        std = jnp.asarray(self.std, jnp.float32)
        return means * std + mean, stds * std
