"""The formulation rules: ``choose_dense``, ``choose_conv``, ``Formulation``.

Each op picks one :class:`~ensembles.ops.Formulation` per call from its own
measured rule: the dense op from the cost model of its backend's row in
:data:`~ensembles.ops.dense.DENSE_COSTS`, the convolution from its backend's
row in :data:`~ensembles.ops.conv.CONV_FORMULATIONS`. A backend without a row
runs ``Formulation()``, what plain differentiation of the formula does. That
each formulation computes the right values is tested in
``test_dense_formulations.py`` and ``test_conv_formulations.py``.
"""

import itertools

import jax
import jax.numpy as jnp
import pytest

from ensembles.ops import Formulation
from ensembles.ops.autodiff import BACKWARDS, FORWARDS, Needs
from ensembles.ops.conv import CONV_FORMULATIONS, ConvRule, choose_conv
from ensembles.ops.dense import (
    DENSE_COSTS,
    MAX_MEMBER_KERNELS_MEMORY,
    CostModel,
    choose_dense,
    estimate,
    member_kernels_fit,
)

ALL_NEEDS = [Needs(*flags) for flags in itertools.product([False, True], repeat=4)]
FIRST_LAYER = Needs(kernel=True, r=True, s=True)
HIDDEN_LAYER = Needs(inputs=True, kernel=True, r=True, s=True)
UNMEASURED = ["gpu", "tpu", "metal"]

# --- Formulation --------------------------------------------------------------


def test_formulation_default_is_plain_differentiation():
    assert Formulation() == Formulation("scale", "scaled_activations")
    assert FORWARDS == ("scale", "fold")
    assert BACKWARDS == ("scaled_activations", "member_kernels")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"forward": "bad"}, "forward"),
        ({"backward": "bad"}, "backward"),
        # The names before the refactor are no longer accepted.
        ({"backward": "kernels"}, "backward"),
        ({"backward": "activations"}, "backward"),
    ],
)
def test_bad_formulation_names_the_field(kwargs, field):
    value = next(iter(kwargs.values()))
    with pytest.raises(ValueError, match=rf"`{field}` must be one of .*'{value}'"):
        Formulation(**kwargs)


def test_positional_bad_formulation():
    with pytest.raises(ValueError, match=r"`forward`"):
        Formulation("bad")
    with pytest.raises(ValueError, match=r"`backward`"):
        Formulation("fold", "bad")


def test_formulation_is_frozen_and_hashable():
    formulation = Formulation("fold", "member_kernels")
    assert hash(formulation) == hash(Formulation("fold", "member_kernels"))
    with pytest.raises(AttributeError):
        formulation.forward = "scale"


F32 = jnp.ones(2, jnp.float32)
BF16 = jnp.ones(2, jnp.bfloat16)
SAME = (F32,) * 4
FOLD_KERNELS = Formulation("fold", "member_kernels")
FOLD_ACTIVATIONS = Formulation("fold", "scaled_activations")


@pytest.mark.parametrize(
    "formulation, needs, operands, expected",
    [
        # One dtype and nothing blocking: it runs as given.
        (FOLD_KERNELS, HIDDEN_LAYER, SAME, "fold"),
        (FOLD_ACTIVATIONS, Needs(), SAME, "fold"),
        (FOLD_ACTIVATIONS, Needs(True, True, True), SAME, "fold"),
        (Formulation("scale", "member_kernels"), HIDDEN_LAYER, SAME, "scale"),
        # Mixed dtypes: "fold" cannot run, whatever is differentiated.
        (FOLD_KERNELS, Needs(), (BF16, F32, F32, F32), "scale"),
        (FOLD_KERNELS, FIRST_LAYER, (F32, F32, F32, BF16), "scale"),
        # "scaled_activations" reads the "scale" forward's product for ds.
        (FOLD_ACTIVATIONS, Needs(s=True), SAME, "scale"),
        (FOLD_ACTIVATIONS, FIRST_LAYER, SAME, "scale"),
    ],
)
def test_runnable(formulation, needs, operands, expected):
    runs = formulation.runnable(needs, *operands)
    assert runs == Formulation(expected, formulation.backward)


