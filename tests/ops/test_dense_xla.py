"""The ``"xla"`` dense op: every formulation, every differentiated subset.

``dense_by_member(..., formulation=...)`` forces each of the four
formulations (``None``: the cost model's choice). Gradients are taken with
``jax.grad(..., argnums=...)`` over only the differentiated operands, so the
op's forward-mode rule sees the others carry no tangent and the backward runs
exactly the case under test. The reference is the per-member
loop of :func:`tests.reference.dense_reference`, differentiated in float32.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest

from ensembles.ops import batch_ensemble_dense, dense_xla
from ensembles.ops.autodiff import PARAM_GRADIENTS, Needs
from ensembles.ops.cost import COST_MODELS
from ensembles.ops.plan import (
    FORWARDS,
    Formulation,
    can_fold,
    choose,
    estimate,
    kernels_fit,
)
from tests.covering import covering
from tests.jaxprs import equations
from tests.reference import cotangent_loss, dense_reference, make_args, random_cotangent
from tests.tolerances import assert_close, assert_close_to_scale

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
NAMES = ("inputs", "kernel", "r", "s", "bias")
MIDDLE_SHAPES = {2: (), 3: (3,), 4: (2, 3)}

FORMULATIONS = [None] + [Formulation(f, p) for f in FORWARDS for p in PARAM_GRADIENTS]
FORMULATION_IDS = ["auto"] + [f"{f.forward}-{f.params}" for f in FORMULATIONS[1:]]

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

# (operand dtype, kernel/r/s/bias dtype): the mixed case cannot "fold".
DTYPES = {
    "f32": (jnp.float32, jnp.float32),
    "bf16": (jnp.bfloat16, jnp.bfloat16),
    "mixed": (jnp.bfloat16, jnp.float32),
}


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
    """Output and gradients w.r.t. all five operands, in float32 (cached).

    The reference is plain ``jnp``: its gradient w.r.t. a subset of the
    operands is the matching subset of these.
    """
    args = _args(seed, num_members, batch, middle, dtype)
    upcast = tuple(a.astype(jnp.float32) for a in args)
    cotangent = random_cotangent((*args[0].shape[:-1], args[1].shape[1]))
    ref = lambda *a: dense_reference(*a, num_members)  # noqa: E731
    fn = jax.value_and_grad(
        cotangent_loss(ref, cotangent), argnums=range(5), has_aux=True
    )
    (_, y), grads = jax.jit(fn)(*upcast)
    return y, grads


def _tolerance_dtype(args):
    """The least precise dtype among the operands: the one the op rounds to."""
    dtypes = {jnp.dtype(a.dtype) for a in args}
    return BF16 if BF16 in dtypes else F32


def _check(case, argnums, formulation, jit=False, primal=True):
    """Forward value and gradients w.r.t. ``argnums`` against the reference.

    ``case`` is ``(seed, num_members, batch, middle, dtype)``. ``primal``: also
    check the forward called outside differentiation (the op primitive's
    own evaluation, which does not depend on ``argnums``).
    """
    args = _args(*case)
    y_ref, grads_ref = _reference(*case)
    out_shape = y_ref.shape
    cotangent = random_cotangent(out_shape)

    def op(*a):
        return dense_xla.dense_by_member(*a, formulation=formulation)

    grad_op = jax.value_and_grad(
        cotangent_loss(op, cotangent), argnums=argnums, has_aux=True
    )
    if jit:
        grad_op = jax.jit(grad_op)
        op = jax.jit(op)
    (_, y), grads = grad_op(*args)

    dtype = _tolerance_dtype(args)
    promoted = jnp.result_type(*args)
    outputs = [("forward (vjp)", y)]
    if primal:
        outputs.append(("forward (primal)", op(*args)))
    for name, out in outputs:
        assert out.shape == out_shape, name
        assert out.dtype == promoted, (name, out.dtype, promoted)
        assert_close(out, y_ref, dtype, scale=4, err_msg=name)

    assert len(grads) == len(argnums)
    for i, g in zip(argnums, grads, strict=True):
        name = NAMES[i]
        assert g.shape == args[i].shape, name
        assert g.dtype == args[i].dtype, (name, g.dtype, args[i].dtype)
        assert_close_to_scale(g, grads_ref[i], dtype, scale=4, err_msg=name)


# The full formulation x needs grid at one shape (E=2, B=3, middle (3,), in=7,
# out=5), jitted, in float32. bfloat16 runs every formulation for the subsets
# whose reductions (dr, ds) or fallbacks differ, as the conv op's grid does; the
# mixed dtypes the formulations whose "fold" must fall back to "scale" (and the
# cost model's choice), for the same subsets.
LOW_PRECISION_NEEDS = ("first_layer", "all", "r", "s")
GRID = [
    pytest.param(formulation, needs, dtype, id=f"{fid}-{needs}-{dtype}")
    for dtype in DTYPES
    for formulation, fid in zip(FORMULATIONS, FORMULATION_IDS, strict=True)
    for needs in NEEDS
    if (dtype != "mixed" or fid in ("auto", "fold-activations", "fold-kernels"))
    and (dtype == "f32" or needs in LOW_PRECISION_NEEDS)
]


@pytest.mark.parametrize("formulation, needs, dtype", GRID)
def test_every_formulation_every_needs(formulation, needs, dtype):
    primal = needs == "all"  # once per formulation and dtype
    _check((3, 2, 3, (3,), dtype), NEEDS[needs], formulation, True, primal)


def _sweep_case(rank, num_members, batch):
    # bf16 where the sum is odd: both dtypes over the sweep, half the cost.
    dtype = "bf16" if (rank + num_members + batch) % 2 else "f32"
    seed = rank * 100 + num_members * 10 + batch
    return (seed, num_members, batch, MIDDLE_SHAPES[rank], dtype)


# Every rank x E, with B alternating between 3 and 7.
SWEEP = [
    (rank, num_members, 3 if (rank + num_members) % 2 else 7)
    for rank, num_members in itertools.product([2, 3, 4], [1, 2, 5])
]


@pytest.mark.parametrize("rank, num_members, batch", SWEEP)
def test_shapes_members_ragged_jit(rank, num_members, batch):
    _check(_sweep_case(rank, num_members, batch), NEEDS["all"], None, jit=True)


# Eager (op by op) is slow to dispatch the first time: a few cases only.
@pytest.mark.parametrize("rank, num_members, batch", [(2, 1, 3), (3, 2, 3), (4, 5, 7)])
def test_shapes_members_ragged_eager(rank, num_members, batch):
    _check(_sweep_case(rank, num_members, batch), NEEDS["all"], None, jit=False)


FORCED = {
    "scale-activations": Formulation("scale", "activations"),
    "fold-kernels": Formulation("fold", "kernels"),
}
# Each shape with both forced formulations, one for a first layer and the other
# for a hidden layer, swapped from shape to shape: 6 of the 12 combinations,
# every pair of values of any two of the three axes included.
FORCED_CASES = covering(
    {
        "needs": ["first_layer", "all"],
        "shape": [(2, 5), (3, 1), (4, 2)],
        "formulation": list(FORCED),
    },
    [
        (["first_layer", "all"][(i + j) % 2], shape, name)
        for i, shape in enumerate([(2, 5), (3, 1), (4, 2)])
        for j, name in enumerate(FORCED)
    ],
)


@pytest.mark.parametrize(
    "needs, rank, num_members, formulation",
    [
        pytest.param(
            needs, *shape, FORCED[name], id=f"{needs}-{shape[0]}-{shape[1]}-{name}"
        )
        for needs, shape, name in FORCED_CASES
    ],
)
def test_forced_formulations_other_shapes(formulation, rank, num_members, needs):
    _check(_sweep_case(rank, num_members, 7), NEEDS[needs], formulation, jit=True)


@pytest.mark.parametrize("needs", ["first_layer", "inputs"])
def test_through_batch_ensemble_dense(needs):
    """The public entry point with ``impl="xla"`` runs the same rule."""
    case = _sweep_case(4, 5, 7)
    args = _args(*case)
    y_ref, grads_ref = _reference(*case)
    cotangent = random_cotangent(y_ref.shape)
    argnums = NEEDS[needs]

    def op(*a):
        return batch_ensemble_dense(*a, num_members=5, impl="xla")

    fn = jax.value_and_grad(
        cotangent_loss(op, cotangent), argnums=argnums, has_aux=True
    )
    (_, y), grads = jax.jit(fn)(*args)
    dtype = _tolerance_dtype(args)
    assert_close(y, y_ref, dtype, scale=4)
    for i, g in zip(argnums, grads, strict=True):
        assert g.dtype == args[i].dtype, NAMES[i]
        assert_close_to_scale(g, grads_ref[i], dtype, scale=4, err_msg=NAMES[i])


def test_mixed_dtypes_fold_falls_back_to_scale():
    """bf16 inputs with f32 parameters: a forced "fold" runs the 2-D matmul."""
    x, kernel, r, s, bias = _args(0, 2, 3, (), "mixed")
    assert not can_fold(x.reshape(2, -1, 7), kernel, r, s)
    fold = Formulation("fold", "kernels")
    for argnums in ((), (1, 2, 3)):

        def f(*a):
            return dense_xla.dense_by_member(*a, formulation=fold)

        fn = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=argnums) if argnums else f
        shapes = [
            shapes for shapes, _ in _dots(jax.make_jaxpr(fn)(x, kernel, r, s, bias))
        ]
        # The forward's matmul is against the shared [in, out] kernel, never
        # against [E, in, out] member kernels.
        assert ((6, 7), (7, 5)) in shapes, shapes
        assert all((2, 7, 5) not in pair for pair in shapes), shapes


# --- dot counts -------------------------------------------------------------


def _dots(closed_jaxpr):
    """``(operand shapes, non-batch dims)`` of every ``dot_general``."""
    found = []
    for eqn in equations(closed_jaxpr, "dot_general"):
        (_, (lhs_batch, rhs_batch)) = eqn.params["dimension_numbers"]
        shapes = tuple(tuple(v.aval.shape) for v in eqn.invars)
        free = tuple(
            tuple(d for i, d in enumerate(shape) if i not in batch)
            for shape, batch in zip(shapes, (lhs_batch, rhs_batch), strict=True)
        )
        found.append((shapes, free))
    return found


def _matmuls(closed_jaxpr):
    """The ``dot_general`` ops that are real matmuls.

    Both operands must have at least two non-batch dimensions of size > 1.
    This leaves out the small matrix-vector reductions the op writes as
    ``dot_general`` (``_sum_rows``, which sums ``g * z`` over the rows into
    ``ds``, and the ``"fold"``/``"kernels"`` ``ds = sum_i (M_k * W)[i, :] r_k[i]``):
    they are ``E x B x out`` or ``E x in x out`` elementwise work, which a plain
    dense layer does not have but which is no extra matmul either. Counting
    every ``dot_general`` would give 3 (not 2) for a first layer for that
    reason alone.
    """
    return [
        shapes
        for shapes, free in _dots(closed_jaxpr)
        if all(sum(d > 1 for d in dims) >= 2 for dims in free)
    ]


# E=4, B=64, in=64, out=48: a shape where the CPU cost model picks "kernels".
DOT_SHAPE = (4, 64, 64, 48)


@pytest.mark.parametrize(
    "formulation",
    [None, Formulation("scale", "kernels"), Formulation("fold", "kernels")],
    ids=["auto", "scale-kernels", "fold-kernels"],
)
@pytest.mark.parametrize(
    "argnums, plain_argnums",
    [((1, 2, 3, 4), (1, 2)), ((0, 1, 2, 3, 4), (0, 1, 2))],
    ids=["first_layer", "hidden_layer"],
)
def test_no_matmul_beyond_a_plain_dense_layer(formulation, argnums, plain_argnums):
    num_members, batch, in_features, out_features = DOT_SHAPE
    needs = Needs(0 in argnums, kernel=True, r=True, s=True)
    if formulation is None:
        assert choose(*DOT_SHAPE, needs, backend="cpu").params == "kernels"
    x, kernel, r, s, bias = make_args(
        0, num_members, batch, (), in_features, out_features, jnp.float32
    )

    def ensemble_loss(*a):
        return jnp.sum(dense_xla.dense_by_member(*a, formulation=formulation) ** 2)

    def plain_loss(x, kernel, bias):
        return jnp.sum((x @ kernel + bias[None, :]) ** 2)

    ensemble = jax.make_jaxpr(jax.grad(ensemble_loss, argnums=argnums))(
        x, kernel, r, s, bias
    )
    plain = jax.make_jaxpr(jax.grad(plain_loss, argnums=plain_argnums))(
        x, kernel, bias[0]
    )
    expected = 3 if 0 in argnums else 2  # forward + dW (+ dx)
    assert len(_matmuls(plain)) == expected
    assert len(_matmuls(ensemble)) == expected, _matmuls(ensemble)


def test_dot_walk_sees_inside_the_op_primitive():
    """The counter is not vacuous: the forward's dot lives inside the primitive."""
    x, kernel, r, s, bias = make_args(0, 2, 3, (), 7, 5, jnp.float32)
    jaxpr = jax.make_jaxpr(dense_xla.dense_by_member)(x, kernel, r, s, bias)
    assert not any(e.primitive.name == "dot_general" for e in jaxpr.jaxpr.eqns)
    assert len(_dots(jaxpr)) == 1


