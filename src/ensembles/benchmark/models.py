"""The plain Flax models the benchmark compares: a layer, an MLP and a small CNN.

Every model is an ``nnx.Sequential`` of stock Flax layers, so what is measured
is what a user would convert with :func:`ensembles.to_batch_ensemble`.
"""

from __future__ import annotations

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
    name: str,
    *,
    width: int | None = None,
    rngs: nnx.Rngs,
) -> nnx.Sequential:
    """Builds one plain Flax model of the benchmark.

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
      name: one of :data:`MODELS`.
      width: see above; ``None`` takes :data:`DEFAULT_WIDTHS` ``[name]``.
      rngs: rng keys for the parameters.

    Returns:
      The model, an ``nnx.Sequential``.

    Raises:
      ValueError: if ``name`` is not one of :data:`MODELS`.
    """
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
    name: str,
    num_samples: int,
    *,
    width: int | None = None,
    image_size: int = DEFAULT_IMAGE_SIZE,
    seed: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Random inputs and integer class labels for ``build_model(name, ...)``.

    >>> from ensembles.benchmark import model_inputs
    >>> x, labels = model_inputs("cnn", 6, width=4, image_size=8)
    >>> x.shape, labels.shape, str(labels.dtype)
    ((6, 8, 8, 3), (6,), 'int32')

    Args:
      name: one of :data:`MODELS`.
      num_samples: the leading axis, e.g. ``E*B``.
      width: as in :func:`build_model`.
      image_size: height and width of the CNN's images (ignored otherwise).
      seed: numpy seed of the draw.

    Returns:
      ``(x, labels)``: standard-normal float32 ``x`` and labels in
      ``[0, outputs)``, where ``outputs`` is the model's last dimension.
    """
    width = _width(name, width)
    rng = np.random.default_rng(seed)
    if name == "cnn":
        shape: tuple[int, ...] = (num_samples, image_size, image_size, 3)
    else:
        shape = (num_samples, width)
    outputs = width if name == "linear" else NUM_CLASSES
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    labels = jnp.asarray(rng.integers(0, outputs, num_samples), jnp.int32)
    return x, labels


def _width(name: str, width: int | None) -> int:
    if name not in MODELS:
        raise ValueError(f"`name` must be one of {list(MODELS)}, got {name!r}.")
    return DEFAULT_WIDTHS[name] if width is None else width
