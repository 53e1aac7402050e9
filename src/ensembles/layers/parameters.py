"""Drawing, copying and slicing a layer's parameters: plain functions.

A layer's constructor draws each parameter in plain sight::

    with drawing_from(rngs) as draw:
        self.kernel = new_param(nnx.Param, kernel_init, draw, shape, dtype,
                                kernel_metadata, "kernel_init")

:func:`drawing_from` lets a constructor that fails halfway (an initializer
returning the wrong shape, say) leave the caller's ``rngs`` as they were;
:func:`new_param` checks the shape an initializer made. ``from_*``
classmethods pass the pretrained values as initializers (:func:`copy_of`,
:func:`member_copies`), and ``extract_member`` slices one member back out
(:func:`member_slice`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.typing import Dtype, Initializer

from ensembles import initializers as fast_initializers
from ensembles._checks import check_initializer
from ensembles.layers.sharding import (
    SHARDING_KEYS,
    member_axis_metadata,
    without_member_axis_metadata,
)

__all__ = [
    "check_norm_initializers",
    "check_rngs",
    "check_weight_initializers",
    "copy_of",
    "default_bias_init",
    "default_fast_weight_init",
    "default_input_r_init",
    "default_kernel_init",
    "drawing_from",
    "flat_copy_of",
    "flat_initializer",
    "member_copies",
    "member_slice",
    "new_param",
    "norm_param",
    "shape_checked",
]

#: The defaults of every BatchEnsemble weight layer: Flax's for the kernel and
#: bias, N(1, 0.5) for the fast weights; ``to_batch_ensemble`` draws the
#: input layer's ``r`` as random signs (:data:`default_input_r_init`). Chosen
#: across three tasks (MNIST-1D, digits, tabular), each method recalibrated on
#: a validation split, by mean rank of the recalibrated NLL in distribution
#: and under shift with each task judged on a choice made on the others, and
#: no more underconfident as trained than a deep ensemble
#: (benchmarks/diversity_study.py, docs/training.md).
default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()
default_fast_weight_init = fast_initializers.normal(1.0, 0.5)
default_input_r_init = fast_initializers.random_sign()


def check_rngs(rngs: Any, name: str = "rngs") -> nnx.Rngs:
    """Checks that ``rngs`` is an ``nnx.Rngs`` (what ``rngs.params()`` needs)."""
    if not isinstance(rngs, nnx.Rngs):
        hint = (
            "wrap it: `nnx.Rngs(params=key)`"
            if hasattr(rngs, "dtype")
            else "e.g. `nnx.Rngs(0)`"
        )
        raise TypeError(
            f"`{name}` must be an `nnx.Rngs`, got {rngs!r} of type "
            f"{type(rngs).__name__}: {hint}."
        )
    return rngs


def check_weight_initializers(
    *,
    kernel_init: Any,
    bias_init: Any,
    r_init: Any,
    s_init: Any,
    stddev_init: Any,
    use_bias: bool,
    posterior: str | None,
) -> None:
    """Checks the initializers a weight layer will call, before it draws anything.

    ``bias_init`` is called only with a bias and ``stddev_init`` only with a
    posterior (``from_*`` passes ``bias_init=None`` for a layer without a
    bias, as Flax allows); the others always.

    Raises:
      TypeError: naming the first initializer that is not callable.
    """
    check_initializer(kernel_init, "kernel_init")
    if use_bias:
        check_initializer(bias_init, "bias_init")
    check_initializer(r_init, "r_init")
    check_initializer(s_init, "s_init")
    if posterior is not None:
        check_initializer(stddev_init, "stddev_init")


@contextlib.contextmanager
def drawing_from(rngs: Any) -> Iterator[nnx.Rngs]:
    """Yields a copy of ``rngs`` to draw from; ``rngs`` catches up on success.

    A constructor that fails halfway has then drawn nothing from the caller's
    ``rngs``: its stream counts stay as they were, so a retry draws the same
    keys as a first try would.
    """
    rngs = check_rngs(rngs)
    draw = nnx.clone(rngs)
    yield draw
    nnx.update(rngs, nnx.state(draw))


def new_param(
    variable_type: type[nnx.Variable],
    initializer: Callable[..., jax.Array],
    rngs: nnx.Rngs,
    shape: Sequence[int],
    dtype: Any,
    metadata: Mapping[str, Any],
    name: str,
) -> nnx.Variable:
    """A new ``variable_type`` from ``initializer(rngs.params(), shape, dtype)``.

    Args:
      variable_type: e.g. ``nnx.Param`` or ``ensembles.FastWeight``.
      initializer: the layer's ``<name>`` argument.
      rngs: what to draw the key from (see :func:`drawing_from`).
      shape: the shape the layer needs.
      dtype: the parameter dtype.
      metadata: the variable's metadata (e.g. sharding names).
      name: the initializer's argument name, for the error.

    Returns:
      The new variable.

    Raises:
      ValueError: if the initializer made another shape.
    """
    value = shape_checked(initializer, name)(rngs.params(), tuple(shape), dtype)
    return variable_type(value, **metadata)


def shape_checked(
    initializer: Callable[..., jax.Array], name: str
) -> Callable[..., jax.Array]:
    """``initializer``, refusing by ``name`` an array of a shape it was not asked for.

    >>> import jax, jax.numpy as jnp
    >>> init = shape_checked(lambda key, shape, dtype: jnp.ones(3), "r_init")
    >>> init(jax.random.key(0), (2, 3), jnp.float32)
    Traceback (most recent call last):
    ValueError: `r_init` returned an array of shape (3,), but the layer needs shape...

    Args:
      initializer: called as ``initializer(key, shape, dtype)``.
      name: the argument that passed it, for the error.

    Returns:
      An initializer that raises a ``ValueError`` naming ``name`` where
      ``initializer`` made another shape than asked for (an array that a
      later ``.at[...].set`` or broadcast would take silently).
    """

    def init(key: jax.Array, shape: Sequence[int], dtype: Any) -> jax.Array:
        value = initializer(key, shape, dtype)
        if tuple(jnp.shape(value)) != tuple(shape):
            raise ValueError(
                f"`{name}` returned an array of shape {tuple(jnp.shape(value))}, "
                f"but the layer needs shape {tuple(shape)}: pass an initializer "
                f"that honours its `shape` argument."
            )
        return value

    return init


def copy_of(variable: nnx.Variable) -> Callable[..., jax.Array]:
    """An initializer returning ``variable``'s value as it is (never reshaped).

    What ``from_*`` passes as ``kernel_init`` to keep a pretrained kernel: one
    that no longer has its layer's shape is refused by :func:`new_param`'s
    shape check rather than silently reshaped.
    """
    value = variable[...]

    def init(key: jax.Array, shape: Sequence[int], dtype: Any) -> jax.Array:
        del key, shape, dtype
        return value

    return init


def member_copies(
    variable: nnx.Variable | None,
) -> tuple[Callable[..., jax.Array] | None, dict[str, Any]]:
    """Initializer and metadata giving every member a copy of a pretrained Variable.

    What ``from_*`` uses to broadcast a pretrained bias (or norm scale) to
    ``[E, ...]``: the initializer broadcasts the value (reshaped to the
    per-member shape, which may be flattened) and the metadata gains a member
    axis (:func:`~ensembles.layers.sharding.member_axis_metadata`). ``None``
    gives ``(None, {})``.
    """
    if variable is None:
        return None, {}
    value = variable[...]

    def init(key: jax.Array, shape: Sequence[int], dtype: Any) -> jax.Array:
        del key, dtype
        return jnp.broadcast_to(jnp.reshape(value, tuple(shape)[1:]), tuple(shape))

    return init, member_axis_metadata(variable.get_metadata())


def variable_copy(
    variable_type: type[nnx.Variable], value: jax.Array, metadata: Mapping[str, Any]
) -> nnx.Variable:
    """``variable_type(value, **metadata)``, outside a mesh too.

    Flax places a Variable annotated for sharding on the mesh in context as
    it creates it (``eager_sharding``), and refuses where there is none: a
    member extracted outside a mesh from a model converted with
    ``member_axis=`` (fresh or restored) failed so. There the Variable is
    created unplaced, with its metadata as given (the structure of the
    Variable it copies), and is placed when the user places it.
    """
    annotated = any(metadata.get(key) for key in SHARDING_KEYS)
    placed = metadata.get("eager_sharding", nnx.using_eager_sharding())
    if not (annotated and placed and jax.sharding.get_abstract_mesh().empty):
        return variable_type(value, **metadata)
    variable = variable_type(value, **{**metadata, "eager_sharding": False})
    if "eager_sharding" in metadata:
        variable.set_metadata(eager_sharding=metadata["eager_sharding"])
    return variable


def member_slice(variable: nnx.Variable | None, member: int) -> nnx.Variable | None:
    """Member ``member``'s slice of an ``[E, ...]`` variable, of the same type."""
    if variable is None:
        return None
    metadata = without_member_axis_metadata(variable.get_metadata())
    return variable_copy(type(variable), variable[member], metadata)


