"""Sharded training: a converted MLP on a mesh of 8 (host) devices.

The parent pytest process has one CPU device, so the sharded runs happen in a
subprocess started with ``--xla_force_host_platform_device_count=8``. It trains
the same converted MLP unsharded (the one-device formulation of the dense op)
and on each mesh, and reports the final parameters, their placement and the
all-gathers of each compiled step as JSON; the tests compare and count here.
"""

from __future__ import annotations

import functools
import json
import math

try:
    import fcntl
except ImportError:  # not POSIX: each xdist worker runs the subprocess
    fcntl = None
import os
import subprocess
import sys
import textwrap
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensembles
from ensembles.layers import sharding
from ensembles.ops import dense
from ensembles.ops import groups as groups_module

SCRIPT = textwrap.dedent(
    """
    import contextlib, json, re, sys, time
    from unittest import mock

    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import ensembles
    from ensembles.ops import groups

    IN, HIDDEN, OUT, STEPS = 16, 32, 8, 4


    def numpy_normal(stddev, mean=0.0):
        # Seeded by the key, drawn with numpy: jax.random would compile for
        # every shape and placement (half of this script's time).
        def init(key, shape, dtype=jnp.float32):
            seed = np.asarray(jax.random.key_data(key), np.uint32).ravel().tolist()
            draw = np.random.default_rng(seed).standard_normal(shape)
            return jnp.asarray(mean + stddev * draw, dtype)

        return init


    FAST_WEIGHTS = {"r_init": numpy_normal(0.5, 1.0), "s_init": numpy_normal(0.5, 1.0)}


    def mlp(model_axis):
        # Kernels' output features (and the biases) over `model_axis`, if any.
        meta = {}
        if model_axis:
            meta = {
                "kernel_metadata": {"out_sharding": (None, model_axis)},
                "bias_metadata": {"out_sharding": (model_axis,)},
            }
        rngs = nnx.Rngs(0)
        init = numpy_normal(0.2)
        return nnx.Sequential(
            nnx.Linear(IN, HIDDEN, kernel_init=init, rngs=rngs, **meta), nnx.relu,
            nnx.Linear(HIDDEN, HIDDEN, kernel_init=init, rngs=rngs, **meta), nnx.relu,
            nnx.Linear(HIDDEN, OUT, kernel_init=init, rngs=rngs, **meta),
        )


    def all_gathers(hlo):
        # The result shapes of every all-gather in the compiled module.
        return re.findall(r"= (.+?) all-gather(?:-start)?\\(", hlo)


    def train(num_members, batch, mesh=None, model_axis=None):
        rng = np.random.default_rng(0)
        x = ensembles.tile(
            jnp.asarray(rng.standard_normal((batch, IN)), jnp.float32),
            num_members)
        targets = jnp.asarray(
            rng.standard_normal((num_members * batch, OUT)), jnp.float32)
        with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
            model = ensembles.to_batch_ensemble(
                mlp(model_axis), num_members=num_members, rngs=nnx.Rngs(1),
                **FAST_WEIGHTS)
            graphdef, params = nnx.split(model, nnx.Param)
            if mesh is not None:
                # The Flax workflow: placements from the variables' metadata.
                specs = nnx.get_partition_spec(params)
                params = jax.device_put(
                    params,
                    jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs))
                rows = NamedSharding(mesh, P("data"))
                x, targets = jax.device_put((x, targets), rows)
            placed = {
                jax.tree_util.keystr(path): [
                    None if a is None else str(a) for a in value.sharding.spec
                ]
                for path, value in jax.tree.leaves_with_path(params)
                if hasattr(value.sharding, "spec")
            }
            tx = optax.sgd(0.1, momentum=0.9)
            opt_state = tx.init(params)

            @jax.jit
            def step(params, opt_state, x, targets):
                def loss_fn(params):
                    y = nnx.merge(graphdef, params)(x)
                    return jnp.mean(jnp.square(y - targets))

                loss, grads = jax.value_and_grad(loss_fn)(params)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            hlo = step.lower(params, opt_state, x, targets).compile().as_text()
            losses = []
            for _ in range(STEPS):
                params, opt_state, loss = step(params, opt_state, x, targets)
                losses.append(float(loss))
        flat = {
            jax.tree_util.keystr(path): value
            for path, value in jax.tree.leaves_with_path(params)
        }
        return {
            "params": {k: np.asarray(v).tolist() for k, v in flat.items()},
            "specs": placed,
            "all_gathers": all_gathers(hlo),
            "rows": num_members * batch,
            "losses": losses,
        }


    def one_device_formulation():
        return mock.patch.object(groups, "row_shards", lambda inputs: None)


    start = time.perf_counter()
    assert jax.device_count() == 8, jax.devices()
    auto, explicit = (AxisType.Auto,), (AxisType.Explicit,)
    data = jax.make_mesh((8,), ("data",), axis_types=auto)
    data_explicit = jax.make_mesh((8,), ("data",), axis_types=explicit)
    data_model = jax.make_mesh((2, 4), ("data", "model"), axis_types=auto * 2)
    cases = {
        "E4": dict(num_members=4, batch=8, mesh=data),
        "E8": dict(num_members=8, batch=4, mesh=data),
        "E3": dict(num_members=3, batch=8, mesh=data),
        "E3_explicit": dict(num_members=3, batch=8, mesh=data_explicit),
        "E4_data_model": dict(
            num_members=4, batch=8, mesh=data_model, model_axis="model"),
    }
    out, references = {}, {}
    for name, case in cases.items():
        size = (case["num_members"], case["batch"])
        if size not in references:
            # Unsharded, unannotated, one device's formulation of the op.
            with one_device_formulation():
                references[size] = train(*size)
        out[name] = {"reference": references[size], "sharded": train(**case)}
    # The control: the one-device formulation, sharded, all-gathers E=3's rows.
    with one_device_formulation():
        out["E3_by_member"] = train(3, 8, mesh=data)

    # A program with no mesh in context, on this machine of 8 devices: one
    # device's program (the gradient's jaxpr equals the forced one's).
    def no_mesh_program():
        model = ensembles.to_batch_ensemble(
            mlp(None), num_members=3, rngs=nnx.Rngs(1))
        graphdef, params = nnx.split(model, nnx.Param)
        x = jnp.ones((24, IN))

        def loss(params):
            return jnp.sum(nnx.merge(graphdef, params)(x))

        return str(jax.make_jaxpr(jax.grad(loss))(params))

    unforced = no_mesh_program()
    with one_device_formulation():
        out["no_mesh_is_one_device"] = unforced == no_mesh_program()
    with jax.set_mesh(data):
        out["mesh_is_grouped"] = unforced != no_mesh_program()

    # Tokens split over an explicit mesh, rows whole: the op keeps the token
    # axis apart (a reshape merging it into the rows is refused there).
    tokens = jax.make_mesh((8,), ("seq",), axis_types=explicit)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((6, 16, 5)), jnp.float32)
    kernel = jnp.asarray(np.random.default_rng(2).standard_normal((5, 4)), jnp.float32)
    r, s = jnp.full((2, 5), 1.5), jnp.full((2, 4), 0.5)

    def dense_loss(x, kernel):
        y = ensembles.ops.batch_ensemble_dense(x, kernel, r, s, num_members=2)
        return jnp.sum(jnp.sin(y))

    expected = jax.jit(jax.value_and_grad(dense_loss, (0, 1)))(x, kernel)
    with jax.set_mesh(tokens):
        placed = jax.device_put(x, NamedSharding(tokens, P(None, "seq", None)))
        found = jax.jit(jax.value_and_grad(dense_loss, (0, 1)))(placed, kernel)
    out["explicit_tokens_error"] = max(  # relative to each result's scale
        float(jnp.max(jnp.abs(jnp.asarray(a) - jnp.asarray(b))))
        / (1.0 + float(jnp.max(jnp.abs(jnp.asarray(b)))))
        for a, b in zip(jax.tree.leaves(found), jax.tree.leaves(expected))
    )
    out["seconds"] = time.perf_counter() - start
    print("RESULT " + json.dumps(out))
    """
)


