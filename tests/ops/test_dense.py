import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ensembles.ops import IMPLS, batch_ensemble_dense
from tests.covering import covering
from tests.reference import dense_reference, make_args
from tests.tolerances import assert_close

MIDDLE_SHAPES = {2: (), 3: (3,), 4: (2, 3)}


F32, BF16 = jnp.float32, jnp.bfloat16

# Every rank, E, dtype, eager/jit and bias/no bias, and every pair of their
# values: 9 of the 72 combinations (tests/covering.py checks the claim).
FORWARD_CASES = covering(
    {
        "use_bias": [True, False],
        "jit": [False, True],
        "dtype": [F32, BF16],
        "num_members": [1, 2, 5],
        "rank": [2, 3, 4],
    },
    [
        (True, False, F32, 1, 2),
        (False, False, BF16, 2, 2),
        (False, True, BF16, 5, 2),
        (True, False, F32, 1, 3),
        (False, True, F32, 2, 3),
        (False, False, BF16, 5, 3),
        (False, True, BF16, 1, 4),
        (True, True, BF16, 2, 4),
        (True, False, F32, 5, 4),
    ],
)


@pytest.mark.parametrize("use_bias, jit, dtype, num_members, rank", FORWARD_CASES)
def test_forward_matches_per_member_loop(
    rank, num_members, dtype, jit, use_bias, formulation
):
    args = make_args(
        rank * 10 + num_members,
        num_members,
        3,
        MIDDLE_SHAPES[rank],
        7,
        5,
        dtype,
        use_bias,
    )
    fn = lambda *a: batch_ensemble_dense(*a, num_members=num_members, impl="xla")  # noqa: E731
    if jit:
        fn = jax.jit(fn)
    y = fn(*args)
    assert y.shape == (num_members * 3, *MIDDLE_SHAPES[rank], 5)
    assert y.dtype == dtype
    assert_close(y, dense_reference(*args, num_members), dtype, scale=4)


# Every rank x E, each dtype with every rank and every E: 9 of 18.
GRADIENT_CASES = covering(
    {"dtype": [F32, BF16], "num_members": [1, 2, 5], "rank": [2, 3, 4]},
    [
        (F32, 1, 2),
        (BF16, 2, 2),
        (BF16, 5, 2),
        (F32, 1, 3),
        (F32, 2, 3),
        (BF16, 5, 3),
        (BF16, 1, 4),
        (BF16, 2, 4),
        (F32, 5, 4),
    ],
)


@pytest.mark.parametrize("dtype, num_members, rank", GRADIENT_CASES)
def test_gradients_match_per_member_loop(rank, num_members, dtype, formulation):
    args = make_args(7, num_members, 2, MIDDLE_SHAPES[rank], 6, 4, dtype)
    cotangent = jnp.asarray(
        np.random.default_rng(8).standard_normal(
            (num_members * 2, *MIDDLE_SHAPES[rank], 4)
        ),
        jnp.float32,
    )

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cotangent)

    op = lambda *a: batch_ensemble_dense(*a, num_members=num_members)  # noqa: E731
    ref = lambda *a: dense_reference(*a, num_members)  # noqa: E731
    argnums = (0, 1, 2, 3, 4)
    grads = jax.jit(jax.grad(loss(op), argnums=argnums))(*args)
    expected = jax.jit(jax.grad(loss(ref), argnums=argnums))(*args)
    for name, g, e in zip(
        ("inputs", "kernel", "r", "s", "bias"), grads, expected, strict=True
    ):
        assert g.dtype == dtype, name
        assert_close(g, e, dtype, scale=8)


def test_member_k_only_sees_its_rows(formulation):
    x, kernel, r, s, bias = make_args(0, 3, 2, (), 4, 3, jnp.float32)
    y = batch_ensemble_dense(x, kernel, r, s, bias, num_members=3)
    y2 = batch_ensemble_dense(x.at[2:4].add(1.0), kernel, r, s, bias, num_members=3)
    np.testing.assert_array_equal(y[:2], y2[:2])
    np.testing.assert_array_equal(y[4:], y2[4:])
    assert not np.allclose(y[2:4], y2[2:4])


