"""``ensembles-bench --quality``: what does an ensemble of E buy?

It trains one model, a BatchEnsemble, a deep ensemble and MC dropout
(:mod:`~ensembles.benchmark.quality_methods`) on MNIST-1D generated offline
(:mod:`~ensembles.benchmark.quality_data`) and measures, with
:mod:`ensembles.uncertainty`, their accuracy, NLL, ECE and Brier score in
distribution and at five severities of shift, and how well total entropy and
mutual information tell out-of-distribution sequences from test sequences
(AUROC).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ensembles import uncertainty
from ensembles.benchmark.quality_data import (
    SEVERITIES,
    QualityData,
    load_quality_data,
)
from ensembles.benchmark.quality_methods import (
    FINETUNE_FRACTION,
    QUALITY_METHODS,
    STEPS,
    Trained,
    train_method,
)
from ensembles.benchmark.quality_models import ModelSpec, check_model, model_name

__all__ = ["METRICS", "evaluate", "run_quality", "summarize"]

#: The metrics of a labelled set, each from :mod:`ensembles.uncertainty`
#: (``aurc``: the area under the risk-coverage curve, selective prediction).
METRICS: tuple[str, ...] = ("accuracy", "nll", "ece", "brier", "aurc")


def _metrics(logits: jax.Array, labels: np.ndarray) -> dict[str, float]:
    return {name: float(getattr(uncertainty, name)(logits, labels)) for name in METRICS}


def _ood(score: Callable, logits_in: jax.Array, logits_out: jax.Array) -> tuple:
    """AUROC and FPR at 95% TPR of ``score`` telling out- from in-distribution."""
    scores_in, scores_out = score(logits_in), score(logits_out)
    return (
        float(uncertainty.auroc(scores_in, scores_out)),
        float(uncertainty.fpr_at_tpr(scores_in, scores_out, tpr=0.95)),
    )


def evaluate(trained: Trained, data: QualityData) -> dict[str, Any]:
    """Measures a trained method on every test set of ``data``.

    Shift metrics at a severity are the means over the shift families of the
    metrics of each family's set (as CIFAR-10-C results average over
    corruptions).

    Args:
      trained: from :func:`~ensembles.benchmark.quality_methods.train_method`.
      data: from :func:`~ensembles.benchmark.quality_data.load_quality_data`.

    Returns:
      ``{"in_distribution": {metric: value}, "shift": [{"severity": s,
      metric: value, ...}, ...], "shift_mean": {metric: mean over
      severities}, "ood": {set: {"auroc_entropy": a, "auroc_mi": a,
      "fpr95_entropy": f, "fpr95_mi": f}}}``: how well total entropy and
      mutual information tell the set from the test set (AUROC, and the
      false-positive rate at 95% true positives). The ``_mi`` entries are
      ``None`` where there is one member (``single``, or E = 1): its mutual
      information is 0 everywhere.
    """
    logits_in = trained.predict(data.x_test)
    result: dict[str, Any] = {"in_distribution": _metrics(logits_in, data.y_test)}
    shift = []
    for severity in SEVERITIES:
        per_family = [
            _metrics(trained.predict(x), y) for x, y in data.shifted[severity].values()
        ]
        shift.append(
            {
                "severity": severity,
                **{m: float(np.mean([f[m] for f in per_family])) for m in METRICS},
            }
        )
    result["shift"] = shift
    result["shift_mean"] = {
        m: float(np.mean([level[m] for level in shift])) for m in METRICS
    }
    ood = {}
    for name, x in data.ood.items():
        logits_out = trained.predict(x)
        auroc_h, fpr_h = _ood(uncertainty.total_entropy, logits_in, logits_out)
        if logits_in.shape[0] == 1:  # one member: mutual information is 0
            auroc_mi = fpr_mi = None
        else:
            auroc_mi, fpr_mi = _ood(
                uncertainty.mutual_information, logits_in, logits_out
            )
        ood[name] = {
            "auroc_entropy": auroc_h,
            "auroc_mi": auroc_mi,
            "fpr95_entropy": fpr_h,
            "fpr95_mi": fpr_mi,
        }
    result["ood"] = ood
    return result


def run_quality(
    *,
    models: Sequence[ModelSpec] = ("cnn",),
    members: Sequence[int] = (4,),
    seeds: Sequence[int] = (0,),
    methods: Sequence[str] = QUALITY_METHODS,
    steps: int = STEPS,
    data: QualityData | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Trains and measures every method for every model, E and seed.

    >>> from ensembles.benchmark.quality import run_quality
    >>> from ensembles.benchmark.quality_data import load_quality_data
    >>> data = load_quality_data(num_train=100, num_test=50, num_shifted=20)
    >>> rows = run_quality(models=["mlp"], members=[2], steps=2, data=data,
    ...                    methods=["single", "batchensemble"])
    >>> [(row["method"], row["members"], row["seed"]) for row in rows]
    [('single', 2, 0), ('batchensemble', 2, 0)]
    >>> sorted(rows[1]["in_distribution"])
    ['accuracy', 'aurc', 'brier', 'ece', 'nll']
    >>> [level["severity"] for level in rows[1]["shift"]]
    [1, 2, 3, 4, 5]

    Your own classifier and data: a factory ``rngs -> nnx.Module`` (rows are
    named after it) and a :class:`QualityData` of your arrays:

    >>> from flax import nnx
    >>> def tiny(rngs):
    ...     return nnx.Sequential(nnx.Linear(40, 10, rngs=rngs))
    >>> rows = run_quality(models=[tiny], members=[2], steps=4, data=data,
    ...                    methods=["single", "finetuned"])
    >>> [(row["model"], row["method"], row["steps"]) for row in rows]
    [('tiny', 'single', 4), ('tiny', 'finetuned', 1)]

    Args:
      models: names from
        :data:`~ensembles.benchmark.quality_models.QUALITY_MODELS`, or
        factories ``rngs -> nnx.Module`` of classifiers of ``data``'s
        examples (``mc_dropout`` calls them with a ``dropout`` keyword too).
      members: ensemble sizes E.
      seeds: seeds of parameters, batches and dropout (the data are fixed).
      methods: names from
        :data:`~ensembles.benchmark.quality_methods.QUALITY_METHODS`.
      steps: training steps of every method; ``finetuned`` fine-tunes the
        trained ``single`` model of the same seed (trained once, whether or
        not ``single`` is in ``methods``) for ``FINETUNE_FRACTION`` of them,
        and its row's ``steps`` counts only those.
      data: the data; ``None`` generates the standard sets
        (:func:`~ensembles.benchmark.quality_data.load_quality_data`).
      progress: called with a status line before each training, and with
        ``""`` at the end.

    Returns:
      One row (a dict) per model, E, seed and method: ``method``, ``model``,
      ``members``, ``seed``, ``steps``, ``params``, ``train_s`` and the
      measurements of :func:`evaluate`.

    Raises:
      ValueError: if ``mc_dropout`` is asked of a factory without a
        ``dropout`` keyword (checked before anything trains).
    """
    show = progress or (lambda message: None)
    data = load_quality_data() if data is None else data
    for model in models:  # refuse now, not after an hour of training
        check_model(model, methods)
    finetune_steps = max(1, int(steps * FINETUNE_FRACTION))
    rows: list[dict[str, Any]] = []
    total = len(models) * len(members) * len(seeds) * len(methods)
    index = 0
    # `single` does not depend on E: trained once per model and seed, its row
    # repeated for every E, and its model the start of `finetuned`.
    singles: dict[tuple[int, int], tuple[Trained, dict[str, Any]]] = {}

    def single_of(model: ModelSpec, seed: int, where: str) -> tuple[Trained, dict]:
        key = (id(model), seed)
        if key not in singles:
            show(f"{where}: training single ({steps} steps)")
            trained = train_method(
                "single",
                model,
                data.x_train,
                data.y_train,
                num_members=1,
                steps=steps,
                seed=seed,
            )
            singles[key] = (trained, _measure(trained, data))
        return singles[key]

    for model in models:
        name = model_name(model)
        for num_members in members:
            for seed in seeds:
                for method in methods:
                    index += 1
                    where = f"[{index}/{total}] {name} E={num_members} seed {seed}"
                    method_steps = steps
                    if method == "single":
                        measured = single_of(model, seed, where)[1]
                    else:
                        start = None
                        if method == "finetuned":
                            start = single_of(model, seed, where)[0].model
                            method_steps = finetune_steps
                        show(f"{where}: training {method} ({method_steps} steps)")
                        trained = train_method(
                            method,
                            model,
                            data.x_train,
                            data.y_train,
                            num_members=num_members,
                            steps=method_steps,
                            seed=seed,
                            start=start,
                        )
                        measured = _measure(trained, data)
                    rows.append(
                        {
                            "task": data.name,
                            "method": method,
                            "model": name,
                            "members": num_members,
                            "seed": seed,
                            "steps": method_steps,
                            **measured,
                        }
                    )
    show("")
    return rows


