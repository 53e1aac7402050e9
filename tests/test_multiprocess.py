"""Several processes, one model: 2 processes x 2 CPU devices on this machine.

JAX's multi-controller runtime (``jax.distributed``), the one users meet on TPU
pods, multi-GPU nodes and SLURM, runs here with gloo collectives over
localhost (tests/multiprocess.py launches it). tests/multiprocess_worker.py
trains a converted MLP across both processes (data-parallel, ``E`` not
dividing the devices, members sharded over the processes, a 2x2 data x model
mesh) and on one device, makes the mistakes users make, saves a checkpoint
from both processes and restores it, and runs the cost benchmark; the tests
here read what it found. docs/scaling_out.md's many-host program then runs
as written, started as a SLURM job step starts it, and its checkpoint is
restored on one device by the page's own code.

One launch of each, shared by the tests of this module (under xdist, the
first worker to need it launches it; the others wait on a file lock and
read its files): the tier's cost is two 2-process runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys

try:
    import fcntl
except ImportError:  # not POSIX: each xdist worker launches its own
    fcntl = None

import numpy as np
import pytest

from tests.multiprocess import launch
from tests.tolerances import assert_close

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")
CASES = ("data_parallel_E4", "data_parallel_E3", "members_sharded_E4", "data_model_E4")

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def docs_block(caption: str) -> str:
    """The ``{code-block} python`` of docs/scaling_out.md with ``caption``."""
    page = (ROOT / "docs" / "scaling_out.md").read_text()
    found = re.search(
        r"```\{code-block\} python\n:caption: " + re.escape(caption) + r"\n\n(.*?)```",
        page,
        re.S,
    )
    assert found, f"docs/scaling_out.md has no code block captioned {caption}"
    return found.group(1)


@contextlib.contextmanager
def _once(tmp_path_factory, name):
    """A directory for ``name``'s run, and whether this worker must run it."""
    shared = tmp_path_factory.getbasetemp()
    if fcntl is not None and "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent  # the session's, not one xdist worker's
    workdir = shared / name
    if fcntl is None:
        yield workdir, True
        return
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield workdir, not (workdir / "finished.json").exists()


def _launched(tmp_path_factory, name, script, how):
    with _once(tmp_path_factory, name) as (workdir, run):
        if run:
            finished = launch(script, workdir=workdir, how=how, timeout=240)
            (workdir / "finished.json").write_text(
                json.dumps([f.__dict__ for f in finished])
            )
    finished = json.loads((workdir / "finished.json").read_text())
    assert all(f["returncode"] == 0 for f in finished), describe_rows(finished)
    return workdir, finished


def describe_rows(finished):
    return "\n".join(
        f"process {f['process_id']}: exit {f['returncode']}\n{f['stderr'][-3000:]}"
        for f in finished
    )


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """The worker's directory and both processes' results."""
    workdir, _ = _launched(tmp_path_factory, "multiprocess_worker", WORKER, "env")
    results = [json.loads((workdir / f"result_{i}.json").read_text()) for i in range(2)]
    return workdir, results


@pytest.fixture(scope="module")
def docs_program(tmp_path_factory):
    """docs/scaling_out.md's many-host program, run in 2 processes as written."""
    name = "many_hosts"
    with _once(tmp_path_factory, name) as (workdir, run):
        if run:
            workdir.mkdir(parents=True, exist_ok=True)
            (workdir / "many_hosts.py").write_text(docs_block("many_hosts.py"))
    return _launched(tmp_path_factory, name, workdir / "many_hosts.py", "slurm")


def _arrays(path):
    with np.load(path) as found:
        return dict(found)


# -------------------------------------------------------------- the launcher


