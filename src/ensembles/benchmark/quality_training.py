"""The mechanics every method of the quality benchmark trains with.

:class:`Context` holds what a recipe shares (the model to build, the data on
the device, the seed's keys), :func:`objective` the loss of member-major
outputs (cross entropy of a classifier's logits, or the (beta-)NLL of a
regressor's Gaussian head), :func:`optimizer` the optimizers and
:func:`train_steps` the jitted loop. The recipes themselves, and the
constants they use, are :mod:`~ensembles.benchmark.quality_methods`'.
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

import ensembles
from ensembles._checks import check_num_members, check_positive_int
from ensembles.benchmark.quality_models import ModelSpec, build_model

__all__ = ["Context", "objective", "optimizer", "train_steps"]


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
) -> float:
    """Runs every step (jitted, the batch drawn on the device); returns seconds.

    ``loss_fn(model, key, step)`` draws its batch from ``key``; the seconds
    count every step, the first one's compilation included.
    """

    @nnx.jit
    def train_step(model, optimizer, key, step):
        loss, grads = nnx.value_and_grad(loss_fn)(model, key, step)
        optimizer.update(model, grads)
        return loss

    keys = jax.random.split(context.key(2), context.steps)
    began = time.perf_counter()
    for step in range(context.steps):
        loss = train_step(net, optimizer, keys[step], jnp.asarray(step))
    jax.block_until_ready(loss)
    return time.perf_counter() - began
