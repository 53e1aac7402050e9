"""The convolutions each ``"xla"`` conv formulation runs, counted in its jaxpr.

And the fallbacks that change them: ``"fold"`` with mixed dtypes or with a
``"scaled_activations"`` backward that differentiates ``s``, a grouped
``"member_kernels"``, and the rule's choice on a measured (CPU) and an
unmeasured backend.
"""

import jax
import jax.numpy as jnp
import pytest

from ensembles.ops import Formulation
from ensembles.ops.autodiff import Needs
from ensembles.ops.conv import ConvConfig, choose_conv
from tests.ops.conv_cases import (
    FORMULATIONS,
    Case,
    case_args,
    conv_op,
    convs,
    reference_fn,
)
from tests.reference import cotangent_loss, random_cotangent
from tests.tolerances import assert_close, assert_close_to_scale

# E=3, B=4, 8x6 pixels, 3x3 kernel, in=4, out=5: the forward's output
# [12, 8, 6, 5], a kernel gradient [3, 3, 4, 5] and an input gradient
# [12, 8, 6, 4] all have different shapes, so each conv is told apart by the
# shape it produces.
COUNT_CASE = Case(
    num_members=3, batch=4, spatial=(8, 6), kernel_size=(3, 3), in_features=4
)
GROUPED_COUNT_CASE = COUNT_CASE._replace(in_features=4, out_features=6, groups=2)
E = COUNT_CASE.num_members


def _first_layer_convs(case, formulation, args=None):
    """Output shapes of every conv of ``jax.grad`` w.r.t. kernel, r and s."""
    x, kernel, r, s = case_args(case)[:4] if args is None else args
    op = conv_op(case, formulation)

    def loss(x, kernel, r, s):
        return jnp.sum(op(x, kernel, r, s).astype(jnp.float32) ** 2)

    return convs(jax.make_jaxpr(jax.grad(loss, argnums=(1, 2, 3)))(x, kernel, r, s))


def _assert_counts(case, shapes, forward_convs, kernel_gradients, input_gradients):
    x, kernel = case_args(case)[:2]
    y_shape = (x.shape[0], *case.spatial, case.out_features)
    member_y_shape = (case.batch, *case.spatial, case.out_features)
    assert len(shapes) == forward_convs + kernel_gradients + input_gradients, shapes
    if forward_convs == 1:
        assert shapes.count(y_shape) == 1, shapes
    else:
        assert shapes.count(member_y_shape) == forward_convs, shapes
    assert shapes.count(kernel.shape) == kernel_gradients, shapes
    assert shapes.count(x.shape) == input_gradients, shapes


@pytest.mark.parametrize(
    "case, formulation, forward_convs, kernel_gradients, input_gradients",
    [
        # "scale" forward: one convolution of all E*B scaled rows.
        # "member_kernels": one kernel-gradient conv per member (M_k), no input
        # gradient; dW, dr and ds are reductions over the M_k.
        (COUNT_CASE, "scale-kernels", 1, E, 0),
        # "fold" forward: E convolutions of B rows, each with its member's
        # kernel W * (r_k (x) s_k).
        (COUNT_CASE, "fold-kernels", E, E, 0),
        # "scaled_activations": one kernel-gradient conv over all E*B rows for
        # dW and the input-gradient conv u that dr_k = sum x_k * u_k needs; its
        # ds reads the "scale" forward's product, so a forced "fold" falls back.
        (COUNT_CASE, "scale-activations", 1, 1, 1),
        (COUNT_CASE, "fold-activations", 1, 1, 1),
        # Grouped: a forced "member_kernels" falls back to "scaled_activations".
        (GROUPED_COUNT_CASE, "scale-kernels", 1, 1, 1),
    ],
    ids=[
        "scale-kernels",
        "fold-kernels",
        "scale-activations",
        "fold-activations_falls_back",
        "grouped_kernels_falls_back",
    ],
)
def test_first_layer_conv_count(
    case, formulation, forward_convs, kernel_gradients, input_gradients
):
    """Counted: every ``conv_general_dilated`` eqn in the jaxpr of ``jax.grad``
    w.r.t. kernel, r and s (a first layer), sub-jaxprs included: the forward
    (one of all rows, or one per member), then kernel gradients
    (kernel-shaped output) or input gradients (input-shaped output)."""
    shapes = _first_layer_convs(case, FORMULATIONS[formulation])
    _assert_counts(case, shapes, forward_convs, kernel_gradients, input_gradients)


