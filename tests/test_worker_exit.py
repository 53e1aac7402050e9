"""A passing run ends without a traceback (tests/worker_exit.py).

The reproduction: a worker that runs a hypothesis test (which installs its gc
callback) and is still collecting garbage 5 s after xdist told it to exit,
run once as the suite runs it and once without tests/worker_exit.py.
"""

import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

TEST = """
from hypothesis import given, strategies as st


@given(st.integers())
def test_integers(n):
    assert n == n
"""

# pytest_unconfigure runs after the worker reported its tests done: garbage
# collection there until Python reports an exception it could not raise (the
# SIGINT, in hypothesis's gc callback), for at most 9 s. execnet's 5 s start
# when the controller's exit message reaches the worker, which on a loaded
# machine can be seconds after this began; the controller kills a worker
# still running 10 s after it sent the message (xdist's EXIT_TIMEOUT), and a
# killed worker's output is lost. A fixed 7 s (as this once was) left 2 s
# for the message, and a loaded CI run's worker ended before the SIGINT.
CONFTEST = """
import gc
import sys
import time

sys.path.insert(0, {root!r})
{hook}


def pytest_unconfigure(config):
    if hasattr(config, "workerinput"):
        reported = []
        previous = sys.unraisablehook

        def noting(unraisable):
            previous(unraisable)
            reported.append(unraisable.exc_type)

        sys.unraisablehook = noting
        try:
            deadline = time.monotonic() + 9
            while not reported and time.monotonic() < deadline:
                junk = [[[] for _ in range(100)] for _ in range(100)]
                junk.append(junk)
                del junk
                gc.collect()
        finally:
            sys.unraisablehook = previous
"""


def run(tmp_path, hook):
    (tmp_path / "test_it.py").write_text(TEST)
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(CONFTEST).format(root=str(ROOT), hook=hook)
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "1", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # two runs of a worker that takes 5-9 s to exit
def test_a_passing_run_ends_without_a_traceback(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "without").mkdir()
    without = run(tmp_path / "without", "")
    assert without.returncode == 0, without.stdout + without.stderr
    # The reproduction holds: execnet's SIGINT lands in hypothesis's gc callback.
    assert "KeyboardInterrupt" in without.stdout + without.stderr
    assert "gc_callback" in without.stdout + without.stderr
    (tmp_path / "with").mkdir()
    quiet = run(tmp_path / "with", "from tests.worker_exit import pytest_sessionfinish")
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert "1 passed" in quiet.stdout
    assert "KeyboardInterrupt" not in quiet.stdout + quiet.stderr
    assert "Traceback" not in quiet.stdout + quiet.stderr
