"""The mechanics every method of the quality benchmark trains with.

:class:`Context` holds what a recipe shares (the model to build, the data on
the device, the seed's keys), :class:`Recipe` the options that vary the
recipes, :func:`optimizer` the optimizers and :func:`train_steps` the jitted
loop; :func:`fast_weight_options`, :func:`independent_head_options` and
:func:`reinit_first_layer` shape a conversion. A method is a
:class:`QualityMethod` (the table of them:
:data:`~ensembles.benchmark.quality.methods.METHOD_TABLE`), built into a
:class:`Built` and trained into a :class:`Trained`; what it trains on is a
:class:`Targets` of its task's kind.
The loss of a method's outputs is its task kind's
(:mod:`~ensembles.benchmark.quality.kinds`); the recipes themselves, and the
constants they use, are :mod:`~ensembles.benchmark.quality.methods`'.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
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
from ensembles.benchmark.quality.regression.head import BETA, MIN_STD

__all__ = [
    "EVAL_DRAWS",
    "FAST_LR_MULTIPLIER",
    "KL_ANNEALING",
    "Built",
    "Context",
    "QualityMethod",
    "Recipe",
    "Targets",
    "Trained",
    "fast_weight_options",
    "independent_head_options",
    "optimizer",
    "reinit_first_layer",
    "train_steps",
]


@dataclasses.dataclass(frozen=True)
class Context:
    """What a method's recipe builds with: the model, the data, the keys, the loss.

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
      recipe: the recipe's options.
      loss: ``loss(outputs, targets, num_members)`` of member-major outputs,
        the task kind's.
      start: the trained model a method starts from (``finetuned``), or
        ``None``.
    """

    model: ModelSpec
    num_members: int
    steps: int
    shape: dict[str, Any]
    x_all: jax.Array
    y_all: jax.Array
    batch: int
    root: jax.Array
    recipe: Recipe
    loss: Callable[[jax.Array, jax.Array, int], jax.Array]
    start: nnx.Module | None

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
        outputs: int,
        recipe: Recipe,
        loss: Callable[[jax.Array, jax.Array, int], jax.Array],
        start: nnx.Module | None,
    ) -> Context:
        """The context of training ``model`` (``outputs`` wide) on the data."""
        return cls(
            model=model,
            num_members=check_num_members(num_members),
            steps=check_positive_int(steps, "steps"),
            shape={"input_shape": tuple(np.shape(x_train)[1:]), "num_classes": outputs},
            x_all=jnp.asarray(x_train),
            y_all=jnp.asarray(y_train),
            batch=min(check_positive_int(batch_size, "batch_size"), len(x_train)),
            root=jax.random.key(seed),
            recipe=recipe,
            loss=loss,
            start=start,
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


#: The fast weights' learning rate over the shared weights' (the recipe).
FAST_LR_MULTIPLIER: float = 0.5

#: The share of the steps over which ``rank1``'s KL weight rises from 0 to 1.
KL_ANNEALING: float = 0.8

#: ``rank1``'s draws of every member's fast weights per prediction (chosen
#: across tasks over 1: benchmarks/quality_defaults.py).
EVAL_DRAWS: int = 4


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The options that vary the recipes: ``train_method``'s keywords.

    A method reads those it has a use for and ignores the others, so that one
    set of options trains every method (all but ``independent_head``, which
    the methods that convert no model refuse); a method may fix some
    (``QualityMethod.fixed``: ``batchensemble_shift`` always has an
    independent head and member batches, ``rank1`` a posterior). The
    benchmark keeps the defaults; ``benchmarks/diversity_study.py``,
    ``benchmarks/quality_defaults.py`` and ``benchmarks/finetune_recipe.py``
    measure the others.

    Attributes:
      fast_weight_init: the fast weights' ``r_init`` and ``s_init`` (one for
        both, or a pair ``(r_init, s_init)``); ``None`` keeps the library's.
      fast_lr_multiplier: the fast weights' learning rate over the shared
        weights'.
      tiled: every member sees the same B examples per step; ``False`` gives
        each its own B (:func:`ensembles.training.member_batches`).
      posterior: ``to_batch_ensemble``'s ``posterior``: ``"gaussian"``
        (``rank1``'s) adds :func:`ensembles.kl_divergence` over the
        training-set size to the loss and predicts with ``eval_draws``
        draws; ``None``: none.
      prior_stddev: the rank-1 prior's scale (``None``: the library's).
      stddev_init: the initializer of the rank-1 posterior's unconstrained
        scales (``None``: the library's).
      kl_annealing: the share of the steps over which the KL weight rises
        from 0 to 1.
      eval_draws: a rank-1 member's draws at prediction; each draw counts as
        a member of the predictive (``[E * draws, N, C]`` logits).
      first_layer_init: ``(r_init, s_init)`` of the first BatchEnsemble layer
        (in the model's graph order, its first layer for an
        ``nnx.Sequential``), the others keeping ``fast_weight_init`` (TabM's
        recipe: random signs for the first layer's ``r``, ones elsewhere);
        ``None``: every layer alike.
      diversity: the weight of a negative-correlation term (Liu & Yao, 1999;
        Buschjaeger et al., 2020): ``diversity`` times the mean squared
        distance of each member's softmax from the members' mean is
        subtracted from the loss, pushing members apart; 0: none
        (classification only).
      independent_head: the model's last ``nnx.Linear`` (its output layer)
        becomes fully independent, a kernel of its own per member drawn
        afresh (``to_batch_ensemble``'s ``independent``; TabM's heads).
      beta: a regressor's beta-NLL exponent
        (:data:`~ensembles.benchmark.quality.regression.head.BETA`).
      min_std: a regressor's spreads' floor, in standardised target units
        (:data:`~ensembles.benchmark.quality.regression.head.MIN_STD`).

    Raises:
      ValueError: if ``eval_draws`` is below 1.
      TypeError: if ``eval_draws`` is not an integer.
    """

    fast_weight_init: Initializer | tuple[Initializer, Initializer] | None = None
    fast_lr_multiplier: float = FAST_LR_MULTIPLIER
    tiled: bool = True
    posterior: str | None = None
    prior_stddev: float | None = None
    stddev_init: Initializer | None = None
    kl_annealing: float = KL_ANNEALING
    eval_draws: int = EVAL_DRAWS
    first_layer_init: tuple[Initializer, Initializer] | None = None
    diversity: float = 0.0
    independent_head: bool = False
    beta: float = BETA
    min_std: float = MIN_STD

    def __post_init__(self):
        draws = check_positive_int(self.eval_draws, "eval_draws")
        object.__setattr__(self, "eval_draws", draws)  # frozen: set once, here


