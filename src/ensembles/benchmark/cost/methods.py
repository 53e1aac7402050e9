"""The five ways of running an ensemble that the benchmark compares.

Every method processes the same ``E*B`` member-samples ``x`` (member ``k`` owns
rows ``[k*B, (k+1)*B)``):

- ``single``: one plain model on all ``E*B`` rows (the floor: the FLOPs of one
  member on the whole batch);
- ``single_b``: one plain model on one member's ``B`` rows: what a prediction
  costs without an ensemble (E members cost about E times its FLOPs);
- ``batchensemble``: the model converted by :func:`ensembles.to_batch_ensemble`
  on the member-major ``[E*B, ...]`` batch;
- ``rank1``: the same conversion with rank-1 Bayesian fast weights
  (``posterior="gaussian"``), in training mode: every step draws all members'
  fast weights, and a train step's loss adds :func:`ensembles.kl_divergence`
  (in evaluation it runs ``batchensemble``'s very program, on the means);
- ``deep_ensemble``: E independent plain models whose states are stacked and run
  together with ``nnx.vmap``, model ``k`` on its ``[B, ...]`` slice;
- ``deep_ensemble_loop``: the same E models run one after another, a jitted
  per-model step called in a Python loop (what people write first).

Every step is jitted with the model's state as an argument (split, never closed
over) and ``mode="train"`` is forward + backward + an ``optax.adam`` update of
the softmax cross-entropy, or, for a model with one output (where that is
identically 0), of the squared error against regression targets
(:mod:`ensembles.benchmark.cost.steps`).
Models run as built, in training mode in both modes: ``nnx.Dropout`` draws its
masks and ``nnx.BatchNorm`` normalizes with the batch's statistics. A train step
carries the state that is not a parameter (rng counts, BatchNorm's running
statistics) over to the next step, as a training loop does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ensembles
from ensembles.benchmark.cost.checks import convert
from ensembles.benchmark.cost.models import (
    DEFAULT_IMAGE_SIZE,
    build_model,
    model_inputs,
)
from ensembles.benchmark.cost.steps import compile_train, merge, rest_of, train_loss

__all__ = [
    "LEARNING_RATE",
    "METHODS",
    "MODES",
    "MemoryStats",
    "Prepared",
    "prepare_method",
]

#: The compared methods, in table order.
METHODS: tuple[str, ...] = (
    "single",
    "single_b",
    "batchensemble",
    "rank1",
    "deep_ensemble",
    "deep_ensemble_loop",
)

#: ``forward``: inference; ``train``: forward + backward + optimizer update.
MODES: tuple[str, ...] = ("forward", "train")

#: Adam's learning rate in ``mode="train"``.
LEARNING_RATE: float = 1e-3


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """XLA's compiled memory analysis of one step, in bytes.

    For ``deep_ensemble_loop`` the argument, output and alias bytes are summed
    over the E per-model calls (all E models stay resident) and the temporary
    bytes are those of one call (the calls run one after another).

    Attributes:
      argument_bytes: inputs of the step (parameters, optimizer state, batch).
      output_bytes: outputs of the step.
      alias_bytes: outputs written in place of donated arguments.
      temp_bytes: XLA's scratch buffers (activations kept for the backward
        pass, intermediate results).
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int

    @property
    def total_bytes(self) -> int:
        """Arguments + outputs not aliased to arguments + temporaries."""
        return (
            self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
        )


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A compiled method, ready to time.

    Attributes:
      method: one of :data:`METHODS`.
      step: runs one forward or train step over all ``E*B`` member-samples.
        Forward steps return the ``[E*B, outputs]`` predictions, member-major;
        train steps update the parameters in place and return the loss
        (``deep_ensemble`` and ``deep_ensemble_loop``: one loss per model).
      params: returns the current parameters (an ``nnx.State``; a list of them
        for ``deep_ensemble_loop``; stacked along a leading ``[E]`` axis for
        ``deep_ensemble``).
      num_params: number of parameters of the whole method (all members).
      param_bytes: bytes of those parameters.
      memory: XLA's memory analysis of the compiled step.
      loss: what a train step minimises (``steps.train_loss``): ``"softmax
        cross-entropy"``, or ``"squared error"`` for a model with one
        output; ``None`` for a forward step.
    """

    method: str
    step: Callable[[], Any]
    params: Callable[[], Any]
    num_params: int
    param_bytes: int
    memory: MemoryStats
    loss: str | None = None


def prepare_method(
    method: str,
    model: str | Callable[[nnx.Rngs], nnx.Module],
    mode: str,
    *,
    num_members: int,
    batch: int,
    width: int | None = None,
    image_size: int = DEFAULT_IMAGE_SIZE,
    input_shape: tuple[int, ...] | None = None,
    impl: str = "xla",
    fast_weight_init: ensembles.initializers.Initializer | None = None,
    seed: int = 0,
) -> Prepared:
    """Builds, jits and compiles one method on its share of the same batch.

    Member ``k`` of the deep ensembles is ``build_model(model, rngs=Rngs(seed
    + k))``; ``single`` is member 0 and ``batchensemble`` converts member 0, so
    with ``fast_weight_init=ensembles.initializers.ones()`` every BatchEnsemble
    member computes what ``single`` does.

    >>> import numpy as np
    >>> from ensembles.benchmark import prepare_method
    >>> single = prepare_method("single", "mlp", "forward", num_members=2,
    ...                         batch=3, width=4)
    >>> loop = prepare_method("deep_ensemble_loop", "mlp", "forward",
    ...                       num_members=2, batch=3, width=4)
    >>> single.step().shape, loop.step().shape
    ((6, 10), (6, 10))
    >>> loop.num_params == 2 * single.num_params
    True
    >>> bool(np.allclose(single.step()[:3], loop.step()[:3], atol=1e-6))
    True

    Args:
      method: one of :data:`METHODS`.
      model: one of :data:`~ensembles.benchmark.MODELS`, or a factory
        ``rngs -> nnx.Module`` (train: softmax cross-entropy over its
        outputs' last axis; with one output, where that is identically 0,
        the squared error against standard-normal targets).
      mode: one of :data:`MODES`.
      num_members: the ensemble size E.
      batch: samples per member B.
      width: see :func:`~ensembles.benchmark.build_model`.
      image_size: the CNN's image height and width.
      input_shape: a factory's example shape (see
        :func:`~ensembles.benchmark.model_inputs`).
      impl: the BatchEnsemble op implementation, one of
        ``ensembles.ops.IMPLS``, set with ``nnx.view(model, impl=impl)``.
      fast_weight_init: ``r_init`` and ``s_init`` of the conversion; ``None``
        keeps the library default.
      seed: seed of the parameters and of the data.

    Returns:
      The compiled method.

    Raises:
      ValueError: if ``method`` or ``mode`` is unknown, or the model does not
        convert completely.
      ImportError: if ``mode="train"`` and optax is not installed.
    """
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {list(METHODS)}, got {method!r}.")
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {list(MODES)}, got {mode!r}.")
    x, labels = model_inputs(
        model,
        num_members * batch,
        width=width,
        image_size=image_size,
        input_shape=input_shape,
        seed=seed,
    )
    if method in ("single", "single_b"):
        module = build_model(model, width=width, rngs=nnx.Rngs(seed))
        if method == "single_b":  # one member's share of the rows
            x, labels = x[:batch], labels[:batch]
        return _prepare_one(method, module, mode, x, labels)
    if method in ("batchensemble", "rank1"):
        base = build_model(model, width=width, rngs=nnx.Rngs(seed))
        posterior = "gaussian" if method == "rank1" else None
        module = convert(
            base,
            num_members,
            fast_weight_init=fast_weight_init,
            seed=seed,
            posterior=posterior,
        )
        return _prepare_one(method, nnx.view(module, impl=impl), mode, x, labels)
    members = [
        build_model(model, width=width, rngs=nnx.Rngs(seed + k))
        for k in range(num_members)
    ]
    xs = x.reshape(num_members, batch, *x.shape[1:])
    ys = labels.reshape(num_members, batch, *labels.shape[1:])
    if method == "deep_ensemble":
        return _prepare_vmap(members, mode, xs, ys)
    return _prepare_loop(members, mode, xs, ys)


def _count(params) -> tuple[int, int]:
    leaves = jax.tree.leaves(params)
    return (
        int(sum(np.size(leaf) for leaf in leaves)),
        int(sum(np.size(leaf) * np.dtype(leaf.dtype).itemsize for leaf in leaves)),
    )


def _memory(compiled, calls: int = 1) -> MemoryStats:
    stats = compiled.memory_analysis()
    return MemoryStats(
        argument_bytes=calls * int(stats.argument_size_in_bytes),
        output_bytes=calls * int(stats.output_size_in_bytes),
        alias_bytes=calls * int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
    )


def _prepare_one(method, module, mode, x, labels) -> Prepared:
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    num_params, param_bytes = _count(params)

    def forward(params, rest, x):
        return merge(graphdef, params, rest)(x)

    if mode == "forward":
        compiled = jax.jit(forward).lower(params, rest, x).compile()
        return Prepared(
            method,
            lambda: compiled(params, rest, x),
            lambda: params,
            num_params,
            param_bytes,
            _memory(compiled),
        )

    loss_name, loss_of = train_loss(labels)

    def loss_fn(params, rest, x, y):
        model = merge(graphdef, params, rest)
        loss = loss_of(model(x), y)
        if method == "rank1":
            # The rank-1 loss (docs/rank1.md), over a data set of these rows.
            loss = loss + ensembles.kl_divergence(model) / x.shape[0]
        return loss, (loss, rest_of(model))

    compiled, opt_state, _ = compile_train(
        loss_fn, params, rest, x, labels, learning_rate=LEARNING_RATE
    )
    step, current = _stateful(compiled, params, opt_state, rest, x, labels)
    return Prepared(
        method,
        step,
        current,
        num_params,
        param_bytes,
        _memory(compiled),
        loss_name,
    )


def _stateful(compiled, params, opt_state, rest, *data):
    """A compiled train step over state it keeps: ``(step, params)``.

    ``step()`` runs ``compiled(params, opt_state, rest, *data)``, keeps what
    it returns and gives the loss; ``params()`` the current parameters.
    """
    state = {"params": params, "opt_state": opt_state, "rest": rest}

    def step():
        state["params"], state["opt_state"], state["rest"], loss = compiled(
            state["params"], state["opt_state"], state["rest"], *data
        )
        return loss

    return step, lambda: state["params"]


def _prepare_vmap(members, mode, xs, ys) -> Prepared:
    graphdef, *_ = nnx.split(members[0], nnx.Param, ...)
    splits = [nnx.split(member, nnx.Param, ...)[1:] for member in members]
    params = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(p for p, _ in splits))
    rest = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(r for _, r in splits))
    num_params, param_bytes = _count(params)

    def forward(params, rest, xs):
        stacked = merge(graphdef, params, rest)
        out = nnx.vmap(lambda model, x: model(x), in_axes=(0, 0))(stacked, xs)
        return out, rest_of(stacked)

    if mode == "forward":

        def predict(params, rest, xs):
            out, _ = forward(params, rest, xs)
            return out.reshape(-1, *out.shape[2:])

        compiled = jax.jit(predict).lower(params, rest, xs).compile()
        return Prepared(
            "deep_ensemble",
            lambda: compiled(params, rest, xs),
            lambda: params,
            num_params,
            param_bytes,
            _memory(compiled),
        )

    loss_name, loss_of = train_loss(ys)

    def loss_fn(params, rest, xs, ys):
        logits, rest = forward(params, rest, xs)
        losses = jax.vmap(loss_of)(logits, ys)
        # Each model's gradient is that of its own mean loss, as in the loop.
        return jnp.sum(losses), (losses, rest)

    compiled, opt_state, _ = compile_train(
        loss_fn, params, rest, xs, ys, learning_rate=LEARNING_RATE
    )
    step, current = _stateful(compiled, params, opt_state, rest, xs, ys)
    return Prepared(
        "deep_ensemble",
        step,
        current,
        num_params,
        param_bytes,
        _memory(compiled),
        loss_name,
    )


def _prepare_loop(members, mode, xs, ys) -> Prepared:
    graphdef, *_ = nnx.split(members[0], nnx.Param, ...)
    splits = [nnx.split(member, nnx.Param, ...)[1:] for member in members]
    params = [p for p, _ in splits]
    rests = [r for _, r in splits]
    xs = list(xs)
    ys = list(ys)
    counts = [_count(p) for p in params]
    num_params = sum(c[0] for c in counts)
    param_bytes = sum(c[1] for c in counts)
    calls = len(members)

    def forward(params, rest, x):
        return merge(graphdef, params, rest)(x)

    if mode == "forward":
        compiled = jax.jit(forward).lower(params[0], rests[0], xs[0]).compile()

        def predict():
            outs = [
                compiled(p, r, x) for p, r, x in zip(params, rests, xs, strict=True)
            ]
            return jnp.concatenate(outs)

        return Prepared(
            "deep_ensemble_loop",
            predict,
            lambda: params,
            num_params,
            param_bytes,
            _memory(compiled, calls),
        )

    loss_name, loss_of = train_loss(ys[0])

    def loss_fn(params, rest, x, y):
        model = merge(graphdef, params, rest)
        loss = loss_of(model(x), y)
        return loss, (loss, rest_of(model))

    compiled, _, tx = compile_train(
        loss_fn, params[0], rests[0], xs[0], ys[0], learning_rate=LEARNING_RATE
    )
    opt_states = [tx.init(p) for p in params]

    def step():
        losses = []
        for k in range(calls):
            params[k], opt_states[k], rests[k], loss = compiled(
                params[k], opt_states[k], rests[k], xs[k], ys[k]
            )
            losses.append(loss)
        return losses

    return Prepared(
        "deep_ensemble_loop",
        step,
        lambda: params,
        num_params,
        param_bytes,
        _memory(compiled, calls),
        loss_name,
    )
