"""Argument checks shared by ops, layers and helpers.

Every check raises before anything is computed or mutated, names the argument,
shows the offending value and says how to fix it.
"""

from __future__ import annotations

import numbers
import operator
import reprlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _shown(value: Any) -> str:
    """``value`` for an error message: its short repr and, unless None, its type."""
    if value is None:
        return "None"
    return f"{reprlib.repr(value)} of type {type(value).__name__}"


def check_bool(value: Any, name: str, *, optional: bool = False) -> bool | None:
    """Returns ``value`` as a ``bool`` if it is a Python or numpy bool, else raises.

    Any other value (``"no"``, ``1``, ``None``, an array) would be read as its
    truthiness: ``share_weights="no"`` would mean True. With ``optional``,
    ``None`` is accepted too and returned as it is (an option left unset).

    >>> import numpy as np
    >>> from ensembles._checks import check_bool
    >>> check_bool(np.True_, "use_bias")
    True
    >>> check_bool("no", "use_bias")
    Traceback (most recent call last):
      ...
    TypeError: `use_bias` must be a bool (True or False), got 'no' of type str: any other value would be read as its truthiness.
    """  # noqa: E501
    if optional and value is None:
        return None
    if not isinstance(value, bool | np.bool_):
        allowed = "True, False or None" if optional else "True or False"
        raise TypeError(
            f"`{name}` must be a bool ({allowed}), got {_shown(value)}: any other "
            f"value would be read as its truthiness."
        )
    return bool(value)


def check_initializer(value: Any, name: str) -> Any:
    """Checks that ``value`` is an initializer: a callable ``(key, shape, dtype)``.

    Called where a layer (or a conversion) receives it, before anything is
    drawn, so that ``r_init=1.0`` names ``r_init`` instead of failing inside
    with "'float' object is not callable".
    """
    if not callable(value):
        example = _INITIALIZER_EXAMPLES.get(name, "nnx.initializers.zeros_init()")
        raise TypeError(
            f"`{name}` must be an initializer, a function `(key, shape, dtype) -> "
            f"array`, got {_shown(value)}: pass e.g. `{example}`."
        )
    return value


_INITIALIZER_EXAMPLES = {
    "r_init": "ensembles.initializers.ones()",
    "s_init": "ensembles.initializers.ones()",
    "stddev_init": "ensembles.initializers.unconstrained_stddev()",
    "kernel_init": "nnx.initializers.lecun_normal()",
    "bias_init": "nnx.initializers.zeros_init()",
    "scale_init": "nnx.initializers.ones_init()",
}


def check_array(value: Any, name: str, *, what: str = "an array") -> Any:
    """Returns ``value`` unchanged if it is an array of numbers, else raises.

    Accepted: a ``jax.Array`` (tracers included), anything JAX converts itself
    (``__jax_array__``, e.g. an ``nnx.Param``), and whatever numpy reads as an
    array of bools or numbers (numpy arrays and scalars, Python numbers, nested
    lists of them). Refused with a ``TypeError`` naming ``name``: ``None``,
    strings, and anything numpy would hold as objects, where JAX would fail
    later with "None is not a valid value for jnp.array". Nothing is converted:
    see :func:`as_array` for the ``jax.Array``.

    Args:
      value: what the caller passed.
      name: the argument's name, for the error.
      what: what the argument must be, for the error (e.g. "a JAX random key
        (`jax.random.key(0)`)").

    Returns:
      ``value`` itself.

    Raises:
      TypeError: if ``value`` is not an array of numbers.
    """
    if isinstance(value, jax.Array) or hasattr(value, "__jax_array__"):
        return value
    dtype = None
    if value is not None and not isinstance(value, str | bytes):
        try:
            dtype = np.asarray(value).dtype
        except (TypeError, ValueError):
            dtype = None
    if dtype is None or not is_real_or_complex(dtype):
        shown = _shown(value) if dtype is None else f"{_shown(value)} (dtype {dtype})"
        raise TypeError(
            f"`{name}` must be {what}, got {shown}: pass a jax.Array or a numpy "
            f"array of numbers."
        )
    return value