@dataclasses.dataclass(frozen=True)
class Targets:
    """A training split's targets, as its task's kind trains on and scores them.

    Attributes:
      y_train: what the methods train on: the labels, or a regressor's
        targets standardised.
      options: ``train_method``'s keywords the kind adds (a classifier's
        ``num_classes``; a regressor's ``regression`` and
        ``early_stopping``).
      scale: a regressor's
        :class:`~ensembles.benchmark.quality.regression.head.TargetScale`
        (its predictions back in the targets' units); ``None`` for a
        classifier.
    """

    y_train: np.ndarray
    options: dict[str, Any]
    scale: Any = None


@dataclasses.dataclass(frozen=True)
class Trained:
    """A trained method.

    Attributes:
      method: its name (one of
        :data:`~ensembles.benchmark.quality.methods.QUALITY_METHODS`, or a
        method of your own's).
      predict: maps ``[N, ...]`` examples to member logits ``[E, N, C]``
        (``[1, N, C]`` for ``single``; ``[E * eval_draws, N, C]`` for
        ``rank1``, every draw a member), the layout of
        :mod:`ensembles.uncertainty`.
      params: parameters of the whole method (all members).
      train_s: wall-clock seconds of all training steps (and early
        stopping's checks), the first step's compilation included.
      model: the trained model (what ``finetuned`` starts from).
      best_step: the steps the kept parameters trained: all of them, or with
        early stopping those of the best check.
    """

    method: str
    predict: Callable[[np.ndarray], jax.Array]
    params: int
    train_s: float
    model: Any = None
    best_step: int | None = None


@dataclasses.dataclass(frozen=True)
class Built:
    """A method's model, built and ready to train.

    Attributes:
      net: the model (all members).
      loss: ``loss(model, key, step)``: the loss of a batch drawn from ``key``.
      predict: ``predict(model, x)``: member outputs ``[E, N, ...]``.
      optimizer: its optimizer.
    """

    net: nnx.Module
    loss: Callable[[nnx.Module, jax.Array, jax.Array], jax.Array]
    predict: Callable[[nnx.Module, jax.Array], jax.Array]
    optimizer: nnx.Optimizer


@dataclasses.dataclass(frozen=True, eq=False)
class QualityMethod:
    """One method of the quality benchmark: its model, training and prediction.

    Attributes:
      name: its name in ``--methods``, the rows and the tables.
      build: ``build(method, context) -> Built`` (a
        :class:`~ensembles.benchmark.quality.training.Context`): its model,
        its loss, its prediction and its optimizer.
      fixed: the recipe options it always has, over ``train_method``'s
        (:class:`~ensembles.benchmark.quality.training.Recipe`'s names).
      one_model: it does not depend on E: trained once per model and seed,
        as one model, and its row repeated for every E.
      starts_from: the method whose trained model (of the same model and
        seed) it starts from, or ``None``.
      steps_share: the share of the steps it trains (at least one).
      dropout: the dropout rate its model is built with (0: none; a
        factory must then take a ``dropout`` keyword).
      keeps_drawing: it predicts in training mode (dropout masks, rank-1
        draws), not after ``model.eval()``.
      no_head: why an independent head (``independent_head=True``) does not
        apply to it, or ``None`` where it does.
      closes_gap: the report gives the share of the gap from one model to
        the deep ensemble (:data:`~ensembles.benchmark.quality.tables.GAP`)
        that it closes.
    """

    name: str
    build: Callable[[QualityMethod, Context], Built]
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    one_model: bool = False
    starts_from: QualityMethod | None = None
    steps_share: float = 1.0
    dropout: float = 0.0
    keeps_drawing: bool = False
    no_head: str | None = None
    closes_gap: bool = True

    def steps(self, steps: int) -> int:
        """The steps it trains when the others train ``steps``."""
        return max(1, int(steps * self.steps_share))


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


def fast_weight_options(recipe: Recipe) -> dict[str, Any]:
    """``to_batch_ensemble``'s keyword arguments for the fast weights of ``recipe``."""
    init = recipe.fast_weight_init
    if init is None:
        options = {}
    elif isinstance(init, tuple):
        options = dict(zip(("r_init", "s_init"), init, strict=True))
    else:
        options = {"r_init": init, "s_init": init}
    if recipe.posterior is not None:
        options["posterior"] = recipe.posterior
        if recipe.prior_stddev is not None:
            options["prior_stddev"] = recipe.prior_stddev
        if recipe.stddev_init is not None:
            options["stddev_init"] = recipe.stddev_init
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
