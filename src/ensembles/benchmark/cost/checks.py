"""What the cost benchmarks check of a model before they compile anything.

``ensembles-bench`` (timed, and ``--compiled-for``) runs :func:`check_convertible`
on every model first, so that a model it cannot measure is refused with one
line that names the fix, not a traceback from deep inside JAX. A user's own
model (a factory ``rngs -> nnx.Module``) is built abstractly (nothing is
allocated) and must be an ``nnx.Module`` that takes one example of
``input_shape`` and converts; what the conversion left shared by every
member (norms, embeddings, a module's own parameters) is returned, for the
report to name. :func:`convert` is the conversion every BatchEnsemble row
measures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import ensembles
from ensembles.benchmark.cost.models import build_model
from ensembles.benchmark.report import model_name, model_reference

__all__ = ["check_convertible", "check_models", "convert"]

# The Flax layers conversion replaces; after it none may remain, else
# "batchensemble" would time a partly plain model.
_PLAIN_LAYERS = tuple(ensembles.convert.CONVERTERS)


def convert(
    base: nnx.Module,
    num_members: int,
    *,
    fast_weight_init: ensembles.initializers.Initializer | None = None,
    seed: int = 0,
    posterior: str | None = None,
) -> nnx.Module:
    """``ensembles.to_batch_ensemble(base, ...)``, refused if a layer stays plain.

    Args:
      base: the plain model.
      num_members: E.
      fast_weight_init: ``r_init`` and ``s_init``; ``None``: the library's.
      seed: the fast weights' rng seed is ``seed + 10_000``.
      posterior: ``to_batch_ensemble``'s ``posterior``.

    Returns:
      The BatchEnsemble model.

    Raises:
      ValueError: if the conversion refuses ``base``, or leaves one of the
        layers it converts (``ensembles.convert.CONVERTERS``) plain.
    """
    kwargs = {}
    if fast_weight_init is not None:
        kwargs = {"r_init": fast_weight_init, "s_init": fast_weight_init}
    converted = ensembles.to_batch_ensemble(
        base,
        num_members=num_members,
        rngs=nnx.Rngs(seed + 10_000),
        posterior=posterior,
        **kwargs,
    )
    left = [
        f"{'/'.join(map(str, path))} ({type(node).__name__})"
        for path, node in nnx.iter_graph(converted)
        if type(node) in _PLAIN_LAYERS
    ]
    if left:
        raise ValueError(
            f"ensembles {ensembles.__version__} cannot convert every layer of "
            f"this model: {', '.join(left)} stayed plain, so 'batchensemble' "
            f"would not be a BatchEnsemble model."
        )
    return converted


def _users_model(
    factory: Callable[[nnx.Rngs], nnx.Module], input_shape: Sequence[int] | None
) -> nnx.Module:
    """A factory's model, converted abstractly, once it proved to take an example.

    Only the mistakes of the factory's contract are refused here: a result
    that is no ``nnx.Module``, a shape error of the plain model's forward
    (``TypeError``/``ValueError``, what JAX raises for a shape that does not
    fit), the conversion's own refusals. Anything else the factory or the
    model raises is the user's bug and keeps its traceback.
    """
    if input_shape is None:
        raise ValueError(
            "`input_shape` must give one example's shape for a model factory "
            "(e.g. (32, 32, 3) for images): the benchmark draws its inputs."
        )
    returned = []

    def build():
        model = factory(nnx.Rngs(0))
        returned.append(type(model).__name__)
        return model if isinstance(model, nnx.Module) else None

    plain = nnx.eval_shape(build)
    if plain is None:
        raise ValueError(
            f"the factory returned {returned[0]}, not an nnx.Module: return the "
            f"model (a function rngs -> nnx.Module)."
        )
    shape = tuple(int(d) for d in input_shape)
    example = jax.ShapeDtypeStruct((1, *shape), jnp.float32)
    try:
        out = nnx.eval_shape(lambda model, x: model(x), plain, example)
    except (TypeError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ValueError(
            f"the model does not take inputs of shape (N, "
            f"{', '.join(map(str, shape))}) ({type(error).__name__}: {first}): "
            f"give `input_shape` (--input-shape) one example's shape as the "
            f"model takes it, without the batch axis."
        ) from error
    if not isinstance(out, jax.ShapeDtypeStruct) or not out.shape:
        raise ValueError(
            f"the model must return one array [N, ..., outputs], got "
            f"{jax.tree.map(lambda leaf: leaf.shape, out)!r}."
        )
    return nnx.eval_shape(lambda: convert(factory(nnx.Rngs(0)), 1))


def check_convertible(
    model: str | Callable[[nnx.Rngs], nnx.Module],
    impl: str = "xla",
    *,
    input_shape: Sequence[int] | None = None,
) -> ensembles.EnsembleSummary:
    """Raises unless ``model`` converts and takes ``impl``; says what stayed shared.

    :func:`ensembles.to_batch_ensemble` must convert every layer it converts
    (:func:`convert`), and every converted layer must accept
    ``nnx.view(model, impl=impl)``. A factory's model is built and converted
    abstractly, and must take one example of ``input_shape``.

    >>> from flax import nnx
    >>> from ensembles.benchmark import check_convertible
    >>> check_convertible("mlp", impl="xla").shared_norms
    ()
    >>> def my_model(rngs):
    ...     return nnx.Sequential(nnx.Linear(6, 8, rngs=rngs),
    ...                           nnx.LayerNorm(8, rngs=rngs))
    >>> check_convertible(my_model, input_shape=(6,)).shared_norms
    (('layers/1', 'LayerNorm', 16),)

    Args:
      model: one of :data:`~ensembles.benchmark.MODELS`, or a factory
        ``rngs -> nnx.Module``.
      impl: the op implementation the benchmark will ask for.
      input_shape: a factory's example shape (required for one).

    Returns:
      :func:`ensembles.summary` of the converted model (one member; of the
      benchmark's own models, at width 1): its ``shared_norms`` and
      ``shared`` are the model's parametrised layers and parameters that the
      conversion left shared by every member.

    Raises:
      ValueError: if a factory comes without ``input_shape``, returns no
        ``nnx.Module``, or its model does not take ``input_shape``; if a
        layer of ``model`` stays a plain Flax layer, the conversion refuses
        the model (nothing to convert, say), or a converted layer has no
        implementation ``impl``.
    """
    if callable(model):
        converted = _users_model(model, input_shape)
    else:
        converted = convert(build_model(model, width=1, rngs=nnx.Rngs(0)), 1)
    name = model_name(model)
    try:
        view = nnx.view(converted, impl=impl)
    except ValueError as error:
        raise ValueError(
            f"impl={impl!r} is not available for every layer of the {name} "
            f"model: {error}"
        ) from None
    # A whole-model view leaves layers whose op lacks `impl` as they were; a
    # benchmark row named after `impl` must not time them with another.
    lacking = sorted(
        {
            type(node).__name__
            for _, node in nnx.iter_graph(view)
            if isinstance(node, ensembles.layers.BatchEnsembleModule)
            and node.impl != impl
        }
    )
    if lacking:
        raise ValueError(
            f"impl={impl!r} is not available for every layer of the {name} "
            f"model: {lacking} have no such implementation."
        )
    return ensembles.summary(converted)


def check_models(
    models: Sequence[str | Callable[[nnx.Rngs], nnx.Module]],
    impl: str = "xla",
    input_shape: Sequence[int] | None = None,
) -> list[str]:
    """:func:`check_convertible` of every model of an ``ensembles-bench`` run.

    >>> from flax import nnx
    >>> def my_model(rngs):
    ...     return nnx.Sequential(nnx.Linear(6, 8, rngs=rngs),
    ...                           nnx.LayerNorm(8, rngs=rngs))
    >>> print(*check_models(["mlp", my_model], input_shape=(6,)))
    ... # doctest: +NORMALIZE_WHITESPACE
    my_model: left shared by every member (one copy, not converted):
    layers/1 (LayerNorm, 16 parameters)

    Args:
      models: the benchmark's model names and the user's factories.
      impl: ``--impl``.
      input_shape: ``--input-shape``, the factories' example shape.

    Returns:
      One line per factory: the parametrised layers (and a module's own
      parameters) of the user's model that the conversion left shared by
      every member, or that it left none.

    Raises:
      ValueError: :func:`check_convertible`'s, prefixed with the options
        that name the model (``--model package.module:factory --input-shape
        8: ...``).
    """
    lines = []
    for model in models:
        factory = not isinstance(model, str)
        try:
            info = check_convertible(
                model, impl, input_shape=input_shape if factory else None
            )
        except ValueError as error:
            given = ",".join(map(str, input_shape or ()))
            flag = f"--input-shape {given}" if factory else f"--impl {impl}"
            raise ValueError(
                f"--model {model_reference(model)} {flag}: {error}"
            ) from error
        if not factory:
            continue
        shared = [
            f"{path} ({kind}, {count:,} parameters)"
            for path, kind, count in (*info.shared_norms, *info.shared)
        ]
        lines.append(
            f"{model_name(model)}: left shared by every member (one copy, not "
            f"converted): {', '.join(shared)}"
            if shared
            else f"{model_name(model)}: every parametrised layer converted, none "
            f"left shared by every member"
        )
    return lines