def is_real_or_complex(dtype: Any) -> bool:
    """Whether ``dtype`` holds bools or numbers, JAX's extended floats included.

    numpy's own test (``dtype.kind in "biufc"``) refuses ``bfloat16`` and
    the other ml_dtypes floats, whose kind is ``"V"``: ``np.asarray`` of a
    bf16 jax.Array is such an array.
    """
    dtype = np.dtype(dtype)
    return dtype.kind in "biufc" or jnp.issubdtype(dtype, jnp.number)


def known_values(value: Any) -> np.ndarray | None:
    """``value``'s values on the host, or ``None`` where they are traced.

    A check of known values (a scale must be positive) runs on these, in
    numpy: under :func:`jax.jit` a jnp operation on even a Python float is
    traced, so a check of its result could not tell a known value from an
    unknown one.
    """
    if isinstance(value, jax.core.Tracer):
        return None
    try:
        return np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def as_array(value: Any, name: str, *, what: str = "an array") -> jax.Array:
    """``jnp.asarray(value)`` after :func:`check_array` (the error names ``name``).

    >>> import jax.numpy as jnp
    >>> from ensembles._checks import as_array
    >>> as_array([1.0, 2.0], "logits")
    Array([1., 2.], dtype=float32)
    >>> as_array(None, "logits")
    Traceback (most recent call last):
      ...
    TypeError: `logits` must be an array, got None: pass a jax.Array or a numpy array of numbers.
    """  # noqa: E501
    value = check_array(value, name, what=what)
    _check_fits_32_bits(value, name)
    return jnp.asarray(value)


def _check_fits_32_bits(value: Any, name: str) -> None:
    """Raises for host integers that JAX would wrap to 32 bits without x64.

    ``jnp.asarray`` of a numpy ``int64`` array holds it as int32 without
    ``jax_enable_x64``, and 3,000,000,000 becomes -1,294,967,296 without a
    word. Values that fit pass (token ids, labels); others are refused with
    the fixes. Real targets take :func:`as_real_array`, which holds them as
    floats instead.
    """
    if jax.config.jax_enable_x64 or isinstance(value, jax.Array):
        return
    if hasattr(value, "__jax_array__") or isinstance(value, bool | float | complex):
        return
    host = np.asarray(value)
    if host.dtype.kind not in "iu" or host.dtype.itemsize <= 4 or not host.size:
        return
    info = np.iinfo(np.int32 if host.dtype.kind == "i" else np.uint32)
    outside = (host < info.min) | (host > info.max)
    if outside.any():
        index = np.unravel_index(int(np.argmax(outside)), host.shape)
        raise ValueError(
            f"`{name}` holds {host.dtype} integers beyond {info.dtype.name} "
            f"({name}[{', '.join(map(str, index))}] = {host[index]}), which JAX "
            f"holds in 32 bits without jax_enable_x64 and would wrap around: "
            f"pass them as floats (`{name}.astype(np.float64)`; the targets of "
            f"a regression), or enable x64 (`jax.config.update('jax_enable_x64', "
            f"True)`)."
        )


def as_real_array(value: Any, name: str, *, what: str = "an array") -> jax.Array:
    """:func:`as_array` for real values that must not wrap: targets, values.

    Without ``jax_enable_x64`` JAX holds integers in 32 bits, and
    ``jnp.asarray`` of a numpy ``int64`` array wraps what lies beyond
    ``2**31`` (3,000,000,000 becomes -1,294,967,296) without a word. A host
    integer array of more than 32 bits is converted to float64 on the host
    first, and JAX then holds it in its float dtype (float32 without x64): the
    nearest value it can hold, never a wrapped one.

    >>> import numpy as np
    >>> from ensembles._checks import as_real_array
    >>> as_real_array(np.array([3_000_000_000, 5], np.int64), "targets")
    Array([3.e+09, 5.e+00], dtype=float32)
    """
    value = check_array(value, name, what=what)
    if not isinstance(value, jax.Array) and not hasattr(value, "__jax_array__"):
        host = np.asarray(value)
        wide = host.dtype.kind in "iu" and host.dtype.itemsize > 4
        if wide and not jax.config.jax_enable_x64:
            value = host.astype(np.float64)
    return jnp.asarray(value)


