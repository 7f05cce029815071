import faulthandler
import os
import shutil
import sys
import tempfile
import threading

import pytest

# Multi-rank tests run several processes on 2 cores: one thread each keeps them from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# torchrun leaves a torchelastic_* log directory in TMPDIR at every launch (it never removes it): the processes the
# tests start get a TMPDIR of their own, removed when the session ends, so the suite leaves nothing in /tmp.
_CHILD_TMPDIR = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="syncppo-tests-")

HANG_S = 600   # every test takes well under a minute; one still running after 10 minutes is hung, not slow


@pytest.fixture(autouse=True)
def fail_a_hung_test_instead_of_hanging_ci(request):
    """A regression that makes a test wait forever (a lock taken without LOCK_NB, a thread never told to end) would
    hang `make test` with no output: after HANG_S the test is named with every thread's stack, and pytest exits
    with status 1. run_ranks bounds multi-rank tests itself (120 s per rank's answer)."""
    def hung():
        capture = request.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:                          # else the words would go to pytest's capture, lost at exit
            capture.suspend_global_capture(in_=True)
        print(f"\n{request.node.nodeid} still running after {HANG_S} s: hung. Its threads:", file=sys.stderr,
              flush=True)
        faulthandler.dump_traceback(file=sys.stderr)
        os._exit(1)
    timer = threading.Timer(HANG_S, hung)
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


def pytest_unconfigure(config):
    shutil.rmtree(_CHILD_TMPDIR, ignore_errors=True)
