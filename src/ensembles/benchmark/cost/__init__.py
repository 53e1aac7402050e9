"""``ensembles-bench`` without ``--quality``: what does an ensemble of E cost?

``speed`` times every method (``methods``: one plain model, the BatchEnsemble,
its rank-1 variant, deep ensembles under ``nnx.vmap`` and in a loop) on every
model (``models``), each step built of ``steps`` and timed by ``timing``;
``report`` prints and plots the rows. ``compiled`` (``--compiled-for``) reads
what an ensemble costs from a chip's own compiled program instead, deviceless
where this machine lacks the chip.
"""
