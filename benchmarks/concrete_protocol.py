"""UCI Concrete with the deep ensembles paper's protocol: a check of ours.

Lakshminarayanan et al. (2017), Table 1, after Hernandez-Lobato & Adams
(2015): 20 random 90/10 train/test splits of the 1,030 mixtures, inputs and
targets standardised with the training split's statistics, one hidden layer
of 50 ReLUs with a Gaussian head (mean and softplus variance + 1e-6), the
plain Gaussian NLL, 40 epochs of batches of 100, Adam at a fixed learning
rate, 5 members; test NLL and RMSE in the targets' units (MPa). Its deep
ensemble: NLL 3.06 +- 0.18, RMSE 6.03 +- 0.58. No adversarial training here
(the paper's Table 1 ensembles use it; its Figure 2 shows it changes the
NLL little on these data).

Written as a user writes it, with the public API only: ``nnx.vmap`` for the
deep ensemble (each member on batches of its own), ``to_batch_ensemble``
for the BatchEnsemble of 5 (every member the same batch, fast weights by
``ensembles.optim``), ``training.gaussian_head`` / ``gaussian_nll`` and
``uncertainty.mixture_nll`` / ``rmse``::

    python benchmarks/concrete_protocol.py --splits 20 --json concrete.json
"""

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ensembles
from ensembles import uncertainty
from ensembles.benchmark.quality.regression.tasks import load_concrete

E, HIDDEN, EPOCHS, BATCH = 5, 50, 40, 100
MIN_STD = 1e-3  # sqrt of the paper's 1e-6 variance floor


def mlp(rngs):
    return nnx.Sequential(
        nnx.Linear(8, HIDDEN, rngs=rngs), nnx.relu, nnx.Linear(HIDDEN, 2, rngs=rngs)
    )


def split(seed):
    x, y, _ = load_concrete()
    order = np.random.default_rng(seed).permutation(len(x))
    test, train = order[: len(x) // 10], order[len(x) // 10 :]
    x_mean, x_std = x[train].mean(0), x[train].std(0)
    y_mean, y_std = y[train].mean(), y[train].std()

    def inputs(rows):
        return jnp.asarray((x[rows] - x_mean) / x_std, jnp.float32)

    return (
        inputs(train),
        jnp.asarray((y[train] - y_mean) / y_std, jnp.float32),
        inputs(test),
        y[test],
        (y_mean, y_std),
    )


def train(method, x, y, seed, learning_rate):
    steps = EPOCHS * int(np.ceil(len(x) / BATCH))
    key = jax.random.key(seed)
    if method == "deep_ensemble":

        @nnx.split_rngs(splits=E)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return mlp(rngs)

        model = create(nnx.Rngs(seed))
        tx = optax.adam(learning_rate)

        def outputs(model, x_batch):  # [E*B, ...] member-major batches
            per_member = x_batch.reshape(E, -1, x_batch.shape[-1])
            out = nnx.vmap(lambda m, x: m(x), in_axes=(0, 0))(model, per_member)
            return out.reshape(-1, 2)

        def predict(model, x):
            return nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(model, x)

    else:
        model = ensembles.to_batch_ensemble(
            mlp(nnx.Rngs(seed)), num_members=E, rngs=nnx.Rngs(seed + 1000)
        )
        tx = ensembles.optim.split_fast_weights(
            optax.adam(learning_rate), optax.adam(0.5 * learning_rate)
        )

        def outputs(model, x_batch):
            return model(x_batch)

        def predict(model, x):
            return ensembles.untile(model(ensembles.tile(x, E)), E)

    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, key):
        members = E if method == "deep_ensemble" else 1
        index = ensembles.training.member_batches(
            key, len(x), batch_size=min(BATCH, len(x)), num_members=members
        )
        x_batch, y_batch = x[index], y[index]
        if members == 1:
            x_batch = ensembles.tile(x_batch, E)

        def loss_fn(model):
            means, stds = ensembles.training.gaussian_head(
                outputs(model, x_batch), min_std=MIN_STD
            )
            return ensembles.training.gaussian_nll(means, stds, y_batch, num_members=E)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    for step_key in jax.random.split(key, steps):
        step(model, optimizer, step_key)
    return nnx.jit(predict), model


def run(splits, learning_rate, show):
    results = []
    for seed in range(splits):
        x, y, x_test, y_test, (y_mean, y_std) = split(seed)
        for method in ("deep_ensemble", "batchensemble"):
            began = time.perf_counter()
            predict, model = train(method, x, y, seed, learning_rate)
            means, stds = ensembles.training.gaussian_head(
                predict(model, x_test), min_std=MIN_STD
            )
            means, stds = means * y_std + y_mean, stds * y_std
            result = {
                "split": seed,
                "method": method,
                "nll": float(uncertainty.mixture_nll(means, stds, y_test)),
                "nll_moment_matched": float(
                    uncertainty.moment_matched_nll(means, stds, y_test)
                ),
                "rmse": float(uncertainty.rmse(means, stds, y_test)),
                "seconds": time.perf_counter() - began,
            }
            show(json.dumps(result))
            results.append(result)
    return results


def summary(results):
    lines = []
    for method in ("deep_ensemble", "batchensemble"):
        rows = [r for r in results if r["method"] == method]
        for key in ("nll", "nll_moment_matched", "rmse"):
            values = [r[key] for r in rows]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            lines.append(
                f"{method:<14} {key:<19} {statistics.fmean(values):.2f} +- "
                f"{spread:.2f} over {len(values)} splits"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", type=int, default=20)
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=0.01,
        help="Adam's (0.1 made a deep-ensemble member diverge on split 1)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = run(args.splits, args.learning_rate, lambda m: print(m, file=sys.stderr))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"learning_rate": args.learning_rate, "results": results}, handle)
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