def as_operands(
    inputs: Any, kernel: Any, r: Any, s: Any, bias: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """A BatchEnsemble op's arrays, each through :func:`as_array` (bias: or None)."""
    return (
        as_array(inputs, "inputs"),
        as_array(kernel, "kernel"),
        as_array(r, "r"),
        as_array(s, "s"),
        None if bias is None else as_array(bias, "bias"),
    )


def check_positive_int(value: Any, name: str) -> int:
    """Returns ``value`` as an ``int`` if it is an integer >= 1, else raises."""
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be an int >= 1, got the bool {value!r}.")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise TypeError(
            f"`{name}` must be an int >= 1, got {value!r} of type "
            f"{type(value).__name__}."
        ) from None
    if as_int < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {as_int}.")
    return as_int


def check_real(value: Any, name: str) -> float:
    """Returns ``value`` as a ``float`` if it is a real scalar, else raises.

    A real scalar is what Flax accepts where it asks for a float: a Python
    ``int`` or ``float``, a numpy scalar (``np.float32(0.1)``) or a 0-d numpy or
    JAX array of a real dtype; not a bool, a complex number or a string. The
    range is the caller's to check.
    """
    dtype = getattr(value, "dtype", None)
    is_bool = isinstance(value, bool) or (
        dtype is not None and np.dtype(dtype) == np.bool_
    )
    real_array = (
        dtype is not None
        and getattr(value, "shape", None) == ()
        and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
    )
    if is_bool or not (isinstance(value, numbers.Real) or real_array):
        raise TypeError(
            f"`{name}` must be a real number (a Python, numpy or 0-d JAX float or "
            f"int), got {value!r} of type {type(value).__name__}."
        )
    try:
        return float(value)
    except jax.errors.ConcretizationTypeError:
        raise TypeError(
            f"`{name}` must be a concrete number, got a traced value {value!r}: "
            f"pass it as a Python float, outside `jax.jit`."
        ) from None


def check_num_members(num_members: Any) -> int:
    """Checks the ensemble size ``num_members`` (E)."""
    return check_positive_int(num_members, "num_members")


def check_member_batch(
    leading: int, num_members: int, name: str = "inputs.shape[0]"
) -> int:
    """Returns the per-member batch B of a member-major ``[E*B, ...]`` axis."""
    if leading % num_members:
        raise ValueError(
            f"`{name}` (={leading}) must be a multiple of `num_members` "
            f"(={num_members}): rows [k*B, (k+1)*B) belong to member k. Tile an "
            f"un-tiled batch with `ensembles.tile(x, {num_members})`."
        )
    return leading // num_members


