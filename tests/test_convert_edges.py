"""Conversion on a new user's second day (issue 67).

Each case is a call that a user following the docs made and that failed or
did something else than they asked, checked against an independent
reference (the plain model, a per-member loop of ``nnx.Linear`` layers) or
the docs' own contract:

* a stack of ``nnx.Linear`` layers (built with ``nnx.vmap`` for
  ``nnx.scan``) selected by ``independent=`` converts layer by layer;
* a second ``to_batch_ensemble(..., independent=head)`` is a no-op, as any
  second conversion is;
* ``member_axis`` naming no axis of the mesh in context is refused at
  conversion, not at placement;
* ``extract_member`` of a model converted with ``member_axis=`` works
  outside a mesh, fresh or restored;
* the restore of ``docs/converting.md``: ``independent=`` must be repeated,
  ``member_axis`` need not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType

import ensembles
from ensembles import initializers

E = 3


@nnx.split_rngs(splits=3)
@nnx.vmap(axis_size=3)
def _stack_of_three(rngs):
    return nnx.Linear(8, 8, rngs=rngs)


class Scanned(nnx.Module):
    """A stack of three layers built under nnx.vmap for nnx.scan, then a head."""

    def __init__(self, rngs):
        self.inputs = nnx.Linear(4, 8, rngs=rngs)
        self.body = _stack_of_three(rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x, layer):
            return nnx.relu(layer(x))

        return self.head(step(nnx.relu(self.inputs(x)), self.body))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(4, 8, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.body(x)))


def _is_body(path, node):
    return path[:1] == ("body",)


def _is_head(path, node):
    return path[-1:] == ("head",)


X = jax.random.normal(jax.random.key(0), (5, 4))


def _assert_untouched(before, rngs):
    """``rngs`` as ``before`` (its state then): no key drawn."""
    assert jax.tree.all(
        jax.tree.map(lambda a, b: bool(jnp.all(a == b)), before, nnx.state(rngs))
    )


def _states_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, nnx.state(a), nnx.state(b))


# --- 1. a stack made independent -------------------------------------------------


def test_a_stacked_linear_becomes_independent_layer_by_layer():
    model = Scanned(nnx.Rngs(0))
    exact = ensembles.to_batch_ensemble(
        model, num_members=E, rngs=nnx.Rngs(1), independent=_is_body,
        r_init=initializers.ones(), s_init=initializers.ones(),
    )  # fmt: skip
    body = exact.body
    assert type(body) is ensembles.EnsembleLinear
    assert body.kernel.shape == (3, E, 8, 8) and body.bias.shape == (3, E, 8)
    for k in range(E):  # every member a copy of every layer
        np.testing.assert_array_equal(body.kernel[...][:, k], model.body.kernel[...])
    # Exact: every member computes what the plain model does.
    outputs = ensembles.untile(exact(ensembles.tile(X, E)), E)
    for k in range(E):
        np.testing.assert_allclose(outputs[k], model(X), rtol=1e-5, atol=1e-6)

    fresh = ensembles.to_batch_ensemble(
        model, num_members=E, rngs=nnx.Rngs(1), independent=_is_body,
        independent_init=nnx.initializers.lecun_normal(),
    )  # fmt: skip
    kernel = np.asarray(fresh.body.kernel[...])
    assert not np.allclose(kernel[0, 0], kernel[0, 1])  # members drawn apart
    assert not np.allclose(kernel[0, 0], kernel[1, 0])  # and layers
    # A member comes back as the stack the model's scan expects, computing
    # what the member computes in the ensemble.
    outputs = ensembles.untile(fresh(ensembles.tile(X, E)), E)
    for k in range(E):
        member = ensembles.extract_member(fresh, k)
        assert type(member.body) is nnx.Linear
        np.testing.assert_array_equal(member.body.kernel[...], kernel[:, k])
        np.testing.assert_allclose(member(X), outputs[k], rtol=1e-5, atol=1e-5)


# --- 2. a second conversion -------------------------------------------------------


@pytest.mark.parametrize("select", [_is_head, _is_body], ids=["head", "stack"])
def test_a_second_conversion_with_independent_is_a_no_op(select):
    model = Scanned(nnx.Rngs(0))
    once = ensembles.to_batch_ensemble(
        model, num_members=E, rngs=nnx.Rngs(1), independent=select
    )
    twice = ensembles.to_batch_ensemble(
        once, num_members=E, rngs=nnx.Rngs(2), independent=select
    )
    _states_equal(once, twice)
    assert twice is not once  # a copy, as documented
    x = ensembles.tile(X, E)
    np.testing.assert_array_equal(twice(x), once(x))


def test_independent_on_a_layer_already_converted_says_how():
    """A BatchEnsemble layer cannot become independent: its fast weights would
    be lost. The error names it and the way (convert the plain model)."""
    once = ensembles.to_batch_ensemble(Model(nnx.Rngs(0)), num_members=E,
                                       rngs=nnx.Rngs(1))  # fmt: skip
    rngs = nnx.Rngs(2)
    before = nnx.state(rngs)
    with pytest.raises(ValueError, match=r"head \(BatchEnsembleLinear, converted\)"):
        ensembles.to_batch_ensemble(once, num_members=E, rngs=rngs,
                                    independent=_is_head)  # fmt: skip
    assert type(once.head) is ensembles.BatchEnsembleLinear
    _assert_untouched(before, rngs)


# --- 3. member_axis and the mesh ------------------------------------------------------


def _mesh():
    return jax.make_mesh(
        (1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1]
    )


def test_a_member_axis_the_mesh_lacks_is_refused_at_conversion():
    model = Model(nnx.Rngs(0))
    rngs = nnx.Rngs(1)
    before = nnx.state(rngs)
    with jax.set_mesh(_mesh()):
        with pytest.raises(
            ValueError,
            match=r"`member_axis='model'` names no axis of the mesh.*\('data',\)",
        ):
            ensembles.to_batch_ensemble(
                model, num_members=E, rngs=rngs, member_axis="model"
            )
        _assert_untouched(before, rngs)
        assert type(model.head) is nnx.Linear
        # The axis it has is taken.
        ensembles.to_batch_ensemble(model, num_members=E, rngs=rngs,
                                    member_axis="data")  # fmt: skip
    # Outside a mesh the annotation alone is set (checked when placed).
    converted = ensembles.to_batch_ensemble(
        model, num_members=E, rngs=nnx.Rngs(1), member_axis="model"
    )
    specs = nnx.get_partition_spec(nnx.state(converted))
    assert tuple(specs["head"]["r"].get_value()) == ("model", None)


# --- 4. extract_member outside a mesh ----------------------------------------------


def _member_outputs(model):
    return ensembles.untile(model(ensembles.tile(X, E)), E)


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_extract_member_of_a_member_axis_model_outside_a_mesh(where):
    model = Model(nnx.Rngs(0))
    with jax.set_mesh(_mesh()) if where == "inside" else _nothing():
        converted = ensembles.to_batch_ensemble(
            model, num_members=E, rngs=nnx.Rngs(1), member_axis="data",
            independent=_is_head,
        )  # fmt: skip
    outputs = _member_outputs(converted)
    for k in range(E):
        member = ensembles.extract_member(converted, k)  # no mesh here
        assert type(member.body) is nnx.Linear
        np.testing.assert_allclose(member(X), outputs[k], rtol=1e-5, atol=1e-6)
    # The member keeps its annotations, without the member axis.
    bias = nnx.get_partition_spec(nnx.state(member))["body"]["bias"].get_value()
    assert tuple(bias) == (None,)
    with jax.set_mesh(_mesh()):  # and inside a mesh, as before
        member = ensembles.extract_member(converted, 1)
    np.testing.assert_allclose(member(X), outputs[1], rtol=1e-5, atol=1e-6)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# --- 5. the restore of docs/converting.md ------------------------------------------


def _save(model, path):
    _, state = nnx.split(model)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
    return checkpointer


def _restore(checkpointer, path, **options):
    abstract = nnx.eval_shape(
        lambda: ensembles.to_batch_ensemble(
            Model(nnx.Rngs(0)), num_members=E, rngs=nnx.Rngs(1), **options
        )
    )
    graphdef, abstract_state = nnx.split(abstract)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract_state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one_device),
        abstract_state,
    )
    return nnx.merge(graphdef, checkpointer.restore(path, abstract_state))


def test_a_restore_repeats_independent_and_may_leave_member_axis_out(tmp_path):
    saved = ensembles.to_batch_ensemble(
        Model(nnx.Rngs(5)), num_members=E, rngs=nnx.Rngs(6), member_axis="data",
        independent=_is_head,
    )  # fmt: skip
    checkpointer = _save(saved, tmp_path / "ckpt")
    restored = _restore(checkpointer, tmp_path / "ckpt", independent=_is_head)
    np.testing.assert_array_equal(_member_outputs(restored), _member_outputs(saved))
    # With member_axis repeated too: the same arrays, annotated; a member of
    # it is extracted outside a mesh.
    annotated = _restore(
        checkpointer, tmp_path / "ckpt", independent=_is_head, member_axis="data"
    )
    member = ensembles.extract_member(annotated, 2)
    np.testing.assert_allclose(
        member(X), _member_outputs(saved)[2], rtol=1e-5, atol=1e-6
    )
    # Without independent= the structure differs: orbax refuses.
    with pytest.raises(ValueError, match="do not match"):
        _restore(checkpointer, tmp_path / "ckpt")


def test_the_converting_page_says_what_to_repeat():
    from pathlib import Path

    page = Path(__file__).parents[1].joinpath("docs", "converting.md").read_text()
    restore = page[page.index("What must be repeated at restore") :][:1500]
    assert "`independent`" in restore and "`member_axis`" in restore
