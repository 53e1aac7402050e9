"""Uncertainty on real data: one MLP vs a BatchEnsemble vs a deep ensemble.

On scikit-learn's bundled digits data (8x8 images; nothing is downloaded) it
trains, on classes 0-4 only:

- ``single``: one MLP;
- ``batchensemble``: the same MLP converted with ``ensembles.to_batch_ensemble``
  (E members sharing weights, rank-one fast weights each; the fast weights get
  half the learning rate and no weight decay, the BatchEnsemble recipe);
- ``deep_ensemble``: E independently initialised MLPs (``nnx.vmap``).

It reports accuracy, NLL, ECE and Brier score on held-out digits 0-4, and how
well the total entropy and the mutual information of each model separate
held-out 0-4 (in distribution) from digits 5-9 (out of distribution, AUROC),
with parameter counts and training times. ``--plot PATH.png`` draws reliability
diagrams and uncertainty histograms (needs matplotlib).

    python examples/digits_uncertainty.py [--members 4] [--steps 1500] [--plot out.png]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import ensembles
from ensembles import uncertainty

IN_CLASSES = 5


class MLP(nnx.Module):
    def __init__(self, *, rngs):
        self.layers = nnx.Sequential(
            nnx.Linear(64, 128, rngs=rngs),
            nnx.relu,
            nnx.Linear(128, 128, rngs=rngs),
            nnx.relu,
            nnx.Linear(128, IN_CLASSES, rngs=rngs),
        )

    def __call__(self, x):
        return self.layers(x)


def load_data(seed):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    inside = y < IN_CLASSES
    x_train, x_test, y_train, y_test = train_test_split(
        x[inside], y[inside], test_size=0.3, random_state=seed, stratify=y[inside]
    )
    return x_train, y_train, x_test, y_test, x[~inside]


def count_params(model):
    return sum(
        int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param))
    )


# Each method: (model, optimizer, member_logits(model, x) -> [E, B, C]). The
# train step is shared: the loss is the sum over members of their mean cross
# entropy, so members never mix (each member's gradient is its own loss's).


def make_single(seed, lr):
    model = MLP(rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(lr, weight_decay=1e-4), wrt=nnx.Param)
    return model, optimizer, lambda model, x: model(x)[None]


def make_batchensemble(seed, lr, members):
    model = ensembles.to_batch_ensemble(
        MLP(rngs=nnx.Rngs(seed)),
        num_members=members,
        rngs=nnx.Rngs(seed + 1),
        r_init=ensembles.initializers.random_sign(0.5),
        s_init=ensembles.initializers.random_sign(0.5),
    )
    tx = ensembles.optim.split_fast_weights(
        optax.adamw(lr, weight_decay=1e-4), optax.adam(0.5 * lr)
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    # Every member sees the same examples: tile the batch E times.
    return (
        model,
        optimizer,
        (lambda model, x: ensembles.untile(model(ensembles.tile(x, members)), members)),
    )


def make_deep_ensemble(seed, lr, members):
    @nnx.split_rngs(splits=members)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return MLP(rngs=rngs)

    model = create(nnx.Rngs(seed))
    # adamw is elementwise, so one optimizer over the stacked parameters trains
    # E independent models.
    optimizer = nnx.Optimizer(model, optax.adamw(lr, weight_decay=1e-4), wrt=nnx.Param)

    @nnx.vmap(in_axes=(0, None), out_axes=0)
    def member_logits(model, x):
        return model(x)

    return model, optimizer, member_logits


@nnx.jit(static_argnums=0)
def train_step(member_logits, model, optimizer, x, y):
    def loss_fn(model):
        logits = member_logits(model, x)  # [E, B, C]
        labels = jnp.broadcast_to(y, logits.shape[:2])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return losses.mean(axis=1).sum()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def train(name, method, data, steps, batch, seed):
    model, optimizer, member_logits = method
    x_train, y_train = data
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    with tqdm(range(steps), desc=f"{name:>14}", unit="step", leave=True) as bar:
        for step in bar:
            idx = rng.choice(len(x_train), batch, replace=False)
            loss = train_step(
                member_logits, model, optimizer, x_train[idx], y_train[idx]
            )
            if step % 50 == 0:
                bar.set_postfix(loss=f"{float(loss):.3f}")
    jax.block_until_ready(nnx.state(model))
    return time.perf_counter() - start


def evaluate(method, x_test, y_test, x_ood):
    model, _, member_logits = method
    logits_in = member_logits(model, x_test)
    logits_out = member_logits(model, x_ood)
    return {
        "accuracy": float(uncertainty.accuracy(logits_in, y_test)),
        "nll": float(uncertainty.nll(logits_in, y_test)),
        "ece": float(uncertainty.ece(logits_in, y_test)),
        "brier": float(uncertainty.brier(logits_in, y_test)),
        "auroc_entropy": float(
            uncertainty.auroc(
                uncertainty.total_entropy(logits_in),
                uncertainty.total_entropy(logits_out),
            )
        ),
        "auroc_mi": float(
            uncertainty.auroc(
                uncertainty.mutual_information(logits_in),
                uncertainty.mutual_information(logits_out),
            )
        ),
        "logits_in": logits_in,
        "logits_out": logits_out,
    }


def plot(results, y_test, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install matplotlib (or the `bench` extra)"
        ) from None
    names = list(results)
    fig, axes = plt.subplots(2, len(names), figsize=(4 * len(names), 7))
    bins = np.linspace(0, 1, 11)
    for column, name in enumerate(names):
        res = results[name]
        probs = np.asarray(uncertainty.predictive_probs(res["logits_in"]))
        confidence = probs.max(-1)
        correct = probs.argmax(-1) == y_test
        which = np.clip(np.digitize(confidence, bins[1:-1]), 0, len(bins) - 2)
        accs = [
            correct[which == b].mean() if np.any(which == b) else np.nan
            for b in range(len(bins) - 1)
        ]
        ax = axes[0, column]
        ax.bar(bins[:-1], accs, width=0.1, align="edge", edgecolor="k", alpha=0.7)
        ax.plot([0, 1], [0, 1], "r--", lw=1)
        ax.set(
            title=f"{name}: reliability (ECE {res['ece']:.3f})",
            xlabel="confidence",
            ylabel="accuracy",
            xlim=(0, 1),
            ylim=(0, 1),
        )
        ax = axes[1, column]
        ent_in = np.asarray(uncertainty.total_entropy(res["logits_in"]))
        ent_out = np.asarray(uncertainty.total_entropy(res["logits_out"]))
        edges = np.linspace(0, np.log(IN_CLASSES), 30)
        ax.hist(ent_in, edges, alpha=0.6, label="digits 0-4 (in)", density=True)
        ax.hist(ent_out, edges, alpha=0.6, label="digits 5-9 (OOD)", density=True)
        ax.set(
            title=f"total entropy (AUROC {res['auroc_entropy']:.3f})",
            xlabel="entropy (nats)",
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="PATH.png")
    args = parser.parse_args(argv)
    if args.members < 1 or args.steps < 1:
        parser.error("--members and --steps must be >= 1")

    x_train, y_train, x_test, y_test, x_ood = load_data(args.seed)
    print(
        f"train {len(x_train)} / test {len(x_test)} digits 0-4; "
        f"{len(x_ood)} digits 5-9 as out-of-distribution"
    )
    methods = {
        "single": make_single(args.seed, args.lr),
        "batchensemble": make_batchensemble(args.seed, args.lr, args.members),
        "deep_ensemble": make_deep_ensemble(args.seed, args.lr, args.members),
    }
    results = {}
    for name, method in methods.items():
        seconds = train(
            name, method, (x_train, y_train), args.steps, args.batch, args.seed
        )
        results[name] = evaluate(method, x_test, y_test, x_ood)
        results[name]["params"] = count_params(method[0])
        results[name]["train_s"] = seconds

    header = (
        f"{'method':>14} {'params':>8} {'train s':>8} {'acc':>6} {'nll':>6} "
        f"{'ece':>6} {'brier':>6} {'AUROC H':>8} {'AUROC MI':>9}"
    )
    print(header)
    for name, r in results.items():
        mi = "n/a" if name == "single" else f"{r['auroc_mi']:.3f}"
        print(
            f"{name:>14} {r['params']:>8,} {r['train_s']:>8.1f} {r['accuracy']:>6.3f} "
            f"{r['nll']:>6.3f} {r['ece']:>6.3f} {r['brier']:>6.3f} "
            f"{r['auroc_entropy']:>8.3f} {mi:>9}"
        )
    print(
        "AUROC: how well the score ranks digits 5-9 above held-out 0-4 (1 = "
        "perfectly, 0.5 = chance); H = total entropy, MI = mutual information "
        "(a single model has none)."
    )
    if args.plot:
        plot(results, y_test, args.plot)
    return results


if __name__ == "__main__":
    main()
