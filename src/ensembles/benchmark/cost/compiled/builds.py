"""What a comparison compiles, built abstractly: a forward, a train step.

:func:`model_programs` builds the plain model and its BatchEnsemble with
``nnx.eval_shape`` (nothing is allocated: a chip's compile-only devices can
run nothing) and returns, for each, the function to compile, its arguments'
shapes and dtypes, the arguments it may donate and, on a mesh of several
devices, where each argument lies (:func:`layout_name` says it in words).
:mod:`ensembles.benchmark.cost.compiled.programs` compiles and counts them.

>>> layout_name({"data": 8})
'data=8'
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import ensembles
from ensembles.benchmark.cost.models import build_model, model_inputs
from ensembles.benchmark.cost.steps import merge, optax_module, rest_of, train_loss

__all__ = ["DTYPES", "LEARNING_RATE", "layout_name", "model_programs"]

#: The dtypes a comparison can run in (parameters, inputs and compute alike).
DTYPES: dict[str, jnp.dtype] = {
    "float32": jnp.dtype(jnp.float32),
    "bfloat16": jnp.dtype(jnp.bfloat16),
}

#: AdamW's learning rate in the compiled train step (any value compiles alike).
LEARNING_RATE = 1e-3


def _abstract(model: Any, dtype: jnp.dtype) -> tuple[Any, Any, Any]:
    """``model`` split into graph, parameters and rest, as specs in ``dtype``."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def spec(leaf):
        leaf_dtype = leaf.dtype
        if jnp.issubdtype(leaf_dtype, jnp.floating):
            leaf_dtype = dtype
        return jax.ShapeDtypeStruct(leaf.shape, leaf_dtype)

    return graphdef, jax.tree.map(spec, params), jax.tree.map(spec, rest)


def _forward(graphdef):
    """The forward of a split model: ``(params, rest, x) -> outputs``."""

    def forward(params, rest, x):
        return merge(graphdef, params, rest)(x)

    return forward


