"""What every method's jitted step is built of: its loss, its train step.

:mod:`ensembles.benchmark.cost.methods` builds each method's forward and train
step from these: the model split into parameters and the rest of its state,
merged again inside the step (:func:`merge`), a loss chosen by the labels
(:func:`train_loss`), and one Adam step compiled with its arguments donated
(:func:`compile_train`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["compile_train", "merge", "optax_module", "rest_of", "train_loss"]


def optax_module() -> Any:
    """``optax``, or an ``ImportError`` that says how to install it."""
    try:
        import optax
    except ImportError as error:
        raise ImportError(
            "mode 'train' needs optax: pip install 'flax-ensembles[bench]'."
        ) from error
    return optax


def train_loss(labels: jax.Array) -> tuple[str, Callable[..., jax.Array]]:
    """The loss a train step minimises for ``labels``, and its name.

    Integer labels (a classifier's, :func:`~ensembles.benchmark.model_inputs`)
    get the softmax cross-entropy over the outputs' last axis. Float targets
    (what ``model_inputs`` draws for a model with one output, where that
    cross-entropy is identically 0 and has no gradient) get the squared error
    of the one output, as a regressor trains.

    >>> import jax.numpy as jnp
    >>> name, loss = train_loss(jnp.array([0.5, -1.0]))
    >>> name, float(loss(jnp.array([[1.5], [-1.0]]), jnp.array([0.5, -1.0])))
    ('squared error', 0.5)
    >>> train_loss(jnp.array([0, 2]))[0]
    'softmax cross-entropy'

    Args:
      labels: ``[N, ...]`` integer class labels, or float targets.

    Returns:
      ``(name, loss)``, ``loss(outputs, labels)`` the mean over the examples.
    """
    if jnp.issubdtype(labels.dtype, jnp.floating):
        return "squared error", _squared_error
    return "softmax cross-entropy", _cross_entropy


def _cross_entropy(logits, labels):
    optax = optax_module()
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _squared_error(outputs, targets):
    return jnp.mean(jnp.square(outputs[..., 0] - targets))


def merge(graphdef: Any, params: Any, rest: Any) -> Any:
    """The model of ``graphdef``, ``params`` and ``rest``, made in the current trace."""
    # Fresh Variables for `rest`, made in the current trace: a train step's
    # forward runs under jax.grad, a trace inside jit's, where a layer that
    # updates its state on every call (nnx.Dropout's and a rank-1 layer's rng
    # count, nnx.BatchNorm's statistics) cannot update Variables made at jit's
    # level ("Cannot extract graph node from different trace level").
    return nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))


def rest_of(model: Any) -> Any:
    """The model's state that is not a parameter, as the forward left it."""
    return nnx.split(model, nnx.Param, ...)[2]


def _train_step(loss_fn, tx):
    """A step of (params, opt_state, rest, x, y) -> (params, opt_state, rest, loss).

    ``loss_fn(params, rest, x, y)`` returns ``(objective, (loss, rest))``.
    """
    optax = optax_module()

    def step(params, opt_state, rest, x, y):
        (_, (loss, rest)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, rest, x, y
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, rest, loss

    return step


def compile_train(
    loss_fn: Callable[..., Any],
    params: Any,
    rest: Any,
    x: jax.Array,
    y: jax.Array,
    *,
    learning_rate: float,
) -> tuple[Any, Any, Any]:
    """Compiles an Adam train step, donating parameters, optimizer state and rest.

    Args:
      loss_fn: ``(params, rest, x, y) -> (objective, (loss, rest))``.
      params: the parameters (an ``nnx.State``), stepped by Adam.
      rest: the rest of the model's state, carried over from step to step.
      x: the inputs the step will be called with.
      y: the labels (or targets) it will be called with.
      learning_rate: Adam's.

    Returns:
      ``(compiled step, initial optimizer state, the optax transformation)``.
    """
    tx = optax_module().adam(learning_rate)
    opt_state = tx.init(params)
    step = jax.jit(_train_step(loss_fn, tx), donate_argnums=(0, 1, 2))
    return step.lower(params, opt_state, rest, x, y).compile(), opt_state, tx
