"""Launching a script in several processes that form one JAX runtime.

:func:`launch` starts ``num_processes`` Pythons on this machine, each with
``devices_per_process`` CPU devices, that a script joins into one runtime
with ``jax.distributed.initialize`` (gloo collectives over localhost): the
runtime users meet on TPU pods, multi-GPU nodes and SLURM. Two ways to tell
a script where the coordinator is:

- ``"env"``: ``ENSEMBLES_COORDINATOR``, ``ENSEMBLES_NUM_PROCESSES`` and
  ``ENSEMBLES_PROCESS_ID``, which the suite's worker scripts pass to
  ``jax.distributed.initialize`` with short timeouts
  (``tests/multiprocess_worker.py``);
- ``"slurm"``: the variables a SLURM job step sets, so that a script calling
  ``jax.distributed.initialize()`` with no arguments, as written for a
  cluster (``docs/scaling_out.md``), finds them itself.

What a crash must not do is leave a sibling waiting: a peer that dies before
``initialize`` leaves the others waiting for ``initialization_timeout``
(300 s by default), one that dies after, for the heartbeat timeout (100 s).
So each process's output goes to a file (a pipe that fills would block it),
the launcher polls, ends the siblings a few seconds after the first failure,
ends everything at an overall timeout, checks every exit code, and only
ever ends the processes it started (``../shared/notes/multihost.md``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import socket
import subprocess
import sys
import time

#: Seconds a failed process's siblings get to fail or finish on their own.
GRACE_S = 5.0


@dataclasses.dataclass(frozen=True)
class Finished:
    """One process's exit code and output."""

    process_id: int
    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _environment(how, port, num_processes, process_id, devices_per_process):
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
    if how == "env":
        env["ENSEMBLES_COORDINATOR"] = f"127.0.0.1:{port}"
        env["ENSEMBLES_NUM_PROCESSES"] = str(num_processes)
        env["ENSEMBLES_PROCESS_ID"] = str(process_id)
    elif how == "slurm":  # as `srun` sets them for one job step on one node
        env.update(
            SLURM_JOB_ID="1",
            SLURM_NTASKS=str(num_processes),
            SLURM_PROCID=str(process_id),
            SLURM_LOCALID=str(process_id),
            SLURM_STEP_NODELIST="localhost",
            SLURM_NODELIST="localhost",
            JAX_COORDINATOR_PORT=str(port),
        )
    else:
        raise ValueError(f"`how` must be 'env' or 'slurm', got {how!r}")
    return env


def launch(
    script: str | pathlib.Path,
    *args: str,
    workdir: pathlib.Path,
    num_processes: int = 2,
    devices_per_process: int = 2,
    how: str = "env",
    timeout: float = 180.0,
) -> list[Finished]:
    """Runs ``script`` in ``num_processes`` processes of one JAX runtime.

    Returns every process's :class:`Finished`, in process order, once all
    have exited; a failure ends its siblings after :data:`GRACE_S` seconds.

    Raises:
      TimeoutError: if they run past ``timeout`` seconds (all are ended).
    """
    script = pathlib.Path(script).resolve()  # the processes run in `workdir`
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    started = []
    for process_id in range(num_processes):
        out = open(workdir / f"stdout_{process_id}.txt", "w")  # noqa: SIM115
        err = open(workdir / f"stderr_{process_id}.txt", "w")  # noqa: SIM115
        env = _environment(how, port, num_processes, process_id, devices_per_process)
        proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdout=out,
            stderr=err,
            env=env,
            cwd=workdir,
        )
        started.append((proc, out, err))
    deadline = time.monotonic() + timeout
    first_failure = None
    timed_out = False
    try:
        while any(proc.poll() is None for proc, _, _ in started):
            now = time.monotonic()
            if first_failure is None and any(
                proc.poll() not in (None, 0) for proc, _, _ in started
            ):
                first_failure = now
            if now > deadline:
                timed_out = True
                break
            if first_failure is not None and now - first_failure > GRACE_S:
                break
            time.sleep(0.1)
    finally:
        for proc, _, _ in started:  # only our own children
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for _, out, err in started:
            out.close()
            err.close()
    finished = [
        Finished(
            process_id=i,
            returncode=proc.returncode,
            stdout=(workdir / f"stdout_{i}.txt").read_text(),
            stderr=(workdir / f"stderr_{i}.txt").read_text(),
        )
        for i, (proc, _, _) in enumerate(started)
    ]
    if timed_out:
        raise TimeoutError(
            f"{script} ran past {timeout} s in {num_processes} processes:\n"
            + describe(finished)
        )
    return finished


def describe(finished: list[Finished]) -> str:
    """Every process's exit code and the end of its stderr, for a failure."""
    return "\n".join(
        f"process {f.process_id}: exit {f.returncode}\n{f.stderr[-3000:]}"
        for f in finished
    )
