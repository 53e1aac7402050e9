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
    "DEEP_ENSEMBLE",
    "DEEP_ENSEMBLE_LOOP",
    "LEARNING_RATE",
    "METHODS",
    "METHOD_TABLE",
    "MODES",
    "SINGLE",
    "SINGLE_B",
    "CostMethod",
    "MemoryStats",
    "Prepared",
    "Setup",
    "cost_method",
    "prepare_method",
]

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


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every method of one model, mode and E is prepared from.

    Attributes:
      model: a name of :data:`~ensembles.benchmark.MODELS`, or a factory.
      mode: one of :data:`MODES`.
      num_members: E.
      batch: samples per member B.
      width: the benchmark's models' width (``None``: the default).
      impl: the BatchEnsemble op implementation.
      fast_weight_init: the conversion's ``r_init`` and ``s_init``.
      seed: seed of the parameters and of the data.
      x: the ``E*B`` member-samples, member-major.
      labels: their labels (or regression targets).
    """

    model: str | Callable[[nnx.Rngs], nnx.Module]
    mode: str
    num_members: int
    batch: int
    width: int | None
    impl: str
    fast_weight_init: ensembles.initializers.Initializer | None
    seed: int
    x: jax.Array
    labels: jax.Array

    def plain(self, member: int = 0) -> nnx.Module:
        """Member ``member``'s plain model (seed + member)."""
        return build_model(
            self.model, width=self.width, rngs=nnx.Rngs(self.seed + member)
        )

    def per_member(self, array: jax.Array) -> jax.Array:
        """``[E*B, ...]`` rows as ``[E, B, ...]``: each member's own."""
        return array.reshape(self.num_members, self.batch, *array.shape[1:])


@dataclasses.dataclass(frozen=True, eq=False)
class CostMethod:
    """One way of running an ensemble that the cost benchmark times.

    Attributes:
      name: its name in the rows and tables.
      prepare: ``prepare(method, setup) -> Prepared``: built, jitted and
        compiled.
      one_member_rows: it runs one member's B rows, not all ``E*B``
        (``single_b``: what a prediction costs without an ensemble).
      posterior: ``to_batch_ensemble``'s ``posterior`` (``rank1``'s
        ``"gaussian"``: every step draws, a train step adds the KL).
      deep: a deep ensemble's form (``"vmap"``, ``"loop"``): the ratios'
        "vs deep" take the faster of them; ``None`` for the others.
    """

    name: str
    prepare: Callable[[CostMethod, Setup], Prepared]
    one_member_rows: bool = False
    posterior: str | None = None
    deep: str | None = None

    def samples(self, num_members: int, batch: int) -> int:
        """The member-samples one of its steps processes."""
        return batch if self.one_member_rows else num_members * batch


def _one_model(method: CostMethod, setup: Setup) -> Prepared:
    """One plain model (member 0), on all rows or one member's."""
    x, labels = setup.x, setup.labels
    if method.one_member_rows:
        x, labels = x[: setup.batch], labels[: setup.batch]
    return _prepare_one(method, setup.plain(), setup.mode, x, labels)


def _converted(method: CostMethod, setup: Setup) -> Prepared:
    """Member 0 converted (:func:`~ensembles.benchmark.cost.checks.convert`)."""
    module = convert(
        setup.plain(),
        setup.num_members,
        fast_weight_init=setup.fast_weight_init,
        seed=setup.seed,
        posterior=method.posterior,
    )
    view = nnx.view(module, impl=setup.impl)
    return _prepare_one(method, view, setup.mode, setup.x, setup.labels)


def _vmapped(method: CostMethod, setup: Setup) -> Prepared:
    """E plain models, stacked and run with ``nnx.vmap``."""
    members = [setup.plain(k) for k in range(setup.num_members)]
    xs, ys = setup.per_member(setup.x), setup.per_member(setup.labels)
    return _prepare_vmap(method, members, setup.mode, xs, ys)


def _looped(method: CostMethod, setup: Setup) -> Prepared:
    """E plain models, one jitted step each, called in a Python loop."""
    members = [setup.plain(k) for k in range(setup.num_members)]
    xs, ys = setup.per_member(setup.x), setup.per_member(setup.labels)
    return _prepare_loop(method, members, setup.mode, xs, ys)


# The methods the rows' ratios divide by (their keys name them): one plain
# model on all E*B rows and on one member's B rows, the two deep ensembles.
SINGLE = CostMethod("single", _one_model)
SINGLE_B = CostMethod("single_b", _one_model, one_member_rows=True)
DEEP_ENSEMBLE = CostMethod("deep_ensemble", _vmapped, deep="vmap")
DEEP_ENSEMBLE_LOOP = CostMethod("deep_ensemble_loop", _looped, deep="loop")

#: Every method, in table order (see the module for each).
METHOD_TABLE: tuple[CostMethod, ...] = (
    SINGLE,
    SINGLE_B,
    CostMethod("batchensemble", _converted),
    CostMethod("rank1", _converted, posterior="gaussian"),
    DEEP_ENSEMBLE,
    DEEP_ENSEMBLE_LOOP,
)

#: The compared methods' names, in table order.
METHODS: tuple[str, ...] = tuple(method.name for method in METHOD_TABLE)

_BY_NAME = {method.name: method for method in METHOD_TABLE}


def cost_method(name: str) -> CostMethod:
    """The method of :data:`METHOD_TABLE` named ``name``."""
    return _BY_NAME[name]


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
    if method not in _BY_NAME:
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
    setup = Setup(
        model, mode, num_members, batch, width, impl, fast_weight_init, seed, x, labels
    )
    return _BY_NAME[method].prepare(_BY_NAME[method], setup)


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


def _prepare_one(method: CostMethod, module, mode, x, labels) -> Prepared:
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    num_params, param_bytes = _count(params)

    def forward(params, rest, x):
        return merge(graphdef, params, rest)(x)

    if mode == "forward":
        compiled = jax.jit(forward).lower(params, rest, x).compile()
        return Prepared(
            method.name,
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
        if method.posterior is not None:
            # The rank-1 loss (docs/rank1.md), over a data set of these rows.
            loss = loss + ensembles.kl_divergence(model) / x.shape[0]
        return loss, (loss, rest_of(model))

    compiled, opt_state, _ = compile_train(
        loss_fn, params, rest, x, labels, learning_rate=LEARNING_RATE
    )
    step, current = _stateful(compiled, params, opt_state, rest, x, labels)
    return Prepared(
        method.name,
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


def _prepare_vmap(method: CostMethod, members, mode, xs, ys) -> Prepared:
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
            method.name,
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
        method.name,
        step,
        current,
        num_params,
        param_bytes,
        _memory(compiled),
        loss_name,
    )


def _prepare_loop(method: CostMethod, members, mode, xs, ys) -> Prepared:
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
            method.name,
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
        method.name,
        step,
        lambda: params,
        num_params,
        param_bytes,
        _memory(compiled, calls),
        loss_name,
    )
