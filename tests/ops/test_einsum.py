"""``batch_ensemble_einsum`` against a per-member loop of ``nnx.Einsum``.

The reference gives member ``k``'s rows to a plain ``nnx.Einsum`` holding the
explicit effective kernel ``kernel * r[k] * s[k]`` (``r[k]`` broadcast over the
kernel's contracted axes, ``s[k]`` over its output axes) and ``bias[k]``, and
puts the results back along the output axis of the member letter.
"""

import functools
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, note, settings
from hypothesis import strategies as st

from ensembles.ops import IMPLS, batch_ensemble_einsum, dense
from tests.covering import covering
from tests.reference import cotangent_loss, random_cotangent
from tests.tolerances import assert_close, assert_close_to_scale

# name: (einsum_str, kernel_shape, bias_shape, one member's input shape)
CONFIGS = {
    # nnx.Einsum's docstring example.
    "flax_docstring": ("nta,hab->nthb", (8, 2, 4), (8, 4), (3, 5, 2)),
    # Gemma's attention projections: features -> heads, heads -> features.
    "gemma_qkv": ("BTD,NDH->BTNH", (3, 7, 5), (3, 5), (2, 5, 7)),
    "gemma_out": ("BTNH,NHD->BTD", (3, 5, 7), (7,), (2, 5, 3, 5)),
    # The member letter B lands on output axis 1.
    "member_not_first": ("BSD,CKDH->CBSKH", (2, 3, 7, 5), (2, 3, 5), (2, 5, 7)),
    "ellipsis": ("...d,df->...f", (7, 13), (13,), (2, 3, 7)),
    # e is a batch letter: in the input, the kernel and the output.
    "batch_letter": ("becd,edf->becf", (3, 7, 5), (3, 5), (2, 3, 4, 7)),
    # Output letters in another order than in the kernel: s is [E, H, N]
    # (kernel order), the bias [N, H] (output order).
    "permuted_output": ("BTD,DHN->BNTH", (7, 5, 3), (3, 5), (2, 5, 7)),
    "spaces": (" BTD , NDH -> NBTH ", (3, 7, 5), (3, 5), (2, 5, 7)),
    # A bias of another shape but the same size, which Flax reshapes.
    "flat_bias": ("BTD,NDH->BTNH", (3, 7, 5), (15,), (2, 5, 7)),
    # An input axis (T) summed without the kernel.
    "summed_input_axis": ("BTD,DH->BH", (7, 13), (13,), (2, 5, 7)),
    # A batch letter e, output letters out of kernel order, members at axis 2.
    "batch_letter_permuted": ("becd,fde->cebf", (5, 7, 3), (3, 5), (2, 3, 4, 7)),
    # Nothing contracted (r is [E]) and nothing kept (s is [E]).
    "outer_product": ("BT,H->BTH", (13,), (13,), (2, 5)),
    "kernel_all_contracted": ("BTD,D->BT", (7,), (1,), (2, 5, 7)),
}


def explicit(einsum_str, ndim):
    """``(input, kernel, output)`` letters, spaces dropped, "..." spelled out."""
    text = einsum_str.replace(" ", "")
    operands, out = text.split("->")
    x, w = operands.split(",")
    if "..." in x:
        unused = [c for c in string.ascii_letters if c not in text]
        fill = "".join(unused[: ndim - (len(x) - 3)])
        x, out = x.replace("...", fill), out.replace("...", fill)
    return x, w, out


def fast_weight_shapes(einsum_str, kernel_shape, ndim, num_members):
    """``r``: [E, contracted dims], ``s``: [E, output dims], in kernel order."""
    _, w, out = explicit(einsum_str, ndim)
    r = [d for c, d in zip(w, kernel_shape, strict=True) if c not in out]
    s = [d for c, d in zip(w, kernel_shape, strict=True) if c in out]
    return (num_members, *r), (num_members, *s)


def effective_kernel(kernel, r_k, s_k, w, out):
    """``kernel * r_k * s_k``, each broadcast over its kernel axes."""
    r_shape = [1 if c in out else d for c, d in zip(w, kernel.shape, strict=True)]
    s_shape = [d if c in out else 1 for c, d in zip(w, kernel.shape, strict=True)]
    return kernel * r_k.reshape(r_shape) * s_k.reshape(s_shape)


def member_axis(einsum_str, ndim):
    """The output axis of the member letter (input axis 0)."""
    x, _, out = explicit(einsum_str, ndim)
    return out.index(x[0])


