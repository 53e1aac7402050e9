"""The BatchEnsemble einsum op: ``nnx.Einsum``'s contraction per member.

An ``einsum_str`` ``"<input>,<kernel>-><output>"`` names every axis by a
letter. The input's first axis carries the members (a member-major ``[E*B,
...]`` batch), so its letter must not be in the kernel and must be in the
output, where member ``k`` owns the slice ``[k*B, (k+1)*B)`` along it. The
kernel's axes fall in two groups: the *contracted* ones (letters absent from the
output) and the *kept* ones (letters in the output, batch letters shared with
the input included). Member ``k``'s effective kernel is::

    kernel * r[k] (over the contracted axes) * s[k] (over the kept axes)

the rank-one ``W * outer(r_k, s_k)`` of the kernel read as a ``[contracted,
kept]`` matrix. ``r`` is ``[E, *contracted dims]``, ``s`` is ``[E, *kept dims]``,
both in kernel order; the bias is ``[E, *bias_shape]``, each member's added as
``nnx.Einsum`` adds its bias.

Without batch letters the op moves the axes into ``[rows, contracted] x
[contracted, kept]`` and calls :func:`ensembles.ops.batch_ensemble_dense` (so
it runs whatever kernel ``impl`` selects, with its derivative). With batch
letters there is no single shared matmul, and the op runs its ``jnp``
formulation: the input scaled by ``r``, one ``jnp.einsum`` with a member
letter, then ``s`` and the bias.
"""

from __future__ import annotations

import math
import string
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ensembles._checks import (
    as_operands,
    check_choice,
    check_member_batch,
    check_num_members,
)
from ensembles.ops import dense
from ensembles.ops.impls import IMPLS

__all__ = [
    "Subscripts",
    "batch_ensemble_einsum",
    "effective_kernel",
    "fast_weight_shapes",
    "kept_axes",
    "parse",
]


class Subscripts(NamedTuple):
    """An ``einsum_str`` read for a member-major input (see :func:`parse`)."""

    #: The input's letters, one per axis (the first is the member axis);
    #: ``"..."`` is kept where :func:`parse` had no input rank.
    inputs: str
    #: The kernel's letters.
    kernel: str
    #: The output's letters.
    output: str
    #: The kernel's letters absent from the output (``r``'s axes), kernel order.
    contracted: str
    #: The kernel's letters in the output (``s``'s axes), kernel order.
    kept: str

    @property
    def batch(self) -> str:
        """Kernel letters that are also in the input and the output."""
        return "".join(c for c in self.kept if c in self.inputs)


def _fail(einsum_str: str, why: str) -> ValueError:
    return ValueError(f"`einsum_str` {einsum_str!r} {why}")


