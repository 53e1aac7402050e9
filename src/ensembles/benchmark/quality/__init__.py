"""``ensembles-bench --quality``: what does an ensemble of E buy?

It trains one model, a BatchEnsemble, a deep ensemble and the other methods
(:mod:`~ensembles.benchmark.quality.methods`) on a task's training set
(:mod:`~ensembles.benchmark.quality.tasks`, or a user's
:class:`~ensembles.benchmark.quality.data.QualityData`) and measures, with
:mod:`ensembles.uncertainty`, their accuracy, NLL, ECE, Brier score and AURC
in distribution and at every severity of shift, and how well total entropy
and mutual information tell out-of-distribution examples from test examples
(:mod:`~ensembles.benchmark.quality.classification`). Regression data
(``QualityData(..., regression=True)``) are measured by
:mod:`~ensembles.benchmark.quality.regression` instead: the members'
Gaussians as their exact mixture, RMSE, NLL, CRPS, calibration and
intervals.

Every method is measured twice: **as trained**, and **recalibrated**, with
one temperature of its own (:func:`ensembles.uncertainty.fit_temperature`,
pool then calibrate; a regressor: one scale of its predictive's spread)
fitted on a validation split held out of the training data, never the test
set. The recalibrated figures are the fair comparison: a method that is only
over- or underconfident gains from its temperature what any other would.

Both kinds of task share this package's modules: the data (``data``), the
task registry (``tasks``), the models, recipes and training loop
(``models``, ``methods``, ``training``), the checks before training
(``checks``), the driver (``run``), the calibrations and what measuring
shares (``calibration``, ``measures``), and the report's summary, tables and
figure (``report``, ``tables``, ``plots``). Where the two kinds differ (their
tasks, scores, tables and panels) each has a sub-package of its own.
"""
