"""The quality benchmark's regression tasks and how a regressor is scored.

``tasks`` builds the tasks (offline; UCI Concrete bundled); ``scores``
measures a method's members' Gaussians as their exact mixture (RMSE, NLL,
CRPS, calibration, intervals, out-of-distribution AUROC, its scale of the
spread); ``report`` and ``plots`` lay out a regression task's tables and the
panels only it has.
"""