@functools.cache
def flax_graphdef(einsum_str, kernel_shape, bias_shape):
    layer = nnx.Einsum(
        einsum_str,
        kernel_shape,
        bias_shape,
        precision="highest",
        kernel_init=nnx.initializers.zeros_init(),  # lecun_normal needs 2-D
        rngs=nnx.Rngs(0),
    )
    return nnx.split(layer)[0]


def reference(config, inputs, kernel, r, s, bias, num_members, call_str=None):
    """Member k's rows through ``nnx.Einsum`` with its effective weights (f32).

    ``config`` is ``(einsum_str, kernel_shape, bias_shape)`` of the Flax layer;
    ``call_str`` an einsum string passed at call time instead.
    """
    einsum_str, kernel_shape, bias_shape = config
    f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)  # noqa: E731
    inputs, kernel, r, s, bias = map(f32, (inputs, kernel, r, s, bias))
    used = call_str if call_str is not None else einsum_str
    _, w, out = explicit(used, inputs.ndim)
    graphdef = flax_graphdef(einsum_str, kernel_shape, bias_shape)
    batch = inputs.shape[0] // num_members
    outputs = []
    for k in range(num_members):
        state = {"kernel": nnx.Param(effective_kernel(kernel, r[k], s[k], w, out))}
        if bias is not None:
            state["bias"] = nnx.Param(bias[k])
        layer = nnx.merge(graphdef, nnx.State(state))
        outputs.append(layer(inputs[k * batch : (k + 1) * batch], einsum_str=call_str))
    return jnp.concatenate(outputs, axis=member_axis(used, inputs.ndim))


jitted_reference = jax.jit(
    reference, static_argnames=("config", "num_members", "call_str")
)


def make_args(name, num_members, dtype, use_bias=True, seed=0):
    """``(config, inputs, kernel, r, s, bias)`` for ``CONFIGS[name]``."""
    einsum_str, kernel_shape, bias_shape, member_shape = CONFIGS[name]
    rng = np.random.default_rng(seed)

    def draw(shape, mean=0.0, scale=1.0):
        return jnp.asarray(mean + scale * rng.standard_normal(shape), dtype)

    x = draw((num_members * member_shape[0], *member_shape[1:]))
    r_shape, s_shape = fast_weight_shapes(einsum_str, kernel_shape, x.ndim, num_members)
    kernel = draw(kernel_shape)
    r, s = draw(r_shape, 1.0, 0.5), draw(s_shape, 1.0, 0.5)
    bias = draw((num_members, *bias_shape)) if use_bias else None
    config = (einsum_str, kernel_shape, bias_shape if use_bias else None)
    return config, x, kernel, r, s, bias


def op(config, num_members, **kwargs):
    return functools.partial(
        batch_ensemble_einsum,
        einsum_str=config[0],
        num_members=num_members,
        **kwargs,
    )


# (dtype, num_members, use_bias, jit) variants of the forward.
FORWARD_VARIANTS = [
    (jnp.float32, 1, True, False),
    (jnp.float32, 3, True, True),
    (jnp.float32, 3, False, False),
    (jnp.bfloat16, 3, True, True),
]
# Each configuration eagerly and under jit: two of the four variants, in turn
# (26 of the 52 combinations); every variant runs on six or seven of them.
FORWARD_CASES = covering(
    {
        "dtype": [jnp.float32, jnp.bfloat16],
        "num_members": [1, 3],
        "use_bias": [True, False],
        "jit": [False, True],
        "name": list(CONFIGS),
    },
    [
        (*FORWARD_VARIANTS[(i + j) % 4], name)
        for i, name in enumerate(CONFIGS)
        for j in (0, 1)
    ],
    pairs=[("jit", "name")],
)


@pytest.mark.parametrize("dtype, num_members, use_bias, jit, name", FORWARD_CASES)
def test_forward_matches_flax_einsum_per_member(
    name, dtype, num_members, use_bias, jit
):
    config, *args = make_args(name, num_members, dtype, use_bias)
    fn = op(config, num_members)
    y = (jax.jit(fn) if jit else fn)(*args)
    expected = jitted_reference(config, *args, num_members)
    assert y.dtype == dtype
    assert y.shape == expected.shape
    assert_close(y, expected, dtype, scale=4)


@pytest.fixture
def pallas_interpreted_off_gpu(monkeypatch):
    """Off a GPU, ``impl="pallas"`` runs the real kernel in Pallas' interpreter.

    The einsum op exposes no ``interpret`` (as ``dense_general`` does not); it
    reaches the kernel through ``dense.dense_rows``, which does.
    """
    if jax.default_backend() == "gpu":
        return
    original = dense.dense_rows

    def interpreted(*args, impl="xla", **kwargs):
        if impl == "pallas":
            kwargs["interpret"] = True
        return original(*args, impl=impl, **kwargs)

    monkeypatch.setattr(dense, "dense_rows", interpreted)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["gemma_qkv", "member_not_first", "ellipsis"])
