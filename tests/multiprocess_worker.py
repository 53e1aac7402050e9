"""One process of tests/test_multiprocess.py's runs (tests/multiprocess.py launches it).

Every process runs this same script, as under any multi-controller launcher:
it trains a converted MLP across the processes' devices in several layouts
and the same MLP on this process's first device alone, reads the results
back, makes the mistakes users make, saves a checkpoint from every process
and restores it, and runs the cost benchmark. What it finds goes to
``result_<process>.json`` in its working directory; the tests assert on it.
"""

import contextlib
import io
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ensembles
import ensembles.benchmark
from ensembles import multihost
from ensembles.ops import groups

IN, HIDDEN, OUT, STEPS = 8, 16, 4, 3


def mlp(model_axis=None):
    meta = {}
    if model_axis:  # kernels' output features (and biases) over `model_axis`
        meta = {
            "kernel_metadata": {"out_sharding": (None, model_axis)},
            "bias_metadata": {"out_sharding": (model_axis,)},
        }
    rngs = nnx.Rngs(0)
    return nnx.Sequential(
        nnx.Linear(IN, HIDDEN, rngs=rngs, **meta),
        nnx.relu,
        nnx.Linear(HIDDEN, HIDDEN, rngs=rngs, **meta),
        nnx.relu,
        nnx.Linear(HIDDEN, OUT, rngs=rngs, **meta),
    )


def data(num_members, batch):
    """The global batch, the same on every process (generated, not loaded)."""
    rng = np.random.default_rng(num_members)
    x = np.tile(rng.standard_normal((batch, IN)).astype(np.float32), (num_members, 1))
    targets = rng.standard_normal((num_members * batch, OUT)).astype(np.float32)
    return x, targets


def trainer(graphdef):
    tx = optax.sgd(0.1, momentum=0.9)

    @jax.jit
    def step(params, opt_state, x, targets):
        def loss_fn(params):
            y = nnx.merge(graphdef, params)(x)
            return jnp.mean(jnp.square(y - targets))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, step


def train(model, x, targets, steps=STEPS):
    graphdef, params = nnx.split(model, nnx.Param)
    tx, step = trainer(graphdef)
    opt_state = tx.init(params)
    for _ in range(steps):
        params, opt_state, _loss = step(params, opt_state, x, targets)
    return params, opt_state, step


def on_one_device(num_members, batch):
    """The reference: the same training on this process's first device."""
    x, targets = data(num_members, batch)
    with multihost.local_mesh():
        model = ensembles.to_batch_ensemble(
            mlp(), num_members=num_members, rngs=nnx.Rngs(1)
        )
        params, _, _ = train(model, jnp.asarray(x), jnp.asarray(targets))
    return multihost.to_host(params)


def across_processes(mesh, num_members, batch, model_axis=None, member_axis=None):
    """Trained over ``mesh``: rows over ``data``, each process loading its own."""
    x, targets = data(num_members, batch)
    rows = NamedSharding(mesh, P("data"))
    mine = multihost.process_rows(rows, num_members * batch)
    with jax.set_mesh(mesh):
        model = ensembles.to_batch_ensemble(
            mlp(model_axis),
            num_members=num_members,
            rngs=nnx.Rngs(1),
            member_axis=member_axis,
        )
        graphdef, params = nnx.split(model, nnx.Param)
        specs = nnx.get_partition_spec(params)
        params = jax.device_put(
            params, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
        )
        batch_x, batch_t = multihost.global_batch(
            rows, (x[mine], targets[mine]), num_rows=num_members * batch
        )
        tx, step = trainer(graphdef)
        opt_state = tx.init(params)
        for _ in range(STEPS):
            params, opt_state, _ = step(params, opt_state, batch_x, batch_t)
        outputs = nnx.merge(graphdef, params)(batch_x)
    multihost.check_replicas(params, name="params")
    return params, outputs, mine, specs, graphdef


def save(name, tree):
    """``tree``'s arrays, by path, for the tests to compare."""
    np.savez(
        f"{name}_{jax.process_index()}.npz",
        **{
            "/".join(map(str, path)): np.asarray(variable.get_value())
            for path, variable in nnx.to_flat_state(tree)
        },
    )


