"""The models and methods of the quality benchmark, and how each is trained.

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

Steps are jitted with the batch drawn on the device, so the timings count
training, not data loading. A model is a name of
:data:`~ensembles.benchmark.quality.models.QUALITY_MODELS` or a
factory ``rngs -> nnx.Module`` of the user's own (a classifier of the data's
examples; for ``mc_dropout`` it must take a ``dropout`` keyword as well).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.nn.initializers import Initializer

import ensembles
from ensembles._checks import check_positive_int
from ensembles.benchmark.quality.models import ModelSpec
from ensembles.benchmark.quality.training import (
    Context,
    fast_weight_options,
    independent_head_options,
    objective,
    optimizer,
    reinit_first_layer,
    train_steps,
    validation_loss,
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
    "MIN_STD",
    "QUALITY_METHODS",
    "STEPS",
    "WEIGHT_DECAY",
    "Trained",
    "train_method",
]

#: The compared methods, in table order.
QUALITY_METHODS: tuple[str, ...] = (
    "single",
    "batchensemble",
    "batchensemble_shift",
    "rank1",
    "finetuned",
    "deep_ensemble",
    "mc_dropout",
)

#: The methods that convert the model with :func:`ensembles.to_batch_ensemble`
#: and train by its recipe (the fast weights' learning rate, no decay).
_CONVERTED: tuple[str, ...] = ("batchensemble", "batchensemble_shift", "rank1")

#: AdamW's learning rate (constant) and weight decay, for every method.
LEARNING_RATE: float = 3e-3
WEIGHT_DECAY: float = 1e-4

#: Examples per step per member, and training steps (25 epochs of 8,000).
BATCH_SIZE: int = 100
STEPS: int = 2000

#: The fast weights' learning rate over the shared weights' (the recipe).
FAST_LR_MULTIPLIER: float = 0.5

#: The share of the steps over which ``rank1``'s KL weight rises from 0 to 1.
KL_ANNEALING: float = 0.8

#: ``rank1``'s draws of every member's fast weights per prediction (chosen
#: across tasks over 1: benchmarks/quality_defaults.py).
EVAL_DRAWS: int = 4

#: Dropout rate of ``mc_dropout``.
DROPOUT_RATE: float = 0.1

#: ``finetuned`` fine-tunes for this share of the steps the others train.
FINETUNE_FRACTION: float = 0.25

#: ``finetuned``'s fast weights start from N(1, this**2) (from scratch: 0.5,
#: with random signs at the input).
FINETUNE_INIT_STDDEV: float = 0.3

#: Regression: the beta-NLL exponent of every method's loss (Seitzer et al.,
#: 2022; 0 is the plain NLL) and the floor of the predicted standard
#: deviations, in standardised target units (``docs/regression.md``).
BETA: float = 0.5
MIN_STD: float = 1e-3

#: With early stopping, how many times over the steps the validation NLL is
#: checked (the parameters of the best check are kept). 40: with 20, the
#: regression study's concrete models were best at their first check (step
#: 100 of 2,000), too coarse to find their optimum.
EARLY_STOPPING_CHECKS: int = 40


@dataclasses.dataclass(frozen=True)
class Trained:
    """A trained method.

    Attributes:
      method: one of :data:`QUALITY_METHODS`.
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


