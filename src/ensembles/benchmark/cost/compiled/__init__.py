"""``ensembles-bench --compiled-for``: what a chip's compiled program costs.

``chips`` compiles for a chip this machine may lack (an H100, TPUs);
``hlo_text``, ``hlo_ops`` and ``hlo`` read the optimized program it writes
(kernels, loops, flops, bytes, collectives); ``programs`` builds a model's
plain and BatchEnsemble programs and compares them; ``report`` runs every
comparison asked for and prints them.
"""
