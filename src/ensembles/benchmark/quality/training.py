"""The mechanics every method of the quality benchmark trains with.

:class:`Context` holds what a recipe shares (the model to build, the data on
the device, the seed's keys), :func:`objective` the loss of member-major
outputs (cross entropy of a classifier's logits, or the (beta-)NLL of a
regressor's Gaussian head), :func:`optimizer` the optimizers and
:func:`train_steps` the jitted loop; :func:`fast_weight_options`,
:func:`independent_head_options` and :func:`reinit_first_layer` shape a
conversion. The recipes themselves, and the constants they use, are
:mod:`~ensembles.benchmark.quality.methods`'.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.nn.initializers import Initializer

import ensembles
from ensembles._checks import check_num_members, check_positive_int
from ensembles._graph import in_construction_order
from ensembles.benchmark.quality.models import ModelSpec, build_model

__all__ = [
    "Context",
    "fast_weight_options",
    "gaussian_pairs",
    "independent_head_options",
    "objective",
    "optimizer",
    "reinit_first_layer",
    "train_steps",
    "validation_loss",
]


@dataclasses.dataclass(frozen=True)
class Context:
    """What every recipe shares: the model, the data on the device, the keys.

    One root key per seed, one independent stream per use (no key is ever
    used twice: the parameters, the fast weights and the batches of a seed,
    or of two seeds, never share a draw).

    Attributes:
      model: the name or factory to build.
      num_members: E.
      steps: optimizer steps.
      shape: ``build_model``'s ``input_shape`` and ``num_classes`` (a
        regressor's: two outputs, a mean and a raw spread, per target).
      x_all: every training example, on the device.
      y_all: their labels or targets.
      batch: examples per member per step.
      root: the seed's key.
    """

    model: ModelSpec
    num_members: int
    steps: int
    shape: dict[str, Any]
    x_all: jax.Array
    y_all: jax.Array
    batch: int
    root: jax.Array

    @classmethod
    def of(
        cls,
        model: ModelSpec,
        x_train: np.ndarray,
        y_train: np.ndarray,
        *,
        num_members: int,
        steps: int,
        seed: int,
        batch_size: int,
        regression: bool,
        num_classes: int | None,
    ) -> Context:
        """The context of training ``model`` on ``(x_train, y_train)``."""
        if regression:
            num_classes = 2 * math.prod(np.shape(y_train)[1:])
        elif num_classes is None:
            num_classes = int(np.max(y_train)) + 1
        return cls(
            model=model,
            num_members=check_num_members(num_members),
            steps=check_positive_int(steps, "steps"),
            shape={
                "input_shape": tuple(np.shape(x_train)[1:]),
                "num_classes": num_classes,
            },
            x_all=jnp.asarray(x_train),
            y_all=jnp.asarray(y_train),
            batch=min(batch_size, len(x_train)),
            root=jax.random.key(seed),
        )

    def key(self, use: int) -> jax.Array:
        """0: parameters, 1: fast weights, 2: batches, 3: the first layer."""
        return jax.random.fold_in(self.root, use)

    def draw(self, key: jax.Array, members: int) -> tuple[jax.Array, jax.Array]:
        """``members`` batches of B examples of their own, member-major."""
        index = ensembles.training.member_batches(
            key, len(self.x_all), batch_size=self.batch, num_members=members
        )
        return self.x_all[index], self.y_all[index]

    def build(self, **options: Any) -> nnx.Module:
        """A new model (``options``: ``rngs`` and, for MC dropout, ``dropout``)."""
        return build_model(self.model, **self.shape, **options)


def objective(
    *, regression: bool, beta: float, min_std: float, diversity: float
) -> Callable[[jax.Array, jax.Array, int], jax.Array]:
    """``loss(outputs, targets, num_members)`` of member-major outputs.

    A classifier's: :func:`ensembles.training.cross_entropy`, less
    ``diversity`` times the mean squared distance of each member's softmax
    from the members' mean. A regressor's:
    :func:`ensembles.training.gaussian_nll` (exponent ``beta``) of
    :func:`ensembles.training.gaussian_head`'s means and spreads (floor
    ``min_std``).
    """
    if not regression:

        def classify(outputs, labels, num_members):
            loss = ensembles.training.cross_entropy(
                outputs, labels, num_members=num_members
            )
            if diversity:
                probs = jax.nn.softmax(ensembles.untile(outputs, num_members), -1)
                spread = jnp.sum((probs - probs.mean(axis=0)) ** 2, axis=-1)
                loss = loss - diversity * jnp.mean(spread)
            return loss

        return classify

    def regress(outputs, targets, num_members):
        means, stds = ensembles.training.gaussian_head(
            gaussian_pairs(outputs, targets.shape[1:]), min_std=min_std
        )
        return ensembles.training.gaussian_nll(
            means, stds, targets, num_members=num_members, beta=beta
        )

    return regress


def gaussian_pairs(outputs: jax.Array, target_shape: tuple[int, ...]) -> jax.Array:
    """A regressor's ``[..., 2 D]`` outputs as ``[..., (D,) 2]`` pairs."""
    return outputs.reshape(*outputs.shape[:-1], *target_shape, 2)