def test_impls_match_reference(impl, name, pallas_interpreted_off_gpu):
    config, *args = make_args(name, 3, jnp.float32)
    y = jax.jit(op(config, 3, impl=impl))(*args)
    assert_close(y, jitted_reference(config, *args, 3), scale=4)


# Every configuration jitted with a bias, in float32 and bfloat16 in turn; the
# eager gradient without a bias (slow: op by op) on three structurally
# different configurations. 16 of the 39 combinations.
EAGER_GRADIENTS = ["ellipsis", "batch_letter_permuted", "outer_product"]
GRADIENT_CASES = covering(
    {
        "dtype": [jnp.float32, jnp.bfloat16],
        "use_bias": [True, False],
        "jit": [False, True],
        "name": list(CONFIGS),
    },
    [
        (jnp.float32 if i % 2 == 0 else jnp.bfloat16, True, True, name)
        for i, name in enumerate(CONFIGS)
    ]
    + [(jnp.float32, False, False, name) for name in EAGER_GRADIENTS],
    pairs=[],
)


@pytest.mark.parametrize("dtype, use_bias, jit, name", GRADIENT_CASES)
def test_gradients_match_jax_grad_of_reference(name, dtype, use_bias, jit):
    num_members = 3
    config, *args = make_args(name, num_members, dtype, use_bias, seed=1)
    cotangent = random_cotangent(jitted_reference(config, *args, num_members).shape)
    argnums = (0, 1, 2, 3, 4) if use_bias else (0, 1, 2, 3)
    grad = jax.grad(
        cotangent_loss(op(config, num_members), cotangent),
        argnums=argnums,
        has_aux=True,
    )
    grads, _ = (jax.jit(grad) if jit else grad)(*args)

    def reference_loss(*a):
        return cotangent_loss(lambda *b: reference(config, *b, num_members), cotangent)(
            *a
        )

    expected, _ = jax.jit(jax.grad(reference_loss, argnums=argnums, has_aux=True))(
        *args
    )
    names = ("inputs", "kernel", "r", "s", "bias")
    for name_, g, e in zip(names, grads, expected, strict=False):
        assert g.shape == e.shape, name_
        assert g.dtype == dtype, name_
        assert_close_to_scale(g, e, dtype, scale=2, err_msg=name_)


@pytest.mark.parametrize("name", ["member_not_first", "ellipsis", "batch_letter"])
def test_member_k_only_sees_its_rows(name):
    config, x, *params = make_args(name, 3, jnp.float32)
    batch = x.shape[0] // 3
    axis = member_axis(config[0], x.ndim)
    fn = op(config, 3)
    y = fn(x, *params)
    y2 = fn(x.at[batch : 2 * batch].add(1.0), *params)
    for k in (0, 2):
        rows = np.arange(k * batch, (k + 1) * batch)
        np.testing.assert_array_equal(y.take(rows, axis), y2.take(rows, axis))
    rows = np.arange(batch, 2 * batch)
    assert not np.allclose(y.take(rows, axis), y2.take(rows, axis))


def test_preferred_element_type():
    config, *args = make_args("gemma_qkv", 2, jnp.bfloat16)
    y = op(config, 2, preferred_element_type=jnp.float32)(*args)
    assert y.dtype == jnp.float32
    assert_close(y, jitted_reference(config, *args, 2), jnp.bfloat16)


def test_precision_is_passed_to_every_contraction():
    config, *args = make_args("gemma_out", 2, jnp.float32)
    hlo = jax.jit(op(config, 2, precision="highest")).lower(*args).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert dots and all("HIGHEST" in line for line in dots), dots