def _measure(trained: Trained, data: QualityData) -> dict[str, Any]:
    return {
        "params": trained.params,
        "train_s": trained.train_s,
        **evaluate(trained, data),
    }


def _mean_std(values: list[float | None]) -> dict[str, float | None]:
    if any(value is None for value in values):
        return {"mean": None, "std": None}
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Means and standard deviations over seeds, per model, E and method.

    >>> from ensembles.benchmark.quality import summarize
    >>> row = {"method": "single", "model": "mlp", "members": 4, "params": 10,
    ...        "train_s": 1.0, "in_distribution": {"nll": 0.5},
    ...        "shift": [{"severity": 1, "nll": 0.7}], "shift_mean": {"nll": 0.7},
    ...        "ood": {"noise": {"auroc_entropy": 0.6, "auroc_mi": None}}}
    >>> other = {**row, "in_distribution": {"nll": 0.7}}
    >>> summary = summarize([row, other])[0]
    >>> round(summary["in_distribution"]["nll"]["mean"], 6)
    0.6
    >>> summary["seeds"], summary["ood"]["noise"]["auroc_mi"]
    (2, {'mean': None, 'std': None})

    Args:
      rows: from :func:`run_quality`.

    Returns:
      One dict per (task, model, E, method), in first-seen order, with ``seeds``
      (how many), ``params`` and, for ``train_s`` and every measurement,
      ``{"mean": m, "std": s}`` (sample standard deviation; 0 for one seed).
      A ``gap_closed`` entry on ``batchensemble``, ``rank1`` and ``finetuned``
      rows with a
      single model and
      a deep ensemble beside them gives the fraction of the NLL gap from one
      model to the deep ensemble that it closes, in distribution and under
      shift (mean over severities).
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = (row.get("task", "mnist1d"), row["model"], row["members"], row["method"])
        groups.setdefault(key, []).append(row)
    summary = []
    for (task, model, members, method), group in groups.items():
        entry: dict[str, Any] = {
            "task": task,
            "method": method,
            "model": model,
            "members": members,
            "seeds": len(group),
            "params": group[0]["params"],
            "train_s": _mean_std([row["train_s"] for row in group]),
            "in_distribution": {
                m: _mean_std([row["in_distribution"][m] for row in group])
                for m in group[0]["in_distribution"]
            },
            "shift": [
                {
                    "severity": level["severity"],
                    **{
                        m: _mean_std([row["shift"][i][m] for row in group])
                        for m in level
                        if m != "severity"
                    },
                }
                for i, level in enumerate(group[0]["shift"])
            ],
            "shift_mean": {
                m: _mean_std([row["shift_mean"][m] for row in group])
                for m in group[0]["shift_mean"]
            },
            "ood": {
                name: {
                    score: _mean_std([row["ood"][name][score] for row in group])
                    for score in scores
                }
                for name, scores in group[0]["ood"].items()
            },
        }
        summary.append(entry)
    by_key = {(e["task"], e["model"], e["members"], e["method"]): e for e in summary}
    for entry in summary:
        if entry["method"] not in ("batchensemble", "rank1", "finetuned"):
            continue
        where = (entry["task"], entry["model"], entry["members"])
        single = by_key.get((*where, "single"))
        deep = by_key.get((*where, "deep_ensemble"))
        if single is None or deep is None:
            continue
        entry["gap_closed"] = {
            where: _gap_closed(single[where], entry[where], deep[where])
            for where in ("in_distribution", "shift_mean")
            if "nll" in entry[where]
        }
    return summary


def _gap_closed(single: dict, ensemble: dict, deep: dict) -> float | None:
    gap = single["nll"]["mean"] - deep["nll"]["mean"]
    if gap <= 0:
        return None  # the deep ensemble is no better: there is no gap to close
    return (single["nll"]["mean"] - ensemble["nll"]["mean"]) / gap