def _run_script():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-2000:]
    return json.loads(lines[0].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """The subprocess's results, computed once per test session.

    Under pytest-xdist every worker that runs one of these tests would start
    the subprocess (half a minute of compiling) for itself: the first computes
    and leaves the JSON in the session's shared temporary directory, the
    others wait on a file lock and read it.
    """
    if fcntl is None or "PYTEST_XDIST_WORKER" not in os.environ:
        return _run_script()
    shared = tmp_path_factory.getbasetemp().parent  # the session's, not a worker's
    path = shared / "sharded_runs.json"
    with open(shared / "sharded_runs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return json.loads(path.read_text())
        runs = _run_script()
        path.write_text(json.dumps(runs))
        return runs


def _leading_rows(shape):
    """The rows of an array ``f32[..., features]{...}``: all but its last axis."""
    dims = [int(d) for d in shape.split("[")[1].split("]")[0].split(",") if d]
    return math.prod(dims[:-1])


def _activation_gathers(run):
    """The all-gathers of the whole batch's rows (``[E*B, F]`` or ``[G, R, F]``)."""
    return [s for s in run["all_gathers"] if _leading_rows(s) == run["rows"]]


SHARDED_CASES = ["E4", "E8", "E3", "E3_explicit", "E4_data_model"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARDED_CASES)
def test_sharded_training_matches_unsharded(sharded_runs, name):
    reference = sharded_runs[name]["reference"]["params"]
    sharded = sharded_runs[name]["sharded"]["params"]
    assert sorted(sharded) == sorted(reference)
    assert len(sharded) == 12  # kernel, bias, r, s of three layers
    for path, value in reference.items():
        np.testing.assert_allclose(
            np.asarray(sharded[path]),
            np.asarray(value),
            rtol=1e-5,
            atol=1e-6,
            err_msg=path,
        )
    # Same losses at every step, and training did train.
    losses = sharded_runs[name]["sharded"]["losses"]
    np.testing.assert_allclose(
        losses, sharded_runs[name]["reference"]["losses"], rtol=1e-5
    )
    assert losses[-1] < 0.9 * losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["E4", "E8", "E3", "E3_explicit"])
def test_data_parallel_step_gathers_nothing(sharded_runs, name):
    run = sharded_runs[name]["sharded"]
    assert _activation_gathers(run) == []
    # Stricter: with replicated parameters nothing at all is all-gathered
    # (gradients are all-reduced).
    assert run["all_gathers"] == []


@pytest.mark.slow
def test_member_reshapes_would_gather_rows(sharded_runs):
    # The control that shows the gather count can fail: the one-device
    # formulation splits rows [E*B] into [E, B]; with E=3 on 8 devices the
    # shards (3 rows each) do not follow member boundaries, so XLA all-gathers
    # the activations.
    run = sharded_runs["E3_by_member"]
    assert _activation_gathers(run), run["all_gathers"]


@pytest.mark.slow
def test_parameters_placed_from_metadata(sharded_runs):
    specs = sharded_runs["E4_data_model"]["sharded"]["specs"]
    for layer in range(3):
        prefix = f"['layers'][{2 * layer}]"
        assert specs[f"{prefix}['kernel'].value"] == [None, "model"]
        # The pretrained bias is broadcast to [E, out] behind a replicated
        # member axis; the fast weights are replicated.
        assert specs[f"{prefix}['bias'].value"] == [None, "model"]
        assert all(a is None for a in specs[f"{prefix}['r'].value"])
        assert all(a is None for a in specs[f"{prefix}['s'].value"])
    data_specs = sharded_runs["E4"]["sharded"]["specs"]
    assert all(a is None for spec in data_specs.values() for a in spec)


@pytest.mark.slow
def test_model_parallel_step_never_gathers_the_batch(sharded_runs):
    # Rows stay split over `data`. What is all-gathered is each data shard's
    # hidden activations over `model` ([E*B/2, hidden]), since every kernel
    # here shards its output features and the next layer contracts them whole,
    # as nnx.Linear with these annotations does.
    run = sharded_runs["E4_data_model"]["sharded"]
    assert _activation_gathers(run) == []
    # Sharded, the op views the rows as groups ([G, R, features]): count rows.
    half = run["rows"] // 2
    assert run["all_gathers"]
    for shape in run["all_gathers"]:
        assert _leading_rows(shape) == half, shape


@pytest.mark.parametrize("key", ["out_sharding", "sharding_names", "sharding"])
def test_member_axis_metadata_prepends_replicated_member_axis(key):
    metadata = sharding.member_axis_metadata({key: ("model",), "other": 1})
    assert metadata == {key: (None, "model"), "other": 1}
    assert sharding.without_member_axis_metadata(metadata) == {
        key: ("model",),
        "other": 1,
    }


def test_partition_specs_of_a_layer():
    layer = ensembles.BatchEnsembleLinear(
        3,
        4,
        num_members=2,
        rngs=nnx.Rngs(0),
        kernel_metadata={"out_sharding": (None, "model"), "eager_sharding": False},
        bias_metadata={"out_sharding": (None, "model"), "eager_sharding": False},
    )
    specs = nnx.get_partition_spec(nnx.state(layer))
    assert specs["kernel"].get_value() == jax.P(None, "model")
    assert specs["bias"].get_value() == jax.P(None, "model")
    assert specs["r"].get_value() == jax.P()
    assert specs["s"].get_value() == jax.P()


def test_from_linear_keeps_the_bias_annotation():
    linear = nnx.Linear(
        3,
        4,
        rngs=nnx.Rngs(0),
        kernel_metadata={"out_sharding": (None, "model"), "eager_sharding": False},
        bias_metadata={"out_sharding": ("model",), "eager_sharding": False},
    )
    layer = ensembles.BatchEnsembleLinear.from_linear(
        linear, num_members=2, rngs=nnx.Rngs(1)
    )
    specs = nnx.get_partition_spec(nnx.state(layer))
    assert specs["kernel"].get_value() == jax.P(None, "model")
    assert specs["bias"].get_value() == jax.P(None, "model")
    assert layer.extract_member(1).bias.get_metadata()["out_sharding"] == ("model",)


def _one_device(inputs, kernel, r, s, bias, **options):
    """One device's formulation of the op, as a program with no mesh runs it."""
    return dense.dense_rows(inputs, kernel, r, s, bias, **options)


@pytest.mark.parametrize("leading", [(), (3,), (2, 3)])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("groups", [3, 6, 12])
def test_grouped_formulation_matches_one_device(leading, use_bias, groups):
    # Sharded, the op views the rows as G groups (a multiple of E); on one
    # device as E members: both must agree, values and every gradient, a
    # first layer's (inputs not differentiated) and a hidden layer's.
    num_members, batch, in_features, out_features = 3, 4, 5, 6
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (num_members * batch, *leading, in_features))
    kernel = jax.random.normal(keys[1], (in_features, out_features))
    r = jax.random.normal(keys[2], (num_members, in_features))
    s = jax.random.normal(keys[3], (num_members, out_features))
    bias = jax.random.normal(keys[4], (num_members, out_features)) if use_bias else None
    options = {"precision": "highest", "preferred_element_type": None}
    grouped = functools.partial(dense.dense_groups, num_groups=groups)

    def loss(formulation, x, kernel, r, s, bias):
        return jnp.sum(jnp.sin(formulation(x, kernel, r, s, bias, **options)))

    args = (x, kernel, r, s, bias)
    bias_argnums = (4,) if use_bias else ()

    # One compiled program for both formulations, values and gradients.
    @jax.jit
    def both(*args):
        return [
            (
                formulation(*args, **options),
                jax.grad(
                    functools.partial(loss, formulation), (0, 1, 2, 3, *bias_argnums)
                )(*args),
                jax.grad(
                    functools.partial(loss, formulation), (1, 2, 3, *bias_argnums)
                )(*args),
            )
            for formulation in (grouped, _one_device)
        ]

    (y_grouped, *grads_grouped), (y_one, *grads_one) = both(*args)
    assert y_grouped.shape == (num_members * batch, *leading, out_features)
    np.testing.assert_allclose(y_grouped, y_one, rtol=1e-5, atol=1e-5)
    for g_grouped, g_one in zip(
        jax.tree.leaves(grads_grouped), jax.tree.leaves(grads_one), strict=True
    ):
        np.testing.assert_allclose(g_grouped, g_one, rtol=1e-4, atol=1e-4)


