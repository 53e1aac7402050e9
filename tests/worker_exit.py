"""A finished xdist worker finishes its teardown: no ``KeyboardInterrupt`` at exit.

When every worker has reported its tests done, pytest-xdist tells each to
exit. execnet gives a worker 5 s to finish what it is running, then sends it
a SIGINT (``WorkerGateway._terminate_execution``), and 10 s after that ends
it with ``os._exit``. A worker whose tests ran thousands of XLA programs can
still be tearing down after 5 s on a busy machine; the SIGINT then raises a
``KeyboardInterrupt`` wherever it is, most often inside a garbage
collection, in hypothesis's gc callback, whose traceback Python prints as an
unraisable exception at the end of a passing run. A worker whose tests are
done has nothing left to interrupt: from then on it ignores SIGINT, and
finishes its teardown (tests/test_worker_exit.py reproduces it).
"""

import signal
import threading

import pytest


@pytest.hookimpl(trylast=True)  # before xdist reports the worker finished
def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput") and (
        threading.current_thread() is threading.main_thread()
    ):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