class TestErrors:
    @pytest.mark.parametrize(
        "einsum_str, input_shape, kernel_shape",
        [
            ("BTD,DZ->BT", (4, 3, 7), (7, 5)),  # kernel letter Z in no other
            ("BTD,BDH->BTH", (4, 3, 7), (2, 7, 5)),  # member letter in the kernel
            ("ecd,edf->ecf", (4, 3, 7), (4, 7, 5)),  # ... as a batch letter
            ("BTD,DH->TH", (4, 3, 7), (7, 5)),  # member letter not in the output
            ("BDD,DH->BH", (4, 7, 7), (7, 5)),  # repeated letter in the input
            ("BTD,DD->BTD", (4, 3, 7), (7, 7)),  # repeated letter in the kernel
            ("BTD,DH", (4, 3, 7), (7, 5)),  # no "->"
            ("BTD->BTD", (4, 3, 7), (7, 5)),  # one operand
            ("BTD,DH,HK->BTK", (4, 3, 7), (7, 5)),  # three operands
        ],
    )
    def test_bad_einsum_str(self, einsum_str, input_shape, kernel_shape):
        x = jnp.ones(input_shape)
        w = jnp.ones(kernel_shape)
        with pytest.raises(ValueError, match=r"einsum_str"):
            batch_ensemble_einsum(
                x,
                w,
                jnp.ones((2, 7)),
                jnp.ones((2, 5)),
                einsum_str=einsum_str,
                num_members=2,
            )

    @pytest.mark.parametrize(
        "name, bad, match",
        [
            ("inputs", (4, 3, 6), r"`(inputs|kernel)"),  # D differs from the kernel's
            ("inputs", (4, 7), r"`inputs|einsum_str"),  # rank does not match "BTD"
            ("kernel", (3, 6, 5), r"`(inputs|kernel)"),
            ("kernel", (3, 7), r"`kernel|einsum_str"),
            ("r", (2, 6), r"`r`"),
            ("r", (3, 7), r"`r`"),
            ("s", (2, 3, 4), r"`s`"),
            ("s", (2, 15), r"`s`"),
            ("bias", (2, 14), r"`bias`"),
            ("bias", (3, 3, 5), r"`bias`"),
        ],
    )
    def test_shape_mismatch(self, name, bad, match):
        config, *arrays = make_args("gemma_qkv", 2, jnp.float32)
        args = dict(zip(("inputs", "kernel", "r", "s", "bias"), arrays, strict=True))
        args[name] = jnp.ones(bad)
        with pytest.raises(ValueError, match=match):
            batch_ensemble_einsum(**args, einsum_str=config[0], num_members=2)

    def test_batch_not_multiple_of_members(self):
        config, x, *params = make_args("gemma_qkv", 2, jnp.float32)
        with pytest.raises(
            ValueError, match=r"inputs.shape\[0\]`? \(=3\).*num_members"
        ):
            batch_ensemble_einsum(x[:3], *params, einsum_str=config[0], num_members=2)

    @pytest.mark.parametrize("impl", ["cuda", "auto"])
    def test_unknown_impl(self, impl):
        config, *args = make_args("gemma_qkv", 2, jnp.float32)
        with pytest.raises(
            ValueError,
            match=rf"`impl` must be one of \['xla', 'pallas'\], got '{impl}'",
        ):
            op(config, 2, impl=impl)(*args)


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_property_random_einsum_strings(data):
    """Random equations: every kind of letter, in random orders, random sizes."""
    letters = iter("abcdefghijklmnopqrstuvwxy")
    draw_letters = lambda n: "".join(next(letters) for _ in range(n))  # noqa: E731
    batch, contracted, kept, free, summed = (
        draw_letters(data.draw(st.integers(0, hi))) for hi in (2, 2, 2, 2, 1)
    )
    permute = lambda s: "".join(data.draw(st.permutations(s))) if s else ""  # noqa: E731
    x = "z" + permute(batch + contracted + free + summed)
    w = permute(batch + contracted + kept)
    out = permute("z" + batch + kept + free)
    if not w:
        w, contracted = "q", "q"
        x += "q"
    sizes = {c: data.draw(st.integers(1, 4)) for c in x + w}
    num_members = data.draw(st.integers(1, 3))
    use_bias = data.draw(st.booleans())
    seed = data.draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    draw = lambda shape, mean=0.0: jnp.asarray(  # noqa: E731
        mean + rng.standard_normal(shape), jnp.float32
    )
    sizes["z"] = data.draw(st.integers(1, 3))
    inputs = draw((num_members * sizes["z"], *(sizes[c] for c in x[1:])))
    kernel_shape = tuple(sizes[c] for c in w)
    kernel = draw(kernel_shape)
    r = draw((num_members, *(sizes[c] for c in w if c not in out)), 1.0)
    s = draw((num_members, *(sizes[c] for c in w if c in out)), 1.0)
    bias_shape = (int(np.prod([sizes[c] for c in out if c in w])),)
    bias = draw((num_members, *bias_shape)) if use_bias else None
    einsum_str = f"{x},{w}->{out}"
    note(einsum_str)
    config = (einsum_str, kernel_shape, bias_shape if use_bias else None)
    args = (inputs, kernel, r, s, bias)
    y = op(config, num_members)(*args)
    assert_close(y, jitted_reference(config, *args, num_members), scale=4)