def add_batch_axis_fix(num_members: int) -> str:
    """How to give ``inputs`` the batch axis they lack: tiled for E > 1 only.

    With one member (a member view, ``nnx.view(layer, member=k)``) the batch
    is the member's own and needs no tiling.
    """
    if num_members == 1:
        return "Add a batch axis, e.g. `inputs[None]`."
    return (
        f"Add a batch axis, e.g. `inputs[None]`, and tile it with "
        f"`ensembles.tile(inputs, {num_members})`."
    )


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    """Checks that ``value`` is one of the strings in ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")
    return value


def check_member_shapes(
    leading: int,
    r: Any,
    s: Any,
    bias: Any,
    num_members: int,
    in_features: int,
    out_features: int,
) -> int:
    """Checks a dense-like op's member batch, fast weights and bias; returns B.

    ``leading`` is the ``[E*B, ...]`` batch's size; ``r`` must be ``[E, in]``,
    ``s`` and ``bias`` (unless ``None``) ``[E, out]``.
    """
    batch = check_member_batch(leading, num_members)
    check_member_params(
        r,
        s,
        bias,
        r_shape=(num_members, in_features),
        s_shape=(num_members, out_features),
        bias_shape=(num_members, out_features),
    )
    return batch


def check_member_params(
    r: Any,
    s: Any,
    bias: Any,
    *,
    r_shape: tuple[int, ...],
    s_shape: tuple[int, ...],
    bias_shape: tuple[int, ...],
) -> None:
    """Checks the shapes of the fast weights and (unless ``None``) the bias."""
    for name, array, expected in (
        ("r", r, r_shape),
        ("s", s, s_shape),
        ("bias", bias, bias_shape),
    ):
        if array is not None and tuple(array.shape) != tuple(expected):
            raise ValueError(
                f"`{name}` must have shape [num_members, features] = "
                f"{tuple(expected)}, got {tuple(array.shape)}."
            )


def check_labels(labels: Any, num_classes: int, hint: str = "") -> jax.Array:
    """Checks integer class ``labels`` and returns them as a wide signed array.

    Any integer dtype is accepted, signed or unsigned, 8 to 64 bits. The labels
    come back as int32 (int64 for 64-bit labels, which exist only with
    ``jax_enable_x64``), so that comparing them with ``num_classes`` or using
    them as fill values never wraps around in a narrow dtype: ``uint8`` labels
    of a 256-class problem mean what their int32 values mean. When the values
    are known (not under ``jax.jit``) they must lie in ``[0, num_classes)``; they
    are checked on the caller's own array, before JAX could truncate a 64-bit
    value. Under ``jax.jit`` the callers make out-of-range labels give NaN.

    Args:
      labels: integer class indices.
      num_classes: C; valid labels lie in ``[0, C)``.
      hint: appended to the dtype error (how to fix other label formats).

    Returns:
      ``labels`` as an int32 (or int64) ``jax.Array`` of the same shape.

    Raises:
      TypeError: if ``labels`` are not an array (e.g. ``None``) or not
        integers (bools included).
      ValueError: if a known label lies outside ``[0, num_classes)``.
    """
    labels = check_array(labels, "labels")
    dtype = getattr(labels, "dtype", None)
    dtype = np.dtype(dtype if dtype is not None else np.asarray(labels).dtype)
    if dtype == np.bool_ or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"`labels` must be integer class indices, got dtype {dtype}{hint}."
        )
    try:
        values = np.asarray(labels)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        values = None
    if values is not None:
        # numpy compares every integer dtype with a Python int exactly.
        bad = (values < 0) | (values >= num_classes)
        if bad.any():
            index = np.unravel_index(int(np.argmax(bad)), values.shape)
            shown = index[0] if len(index) == 1 else index
            raise ValueError(
                f"`labels` must lie in [0, C) = [0, {num_classes}), got "
                f"labels[{shown}] = {int(values[index])}."
            )
    wide = jnp.int64 if dtype.itemsize == 8 and jax.config.jax_enable_x64 else jnp.int32
    # Known values are in range, so the cast is exact; traced 64-bit labels
    # exist only with x64 (kept int64); a traced uint32 label >= 2**31 turns
    # negative, out of range, and the callers give NaN for it.
    return jnp.asarray(values if values is not None else labels).astype(wide)


def check_norm_mask(mask: Any, x: Any) -> Any:
    """Checks a norm's ``mask``: boolean, broadcasting to the inputs ``x``."""
    if mask is None:
        return None
    mask = as_array(mask, "mask")
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"`mask` must be a boolean array (True: the entry counts in the "
            f"statistics), got dtype {mask.dtype}: pass `mask.astype(bool)`."
        )
    shape = tuple(jnp.shape(x))
    try:
        broadcast = jnp.broadcast_shapes(tuple(mask.shape), shape)
    except ValueError:
        broadcast = None
    if broadcast != shape:
        raise ValueError(
            f"`mask` must broadcast to the shape of `x` {shape}, got shape "
            f"{tuple(mask.shape)}: give it one entry per input entry (or size-1 "
            f"axes to broadcast)."
        )
    return mask