def parse(einsum_str: Any, input_ndim: int | None = None) -> Subscripts:
    """Reads ``einsum_str`` as the BatchEnsemble op does, checking it.

    With ``input_ndim`` an ellipsis ``...`` in the input (and output) is
    replaced by letters for the axes it stands for; without, it is kept.

    >>> parse("BTD,NDH->BTNH")
    Subscripts(inputs='BTD', kernel='NDH', output='BTNH', contracted='D', kept='NH')
    >>> parse("...d,df->...f", input_ndim=3).inputs
    'abd'

    Args:
      einsum_str: ``"<input>,<kernel>-><output>"``; spaces are ignored.
      input_ndim: the rank of the inputs, if known.

    Returns:
      The :class:`Subscripts`.

    Raises:
      TypeError: if ``einsum_str`` is not a string.
      ValueError: if ``einsum_str`` is not an explicit two-operand equation,
        repeats a letter within an operand, has a kernel letter in neither the
        input nor the output, puts the member axis (the input's first) in the
        kernel or leaves it out of the output, or does not fit ``input_ndim``.
    """
    if not isinstance(einsum_str, str):
        raise TypeError(
            f"`einsum_str` must be a string such as 'BTD,DF->BTF', got "
            f"{einsum_str!r} of type {type(einsum_str).__name__}."
        )
    equation = einsum_str.replace(" ", "")
    if equation.count("->") != 1 or equation.count(",") != 1:
        raise _fail(
            einsum_str,
            "must be explicit with exactly two operands, "
            "'<input>,<kernel>-><output>', as for `nnx.Einsum`.",
        )
    lhs, output = equation.split("->")
    inputs, kernel = lhs.split(",")
    if "." in kernel:
        raise _fail(einsum_str, "has '...' in the kernel: name its axes.")
    for name, letters in (("input", inputs), ("output", output)):
        if letters.replace("...", "").count(".") or letters.count("...") > 1:
            raise _fail(einsum_str, f"has a malformed ellipsis in the {name}.")
    if ("..." in inputs) != ("..." in output):
        raise _fail(
            einsum_str,
            "must have '...' in both the input and the output or in neither.",
        )
    if input_ndim is not None and "..." in inputs:
        unused = [c for c in string.ascii_letters if c not in equation]
        count = input_ndim - (len(inputs) - 3)
        if count < 0:
            raise _fail(einsum_str, f"names more axes than the inputs' {input_ndim}.")
        letters = "".join(unused[:count])
        inputs, output = inputs.replace("...", letters), output.replace("...", letters)
    for name, letters in (("input", inputs), ("kernel", kernel), ("output", output)):
        plain = letters.replace("...", "")
        if not all(c in string.ascii_letters for c in plain):
            raise _fail(
                einsum_str, f"has a character other than a letter in the {name}."
            )
        if len(set(plain)) != len(plain):
            raise _fail(
                einsum_str,
                f"repeats a letter in the {name}: traces and diagonals are not "
                f"supported.",
            )
    stray = [c for c in output.replace("...", "") if c not in inputs + kernel]
    if stray:
        raise _fail(einsum_str, f"has output letters {stray} in neither operand.")
    orphans = [c for c in kernel if c not in inputs and c not in output]
    if orphans:
        raise _fail(
            einsum_str,
            f"has kernel letters {orphans} in neither the input nor the output: "
            f"sum the kernel over them first.",
        )
    if not inputs:
        raise _fail(einsum_str, "has no input axis: axis 0 must carry the members.")
    member = inputs[0]
    if member != "." and (member in kernel or member not in output):
        raise _fail(
            einsum_str,
            f"must keep the input's first axis {member!r} (it carries the "
            f"members: rows [k*B, (k+1)*B) are member k) out of the kernel and "
            f"in the output.",
        )
    if input_ndim is not None and len(inputs) != input_ndim:
        raise _fail(
            einsum_str,
            f"names {len(inputs)} input axes, but the inputs have {input_ndim}.",
        )
    return Subscripts(
        inputs,
        kernel,
        output,
        contracted="".join(c for c in kernel if c not in output),
        kept="".join(c for c in kernel if c in output),
    )


