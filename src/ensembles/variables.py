"""The variable type of the fast weights."""

from __future__ import annotations

from flax import nnx

__all__ = ["FastWeight"]


class FastWeight(nnx.Param):
    """A fast weight: the per-member ``r`` ``[E, in]`` or ``s`` ``[E, out]``.

    ``FastWeight`` subclasses ``nnx.Param``, so optimizers and ``nnx.state(model,
    nnx.Param)`` see fast weights by default, and a filter on ``FastWeight``
    selects them alone (to give them their own learning rate or no weight decay).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import ensembles
    >>> layer = ensembles.BatchEnsembleLinear(3, 2, num_members=4, rngs=nnx.Rngs(0))
    >>> sorted(nnx.state(layer, ensembles.FastWeight).keys())
    ['r', 's']
    >>> isinstance(layer.r, nnx.Param)
    True
    """
