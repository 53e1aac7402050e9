"""What every weight layer shares (layers/base.py): promote_dtype and views.

* A custom ``promote_dtype`` written to Flax's contract (it takes and returns
  ``(inputs, kernel, bias)``) works after conversion, in every weight layer,
  and gives what the Flax layer gives.
* ``nnx.view(model, impl=...)`` on a model mixing dense and conv layers sets
  the implementation where a layer has it and leaves the rest; a name no op
  knows raises.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from tests.models import ONES, random_input
from tests.tolerances import assert_close

CALLS = []


def promote_to_bfloat16(args, /, *, dtype=None, inexact=True):
    """A promote_dtype of Flax's contract that computes in bfloat16."""
    _inputs, _kernel, _bias = args  # fails on anything but the 3-tuple
    CALLS.append(dtype)
    return tuple(None if a is None else jnp.asarray(a, jnp.bfloat16) for a in args)


def _layers(rngs):
    kw = {"promote_dtype": promote_to_bfloat16, "rngs": rngs}
    return {
        "linear": (nnx.Linear(4, 3, **kw), (6, 4)),
        "linear_general": (nnx.LinearGeneral(4, (2, 3), **kw), (6, 4)),
        "conv": (nnx.Conv(4, 3, (3,), **kw), (6, 5, 4)),
        "conv_transpose": (nnx.ConvTranspose(4, 3, (3,), **kw), (6, 5, 4)),
        "einsum": (nnx.Einsum("bd,dh->bh", (4, 3), (3,), **kw), (6, 4)),
    }


@pytest.mark.parametrize(
    "name", ["linear", "linear_general", "conv", "conv_transpose", "einsum"]
)
def test_a_flax_contract_promote_dtype_survives_conversion(name):
    flax_layer, shape = _layers(nnx.Rngs(0))[name]
    model = nnx.Sequential(flax_layer)
    ensemble = ensembles.to_batch_ensemble(
        model, num_members=2, rngs=nnx.Rngs(1), **ONES
    )
    converted = ensemble.layers[0]
    assert converted.promote_dtype is promote_to_bfloat16
    x = random_input(0, shape)
    CALLS.clear()
    y = ensemble(ensembles.tile(x, 2))
    assert CALLS == [None]
    assert y.dtype == jnp.bfloat16
    expected = flax_layer(x)
    assert expected.dtype == jnp.bfloat16
    for k in range(2):
        assert_close(y[k * 6 : (k + 1) * 6], expected, dtype=jnp.bfloat16)
    # ... and member views and the extracted member too.
    assert_close(nnx.view(ensemble, member=1)(x), expected, dtype=jnp.bfloat16)
    assert_close(ensembles.extract_member(ensemble, 1)(x), expected, jnp.bfloat16)


def test_promote_dtype_casts_the_fast_weights_to_the_kernel_dtype():
    layer = ensembles.BatchEnsembleLinear(
        4, 3, num_members=2, promote_dtype=promote_to_bfloat16, rngs=nnx.Rngs(0)
    )
    x = random_input(0, (4, 4))
    kernel = np.asarray(layer.kernel[...].astype(jnp.bfloat16), np.float32)
    r = np.asarray(layer.r[...].astype(jnp.bfloat16), np.float32)
    s = np.asarray(layer.s[...].astype(jnp.bfloat16), np.float32)
    xb = np.asarray(x.astype(jnp.bfloat16), np.float32)
    expected = np.concatenate(
        [xb[2 * k : 2 * k + 2] @ (kernel * np.outer(r[k], s[k])) for k in range(2)]
    )
    y = layer(x)
    assert y.dtype == jnp.bfloat16
    assert_close(y, expected, dtype=jnp.bfloat16)


class MixedModel(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        self.transpose = nnx.ConvTranspose(4, 4, (3, 3), rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.transpose(self.conv(x)).mean(axis=(1, 2)))


def test_a_whole_model_impl_view_sets_what_each_layer_supports():
    model = ensembles.to_batch_ensemble(
        MixedModel(nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(1)
    )
    view = nnx.view(model, impl="pallas")
    assert view.head.impl == "pallas"
    assert view.conv.impl == model.conv.impl
    assert view.transpose.impl == model.transpose.impl
    xla = nnx.view(model, impl="xla")
    assert {xla.head.impl, xla.conv.impl, xla.transpose.impl} == {"xla"}
    x = ensembles.tile(random_input(0, (3, 6, 6, 3)), 2)
    np.testing.assert_array_equal(xla(x), model(x))


def test_an_impl_no_op_knows_raises_and_changes_nothing():
    model = ensembles.to_batch_ensemble(
        MixedModel(nnx.Rngs(0)), num_members=2, rngs=nnx.Rngs(1)
    )
    before = (model.head.impl, model.conv.impl)
    with pytest.raises(ValueError, match=r"`impl` must be one of .*got 'palas'"):
        nnx.view(model, impl="palas")
    assert (model.head.impl, model.conv.impl) == before
