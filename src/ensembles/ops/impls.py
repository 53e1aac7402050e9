"""What ``impl=`` may name, and which ops have which: decided here, once.

``"xla"`` is the ``jnp`` formula, every op's implementation on every backend
(the default). ``"pallas"`` names the fused kernels of
:mod:`ensembles.experimental.pallas`, imported only when named, which the
dense-like ops (dense, general, einsum) have and the convolutions do not. A
layer whose op lacks a name keeps its own under a whole-model
``nnx.view(model, impl=...)``.
"""

from __future__ import annotations

__all__ = ["CONV_IMPLS", "IMPLS"]

#: Every name ``impl=`` may take: what the dense-like ops (dense, general,
#: einsum) have, ``"xla"`` (the ``jnp`` formula, the default, on every
#: backend) and ``"pallas"`` (the fused kernels of
#: :mod:`ensembles.experimental.pallas`).
IMPLS: tuple[str, ...] = ("xla", "pallas")

#: What the convolutions (plain and transposed) have: the ``jnp`` formula.
CONV_IMPLS: tuple[str, ...] = ("xla",)
