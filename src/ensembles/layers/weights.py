"""What the five weight layers share: their options' checks, parameters, ``from_*``.

Plain functions of arguments, called in plain sight by each layer's
``__init__`` (whose signature still lists every parameter and option, and
which stores every option itself) and ``from_*``::

    num_members, impl, posterior, prior_stddev, deterministic, rng_collection = (
        check_weight_options(num_members, impl, self._impls, posterior, ...)
    )
    (self.kernel, self.r, self.s, self.bias, self.r_unconstrained_stddev,
     self.s_unconstrained_stddev, self.rngs) = new_weights(rngs, ...)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flax import nnx

from ensembles._checks import check_bool, check_choice, check_num_members
from ensembles.layers.parameters import (
    check_weight_initializers,
    copy_of,
    drawing_from,
    member_copies,
    new_param,
)
from ensembles.layers.posterior import (
    check_posterior,
    check_prior_stddev,
    check_rng_collection,
)
from ensembles.variables import FastWeight

__all__ = ["check_weight_options", "from_flax_layer", "new_weights"]


def check_weight_options(
    num_members: Any,
    impl: Any,
    impls: tuple[str, ...],
    posterior: Any,
    prior_stddev: Any,
    deterministic: Any,
    rng_collection: Any,
) -> tuple[int, str, str | None, float, bool, str]:
    """Checks the options every weight layer has, once, where they enter.

    Returns:
      ``(num_members, impl, posterior, prior_stddev, deterministic,
      rng_collection)``, checked.

    Raises:
      ValueError, TypeError: naming the first bad option and the fix.
    """
    return (
        check_num_members(num_members),
        check_choice(impl, "impl", impls),
        check_posterior(posterior),
        check_prior_stddev(prior_stddev),
        check_bool(deterministic, "deterministic"),
        check_rng_collection(rng_collection),
    )


def new_weights(
    rngs: nnx.Rngs,
    *,
    kernel_shape: Sequence[int],
    r_shape: Sequence[int],
    s_shape: Sequence[int],
    bias_shape: Sequence[int] | None,
    param_dtype: Any,
    kernel_init: Callable,
    bias_init: Callable,
    r_init: Callable,
    s_init: Callable,
    posterior: str | None,
    stddev_init: Callable,
    rng_collection: str,
    kernel_metadata: Mapping[str, Any],
    bias_metadata: Mapping[str, Any],
    fast_weight_metadata: Mapping[str, Any],
) -> tuple:
    """A weight layer's parameters, drawn in order from ``rngs.params()``.

    The kernel, ``r``, ``s`` and (unless ``bias_shape`` is ``None``) the bias;
    with a ``posterior``, the unconstrained posterior scales of ``r`` and
    ``s`` (``FastWeight`` objects of their shapes) and a fork of
    ``rngs[rng_collection]`` to draw from, as ``nnx.Dropout`` holds one
    (``nnx.data(None)`` each without). Every initializer is checked before
    anything is drawn, and a failure draws nothing from ``rngs``
    (:func:`~ensembles.layers.parameters.drawing_from`).

    Args:
      rngs: the layer's ``rngs``.
      kernel_shape: the shared kernel's shape.
      r_shape: ``[E, ...]``: the fast weights ``r``.
      s_shape: ``[E, ...]``: the fast weights ``s``.
      bias_shape: ``[E, ...]``, or ``None`` for no bias.
      param_dtype: every parameter's dtype.
      kernel_init: the layer's argument of that name, and so on.
      bias_init: called only with a bias.
      r_init: the initializer of ``r``.
      s_init: the initializer of ``s``.
      posterior: ``None``, ``"gaussian"`` or ``"cauchy"`` (checked).
      stddev_init: called only with a posterior.
      rng_collection: the stream the draws come from (checked).
      kernel_metadata: the kernel ``Param``'s metadata.
      bias_metadata: the bias ``Param``'s metadata.
      fast_weight_metadata: the metadata of ``r``, ``s`` and their scales.

    Returns:
      ``(kernel, r, s, bias, r_unconstrained_stddev, s_unconstrained_stddev,
      rngs)``.
    """
    check_weight_initializers(
        kernel_init=kernel_init,
        bias_init=bias_init,
        r_init=r_init,
        s_init=s_init,
        stddev_init=stddev_init,
        use_bias=bias_shape is not None,
        posterior=posterior,
    )
    with drawing_from(rngs) as draw:

        def param(variable_type, init, shape, metadata, name, dtype=param_dtype):
            return new_param(variable_type, init, draw, shape, dtype, metadata, name)

        kernel = param(
            nnx.Param, kernel_init, kernel_shape, kernel_metadata, "kernel_init"
        )
        r = param(FastWeight, r_init, r_shape, fast_weight_metadata, "r_init")
        s = param(FastWeight, s_init, s_shape, fast_weight_metadata, "s_init")
        bias = nnx.data(None)
        if bias_shape is not None:
            bias = param(nnx.Param, bias_init, bias_shape, bias_metadata, "bias_init")
        if posterior is None:
            return kernel, r, s, bias, nnx.data(None), nnx.data(None), nnx.data(None)
        r_stddev, s_stddev = (
            param(FastWeight, stddev_init, w.shape, fast_weight_metadata, "stddev_init")
            for w in (r, s)
        )
        return kernel, r, s, bias, r_stddev, s_stddev, draw[rng_collection].fork()


def from_flax_layer(
    cls: type,
    layer: nnx.Module,
    *args: Any,
    share_kernel: Any,
    kernel_init: Callable[[nnx.Variable], Callable] = copy_of,
    **options: Any,
) -> nnx.Module:
    """``cls(*args, **options)`` holding the pretrained ``layer``'s weights.

    What every ``from_*`` shares once it has checked ``layer``: the kernel kept
    (``kernel_init(layer.kernel)``, a copy; the very same ``Param`` with
    ``share_kernel``), the bias broadcast to every member with a member axis
    in its metadata, and the Flax layer's parameter dtype (the dtype its
    parameters are held in: a model cast after it was built keeps a stale
    ``param_dtype``), ``promote_dtype``, ``preferred_element_type`` and
    metadata. ``options`` are the rest of the constructor's arguments.
    """
    share_kernel = check_bool(share_kernel, "share_kernel")
    bias_init, bias_metadata = member_copies(layer.bias)
    new = cls(
        *args,
        param_dtype=layer.kernel.dtype,
        kernel_init=kernel_init(layer.kernel),
        bias_init=bias_init,
        promote_dtype=layer.promote_dtype,
        preferred_element_type=layer.preferred_element_type,
        kernel_metadata=layer.kernel.get_metadata(),
        bias_metadata=bias_metadata,
        **options,
    )
    if share_kernel:
        new.kernel = layer.kernel
    return new
