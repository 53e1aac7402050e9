"""The ``"xla"`` convolution's formulations: every one, every differentiated subset.

``conv_rows(..., ConvConfig(..., formulation=...))`` forces each forward and
backward formulation (``None``: :func:`~ensembles.ops.conv.choose_conv`'s
choice); ``batch_ensemble_conv(..., formulation=...)`` forces them through the
public op. Gradients are taken with ``jax.grad(..., argnums=...)`` over only
the differentiated operands, so the op's forward-mode rule sees the others
carry no tangent and the backward runs exactly the case under test. The
reference (:mod:`tests.ops.conv_cases`) loops over members with each
member's explicit effective kernel. The rule itself is tested in
``test_rules.py``, the convolutions each formulation runs in
``test_conv_counts.py``.
"""

import jax
import jax.numpy as jnp
import pytest

from ensembles.ops import batch_ensemble_conv
from tests.covering import covering
from tests.ops.conv_cases import (
    FORMULATIONS,
    NEEDS,
    Case,
    case_args,
    check,
    check_public,
    convs,
    one_d,
    public_op,
)

# --- every formulation x every differentiated subset -----------------------

# 2-D, E=2, B=3, 7x5 pixels, 3x2 kernel, in=3, out=5, SAME, jitted. Every
# formulation (and the rule's choice) in f32 ("fold": E convolutions with the
# members' kernels; with "scaled_activations" and ds differentiated it falls
# back to "scale", whose product ds reads); in bf16 the rule's choice and one
# formulation of each forward and each backward, for the subsets whose
# reductions (dr, ds) or fallbacks differ.
BF16_FORMULATIONS = ("rule", "scale-activations", "fold-kernels")
GRID = [
    pytest.param(FORMULATIONS.get(name), needs, dtype, id=f"{name}-{needs}-{dtype}")
    for dtype in ("f32", "bf16")
    for name in ("rule", *FORMULATIONS)
    if dtype == "f32" or name in BF16_FORMULATIONS
    for needs in NEEDS
    if dtype == "f32" or needs in ("first_layer", "all", "r", "s")
]


@pytest.mark.parametrize("formulation, needs, dtype", GRID)
def test_every_formulation_every_needs(formulation, needs, dtype):
    primal = needs == "all"  # once per formulation and dtype
    check(Case(dtype=dtype), NEEDS[needs], formulation, primal=primal)


# Shapes and options, each with both forced formulations, for a first layer
# and a hidden layer (the table's choice is one of them: the grid covers it).
SWEEP = {
    "1d_E1": one_d(num_members=1, padding="SAME"),
    "1d_E5_bf16": one_d(num_members=5, padding="VALID", dtype="bf16"),
    "1d_strides2": one_d(num_members=2, strides=(2,), spatial=(7,)),
    "1d_kernel_dilation2": one_d(num_members=2, kernel_dilation=(2,), spatial=(7,)),
    "1d_input_dilation2": one_d(num_members=2, input_dilation=(2,), padding=((1, 2),)),
    "2d_E5_strides2": Case(num_members=5, strides=(2, 2), padding=((1, 0), (0, 1))),
    "2d_kernel_dilation2_bf16": Case(
        kernel_dilation=(2, 2), kernel_size=(2, 2), dtype="bf16"
    ),
    # Grouped: a forced "member_kernels" falls back to "scaled_activations".
    "2d_grouped": Case(in_features=4, out_features=6, groups=2),
    "1d_grouped_E5": one_d(num_members=5, in_features=4, out_features=6, groups=2),
}


# Each case with every forced formulation that runs as forced whatever is
# differentiated, one for a first layer and the others for a hidden layer,
# rotated from case to case: every case runs every formulation and both
# layers, every (formulation, layer) pair runs on several cases. 27 of the 54
# combinations. (The rule's choice is one of them: the grid covers it.)
SWEPT = ["scale-activations", "scale-kernels", "fold-kernels"]
SWEEP_CASES = covering(
    {
        "case": list(SWEEP),
        "formulation": SWEPT,
        "needs": ["first_layer", "all"],
    },
    [
        (name, formulation, ["first_layer", "all"][(i + j) % 2])
        for i, name in enumerate(SWEEP)
        for j, formulation in enumerate(SWEPT)
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
    check(case, NEEDS[needs], FORMULATIONS[formulation])


# Eager (op by op) is slow to dispatch the first time: a few cases only.
@pytest.mark.parametrize(
    "case, formulation",
    [
        (one_d(num_members=1), "scale-kernels"),
        (Case(num_members=5), "scale-activations"),
        (one_d(in_features=4, out_features=6, groups=2, dtype="bf16"), "fold-kernels"),
    ],
    ids=["1d_E1_scale-kernels", "2d_E5_scale-activations", "1d_grouped_bf16_fold"],
)
def test_eager(case, formulation):
    check(case, NEEDS["all"], FORMULATIONS[formulation], jit=False, primal=True)


# --- through the public op --------------------------------------------------

PUBLIC = {
    "2d_circular": Case(padding="CIRCULAR"),
    "2d_reflect_bf16": Case(padding="REFLECT", dtype="bf16"),
    "2d_circular_dilated_E5": Case(
        num_members=5, padding="CIRCULAR", kernel_dilation=(2, 1)
    ),
    "1d_reflect_strides2": one_d(padding="REFLECT", strides=(2,), spatial=(7,)),
    "1d_causal": one_d(padding="CAUSAL"),
    "1d_causal_dilated_grouped": one_d(
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
    check_public(case, argnums)


@pytest.mark.parametrize(
    "name, formulation, needs, forward_convs",
    [
        ("2d_circular", "fold-kernels", "all", 2),
        ("2d_circular_dilated_E5", "fold-kernels", "first_layer", 5),
        ("1d_reflect_strides2", "scale-kernels", "all", 1),
        # "scaled_activations" (grouped: "member_kernels" falls back to it)
        # reads the "scale" forward's product for ds: "fold" falls back too.
        ("1d_causal_dilated_grouped", "fold-kernels", "first_layer", 1),
        ("2d_reflect_bf16", "fold-activations", "all", 1),
    ],
)
def test_formulation_forced_through_batch_ensemble_conv(
    name, formulation, needs, forward_convs
):
    """``formulation=`` on the public op: right values, and that forward runs."""
    case = PUBLIC[name]
    formulation = FORMULATIONS[formulation]
    check_public(case, PUBLIC_ARGNUMS[needs], formulation)
    # The forward (as differentiated, after any fallback): one convolution of
    # all E*B rows, or one of B rows per member.
    args = case_args(case)
    op = public_op(case, formulation)
    grad = jax.grad(
        lambda *a: jnp.sum(op(*a).astype(jnp.float32)), argnums=PUBLIC_ARGNUMS[needs]
    )
    y = jax.eval_shape(op, *args)
    shapes = convs(jax.make_jaxpr(grad)(*args))
    forward = [shape for shape in shapes if shape[1:] == y.shape[1:]]
    rows = y.shape[0] // forward_convs
    assert forward == [(rows, *y.shape[1:])] * forward_convs, shapes


def test_formulation_must_be_a_formulation():
    x, kernel, r, s, bias = case_args(Case())
    for bad in ("fold", ("fold", "member_kernels")):
        with pytest.raises(TypeError, match=r"`formulation` must be an .*Formulation"):
            batch_ensemble_conv(x, kernel, r, s, bias, num_members=2, formulation=bad)
