"""ensembles.multihost, member sharding and the dense op's choice, in one process.

The same functions across 2 processes: tests/test_multiprocess.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

import ensembles
from ensembles import multihost
from ensembles.layers import shard_members
from ensembles.ops import groups


def one_device_mesh(names=("data",)):
    return jax.make_mesh(
        (1,) * len(names),
        names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(names),
        devices=jax.devices()[:1],
    )


def spec(variable):
    return tuple(variable.get_metadata().get("out_sharding") or ())


# ------------------------------------------------------------ rows and batches


def test_process_rows_in_one_process_are_every_row():
    rows = NamedSharding(one_device_mesh(), PartitionSpec("data"))
    np.testing.assert_array_equal(multihost.process_rows(rows, 6), np.arange(6))


@pytest.mark.parametrize(
    "sharding",
    [jax.sharding.SingleDeviceSharding(jax.devices()[0]), "data", None],
)
def test_process_rows_names_a_sharding_that_is_not_named(sharding):
    with pytest.raises(TypeError, match=r"`sharding` must be a jax\.sharding\.Named"):
        multihost.process_rows(sharding, 4)


@pytest.mark.parametrize("num_rows", [0, -2, 2.5, "4"])
def test_process_rows_names_a_bad_row_count(num_rows):
    rows = NamedSharding(one_device_mesh(), PartitionSpec("data"))
    with pytest.raises((TypeError, ValueError), match="num_rows"):
        multihost.process_rows(rows, num_rows)


def test_global_batch_places_every_leaf_by_its_rows():
    mesh = one_device_mesh(("data", "model"))
    rows = NamedSharding(mesh, PartitionSpec("data", "model"))
    x = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    y = np.arange(4)  # fewer axes than the spec: placed by its rows
    batch = multihost.global_batch(rows, {"x": x, "y": y}, num_rows=4)
    np.testing.assert_array_equal(batch["x"], x)
    np.testing.assert_array_equal(batch["y"], y)
    assert batch["x"].sharding == rows
    assert batch["y"].sharding.spec == PartitionSpec("data")


def test_global_batch_names_the_leaf_that_holds_other_rows():
    rows = NamedSharding(one_device_mesh(), PartitionSpec("data"))
    with pytest.raises(ValueError, match=r"`\['y'\]` must hold this process's 4"):
        multihost.global_batch(
            rows, {"x": np.ones((4, 2)), "y": np.ones(3)}, num_rows=4
        )


# ------------------------------------------------------------- reading back


def test_to_host_reads_a_model_state():
    layer = ensembles.BatchEnsembleLinear(3, 2, num_members=2, rngs=nnx.Rngs(0))
    host = multihost.to_host(nnx.state(layer))
    assert isinstance(host["r"].get_value(), np.ndarray)
    np.testing.assert_array_equal(host["r"].get_value(), layer.r[...])


def test_check_replicas_passes_where_every_copy_agrees():
    layer = ensembles.BatchEnsembleLinear(3, 2, num_members=2, rngs=nnx.Rngs(0))
    multihost.check_replicas(nnx.state(layer))
    multihost.check_replicas({"host": np.ones(3), "device": jnp.zeros(2)})


# ------------------------------------------------ the dense op's formulation


def _traced_row_shards(x):
    """What :func:`groups.row_shards` says of ``x`` traced by ``jax.jit``."""
    seen = []
    jax.jit(lambda x: seen.append(groups.row_shards(x)) or x).trace(x)
    return seen[0]


def test_row_shards_follows_the_array_and_the_mesh():
    x = jnp.ones((4, 3))
    assert groups.row_shards(x) is None  # placed on one device
    assert _traced_row_shards(x) is None  # a program with no mesh: one device's
    with jax.sharding.use_abstract_mesh(AbstractMesh((2,), ("data",))):
        assert _traced_row_shards(x) == 2  # a mesh of two in context
    with multihost.local_mesh() as mesh:
        assert mesh.size == 1
        assert _traced_row_shards(x) is None


# ----------------------------------------------------- members over an axis


def test_shard_members_annotates_every_per_member_array_and_no_kernel():
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(
        ensembles.BatchEnsembleConv(2, 3, (3,), num_members=4, rngs=rngs),
        ensembles.EnsembleLayerNorm(3, num_members=4, rngs=rngs),
        ensembles.EnsembleBatchNorm(3, num_members=4, rngs=rngs),
        ensembles.BatchEnsembleLinear(
            3, 3, num_members=4, posterior="gaussian", rngs=rngs
        ),
        ensembles.EnsembleLinear(3, 2, num_members=4, rngs=rngs),
    )
    assert shard_members(model, "data") is model
    conv, norm, batch_norm, rank1, head = model.layers
    for variable in (conv.r, conv.s, conv.bias, norm.scale, norm.bias):
        assert spec(variable)[0] == "data"
    for variable in (batch_norm.mean, batch_norm.var, batch_norm.scale):
        assert spec(variable) == ("data", None)
    assert spec(rank1.r_unconstrained_stddev) == ("data", None)
    assert spec(head.kernel) == ("data", None, None)  # a kernel per member
    assert spec(conv.kernel) == () and spec(rank1.kernel) == ()  # shared


def test_shard_members_keeps_the_feature_axes_annotated():
    with jax.set_mesh(one_device_mesh(("data", "model"))):
        layer = ensembles.BatchEnsembleLinear(
            3,
            4,
            num_members=2,
            bias_metadata={"out_sharding": (None, "model")},
            kernel_metadata={"out_sharding": (None, "model")},
            rngs=nnx.Rngs(0),
        )
        shard_members(layer, "data")
    assert spec(layer.bias) == ("data", "model")
    assert spec(layer.kernel) == (None, "model")


def test_shard_members_puts_the_member_axis_after_layer_axes():
    @nnx.split_rngs(splits=3)
    @nnx.vmap(axis_size=3)
    def stack(rngs):
        return ensembles.BatchEnsembleLinear(4, 4, num_members=2, rngs=rngs)

    layers = shard_members(stack(nnx.Rngs(0)), "data")
    assert layers.r.shape == (3, 2, 4)
    assert spec(layers.r) == (None, "data", None)


def test_shard_members_refuses_a_conflicting_annotation_and_changes_nothing():
    with jax.set_mesh(one_device_mesh(("data", "model"))):
        layer = ensembles.BatchEnsembleLinear(
            3,
            4,
            num_members=2,
            bias_metadata={"out_sharding": ("model", None)},
            rngs=nnx.Rngs(0),
        )
        with pytest.raises(
            ValueError,
            match="cannot go on the member axis of `BatchEnsembleLinear/bias`",
        ):
            shard_members(layer, "data")
    assert spec(layer.r) == ()  # checked first, annotated after: nothing set


def test_shard_members_refuses_an_axis_that_does_not_divide_the_members():
    layer = ensembles.BatchEnsembleLinear(3, 4, num_members=3, rngs=nnx.Rngs(0))
    with (
        jax.sharding.use_abstract_mesh(AbstractMesh((2,), ("data",))),
        pytest.raises(ValueError, match=r"do not divide .*num_members=3"),
    ):
        shard_members(layer, "data")
    assert spec(layer.r) == ()


def test_shard_members_names_an_axis_that_is_not_a_string():
    layer = ensembles.BatchEnsembleLinear(3, 4, num_members=2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="`member_axis` must be a mesh axis name"):
        shard_members(layer, 0)


def test_to_batch_ensemble_shards_members_on_request():
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(
        nnx.Linear(3, 4, rngs=rngs),
        nnx.LayerNorm(4, rngs=rngs),
        nnx.Linear(4, 2, rngs=rngs),
    )
    converted = ensembles.to_batch_ensemble(
        model,
        num_members=2,
        rngs=nnx.Rngs(1),
        norms="member",
        independent=lambda path, node: path[-1] == 2,
        member_axis="data",
    )
    first, norm, head = converted.layers
    assert spec(first.r) == ("data", None) and spec(first.kernel) == ()
    assert spec(norm.scale) == ("data", None)
    assert spec(head.kernel) == ("data", None, None)
    assert spec(model.layers[0].kernel) == ()  # the original is untouched
    plain = ensembles.to_batch_ensemble(model, num_members=2, rngs=nnx.Rngs(1))
    assert spec(plain.layers[0].r) == ()


def test_to_batch_ensemble_checks_member_axis_before_drawing():
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)))
    rngs = nnx.Rngs(1)
    before = rngs.params.count[...]
    with pytest.raises(TypeError, match="`member_axis` must be a mesh axis name"):
        ensembles.to_batch_ensemble(model, num_members=2, rngs=rngs, member_axis=1)
    assert rngs.params.count[...] == before


# ------------------------------------------------- parameters placed (issue 67)


def _converted(seed):
    model = ensembles.to_batch_ensemble(
        nnx.Linear(3, 2, rngs=nnx.Rngs(seed)), num_members=2, rngs=nnx.Rngs(seed),
        member_axis="data",
    )  # fmt: skip
    return nnx.split(model, nnx.Param)[1]


def test_place_state_places_every_array_as_annotated():
    mesh = one_device_mesh()
    params = _converted(0)
    placed = multihost.place_state(params, mesh)
    specs = nnx.get_partition_spec(params)
    expected = jax.device_put(
        params, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    )
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.sharding == b.sharding
    assert placed["r"][...].sharding.spec == PartitionSpec("data", None)
    with pytest.raises(TypeError, match=r"`mesh` must be a jax\.sharding\.Mesh"):
        multihost.place_state(params, "data")


def test_a_different_seed_per_process_is_caught_at_placement(monkeypatch):
    """Two processes, faked: this one's digests and those of a process that
    built the model from another seed. The error names both causes."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    tables = []

    def gather(table):
        tables.append(np.asarray(table))
        return np.stack([tables[0], tables[-1]])

    monkeypatch.setattr(multihost.multihost_utils, "process_allgather", gather)
    multihost.check_replicas(_converted(1))  # the other process's digests
    with pytest.raises(ValueError, match="copies differ between processes") as info:
        multihost.place_state(_converted(0), one_device_mesh())
    message = str(info.value)
    assert "different seed per process" in message and "global_batch" in message
    multihost.check_replicas(_converted(1))  # the same values: no error