def validation_loss(
    predict_fn: Callable,
    x_valid: np.ndarray,
    y_valid: np.ndarray,
    regression: bool,
    min_std: float,
) -> Callable[[nnx.Module], jax.Array]:
    """The method's NLL on held-out examples, as it predicts (for early stopping).

    A classifier's: :func:`ensembles.uncertainty.nll` of its member logits;
    a regressor's: :func:`ensembles.uncertainty.mixture_nll` of its members'
    Gaussians (targets as it trains on them, standardised).
    """
    x, y = jnp.asarray(x_valid), jnp.asarray(y_valid)

    def loss(model):
        outputs = predict_fn(model, x)
        if not regression:
            return ensembles.uncertainty.nll(outputs, y)
        means, stds = ensembles.training.gaussian_head(
            gaussian_pairs(outputs, y.shape[1:]), min_std=min_std
        )
        return ensembles.uncertainty.mixture_nll(means, stds, y)

    return loss


def optimizer(
    model: nnx.Module,
    *,
    learning_rate: float,
    weight_decay: float,
    fast: float | None,
    decay_steps: int | None = None,
) -> nnx.Optimizer:
    """AdamW; with a multiplier ``fast``, Adam for the fast weights (the recipe).

    With ``decay_steps`` the learning rates decay to 0 along a cosine.
    """
    import optax

    def rate(scale: float) -> Any:
        if decay_steps is None:
            return scale * learning_rate
        return optax.cosine_decay_schedule(scale * learning_rate, decay_steps)

    shared = optax.adamw(rate(1.0), weight_decay=weight_decay)
    if fast is not None:
        tx = ensembles.optim.split_fast_weights(shared, optax.adam(rate(fast)))
    else:
        tx = shared
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def train_steps(
    net: nnx.Module,
    optimizer: nnx.Optimizer,
    loss_fn: Callable,
    context: Context,
    validate: Callable[[nnx.Module], jax.Array] | None = None,
    checks: int = 1,
) -> tuple[float, int]:
    """Runs every step (jitted, the batch drawn on the device).

    ``loss_fn(model, key, step)`` draws its batch from ``key``. With
    ``validate`` (the model's loss on held-out examples, lower is better)
    the model is checked ``checks`` times, evenly over the steps (the last
    step included; 1: only after it), and ends with the parameters of its
    best check: early stopping, without stopping (the steps are a cap, so
    every method runs the same number).

    Returns:
      ``(seconds, best_step)``: the seconds count every step and check, the
      first step's compilation included; ``best_step`` is the number of steps
      the kept parameters had trained (``context.steps`` without
      ``validate``).
    """

    @nnx.jit
    def train_step(model, optimizer, key, step):
        loss, grads = nnx.value_and_grad(loss_fn)(model, key, step)
        optimizer.update(model, grads)
        return loss

    steps = context.steps
    every = max(1, steps // checks)
    checked = validate is not None
    keys = jax.random.split(context.key(2), steps)
    best_step, best_loss, best_state = steps, math.inf, None
    began = time.perf_counter()
    for step in range(steps):
        loss = train_step(net, optimizer, keys[step], jnp.asarray(step))
        done = step + 1
        if checked and (done % every == 0 or done == steps):
            value = float(validate(net))
            if value < best_loss:  # a NaN never is: a diverged check is skipped
                best_step, best_loss = done, value
                # A copy of the values: the optimizer replaces, never mutates.
                best_state = jax.tree.map(lambda x: x, nnx.state(net))
    jax.block_until_ready(loss)
    if best_state is not None:
        nnx.update(net, best_state)
    return time.perf_counter() - began, best_step


def independent_head_options(model: nnx.Module) -> dict[str, Any]:
    """``to_batch_ensemble`` options making ``model``'s output layer independent.

    The output layer is the last ``nnx.Linear`` the model created; each
    member's kernel is drawn afresh (LeCun normal, ``nnx.Linear``'s).

    Raises:
      ValueError: if the model holds no ``nnx.Linear``.
    """
    linears = [n for n in in_construction_order(model) if type(n) is nnx.Linear]
    if not linears:
        raise ValueError(
            "`independent_head` needs an nnx.Linear output layer; the model has none."
        )
    head = linears[-1]
    return {
        "independent": lambda path, node: node is head,
        "independent_init": nnx.initializers.lecun_normal(),
    }


def fast_weight_options(
    method: str,
    fast_weight_init: Initializer | tuple[Initializer, Initializer] | None,
    prior_stddev: float | None,
    stddev_init: Initializer | None,
) -> dict[str, Any]:
    """``to_batch_ensemble``'s keyword arguments for ``batchensemble``/``rank1``."""
    if fast_weight_init is None:
        options = {}
    elif isinstance(fast_weight_init, tuple):
        options = dict(zip(("r_init", "s_init"), fast_weight_init, strict=True))
    else:
        options = {"r_init": fast_weight_init, "s_init": fast_weight_init}
    if method == "rank1":
        options["posterior"] = "gaussian"
        if prior_stddev is not None:
            options["prior_stddev"] = prior_stddev
        if stddev_init is not None:
            options["stddev_init"] = stddev_init
    return options


def reinit_first_layer(
    net: nnx.Module, inits: tuple[Initializer, Initializer], key: jax.Array
) -> None:
    """Draws the first BatchEnsemble layer's ``r`` and ``s`` from ``inits``."""
    first = next(
        node
        for _, node in nnx.iter_graph(net)
        if isinstance(node, ensembles.layers.BatchEnsembleModule)
    )
    r_key, s_key = jax.random.split(key)
    for variable, init, init_key in zip(
        (first.r, first.s), inits, (r_key, s_key), strict=True
    ):
        variable[...] = init(init_key, variable.shape, variable.dtype)
