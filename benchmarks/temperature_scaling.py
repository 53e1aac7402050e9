"""One fitted temperature on the quality benchmark's models (docs/uncertainty.md).

Trains one model (``single``), a BatchEnsemble and its rank-1 variant (the
library's defaults) and a deep ensemble, E = 4, on every task of
``ensembles-bench --quality`` as it does, fits one temperature
per trained method on half of the in-distribution test set
(``ensembles.uncertainty.fit_temperature``, pool then calibrate) and measures
NLL and ECE on the other half and on every shifted set (mean over the families
and the five severities), before and after
``ensembles.uncertainty.scale_temperature``::

    python benchmarks/temperature_scaling.py [--seeds 3] [--tasks mnist1d,digits]
"""

import argparse
import statistics
import sys

import numpy as np

from ensembles import uncertainty
from ensembles.benchmark.quality_data import SEVERITIES
from ensembles.benchmark.quality_methods import train_method
from ensembles.benchmark.quality_tasks import TASK_MODELS, TASK_STEPS, TASKS, load_task

E = 4
METHODS = {"single": 1, "batchensemble": E, "rank1": E, "deep_ensemble": E}


def _nll_ece(logits, labels):
    return float(uncertainty.nll(logits, labels)), float(
        uncertainty.ece(logits, labels)
    )


def measure(trained, data, calibration, evaluation):
    """Raw and temperature-scaled NLL / ECE, in distribution and under shift."""
    temperature = uncertainty.fit_temperature(
        trained.predict(data.x_test[calibration]), data.y_test[calibration]
    )

    def both(x, y):
        logits = trained.predict(x)
        scaled = uncertainty.scale_temperature(logits, temperature)
        return _nll_ece(logits, y) + _nll_ece(scaled, y)

    test = both(data.x_test[evaluation], data.y_test[evaluation])
    shifted = [
        both(x, y)
        for severity in SEVERITIES
        for x, y in data.shifted[severity].values()
    ]
    shift = tuple(statistics.fmean(values) for values in zip(*shifted, strict=True))
    return {"temperature": float(temperature), "test": test, "shift": shift}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tasks", default=",".join(TASKS))
    args = parser.parse_args(argv)
    rows = []
    for task in args.tasks.split(","):
        data = load_task(task)
        # A fixed half of the test set fits the temperature, the other measures.
        order = np.random.default_rng(0).permutation(len(data.y_test))
        calibration, evaluation = np.sort(order[::2]), np.sort(order[1::2])
        for model in TASK_MODELS[task]:
            for method, members in METHODS.items():
                runs = []
                for seed in range(args.seeds):
                    print(f"{task} {model} {method} seed {seed}", file=sys.stderr)
                    trained = train_method(
                        method,
                        model,
                        data.x_train,
                        data.y_train,
                        num_members=members,
                        steps=TASK_STEPS[task],
                        seed=seed,
                    )
                    runs.append(measure(trained, data, calibration, evaluation))
                rows.append((task, model, method, runs))
    print(
        f"E = {E}, mean of {args.seeds} seeds; the temperature fitted on half of the "
        "test set, NLL and ECE on the other half and on every shifted set; "
        "'raw -> scaled'.\n"
    )
    print("| task, model | method | T | NLL | ECE | shift NLL | shift ECE |")
    print("|:---|:---|---:|---:|---:|---:|---:|")
    for task, model, method, runs in rows:

        def mean(where, index, runs=runs):
            return statistics.fmean(run[where][index] for run in runs)

        cells = [
            f"{mean(where, i):.3f} -> {mean(where, i + 2):.3f}"
            for where in ("test", "shift")
            for i in (0, 1)
        ]
        temperature = statistics.fmean(run["temperature"] for run in runs)
        print(
            f"| {task}, {model} | {method} | {temperature:.2f} | "
            + " | ".join(cells)
            + " |"
        )


if __name__ == "__main__":
    main()