def test_member_groups():
    # One device: a group per member. Sharded: every device's rows whole
    # groups, every group inside one member.
    assert groups_module.member_groups(num_rows=24, num_members=3, shards=1) == 3
    assert groups_module.member_groups(num_rows=24, num_members=3, shards=8) == 24
    assert groups_module.member_groups(num_rows=48, num_members=3, shards=8) == 24
    assert groups_module.member_groups(num_rows=32, num_members=4, shards=8) == 8
    assert groups_module.member_groups(num_rows=64, num_members=8, shards=4) == 8
    # A mesh larger than the rows split into: its largest divisor they do.
    assert groups_module.member_groups(num_rows=12, num_members=3, shards=8) == 12
    assert groups_module.member_groups(num_rows=6, num_members=3, shards=8) == 6
    assert groups_module.member_groups(num_rows=3, num_members=3, shards=8) == 3


@pytest.mark.slow
def test_tokens_over_an_explicit_mesh_keep_their_axis(sharded_runs):
    assert sharded_runs["explicit_tokens_error"] < 1e-5


@pytest.mark.slow
def test_no_mesh_on_eight_devices_is_one_device_program(sharded_runs):
    assert sharded_runs["no_mesh_is_one_device"] is True
    assert sharded_runs["mesh_is_grouped"] is True  # the control


