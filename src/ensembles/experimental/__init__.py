"""Opt-in parts of ``ensembles`` that ``import ensembles`` never loads.

:mod:`ensembles.experimental.pallas` holds the fused Pallas kernels of the
dense op (Triton on GPU, Mosaic on TPU, a Hopper kernel in the making), run
when ``impl="pallas"`` names them; no default call reaches them.
"""