# --- choose_dense -------------------------------------------------------------

SHAPES = [
    (1, 1, 1, 1),
    (2, 3, 7, 5),
    (4, 64, 64, 48),
    (4, 256, 1024, 1024),
    (8, 2048, 1024, 4096),
    (16, 8, 4096, 64),
    (4, 1024, 4096, 4096),
]


def test_dense_first_layer_on_cpu_uses_member_kernels():
    assert choose_dense(4, 256, 1024, 1024, FIRST_LAYER, backend="cpu") == (
        Formulation("scale", "member_kernels")
    )
    cpu = DENSE_COSTS["cpu"]
    kernels = estimate(
        Formulation("scale", "member_kernels"), 4, 256, 1024, 1024, FIRST_LAYER, cpu
    )
    activations = estimate(
        Formulation("scale", "scaled_activations"),
        4,
        256,
        1024,
        1024,
        FIRST_LAYER,
        cpu,
    )
    assert kernels < activations


def test_dense_hidden_layer_on_cpu():
    chosen = choose_dense(4, 256, 1024, 1024, HIDDEN_LAYER, backend="cpu")
    assert chosen == Formulation("scale", "scaled_activations")


def test_dense_default_backend_is_this_one():
    backend = jax.default_backend()
    for shape, needs in itertools.product(SHAPES, [FIRST_LAYER, HIDDEN_LAYER]):
        assert choose_dense(*shape, needs) == choose_dense(
            *shape, needs, backend=backend
        )


@pytest.mark.parametrize("backend", sorted(DENSE_COSTS))
def test_dense_never_chooses_what_cannot_run(backend):
    for shape, needs in itertools.product(SHAPES, ALL_NEEDS):
        chosen = choose_dense(*shape, needs, backend=backend)
        if needs.s:
            assert chosen != Formulation("fold", "scaled_activations"), (shape, needs)
        # With one dtype the rule's choice runs as chosen.
        assert chosen.runnable(needs, *SAME) == chosen, (shape, needs)
        if not needs.params:
            # No parameter gradient: the backward is irrelevant, left default.
            assert chosen.backward == "scaled_activations", (shape, needs)


@pytest.mark.parametrize("backend", sorted(DENSE_COSTS))
def test_dense_returns_the_cheapest_candidate(backend):
    model = DENSE_COSTS[backend]
    chosen_any = set()
    for shape, needs in itertools.product(SHAPES, ALL_NEEDS):
        chosen = choose_dense(*shape, needs, backend=backend)
        chosen_any.add(chosen)
        for forward, backward in itertools.product(FORWARDS, BACKWARDS):
            if forward == "fold" and backward == "scaled_activations" and needs.s:
                continue
            if not needs.params and backward == "member_kernels":
                continue
            if backward == "member_kernels" and not member_kernels_fit(*shape):
                continue
            other = Formulation(forward, backward)
            assert estimate(chosen, *shape, needs, model) <= estimate(
                other, *shape, needs, model
            ), (shape, needs, chosen, other)
    # The model decides: both backwards are chosen somewhere over the grid.
    assert {f.backward for f in chosen_any} == set(BACKWARDS), chosen_any