def test_a_program_with_no_mesh_is_one_device_program():
    # Whatever jax.device_count() says (8 in the sharded script, checked
    # there): with no mesh in context, the op traces one device's program.
    seen = []
    jax.jit(lambda x: seen.append(groups_module.row_shards(x)) or x).trace(
        jnp.ones((4, 3))
    )
    assert seen == [None]


@pytest.mark.parametrize("op", ["dense", "conv", "conv_transpose"])
def test_sharded_rows_are_viewed_as_groups(op, monkeypatch):
    # The control for tests/ops/test_autodiff.py's "sharded" formulation: told
    # that its rows are split 6 ways, an op views E = 2 members' 12 rows as 6
    # groups of 2 (one device: 2 groups of 6).
    from ensembles import ops

    x = jnp.ones((12, 5, 3))
    kernel = jnp.ones((3, 4)) if op == "dense" else jnp.ones((2, 3, 4))
    r, s = jnp.ones((2, 3)), jnp.ones((2, 4))
    call = {
        "dense": lambda *a: ops.batch_ensemble_dense(*a, num_members=2),
        "conv": lambda *a: ops.batch_ensemble_conv(*a, num_members=2),
        "conv_transpose": lambda *a: ops.batch_ensemble_conv_transpose(
            *a, num_members=2
        ),
    }[op]

    def views(shards):
        jax.clear_caches()  # no trace made under the other count
        with mock.patch.object(groups_module, "row_shards", lambda inputs: shards):
            jaxpr = jax.make_jaxpr(call)(x, kernel, r, s)
        return {
            tuple(e.params["new_sizes"])[:2]
            for e in jaxpr.eqns
            if e.primitive.name == "reshape"
        }

    assert (6, 2) in views(6)
    assert (6, 2) not in views(None)  # one device's program