def test_the_launcher_ends_the_siblings_of_a_failed_process(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['ENSEMBLES_PROCESS_ID'] == '1':\n"
        "    sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    finished = launch(script, workdir=tmp_path / "run", timeout=60)
    assert [f.returncode for f in finished][1] == 3
    assert finished[0].returncode != 0  # ended, not left waiting 120 s


def test_the_launcher_times_out(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import time\ntime.sleep(120)\n")
    with pytest.raises(TimeoutError, match="ran past"):
        launch(script, workdir=tmp_path / "run", timeout=1)


# ------------------------------------------------- training across processes


@pytest.mark.parametrize("case", CASES)
def test_training_across_processes_equals_one_device(worker, case):
    workdir, _ = worker
    for process in range(2):
        trained = _arrays(workdir / f"trained_{case}_{process}.npz")
        reference = _arrays(workdir / f"reference_{case}_{process}.npz")
        assert trained.keys() == reference.keys()
        for path, value in trained.items():
            assert_close(value, reference[path], err_msg=f"{case} {path}")


def test_each_process_loads_the_rows_its_devices_hold(worker):
    _, results = worker
    assert results[0]["data_parallel_E4"]["rows"] == list(range(8))
    assert results[1]["data_parallel_E4"]["rows"] == list(range(8, 16))
    # E=3, B=4: member 1's rows 4-7 are split between the processes.
    assert results[0]["data_parallel_E3"]["rows"] == list(range(6))
    assert results[1]["data_parallel_E3"]["rows"] == list(range(6, 12))


def test_members_are_sharded_at_conversion(worker):
    _, results = worker
    for result in results:
        assert result["members_sharded_E4"]["fast_weight_spec"] == ["data", None]
        assert result["data_parallel_E4"]["fast_weight_spec"] == []


# ------------------------------------------------------ the six pitfalls


def test_a_batch_of_each_process_own_rows_as_numpy_is_caught(worker):
    _, results = worker
    for result in results:
        assert "copies differ between processes" in result["mistake_caught"]
        assert "global_batch" in result["mistake_caught"]


def test_a_different_seed_per_process_is_caught_at_placement(worker):
    _, results = worker
    for result in results:
        assert "copies differ between processes" in result["seed_own_caught"]
        assert "different seed per process" in result["seed_own_caught"]
        assert result["seed_same_caught"] is None


def test_results_spanning_processes_are_read_back_whole(worker):
    _, results = worker
    for result in results:
        assert result["asarray_raises"] is True  # what users met
        assert result["outputs_shape"] == [16, 4]
        assert result["outputs_max_difference"] < 1e-5


def test_a_mesh_of_one_process_devices_is_refused(worker):
    _, results = worker
    for result in results:
        assert (
            "holds the devices of process(es) [0] only"
            in (result["local_mesh_refused"])
        )


def test_a_sharded_checkpoint_restores_into_two_processes_and_one_device(worker):
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    import ensembles
    from tests.multiprocess_worker import mlp

    workdir, results = worker
    assert all(result["restored_into_two_equal"] for result in results)
    # Into this process's one device, as docs/scaling_out.md restores.
    abstract = nnx.eval_shape(
        lambda: ensembles.to_batch_ensemble(mlp(), num_members=4, rngs=nnx.Rngs(1))
    )
    _, abstract_params = nnx.split(abstract, nnx.Param)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one_device),
        abstract_params,
    )
    restored = ocp.StandardCheckpointer().restore(str(workdir / "checkpoint"), target)
    saved = _arrays(workdir / "saved_0.npz")
    flat = {
        "/".join(map(str, path)): np.asarray(variable.get_value())
        for path, variable in nnx.to_flat_state(restored)
    }
    assert flat.keys() == saved.keys()
    for path, value in flat.items():
        np.testing.assert_array_equal(value, saved[path], err_msg=path)


def test_local_work_takes_the_one_device_path(worker):
    _, results = worker
    for result in results:
        assert result["local_rows_sharded"] is False
        assert result["global_rows_sharded"] is True
        # A jitted program with no mesh in context is one device's, though
        # the processes see 4 devices together.
        assert result["jit_rows_sharded"] is False
        assert result["local_mesh_rows_sharded"] is False


def test_the_benchmark_gives_one_report(worker):
    workdir, results = worker
    assert [r["benchmark_status"] for r in results] == [0, 0]
    assert "| E | method |" in results[0]["benchmark_stdout"]
    assert results[1]["benchmark_stdout"] == ""
    report = json.loads((workdir / "bench.json").read_text())
    assert report["device"]["process_count"] == 2
    stderr = (workdir / "stderr_1.txt").read_text()
    assert "process 0 prints and writes the report" in stderr


# ------------------------------------------------ docs/scaling_out.md


def test_the_docs_many_hosts_program_runs_as_written(docs_program):
    workdir, finished = docs_program
    assert "loss" in finished[0]["stdout"]
    assert "loss" not in finished[1]["stdout"]  # process 0 prints
    # The page's restore, in one fresh process of one device.
    script = workdir / "restore_on_one_device.py"
    script.write_text(docs_block("restore_on_one_device.py"))
    restored = subprocess.run(
        [sys.executable, str(script)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert restored.returncode == 0, restored.stderr[-3000:]


def test_the_docs_no_longer_say_the_many_host_section_cannot_be_tested():
    page = (ROOT / "docs" / "scaling_out.md").read_text()
    assert "cannot run them" not in page
    assert "tests/test_multiprocess.py" in page
