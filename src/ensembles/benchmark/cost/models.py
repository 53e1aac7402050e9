"""The models the benchmark compares: a layer, an MLP, a CNN, or your own.

Every model of the benchmark's is an ``nnx.Sequential`` of stock Flax layers,
so what is measured is what a user would convert with
:func:`ensembles.to_batch_ensemble`; a factory ``rngs -> nnx.Module`` brings
the user's model (with the shape of one example, ``input_shape``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "DEFAULT_IMAGE_SIZE",
    "DEFAULT_WIDTHS",
    "MODELS",
    "NUM_CLASSES",
    "build_model",
    "model_inputs",
]

#: The ``--model`` choices.
MODELS: tuple[str, ...] = ("linear", "mlp", "cnn")

#: Default ``width`` per model: features of the layer and of the MLP's input
#: and hidden layers, base channels of the CNN (two more convs use 2x).
DEFAULT_WIDTHS: dict[str, int] = {"linear": 1024, "mlp": 1024, "cnn": 16}

#: Height and width of the CNN's RGB input images (CIFAR-sized).
DEFAULT_IMAGE_SIZE: int = 32

#: Outputs of the MLP and CNN heads (a 10-class classifier).
NUM_CLASSES: int = 10


def _global_mean_pool(x: jax.Array) -> jax.Array:
    return jnp.mean(x, axis=(1, 2))


def build_model(
    name: str | Callable[[nnx.Rngs], nnx.Module],
    *,
    width: int | None = None,
    rngs: nnx.Rngs,
) -> nnx.Module:
    """Builds one plain Flax model of the benchmark, or the user's own.

    A factory ``rngs -> nnx.Module`` (your model) is called as ``name(rngs)``
    (``width`` does not apply). The benchmark's own:

    - ``"linear"``: ``nnx.Linear(width, width)``.
    - ``"mlp"``: ``width -> width -> width -> 10`` with ReLUs (three
      ``nnx.Linear``).
    - ``"cnn"``: three 3x3 ``nnx.Conv`` (``width``, ``2*width`` with stride 2,
      ``2*width`` with stride 2) with ReLUs on ``[N, H, W, 3]`` images, global
      mean pooling and an ``nnx.Linear`` head with 10 outputs.

    >>> from flax import nnx
    >>> from ensembles.benchmark import build_model
    >>> model = build_model("mlp", width=8, rngs=nnx.Rngs(0))
    >>> [layer.kernel.shape for layer in model.layers[::2]]
    [(8, 8), (8, 8), (8, 10)]

    Args:
      name: one of :data:`MODELS`, or a factory ``rngs -> nnx.Module``.
      width: see above; ``None`` takes :data:`DEFAULT_WIDTHS` ``[name]``.
      rngs: rng keys for the parameters.

    Returns:
      The model (the benchmark's own are ``nnx.Sequential``).

    Raises:
      ValueError: if ``name`` is not one of :data:`MODELS` nor callable.
    """
    if callable(name):
        return name(rngs)
    width = _width(name, width)
    if name == "linear":
        return nnx.Sequential(nnx.Linear(width, width, rngs=rngs))
    if name == "mlp":
        return nnx.Sequential(
            nnx.Linear(width, width, rngs=rngs),
            nnx.relu,
            nnx.Linear(width, width, rngs=rngs),
            nnx.relu,
            nnx.Linear(width, NUM_CLASSES, rngs=rngs),
        )
    return nnx.Sequential(
        nnx.Conv(3, width, (3, 3), rngs=rngs),
        nnx.relu,
        nnx.Conv(width, 2 * width, (3, 3), strides=2, rngs=rngs),
        nnx.relu,
        nnx.Conv(2 * width, 2 * width, (3, 3), strides=2, rngs=rngs),
        nnx.relu,
        _global_mean_pool,
        nnx.Linear(2 * width, NUM_CLASSES, rngs=rngs),
    )


def model_inputs(
    name: str | Callable[[nnx.Rngs], nnx.Module],
    num_samples: int,
    *,
    width: int | None = None,
    image_size: int = DEFAULT_IMAGE_SIZE,
    input_shape: Sequence[int] | None = None,
    seed: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Random inputs and labels (or regression targets) for ``build_model(name, ...)``.

    For a factory, ``input_shape`` is one example's shape; the labels take the
    shape of its outputs but the last axis (classes), read from an abstract
    call of the model (nothing is computed).

    >>> from flax import nnx
    >>> from ensembles.benchmark import model_inputs
    >>> x, labels = model_inputs("cnn", 6, width=4, image_size=8)
    >>> x.shape, labels.shape, str(labels.dtype)
    ((6, 8, 8, 3), (6,), 'int32')
    >>> def tagger(rngs):                      # [N, T, 16] -> [N, T, 5]
    ...     return nnx.Linear(16, 5, rngs=rngs)
    >>> x, labels = model_inputs(tagger, 6, input_shape=(7, 16))
    >>> x.shape, labels.shape
    ((6, 7, 16), (6, 7))
    >>> def regressor(rngs):                   # [N, 16] -> [N, 1]
    ...     return nnx.Linear(16, 1, rngs=rngs)
    >>> x, targets = model_inputs(regressor, 6, input_shape=(16,))
    >>> targets.shape, str(targets.dtype)
    ((6,), 'float32')

    Args:
      name: one of :data:`MODELS`, or a factory ``rngs -> nnx.Module``.
      num_samples: the leading axis, e.g. ``E*B``.
      width: as in :func:`build_model`.
      image_size: height and width of the CNN's images (ignored otherwise).
      input_shape: a factory's example shape (required for one; ignored for
        the benchmark's own models).
      seed: numpy seed of the draw.

    Returns:
      ``(x, labels)``: standard-normal float32 ``x`` and int32 labels in
      ``[0, outputs)``, where ``outputs`` is the model's last dimension; for a
      model with one output (a regressor, whose softmax cross-entropy would
      be identically 0), standard-normal float32 targets instead, which the
      train steps fit by the squared error
      (:func:`~ensembles.benchmark.cost.steps.train_loss`).

    Raises:
      ValueError: if a factory comes without ``input_shape``.
    """
    rng = np.random.default_rng(seed)
    if callable(name):
        if input_shape is None:
            raise ValueError(
                "`input_shape` must give one example's shape for a model factory "
                "(e.g. (32, 32, 3) for images): the benchmark draws its inputs."
            )
        shape = (num_samples, *(int(d) for d in input_shape))
        x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        out = jax.eval_shape(lambda x: name(nnx.Rngs(0))(x), x[:1])
        outputs, label_shape = out.shape[-1], (num_samples, *out.shape[1:-1])
    else:
        width = _width(name, width)
        if name == "cnn":
            shape: tuple[int, ...] = (num_samples, image_size, image_size, 3)
        else:
            shape = (num_samples, width)
        outputs = width if name == "linear" else NUM_CLASSES
        label_shape = (num_samples,)
        x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    if outputs == 1:
        # A softmax over one output is 1 whatever the model computes: its
        # cross-entropy is identically 0, and a train step would have no
        # gradient. Such a model is a regressor: give it targets.
        return x, jnp.asarray(rng.standard_normal(label_shape), jnp.float32)
    return x, jnp.asarray(rng.integers(0, outputs, label_shape), jnp.int32)


def _width(name: str, width: int | None) -> int:
    if name not in MODELS:
        raise ValueError(f"`name` must be one of {list(MODELS)}, got {name!r}.")
    return DEFAULT_WIDTHS[name] if width is None else width
