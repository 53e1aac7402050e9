"""The convolution ops' validation and effective kernels.

Their numerics are tested through the layers against nnx.Conv / ConvTranspose
(tests/layers/test_conv.py); here the op-level contract: the effective kernel
formula and the errors, which must name the argument and show the value.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ensembles
from ensembles.ops import (
    batch_ensemble_conv,
    batch_ensemble_conv_transpose,
    conv,
    conv_transpose,
    impls,
)
from ensembles.ops.conv import effective_kernel
from tests.reference import conv_effective_kernel
from tests.tolerances import assert_close


def draw(seed, shape, mean=0.0):
    return jnp.asarray(mean + np.random.default_rng(seed).standard_normal(shape))


@pytest.mark.parametrize(
    "groups, transpose_kernel, kernel_shape",
    [
        (1, False, (3, 3, 4, 6)),
        (2, False, (3, 4, 2, 6)),
        (4, False, (2, 1, 8)),  # depthwise, channel multiplier 2
        (1, True, (3, 2, 6, 4)),
    ],
)
def test_effective_kernel_matches_index_by_index_reference(
    groups, transpose_kernel, kernel_shape
):
    kernel = draw(0, kernel_shape)
    r, s = draw(1, (2, 4), 1.0), draw(2, (2, 6 if kernel_shape[-1] == 6 else 8), 1.0)
    if transpose_kernel:
        r, s = draw(1, (2, 4), 1.0), draw(2, (2, 6), 1.0)
    for k in range(2):
        actual = effective_kernel(
            kernel,
            r[k],
            s[k],
            feature_group_count=groups,
            transpose_kernel=transpose_kernel,
        )
        expected = conv_effective_kernel(kernel, r, s, k, groups, transpose_kernel)
        assert_close(actual, expected)


def test_grouped_effective_kernel_by_hand():
    # in=4, G=2, out=4: outputs 0, 1 read inputs 0, 1; outputs 2, 3 read 2, 3.
    kernel = jnp.ones((1, 2, 4))
    r = jnp.array([1.0, 2.0, 3.0, 4.0])
    s = jnp.array([1.0, 10.0, 100.0, 1000.0])
    np.testing.assert_array_equal(
        effective_kernel(kernel, r, s, feature_group_count=2)[0],
        [[1.0, 10.0, 300.0, 3000.0], [2.0, 20.0, 400.0, 4000.0]],
    )


def test_impls_are_decided_in_one_place():
    # One implementation for both convolutions: the jnp formulation ("auto"
    # is gone). Which op has which implementation is written down once, in
    # ops/impls.py: the three tuples that stood in dense.py, conv.py and
    # conv_transpose.py could drift apart.
    assert impls.CONV_IMPLS == ("xla",)
    assert impls.IMPLS == ensembles.ops.IMPLS == ("xla", "pallas")
    source = pathlib.Path(ensembles.__file__).parent
    defined = [
        (path.relative_to(source).as_posix(), line)
        for path in sorted(source.rglob("*.py"))
        for line in path.read_text().splitlines()
        if re.match(r"\s*\w*IMPLS\b[^=]*=(?!=)", line)
    ]
    assert defined == [
        ("ops/impls.py", 'IMPLS: tuple[str, ...] = ("xla", "pallas")'),
        ("ops/impls.py", 'CONV_IMPLS: tuple[str, ...] = ("xla",)'),
    ]
    for op in (conv.batch_ensemble_conv, conv_transpose.batch_ensemble_conv_transpose):
        with pytest.raises(ValueError, match=r"`impl` must be one of \['xla'\]"):
            op(*conv_args()[:4], num_members=2, impl="pallas")


def conv_args(num_members=2, batch=3, in_features=4, out_features=6):
    x = draw(0, (num_members * batch, 5, 5, in_features))
    kernel = draw(1, (3, 3, in_features, out_features))
    r = draw(2, (num_members, in_features), 1.0)
    s = draw(3, (num_members, out_features), 1.0)
    bias = draw(4, (num_members, out_features))
    return x, kernel, r, s, bias


OPS = [
    pytest.param(batch_ensemble_conv, id="conv"),
    pytest.param(batch_ensemble_conv_transpose, id="transpose"),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            {"x": (5, 5, 5, 4)},
            ValueError,
            r"`inputs.shape\[0\]` \(=5\) must be a multiple of `num_members` "
            r"\(=2\).*`ensembles.tile\(x, 2\)`",
        ),
        (
            {"x": (6, 5, 5, 3)},
            ValueError,
            r"`inputs.shape\[-1\]` \(=3\) must equal in_features \(=4",
        ),
        (
            {"x": (5, 5, 4)},
            ValueError,
            r"`inputs` must have shape \[E\*B, \*spatial \(2 dims\), in_features\] "
            r"\(at least 4 dimensions\).*got shape \(5, 5, 4\)",
        ),
        (
            {"kernel": (4, 6)},
            ValueError,
            r"`kernel` must have shape \[\*kernel_size, in, out\].*got shape \(4, 6\)",
        ),
        (
            {"r": (3, 4)},
            ValueError,
            r"`r` must have shape \[num_members, features\] = \(2, 4\), got \(3, 4\)",
        ),
        (
            {"s": (2, 5)},
            ValueError,
            r"`s` must have shape \[num_members, features\] = \(2, 6\), got \(2, 5\)",
        ),
        (
            {"bias": (6,)},
            ValueError,
            r"`bias` must have shape \[num_members, features\] = \(2, 6\), got \(6,\)",
        ),
        (
            {"num_members": 0},
            ValueError,
            r"`num_members` must be an int >= 1, got 0",
        ),
        ({"num_members": 2.0}, TypeError, r"`num_members` must be an int >= 1"),
        (
            {"impl": "pallas"},
            ValueError,
            r"`impl` must be one of \['xla'\], got 'pallas'",
        ),
        (
            {"impl": "auto"},
            ValueError,
            r"`impl` must be one of \['xla'\], got 'auto'",
        ),
        (
            {"strides": (1, 1, 1)},
            ValueError,
            r"`strides` must be an int or a sequence of 2 ints .*got \(1, 1, 1\)",
        ),
        ({"kernel_dilation": -1}, ValueError, r"`kernel_dilation` must be an int >= 1"),
        ({"padding": "FULL"}, ValueError, r"`padding` must be one of .*got 'FULL'"),
        (
            {"padding": "circular"},
            ValueError,
            r"`padding` must be one of .*got 'circular'.*write 'CIRCULAR'",
        ),
        (
            {"kernel": (0, 3, 4, 6)},
            ValueError,
            r"`kernel` must have no zero-size axis.*got shape \(0, 3, 4, 6\)",
        ),
        (
            {"padding": [(1, 2, 3), 1]},
            ValueError,
            r"`padding` must be one of .*got \[\(1, 2, 3\), 1\]",
        ),
    ],
)
def test_bad_arguments(op, change, error, match):
    x, kernel, r, s, bias = conv_args()
    arrays = {"x": x, "kernel": kernel, "r": r, "s": s, "bias": bias}
    change = dict(change)  # shared between the parametrized ops
    for name in ("x", "kernel", "r", "s", "bias"):
        if name in change:
            arrays[name] = jnp.zeros(change.pop(name))
    options = {"num_members": 2, **change}
    with pytest.raises(error, match=match):
        op(*arrays.values(), **options)


def test_conv_specific_errors():
    x, kernel, r, s, bias = conv_args()
    with pytest.raises(ValueError, match=r"`padding='CAUSAL'` is only defined for 1-D"):
        batch_ensemble_conv(x, kernel, r, s, bias, num_members=2, padding="CAUSAL")
    with pytest.raises(ValueError, match=r"`input_dilation` must be an int or a seq"):
        batch_ensemble_conv(x, kernel, r, s, num_members=2, input_dilation=(1,))
    # G=2 with a [.., 2, 5] kernel: in_features 4 fits, out_features 5 does not.
    grouped = jnp.zeros((3, 3, 2, 5))
    with pytest.raises(
        ValueError, match=r"`feature_group_count` \(=2\) must divide out_features \(=5"
    ):
        batch_ensemble_conv(
            x, grouped, r, jnp.ones((2, 5)), num_members=2, feature_group_count=2
        )
    with pytest.raises(
        ValueError,
        match=r"in_features \(=8: `kernel.shape\[-2\]` times `feature_group_count` "
        r"\(=2\)",
    ):
        batch_ensemble_conv(x, kernel, r, s, num_members=2, feature_group_count=2)


@pytest.mark.parametrize("padding", ["REFLECT", "CAUSAL"])
def test_transpose_rejects_paddings_flax_lacks(padding):
    x, kernel, r, s, _ = conv_args()
    with pytest.raises(
        ValueError, match=rf"`padding='{padding}'` is not defined for transposed"
    ):
        batch_ensemble_conv_transpose(x, kernel, r, s, num_members=2, padding=padding)


def test_transpose_kernel_swaps_channel_axes():
    x, kernel, r, s, bias = conv_args()
    swapped = jnp.swapaxes(kernel, -1, -2)  # [3, 3, out=6, in=4]
    with pytest.raises(ValueError, match=r"with `transpose_kernel=True`"):
        batch_ensemble_conv_transpose(x, kernel, r, s, num_members=2,
                                      transpose_kernel=True)  # fmt: skip
    y = batch_ensemble_conv_transpose(
        x, swapped, r, s, bias, num_members=2, transpose_kernel=True
    )
    assert y.shape == (6, 5, 5, 6)


@pytest.mark.parametrize("padding", ["same", "Valid", "same_lower", "SAME_LOWER"])
def test_lax_paddings_in_any_case(padding):
    """As lax (and so Flax) reads them: ``nnx.Conv(padding="same")`` works.

    (A transposed convolution passes them to ``lax.conv_transpose`` as given,
    which reads only upper-case 'SAME'/'VALID' as its own; the layer tests
    compare that with ``nnx.ConvTranspose``.)
    """
    x, kernel, r, s, bias = conv_args()
    op = batch_ensemble_conv
    expected = op(x, kernel, r, s, bias, num_members=2, padding=padding.upper())
    actual = op(x, kernel, r, s, bias, num_members=2, padding=padding)
    np.testing.assert_array_equal(actual, expected)


def test_empty_batch():
    x, kernel, r, s, bias = conv_args()
    for op in (batch_ensemble_conv, batch_ensemble_conv_transpose):
        full = op(x, kernel, r, s, bias, num_members=2)
        empty = op(x[:0], kernel, r, s, bias, num_members=2)
        assert empty.shape == (0, *full.shape[1:]) and empty.dtype == full.dtype
        grads = jax.grad(
            lambda *a, op=op: jnp.sum(op(*a, num_members=2)), argnums=range(5)
        )(x[:0], kernel, r, s, bias)
        assert all(not np.any(np.asarray(g)) for g in grads)