def test_first_layer_conv_count_of_the_rule_on_cpu(monkeypatch):
    """The rule's choice on CPU for a first layer: "scale" and "member_kernels"."""
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert choose_conv(Needs(kernel=True, r=True, s=True), 1) == Formulation(
        "scale", "member_kernels"
    )
    _assert_counts(COUNT_CASE, _first_layer_convs(COUNT_CASE, None), 1, E, 0)


def test_first_layer_conv_count_on_an_unmeasured_backend(monkeypatch):
    """No row: ``Formulation()``, plain differentiation's convolutions."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert choose_conv(Needs(kernel=True, r=True, s=True), 1) == Formulation()
    _assert_counts(COUNT_CASE, _first_layer_convs(COUNT_CASE, None), 1, 1, 1)


def test_mixed_dtypes_fold_falls_back_to_scale():
    """bf16 inputs with f32 parameters: a forced "fold" runs one convolution."""
    x, kernel, r, s = case_args(COUNT_CASE)[:4]
    mixed = (x.astype(jnp.bfloat16), kernel, r, s)
    fold = FORMULATIONS["fold-kernels"]
    _assert_counts(COUNT_CASE, _first_layer_convs(COUNT_CASE, fold, mixed), 1, E, 0)
    # The same operands in one dtype do fold (the count is not vacuous).
    _assert_counts(COUNT_CASE, _first_layer_convs(COUNT_CASE, fold), E, E, 0)
    # And the values are right, against the reference on the operands as
    # they are (x rounded to bfloat16, then computed in float32).
    cotangent = random_cotangent((x.shape[0], *COUNT_CASE.spatial, 5))

    def ref(x, kernel, r, s):
        return reference_fn(COUNT_CASE)(x, kernel, r, s, jnp.zeros_like(s))

    def value_and_grads(fn, *a):
        grad = jax.value_and_grad(
            cotangent_loss(fn, cotangent), argnums=(1, 2, 3), has_aux=True
        )
        return jax.jit(grad)(*a)

    (_, y), grads = value_and_grads(conv_op(COUNT_CASE, fold), *mixed)
    (_, y_ref), grads_ref = value_and_grads(
        ref, *(a.astype(jnp.float32) for a in mixed)
    )
    assert y.dtype == jnp.float32
    assert_close(y, y_ref, jnp.float32, scale=4)
    for name, g, e, a in zip("krs", grads, grads_ref, mixed[1:], strict=True):
        assert g.dtype == a.dtype, name
        assert_close_to_scale(g, e, jnp.float32, scale=4, err_msg=name)


def test_conv_walk_sees_inside_the_op_primitive():
    """The counter is not vacuous: the forward's conv lives inside the primitive."""
    x, kernel, r, s, _ = case_args(COUNT_CASE)
    op = conv_op(COUNT_CASE, FORMULATIONS["scale-activations"])
    jaxpr = jax.make_jaxpr(op)(x, kernel, r, s)
    assert not any(e.primitive.name == "conv_general_dilated" for e in jaxpr.jaxpr.eqns)
    assert len(convs(jaxpr)) == 1


def test_no_cotangent_for_unperturbed_output():
    """Only the parameters differentiated, output partly unused: still right."""
    case = Case()
    x, kernel, r, s, _ = case_args(case)
    op = conv_op(case, FORMULATIONS["scale-kernels"])

    def loss(kernel):
        return jnp.sum(op(x, kernel, r, s)[:3])

    def ref(kernel):
        return jnp.sum(reference_fn(case)(x, kernel, r, s, jnp.zeros_like(s))[:3])

    assert_close_to_scale(jax.jit(jax.grad(loss))(kernel), jax.grad(ref)(kernel))


def test_config_is_hashable():
    def config():
        return ConvConfig(
            (1,), "VALID", (1,), (1,), 1, None, None, FORMULATIONS["scale-kernels"]
        )

    assert hash(config()) == hash(config()) and config() == config()
    assert config() != ConvConfig((1,), "VALID", (1,), (1,), 1, None, None)