def flat_initializer(
    initializer: Callable[..., jax.Array], num_rows: int, name: str
) -> Callable[..., jax.Array]:
    """Calls ``initializer`` with a 2-D shape and reshapes, as Flax does.

    ``nnx.LinearGeneral`` initializes its kernel as a 2-D
    ``[prod(batch) * prod(in), prod(out)]`` matrix (so fan-in and fan-out are
    those of the flattened contraction) and its bias flat; so do we: the first
    ``num_rows`` axes of the shape asked for become the first flat axis.
    """
    check_initializer(initializer, name)

    checked = shape_checked(initializer, name)

    def init(key, shape, dtype):
        flat_shape = (math.prod(shape[:num_rows]), math.prod(shape[num_rows:]))
        return jnp.reshape(checked(key, flat_shape, dtype), shape)

    return init


def flat_copy_of(variable: nnx.Variable) -> Callable[..., jax.Array]:
    """An initializer returning ``variable``'s value in the (flat) shape asked."""
    value = variable[...]

    def init(key: jax.Array, shape: Sequence[int], dtype: Any) -> jax.Array:
        del key, dtype
        return jnp.reshape(value, tuple(shape))

    return init


def check_norm_initializers(
    use_scale: bool, scale_init: Any, use_bias: bool, bias_init: Any
) -> None:
    """Checks the initializers a norm will call, before it draws anything.

    ``from_*`` passes ``None`` for a parameter the pretrained norm lacks, as
    Flax allows an unused initializer to be anything.
    """
    if use_scale:
        check_initializer(scale_init, "scale_init")
    if use_bias:
        check_initializer(bias_init, "bias_init")


def norm_param(
    used: bool,
    init: Initializer,
    rngs: nnx.Rngs,
    shape: tuple[int, int],
    dtype: Dtype,
    metadata: Mapping[str, Any],
    name: str,
) -> nnx.Param | None:
    """A norm's ``[E, features]`` ``name`` (:func:`new_param`) or ``nnx.data(None)``."""
    if not used:
        return nnx.data(None)
    return new_param(nnx.Param, init, rngs, shape, dtype, metadata, f"{name}_init")