def train_method(
    method: str,
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
    """Builds and trains one method; see the module docs for the recipes.

    The arguments from ``fast_weight_init`` to ``eval_draws``,
    ``first_layer_init`` and ``diversity`` vary ``batchensemble``'s and
    ``rank1``'s recipes; the methods they do not apply to ignore them, so
    that one set of options can train every method, all but
    ``independent_head``, which changes what the method is and is refused
    by the others (the benchmark keeps their defaults;
    ``benchmarks/diversity_study.py``, ``benchmarks/quality_defaults.py`` and
    ``benchmarks/finetune_recipe.py`` measure them). A name of
    ``QUALITY_MODELS`` is built for the data's examples (``x_train.shape[1:]``)
    and ``num_classes`` classes (regression: two outputs, a mean and a raw
    spread, per target).

    >>> import numpy as np
    >>> from ensembles.benchmark.quality.methods import train_method
    >>> x, y = np.zeros((20, 40), np.float32), np.arange(20) % 10
    >>> trained = train_method("batchensemble", "mlp", x, y, num_members=2,
    ...                        steps=2)
    >>> trained.predict(x[:5]).shape
    (2, 5, 10)
    >>> targets = np.linspace(-1, 1, 20, dtype=np.float32)  # regression
    >>> trained = train_method("single", "mlp", x, targets, num_members=2,
    ...                        steps=2, regression=True)
    >>> trained.predict(x[:5]).shape  # one model: a mean and a raw spread
    (1, 5, 2)

    Args:
      method: one of :data:`QUALITY_METHODS`.
      model: a name of ``QUALITY_MODELS``, or a factory ``rngs ->
        nnx.Module`` (:func:`~ensembles.benchmark.quality.models.build_model`).
      x_train: ``[N, ...]`` float32 training examples.
      y_train: ``[N]`` integer labels (regression: ``[N]`` or ``[N, D]`` real
        targets, best standardised).
      num_members: the ensemble size E (``single`` ignores it).
      steps: optimizer steps.
      seed: seed of the parameters, the fast weights, the batches and the
        dropout masks.
      batch_size: B, the examples each member sees per step (:data:`BATCH_SIZE`;
        at most the training examples); an ensemble's step runs ``E * B``
        rows, so E = 8 at ``BATCH_SIZE // 2`` runs the rows of E = 4.
      fast_weight_init: the fast weights' ``r_init`` and ``s_init`` (one
        for both, or a pair ``(r_init, s_init)``); ``None``
        keeps the library's default.
      fast_lr_multiplier: the fast weights' learning rate over the shared
        weights'.
      tiled: every member sees the same B examples per step; ``False`` gives
        each its own B (:func:`ensembles.training.member_batches`), as
        ``batchensemble_shift`` always does.
      prior_stddev: ``rank1``'s prior scale (``None``: the library's).
      stddev_init: ``rank1``'s initializer of the unconstrained posterior
        scales (``None``: the library's).
      kl_annealing: the share of the steps over which ``rank1``'s KL weight
        rises from 0 to 1.
      eval_draws: ``rank1``'s draws per member at prediction; each draw counts
        as a member of the predictive (``[E * draws, N, C]`` logits).
      start: ``finetuned`` only: the trained ``single`` model it starts from
        (not changed).
      num_classes: the classes a named model is built for (``None``: the
        largest training label + 1); not for regression.
      first_layer_init: ``(r_init, s_init)`` of the first BatchEnsemble layer
        (in the model's graph order, its first layer for an
        ``nnx.Sequential``), the others keeping ``fast_weight_init`` (TabM's
        recipe: random signs for the first layer's ``r``, ones elsewhere);
        ``None``: every layer alike.
      independent_head: ``batchensemble``/``rank1``: the model's last
        ``nnx.Linear`` (its output layer) becomes fully independent, a kernel
        of its own per member drawn afresh (``to_batch_ensemble``'s
        ``independent``; TabM's heads); ``batchensemble_shift``'s always is.
      diversity: the weight of a negative-correlation term (Liu & Yao, 1999;
        Buschjaeger et al., 2020): ``diversity`` times the mean squared
        distance of each member's softmax from the members' mean is
        subtracted from the loss, pushing members apart; 0: none
        (classification only).
      regression: train Gaussian-head regressors of real targets:
        :func:`ensembles.training.gaussian_nll` of
        :func:`ensembles.training.gaussian_head`'s means and spreads.
      beta: regression: the beta-NLL exponent (:data:`BETA`).
      min_std: regression: the spreads' floor, in the targets' units
        (:data:`MIN_STD`).
      early_stopping: held-out ``(x, y)`` (never test examples): the method's
        NLL on them (the exact mixture's, for a regressor) is checked
        :data:`EARLY_STOPPING_CHECKS` times over the steps, and the
        parameters of the best check are kept (``Trained.best_step``).
        ``None``: the last step's.

    Returns:
      The :class:`Trained` method.

    Raises:
      ValueError: if ``method`` is unknown, ``finetuned`` has no ``start``,
        ``independent_head`` is asked of a method that converts no model to
        a BatchEnsemble (``single``, ``mc_dropout``, ``deep_ensemble``,
        ``finetuned``), or ``diversity`` of a regression.
    """
    _check_method(method, start)
    if independent_head and method not in _CONVERTED:
        raise ValueError(
            f"`independent_head=True` gives the members of a converted model "
            f"an output layer each: it is for {list(_CONVERTED)} (where "
            f"'batchensemble_shift' always has one), got method={method!r}, "
            f"{_WITHOUT_HEADS.get(method, 'which converts no model')}. Leave it "
            f"False for {method!r}."
        )
    if regression and diversity:
        raise ValueError(
            f"`diversity` (={diversity}) pushes members' softmaxes apart: it is "
            f"for classification; leave it 0 for regression."
        )
    context = Context.of(
        model,
        x_train,
        y_train,
        num_members=num_members,
        steps=steps,
        seed=seed,
        batch_size=check_positive_int(batch_size, "batch_size"),
        regression=regression,
        num_classes=num_classes,
    )
    loss_of = objective(
        regression=regression, beta=beta, min_std=min_std, diversity=diversity
    )
    eval_draws = check_positive_int(eval_draws, "eval_draws")
    if method == "deep_ensemble":
        net, loss_fn, predict_fn = _deep_ensemble(context, loss_of)
    elif method in _CONVERTED:
        shift = method == "batchensemble_shift"  # the recipe for shift
        net, loss_fn, predict_fn = _batch_ensemble(
            method,
            context,
            loss_of,
            fast_weight_options(method, fast_weight_init, prior_stddev, stddev_init),
            first_layer_init=first_layer_init,
            tiled=tiled and not shift,
            kl_annealing=kl_annealing,
            eval_draws=eval_draws,
            independent_head=independent_head or shift,
        )
    elif method == "finetuned":
        net, loss_fn, predict_fn = _finetuned(context, loss_of, start)
    else:
        net, loss_fn, predict_fn = _single(method, context, loss_of)
    if method == "finetuned":  # every parameter at the full, decaying rate
        fast, decay_steps = 1.0, context.steps
    else:
        fast = fast_lr_multiplier if method in _CONVERTED else None
        decay_steps = None
    tx = optimizer(
        net,
        learning_rate=LEARNING_RATE,
        weight_decay=WEIGHT_DECAY,
        fast=fast,
        decay_steps=decay_steps,
    )
    validate = None
    if early_stopping is not None:
        validate = nnx.jit(
            validation_loss(predict_fn, *early_stopping, regression, min_std)
        )
    train_s, best_step = train_steps(
        net, tx, loss_fn, context, validate, checks=EARLY_STOPPING_CHECKS
    )
    if method not in ("mc_dropout", "rank1"):
        net.eval()  # mc_dropout keeps its masks, rank1 its draws
    predict = nnx.jit(predict_fn)
    return Trained(
        method=method,
        predict=lambda x: predict(net, jnp.asarray(x)),
        params=_param_count(net),
        train_s=train_s,
        model=net,
        best_step=best_step,
    )


#: What ``independent_head`` would mean for the methods that take no such head.
_WITHOUT_HEADS = {
    "deep_ensemble": "whose members are whole independent models already",
    "single": "one model, whose head is its own",
    "mc_dropout": "one model, whose dropout masks are its members",
    "finetuned": "whose recipe converts the trained single model as it is "
    "(every layer BatchEnsemble, its head too)",
}


def _param_count(net: nnx.Module) -> int:
    return int(
        sum(np.size(leaf) for leaf in jax.tree.leaves(nnx.state(net, nnx.Param)))
    )


def _check_method(method: str, start: nnx.Module | None) -> None:
    if method not in QUALITY_METHODS:
        raise ValueError(
            f"`method` must be one of {list(QUALITY_METHODS)}, got {method!r}."
        )
    if (method == "finetuned") != (start is not None):
        raise ValueError(
            "`start` (the trained single model) must be given for method "
            f"'finetuned' and only for it, got method={method!r} and "
            f"start={type(start).__name__}."
        )


def _deep_ensemble(context: Context, loss_of: Callable):
    E, batch = context.num_members, context.batch

    @nnx.split_rngs(splits=E)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return context.build(rngs=rngs)

    net = create(nnx.Rngs(context.key(0)))
    members_outputs = nnx.vmap(lambda m, x: m(x), in_axes=(0, 0))

    def loss_fn(model, key, step):
        x, y = context.draw(key, E)  # B examples of its own per member
        outputs = members_outputs(model, x.reshape(E, batch, *x.shape[1:]))
        return loss_of(outputs.reshape(E * batch, -1), y, E)

    def predict_fn(model, x):
        return nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(model, x)

    return net, loss_fn, predict_fn


def _batch_ensemble(
    method,
    context,
    loss_of,
    options,
    *,
    first_layer_init,
    tiled,
    kl_annealing,
    eval_draws,
    independent_head,
):
    import optax

    E, count = context.num_members, len(context.x_all)
    plain = context.build(rngs=nnx.Rngs(context.key(0)))
    if independent_head:
        options = {**options, **independent_head_options(plain)}
    net = ensembles.to_batch_ensemble(
        plain,
        num_members=E,
        rngs=nnx.Rngs(context.key(1)),
        **options,
    )
    if first_layer_init is not None:
        reinit_first_layer(net, first_layer_init, context.key(3))
    kl_weight = optax.linear_schedule(
        0.0, 1.0, transition_steps=max(1, int(kl_annealing * context.steps))
    )

    def loss_fn(model, key, step):
        if tiled:
            x, y = context.draw(key, 1)  # the same B examples for every member
            x = ensembles.tile(x, E)
        else:
            x, y = context.draw(key, E)  # B examples of its own per member
        loss = loss_of(model(x), y, E)
        if method == "rank1":
            kl = ensembles.kl_divergence(model)
            loss = loss + kl_weight(step) * kl / count
        return loss

    def predict_fn(model, x):
        # rank1 draws on every call: eval_draws draws, each a "member".
        draws = eval_draws if method == "rank1" else 1
        return jnp.concatenate(
            [ensembles.untile(model(ensembles.tile(x, E)), E) for _ in range(draws)]
        )

    return net, loss_fn, predict_fn


def _finetuned(context: Context, loss_of: Callable, start: nnx.Module):
    E = context.num_members
    init = ensembles.initializers.normal(1.0, FINETUNE_INIT_STDDEV)
    net = ensembles.to_batch_ensemble(
        start, num_members=E, rngs=nnx.Rngs(context.key(1)), r_init=init, s_init=init
    )

    def loss_fn(model, key, step):
        x, y = context.draw(key, E)  # B examples of its own per member
        return loss_of(model(x), y, E)

    def predict_fn(model, x):
        return ensembles.untile(model(ensembles.tile(x, E)), E)

    return net, loss_fn, predict_fn


def _single(method: str, context: Context, loss_of: Callable):
    dropout = DROPOUT_RATE if method == "mc_dropout" else 0.0
    net = context.build(dropout=dropout, rngs=nnx.Rngs(context.key(0)))

    def loss_fn(model, key, step):
        x, y = context.draw(key, 1)
        return loss_of(model(x), y, 1)

    if method == "mc_dropout":

        def predict_fn(model, x):  # E dropout masks, one per tiled copy
            E = context.num_members
            return ensembles.untile(model(ensembles.tile(x, E)), E)

    else:

        def predict_fn(model, x):
            return model(x)[None]

    return net, loss_fn, predict_fn
