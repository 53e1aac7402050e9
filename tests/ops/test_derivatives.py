"""The dense and convolution ops' derivatives: every differentiated subset.

Each op is its ``jnp`` formula with a ``jax.custom_jvp`` that writes the
tangent member by member where a parameter is differentiated (the dense op:
only where the inputs are not). Gradients are taken with ``jax.grad(...,
argnums=...)`` over only the differentiated operands, so the rule sees the
others as symbolic zeros and runs exactly the case under test. They are
compared with the per-member loops of :mod:`tests.reference` and
:mod:`tests.ops.conv_cases` (differentiated in float32), and with JAX's own
derivative of the plain formula; the compiled first-layer backward is checked
to do the matmuls (convolutions) of a plain layer and nothing ``[E, in, out]``.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from ensembles.ops import batch_ensemble_dense, conv, dense
from tests.covering import covering
from tests.formulations import use_formulation
from tests.jaxprs import equations
from tests.ops.conv_cases import (
    NEEDS as CONV_NEEDS,
)
from tests.ops.conv_cases import (
    Case,
    case_args,
    check,
    check_public,
    conv_op,
    convs,
    one_d,
)
from tests.ops.test_autodiff import _matmuls_and_convs
from tests.reference import cotangent_loss, dense_reference, make_args, random_cotangent
from tests.tolerances import assert_close, assert_close_to_scale

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
NAMES = ("inputs", "kernel", "r", "s", "bias")
MIDDLE_SHAPES = {2: (), 3: (3,), 4: (2, 3)}

# argnums into (inputs, kernel, r, s, bias).
NEEDS = {
    "first_layer": (1, 2, 3, 4),
    "inputs": (0,),
    "all": (0, 1, 2, 3, 4),
    "r": (2,),
    "s": (3,),
    "kernel": (1,),
    "inputs_s": (0, 3),
    "r_s": (2, 3),
}

# (operand dtype, kernel/r/s/bias dtype).
DTYPES = {
    "f32": (jnp.float32, jnp.float32),
    "bf16": (jnp.bfloat16, jnp.bfloat16),
    "mixed": (jnp.bfloat16, jnp.float32),
}


@pytest.fixture(autouse=True)
def _member_backward_at_any_size(monkeypatch):
    """The per-member first-layer backward at these tests' small sizes.

    (By default it runs from ``MEMBER_BACKWARD_MIN_ROWS`` rows per member;
    tests that need JAX's own derivative of a first layer raise the bound.)
    """
    monkeypatch.setattr(dense, "MEMBER_BACKWARD_MIN_ROWS", 1)


def jax_own_first_layer(monkeypatch):
    monkeypatch.setattr(dense, "MEMBER_BACKWARD_MIN_ROWS", 10**9)


def dense_op(*args, **options):
    """The one-device op on checked operands (what the layers run)."""
    return dense.dense_rows(*args, **options)


@functools.cache
def _args(seed, num_members, batch, middle, dtype, in_features=7, out_features=5):
    input_dtype, param_dtype = DTYPES[dtype]
    x, kernel, r, s, bias = make_args(
        seed, num_members, batch, middle, in_features, out_features, jnp.float32
    )
    return (
        x.astype(input_dtype),
        *(a.astype(param_dtype) for a in (kernel, r, s, bias)),
    )


@functools.cache
def _reference(seed, num_members, batch, middle, dtype):
    """Output and gradients w.r.t. all five operands, in float32 (cached)."""
    args = _args(seed, num_members, batch, middle, dtype)
    upcast = tuple(a.astype(jnp.float32) for a in args)
    cotangent = random_cotangent((*args[0].shape[:-1], args[1].shape[1]))
    ref = lambda *a: dense_reference(*a, num_members)  # noqa: E731
    fn = jax.value_and_grad(
        cotangent_loss(ref, cotangent), argnums=range(5), has_aux=True
    )
    (_, y), grads = jax.jit(fn)(*upcast)
    return y, grads


def _check(case, argnums, jit=False, primal=True, op=dense_op):
    """Forward value and gradients w.r.t. ``argnums`` against the reference."""
    args = _args(*case)
    y_ref, grads_ref = _reference(*case)
    grad_op = jax.value_and_grad(
        cotangent_loss(op, random_cotangent(y_ref.shape)),
        argnums=argnums,
        has_aux=True,
    )
    if jit:
        grad_op, op = jax.jit(grad_op), jax.jit(op)
    (_, y), grads = grad_op(*args)
    dtype = BF16 if any(a.dtype == BF16 for a in args) else F32
    outputs = [("forward (vjp)", y)] + ([("forward", op(*args))] if primal else [])
    for name, out in outputs:
        assert out.shape == y_ref.shape, name
        assert out.dtype == jnp.result_type(*args), (name, out.dtype)
        assert_close(out, y_ref, dtype, scale=4, err_msg=name)
    assert len(grads) == len(argnums)
    for i, g in zip(argnums, grads, strict=True):
        assert g.shape == args[i].shape and g.dtype == args[i].dtype, NAMES[i]
        assert_close_to_scale(g, grads_ref[i], dtype, scale=4, err_msg=NAMES[i])


# --- dense: against the per-member loop ---------------------------------------

LOW_PRECISION_NEEDS = ("first_layer", "all", "r", "s")
GRID = [
    pytest.param(needs, dtype, id=f"{needs}-{dtype}")
    for dtype in DTYPES
    for needs in NEEDS
    if dtype == "f32" or needs in LOW_PRECISION_NEEDS
]


@pytest.mark.parametrize("needs, dtype", GRID)
def test_dense_every_differentiated_subset(needs, dtype, formulation):
    _check((3, 2, 3, (3,), dtype), NEEDS[needs], jit=True, primal=needs == "all")


def _sweep_case(rank, num_members, batch):
    # bf16 where the sum is odd: both dtypes over the sweep, half the cost.
    dtype = "bf16" if (rank + num_members + batch) % 2 else "f32"
    seed = rank * 100 + num_members * 10 + batch
    return (seed, num_members, batch, MIDDLE_SHAPES[rank], dtype)


# Every rank x E, with B alternating between 3 and 7, for a hidden layer and
# a first layer in turn.
SWEEP = [
    (rank, num_members, 3 if (rank + num_members) % 2 else 7)
    for rank, num_members in itertools.product([2, 3, 4], [1, 2, 5])
]


@pytest.mark.parametrize("rank, num_members, batch", SWEEP)
def test_dense_shapes_members_ragged_jit(rank, num_members, batch, formulation):
    needs = "all" if (rank + num_members) % 2 else "first_layer"
    _check(_sweep_case(rank, num_members, batch), NEEDS[needs], jit=True)


# Eager (op by op) is slow to dispatch the first time: a few cases only.
@pytest.mark.parametrize(
    "rank, num_members, batch, needs",
    [(2, 1, 3, "all"), (3, 2, 3, "first_layer"), (4, 5, 7, "all")],
)
def test_dense_shapes_members_ragged_eager(
    rank, num_members, batch, needs, formulation
):
    _check(_sweep_case(rank, num_members, batch), NEEDS[needs], jit=False)


@pytest.mark.parametrize("needs", ["first_layer", "inputs"])
def test_dense_through_batch_ensemble_dense(needs, formulation):
    def op(*a):
        return batch_ensemble_dense(*a, num_members=5, impl="xla")

    _check(_sweep_case(4, 5, 7), NEEDS[needs], jit=True, primal=False, op=op)


# --- dense: against JAX's derivative of the plain formula -----------------------


def plain_dense(x, kernel, r, s, bias):
    """``((x * r_rows) @ W) * s_rows + b`` as plain ``jnp``, no custom rule."""
    num_members, in_features = r.shape
    y = dense._scaled_matmul.fun(
        x.reshape(num_members, -1, in_features), kernel, r, s, None, None
    )
    return (y + bias[:, None, :]).reshape(*x.shape[:-1], kernel.shape[1])


SUBSETS = [
    subset for n in range(1, 6) for subset in itertools.combinations(range(5), n)
]


# A first layer on the CPU member by member or by JAX's own derivative (below
# MEMBER_BACKWARD_MIN_ROWS), and the accelerators' formulation.
@pytest.mark.parametrize("first_layer", ["per_member", "jax", "accelerator"])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f64"])
def test_dense_gradients_equal_jax_of_the_plain_formula(
    dtype, first_layer, request, monkeypatch
):
    if dtype == "f64":
        request.getfixturevalue("x64")
    use_formulation(
        monkeypatch, "accelerator" if first_layer == "accelerator" else "cpu"
    )
    if first_layer == "jax":
        jax_own_first_layer(monkeypatch)
    jnp_dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f64": jnp.float64}[dtype]
    args = make_args(1, 3, 4, (2,), 6, 5, jnp_dtype)
    cotangent = random_cotangent((12, 2, 5)).astype(jnp_dtype)

    @jax.jit
    def every_subset(*args):
        def grads(fn):
            loss = lambda *a: jnp.sum(jnp.sin(fn(*a)) * cotangent)  # noqa: E731
            return [jax.grad(loss, argnums)(*args) for argnums in SUBSETS]

        return grads(dense_op), grads(plain_dense)

    ours, theirs = every_subset(*args)
    rtol = {"f32": 1e-5, "bf16": 3e-2, "f64": 1e-12}[dtype]
    for argnums, mine, expected in zip(SUBSETS, ours, theirs, strict=True):
        for i, g, e in zip(argnums, mine, expected, strict=True):
            assert g.dtype == e.dtype == args[i].dtype, (argnums, i)
            scale = max(float(jnp.max(jnp.abs(e.astype(jnp.float32)))), 1e-30)
            error = float(jnp.max(jnp.abs((g - e).astype(jnp.float32))))
            assert error <= rtol * 4 * scale, (argnums, NAMES[i], error / scale)


@pytest.mark.slow  # forward mode also in tests/ops/test_autodiff.py's quick tier
def test_dense_forward_mode_equals_the_plain_formula(x64):
    args = make_args(2, 3, 4, (), 6, 5, jnp.float64)
    tangents = make_args(3, 3, 4, (), 6, 5, jnp.float64)
    for argnums in [(1, 2, 3), (2,), (0, 1, 2, 3, 4)]:
        # jvp with some operands held constant: the rule sees symbolic zeros.
        def restricted(fn, argnums=argnums):
            def f(*diff):
                full = list(args)
                for i, a in zip(argnums, diff, strict=True):
                    full[i] = a
                return fn(*full)

            return f

        primals = [args[i] for i in argnums]
        dirs = [tangents[i] for i in argnums]
        ours = jax.jvp(restricted(dense_op), primals, dirs)
        theirs = jax.jvp(restricted(plain_dense), primals, dirs)
        np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-12, atol=1e-12)

    def scalar(fn):
        return lambda kernel, r, s: jnp.sum(jnp.sin(fn(args[0], kernel, r, s, args[4])))

    hessians = jax.jit(jax.hessian(scalar(dense_op), argnums=(0, 1, 2)))(*args[1:4])
    expected = jax.hessian(scalar(plain_dense), argnums=(0, 1, 2))(*args[1:4])
    for h, e in zip(jax.tree.leaves(hessians), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(h, e, rtol=1e-10, atol=1e-10)


# --- dense: what the first layer's backward compiles to -------------------------

# E=4, B=32, in=64, out=48: every [E, ...] shape tells what it is.
E, B, IN, OUT = 4, 32, 64, 48


def _matmul_flops(fn, *args):
    """Multiply-adds of the real matmuls of ``fn``: both operands with at least
    two non-batch axes above 1.

    Outer and matrix-vector products (the tangents and the ``dr``, ``ds``
    reductions) are elementwise work, not matmuls; a matmul in a ``scan``
    counts once per iteration.
    """
    total = 0
    for eqn, times in equations(jax.make_jaxpr(fn)(*args), "dot_general"):
        (contract, _), batch = eqn.params["dimension_numbers"]
        shapes = [v.aval.shape for v in eqn.invars]
        if all(
            sum(d > 1 for i, d in enumerate(shape) if i not in dims) >= 2
            for shape, dims in zip(shapes, batch, strict=True)
        ):
            depth = int(np.prod([shapes[0][i] for i in contract]))
            total += times * int(np.prod(eqn.outvars[0].aval.shape)) * depth
    return total


def _layer_args():
    return make_args(0, E, B, (), IN, OUT, jnp.float32)


@pytest.mark.parametrize(
    "argnums, plain_argnums", [((1, 2, 3, 4), (1, 2)), ((0, 1, 2, 3, 4), (0, 1, 2))]
)
def test_dense_backward_does_a_plain_layers_matmuls(
    argnums, plain_argnums, formulation
):
    x, kernel, r, s, bias = _layer_args()

    def ensemble(*a):
        return jnp.sum(dense_op(*a) ** 2)

    def plain(x, kernel, bias):
        return jnp.sum((x @ kernel + bias[None, :]) ** 2)

    ours = _matmul_flops(jax.grad(ensemble, argnums), x, kernel, r, s, bias)
    theirs = _matmul_flops(jax.grad(plain, plain_argnums), x, kernel, bias[0])
    layer = E * B * IN * OUT
    assert theirs == (3 if 0 in argnums else 2) * layer
    assert ours == theirs
    # JAX's own derivative of the formula forms dr through the input-gradient
    # matmul a plain first layer never does (the counter is not vacuous).
    jax_own = _matmul_flops(jax.grad(plain_dense_loss, argnums), x, kernel, r, s, bias)
    assert jax_own == 3 * layer


def plain_dense_loss(*a):
    return jnp.sum(plain_dense(*a) ** 2)


def test_member_backward_min_rows_decides(monkeypatch):
    """Below the bound a first layer gets JAX's own derivative (its extra
    input-gradient matmul); from it on, the per-member one (the CPU's
    formulation: the accelerators' has no bound)."""
    use_formulation(monkeypatch, "cpu")
    args = _layer_args()

    def first_layer_flops(bound):
        monkeypatch.setattr(dense, "MEMBER_BACKWARD_MIN_ROWS", bound)
        # A new function each time: JAX caches traces by function.
        grad = jax.grad(lambda *a: jnp.sum(dense_op(*a) ** 2), (1, 2, 3, 4))
        return _matmul_flops(grad, *args)

    assert first_layer_flops(B) == 2 * E * B * IN * OUT
    assert first_layer_flops(B + 1) == 3 * E * B * IN * OUT


def test_dense_member_backward_at_the_requested_precision(formulation):
    """Every matmul of the per-member backward at ``precision`` and with its
    ``preferred_element_type`` (the outer products and matrix-vector products
    of the reductions included)."""
    x, kernel, r, s, bias = (a.astype(jnp.bfloat16) for a in _layer_args())

    def loss(*a):
        y = dense_op(
            *a, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )
        return jnp.sum(y**2)

    grads = jax.grad(loss, (1, 2, 3, 4))
    found = _matmuls_and_convs(grads, x, kernel, r, s, bias)
    # CPU: the forward, M_k, and the dr, ds products; the accelerators': the
    # forward and the batched M.
    assert len(found) >= (4 if formulation == "cpu" else 2), found
    for kind, precision, operand_types, result in found:
        assert precision == ("HIGHEST", "HIGHEST"), (kind, operand_types)
        if any("bf16" in t for t in operand_types):
            assert result.endswith("xf32>"), (kind, operand_types, result)
    shapes = jax.eval_shape(grads, x, kernel, r, s, bias)
    for g, a in zip(shapes, (kernel, r, s, bias), strict=True):
        assert g.dtype == a.dtype


def test_dense_first_layer_compiles_without_member_kernels(monkeypatch):
    """The CPU's: no [E, in, out] array (the accelerators' forms one, by
    design: ensembles/ops/dense_batched.py)."""
    use_formulation(monkeypatch, "cpu")
    x, kernel, r, s, bias = _layer_args()

    def compiled(fn):
        return (
            jax.jit(jax.grad(fn, (1, 2, 3, 4))).lower(x, kernel, r, s, bias).compile()
        )

    ours = compiled(lambda *a: jnp.sum(dense_op(*a) ** 2))
    theirs = compiled(plain_dense_loss)
    text = ours.as_text()
    assert f"f32[{E},{IN},{OUT}]" not in text

    # No input-gradient matmul: no dot (or library call: kCustom) makes an
    # array of the inputs' shape; JAX's own derivative of the formula has one.
    def input_gradient_dots(compiled):
        rows = f"= f32[{E * B},{IN}]"
        return [
            line
            for line in compiled.as_text().splitlines()
            if rows in line and (" dot(" in line or "kind=kCustom" in line)
        ]

    assert not input_gradient_dots(ours)
    assert input_gradient_dots(theirs)
    assert ours.memory_analysis().temp_size_in_bytes <= (
        theirs.memory_analysis().temp_size_in_bytes
    )


def test_dense_hidden_layer_compiles_as_plain_jnp(monkeypatch):
    use_formulation(monkeypatch, "cpu")
    x, kernel, r, s, bias = _layer_args()

    def hlo(fn):
        lowered = jax.jit(jax.grad(fn, (0, 1, 2, 3, 4))).lower(x, kernel, r, s, bias)
        return lowered.compile().cost_analysis()

    ours = hlo(lambda *a: jnp.sum(dense_op(*a) ** 2))
    theirs = hlo(plain_dense_loss)
    ours, theirs = (c[0] if isinstance(c, list) else c for c in (ours, theirs))
    assert ours["flops"] == theirs["flops"]
    assert ours["bytes accessed"] == theirs["bytes accessed"]


# --- conv: against the per-member loop ------------------------------------------

CONV_GRID = [
    pytest.param(needs, dtype, id=f"{needs}-{dtype}")
    for dtype in ("f32", "bf16")
    for needs in CONV_NEEDS
    if dtype == "f32" or needs in ("first_layer", "all", "r", "s")
]


@pytest.mark.parametrize("needs, dtype", CONV_GRID)
def test_conv_every_differentiated_subset(needs, dtype, formulation):
    check(Case(dtype=dtype), CONV_NEEDS[needs], primal=needs == "all")


CONV_SWEEP = {
    "1d_E1": one_d(num_members=1, padding="SAME"),
    "1d_E5_bf16": one_d(num_members=5, padding="VALID", dtype="bf16"),
    "1d_strides2": one_d(num_members=2, strides=(2,), spatial=(7,)),
    "1d_kernel_dilation2": one_d(num_members=2, kernel_dilation=(2,), spatial=(7,)),
    "1d_input_dilation2": one_d(num_members=2, input_dilation=(2,), padding=((1, 2),)),
    "2d_E5_strides2": Case(num_members=5, strides=(2, 2), padding=((1, 0), (0, 1))),
    "2d_kernel_dilation2_bf16": Case(
        kernel_dilation=(2, 2), kernel_size=(2, 2), dtype="bf16"
    ),
    "2d_grouped": Case(in_features=4, out_features=6, groups=2),
    "1d_grouped_E5": one_d(num_members=5, in_features=4, out_features=6, groups=2),
}
CONV_SWEEP_CASES = covering(
    {"case": list(CONV_SWEEP), "needs": ["first_layer", "all"]},
    [(name, needs) for name in CONV_SWEEP for needs in ("first_layer", "all")],
)


@pytest.mark.parametrize("name, needs", CONV_SWEEP_CASES)
def test_conv_shapes_options_members_jit(name, needs, formulation):
    check(CONV_SWEEP[name], CONV_NEEDS[needs])


@pytest.mark.parametrize(
    "case",
    [
        one_d(num_members=1),
        pytest.param(Case(num_members=5), marks=pytest.mark.slow),
        one_d(groups=2, in_features=4),
    ],
    ids=["1d_E1", "2d_E5", "1d_grouped"],
)
def test_conv_eager(case, formulation):
    check(case._replace(out_features=6), CONV_NEEDS["all"], jit=False, primal=True)


PUBLIC = {
    "2d_circular-all": (Case(padding="CIRCULAR"), (0, 1, 2, 3, 4)),
    "2d_reflect_bf16-all": (Case(padding="REFLECT", dtype="bf16"), (0, 1, 2, 3, 4)),
    "2d_circular_dilated_E5-first_layer": (
        Case(num_members=5, padding="CIRCULAR", kernel_dilation=(2, 1)),
        (1, 2, 3, 4),
    ),
    "1d_reflect_strides2-first_layer": (
        one_d(padding="REFLECT", strides=(2,), spatial=(7,)),
        (1, 2, 3, 4),
    ),
    "1d_causal-all": (one_d(padding="CAUSAL"), (0, 1, 2, 3, 4)),
    "1d_causal_dilated_grouped-first_layer": (
        one_d(
            padding="CAUSAL",
            kernel_dilation=(2,),
            in_features=4,
            out_features=6,
            groups=2,
        ),
        (1, 2, 3, 4),
    ),
}


@pytest.mark.parametrize("name", list(PUBLIC))
def test_conv_through_batch_ensemble_conv(name, formulation):
    """Value-copying paddings and a bias through the public op."""
    check_public(*PUBLIC[name])


# --- conv: what the backward convolves --------------------------------------------

# E=3, B=4, 8x6 pixels, 3x3 kernel, in=4, out=5: the forward's output, a
# kernel gradient and an input gradient all have different shapes.
COUNT_CASE = Case(
    num_members=3, batch=4, spatial=(8, 6), kernel_size=(3, 3), in_features=4
)


@pytest.mark.parametrize(
    "case, argnums, forward, kernel_grads, input_grads",
    [
        # A first layer: one convolution of all E*B rows, then one
        # kernel-gradient convolution of B rows per member (M_k).
        (COUNT_CASE, (1, 2, 3), (1, 12), 3, (0, 0)),
        # A hidden layer: and one input-gradient convolution of B rows per
        # member, against its own kernel.
        (COUNT_CASE, (0, 1, 2, 3), (1, 12), 3, (3, 4)),
        # The inputs alone: JAX's derivative of the formula.
        (COUNT_CASE, (0,), (1, 12), 0, (1, 12)),
        # Grouped: JAX's derivative of the formula (dr through the input
        # gradient), whatever is differentiated.
        (COUNT_CASE._replace(out_features=6, groups=2), (1, 2, 3), (1, 12), 1, (1, 12)),
    ],
    ids=["first_layer", "hidden_layer", "inputs", "grouped_first_layer"],
)
def test_conv_counts(case, argnums, forward, kernel_grads, input_grads, formulation):
    """Every convolution of ``jax.grad``, told apart by the shape it makes:
    ``(count, rows)`` of the forward and input-gradient ones, the number of
    kernel-gradient ones.

    The parameters give the CPU's formulation's; the accelerators' is JAX's
    derivative of the formula, one convolution of all rows per gradient
    (``dr`` through the input gradient, a first layer's too).
    """
    if formulation == "accelerator":
        rows = case.num_members * case.batch
        kernel_grads = int(any(i in argnums for i in (1, 2, 3)))
        input_grads = (1, rows) if {0, 2} & set(argnums) else (0, 0)
    x, kernel, r, s = case_args(case)[:4]
    op = conv_op(case)

    def loss(*a):
        return jnp.sum(op(*a).astype(jnp.float32) ** 2)

    shapes = convs(jax.make_jaxpr(jax.grad(loss, argnums))(x, kernel, r, s))
    out = (*case.spatial, case.out_features)
    found = {
        "forward": [sh[0] for sh in shapes if sh[1:] == out],
        "kernel": [sh for sh in shapes if sh == kernel.shape],
        "input": [sh[0] for sh in shapes if sh[1:] == x.shape[1:]],
    }
    assert len(shapes) == sum(map(len, found.values())), shapes
    assert found["forward"] == [forward[1]] * forward[0], shapes
    assert len(found["kernel"]) == kernel_grads, shapes
    assert found["input"] == [input_grads[1]] * input_grads[0], shapes


def test_conv_gradients_equal_jax_of_the_plain_formula(formulation):
    case = Case(num_members=3)
    args = case_args(case)
    options = (case.strides, "SAME", (1, 1), (1, 1), 1, None, None)
    y_shape = jax.eval_shape(conv_op(case), *args[:4]).shape
    cotangent = random_cotangent(y_shape)

    def plain(x, kernel, r, s):
        return conv._scaled_conv_formula(x, kernel, r, s, options)

    @jax.jit
    def every_subset(*args):
        def grads(fn):
            loss = lambda *a: jnp.sum(jnp.sin(fn(*a)) * cotangent)  # noqa: E731
            subsets = [
                c for n in range(1, 5) for c in itertools.combinations(range(4), n)
            ]
            return [jax.grad(loss, argnums)(*args) for argnums in subsets]

        return grads(conv_op(case)), grads(plain)

    for mine, expected in zip(*every_subset(*args[:4]), strict=True):
        for g, e in zip(mine, expected, strict=True):
            assert_close_to_scale(g, e, jnp.float32, scale=4)


def test_conv_no_cotangent_for_unperturbed_output(formulation):
    """Only the kernel differentiated, output partly unused: still right."""
    case = Case()
    x, kernel, r, s, _ = case_args(case)
    options = (case.strides, "SAME", (1, 1), (1, 1), 1, None, None)

    def grad(fn):
        return jax.grad(lambda kernel: jnp.sum(fn(x, kernel, r, s)[:3]))(kernel)

    def plain(*a):
        return conv._scaled_conv_formula(*a, options)

    assert_close_to_scale(jax.jit(grad, static_argnums=0)(conv_op(case)), grad(plain))


def test_precision_list_is_accepted():
    """``precision`` as a list (lax's form for two operands) reaches the rule."""
    x, kernel, r, s, bias = _layer_args()
    pair = [lax.Precision.HIGHEST, lax.Precision.HIGHEST]
    grads = jax.grad(lambda k: jnp.sum(dense_op(x, k, r, s, bias, precision=pair)))(
        kernel
    )
    assert grads.shape == kernel.shape