def main():
    jax.distributed.initialize(  # first: nothing may compute before it
        os.environ["ENSEMBLES_COORDINATOR"],
        num_processes=int(os.environ["ENSEMBLES_NUM_PROCESSES"]),
        process_id=int(os.environ["ENSEMBLES_PROCESS_ID"]),
        initialization_timeout=60,
        heartbeat_timeout_seconds=10,
    )
    result = {"process": jax.process_index(), "processes": jax.process_count()}
    every = jax.devices()
    data_mesh = jax.make_mesh(
        (jax.device_count(),), ("data",), axis_types=(AxisType.Auto,), devices=every
    )
    grid = jax.make_mesh(
        (2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=every
    )
    cases = {
        "data_parallel_E4": dict(mesh=data_mesh, num_members=4, batch=4),
        "data_parallel_E3": dict(mesh=data_mesh, num_members=3, batch=4),
        "members_sharded_E4": dict(
            mesh=data_mesh, num_members=4, batch=4, member_axis="data"
        ),
        "data_model_E4": dict(mesh=grid, num_members=4, batch=4, model_axis="model"),
    }
    references = {}
    kept = {}
    for name, case in cases.items():
        size = (case["num_members"], case["batch"])
        if size not in references:
            references[size] = on_one_device(*size)
        params, outputs, mine, specs, graphdef = across_processes(**case)
        kept[name] = (params, outputs, graphdef)
        save(f"trained_{name}", multihost.to_host(params))
        save(f"reference_{name}", references[size])
        result[name] = {
            "rows": mine.tolist(),
            "fast_weight_spec": next(
                list(spec.get_value())
                for path, spec in nnx.to_flat_state(specs)
                if path[-1] == "r"
            ),
        }

    # 2. Reading results: np.asarray raises on what spans other processes;
    # to_host reads it whole.
    params, outputs, graphdef = kept["members_sharded_E4"]
    r = params["layers"][0]["r"][...]
    try:
        np.asarray(r)
        result["asarray_raises"] = False
    except RuntimeError:
        result["asarray_raises"] = True
    whole = multihost.to_host(outputs)
    host_params = multihost.to_host(params)
    with multihost.local_mesh():  # the trained model, on this process's device
        x, _ = data(4, 4)
        expected = np.asarray(nnx.merge(graphdef, host_params)(jnp.asarray(x)))
    result["outputs_shape"] = list(whole.shape)
    result["outputs_max_difference"] = float(np.max(np.abs(whole - expected)))

    # 1. The silent mistake: each process passes its own rows as numpy. JAX
    # reads them as one replicated batch; the replicas drift apart unnoticed
    # until check_replicas compares them.
    x, targets = data(4, 4)
    rows = NamedSharding(data_mesh, P("data"))
    mine = multihost.process_rows(rows, 16)
    with jax.set_mesh(data_mesh):
        model = ensembles.to_batch_ensemble(mlp(), num_members=4, rngs=nnx.Rngs(1))
        graphdef, params = nnx.split(model, nnx.Param)
        params = jax.device_put(params, NamedSharding(data_mesh, P()))
        tx, step = trainer(graphdef)
        opt_state = tx.init(params)
        params, opt_state, _ = step(params, opt_state, x[mine], targets[mine])
    try:
        multihost.check_replicas(params, name="params")
        result["mistake_caught"] = None
    except ValueError as error:
        result["mistake_caught"] = str(error)

    # 1b. A different seed per process (issue 67): caught when the parameters
    # are placed, naming both causes; the same seed is placed.
    with jax.set_mesh(data_mesh):
        for name, seed in (("own", jax.process_index()), ("same", 1)):
            model = ensembles.to_batch_ensemble(
                mlp(), num_members=4, rngs=nnx.Rngs(seed), member_axis="data"
            )
            try:
                multihost.place_state(nnx.split(model, nnx.Param)[1], data_mesh)
                result[f"seed_{name}_caught"] = None
            except ValueError as error:
                result[f"seed_{name}_caught"] = str(error)

    # 3. A mesh of one process's devices, as a one-host snippet builds it.
    local_only = jax.make_mesh(
        (jax.local_device_count(),),
        ("data",),
        axis_types=(AxisType.Auto,),
        devices=jax.devices()[: jax.local_device_count()],
    )
    try:
        multihost.process_rows(NamedSharding(local_only, P("data")), 16)
        result["local_mesh_refused"] = None
    except ValueError as error:
        result["local_mesh_refused"] = str(error)

    # 5. A checkpoint saved from every process, restored into both.
    import orbax.checkpoint as ocp

    params, _, _ = kept["members_sharded_E4"]
    path = os.path.abspath("checkpoint")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, params)
    checkpointer.wait_until_finished()
    targets_abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params
    )
    restored = checkpointer.restore(path, targets_abstract)
    saved, back = multihost.to_host(params), multihost.to_host(restored)
    result["restored_into_two_equal"] = all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(back), strict=True)
    )
    save("saved", saved)

    # 6. Local work takes the one-device path; the benchmark gives one report.
    local = jnp.ones((8, IN))
    result["local_rows_sharded"] = groups.row_shards(local) is not None
    result["global_rows_sharded"] = (
        groups.row_shards(multihost.global_batch(rows, x[mine], num_rows=16))
        is not None
    )
    seen = []
    jax.jit(lambda a: seen.append(groups.row_shards(a)) or a).trace(local)
    with multihost.local_mesh():
        jax.jit(lambda a: seen.append(groups.row_shards(a)) or a).trace(local)
    result["jit_rows_sharded"] = seen[0] is not None
    result["local_mesh_rows_sharded"] = seen[1] is not None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = ensembles.benchmark.main(
            [
                "--model",
                "linear",
                "--mode",
                "forward",
                "--members",
                "2",
                "--batch",
                "2",
                "--width",
                "4",
                "--repeats",
                "1",
                "--markdown",
                "--default-malloc",
                "--json",
                os.path.abspath("bench.json"),
            ]
        )
    result["benchmark_status"] = status
    result["benchmark_stdout"] = printed.getvalue()

    with open(f"result_{jax.process_index()}.json", "w") as f:
        json.dump(result, f)
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