def test_preferred_element_type(formulation):
    args = make_args(0, 2, 2, (), 4, 3, jnp.bfloat16)
    y = batch_ensemble_dense(*args, num_members=2, preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32
    assert_close(y, dense_reference(*args, 2), jnp.bfloat16)


@pytest.mark.parametrize(
    "precision, text", [(None, "DEFAULT, DEFAULT"), ("highest", "HIGHEST, HIGHEST")]
)
def test_precision_is_passed_to_the_matmul(precision, text, formulation):
    args = make_args(0, 2, 2, (), 4, 3, jnp.float32)
    fn = lambda *a: batch_ensemble_dense(*a, num_members=2, precision=precision)  # noqa: E731
    hlo = jax.jit(fn).lower(*args).as_text()
    (dot,) = [line for line in hlo.splitlines() if "dot_general" in line]
    assert f"precision = [{text}]" in dot


def test_default_impl_is_xla():
    # "auto" is gone: the jnp formulation is the default on every backend, the
    # Pallas kernel runs only when named.
    assert IMPLS == ("xla", "pallas")
    args = make_args(0, 2, 2, (), 4, 3, jnp.float32)
    np.testing.assert_array_equal(
        batch_ensemble_dense(*args, num_members=2),
        batch_ensemble_dense(*args, num_members=2, impl="xla"),
    )


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(
    num_members=st.integers(1, 6),
    batch=st.integers(1, 4),
    middle=st.lists(st.integers(1, 3), max_size=2),
    in_features=st.integers(1, 9),
    out_features=st.integers(1, 9),
    use_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes(
    num_members, batch, middle, in_features, out_features, use_bias, seed
):
    args = make_args(
        seed,
        num_members,
        batch,
        tuple(middle),
        in_features,
        out_features,
        jnp.float32,
        use_bias,
    )
    y = batch_ensemble_dense(*args, num_members=num_members)
    assert y.shape == (num_members * batch, *middle, out_features)
    assert_close(y, dense_reference(*args, num_members), scale=4)


class TestErrors:
    def args(self):
        return make_args(0, 2, 3, (), 4, 5, jnp.float32)

    def test_batch_not_multiple_of_members(self):
        x, kernel, r, s, bias = self.args()
        with pytest.raises(
            ValueError,
            match=r"inputs.shape\[0\]` \(=5\).*"
            r"`num_members` \(=2\).*ensembles.tile\(x, 2\)",
        ):
            batch_ensemble_dense(x[:5], kernel, r, s, bias, num_members=2)

    def test_wrong_feature_size(self):
        x, kernel, r, s, bias = self.args()
        with pytest.raises(ValueError, match=r"inputs.shape\[-1\]` \(=3\).*=4"):
            batch_ensemble_dense(x[:, :3], kernel, r, s, bias, num_members=2)

    def test_rank_one_inputs(self):
        x, kernel, r, s, bias = self.args()
        with pytest.raises(ValueError, match=r"`inputs` must have shape .*\(4,\)"):
            batch_ensemble_dense(x[0], kernel, r, s, bias, num_members=2)

    def test_kernel_rank(self):
        x, kernel, r, s, bias = self.args()
        with pytest.raises(ValueError, match=r"`kernel` must have shape"):
            batch_ensemble_dense(x, kernel[None], r, s, bias, num_members=2)

    @pytest.mark.parametrize("name", ["r", "s", "bias"])
    def test_fast_weight_and_bias_shapes(self, name):
        x, kernel, r, s, bias = self.args()
        args = {"r": r, "s": s, "bias": bias}
        args[name] = args[name][:1]
        with pytest.raises(ValueError, match=rf"`{name}` must have shape .*\(2, "):
            batch_ensemble_dense(x, kernel, num_members=2, **args)

    @pytest.mark.parametrize(
        "bad, error",
        [
            (0, ValueError),
            (-1, ValueError),
            (2.0, TypeError),
            (True, TypeError),
            ("2", TypeError),
        ],
    )
    def test_num_members(self, bad, error):
        x, kernel, r, s, bias = self.args()
        with pytest.raises(error, match=r"`num_members` must be an int >= 1"):
            batch_ensemble_dense(x, kernel, r, s, bias, num_members=bad)

    @pytest.mark.parametrize("impl", ["xla", "pallas"])
    def test_zero_size_features(self, impl):
        x, kernel, r, s, bias = self.args()
        extra = {"interpret": True} if impl == "pallas" else {}
        with pytest.raises(
            ValueError, match=r"`kernel` must have at least one input and one output"
        ):
            batch_ensemble_dense(
                x[:, :0], kernel[:0], r[:, :0], s, bias, num_members=2, impl=impl,
                **extra,
            )  # fmt: skip

    @pytest.mark.parametrize("impl", ["cuda", "auto"])
    def test_unknown_impl(self, impl):
        x, kernel, r, s, bias = self.args()
        with pytest.raises(
            ValueError,
            match=rf"`impl` must be one of \['xla', 'pallas'\], got '{impl}'",
        ):
            batch_ensemble_dense(x, kernel, r, s, bias, num_members=2, impl=impl)


# Every impl over one shape grid, empty batches included: (E, rows per member,
# middle axes, in, out). Pallas runs in its interpreter off a GPU.
IMPL_GRID = [
    (2, 0, (), 5, 3),
    (2, 3, (0,), 5, 3),
    (1, 0, (2,), 4, 4),
    (3, 1, (), 5, 3),
    (2, 5, (2,), 7, 9),
    (2, 16, (), 16, 16),
]
# Op by op, the impls' gradients take seconds per shape; jitted, a
# fraction. Two shapes (an empty batch, and E=3 with one row each) run eagerly.
EAGER_GRID = {(2, 0, (), 5, 3), (3, 1, (), 5, 3)}


@pytest.mark.parametrize(
    "num_members, rows, middle, in_features, out_features", IMPL_GRID
)
def test_every_impl_gives_the_same_answer(
    num_members, rows, middle, in_features, out_features, formulation
):
    args = make_args(
        3, num_members, rows, middle, in_features, out_features, jnp.float32
    )
    options = {"xla": {}, "pallas": {"interpret": True}}
    assert set(options) == set(IMPLS)
    cotangent = jnp.ones((num_members * rows, *middle, out_features))
    eager = (num_members, rows, middle, in_features, out_features) in EAGER_GRID
    results = {}
    for impl, extra in options.items():

        def op(*a, impl=impl, extra=extra):
            return batch_ensemble_dense(*a, num_members=num_members, impl=impl, **extra)

        def value_and_grads(*a, op=op):
            grad = jax.grad(lambda *b: jnp.sum(op(*b) * cotangent), argnums=range(5))
            return op(*a), grad(*a)

        results[impl] = (value_and_grads if eager else jax.jit(value_and_grads))(*args)
    reference = dense_reference(*args, num_members)
    for impl, (y, grads) in results.items():
        assert y.shape == reference.shape == (num_members * rows, *middle, out_features)
        assert y.dtype == jnp.float32, impl
        assert_close(y, reference, jnp.float32, scale=4, err_msg=impl)
        for g, g_xla, a in zip(grads, results["xla"][1], args, strict=True):
            assert g.shape == a.shape and g.dtype == a.dtype, impl
            assert_close(g, g_xla, jnp.float32, scale=4, err_msg=impl)
            if not reference.size:  # an empty batch: nothing to differentiate
                assert not np.any(np.asarray(g)), impl