def test_dense_member_kernels_never_beyond_the_memory_limit():
    # Time alone picks "member_kernels" here (B = 64 rows amortise its
    # passes), but its M_k would take 4 GiB in float32 against 64 MiB of
    # activations.
    shape = (16, 64, 8192, 8192)
    model = DENSE_COSTS["cpu"]
    assert estimate(
        Formulation("scale", "member_kernels"), *shape, FIRST_LAYER, model
    ) < estimate(Formulation("scale", "scaled_activations"), *shape, FIRST_LAYER, model)
    assert not member_kernels_fit(*shape)
    assert choose_dense(*shape, FIRST_LAYER, backend="cpu").backward == (
        "scaled_activations"
    )
    # M_k of exactly MAX_MEMBER_KERNELS_MEMORY times the activations still fit:
    # E * f * f == limit * E * B * (f + f) at f = 2 * limit * B.
    num_members, rows = 2, 8
    features = int(2 * MAX_MEMBER_KERNELS_MEMORY * rows)
    assert member_kernels_fit(num_members, rows, features, features)
    assert not member_kernels_fit(num_members, rows, features + 1, features + 1)
    # Every shape of the CPU measurements stays within the limit.
    for measured in [(4, 256, 1024, 1024), (8, 512, 256, 256), (16, 64, 512, 512)]:
        assert member_kernels_fit(*measured)


@pytest.mark.parametrize("backend", [b for b in UNMEASURED if b not in DENSE_COSTS])
def test_dense_unmeasured_backend_runs_plain_differentiation(backend):
    for shape, needs in itertools.product(SHAPES, ALL_NEEDS):
        assert choose_dense(*shape, needs, backend=backend) == Formulation()


def test_dense_cost_rows():
    assert "cpu" in DENSE_COSTS
    for backend, model in DENSE_COSTS.items():
        assert isinstance(model, CostModel), backend
        for name, value in vars(model).items():
            assert isinstance(value, float) and value >= 0, (backend, name, value)


# --- choose_conv --------------------------------------------------------------


def test_conv_on_cpu_uses_member_kernels():
    # Measured (docs/cost.md): "scale" forward (the E convolutions of "fold"
    # were 2x slower inside a whole CNN), "member_kernels" backward.
    assert CONV_FORMULATIONS["cpu"] == ConvRule(
        "scale", "member_kernels", "member_kernels"
    )
    expected = Formulation("scale", "member_kernels")
    for needs in (FIRST_LAYER, Needs(r=True), HIDDEN_LAYER):
        assert choose_conv(needs, 1, backend="cpu") == expected


@pytest.mark.parametrize("needs", [FIRST_LAYER, HIDDEN_LAYER], ids=["first", "hidden"])
@pytest.mark.parametrize("groups", [2, 4])
def test_conv_grouped_uses_scaled_activations(needs, groups):
    chosen = choose_conv(needs, groups, backend="cpu")
    assert chosen == Formulation("scale", "scaled_activations")


@pytest.mark.parametrize("backend", ["cpu", *UNMEASURED])
def test_conv_without_parameter_gradients_uses_scaled_activations(backend):
    for needs in (Needs(), Needs(inputs=True)):
        assert choose_conv(needs, 1, backend=backend).backward == "scaled_activations"


@pytest.mark.parametrize(
    "backend", [b for b in UNMEASURED if b not in CONV_FORMULATIONS]
)
def test_conv_unmeasured_backend_runs_plain_differentiation(backend):
    for needs, groups in itertools.product(ALL_NEEDS, [1, 2]):
        assert choose_conv(needs, groups, backend=backend) == Formulation()


@pytest.mark.parametrize("backend", sorted(CONV_FORMULATIONS))
def test_conv_rule_follows_the_table(backend):
    rule = CONV_FORMULATIONS[backend]
    assert rule.forward in FORWARDS
    assert {rule.first_layer, rule.hidden_layer} <= set(BACKWARDS)
    for needs in ALL_NEEDS:
        chosen = choose_conv(needs, 1, backend=backend)
        assert chosen.forward == rule.forward, needs
        if needs.params:
            expected = rule.hidden_layer if needs.inputs else rule.first_layer
            assert chosen.backward == expected, needs


def test_conv_default_backend_is_this_one():
    for needs in (FIRST_LAYER, HIDDEN_LAYER):
        assert choose_conv(needs, 1) == choose_conv(
            needs, 1, backend=jax.default_backend()
        )