def _train_step(graphdef, labels):
    """An AdamW step of a split model, and the optax transformation.

    ``(params, opt_state, rest, x, y) -> (params, opt_state, rest, loss)``;
    the loss is :func:`~ensembles.benchmark.cost.steps.train_loss`'s for ``labels``,
    of the outputs in float32.
    """
    _, loss_of = train_loss(labels)
    optax = optax_module()
    tx = optax.adamw(LEARNING_RATE)

    def loss_fn(params, rest, x, y):
        model = merge(graphdef, params, rest)
        loss = loss_of(model(x).astype(jnp.float32), y)
        return loss, rest_of(model)

    def train(params, opt_state, rest, x, y):
        (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, rest, x, y
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, rest, loss

    return train, tx


def layout_name(
    mesh: Mapping[str, int] | None = None, member_axis: str | None = None
) -> str:
    """How a comparison's programs are laid out, in words.

    >>> layout_name(), layout_name({"data": 8})
    ('one device', 'data=8')
    >>> layout_name({"data": 2, "model": 4}, "model")
    'data=2,model=4 members:model'
    """
    if not mesh:
        return "one device"
    name = ",".join(f"{axis}={size}" for axis, size in mesh.items())
    return name if member_axis is None else f"{name} members:{member_axis}"


def _row_partition(mesh, member_axis):
    """The rows' placement: over every mesh axis, the members' axis first."""
    axes = list(mesh)
    if member_axis is not None:
        axes.remove(member_axis)
        axes.insert(0, member_axis)
    return P(tuple(axes))


def _opt_partitions(tx, opt_state, params, partitions):
    """Where each entry of the optimizer's state lies: as its parameter does."""
    optax = optax_module()
    return optax.tree_utils.tree_map_params(
        tx,
        lambda _, partition: partition,
        opt_state,
        partitions,
        transform_non_params=lambda _: P(),
        is_leaf=lambda leaf: isinstance(leaf, P),
    )


def model_programs(
    model: str | Callable[[nnx.Rngs], nnx.Module],
    mode: str,
    *,
    num_members: int,
    batch: int,
    dtype: str = "float32",
    width: int | None = None,
    image_size: int = 32,
    input_shape: Sequence[int] | None = None,
    impl: str = "xla",
    norms: str = "shared",
    mesh: Mapping[str, int] | None = None,
    member_axis: str | None = None,
) -> dict[str, tuple[Callable[..., Any], list[Any], tuple[int, ...], list[Any]]]:
    """The plain and the BatchEnsemble program of a model, built abstractly.

    Args:
      model: one of :data:`~ensembles.benchmark.MODELS` or a factory ``rngs ->
        nnx.Module`` (with ``input_shape``).
      mode: ``"forward"`` or ``"train"`` (softmax cross-entropy, or the
        squared error for one output, and an ``optax.adamw`` update).
      num_members: E.
      batch: B, rows per member; both programs see ``E*B`` rows.
      dtype: a key of :data:`DTYPES`: parameters, inputs and compute.
      width: as for :func:`~ensembles.benchmark.build_model`.
      image_size: the CNN's image height and width.
      input_shape: a factory's example shape.
      impl: the BatchEnsemble layers' ``impl``.
      norms: how the conversion treats the model's norms, as
        :func:`ensembles.to_batch_ensemble`'s ``norms``.
      mesh: the devices' mesh axes (``{"data": 8}``); ``None``: one device.
        Both programs get their rows split over every axis (the members'
        axis first) and their parameters as their metadata places them
        (replicated, unless the model annotates them), the optimizer's
        state as its parameters.
      member_axis: with ``mesh``, the axis the BatchEnsemble's per-member
        arrays are split over (:func:`ensembles.to_batch_ensemble`'s
        ``member_axis``); ``None``: replicated.

    Returns:
      ``{"single": (fn, specs, donate_argnums, partitions), "batchensemble":
      (...)}``; ``partitions`` is ``None`` for one device.
    """
    if mode not in ("forward", "train"):
        raise ValueError(f"`mode` must be 'forward' or 'train', got {mode!r}.")
    if dtype not in DTYPES:
        raise ValueError(f"`dtype` must be one of {list(DTYPES)}, got {dtype!r}.")
    if member_axis is not None and (not mesh or member_axis not in mesh):
        raise ValueError(
            f"`member_axis` must be an axis of `mesh`, got {member_axis!r} with "
            f"mesh {mesh!r}."
        )
    x, labels = model_inputs(
        model,
        num_members * batch,
        width=width,
        image_size=image_size,
        input_shape=input_shape,
    )
    x_spec = jax.ShapeDtypeStruct(x.shape, DTYPES[dtype])
    y_spec = jax.ShapeDtypeStruct(labels.shape, labels.dtype)

    def plain():
        return build_model(model, width=width, rngs=nnx.Rngs(0))

    def converted():
        ensemble = ensembles.to_batch_ensemble(
            plain(),
            num_members=num_members,
            rngs=nnx.Rngs(1),
            norms=norms,
            member_axis=member_axis,
        )
        return nnx.view(ensemble, impl=impl)

    abstract_mesh = (
        contextlib.nullcontext()
        if not mesh
        else jax.sharding.use_abstract_mesh(
            AbstractMesh(tuple(mesh.values()), tuple(mesh))
        )
    )
    rows = None if not mesh else _row_partition(mesh, member_axis)
    programs = {}
    for method, build in (("single", plain), ("batchensemble", converted)):
        with abstract_mesh:
            abstract_model = nnx.eval_shape(build)
        graphdef, params, rest = _abstract(abstract_model, DTYPES[dtype])
        params_at = (
            None
            if not mesh
            else nnx.get_partition_spec(nnx.state(abstract_model, nnx.Param))
        )
        if mode == "forward":
            partitions = None if not mesh else [params_at, None, rows]
            programs[method] = (
                _forward(graphdef),
                [params, rest, x_spec],
                (),
                partitions,
            )
        else:
            train, tx = _train_step(graphdef, labels)
            opt_state = jax.eval_shape(tx.init, params)
            specs = [params, opt_state, rest, x_spec, y_spec]
            partitions = (
                None
                if not mesh
                else [
                    params_at,
                    _opt_partitions(tx, opt_state, params, params_at),
                    None,
                    rows,
                    rows,
                ]
            )
            programs[method] = (train, specs, (0, 1, 2), partitions)
    return programs
