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


@pytest.fixture(scope="session")
def one_node_two_ranks(tmp_path_factory):
    """The reference run of tests/test_multi_node.py and tests/test_slurm.py, which train it again on 2 nodes:
    `one_node_two_ranks(args)` starts `torchrun --standalone --nproc-per-node 2 train.py ARGS --log.root ...` (once
    per session for the same args; its start-up then overlaps the test's own runs) and returns a call that waits
    for that run and gives its model_2.pt's weights."""
    import glob
    import subprocess

    from dist.checkpoint_read import load_checkpoint
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    runs: dict = {}

    def start(args: list[str]):
        if tuple(args) not in runs:
            root = tmp_path_factory.mktemp("one-node")
            job = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2", "train.py", *args,
                                    "--log.root", str(root)], cwd=repo, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            runs[tuple(args)] = (job, root, [])
        job, root, output = runs[tuple(args)]

        def model() -> dict:
            if not output:
                try:
                    output.append(job.communicate(timeout=180)[0])
                finally:
                    job.kill()
            assert job.returncode == 0, output[0]
            (path,) = glob.glob(os.path.join(root, "cartpole", "*", "model_2.pt"))
            return load_checkpoint(path)["model"]
        return model
    yield start
    for job, _, _ in runs.values():
        job.kill()
        job.wait()