# --- the cost model ---------------------------------------------------------

ALL_NEEDS = [Needs(*flags) for flags in itertools.product([False, True], repeat=4)]
SHAPES = [
    (1, 1, 1, 1),
    (2, 3, 7, 5),
    (4, 64, 64, 48),
    (4, 256, 1024, 1024),
    (8, 2048, 1024, 4096),
    (16, 8, 4096, 64),
    (4, 1024, 4096, 4096),
]


def test_first_layer_on_cpu_uses_kernels():
    first_layer = Needs(kernel=True, r=True, s=True)
    assert choose(4, 256, 1024, 1024, first_layer, backend="cpu").params == "kernels"
    cpu = COST_MODELS["cpu"]
    kernels = estimate(
        Formulation("scale", "kernels"), 4, 256, 1024, 1024, first_layer, cpu
    )
    activations = estimate(
        Formulation("scale", "activations"), 4, 256, 1024, 1024, first_layer, cpu
    )
    assert kernels < activations


@pytest.mark.parametrize("backend", sorted(COST_MODELS))
def test_cannot_fold_never_folds(backend):
    for shape, needs in itertools.product(SHAPES, ALL_NEEDS):
        chosen = choose(*shape, needs, can_fold=False, backend=backend)
        assert chosen.forward == "scale", (shape, needs, chosen)


