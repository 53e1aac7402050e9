"""The quality benchmark's methods, one table: each method one object.

:data:`METHOD_TABLE` holds every method as a :class:`QualityMethod`: its
name, how its model, loss, prediction and optimizer are built (``build``),
the recipe options it always has (``fixed``), and what the driver, the
checks and the report read of it (trained once as one model, the method it
starts from, its share of the steps, its dropout, whether it predicts in
training mode, whether it takes an independent head, whether it closes the
gap). :func:`train_method` trains one:

>>> import numpy as np
>>> from ensembles.benchmark.quality.methods import train_method
>>> x, y = np.zeros((20, 40), np.float32), np.arange(20) % 10
>>> trained = train_method("batchensemble", "mlp", x, y, num_members=2, steps=2)
>>> trained.predict(x[:5]).shape
(2, 5, 10)
>>> targets = np.linspace(-1, 1, 20, dtype=np.float32)  # regression
>>> trained = train_method("single", "mlp", x, targets, num_members=2,
...                        steps=2, regression=True)
>>> trained.predict(x[:5]).shape  # one model: a mean and a raw spread
(1, 5, 2)

A new method is one new entry in the table (and its ``build``, where no
existing one fits): ``docs/benchmarking.md`` shows one.

Every method trains the same plain Flax model
(:func:`~ensembles.benchmark.quality.models.build_model`) with the same
optimizer, learning rate, batch size B and number of steps:

- ``single``: one model, B examples per step;
- ``batchensemble``: the model converted by :func:`ensembles.to_batch_ensemble`
  with the library's defaults, trained by the recipe of ``docs/training.md``:
  every member sees the same B examples (:func:`ensembles.tile`), the loss is
  the mean of the member losses (:func:`ensembles.training.cross_entropy`),
  the fast weights get no weight decay and :data:`FAST_LR_MULTIPLIER` times
  the learning rate (:func:`ensembles.optim.split_fast_weights`);
- ``batchensemble_shift``: ``batchensemble`` with the recipe for shift of
  ``docs/training.md``: the output layer an
  :class:`ensembles.EnsembleLinear` drawn afresh per member
  (``to_batch_ensemble(..., independent=...)``) and each member B examples of
  its own per step (:func:`ensembles.training.member_batches`); the
  calibration it was chosen with, a temperature per member on noisy copies,
  is the benchmark's ``members_noisy`` (measured for every method);
- ``rank1``: ``batchensemble`` with rank-1 Bayesian fast weights
  (``posterior="gaussian"``, the library's prior and posterior defaults),
  trained by the recipe of ``docs/rank1.md``: the loss adds
  :func:`ensembles.kl_divergence` over the training-set size, its weight
  annealed linearly from 0 to 1 over the first :data:`KL_ANNEALING` of the
  steps (uncertainty-baselines anneals over 200 of 250 epochs); predicted
  with :data:`EVAL_DRAWS` draws of every member's fast weights, every draw a
  member of the predictive (``[E * draws, N, C]`` logits). uncertainty-
  baselines draws once (``num_eval_samples=1``, at BatchEnsemble's cost); 4
  draws cost 4 times that and were the choice across tasks
  (``docs/rank1.md``);
- ``finetuned``: the trained ``single`` model of the same seed, converted by
  :func:`ensembles.to_batch_ensemble` with fast weights drawn from
  N(1, :data:`FINETUNE_INIT_STDDEV`) and fine-tuned by the recipe of
  ``docs/converting.md``: every parameter trains (AdamW for the shared ones,
  Adam for the fast weights), the learning rate decays from
  :data:`LEARNING_RATE` to 0 along a cosine, each member sees B examples of
  its own; :data:`FINETUNE_FRACTION` of the steps;
- ``deep_ensemble``: E independently initialised models under ``nnx.vmap``,
  each on B examples of its own per step
  (:func:`ensembles.training.member_batches`);
- ``mc_dropout``: one model with dropout (:data:`DROPOUT_RATE`) after every
  hidden layer, trained as ``single``; its E "members" are E dropout masks
  drawn at test time.

What differs between a classifier and a regressor (the loss, the validation
NLL of early stopping, the outputs) is the task kind's
(:mod:`~ensembles.benchmark.quality.kinds`). Steps are jitted with the batch
drawn on the device, so the timings count training, not data loading. A
model is a name of :data:`~ensembles.benchmark.quality.models.QUALITY_MODELS`
or a factory ``rngs -> nnx.Module`` of the user's own (a model of the data's
examples; for ``mc_dropout`` it must take a ``dropout`` keyword as well).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.nn.initializers import Initializer

import ensembles
from ensembles.benchmark.quality.kinds import kind_for
from ensembles.benchmark.quality.models import ModelSpec
from ensembles.benchmark.quality.regression.head import BETA, MIN_STD
from ensembles.benchmark.quality.training import (
    EVAL_DRAWS,
    FAST_LR_MULTIPLIER,
    KL_ANNEALING,
    Built,
    Context,
    QualityMethod,
    Recipe,
    Trained,
    fast_weight_options,
    independent_head_options,
    optimizer,
    reinit_first_layer,
    train_steps,
)

__all__ = [
    "BATCH_SIZE",
    "BETA",
    "DROPOUT_RATE",
    "EARLY_STOPPING_CHECKS",
    "EVAL_DRAWS",
    "FAST_LR_MULTIPLIER",
    "FINETUNE_FRACTION",
    "FINETUNE_INIT_STDDEV",
    "KL_ANNEALING",
    "LEARNING_RATE",
    "METHOD_TABLE",
    "MIN_STD",
    "QUALITY_METHODS",
    "STEPS",
    "WEIGHT_DECAY",
    "QualityMethod",
    "Trained",
    "closes_gap",
    "resolve_method",
    "train_method",
]

#: AdamW's learning rate (constant) and weight decay, for every method.
LEARNING_RATE: float = 3e-3
WEIGHT_DECAY: float = 1e-4

#: Examples per step per member, and training steps (25 epochs of 8,000).
BATCH_SIZE: int = 100
STEPS: int = 2000

#: Dropout rate of ``mc_dropout``.
DROPOUT_RATE: float = 0.1

#: ``finetuned`` fine-tunes for this share of the steps the others train.
FINETUNE_FRACTION: float = 0.25

#: ``finetuned``'s fast weights start from N(1, this**2) (from scratch: 0.5,
#: with random signs at the input).
FINETUNE_INIT_STDDEV: float = 0.3

#: With early stopping, how many times over the steps the validation NLL is
#: checked (the parameters of the best check are kept). 40: with 20, the
#: regression study's concrete models were best at their first check (step
#: 100 of 2,000), too coarse to find their optimum.
EARLY_STOPPING_CHECKS: int = 40


def _adamw(net: nnx.Module, fast: float | None = None, **options) -> nnx.Optimizer:
    return optimizer(
        net,
        learning_rate=LEARNING_RATE,
        weight_decay=WEIGHT_DECAY,
        fast=fast,
        **options,
    )


def _one_model(method: QualityMethod, context: Context) -> Built:
    """One plain model (with the method's dropout), B examples per step."""
    net = context.build(dropout=method.dropout, rngs=nnx.Rngs(context.key(0)))

    def loss(model, key, step):
        x, y = context.draw(key, 1)
        return context.loss(model(x), y, 1)

    def predict(model, x):
        return model(x)[None]

    return Built(net, loss, predict, _adamw(net))


def _dropout_masks(method: QualityMethod, context: Context) -> Built:
    """:func:`_one_model` predicting with E dropout masks, one per tiled copy."""
    built = _one_model(method, context)
    E = context.num_members

    def predict(model, x):
        return ensembles.untile(model(ensembles.tile(x, E)), E)

    return dataclasses.replace(built, predict=predict)


def _converted(method: QualityMethod, context: Context) -> Built:
    """The model converted by ``to_batch_ensemble`` and trained by its recipe."""
    import optax

    recipe, E, count = context.recipe, context.num_members, len(context.x_all)
    plain = context.build(rngs=nnx.Rngs(context.key(0)))
    options = fast_weight_options(recipe)
    if recipe.independent_head:
        options = {**options, **independent_head_options(plain)}
    net = ensembles.to_batch_ensemble(
        plain, num_members=E, rngs=nnx.Rngs(context.key(1)), **options
    )
    if recipe.first_layer_init is not None:
        reinit_first_layer(net, recipe.first_layer_init, context.key(3))
    kl_weight = optax.linear_schedule(
        0.0, 1.0, transition_steps=max(1, int(recipe.kl_annealing * context.steps))
    )
    posterior = recipe.posterior is not None

    def loss(model, key, step):
        if recipe.tiled:
            x, y = context.draw(key, 1)  # the same B examples for every member
            x = ensembles.tile(x, E)
        else:
            x, y = context.draw(key, E)  # B examples of its own per member
        value = context.loss(model(x), y, E)
        if posterior:
            value = value + kl_weight(step) * ensembles.kl_divergence(model) / count
        return value

    def predict(model, x):
        # A posterior draws on every call: eval_draws draws, each a "member".
        draws = recipe.eval_draws if posterior else 1
        return jnp.concatenate(
            [ensembles.untile(model(ensembles.tile(x, E)), E) for _ in range(draws)]
        )

    return Built(net, loss, predict, _adamw(net, recipe.fast_lr_multiplier))


def _finetuned(method: QualityMethod, context: Context) -> Built:
    """The trained start converted, every parameter fine-tuned, rate decaying."""
    E = context.num_members
    init = ensembles.initializers.normal(1.0, FINETUNE_INIT_STDDEV)
    net = ensembles.to_batch_ensemble(
        context.start,
        num_members=E,
        rngs=nnx.Rngs(context.key(1)),
        r_init=init,
        s_init=init,
    )

    def loss(model, key, step):
        x, y = context.draw(key, E)  # B examples of its own per member
        return context.loss(model(x), y, E)

    def predict(model, x):
        return ensembles.untile(model(ensembles.tile(x, E)), E)

    # Every parameter at the full rate, decaying along a cosine.
    return Built(net, loss, predict, _adamw(net, 1.0, decay_steps=context.steps))


def _deep_ensemble(method: QualityMethod, context: Context) -> Built:
    """E independently initialised models under ``nnx.vmap``."""
    E, batch = context.num_members, context.batch

    @nnx.split_rngs(splits=E)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return context.build(rngs=rngs)

    net = create(nnx.Rngs(context.key(0)))
    members_outputs = nnx.vmap(lambda m, x: m(x), in_axes=(0, 0))

    def loss(model, key, step):
        x, y = context.draw(key, E)  # B examples of its own per member
        outputs = members_outputs(model, x.reshape(E, batch, *x.shape[1:]))
        return context.loss(outputs.reshape(E * batch, -1), y, E)

    def predict(model, x):
        return nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(model, x)

    return Built(net, loss, predict, _adamw(net))


#: ``single``: one model, B examples per step.
SINGLE = QualityMethod(
    "single",
    _one_model,
    one_model=True,
    no_head="one model, whose head is its own",
    closes_gap=False,
)

#: Every method, in table order (see the module for each recipe).
METHOD_TABLE: tuple[QualityMethod, ...] = (
    SINGLE,
    QualityMethod("batchensemble", _converted),
    QualityMethod(
        "batchensemble_shift",
        _converted,
        fixed={"tiled": False, "independent_head": True},
    ),
    QualityMethod(
        "rank1", _converted, fixed={"posterior": "gaussian"}, keeps_drawing=True
    ),
    QualityMethod(
        "finetuned",
        _finetuned,
        starts_from=SINGLE,
        steps_share=FINETUNE_FRACTION,
        no_head="whose recipe converts the trained single model as it is "
        "(every layer BatchEnsemble, its head too)",
    ),
    QualityMethod(
        "deep_ensemble",
        _deep_ensemble,
        no_head="whose members are whole independent models already",
        closes_gap=False,
    ),
    QualityMethod(
        "mc_dropout",
        _dropout_masks,
        dropout=DROPOUT_RATE,
        keeps_drawing=True,
        no_head="one model, whose dropout masks are its members",
        closes_gap=False,
    ),
)

#: The compared methods' names, in table order.
QUALITY_METHODS: tuple[str, ...] = tuple(method.name for method in METHOD_TABLE)

_BY_NAME = {method.name: method for method in METHOD_TABLE}


def resolve_method(method: str | QualityMethod) -> QualityMethod:
    """The method a name of :data:`QUALITY_METHODS` names (an object: itself).

    Raises:
      ValueError: if the name is none of :data:`QUALITY_METHODS`.
      TypeError: if ``method`` is neither a name nor a :class:`QualityMethod`.
    """
    if isinstance(method, QualityMethod):
        return method
    if not isinstance(method, str):
        raise TypeError(
            f"a method must be a name of {list(QUALITY_METHODS)} or a "
            f"QualityMethod, got {method!r} of type {type(method).__name__}."
        )
    if method not in _BY_NAME:
        raise ValueError(
            f"`method` must be one of {list(QUALITY_METHODS)}, got {method!r}."
        )
    return _BY_NAME[method]


def closes_gap(name: str) -> bool:
    """Whether the report gives the gap a method of this name closes.

    A name outside the table (a method of your own) does.
    """
    method = _BY_NAME.get(name)
    return method is None or method.closes_gap


def train_method(
    method: str | QualityMethod,
    model: ModelSpec,
    x_train: np.ndarray,
    y_train: np.ndarray,
    *,
    num_members: int,
    steps: int = STEPS,
    seed: int = 0,
    batch_size: int = BATCH_SIZE,
    fast_weight_init: Initializer | tuple[Initializer, Initializer] | None = None,
    fast_lr_multiplier: float = FAST_LR_MULTIPLIER,
    tiled: bool = True,
    prior_stddev: float | None = None,
    stddev_init: Initializer | None = None,
    kl_annealing: float = KL_ANNEALING,
    eval_draws: int = EVAL_DRAWS,
    start: nnx.Module | None = None,
    num_classes: int | None = None,
    first_layer_init: tuple[Initializer, Initializer] | None = None,
    diversity: float = 0.0,
    independent_head: bool = False,
    regression: bool = False,
    beta: float = BETA,
    min_std: float = MIN_STD,
    early_stopping: tuple[np.ndarray, np.ndarray] | None = None,
) -> Trained:
    """Builds and trains one method (see the module for the recipes and examples).

    Args:
      method: a name of :data:`QUALITY_METHODS`, or a :class:`QualityMethod`.
      model: a name of ``QUALITY_MODELS`` (built for ``x_train``'s examples
        and ``num_classes``), or a factory ``rngs -> nnx.Module``.
      x_train: ``[N, ...]`` float32 training examples.
      y_train: ``[N]`` integer labels (regression: ``[N]`` or ``[N, D]``).
      num_members: the ensemble size E (a ``one_model`` method ignores it).
      steps: optimizer steps.
      seed: seed of the parameters, fast weights, batches and dropout masks.
      batch_size: B, the examples each member sees per step (at most N).
      fast_weight_init: the recipe's (:class:`Recipe` says what each does).
      fast_lr_multiplier: the recipe's.
      tiled: the recipe's (``batchensemble_shift`` always has it False).
      prior_stddev: the recipe's.
      stddev_init: the recipe's.
      kl_annealing: the recipe's.
      eval_draws: the recipe's.
      start: the trained model a method ``starts_from`` starts from (for it
        alone; not changed).
      num_classes: a named model's classes (``None``: the largest label + 1).
      first_layer_init: the recipe's.
      diversity: the recipe's (classification only).
      independent_head: the recipe's (refused where the method's ``no_head``).
      regression: train Gaussian-head regressors of real targets.
      beta: the recipe's (regression).
      min_std: the recipe's (regression).
      early_stopping: held-out ``(x, y)``: keep the parameters of the best of
        :data:`EARLY_STOPPING_CHECKS` checks of the NLL on them.

    Returns:
      The :class:`Trained` method.

    Raises:
      ValueError: if ``method`` is unknown, ``start`` is missing or not
        wanted, ``independent_head`` asked of a method that converts no
        model, or ``diversity`` of a regression.
    """
    recipe = Recipe(
        fast_weight_init=fast_weight_init,
        fast_lr_multiplier=fast_lr_multiplier,
        tiled=tiled,
        prior_stddev=prior_stddev,
        stddev_init=stddev_init,
        kl_annealing=kl_annealing,
        eval_draws=eval_draws,
        first_layer_init=first_layer_init,
        diversity=diversity,
        independent_head=independent_head,
        beta=beta,
        min_std=min_std,
    )
    method, kind = resolve_method(method), kind_for(regression)
    _check_method(method, recipe, start)
    kind.check_recipe(recipe)
    recipe = dataclasses.replace(recipe, **method.fixed)
    context = Context.of(
        model,
        x_train,
        y_train,
        num_members=num_members,
        steps=steps,
        seed=seed,
        batch_size=batch_size,
        outputs=kind.model_outputs(y_train, num_classes),
        recipe=recipe,
        loss=kind.objective(recipe),
        start=start,
    )
    built = method.build(method, context)
    validate = None
    if early_stopping is not None:
        validate = nnx.jit(kind.validation_loss(built.predict, *early_stopping, recipe))
    return _trained(method, built, context, validate)


def _check_method(
    method: QualityMethod, recipe: Recipe, start: nnx.Module | None
) -> None:
    """Refuses a ``start`` the method has no use for, or lacks; a head it refuses."""
    if (method.starts_from is not None) != (start is not None):
        starting = [m.name for m in METHOD_TABLE if m.starts_from is not None]
        raise ValueError(
            f"`start` (the trained model a method starts from) must be given for "
            f"a method that starts from one ({', '.join(map(repr, starting))}) "
            f"and only for it, got method={method.name!r} and "
            f"start={type(start).__name__}."
        )
    if recipe.independent_head and method.no_head is not None:
        heads = [m.name for m in METHOD_TABLE if m.no_head is None]
        always = [m.name for m in METHOD_TABLE if m.fixed.get("independent_head")]
        raise ValueError(
            f"`independent_head=True` gives the members of a converted model "
            f"an output layer each: it is for {heads} (where "
            f"{', '.join(map(repr, always))} always has one), got "
            f"method={method.name!r}, {method.no_head}. Leave it False for "
            f"{method.name!r}."
        )


def _trained(
    method: QualityMethod,
    built: Built,
    context: Context,
    validate: Callable[[nnx.Module], jax.Array] | None,
) -> Trained:
    """Runs the steps, keeps the best check's parameters, jits the prediction."""
    net = built.net
    train_s, best_step = train_steps(
        net,
        built.optimizer,
        built.loss,
        context,
        validate,
        checks=EARLY_STOPPING_CHECKS,
    )
    if not method.keeps_drawing:
        net.eval()
    predict = nnx.jit(built.predict)
    return Trained(
        method=method.name,
        predict=lambda x: predict(net, jnp.asarray(x)),
        params=int(
            sum(np.size(leaf) for leaf in jax.tree.leaves(nnx.state(net, nnx.Param)))
        ),
        train_s=train_s,
        model=net,
        best_step=best_step,
    )
