"""The models of the quality benchmark: its own two, or a factory of the user's.

A model is named by a str of :data:`QUALITY_MODELS` (built by
:func:`build_quality_model`) or given as a factory ``rngs -> nnx.Module``, a
classifier of the data's examples of the user's own (:func:`build_model`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from ensembles.benchmark.report import model_name

__all__ = [
    "QUALITY_MODELS",
    "ModelSpec",
    "build_model",
    "build_quality_model",
    "check_model",
]

#: The ``--model`` choices of ``--quality``.
QUALITY_MODELS: tuple[str, ...] = ("cnn", "mlp")


def _flatten(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[0], -1)


def _add_channel(x: jax.Array) -> jax.Array:
    return x[..., None]


def build_quality_model(
    name: str,
    *,
    input_shape: Sequence[int] = (40,),
    num_classes: int = 10,
    dropout: float = 0.0,
    rngs: nnx.Rngs,
) -> nnx.Sequential:
    """One plain Flax classifier of ``[N, *input_shape]`` examples.

    - ``"cnn"``: three ``nnx.Conv`` of 32 channels, stride 2 each, with ReLUs,
      over the examples' axes as spatial axes (1-D sequences: kernels 5, 3, 3;
      2-D images: 3x3), flattened, an ``nnx.Linear`` head;
    - ``"mlp"``: flattened, ``-> 256 -> 256 -> num_classes`` with ReLUs.

    The defaults are MNIST-1D's ``[N, 40]`` sequences and 10 classes.

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from ensembles.benchmark.quality.models import build_quality_model
    >>> build_quality_model("cnn", rngs=nnx.Rngs(0))(jnp.ones((3, 40))).shape
    (3, 10)
    >>> digits = build_quality_model("cnn", input_shape=(8, 8), rngs=nnx.Rngs(0))
    >>> digits(jnp.ones((3, 8, 8))).shape
    (3, 10)

    Args:
      name: one of :data:`QUALITY_MODELS`.
      input_shape: one example's shape (a CNN needs 1 or 2 axes).
      num_classes: the head's outputs.
      dropout: if > 0, an ``nnx.Dropout`` of this rate after every hidden
        layer's activation.
      rngs: rng keys for the parameters (and the dropout masks).

    Returns:
      The model, an ``nnx.Sequential``.

    Raises:
      ValueError: if ``name`` is not one of :data:`QUALITY_MODELS`, or a CNN
        is asked for examples of another rank.
    """
    if name not in QUALITY_MODELS:
        raise ValueError(f"`name` must be one of {list(QUALITY_MODELS)}, got {name!r}.")
    input_shape = tuple(input_shape)

    def hidden(layer: nnx.Module) -> list:
        drop = [nnx.Dropout(dropout, rngs=rngs)] if dropout else []
        return [layer, nnx.relu, *drop]

    if name == "cnn":
        rank = len(input_shape)
        if rank not in (1, 2):
            raise ValueError(
                f"the 'cnn' convolves the axes of 1-D or 2-D examples, got examples "
                f"of shape {input_shape}: use 'mlp' (e.g. for tabular data)."
            )
        channels = 32
        sizes = [(5,), (3,), (3,)] if rank == 1 else [(3, 3)] * 3
        spatial = list(input_shape)
        for _ in range(3):  # stride 2, SAME padding: ceil(n / 2)
            spatial = [-(-n // 2) for n in spatial]
        return nnx.Sequential(
            _add_channel,
            *hidden(nnx.Conv(1, channels, sizes[0], strides=2, rngs=rngs)),
            *hidden(nnx.Conv(channels, channels, sizes[1], strides=2, rngs=rngs)),
            *hidden(nnx.Conv(channels, channels, sizes[2], strides=2, rngs=rngs)),
            _flatten,
            nnx.Linear(channels * math.prod(spatial), num_classes, rngs=rngs),
        )
    width = 256
    return nnx.Sequential(
        _flatten,
        *hidden(nnx.Linear(math.prod(input_shape), width, rngs=rngs)),
        *hidden(nnx.Linear(width, width, rngs=rngs)),
        nnx.Linear(width, num_classes, rngs=rngs),
    )


ModelSpec = str | Callable[..., nnx.Module]


def build_model(
    model: ModelSpec,
    *,
    input_shape: Sequence[int] = (40,),
    num_classes: int = 10,
    dropout: float = 0.0,
    rngs: nnx.Rngs,
) -> Any:
    """Builds ``model``: a name of :data:`QUALITY_MODELS` or a user's factory.

    A name is built for the data's examples and classes
    (:func:`build_quality_model`); a factory is called as ``model(rngs)``, or
    ``model(rngs, dropout=rate)`` when ``dropout`` is asked for
    (``mc_dropout``), and must fit the data itself.

    >>> from flax import nnx
    >>> from ensembles.benchmark.quality.models import build_model
    >>> def my_mlp(rngs):
    ...     return nnx.Sequential(nnx.Linear(40, 10, rngs=rngs))
    >>> type(build_model(my_mlp, rngs=nnx.Rngs(0))).__name__
    'Sequential'

    Args:
      model: a name or a factory.
      input_shape: one example's shape (names only).
      num_classes: the number of classes (names only).
      dropout: the dropout rate to build with (0: none).
      rngs: rng keys for the parameters (and dropout masks).

    Returns:
      The new model.

    Raises:
      ValueError: if ``dropout`` is asked of a factory without a ``dropout``
        parameter, or the name is unknown.
    """
    if isinstance(model, str):
        return build_quality_model(
            model,
            input_shape=input_shape,
            num_classes=num_classes,
            dropout=dropout,
            rngs=rngs,
        )
    if not dropout:
        return model(rngs)
    check_model(model, [f"dropout={dropout}"])
    return model(rngs, dropout=dropout)


def check_model(model: ModelSpec, with_dropout: Sequence[str]) -> None:
    """Raises unless ``model`` is a name or a factory, taking dropout if asked.

    Args:
      model: a name of :data:`QUALITY_MODELS` or a factory.
      with_dropout: what builds it with dropout (the methods' names, say:
        ``mc_dropout``); empty: nothing.

    Raises:
      ValueError: if the name is unknown, or something builds the factory's
        model with dropout and it takes no ``dropout`` keyword.
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
    if with_dropout and "dropout" not in inspect.signature(model).parameters:
        named = ", ".join(with_dropout)
        raise ValueError(
            f"`{named}` needs a model with dropout: the factory "
            f"{model_name(model)!r} must take a `dropout` keyword (the rate), or "
            f"leave {named} out of `methods`."
        )
