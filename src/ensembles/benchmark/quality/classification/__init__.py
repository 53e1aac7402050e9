"""The quality benchmark's classification tasks and how a classifier is scored.

``mnist1d`` and ``tasks`` build the tasks (MNIST-1D, generated offline; the
digits and tabular tasks); ``scores`` measures a method's member logits
(accuracy, NLL, ECE, Brier, AURC, out-of-distribution AUROC, its
temperature); ``report`` lays out a classification task's tables.
"""
