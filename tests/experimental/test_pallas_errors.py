"""``impl="pallas"``'s options and errors: what it accepts, and what it names.

The kernel is opt-in: ``impl`` is ``"xla"`` (the default) or ``"pallas"``;
``interpret`` and ``block_sizes`` configure the kernel and are refused
without it; :class:`~ensembles.experimental.pallas.BlockSizes` checks its
tiles; operands the kernel cannot run raise a ``TypeError`` that names the
fix.
"""

import jax.numpy as jnp
import pytest

import ensembles
from ensembles.experimental.pallas import BlockSizes
from ensembles.ops import IMPLS, batch_ensemble_dense
from tests.reference import make_args


def test_impls_and_errors():
    assert IMPLS == ("xla", "pallas")
    args = make_args(0, 2, 3, (), 4, 5, jnp.float32)
    for impl in ("auto", "triton"):
        with pytest.raises(
            ValueError,
            match=rf"`impl` must be one of \['xla', 'pallas'\], got '{impl}'",
        ):
            batch_ensemble_dense(*args, num_members=2, impl=impl)
    # The kernel's options live with the kernel, not in ensembles.ops.
    assert not hasattr(ensembles.ops, "BlockSizes")


class TestErrors:
    def args(self, dtype=jnp.float32):
        return make_args(0, 2, 3, (), 4, 5, dtype)

    @pytest.mark.parametrize(
        "field, value", [("block_b", 24), ("block_out", 8), ("block_k", 0)]
    )
    def test_block_size_values(self, field, value):
        with pytest.raises(
            ValueError,
            match=rf"`BlockSizes.{field}` must be a power of two >= 16, got {value}",
        ):
            BlockSizes(**{field: value})

    @pytest.mark.parametrize("value", [32.0, True, "32"])
    def test_block_size_types(self, value):
        with pytest.raises(TypeError, match=r"`BlockSizes.block_k` must be an int"):
            BlockSizes(block_k=value)

    def test_block_sizes_is_frozen(self):
        with pytest.raises(AttributeError):
            BlockSizes().block_b = 32

    def test_block_sizes_type(self):
        with pytest.raises(TypeError, match=r"`block_sizes` must be an .*BlockSizes"):
            batch_ensemble_dense(
                *self.args(), num_members=2, impl="pallas", block_sizes=(16, 16, 16)
            )

    @pytest.mark.parametrize("dtype", [jnp.float16, jnp.int32])
    def test_unsupported_dtype(self, dtype):
        with pytest.raises(
            TypeError,
            match=rf"supports dtypes \['float32', 'bfloat16'\], got "
            rf"{jnp.dtype(dtype).name}.*impl=\"xla\"",
        ):
            batch_ensemble_dense(*self.args(dtype), num_members=2, impl="pallas")

    def test_mixed_dtypes(self):
        x, kernel, r, s, bias = self.args()
        with pytest.raises(
            TypeError, match=r"one dtype, got inputs=float32, kernel=bfloat16"
        ):
            batch_ensemble_dense(
                x, kernel.astype(jnp.bfloat16), r, s, bias, num_members=2, impl="pallas"
            )

    def test_preferred_element_type(self):
        with pytest.raises(TypeError, match=r"`preferred_element_type`.*bfloat16"):
            batch_ensemble_dense(
                *self.args(),
                num_members=2,
                impl="pallas",
                preferred_element_type=jnp.bfloat16,
            )

    @pytest.mark.parametrize("impl", [{}, {"impl": "xla"}], ids=["default", "xla"])
    @pytest.mark.parametrize(
        "kwargs, name",
        [
            ({"interpret": True}, "interpret"),
            ({"block_sizes": BlockSizes()}, "block_sizes"),
        ],
    )
    def test_pallas_options_with_xla(self, kwargs, name, impl):
        # Named, with the impl asked for and the fix; the default is "xla".
        with pytest.raises(
            ValueError,
            match=rf"`{name}` configures the Pallas kernel, but impl='xla' .*"
            rf'Use impl="pallas", or drop `{name}`',
        ):
            batch_ensemble_dense(*self.args(), num_members=2, **impl, **kwargs)

    def test_interpret_type(self):
        with pytest.raises(TypeError, match=r"`interpret` must be a bool"):
            batch_ensemble_dense(
                *self.args(), num_members=2, impl="pallas", interpret="yes"
            )

    def test_shape_errors_unchanged(self):
        x, kernel, r, s, bias = self.args()
        with pytest.raises(ValueError, match=r"inputs.shape\[0\]` \(=5\)"):
            batch_ensemble_dense(
                x[:5], kernel, r, s, bias, num_members=2, impl="pallas"
            )


def test_each_family_takes_its_own_interpreters_parameters():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas import tpu as pltpu

    from ensembles.experimental.pallas import fused_dense

    args = make_args(0, 2, 4, (), 8, 8, jnp.bfloat16)
    with pytest.raises(
        TypeError, match=r"family=\"hopper\" runs in jax's Mosaic GPU interpreter"
    ):
        fused_dense(*args, family="hopper", interpret=pltpu.InterpretParams())
    if hasattr(plgpu, "InterpretGPUParams"):  # jax >= 0.12
        for family in ("gpu", "tpu", None):
            with pytest.raises(
                TypeError, match=r"configures jax's Mosaic GPU interpreter"
            ):
                fused_dense(*args, family=family, interpret=plgpu.InterpretGPUParams())
