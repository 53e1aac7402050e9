"""The BatchEnsemble dense op: validation, implementation dispatch, jnp formulation.

Member ``k`` of the op maps its rows ``[k*B, (k+1)*B)`` of the member-major batch
as if its kernel were ``kernel * outer(r[k], s[k])``. That is computed without
ever forming per-member kernels::

    y = ((x * r[k]) @ kernel) * s[k] + bias[k]

The ``"xla"`` implementation below is that formula in ``jnp`` with one 2-D
matmul (see ``shared/notes/pallas.md``: the 2-D form is what XLA's CPU backend
compiles best, forward and backward). It is also the reference the tests compare
every other implementation against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ensembles._checks import check_choice, check_member_batch, check_num_members

__all__ = ["IMPLS", "batch_ensemble_dense", "check_impl", "resolve_impl"]

#: The implementations ``batch_ensemble_dense`` accepts as ``impl``.
IMPLS: tuple[str, ...] = ("auto", "xla")


def check_impl(impl: str) -> str:
    """Checks that ``impl`` names an implementation of the dense op.

    Args:
      impl: one of :data:`IMPLS`.

    Returns:
      ``impl`` unchanged.

    Raises:
      ValueError: if ``impl`` is not one of :data:`IMPLS`.

    >>> check_impl("xla")
    'xla'
    """
    return check_choice(impl, "impl", IMPLS)


def resolve_impl(impl: str) -> str:
    """Resolves ``"auto"`` to the concrete implementation used on this backend.

    ``"auto"`` is ``"xla"`` everywhere for now: the fused Pallas kernel for
    GPU/TPU is not part of the package yet.

    Args:
      impl: one of :data:`IMPLS`.

    Returns:
      The concrete implementation name.

    >>> resolve_impl("auto")
    'xla'
    """
    check_impl(impl)
    return "xla" if impl == "auto" else impl


def _check_dense_shapes(inputs, kernel, r, s, bias, num_members: int) -> None:
    if inputs.ndim < 2:
        raise ValueError(
            f"`inputs` must have shape [E*B, ..., in_features] (at least 2 "
            f"dimensions), got shape {inputs.shape}. Add a batch axis, e.g. "
            f"`inputs[None]`, and tile it with `ensembles.tile`."
        )
    if kernel.ndim != 2:
        raise ValueError(
            f"`kernel` must have shape [in_features, out_features], got shape "
            f"{kernel.shape}."
        )
    in_features, out_features = kernel.shape
    if inputs.shape[-1] != in_features:
        raise ValueError(
            f"`inputs.shape[-1]` (={inputs.shape[-1]}) must equal in_features "
            f"(`kernel.shape[0]`={in_features}); got inputs of shape "
            f"{inputs.shape}."
        )
    check_member_batch(inputs.shape[0], num_members)
    expected = {
        "r": (num_members, in_features),
        "s": (num_members, out_features),
    }
    if bias is not None:
        expected["bias"] = (num_members, out_features)
    for name, array in (("r", r), ("s", s), ("bias", bias)):
        if name in expected and tuple(array.shape) != expected[name]:
            raise ValueError(
                f"`{name}` must have shape [num_members, features] = "
                f"{expected[name]}, got {tuple(array.shape)}."
            )


def _dense_xla(inputs, kernel, r, s, bias, *, precision, preferred_element_type):
    num_members, in_features = r.shape
    out_features = kernel.shape[1]
    # Scale in the [E, rows, in] view, multiply in the flat [E*rows, in] view:
    # XLA fuses the scalings into one loop each and keeps a single 2-D dot,
    # which is measurably cheaper (forward and backward) than a 3-D einsum.
    members = inputs.reshape(num_members, -1, in_features) * r[:, None, :]
    y = lax.dot_general(
        members.reshape(-1, in_features),
        kernel,
        (((1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    y = y.reshape(num_members, -1, out_features) * s[:, None, :]
    if bias is not None:
        y = y + bias[:, None, :]
    return y.reshape(*inputs.shape[:-1], out_features)


_IMPLEMENTATIONS = {"xla": _dense_xla}


def batch_ensemble_dense(
    inputs: jax.Array,
    kernel: jax.Array,
    r: jax.Array,
    s: jax.Array,
    bias: jax.Array | None = None,
    *,
    num_members: int,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Applies a BatchEnsemble dense layer to a member-major batch.

    Rows ``[k*B, (k+1)*B)`` of ``inputs`` belong to member ``k``, whose effective
    kernel is ``kernel * outer(r[k], s[k])`` and whose bias is ``bias[k]``. The
    per-member kernels are never materialised: the op scales the inputs by ``r``,
    runs one shared matmul and scales the result by ``s``.

    The op computes in the dtypes it is given (the layers promote their
    parameters and inputs first, as Flax does).

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import batch_ensemble_dense
    >>> x = jnp.ones((2 * 3, 4))                    # E=2 members, B=3 rows each
    >>> kernel = jnp.ones((4, 5))
    >>> r = jnp.stack([jnp.ones(4), 2 * jnp.ones(4)])  # [E, in]
    >>> s = jnp.ones((2, 5))                          # [E, out]
    >>> y = batch_ensemble_dense(x, kernel, r, s, num_members=2)
    >>> y.shape
    (6, 5)
    >>> y[:, 0]
    Array([4., 4., 4., 8., 8., 8.], dtype=float32)

    Args:
      inputs: ``[E*B, ..., in_features]`` member-major batch; any number of middle
        axes (e.g. tokens or pixels) is allowed.
      kernel: the shared ``[in_features, out_features]`` kernel.
      r: ``[E, in_features]`` input fast weights.
      s: ``[E, out_features]`` output fast weights.
      bias: ``[E, out_features]`` per-member bias, or ``None``.
      num_members: the ensemble size E.
      precision: matmul precision, as for ``jax.lax.dot_general``.
      preferred_element_type: accumulation/output dtype of the matmul, as for
        ``jax.lax.dot_general``.
      impl: ``"xla"`` (the ``jnp`` formulation) or ``"auto"`` (resolves to the
        best implementation for the backend; ``"xla"`` for now).

    Returns:
      The ``[E*B, ..., out_features]`` outputs.

    Raises:
      ValueError: if a shape, ``num_members`` or ``impl`` is invalid; the message
        names the argument and the fix.
      TypeError: if ``num_members`` is not an int.
    """
    num_members = check_num_members(num_members)
    impl = resolve_impl(impl)
    inputs, kernel, r, s = (jnp.asarray(a) for a in (inputs, kernel, r, s))
    bias = None if bias is None else jnp.asarray(bias)
    _check_dense_shapes(inputs, kernel, r, s, bias, num_members)
    return _IMPLEMENTATIONS[impl](
        inputs,
        kernel,
        r,
        s,
        bias,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
