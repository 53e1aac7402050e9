"""Which fine-tuning choices matter: the table of docs/converting.md.

Trains the quality benchmark's ``single`` model (``ensembles-bench --quality``:
MNIST-1D, 2,000 AdamW steps) and a deep ensemble per seed, then converts the
trained model into a BatchEnsemble of E = 4 and fine-tunes it with recipes that
differ in one choice from the library's (``finetuned``: fast weights N(1, 0.3),
every parameter trained, the learning rate decayed from the training rate to 0
along a cosine, per-member batches, FINETUNE_FRACTION of the steps), and
prints a Markdown table of means over seeds: each row's change against the
trained model, and the share of the shift-NLL gap to the deep ensemble it
closes.

    python benchmarks/finetune_recipe.py [--model cnn] [--seeds 3]
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ensembles
from ensembles.benchmark.quality.classification.mnist1d import load_quality_data
from ensembles.benchmark.quality.classification.scores import evaluate
from ensembles.benchmark.quality.methods import (
    BATCH_SIZE,
    FINETUNE_FRACTION,
    FINETUNE_INIT_STDDEV,
    LEARNING_RATE,
    STEPS,
    WEIGHT_DECAY,
    Trained,
    train_method,
)
from ensembles.benchmark.quality.run import split_validation

E = 4
THE_RECIPE = {
    "init": FINETUNE_INIT_STDDEV,
    "train": "all",
    "schedule": "cosine",
    "learning_rate": LEARNING_RATE,
    "tiled": False,
    "fraction": FINETUNE_FRACTION,
}
# name: overrides of THE_RECIPE ("the recipe" runs train_method("finetuned"), which
# finetune() below reproduces with other draws)
RECIPES = {
    "the recipe": {},
    "fast-weight init stddev 0.2": {"init": 0.2},
    "fast-weight init stddev 0.4": {"init": 0.4},
    "fast-weight init stddev 0.5": {"init": 0.5},
    "fast weights only": {"train": "fast"},
    "fast weights and biases": {"train": "fast+bias"},
    "shared weights at 0.1x": {"train": "all, shared 0.1x"},
    "constant learning rate": {"schedule": "constant"},
    "learning rate / 3": {"learning_rate": LEARNING_RATE / 3},
    "learning rate x 3": {"learning_rate": LEARNING_RATE * 3},
    "tiled batches": {"tiled": True},
    "half the steps": {"fraction": FINETUNE_FRACTION / 2},
    "twice the steps": {"fraction": FINETUNE_FRACTION * 2},
}


def _labels(params, train):
    """'fast', 'shared' or 'frozen' for every parameter, by the recipe."""

    def label(path, variable):
        if isinstance(variable, ensembles.FastWeight):
            return "fast"
        if train == "fast" or (train == "fast+bias" and path[-1] != "bias"):
            return "frozen"
        return "shared"

    flat = nnx.to_flat_state(params)
    return nnx.from_flat_state([(path, label(path, v)) for path, v in flat])


def finetune(start, data, seed, recipe):
    steps = max(1, int(STEPS * recipe["fraction"]))
    root = jax.random.key(seed)
    init = ensembles.initializers.normal(1.0, recipe["init"])
    model = ensembles.to_batch_ensemble(
        start,
        num_members=E,
        rngs=nnx.Rngs(jax.random.fold_in(root, 10)),
        r_init=init,
        s_init=init,
    )
    rate = recipe["learning_rate"]
    if recipe["schedule"] == "cosine":
        rate = optax.cosine_decay_schedule(rate, steps)
    shared_rate = rate
    if recipe["train"] == "all, shared 0.1x":
        shared_rate = (
            optax.cosine_decay_schedule(recipe["learning_rate"] / 10, steps)
            if recipe["schedule"] == "cosine"
            else recipe["learning_rate"] / 10
        )
    tx = optax.multi_transform(
        {
            "fast": optax.adam(rate),
            "shared": optax.adamw(shared_rate, weight_decay=WEIGHT_DECAY),
            "frozen": optax.set_to_zero(),
        },
        _labels(nnx.state(model, nnx.Param), recipe["train"]),
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x_all, y_all = jnp.asarray(data.x_train), jnp.asarray(data.y_train)

    @nnx.jit
    def step(model, optimizer, key):
        members = 1 if recipe["tiled"] else E
        index = ensembles.training.member_batches(
            key, len(x_all), batch_size=BATCH_SIZE, num_members=members
        )
        x, y = x_all[index], y_all[index]
        if recipe["tiled"]:
            x = ensembles.tile(x, E)

        def loss_fn(model):
            return ensembles.training.cross_entropy(model(x), y, num_members=E)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    for key in jax.random.split(jax.random.fold_in(root, 11), steps):
        step(model, optimizer, key)
    model.eval()
    predict = nnx.jit(lambda m, x: ensembles.untile(m(ensembles.tile(x, E)), E))
    return Trained("finetuned", lambda x: predict(model, jnp.asarray(x)), 0, 0.0)


def _row(result):
    return {
        "acc": result["in_distribution"]["accuracy"],
        "NLL": result["in_distribution"]["nll"],
        "ECE": result["in_distribution"]["ece"],
        "shift NLL": result["shift_mean"]["nll"],
        "shift ECE": result["shift_mean"]["ece"],
        "OOD MI": result["ood"]["shuffled"]["auroc_mi"],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--recipes",
        type=lambda text: text.split(","),
        default=list(RECIPES),
        help="comma-separated names of RECIPES to run (default: all)",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.recipes if name not in RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; choose from {list(RECIPES)}")
    data, x_valid, y_valid = split_validation(load_quality_data())
    rows = {name: [] for name in ("trained model", "deep ensemble", *args.recipes)}
    gaps = {name: [] for name in args.recipes}
    for seed in range(args.seeds):
        print(f"seed {seed}: single, deep ensemble", file=sys.stderr, flush=True)
        single = train_method(
            "single", args.model, data.x_train, data.y_train, num_members=1, seed=seed
        )
        deep = train_method(
            "deep_ensemble",
            args.model,
            data.x_train,
            data.y_train,
            num_members=E,
            seed=seed,
        )
        base, top = (
            _row(evaluate(single, data, x_valid=x_valid, y_valid=y_valid)),
            _row(evaluate(deep, data, x_valid=x_valid, y_valid=y_valid)),
        )
        rows["trained model"].append(base)
        rows["deep ensemble"].append(top)
        for name in args.recipes:
            print(f"seed {seed}: {name}", file=sys.stderr, flush=True)
            if name == "the recipe":  # the benchmark's own method, as it runs
                tuned = train_method(
                    "finetuned",
                    args.model,
                    data.x_train,
                    data.y_train,
                    num_members=E,
                    steps=int(STEPS * FINETUNE_FRACTION),
                    seed=seed,
                    start=single.model,
                )
            else:
                tuned = finetune(
                    single.model, data, seed, {**THE_RECIPE, **RECIPES[name]}
                )
            row = _row(evaluate(tuned, data, x_valid=x_valid, y_valid=y_valid))
            rows[name].append(row)
            gaps[name].append(
                (base["shift NLL"] - row["shift NLL"])
                / (base["shift NLL"] - top["shift NLL"])
            )
    columns = list(rows["trained model"][0])
    print(
        f"{args.model}, E={E}, mean of {args.seeds} seeds; the recipe: fast weights "
        f"N(1, {FINETUNE_INIT_STDDEV}), every parameter, lr {LEARNING_RATE} cosine "
        f"to 0, per-member batches, {int(STEPS * FINETUNE_FRACTION)} steps from "
        f"the trained model; other rows change one choice. 'gap': the share of "
        f"the shift-NLL gap from the trained model to the deep ensemble closed "
        f"(min over seeds in brackets)."
    )
    print()
    print("| recipe | " + " | ".join(columns) + " | gap |")
    print("|:---|" + "---:|" * (len(columns) + 1))
    for name, values in rows.items():
        cells = []
        for column in columns:
            numbers = [v[column] for v in values]
            cells.append("n/a" if None in numbers else f"{np.mean(numbers):.3f}")
        gap = gaps.get(name)
        cells.append(f"{np.mean(gap):.0%} ({min(gap):.0%})" if gap else "")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