def fast_weight_shapes(
    einsum_str: str, kernel_shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One member's ``r`` and ``s`` shapes: the contracted and the kept dims.

    >>> fast_weight_shapes("BTD,NDH->BTNH", (4, 8, 16))
    ((8,), (4, 16))
    """
    subscripts = parse(einsum_str)
    if len(subscripts.kernel) != len(kernel_shape):
        raise ValueError(
            f"`kernel_shape` {tuple(kernel_shape)} must have one size per kernel "
            f"letter of `einsum_str` {einsum_str!r} ({subscripts.kernel!r})."
        )
    dims = _kernel_dims(subscripts, kernel_shape)
    return (
        tuple(dims[c] for c in subscripts.contracted),
        tuple(dims[c] for c in subscripts.kept),
    )


def kept_axes(einsum_str: str) -> tuple[bool, ...]:
    """Per kernel axis: True where ``s`` spans it (kept), False where ``r`` does.

    >>> kept_axes("BTD,NDH->BTNH")
    (True, False, True)
    """
    subscripts = parse(einsum_str)
    return tuple(c in subscripts.kept for c in subscripts.kernel)


def _kernel_dims(subscripts: Subscripts, shape) -> dict[str, int]:
    """Each kernel letter's size."""
    return dict(zip(subscripts.kernel, shape, strict=True))


def _place(values: jax.Array, letters: str, target: str) -> jax.Array:
    """``[E, *letters]`` values arranged to broadcast against ``[E, *target]``."""
    order = sorted(letters, key=target.index)
    values = jnp.transpose(values, (0, *(1 + letters.index(c) for c in order)))
    dims = dict(zip(order, values.shape[1:], strict=True))
    return values.reshape(values.shape[0], *(dims.get(c, 1) for c in target))


def effective_kernel(
    kernel: jax.Array, r: jax.Array, s: jax.Array, *, einsum_str: str
) -> jax.Array:
    """One member's kernel ``kernel * r * s`` (``r``, ``s``: that member's).

    >>> import jax.numpy as jnp
    >>> effective_kernel(jnp.ones((2, 3)), jnp.array([1.0, 2.0]),
    ...                  jnp.array([1.0, 1.0, 3.0]), einsum_str="bi,io->bo")
    Array([[1., 1., 3.],
           [2., 2., 6.]], dtype=float32)
    """
    subscripts = parse(einsum_str)
    r = _place(r[None], subscripts.contracted, subscripts.kernel)[0]
    s = _place(s[None], subscripts.kept, subscripts.kernel)[0]
    return kernel * (r * s).astype(kernel.dtype)


def _check_shapes(subscripts, inputs, kernel, r, s, bias, num_members) -> None:
    if len(subscripts.kernel) != kernel.ndim:
        raise ValueError(
            f"`kernel` has shape {kernel.shape}, but `einsum_str` names "
            f"{len(subscripts.kernel)} kernel axes ({subscripts.kernel!r})."
        )
    dims = _kernel_dims(subscripts, kernel.shape)
    for c, size in zip(subscripts.inputs, inputs.shape, strict=True):
        if c in dims and dims[c] != size:
            raise ValueError(
                f"`inputs` axis {subscripts.inputs.index(c)} ({c!r}, size {size}) "
                f"must match the kernel's axis {c!r} (size {dims[c]}); got inputs "
                f"of shape {inputs.shape} and a kernel of shape {kernel.shape}."
            )
    check_member_batch(inputs.shape[0], num_members)
    expected = {
        "r": (num_members, *(dims[c] for c in subscripts.contracted)),
        "s": (num_members, *(dims[c] for c in subscripts.kept)),
    }
    for name, array in (("r", r), ("s", s)):
        if tuple(array.shape) != expected[name]:
            raise ValueError(
                f"`{name}` must have shape {expected[name]} ([num_members, "
                f"*{'contracted' if name == 'r' else 'kept'} kernel dims]), got "
                f"{tuple(array.shape)}."
            )
    if bias is not None:
        size = math.prod(dims[c] for c in subscripts.output if c in dims)
        if bias.ndim < 1 or bias.shape[0] != num_members or bias[0].size != size:
            raise ValueError(
                f"`bias` must have shape [num_members, *bias_shape] with "
                f"num_members={num_members} and prod(bias_shape)={size} (the "
                f"kernel's kept dims), got {tuple(bias.shape)}."
            )


def _bias_kept(subscripts: Subscripts, bias: jax.Array, dims) -> jax.Array:
    """``[E, *bias_shape]`` as ``[E, *kept dims]`` in kernel order.

    ``nnx.Einsum`` reshapes its bias to the kernel's sizes of the output's
    kernel letters, in output order (and 1 for the other output letters).
    """
    in_output = "".join(c for c in subscripts.output if c in dims)
    bias = bias.reshape(bias.shape[0], *(dims[c] for c in in_output))
    return jnp.transpose(bias, (0, *(1 + in_output.index(c) for c in subscripts.kept)))


def _via_dense(subscripts, inputs, kernel, r, s, bias, *, num_members, **kwargs):
    """No batch letters: ``[rows, contracted] x [contracted, kept]`` by dense."""
    letters, dims = subscripts.inputs, _kernel_dims(subscripts, kernel.shape)
    summed = tuple(
        i
        for i, c in enumerate(letters)
        if c not in subscripts.output + subscripts.kernel
    )
    if summed:  # input letters in no other operand: einsum sums them out
        inputs = jnp.sum(inputs, axis=summed)
        letters = "".join(c for i, c in enumerate(letters) if i not in summed)
    rows = "".join(c for c in letters if c not in dims)  # rows[0]: the members
    moved = jnp.transpose(
        inputs, [letters.index(c) for c in rows + subscripts.contracted]
    )
    matrix = jnp.transpose(
        kernel,
        [subscripts.kernel.index(c) for c in subscripts.contracted + subscripts.kept],
    )
    in_size = math.prod(dims[c] for c in subscripts.contracted)
    out_size = math.prod(dims[c] for c in subscripts.kept)
    y = dense.dense_rows(
        moved.reshape(-1, in_size),
        matrix.reshape(in_size, out_size),
        r.reshape(num_members, in_size),
        s.reshape(num_members, out_size),
        None
        if bias is None
        else _bias_kept(subscripts, bias, dims).reshape(num_members, out_size),
        **kwargs,
    )
    y = y.reshape(*moved.shape[: len(rows)], *(dims[c] for c in subscripts.kept))
    order = rows + subscripts.kept
    return jnp.transpose(y, [order.index(c) for c in subscripts.output])


def _batched_xla(subscripts, inputs, kernel, r, s, bias, *, num_members, **kwargs):
    """Batch letters: one ``jnp.einsum`` with a member letter, between scalings."""
    used = subscripts.inputs + subscripts.kernel + subscripts.output
    member = next(c for c in string.ascii_letters if c not in used)
    dims = _kernel_dims(subscripts, kernel.shape)
    x = inputs.reshape(num_members, -1, *inputs.shape[1:])  # [E, *inputs]
    x = x * _place(r, subscripts.contracted, subscripts.inputs)
    at = subscripts.output.index(subscripts.inputs[0])
    output = subscripts.output[:at] + member + subscripts.output[at:]
    y = jnp.einsum(
        f"{member}{subscripts.inputs},{subscripts.kernel}->{output}",
        x,
        kernel,
        **kwargs,
    )
    y = jnp.moveaxis(y, at, 0)  # [E, *output]
    y = y * _place(s, subscripts.kept, subscripts.output)
    if bias is not None:
        kept_bias = _bias_kept(subscripts, bias, dims)
        y = y + _place(kept_bias, subscripts.kept, subscripts.output)
    y = jnp.moveaxis(y, 0, at)
    return y.reshape(*y.shape[:at], -1, *y.shape[at + 2 :])


def batch_ensemble_einsum(
    inputs: jax.Array,
    kernel: jax.Array,
    r: jax.Array,
    s: jax.Array,
    bias: jax.Array | None = None,
    *,
    einsum_str: str,
    num_members: int,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    impl: str = "xla",
) -> jax.Array:
    """Applies a BatchEnsemble ``nnx.Einsum`` to a member-major batch.

    Member ``k`` (rows ``[k*B, (k+1)*B)`` of ``inputs``) computes
    ``jnp.einsum(einsum_str, rows, kernel_k) + bias[k]`` as ``nnx.Einsum``
    does, with ``kernel_k = kernel * r[k] * s[k]`` (``r`` over the kernel's
    contracted axes, ``s`` over its kept ones; see :mod:`ensembles.ops.einsum`).
    Per-member kernels are never materialised.

    >>> import jax.numpy as jnp
    >>> from ensembles.ops import batch_ensemble_einsum
    >>> x = jnp.ones((2 * 3, 5, 4))                   # E=2, B=3, 5 tokens, D=4
    >>> kernel = jnp.ones((2, 4, 6))                  # N=2 heads, D=4 -> H=6
    >>> r = jnp.stack([jnp.ones(4), 2 * jnp.ones(4)])  # [E, D]: contracted
    >>> s = jnp.ones((2, 2, 6))                       # [E, N, H]: kept
    >>> y = batch_ensemble_einsum(x, kernel, r, s, einsum_str="BTD,NDH->BTNH",
    ...                           num_members=2)
    >>> y.shape
    (6, 5, 2, 6)
    >>> y[:, 0, 0, 0]
    Array([4., 4., 4., 8., 8., 8.], dtype=float32)

    Args:
      inputs: the member-major ``[E*B, ...]`` batch.
      kernel: the shared kernel, one axis per kernel letter.
      r: ``[E, *contracted dims]`` input fast weights (kernel order).
      s: ``[E, *kept dims]`` output fast weights (kernel order).
      bias: ``[E, *bias_shape]`` per-member bias (``nnx.Einsum``'s
        ``bias_shape``), or ``None``.
      einsum_str: ``"<input>,<kernel>-><output>"`` as for ``nnx.Einsum``; the
        input's first axis carries the members (see :func:`parse`).
      num_members: the ensemble size E.
      precision: precision of the contraction, as for ``jnp.einsum``.
      preferred_element_type: accumulation/output dtype of the contraction.
      impl: the dense op implementation, see
        :func:`ensembles.ops.batch_ensemble_dense`. With batch letters the op
        always runs its ``jnp`` formulation (``impl`` is still checked).

    Returns:
      The outputs, laid out as ``einsum_str``'s output; member ``k`` owns the
      slice ``[k*B, (k+1)*B)`` along the axis of the input's first letter.

    Raises:
      ValueError: if ``einsum_str``, a shape, ``num_members`` or ``impl`` is
        invalid.
      TypeError: if ``einsum_str`` is not a string or ``num_members`` not an
        int.
    """
    num_members = check_num_members(num_members)
    impl = check_choice(impl, "impl", IMPLS)
    inputs, kernel, r, s, bias = as_operands(inputs, kernel, r, s, bias)
    subscripts = parse(einsum_str, inputs.ndim)
    _check_shapes(subscripts, inputs, kernel, r, s, bias, num_members)
    kwargs = {"precision": precision, "preferred_element_type": preferred_element_type}
    if subscripts.batch:
        return _batched_xla(
            subscripts, inputs, kernel, r, s, bias, num_members=num_members, **kwargs
        )
    return _via_dense(
        subscripts,
        inputs,
        kernel,
        r,
        s,
        bias,
        num_members=num_members,
        impl=impl,
        **kwargs,
    )