@pytest.mark.parametrize("backend", sorted(COST_MODELS))
def test_fold_activations_never_chosen_when_s_differentiated(backend):
    for shape, needs in itertools.product(SHAPES, ALL_NEEDS):
        chosen = choose(*shape, needs, backend=backend)
        if needs.s:
            assert chosen != Formulation("fold", "activations"), (shape, needs)
        if not needs.params:
            # No parameter gradient: "params" is irrelevant, kept at its default.
            assert chosen.params == "activations", (shape, needs)


def test_choose_returns_the_cheapest_candidate():
    model = COST_MODELS["cpu"]
    for shape, needs in itertools.product(SHAPES, ALL_NEEDS):
        chosen = choose(*shape, needs, backend="cpu")
        for forward, params in itertools.product(FORWARDS, PARAM_GRADIENTS):
            if forward == "fold" and params == "activations" and needs.s:
                continue
            if not needs.params and params == "kernels":
                continue
            if params == "kernels" and not kernels_fit(*shape):
                continue
            other = Formulation(forward, params)
            assert estimate(chosen, *shape, needs, model) <= estimate(
                other, *shape, needs, model
            ), (shape, needs, chosen, other)


def test_kernels_are_never_chosen_beyond_the_memory_limit():
    # Time alone picks "kernels" here (B = 64 rows amortise its passes), but
    # its M_k would take 4 GiB in float32 against 64 MiB of activations.
    needs = Needs(kernel=True, r=True, s=True)
    shape = (16, 64, 8192, 8192)
    model = COST_MODELS["cpu"]
    assert estimate(Formulation("scale", "kernels"), *shape, needs, model) < estimate(
        Formulation("scale", "activations"), *shape, needs, model
    )
    assert not kernels_fit(*shape)
    assert choose(*shape, needs, backend="cpu").params == "activations"
    # Every shape of the CPU measurements stays within the limit.
    for measured in [(4, 256, 1024, 1024), (8, 512, 256, 256), (16, 64, 512, 512)]:
        assert kernels_fit(*measured)


def test_unknown_backend_uses_the_cpu_row():
    needs = Needs(kernel=True, r=True, s=True)
    for shape in SHAPES:
        assert choose(*shape, needs, backend="metal") == choose(
            *shape, needs, backend="cpu"
        )


@pytest.mark.parametrize(
    "kwargs, field",
    [({"forward": "bad"}, "forward"), ({"params": "bad"}, "params")],
)
def test_bad_formulation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"`{field}` must be one of .*'bad'"):
        Formulation(**kwargs)


def test_positional_bad_formulation():
    with pytest.raises(ValueError, match=r"`forward`"):
        Formulation("bad")


def test_every_cost_model_says_where_it_was_measured():
    assert {"cpu", "gpu", "tpu"} <= set(COST_MODELS)
    for backend, model in COST_MODELS.items():
        assert isinstance(model.measured, str), backend
        assert model.measured.strip(), backend
