"""The models of the quality benchmark: its own two, or a factory of the user's.

A model is named by a str of :data:`QUALITY_MODELS` (built by
:func:`build_quality_model`) or given as a factory ``rngs -> nnx.Module``, a
classifier of the data's examples of the user's own (:func:`build_model`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from ensembles.benchmark.models import model_name

__all__ = [
    "QUALITY_MODELS",
    "ModelSpec",
    "build_model",
    "build_quality_model",
    "check_model",
    "model_name",
]

#: The ``--model`` choices of ``--quality``.
QUALITY_MODELS: tuple[str, ...] = ("cnn", "mlp")

_NUM_CLASSES = 10
_LENGTH = 40


def _flatten(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[0], -1)


def _add_channel(x: jax.Array) -> jax.Array:
    return x[..., None]


def build_quality_model(
    name: str, *, dropout: float = 0.0, rngs: nnx.Rngs
) -> nnx.Sequential:
    """One plain Flax classifier of ``[N, 40]`` MNIST-1D sequences.

    - ``"cnn"``: three 1-D ``nnx.Conv`` of 32 channels (kernel 5, 3, 3;
      stride 2 each) with ReLUs, flattened, an ``nnx.Linear`` head (10).
    - ``"mlp"``: ``40 -> 256 -> 256 -> 10`` with ReLUs.

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from ensembles.benchmark.quality_models import build_quality_model
    >>> build_quality_model("cnn", rngs=nnx.Rngs(0))(jnp.ones((3, 40))).shape
    (3, 10)

    Args:
      name: one of :data:`QUALITY_MODELS`.
      dropout: if > 0, an ``nnx.Dropout`` of this rate after every hidden
        layer's activation.
      rngs: rng keys for the parameters (and the dropout masks).

    Returns:
      The model, an ``nnx.Sequential``.

    Raises:
      ValueError: if ``name`` is not one of :data:`QUALITY_MODELS`.
    """
    if name not in QUALITY_MODELS:
        raise ValueError(f"`name` must be one of {list(QUALITY_MODELS)}, got {name!r}.")

    def hidden(layer: nnx.Module) -> list:
        drop = [nnx.Dropout(dropout, rngs=rngs)] if dropout else []
        return [layer, nnx.relu, *drop]

    if name == "cnn":
        channels = 32
        return nnx.Sequential(
            _add_channel,
            *hidden(nnx.Conv(1, channels, (5,), strides=2, rngs=rngs)),
            *hidden(nnx.Conv(channels, channels, (3,), strides=2, rngs=rngs)),
            *hidden(nnx.Conv(channels, channels, (3,), strides=2, rngs=rngs)),
            _flatten,
            nnx.Linear(channels * _LENGTH // 8, _NUM_CLASSES, rngs=rngs),
        )
    width = 256
    return nnx.Sequential(
        *hidden(nnx.Linear(_LENGTH, width, rngs=rngs)),
        *hidden(nnx.Linear(width, width, rngs=rngs)),
        nnx.Linear(width, _NUM_CLASSES, rngs=rngs),
    )


ModelSpec = str | Callable[..., nnx.Module]


def build_model(model: ModelSpec, *, dropout: float = 0.0, rngs: nnx.Rngs) -> Any:
    """Builds ``model``: a name of :data:`QUALITY_MODELS` or a user's factory.

    A factory is called as ``model(rngs)``, or ``model(rngs, dropout=rate)``
    when ``dropout`` is asked for (``mc_dropout``).

    >>> from flax import nnx
    >>> from ensembles.benchmark.quality_methods import build_model
    >>> def my_mlp(rngs):
    ...     return nnx.Sequential(nnx.Linear(40, 10, rngs=rngs))
    >>> type(build_model(my_mlp, rngs=nnx.Rngs(0))).__name__
    'Sequential'

    Args:
      model: a name or a factory.
      dropout: the dropout rate to build with (0: none).
      rngs: rng keys for the parameters (and dropout masks).

    Returns:
      The new model.

    Raises:
      ValueError: if ``dropout`` is asked of a factory without a ``dropout``
        parameter, or the name is unknown.
    """
    if isinstance(model, str):
        return build_quality_model(model, dropout=dropout, rngs=rngs)
    if not dropout:
        return model(rngs)
    check_model(model, ("mc_dropout",))
    return model(rngs, dropout=dropout)


def check_model(model: ModelSpec, methods: Sequence[str]) -> None:
    """Raises unless ``model`` can run every method of ``methods``.

    Args:
      model: a name of :data:`QUALITY_MODELS` or a factory.
      methods: the methods it will run.

    Raises:
      ValueError: if the name is unknown, or ``methods`` has ``mc_dropout``
        and the factory takes no ``dropout`` keyword.
      TypeError: if ``model`` is neither a str nor callable.
    """
    if isinstance(model, str):
        if model not in QUALITY_MODELS:
            raise ValueError(
                f"`model` must be one of {list(QUALITY_MODELS)} or a factory "
                f"`rngs -> nnx.Module`, got {model!r}."
            )
        return
    if not callable(model):
        raise TypeError(
            f"`model` must be a name or a factory `rngs -> nnx.Module`, got "
            f"{model!r} of type {type(model).__name__}."
        )
    if "mc_dropout" in methods and "dropout" not in inspect.signature(model).parameters:
        raise ValueError(
            f"`mc_dropout` needs a model with dropout: the factory "
            f"{model_name(model)!r} must take a `dropout` keyword (the rate), or "
            f"leave mc_dropout out of `methods`."
        )
