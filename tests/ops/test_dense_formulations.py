"""The ``"xla"`` dense op: every formulation, every differentiated subset.

``dense._dense_by_member`` with a :class:`~ensembles.ops.dense_formulations.DenseConfig`
forces each of the four formulations (``None``: :func:`choose_dense`'s
choice); ``batch_ensemble_dense(..., formulation=...)`` forces them through
the public op. Gradients are taken with ``jax.grad(..., argnums=...)`` over
only the differentiated operands, so the op's forward-mode rule sees the
others carry no tangent and the backward runs exactly the case under test.
The reference is the per-member loop of :func:`tests.reference.dense_reference`,
differentiated in float32. The rule itself is tested in ``test_rules.py``.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest

from ensembles.ops import Formulation, batch_ensemble_dense, dense
from ensembles.ops.autodiff import BACKWARDS, FORWARDS, Needs
from ensembles.ops.dense_formulations import DenseConfig
from tests.covering import covering
from tests.jaxprs import equations
from tests.reference import cotangent_loss, dense_reference, make_args, random_cotangent
from tests.tolerances import assert_close, assert_close_to_scale

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
NAMES = ("inputs", "kernel", "r", "s", "bias")
MIDDLE_SHAPES = {2: (), 3: (3,), 4: (2, 3)}

FORMULATIONS = [None] + [Formulation(f, b) for f in FORWARDS for b in BACKWARDS]
SHORT = {"scaled_activations": "activations", "member_kernels": "kernels"}
FORMULATION_IDS = ["rule"] + [
    f"{f.forward}-{SHORT[f.backward]}" for f in FORMULATIONS[1:]
]

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


def by_member(
    inputs,
    kernel,
    r,
    s,
    bias,
    *,
    formulation=None,
    precision=None,
    preferred_element_type=None,
):
    """The one-device path of the op with a forced (or the rule's) formulation."""
    config = DenseConfig(precision, preferred_element_type, formulation)
    return dense._dense_by_member(inputs, kernel, r, s, bias, config)


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


def _compare(args, argnums, y_ref, grads_ref, outputs, grads):
    dtype = _tolerance_dtype(args)
    promoted = jnp.result_type(*args)
    for name, out in outputs:
        assert out.shape == y_ref.shape, name
        assert out.dtype == promoted, (name, out.dtype, promoted)
        assert_close(out, y_ref, dtype, scale=4, err_msg=name)
    assert len(grads) == len(argnums)
    for i, g in zip(argnums, grads, strict=True):
        name = NAMES[i]
        assert g.shape == args[i].shape, name
        assert g.dtype == args[i].dtype, (name, g.dtype, args[i].dtype)
        assert_close_to_scale(g, grads_ref[i], dtype, scale=4, err_msg=name)


def _check(case, argnums, formulation, jit=False, primal=True, op=None):
    """Forward value and gradients w.r.t. ``argnums`` against the reference.

    ``case`` is ``(seed, num_members, batch, middle, dtype)``. ``primal``: also
    check the forward called outside differentiation (the op primitive's
    own evaluation, which does not depend on ``argnums``). ``op``: the
    function of the five operands to run (default: :func:`by_member`).
    """
    args = _args(*case)
    y_ref, grads_ref = _reference(*case)
    cotangent = random_cotangent(y_ref.shape)
    if op is None:
        op = functools.partial(by_member, formulation=formulation)

    grad_op = jax.value_and_grad(
        cotangent_loss(op, cotangent), argnums=argnums, has_aux=True
    )
    if jit:
        grad_op = jax.jit(grad_op)
        op = jax.jit(op)
    (_, y), grads = grad_op(*args)
    outputs = [("forward (vjp)", y)]
    if primal:
        outputs.append(("forward (primal)", op(*args)))
    _compare(args, argnums, y_ref, grads_ref, outputs, grads)


# The full formulation x needs grid at one shape (E=2, B=3, middle (3,), in=7,
# out=5), jitted, in float32. bfloat16 runs every formulation for the subsets
# whose reductions (dr, ds) or fallbacks differ, as the conv op's grid does; the
# mixed dtypes the formulations whose "fold" must fall back to "scale" (and the
# rule's choice), for the same subsets.
LOW_PRECISION_NEEDS = ("first_layer", "all", "r", "s")
GRID = [
    pytest.param(formulation, needs, dtype, id=f"{fid}-{needs}-{dtype}")
    for dtype in DTYPES
    for formulation, fid in zip(FORMULATIONS, FORMULATION_IDS, strict=True)
    for needs in NEEDS
    if (dtype != "mixed" or fid in ("rule", "fold-activations", "fold-kernels"))
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
    "scale-activations": Formulation("scale", "scaled_activations"),
    "fold-kernels": Formulation("fold", "member_kernels"),
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

    def op(*a):
        return batch_ensemble_dense(*a, num_members=5, impl="xla")

    _check(case, NEEDS[needs], None, jit=True, primal=False, op=op)


@pytest.mark.parametrize(
    "formulation, needs, runs",
    [
        (Formulation("fold", "member_kernels"), "first_layer", "fold"),
        (Formulation("fold", "member_kernels"), "all", "fold"),
        (Formulation("scale", "member_kernels"), "all", "scale"),
        # "fold" cannot give "scaled_activations" its ds: it runs "scale".
        (Formulation("fold", "scaled_activations"), "first_layer", "scale"),
        (Formulation("fold", "scaled_activations"), "inputs", "fold"),
    ],
    ids=[
        "fold-kernels-first_layer",
        "fold-kernels-all",
        "scale-kernels-all",
        "fold-activations-first_layer",
        "fold-activations-inputs",
    ],
)
def test_formulation_forced_through_batch_ensemble_dense(formulation, needs, runs):
    """``formulation=`` on the public op: right values, and that forward runs."""
    num_members = 2
    case = _sweep_case(3, num_members, 7)

    def op(*a):
        return batch_ensemble_dense(
            *a, num_members=num_members, formulation=formulation
        )

    _check(case, NEEDS[needs], None, jit=True, primal=True, op=op)
    # The forward's matmul shows which forward ran: against the [E, in, out]
    # member kernels ("fold") or the shared [in, out] kernel ("scale").
    grad = jax.grad(lambda *a: jnp.sum(op(*a)), argnums=NEEDS[needs])
    shapes = [shapes for shapes, _ in _dots(jax.make_jaxpr(grad)(*_args(*case)))]
    folds = any((num_members, 7, 5) in pair for pair in shapes)
    assert folds == (runs == "fold"), shapes


def test_mixed_dtypes_fold_falls_back_to_scale():
    """bf16 inputs with f32 parameters: a forced "fold" runs the 2-D matmul."""
    x, kernel, r, s, bias = _args(0, 2, 3, (), "mixed")
    fold = Formulation("fold", "member_kernels")
    assert fold.runnable(Needs(), x, kernel, r, s) == Formulation(
        "scale", "member_kernels"
    )
    assert fold.runnable(Needs(), x.astype(jnp.float32), kernel, r, s) == fold
    f = functools.partial(by_member, formulation=fold)
    for argnums in ((), (1, 2, 3)):
        fn = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=argnums) if argnums else f
        shapes = [
            shapes for shapes, _ in _dots(jax.make_jaxpr(fn)(x, kernel, r, s, bias))
        ]
        # The forward's matmul is against the shared [in, out] kernel, never
        # against [E, in, out] member kernels.
        assert ((6, 7), (7, 5)) in shapes, shapes
        assert all((2, 7, 5) not in pair for pair in shapes), shapes
        # The same operands in one dtype do fold (the check is not vacuous).
        same = (x.astype(jnp.float32), kernel, r, s, bias)
        shapes = [shapes for shapes, _ in _dots(jax.make_jaxpr(fn)(*same))]
        assert any((2, 7, 5) in pair for pair in shapes), shapes


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
    ``ds``, and the ``"fold"``/``"member_kernels"``
    ``ds = sum_i (M_k * W)[i, :] r_k[i]``): they are ``E x B x out`` or
    ``E x in x out`` elementwise work, which a plain dense layer does not have
    but which is no extra matmul either. Counting every ``dot_general`` would
    give 3 (not 2) for a first layer for that reason alone.
    """
    return [
        shapes
        for shapes, free in _dots(closed_jaxpr)
        if all(sum(d > 1 for d in dims) >= 2 for dims in free)
    ]


# E=4, B=64, in=64, out=48: a shape where the CPU rule picks "member_kernels".
DOT_SHAPE = (4, 64, 64, 48)


def _matmul_counts(formulation, argnums, plain_argnums):
    """Matmuls of the op's gradient and of a plain dense layer's, same operands."""
    num_members, batch, in_features, out_features = DOT_SHAPE
    x, kernel, r, s, bias = make_args(
        0, num_members, batch, (), in_features, out_features, jnp.float32
    )

    def ensemble_loss(*a):
        return jnp.sum(by_member(*a, formulation=formulation) ** 2)

    def plain_loss(x, kernel, bias):
        return jnp.sum((x @ kernel + bias[None, :]) ** 2)

    ensemble = jax.make_jaxpr(jax.grad(ensemble_loss, argnums=argnums))(
        x, kernel, r, s, bias
    )
    plain = jax.make_jaxpr(jax.grad(plain_loss, argnums=plain_argnums))(
        x, kernel, bias[0]
    )
    return len(_matmuls(ensemble)), len(_matmuls(plain))


LAYERS = pytest.mark.parametrize(
    "argnums, plain_argnums",
    [((1, 2, 3, 4), (1, 2)), ((0, 1, 2, 3, 4), (0, 1, 2))],
    ids=["first_layer", "hidden_layer"],
)


@pytest.mark.parametrize(
    "formulation",
    [
        None,
        Formulation("scale", "member_kernels"),
        Formulation("fold", "member_kernels"),
    ],
    ids=["rule", "scale-kernels", "fold-kernels"],
)
@LAYERS
def test_no_matmul_beyond_a_plain_dense_layer(formulation, argnums, plain_argnums):
    if formulation is None:
        needs = Needs(0 in argnums, kernel=True, r=True, s=True)
        chosen = dense.choose_dense(*DOT_SHAPE, needs, backend="cpu")
        assert chosen.backward == "member_kernels", chosen
        if jax.default_backend() != "cpu":
            pytest.skip(f"the rule is measured on CPU only, not on {jax.devices()}")
    ensemble, plain = _matmul_counts(formulation, argnums, plain_argnums)
    expected = 3 if 0 in argnums else 2  # forward + dW (+ dx)
    assert plain == expected
    assert ensemble == expected


@LAYERS
def test_unmeasured_backend_runs_plain_differentiation(
    monkeypatch, argnums, plain_argnums
):
    """Where no cost row exists the rule runs ``Formulation()``: its first
    layer does the input-gradient matmul that ``dr`` reads (one more than a
    plain layer), where the CPU rule needs none."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    needs = Needs(0 in argnums, kernel=True, r=True, s=True)
    assert dense.choose_dense(*DOT_SHAPE, needs) == Formulation()
    ensemble, plain = _matmul_counts(None, argnums, plain_argnums)
    # forward + dW + the input-gradient matmul u (which dx, if needed, shares).
    assert ensemble == 3
    assert plain == (3 if 0 in argnums else 2)


def test_dot_walk_sees_inside_the_op_primitive():
    """The counter is not vacuous: the forward's dot lives inside the primitive."""
    x, kernel, r, s, bias = make_args(0, 2, 3, (), 7, 5, jnp.float32)
    jaxpr = jax.make_jaxpr(by_member)(x, kernel, r, s, bias)
    assert not any(e.primitive.name == "dot_general" for e in jaxpr.jaxpr.eqns)
    assert len(_dots(jaxpr)) == 1
