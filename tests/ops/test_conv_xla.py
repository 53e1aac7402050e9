"""The ``"xla"`` convolution's derivative rule: both formulations, every subset.

``conv_by_member(..., ConvConfig(..., params=...))`` forces each backward
formulation (``None``: the measured table's choice). Gradients are taken with
``jax.grad(..., argnums=...)`` over only the differentiated operands, so the
op's forward-mode rule sees the others carry no tangent and the backward runs
exactly the case under test. The reference loops over members
and runs ``lax.conv_general_dilated`` with each member's explicit effective
kernel (:func:`tests.reference.conv_effective_kernel`), differentiated in
float32 on upcast operands.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from ensembles.ops import batch_ensemble_conv, conv_xla
from ensembles.ops.autodiff import Needs
from ensembles.ops.conv_xla import ConvConfig, channels_last_dimension_numbers
from ensembles.ops.cost import FOLD_MEASURED, KERNELS_MEASURED
from ensembles.ops.plan import Formulation, choose_conv
from ensembles.ops.plan import choose_conv_backward as choose
from tests.covering import covering
from tests.jaxprs import equations
from tests.reference import conv_effective_kernel, cotangent_loss, random_cotangent
from tests.tolerances import assert_close, assert_close_to_scale

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
NAMES = ("inputs", "kernel", "r", "s", "bias")
PARAMS = [None, "activations", "kernels"]
PARAM_IDS = ["auto", "activations", "kernels"]

# argnums into (inputs, kernel, r, s); conv_by_member takes no bias.
NEEDS = {
    "first_layer": (1, 2, 3),
    "inputs": (0,),
    "all": (0, 1, 2, 3),
    "r": (2,),
    "s": (3,),
    "kernel": (1,),
}


class Case(NamedTuple):
    """One convolution: shapes, options, dtype (hashable, for the caches).

    ``padding`` is either what ``lax`` takes (``conv_by_member``) or one of
    the padding modes that copy values (``batch_ensemble_conv`` only).
    """

    num_members: int = 2
    batch: int = 3
    spatial: tuple[int, ...] = (7, 5)
    kernel_size: tuple[int, ...] = (3, 2)
    in_features: int = 3
    out_features: int = 5
    groups: int = 1
    strides: tuple[int, ...] = (1, 1)
    padding: Any = "SAME"
    input_dilation: tuple[int, ...] = (1, 1)
    kernel_dilation: tuple[int, ...] = (1, 1)
    dtype: str = "f32"
    seed: int = 0


DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def _one_d(**kwargs):
    base = {
        "spatial": (5,),
        "kernel_size": (3,),
        "strides": (1,),
        "input_dilation": (1,),
        "kernel_dilation": (1,),
    }
    return Case(**{**base, **kwargs})


@functools.cache
def _args(case: Case):
    """``(x, kernel, r, s, bias)``; r and s around 1, drawn with numpy."""
    rng = np.random.default_rng(case.seed)
    dtype = DTYPES[case.dtype]

    def draw(shape, mean=0.0, scale=1.0):
        return jnp.asarray(mean + scale * rng.standard_normal(shape), dtype)

    e, i, o = case.num_members, case.in_features, case.out_features
    x = draw((e * case.batch, *case.spatial, i))
    kernel = draw((*case.kernel_size, i // case.groups, o))
    r = draw((e, i), 1.0, 0.5)
    s = draw((e, o), 1.0, 0.5)
    bias = draw((e, o))
    return x, kernel, r, s, bias


def _spec(case: Case, params=None, forward=None) -> ConvConfig:
    return ConvConfig(
        case.strides,
        case.padding,
        case.input_dilation,
        case.kernel_dilation,
        case.groups,
        None,
        None,
        params=params,
        forward=forward,
    )


def _pad_like_the_op(x, case: Case):
    """The op's value-copying padding, then ``"VALID"`` (as ``nnx.Conv``)."""
    rank = len(case.kernel_size)
    dilated = [
        (k - 1) * d + 1
        for k, d in zip(case.kernel_size, case.kernel_dilation, strict=True)
    ]
    if case.padding == "CAUSAL":
        return jnp.pad(x, [(0, 0), (dilated[0] - 1, 0), (0, 0)]), "VALID"
    if case.padding in ("CIRCULAR", "REFLECT"):
        pads = [((k - 1) // 2, k // 2) for k in dilated]
        mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[case.padding]
        return jnp.pad(x, [(0, 0), *pads, (0, 0)], mode=mode), "VALID"
    assert rank == x.ndim - 2
    return x, case.padding


def _reference_fn(case: Case):
    """Per-member loop over explicit effective kernels, in float32."""

    def ref(x, kernel, r, s, bias):
        x, padding = _pad_like_the_op(x, case)
        batch = x.shape[0] // case.num_members
        outputs = []
        for k in range(case.num_members):
            weight = conv_effective_kernel(kernel, r, s, k, case.groups)
            y = lax.conv_general_dilated(
                x[k * batch : (k + 1) * batch],
                weight,
                case.strides,
                padding,
                lhs_dilation=case.input_dilation,
                rhs_dilation=case.kernel_dilation,
                dimension_numbers=channels_last_dimension_numbers(x.ndim),
                feature_group_count=case.groups,
                precision=lax.Precision.HIGHEST,
            )
            outputs.append(y + bias[k].reshape((1,) * (y.ndim - 1) + (-1,)))
        return jnp.concatenate(outputs)

    return ref


@functools.cache
def _reference(case: Case, with_bias: bool):
    """Output and gradients w.r.t. all operands, in float32 (cached).

    Without ``with_bias`` the bias is zero and gets no gradient (the
    ``conv_by_member`` cases).
    """
    x, kernel, r, s, bias = (a.astype(jnp.float32) for a in _args(case))
    if not with_bias:
        bias = jnp.zeros_like(bias)
    ref = _reference_fn(case)
    y = jax.jit(ref)(x, kernel, r, s, bias)
    cotangent = random_cotangent(y.shape)
    argnums = tuple(range(5 if with_bias else 4))
    fn = jax.value_and_grad(
        cotangent_loss(ref, cotangent), argnums=argnums, has_aux=True
    )
    (_, y), grads = jax.jit(fn)(x, kernel, r, s, bias)
    return y, grads


def _compare(case, args, argnums, y, grads, primal_outputs=()):
    y_ref, grads_ref = _reference(case, len(args) == 5)
    dtype = F32 if case.dtype == "f32" else BF16
    promoted = jnp.result_type(*args)
    for name, out in [("forward (vjp)", y), *primal_outputs]:
        assert out.shape == y_ref.shape, (name, out.shape, y_ref.shape)
        assert out.dtype == promoted, (name, out.dtype, promoted)
        assert_close(out, y_ref, dtype, scale=4, err_msg=name)
    assert len(grads) == len(argnums)
    for i, g in zip(argnums, grads, strict=True):
        name = NAMES[i]
        assert g.shape == args[i].shape, name
        assert g.dtype == args[i].dtype, (name, g.dtype, args[i].dtype)
        assert_close_to_scale(g, grads_ref[i], dtype, scale=4, err_msg=name)


def _check(case: Case, argnums, params, jit=True, primal=False, forward=None):
    """Forward value and gradients w.r.t. ``argnums`` against the reference.

    ``primal``: also check the forward called outside differentiation (the
    op primitive's own evaluation, which does not depend on ``argnums``).
    """
    args = _args(case)[:4]
    y_ref, _ = _reference(case, False)
    spec = _spec(case, params, forward)

    def op(*a):
        return conv_xla.conv_by_member(*a, spec)

    grad_op = jax.value_and_grad(
        cotangent_loss(op, random_cotangent(y_ref.shape)), argnums=argnums, has_aux=True
    )
    if jit:
        grad_op, op = jax.jit(grad_op), jax.jit(op)
    (_, y), grads = grad_op(*args)
    primal_outputs = [("forward (primal)", op(*args))] if primal else []
    _compare(case, args, argnums, y, grads, primal_outputs)


# --- every formulation x every differentiated subset -----------------------

# 2-D, E=2, B=3, 7x5 pixels, 3x2 kernel, in=3, out=5, SAME, jitted. A forced
# backward runs with each forced forward in f32 ("fold": E convolutions with
# the members' kernels; with "activations" and ds differentiated it falls back
# to "scale", whose product ds reads), with the table's forward in bf16.
GRID = [
    pytest.param(params, forward, needs, dtype, id=f"{pid}-{forward}-{needs}-{dtype}")
    for dtype in ("f32", "bf16")
    for params, pid in zip(PARAMS, PARAM_IDS, strict=True)
    for forward in ([None] if params is None or dtype == "bf16" else ["scale", "fold"])
    for needs in NEEDS
    # bf16: the subsets whose reductions (dr, ds) or fallbacks differ.
    if dtype == "f32" or needs in ("first_layer", "all", "r", "s")
]


@pytest.mark.parametrize("params, forward, needs, dtype", GRID)
def test_every_formulation_every_needs(params, forward, needs, dtype):
    primal = needs == "all"  # once per formulation and dtype
    _check(Case(dtype=dtype), NEEDS[needs], params, primal=primal, forward=forward)


# Shapes and options, each with both forced formulations, for a first layer
# and a hidden layer (the table's choice is one of them: the grid covers it).
SWEEP = {
    "1d_E1": _one_d(num_members=1, padding="SAME"),
    "1d_E5_bf16": _one_d(num_members=5, padding="VALID", dtype="bf16"),
    "1d_strides2": _one_d(num_members=2, strides=(2,), spatial=(7,)),
    "1d_kernel_dilation2": _one_d(num_members=2, kernel_dilation=(2,), spatial=(7,)),
    "1d_input_dilation2": _one_d(num_members=2, input_dilation=(2,), padding=((1, 2),)),
    "2d_E5_strides2": Case(num_members=5, strides=(2, 2), padding=((1, 0), (0, 1))),
    "2d_kernel_dilation2_bf16": Case(
        kernel_dilation=(2, 2), kernel_size=(2, 2), dtype="bf16"
    ),
    # Grouped: a forced "kernels" falls back to "activations".
    "2d_grouped": Case(in_features=4, out_features=6, groups=2),
    "1d_grouped_E5": _one_d(num_members=5, in_features=4, out_features=6, groups=2),
}


# Each case with every forced formulation (forward and backward), one for a
# first layer and the others for a hidden layer, rotated from case to case:
# every case runs every formulation and both layers, every (formulation,
# layer) pair runs on several cases. 27 of the 54 combinations.
FORMULATIONS = ["scale-activations", "scale-kernels", "fold-kernels"]
SWEEP_CASES = covering(
    {
        "case": list(SWEEP),
        "formulation": FORMULATIONS,
        "needs": ["first_layer", "all"],
    },
    [
        (name, formulation, ["first_layer", "all"][(i + j) % 2])
        for i, name in enumerate(SWEEP)
        for j, formulation in enumerate(FORMULATIONS)
    ],
)


@pytest.mark.parametrize(
    "case, formulation, needs",
    [
        pytest.param(
            SWEEP[name], formulation, needs, id=f"{name}-{formulation}-{needs}"
        )
        for name, formulation, needs in SWEEP_CASES
    ],
)
def test_shapes_options_members_jit(case, formulation, needs):
    forward, params = formulation.split("-")
    _check(case, NEEDS[needs], params, forward=forward)


# Eager (op by op) is slow to dispatch the first time: a few cases only.
@pytest.mark.parametrize(
    "case, params",
    [
        (_one_d(num_members=1), "kernels"),
        (Case(num_members=5), "activations"),
        (_one_d(in_features=4, out_features=6, groups=2, dtype="bf16"), "kernels"),
    ],
    ids=["1d_E1_kernels", "2d_E5_activations", "1d_grouped_bf16_kernels"],
)
def test_eager(case, params):
    _check(case, NEEDS["all"], params, jit=False, primal=True)


# --- through the public op --------------------------------------------------

PUBLIC = {
    "2d_circular": Case(padding="CIRCULAR"),
    "2d_reflect_bf16": Case(padding="REFLECT", dtype="bf16"),
    "2d_circular_dilated_E5": Case(
        num_members=5, padding="CIRCULAR", kernel_dilation=(2, 1)
    ),
    "1d_reflect_strides2": _one_d(padding="REFLECT", strides=(2,), spatial=(7,)),
    "1d_causal": _one_d(padding="CAUSAL"),
    "1d_causal_dilated_grouped": _one_d(
        padding="CAUSAL", kernel_dilation=(2,), in_features=4, out_features=6, groups=2
    ),
}


# Each value-copying padding (circular, reflect, causal) for a hidden layer
# (all gradients: the padding's own transpose) and for a first layer, on two
# different cases each: 6 of the 12 combinations.
PUBLIC_NEEDS = {
    "2d_circular": "all",
    "2d_reflect_bf16": "all",
    "2d_circular_dilated_E5": "first_layer",
    "1d_reflect_strides2": "first_layer",
    "1d_causal": "all",
    "1d_causal_dilated_grouped": "first_layer",
}
PUBLIC_ARGNUMS = {"all": (0, 1, 2, 3, 4), "first_layer": (1, 2, 3, 4)}
assert set(PUBLIC_NEEDS) == set(PUBLIC)
assert {(PUBLIC[name].padding, needs) for name, needs in PUBLIC_NEEDS.items()} == {
    (p, n) for p in ("CIRCULAR", "REFLECT", "CAUSAL") for n in PUBLIC_ARGNUMS
}


@pytest.mark.parametrize(
    "case, argnums",
    [
        pytest.param(PUBLIC[name], PUBLIC_ARGNUMS[needs], id=f"{name}-{needs}")
        for name, needs in PUBLIC_NEEDS.items()
    ],
)
def test_through_batch_ensemble_conv(case, argnums):
    """``impl="xla"`` with value-copying padding and a bias: same rule."""
    args = _args(case)
    y_ref, _ = _reference(case, True)

    def op(*a):
        return batch_ensemble_conv(
            *a,
            num_members=case.num_members,
            strides=case.strides,
            padding=case.padding,
            input_dilation=case.input_dilation,
            kernel_dilation=case.kernel_dilation,
            feature_group_count=case.groups,
            impl="xla",
        )

    fn = jax.value_and_grad(
        cotangent_loss(op, random_cotangent(y_ref.shape)), argnums=argnums, has_aux=True
    )
    (_, y), grads = jax.jit(fn)(*args)
    _compare(case, args, argnums, y, grads)


# --- conv counts ------------------------------------------------------------


def _convs(closed_jaxpr):
    """Output shapes of every ``conv_general_dilated``, recursively."""
    eqns = equations(closed_jaxpr, "conv_general_dilated")
    return [tuple(eqn.outvars[0].aval.shape) for eqn in eqns]


# E=3, B=4, 8x6 pixels, 3x3 kernel, in=4, out=5: the forward's output
# [12, 8, 6, 5], a kernel gradient [3, 3, 4, 5] and an input gradient
# [12, 8, 6, 4] all have different shapes, so each conv is told apart by the
# shape it produces.
COUNT_CASE = Case(
    num_members=3, batch=4, spatial=(8, 6), kernel_size=(3, 3), in_features=4
)


E = COUNT_CASE.num_members


@pytest.mark.parametrize(
    "case, forward, params, forward_convs, kernel_gradients, input_gradients",
    [
        # "scale" forward: one convolution of all E*B scaled rows.
        # "kernels": one kernel-gradient conv per member (M_k), no input
        # gradient; dW, dr and ds are reductions over the M_k.
        (COUNT_CASE, "scale", "kernels", 1, E, 0),
        # "fold" forward: E convolutions of B rows, each with its member's
        # kernel W * (r_k (x) s_k).
        (COUNT_CASE, "fold", "kernels", E, E, 0),
        # The table's choice on CPU for a first layer is "fold" and "kernels".
        (COUNT_CASE, None, None, E, E, 0),
        # "activations": one kernel-gradient conv over all E*B rows for dW and
        # the input-gradient conv u that dr_k = sum x_k * u_k needs; its ds
        # reads the "scale" forward's product, so a forced "fold" falls back.
        (COUNT_CASE, "scale", "activations", 1, 1, 1),
        (COUNT_CASE, "fold", "activations", 1, 1, 1),
        # Grouped: a forced "kernels" falls back to "activations".
        (
            COUNT_CASE._replace(in_features=4, out_features=6, groups=2),
            "scale",
            "kernels",
            1,
            1,
            1,
        ),
    ],
    ids=[
        "scale-kernels",
        "fold-kernels",
        "auto_cpu",
        "scale-activations",
        "fold-activations_falls_back",
        "grouped_kernels_falls_back",
    ],
)
def test_first_layer_conv_count(
    case, forward, params, forward_convs, kernel_gradients, input_gradients
):
    """Counted: every ``conv_general_dilated`` eqn in the jaxpr of ``jax.grad``
    w.r.t. kernel, r and s (a first layer), sub-jaxprs included: the forward
    (one of all rows, or one per member), then kernel gradients
    (kernel-shaped output) or input gradients (input-shaped output)."""
    auto = choose_conv(Needs(kernel=True, r=True, s=True), 1)
    if params is None and auto != Formulation("fold", "kernels"):
        pytest.skip(f"the table picks {auto} on this backend")
    x, kernel, r, s, _ = _args(case)
    spec = _spec(case, params, forward)

    def loss(x, kernel, r, s):
        return jnp.sum(conv_xla.conv_by_member(x, kernel, r, s, spec) ** 2)

    shapes = _convs(jax.make_jaxpr(jax.grad(loss, argnums=(1, 2, 3)))(x, kernel, r, s))
    y_shape = (x.shape[0], *case.spatial, case.out_features)
    member_y_shape = (case.batch, *case.spatial, case.out_features)
    assert len(shapes) == forward_convs + kernel_gradients + input_gradients, shapes
    if forward_convs == 1:
        assert shapes.count(y_shape) == 1, shapes
    else:
        assert shapes.count(member_y_shape) == forward_convs, shapes
    assert shapes.count(kernel.shape) == kernel_gradients, shapes
    assert shapes.count(x.shape) == input_gradients, shapes


def test_conv_walk_sees_inside_the_op_primitive():
    """The counter is not vacuous: the forward's conv lives inside the primitive."""
    x, kernel, r, s, _ = _args(COUNT_CASE)
    spec = _spec(COUNT_CASE, forward="scale")
    jaxpr = jax.make_jaxpr(lambda *a: conv_xla.conv_by_member(*a, spec))(
        x, kernel, r, s
    )
    assert not any(e.primitive.name == "conv_general_dilated" for e in jaxpr.jaxpr.eqns)
    assert len(_convs(jaxpr)) == 1


def test_no_cotangent_for_unperturbed_output():
    """Only the parameters differentiated, output partly unused: still right."""
    case = Case()
    x, kernel, r, s, _ = _args(case)
    spec = _spec(case, "kernels")

    def loss(kernel):
        return jnp.sum(conv_xla.conv_by_member(x, kernel, r, s, spec)[:3])

    def ref(kernel):
        return jnp.sum(_reference_fn(case)(x, kernel, r, s, jnp.zeros_like(s))[:3])

    assert_close_to_scale(jax.jit(jax.grad(loss))(kernel), jax.grad(ref)(kernel))


# --- the table --------------------------------------------------------------

FIRST_LAYER = Needs(kernel=True, r=True, s=True)
HIDDEN_LAYER = Needs(inputs=True, kernel=True, r=True, s=True)


def test_choose_first_layer_on_cpu_uses_kernels():
    assert choose(FIRST_LAYER, 1, backend="cpu") == "kernels"
    assert choose(Needs(r=True), 1, backend="cpu") == "kernels"


def test_choose_hidden_layer_follows_the_table():
    expected = "kernels" if KERNELS_MEASURED["cpu"].hidden else "activations"
    assert choose(HIDDEN_LAYER, 1, backend="cpu") == expected


@pytest.mark.parametrize("needs", [FIRST_LAYER, HIDDEN_LAYER], ids=["first", "hidden"])
@pytest.mark.parametrize("groups", [2, 4])
def test_choose_grouped_uses_activations(needs, groups):
    assert choose(needs, groups, backend="cpu") == "activations"


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu", "metal"])
def test_choose_without_parameter_gradients_uses_activations(backend):
    assert choose(Needs(), 1, backend=backend) == "activations"
    assert choose(Needs(inputs=True), 1, backend=backend) == "activations"


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_choose_accelerators_use_activations(backend):
    for needs in (FIRST_LAYER, HIDDEN_LAYER):
        assert choose(needs, 1, backend=backend) == "activations"


def test_choose_unknown_backend_uses_activations():
    for needs in (FIRST_LAYER, HIDDEN_LAYER):
        assert choose(needs, 1, backend="metal") == "activations"


def test_every_backend_is_in_the_table():
    assert {"cpu", "gpu", "tpu"} <= set(KERNELS_MEASURED)
    for backend, row in KERNELS_MEASURED.items():
        assert isinstance(row.first, bool) and isinstance(row.hidden, bool), backend
        assert row.measured.strip(), backend


def test_bad_params_names_the_field():
    with pytest.raises(ValueError, match=r"`params` must be .*'bad'"):
        ConvConfig((1,), "VALID", (1,), (1,), 1, None, None, params="bad")


def test_spec_is_hashable():
    spec = ConvConfig((1,), "VALID", (1,), (1,), 1, None, None, params="kernels")
    assert hash(spec) == hash(
        ConvConfig((1,), "VALID", (1,), (1,), 1, None, None, params="kernels")
    )


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu", "metal"])
@pytest.mark.parametrize(
    "needs",
    [Needs(), Needs(inputs=True), FIRST_LAYER, HIDDEN_LAYER],
    ids=["primal", "inputs", "first", "hidden"],
)
def test_choose_conv_forward_follows_the_fold_table(backend, needs):
    """ "fold" exactly where FOLD_MEASURED says so, never with an
    "activations" backward that differentiates ``s`` (its ds reads the "scale"
    forward's product) and never for mixed dtypes (``can_fold=False``)."""
    row = FOLD_MEASURED.get(backend)
    params = choose(needs, 1, backend=backend)
    blocked = params == "activations" and needs.s
    expected = "fold" if row is not None and row.fold and not blocked else "scale"
    assert choose_conv(needs, 1, backend=backend) == Formulation(expected, params)
    assert choose_conv(needs, 1, can_fold=False, backend=backend) == Formulation(
        "scale", params
    )
