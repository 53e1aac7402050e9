"""The shared argument checks (_checks.py), where the values enter.

* Options take any real scalar Flax takes: numpy and JAX scalars included.
  ``prior_stddev=np.float32(0.1)`` was refused ("must be a float") where Flax
  accepts such scalars (``nnx.Dropout(np.float32(0.1))``). Every option that
  asks for a number or an int is tried with numpy and 0-d JAX values and must
  give what the Python value gives; bools, strings, complex numbers and arrays
  stay refused.
* Every bool option takes a Python or numpy bool and nothing else (``"no"``
  was read as True), and an initializer that is not callable is named, before
  anything is drawn or converted.
* ``None`` (or a string) where an array belongs is named, in every public
  function and layer that takes arrays.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from ensembles import initializers, training, uncertainty
from ensembles._checks import (
    as_array,
    check_bool,
    check_initializer,
    check_positive_int,
    check_real,
)
from ensembles.experimental.pallas import BlockSizes
from ensembles.members import per_row
from ensembles.ops import (
    batch_ensemble_conv,
    batch_ensemble_conv_transpose,
    batch_ensemble_dense,
    batch_ensemble_dense_general,
    batch_ensemble_einsum,
    ensemble_batch_norm,
    ensemble_batch_statistics,
    ensemble_layer_norm,
    ensemble_rms_norm,
)
from tests.models import MLP

REALS = [0.25, np.float32(0.25), np.float64(0.25), jnp.float32(0.25), np.array(0.25)]
INTS = [3, np.int64(3), np.int32(3), np.uint8(3), jnp.array(3)]


@pytest.mark.parametrize("value", REALS, ids=lambda v: type(v).__name__)
def test_check_real_accepts_real_scalars(value):
    assert check_real(value, "x") == 0.25
    assert type(check_real(value, "x")) is float
    assert check_real(np.int16(2), "x") == 2.0


@pytest.mark.parametrize(
    "value",
    [True, np.bool_(True), "0.1", 1j, np.array([0.1, 0.2]), None, jnp.array(True)],
    ids=repr,
)
def test_check_real_refuses_what_is_not_one_real_number(value):
    with pytest.raises(TypeError, match=r"`x` must be a real number.*got"):
        check_real(value, "x")


def test_check_real_refuses_a_traced_value():
    with pytest.raises(TypeError, match=r"`x` must be a concrete number"):
        jax.jit(lambda v: check_real(v, "x"))(jnp.float32(0.1))


@pytest.mark.parametrize("value", INTS, ids=lambda v: type(v).__name__)
def test_check_positive_int_accepts_integer_scalars(value):
    assert check_positive_int(value, "n") == 3
    assert type(check_positive_int(value, "n")) is int


@pytest.mark.parametrize("value", REALS[1:], ids=lambda v: type(v).__name__)
def test_prior_stddev_takes_numpy_and_jax_scalars(value):
    layer = ensembles.BatchEnsembleLinear(
        3, 2, num_members=2, posterior="gaussian", prior_stddev=value, rngs=nnx.Rngs(0)
    )
    python = ensembles.BatchEnsembleLinear(
        3, 2, num_members=2, posterior="gaussian", prior_stddev=0.25, rngs=nnx.Rngs(0)
    )
    assert layer.prior_stddev == 0.25 and type(layer.prior_stddev) is float
    assert float(ensembles.kl_divergence(layer)) == float(
        ensembles.kl_divergence(python)
    )
    model = ensembles.to_batch_ensemble(
        MLP(nnx.Rngs(0)),
        num_members=2,
        posterior="cauchy",
        prior_stddev=value,
        rngs=nnx.Rngs(1),
    )
    assert model.inp.prior_stddev == 0.25


@pytest.mark.parametrize(
    "make",
    [
        lambda v: initializers.normal(v, v),
        lambda v: initializers.random_sign(v),
        lambda v: initializers.unconstrained_stddev(v, jitter=v),
    ],
    ids=["normal", "random_sign", "unconstrained_stddev"],
)
def test_initializers_take_numpy_and_jax_scalars(make):
    key = jax.random.key(0)
    expected = make(0.25)(key, (3, 4))
    for value in REALS[1:]:
        np.testing.assert_array_equal(make(value)(key, (3, 4)), expected)
    with pytest.raises(TypeError, match=r"must be a real number"):
        make("0.25")


def test_integer_options_take_numpy_and_jax_ints():
    x = ensembles.tile(jnp.ones((2, 8, 8, 3)), 2)
    python = ensembles.BatchEnsembleConv(
        3, 4, (3, 3), strides=2, num_members=2, rngs=nnx.Rngs(0)
    )
    for n in INTS[1:]:
        layer = ensembles.BatchEnsembleConv(
            3, 4, (n, n), strides=n - 1, num_members=n - 1, rngs=nnx.Rngs(0)
        )
        np.testing.assert_array_equal(layer(x), python(x))
        one = ensembles.BatchEnsembleConv(
            3, 4, n, num_members=2, rngs=nnx.Rngs(0)
        )  # a 1-D kernel of size n
        assert one.kernel_size == (3,)
    assert BlockSizes(block_b=np.int64(64)).block_b == 64
    assert type(BlockSizes(block_b=np.int64(64)).block_b) is int
    inputs = jnp.ones((4, 2, 3))
    y = batch_ensemble_dense_general(
        inputs,
        jnp.ones((2, 3, 5)),
        jnp.ones((2, 3)),
        jnp.ones((2, 5)),
        num_members=2,
        axis=-1,
        num_batch_axes=np.int64(1),
    )
    assert y.shape == (4, 2, 5)


def test_deterministic_takes_a_numpy_bool():
    layer = ensembles.BatchEnsembleLinear(
        3, 2, num_members=2, posterior="gaussian", rngs=nnx.Rngs(0)
    )
    x = jnp.ones((4, 3))
    np.testing.assert_array_equal(
        layer(x, deterministic=np.True_), layer(x, deterministic=True)
    )
    assert nnx.view(layer, deterministic=np.True_).deterministic is True


# ------------------------------------------------------------ bool options
# Issue 41 (1): a bool option given "no" (or 1, or None) was read as its
# truthiness: share_weights="no" shared the pretrained Variables.

E = 2


def _dense(cls, *args):
    return lambda rngs, **kw: cls(*args, num_members=E, rngs=rngs, **kw)


LAYERS = {
    "linear": _dense(ensembles.BatchEnsembleLinear, 3, 2),
    "linear_general": _dense(ensembles.BatchEnsembleLinearGeneral, 3, 2),
    "einsum": _dense(ensembles.BatchEnsembleEinsum, "bi,io->bo", (3, 2), (2,)),
    "conv": _dense(ensembles.BatchEnsembleConv, 3, 2, (3,)),
    "conv_transpose": _dense(ensembles.BatchEnsembleConvTranspose, 3, 2, (3,)),
    "layer_norm": _dense(ensembles.EnsembleLayerNorm, 3),
    "rms_norm": _dense(ensembles.EnsembleRMSNorm, 3),
    "batch_norm": _dense(ensembles.EnsembleBatchNorm, 3),
}
BOOL_OPTIONS = [
    *((name, "use_bias") for name in ["linear", "linear_general", "conv"]),
    ("conv_transpose", "use_bias"),
    ("layer_norm", "use_bias"),
    ("batch_norm", "use_bias"),
    *(
        (name, "deterministic")
        for name in ["linear", "linear_general", "einsum", "conv", "conv_transpose"]
    ),
    ("conv_transpose", "transpose_kernel"),
    *((name, "use_scale") for name in ["layer_norm", "rms_norm", "batch_norm"]),
    *((name, "use_fast_variance") for name in ["layer_norm", "rms_norm", "batch_norm"]),
    ("batch_norm", "use_running_average"),
]
NOT_BOOLS = ["no", 1, None, 0.0, jnp.array(True)]


def _counts(rngs):
    """How far each stream of ``rngs`` has been drawn from."""
    return [int(c) for c in jax.tree.leaves(nnx.state(rngs, nnx.RngCount))]


def assert_same_state(a, b):
    leaves_a, leaves_b = jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(("layer", "option"), BOOL_OPTIONS)
def test_bool_options_of_every_layer_refuse_what_is_not_a_bool(layer, option):
    make = LAYERS[layer]
    for value in NOT_BOOLS:
        if value is None and option == "use_running_average":
            continue  # Flax's "set it at the call"
        rngs = nnx.Rngs(0)
        before = _counts(rngs)
        with pytest.raises(TypeError, match=rf"`{option}` must be a bool.*got"):
            make(rngs, **{option: value})
        # Raised before anything was drawn.
        np.testing.assert_equal(_counts(rngs), before)


@pytest.mark.parametrize(("layer", "option"), BOOL_OPTIONS)
def test_bool_options_of_every_layer_take_numpy_bools(layer, option):
    make = LAYERS[layer]
    for value in [True, False]:
        python = make(nnx.Rngs(0), **{option: value})
        numpy = make(nnx.Rngs(0), **{option: np.bool_(value)})
        assert getattr(numpy, option) is value
        assert_same_state(numpy, python)


FLAX_LAYERS = {
    "linear": (lambda r: nnx.Linear(3, 2, rngs=r), "from_linear"),
    "linear_general": (
        lambda r: nnx.LinearGeneral(3, 2, rngs=r),
        "from_linear_general",
    ),
    "einsum": (lambda r: nnx.Einsum("bi,io->bo", (3, 2), rngs=r), "from_einsum"),
    "conv": (lambda r: nnx.Conv(3, 2, (3,), rngs=r), "from_conv"),
    "conv_transpose": (
        lambda r: nnx.ConvTranspose(3, 2, (3,), rngs=r),
        "from_conv_transpose",
    ),
}
BE_CLASSES = {
    "linear": ensembles.BatchEnsembleLinear,
    "linear_general": ensembles.BatchEnsembleLinearGeneral,
    "einsum": ensembles.BatchEnsembleEinsum,
    "conv": ensembles.BatchEnsembleConv,
    "conv_transpose": ensembles.BatchEnsembleConvTranspose,
}


@pytest.mark.parametrize("name", FLAX_LAYERS)
def test_share_kernel_takes_only_a_bool(name):
    make_flax, method = FLAX_LAYERS[name]
    flax_layer = make_flax(nnx.Rngs(0))
    convert = getattr(BE_CLASSES[name], method)
    for value in NOT_BOOLS:
        rngs = nnx.Rngs(1)
        before = _counts(rngs)
        with pytest.raises(TypeError, match=r"`share_kernel` must be a bool"):
            convert(flax_layer, num_members=E, rngs=rngs, share_kernel=value)
        np.testing.assert_equal(_counts(rngs), before)
    for value, shared in [(np.True_, True), (np.False_, False)]:
        layer = convert(flax_layer, num_members=E, rngs=nnx.Rngs(1), share_kernel=value)
        assert (layer.kernel is flax_layer.kernel) is shared


def test_call_and_view_bools_take_only_bools():
    layer = LAYERS["linear"](nnx.Rngs(0), posterior="gaussian")
    norm = LAYERS["batch_norm"](nnx.Rngs(0))
    x = jnp.ones((4, 3))
    for value in ["no", 1]:
        with pytest.raises(TypeError, match=r"`deterministic` must be a bool"):
            layer(x, deterministic=value)
        with pytest.raises(TypeError, match=r"`deterministic` must be a bool"):
            nnx.view(layer, deterministic=value)
        with pytest.raises(TypeError, match=r"`use_running_average` must be a bool"):
            norm(x, use_running_average=value)
        with pytest.raises(TypeError, match=r"`use_running_average` must be a bool"):
            nnx.view(norm, use_running_average=value)
    assert layer.deterministic is False and norm.use_running_average is False
    np.testing.assert_array_equal(
        norm(x, use_running_average=np.True_), norm(x, use_running_average=True)
    )


def test_bool_options_of_the_ops_take_only_bools():
    x = jnp.ones((4, 5, 3))
    kernel, r, s = jnp.ones((3, 3, 2)), jnp.ones((E, 3)), jnp.ones((E, 2))
    scale = jnp.ones((E, 3))
    calls = {
        "transpose_kernel": lambda v: ensembles.ops.batch_ensemble_conv_transpose(
            x, kernel, r, s, num_members=E, transpose_kernel=v
        ),
        "use_fast_variance": lambda v: ensembles.ops.ensemble_layer_norm(
            x, scale, None, num_members=E, use_fast_variance=v
        ),
    }
    stats = lambda v: ensembles.ops.ensemble_batch_statistics(  # noqa: E731
        x, num_members=E, use_fast_variance=v
    )
    rms = lambda v: ensembles.ops.ensemble_rms_norm(  # noqa: E731
        x, scale, num_members=E, use_fast_variance=v
    )
    for option, call in [*calls.items(), ("use_fast_variance", stats)]:
        for value in ["no", 1, None]:
            with pytest.raises(TypeError, match=rf"`{option}` must be a bool"):
                call(value)
        np.testing.assert_array_equal(
            jax.tree.leaves(call(np.False_)), jax.tree.leaves(call(False))
        )
    with pytest.raises(TypeError, match=r"`use_fast_variance` must be a bool"):
        rms("no")


def test_share_weights_takes_only_a_bool_and_leaves_the_model_untouched():
    model = MLP(nnx.Rngs(0))
    before = nnx.clone(model)
    rngs = nnx.Rngs(1)
    counts = _counts(rngs)
    for value in NOT_BOOLS:
        with pytest.raises(TypeError, match=r"`share_weights` must be a bool.*got"):
            ensembles.to_batch_ensemble(
                model, num_members=E, rngs=rngs, share_weights=value
            )
    assert_same_state(model, before)
    np.testing.assert_equal(_counts(rngs), counts)
    for value, shared in [(np.True_, True), (np.False_, False)]:
        ensemble = ensembles.to_batch_ensemble(
            model, num_members=E, rngs=nnx.Rngs(1), share_weights=value
        )
        assert (ensemble.inp.kernel is model.inp.kernel) is shared


# ------------------------------------------------------------ initializers

INITIALIZERS = [
    *(
        (layer, init)
        for layer in ["linear", "linear_general", "einsum", "conv", "conv_transpose"]
        for init in ["kernel_init", "bias_init", "r_init", "s_init", "stddev_init"]
    ),
    *((norm, "scale_init") for norm in ["layer_norm", "rms_norm", "batch_norm"]),
    *((norm, "bias_init") for norm in ["layer_norm", "batch_norm"]),
]


@pytest.mark.parametrize(("layer", "init"), INITIALIZERS)
def test_an_initializer_that_is_not_callable_is_named(layer, init):
    make = LAYERS[layer]
    extra = {"posterior": "gaussian"} if init == "stddev_init" else {}
    fast = init in ("r_init", "s_init", "stddev_init")
    hint = "ensembles.initializers" if fast else "nnx.initializers"
    for value in [1.0, None, jnp.ones((E, 3))]:
        rngs = nnx.Rngs(0)
        before = _counts(rngs)
        with pytest.raises(
            TypeError, match=rf"`{init}` must be an initializer.*`{hint}\."
        ):
            make(rngs, **{init: value}, **extra)
        np.testing.assert_equal(_counts(rngs), before)


def test_unused_initializers_may_be_anything_as_in_flax():
    # from_* passes bias_init=None for a layer without a bias.
    layer = ensembles.BatchEnsembleLinear(
        3, 2, num_members=E, use_bias=False, bias_init=None, rngs=nnx.Rngs(0)
    )
    assert layer.bias is None
    ensembles.BatchEnsembleLinear(
        3, 2, num_members=E, stddev_init=1.0, rngs=nnx.Rngs(0)
    )
    ensembles.EnsembleLayerNorm(
        3, num_members=E, use_scale=False, scale_init=None, rngs=nnx.Rngs(0)
    )
    converted = ensembles.BatchEnsembleLinear.from_linear(
        nnx.Linear(3, 2, use_bias=False, rngs=nnx.Rngs(0)),
        num_members=E,
        rngs=nnx.Rngs(1),
    )
    assert converted.bias is None


@pytest.mark.parametrize("init", ["r_init", "s_init", "stddev_init"])
def test_to_batch_ensemble_names_a_bad_initializer(init):
    model = MLP(nnx.Rngs(0))
    before = nnx.clone(model)
    with pytest.raises(
        TypeError,
        match=rf"`{init}` must be an initializer.*ensembles\.initializers\.",
    ):
        ensembles.to_batch_ensemble(
            model, num_members=E, rngs=nnx.Rngs(1), posterior="gaussian", **{init: 1.0}
        )
    assert_same_state(model, before)


def test_check_bool_and_check_initializer_directly():
    assert check_bool(np.True_, "flag") is True
    assert check_bool(None, "flag", optional=True) is None
    with pytest.raises(TypeError, match=r"`flag` must be a bool \(True or False\), "):
        check_bool(None, "flag")
    with pytest.raises(TypeError, match=r"True, False or None\), got 'no' of type"):
        check_bool("no", "flag", optional=True)
    assert check_initializer(initializers.ones(), "r_init") is not None
    with pytest.raises(TypeError, match=r"`r_init` must be an initializer.*ones\(\)"):
        check_initializer(1.0, "r_init")


# ------------------------------------------------------------------ arrays
# Issue 41 (3): None where an array belongs gave JAX's bare "None is not a
# valid value for jnp.array"; now the argument is named.

LOGITS, LABELS = jnp.zeros((2, 3, 4)), jnp.array([0, 1, 2])
SCORES = jnp.array([0.1, 0.5, 0.9])
X2, X3 = jnp.ones((4, 3)), jnp.ones((4, 5, 3))
R, S2 = jnp.ones((E, 3)), jnp.ones((E, 2))
STATS = jnp.ones((E, 3))


def _array_calls():
    """``(call, argument name)``: ``call(value)`` passes ``value`` as that argument."""
    calls = []
    labeled = ["nll", "accuracy", "brier", "ece", "adaptive_ece", "mce", "aurc"]
    for name in [*labeled, "augrc", "fit_temperature"]:
        fn = getattr(uncertainty, name)
        calls.append((lambda v, fn=fn: fn(v, LABELS), "logits"))
        calls.append((lambda v, fn=fn: fn(LOGITS, v), "labels"))
    for name in [
        "predictive_probs",
        "total_entropy",
        "expected_entropy",
        "mutual_information",
        "disagreement",
        "variance",
    ]:
        calls.append((getattr(uncertainty, name), "logits"))
    for name in ["auroc", "aupr", "fpr_at_tpr"]:
        fn = getattr(uncertainty, name)
        calls.append((lambda v, fn=fn: fn(v, SCORES), "in_scores"))
        calls.append((lambda v, fn=fn: fn(SCORES, v), "out_scores"))
    calls += [
        (lambda v: uncertainty.scale_temperature(v, 1.0), "logits"),
        (lambda v: uncertainty.scale_temperature(LOGITS, v), "temperature"),
        (lambda v: training.cross_entropy(v, LABELS, num_members=2), "logits"),
        (lambda v: training.cross_entropy(X2, v, num_members=2), "labels"),
        (
            lambda v: training.member_batches(v, 10, batch_size=2, num_members=2),
            "key",
        ),
        (lambda v: ensembles.tile(v, 2), "x"),
        (lambda v: ensembles.untile(v, 2), "y"),
        (lambda v: per_row(v, 4, 2), "weights"),
    ]
    dense_args = {"inputs": X2, "kernel": jnp.ones((3, 2)), "r": R, "s": S2}
    conv_args = {"inputs": X3, "kernel": jnp.ones((3, 3, 2)), "r": R, "s": S2}
    einsum_args = {"einsum_str": "bi,io->bo"}
    for op, args, extra in [
        (batch_ensemble_dense, dense_args, {}),
        (batch_ensemble_einsum, dense_args, einsum_args),
        (batch_ensemble_conv, conv_args, {}),
        (batch_ensemble_conv_transpose, conv_args, {}),
    ]:
        for name in [*args, "bias"]:
            calls.append(
                (
                    lambda v, op=op, args=args, name=name, extra=extra: op(
                        **{**args, name: v}, num_members=E, **extra
                    ),
                    name,
                )
            )
    calls += [
        (lambda v: ensemble_layer_norm(v, None, None, num_members=E), "inputs"),
        (lambda v: ensemble_layer_norm(X2, v, None, num_members=E), "scale"),
        (lambda v: ensemble_layer_norm(X2, None, v, num_members=E), "bias"),
        (lambda v: ensemble_rms_norm(v, None, num_members=E), "inputs"),
        (lambda v: ensemble_batch_statistics(v, num_members=E), "inputs"),
        (
            lambda v: ensemble_batch_statistics(X2, num_members=E, mask=v),
            "mask",
        ),
        (
            lambda v: ensemble_batch_norm(v, STATS, STATS, None, None, num_members=E),
            "inputs",
        ),
        (
            lambda v: ensemble_batch_norm(X2, v, STATS, None, None, num_members=E),
            "mean",
        ),
        (
            lambda v: ensemble_batch_norm(X2, STATS, v, None, None, num_members=E),
            "var",
        ),
        (
            lambda v: ensemble_batch_norm(X2, STATS, STATS, v, None, num_members=E),
            "scale",
        ),
    ]
    return calls


ARRAY_CALLS = _array_calls()


@pytest.mark.parametrize(
    ("call", "name"),
    ARRAY_CALLS,
    ids=[f"{i}-{n}" for i, (_, n) in enumerate(ARRAY_CALLS)],
)
def test_none_where_an_array_belongs_is_named(call, name):
    # The optional arrays (a bias, a scale, a mask) may be None: not a string.
    optional = name in ("bias", "scale", "mask")
    values = ["abc"] if optional else [None, "abc"]
    for value in values:
        shown = "None" if value is None else "'abc' of type str"
        with pytest.raises(TypeError, match=rf"`{name}` must be .*got {shown}"):
            call(value)


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_called_on_none_names_its_input(layer):
    module = LAYERS[layer](nnx.Rngs(0))
    name = "x" if "norm" in layer else "inputs"
    for view in [module, nnx.view(module, member=1)]:
        with pytest.raises(TypeError, match=rf"`{name}` must be an array, got None"):
            view(None)
    if layer == "batch_norm":
        before = np.asarray(module.mean[...])
        with pytest.raises(TypeError, match=r"`x` must be an array"):
            module([[1.0, "a", 2.0]])
        np.testing.assert_array_equal(module.mean[...], before)


def test_as_array_takes_what_jax_takes():
    for value in [1.0, [1, 2], np.float32(2), np.ones(3), jnp.ones(2), True]:
        np.testing.assert_array_equal(as_array(value, "x"), jnp.asarray(value))
    assert as_array(1.0, "x").weak_type  # a Python scalar stays weakly typed
    param = nnx.Param(jnp.ones(2))
    np.testing.assert_array_equal(as_array(param, "x"), jnp.ones(2))
    for value in [None, "1", [1, None], [[1], [1, 2]], {"a": 1}, np.array(["a"])]:
        with pytest.raises(TypeError, match=r"`x` must be an array, got"):
            as_array(value, "x")


def test_numpy_bfloat16_is_an_array_of_numbers():
    """``np.asarray`` of a bf16 jax.Array: numpy's kind for it is "V" (issue 67)."""
    bf16 = np.asarray(jnp.array([0.5, 2.0], jnp.bfloat16))
    assert bf16.dtype.kind == "V"
    np.testing.assert_array_equal(as_array(bf16, "x"), jnp.array([0.5, 2.0]))
    assert as_array(bf16, "x").dtype == jnp.bfloat16
    assert check_real(bf16[0], "x") == 0.5
    assert check_real(np.asarray(jnp.array(3, jnp.int4)), "x") == 3.0
    with pytest.raises(TypeError, match=r"`x` must be an array"):
        as_array(np.zeros(2, dtype=[("a", np.float32)]), "x")  # a record: no number


def test_host_integers_beyond_32_bits_are_refused_not_wrapped():
    """``jnp.asarray`` holds numpy int64 as int32 without x64: 3e9 became
    -1294967296 (issue 67). Values that fit pass; the others are named."""
    np.testing.assert_array_equal(
        ensembles.tile(np.array([5, 7], np.int64), 2), [5, 7, 5, 7]
    )
    for big in (np.array([3_000_000_000, 5], np.int64), np.array([2**40], np.uint64)):
        with pytest.raises(ValueError, match=r"`x` holds .*int64 integers beyond"):
            ensembles.tile(big, 2)
        with pytest.raises(ValueError, match=r"`y` holds .*astype\(np.float64\)"):
            ensembles.untile(np.concatenate([big, big]), 2)
