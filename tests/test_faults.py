"""Failing well: stop on a signal with a checkpoint, restart in place, never hang, never orphan.

The torchrun tests start real `torchrun ... train.py cartpole` jobs (2 gloo ranks) and poke them the
way a cluster does: SIGTERM to one rank, kill -9 of a rank or of the launcher.
"""

import contextlib
import glob
import itertools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
import weakref

import pytest
import torch

import train
from configs import preset
from dist import comm
from dist.checkpoint import create_run_dir, open_run_dir, save_checkpoint
from dist.errors import RunError, UsageError
from dist.setup import init_distributed
from dist.stop import SecondInterrupt, StopRequests
from tests.multirank import run_ranks
from tests.read_only import read_only_folder
from tests.torchrun_job import Job, alive

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tb_steps(run_dir: str, tag: str = "Perf/total_fps") -> list[int]:
    """Steps of `tag` as TensorBoard shows them (events an earlier attempt logged past a restart purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def cartpole_args(root, iterations=100000, save_every=1000):
    return ["cartpole", "--max-iterations", str(iterations), "--log.save-every", str(save_every),
            "--log.root", str(root)]


@pytest.mark.slow
def test_restarts_continue_the_same_run_directory_and_curves(tmp_path):
    # A save every 2 iterations, each attempt killed at its first: restarts resume at 2, 4 and 6, the last runs to 8.
    job = Job(cartpole_args(tmp_path, iterations=8, save_every=2), max_restarts=3)
    for _ in range(3):                      # three restarts in a row: the process group must re-form each time
        job.wait_for(r"saved .*model_\d+\.pt")
        os.kill(job.workers()[-1], signal.SIGKILL)
    assert job.finish(240) == 0, job.output()
    assert job.output().count("[syncppo] resumed") == 3
    (run_dir,) = glob.glob(os.path.join(tmp_path, "cartpole", "*"))
    assert os.path.exists(os.path.join(run_dir, "model_8.pt"))
    assert tb_steps(run_dir) == list(range(1, 9))           # each iteration once, k + 1 following k


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_after_a_checkpoint(tmp_path):
    job = Job(cartpole_args(tmp_path))
    job.wait_for(r"^it +3/")
    os.kill(job.workers()[1], signal.SIGTERM)          # rank 1 only: the flag rides in the metrics all-reduce
    assert job.finish(120) == 0, job.output()
    stopped = job.wait_for(r"stopped on request .* after iteration (\d+); saved (\S+);")
    k, path = int(stopped.group(1)), stopped.group(2)
    assert k >= 3 and path.endswith(f"model_{k}.pt")
    assert torch.load(path, weights_only=True)["iteration"] == k
    assert "Traceback" not in job.output()


@pytest.mark.slow
def test_killed_launcher_leaves_no_orphans(tmp_path):
    job = Job(cartpole_args(tmp_path))
    job.wait_for(r"^it +2/")
    workers = job.workers()
    os.kill(job.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert not any(alive(p) for p in workers), "workers outlived their launcher"
        job.wait_for(r"launcher \(torchrun\) is gone: stopped after iteration \d+ without saving", timeout=5)
        assert not glob.glob(os.path.join(tmp_path, "cartpole", "*", "model_*.pt"))   # orphans wrote nothing
    finally:
        job.kill_all()


def test_ctrl_c_saves_and_resume_auto_continues_in_place(tmp_path):
    job = Job(cartpole_args(tmp_path), python=True)
    job.wait_for(r"^it +2/")
    job.signal(signal.SIGINT)
    assert job.finish(60) == 0, job.output()
    stopped = job.wait_for(r"after iteration (\d+); saved (\S+); continue it in place with: (.*)$")
    k, path = int(stopped.group(1)), stopped.group(2)
    run_dir = os.path.dirname(path)
    # this run's command, resuming this run (not the experiment's newest one, which in a sweep may be another)
    assert stopped.group(3) == shlex.join(["train.py", *cartpole_args(tmp_path), "--resume",
                                           os.path.abspath(run_dir)])
    open(os.path.join(run_dir, f"model_{k + 5}.pt.tmp-999-deadbeef"), "wb").write(b"half a checkpoint")
    cfg = preset("cartpole")
    cfg.log.root, cfg.resume, cfg.max_iterations, cfg.log.print_every = str(tmp_path), "auto", k + 2, 100
    train.main(cfg)
    expected = [f"model_{k}.pt", f"model_{k + 2}.pt", ".lock", "config_0.json", f"config_{k}.json"]
    assert sorted(os.listdir(run_dir)) == sorted(expected + [f for f in os.listdir(run_dir) if f.startswith("events")])
    assert tb_steps(run_dir) == list(range(1, k + 3))


@contextlib.contextmanager
def not_interrupted(what: str):
    """A KeyboardInterrupt escaping a test ends the whole pytest session: where none may come, one fails this test."""
    try:
        yield
    except KeyboardInterrupt as exc:
        pytest.fail(f"{what} interrupted at once ({type(exc).__name__})")


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_second_ctrl_c_interrupts_at_once_but_a_forwarded_duplicate_does_not(second):
    """torch 2.13's torchrun starts each rank in its own session: only torchrun gets the terminal's Ctrl-C, and it
    answers the second one with SIGTERM to the ranks (measured), which finished the iteration and saved."""
    stop = StopRequests(watch_launcher=False)
    try:
        with not_interrupted("the first Ctrl-C"):
            stop._on_signal(signal.SIGINT, None)
        if second == signal.SIGINT:
            with not_interrupted("a forwarded copy within the second"):
                stop._on_signal(second, None)         # a forwarded copy, within the second: ignored
            assert stop.signal_name == "SIGINT"
            stop._first_sigint -= 2.0
        with pytest.raises(KeyboardInterrupt) as raised:   # torchrun's SIGTERM: the second Ctrl-C however soon
            stop._on_signal(second, None)
        assert type(raised.value) is SecondInterrupt
    finally:
        stop.restore_default_handlers()


def test_sigterms_alone_never_interrupt_the_iteration(monkeypatch):
    """A scheduler's SIGTERM (repeated or not, seconds apart) stops at the iteration's end with a checkpoint."""
    clock = itertools.count(0.0, 5.0)
    monkeypatch.setattr("dist.stop.time.monotonic", lambda: next(clock))
    stop = StopRequests(watch_launcher=False)
    try:
        for _ in range(3):
            with not_interrupted("a SIGTERM"):
                stop._on_signal(signal.SIGTERM, None)
            assert stop.signal_name == "SIGTERM"
    finally:
        stop.restore_default_handlers()


@pytest.mark.parametrize("interrupt, said", [(SecondInterrupt, "by a second Ctrl-C"),
                                              (KeyboardInterrupt, "by Ctrl-C outside the training loop")])
def test_an_interrupt_says_whether_it_was_a_second_ctrl_c(monkeypatch, capsys, interrupt, said):
    """A Ctrl-C during start-up (a long one with Isaac Lab) is the first one the user sent: it must not be
    reported as a second."""
    monkeypatch.setattr(train, "main", lambda cfg, typed: (_ for _ in ()).throw(interrupt()))
    assert train.cli(preset("cartpole")) == 130
    assert capsys.readouterr().err == f"error: interrupted {said}: nothing saved since the last checkpoint\n"


def test_a_failure_releases_what_the_frames_of_its_whole_chain_hold(monkeypatch):
    """A learner whose weight-serving thread failed re-raises that failure while the batch's failed wait is handled
    (LearnerTeam.receive): the wait's error becomes its __context__, beside the __cause__ the thread's raise gave
    it. cli() cleared only the first of the two, so the wait's frames kept the learner's team, and with it the
    group its other rollout ranks wait in: they never saw it close, and the learner waited for them at exit
    (WeightServer.abandon) for --dist.timeout-s."""
    class Team:
        pass
    teams = []

    def receive(team):
        raise comm.CollectiveError("irecv for 'batches' failed: injected")

    def main(cfg, typed):
        team = Team()
        teams.append(weakref.ref(team))
        try:
            raise comm.CollectiveError("recv for 'weight_request' failed: injected") from ConnectionResetError()
        except comm.CollectiveError as exc:      # as the serving thread keeps it (WeightServer.failures)
            failure = exc
        try:
            receive(team)
        except comm.CollectiveError:
            raise failure
    monkeypatch.setattr(train, "main", main)
    monkeypatch.setattr(sys, "last_exc", None, raising=False)   # cli() records the failure there
    monkeypatch.setattr(sys, "last_value", None, raising=False)
    assert train.cli(preset("cartpole")) == 1
    recorded = sys.last_exc.__context__          # the failure, under the SystemExit(1) the process ends with
    assert recorded.__context__ is not None and recorded.__cause__ is not None
    assert teams[0]() is None


@pytest.mark.parametrize("error, code", [(RunError("a rollout rank died"), 1), (UsageError("bad flag"), 2),
                                         (RuntimeError("a bug"), 1)])
def test_a_failed_run_takes_sigterm_as_the_end_not_as_a_stop_request(monkeypatch, error, code):
    """After the error line, torchrun sends SIGTERM to the ranks still alive and SIGKILL 30 s later. The run's stop
    handlers, installed for the training loop, took that SIGTERM as a request to stop after the iteration (which
    never comes), so a rank whose clean-up waited on a peer was killed only then: cli() restores the defaults."""
    def main(cfg, typed):
        StopRequests(watch_launcher=False)        # as the training loop installs them
        raise error
    monkeypatch.setattr(train, "main", main)
    monkeypatch.setattr(sys, "last_exc", None, raising=False)
    monkeypatch.setattr(sys, "last_value", None, raising=False)
    assert train.cli(preset("cartpole")) == code
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_while_torch_imports_ends_at_once_without_a_traceback(tmp_path):
    """The first ~1.5 s of `python train.py` import torch and numpy: a KeyboardInterrupt there printed a traceback
    of import machinery and now and then aborted the interpreter (134). It now ends the process quietly with 130.
    A stand-in `torch` whose import waits makes the Ctrl-C land inside the import every time."""
    (tmp_path / "torch.py").write_text("import pathlib, time\npathlib.Path(__file__).with_name('importing').touch()\n"
                                       "time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    job = subprocess.Popen([sys.executable, os.path.join(REPO, "train.py"), "cartpole", "--dry-run"], cwd=tmp_path,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if (tmp_path / "importing").exists() or job.poll() is not None:
                break
            time.sleep(0.05)
        job.send_signal(signal.SIGINT)
        out, err = job.communicate(timeout=30)
    finally:
        job.kill()
    assert (tmp_path / "importing").exists()
    assert (job.returncode, out, err) == (130, "", "")


def stalled_body(rank, world_size, failed):
    """Rank 1 stalls until rank 0's all_reduce has failed (`failed` exists; 30 s at most): past the 2 s timeout."""
    init_distributed("gloo", "cpu", timeout_s=2.0)
    if rank == 1:
        deadline = time.monotonic() + 30
        while not os.path.exists(failed) and time.monotonic() < deadline:
            time.sleep(0.05)
        return "stalled"
    try:
        comm.all_reduce(torch.ones(3), "metrics")
    except comm.CollectiveError as exc:
        return str(exc)
    finally:
        open(failed, "w").close()
    return "no error"


@pytest.mark.slow
def test_a_stalled_rank_fails_the_others_naming_the_collective(tmp_path):
    message, _ = run_ranks(stalled_body, 2, args=(str(tmp_path / "failed"),), init_group=False)
    assert "all_reduce for 'metrics' failed on rank 0" in message and "--dist.timeout-s" in message
    assert "Timed out waiting 2000ms" in message            # --dist.timeout-s reached the backend


def test_two_runs_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda fmt: "2026-12-01_06-00-00")    # the same second, whatever the clock
    first, second = create_run_dir(str(tmp_path), None), create_run_dir(str(tmp_path), "job-7")
    assert os.path.basename(second) == os.path.basename(first) + "-2"
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    assert open(os.path.join(second, "run_id")).read() == "job-7"


def test_write_error_names_the_path_and_leaves_no_temporary(tmp_path, monkeypatch):
    def disk_full(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", disk_full)
    path = str(tmp_path / "model_3.pt")
    with pytest.raises(RunError, match=f"could not write checkpoint {path}: No space left on device"):
        save_checkpoint(path, {"iteration": 3})
    assert os.listdir(tmp_path) == []


def failing_file(error: BaseException):
    """A stand-in for the temporary save_checkpoint opens: `error` is raised once 4 KB of it are written."""
    class FailingFile:
        def __init__(self, path, mode):
            self.f, self.written = open(path, mode), 0

        def write(self, data):
            self.written += len(data)
            if self.written > 4096:
                raise error
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()
    return FailingFile


def test_a_second_ctrl_c_during_a_save_stays_an_interrupt_and_leaves_no_temporary(tmp_path, monkeypatch):
    """The second Ctrl-C raises from the signal handler wherever Python runs: inside torch.save's writes to the
    file, its zip writer is left mid-record and raised RuntimeError ("unexpected pos") over the interrupt, which
    cli() reported as a bug (traceback, status 1 instead of 130), and the temporary stayed."""
    monkeypatch.setattr("dist.checkpoint.open", failing_file(SecondInterrupt()), raising=False)
    path = str(tmp_path / "model_3.pt")
    with pytest.raises(SecondInterrupt):
        save_checkpoint(path, {"iteration": 3, "model": {"w": torch.zeros(10_000)}})
    assert os.listdir(tmp_path) == []


def test_a_disk_filling_up_during_a_save_is_the_write_error_and_leaves_no_temporary(tmp_path, monkeypatch):
    """A disk that fills up while torch.save writes a tensor (a 2 MB tmpfs as --log.root, a save every iteration,
    with rollout ranks) left the zip writer mid-record as a second Ctrl-C does: its RuntimeError ("unexpected pos")
    was reported as a bug with a traceback instead of the write error's one line."""
    monkeypatch.setattr("dist.checkpoint.open", failing_file(OSError(28, "No space left on device")), raising=False)
    path = str(tmp_path / "model_3.pt")
    with pytest.raises(RunError, match=f"could not write checkpoint {path}: No space left on device"):
        save_checkpoint(path, {"iteration": 3, "model": {"w": torch.zeros(10_000)}})
    assert os.listdir(tmp_path) == []


def test_a_run_directory_in_use_is_not_continued_by_a_second_run(tmp_path):
    """Two runs continuing one directory at once (`--resume auto` typed twice) overwrite each other's checkpoints
    and remove each other's saves in progress as stale: the second is refused naming the holder, and nothing of
    the first's is touched; once the holder is gone (the OS drops its lock) the directory continues."""
    run_dir = create_run_dir(str(tmp_path), None)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from dist.checkpoint import open_run_dir
        open_run_dir({run_dir!r}, {str(tmp_path)!r}, None)
        print("locked", flush=True)
        sys.stdin.read()
        """)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        in_progress = os.path.join(run_dir, "model_4.pt.tmp-123-abcdef01")    # the holder's save, being written
        open(in_progress, "wb").write(b"half a checkpoint")
        with pytest.raises(UsageError, match=rf"^run directory {re.escape(run_dir)} is in use by another run "
                                             rf"\(pid {holder.pid} on {re.escape(socket.gethostname())}\)"):
            open_run_dir(run_dir, str(tmp_path), None)
        assert os.path.exists(in_progress)
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert open_run_dir(run_dir, str(tmp_path), None) == run_dir     # released with its process
    assert not os.path.exists(in_progress)                            # now it is stale


@pytest.mark.parametrize("cause", ["lock is a directory", "permission denied"])
def test_a_run_directory_that_cannot_be_written_is_refused_in_one_line(tmp_path, monkeypatch, cause):
    """--resume RUN_DIR continues in place, so rank 0 opens RUN_DIR/.lock for writing first: another user's run or a
    read-only mount (PermissionError) and a .lock that is a directory were a traceback, not a line naming the fix."""
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.ppo.num_mini_batches, cfg.max_iterations = 4, 4, 1, 1
    cfg.log.root, cfg.log.print_every, cfg.dist.device = str(tmp_path), 100, "cpu"
    train.main(cfg)
    (run_dir,) = glob.glob(str(tmp_path / "cartpole" / "*"))
    if cause == "lock is a directory":
        os.remove(os.path.join(run_dir, ".lock"))
        os.mkdir(os.path.join(run_dir, ".lock"))
    else:
        def refuse(path, *args, **kwargs):
            if str(path).endswith(".lock"):
                raise PermissionError(13, "Permission denied", str(path))
            return open(path, *args, **kwargs)
        monkeypatch.setattr("dist.checkpoint.open", refuse, raising=False)
    before = sorted(os.listdir(run_dir))
    cfg.resume, cfg.max_iterations = run_dir, 2
    with pytest.raises(UsageError, match=rf"^run directory {re.escape(run_dir)} cannot be continued in place: "
                                         rf"(Is a directory|Permission denied) \(.*\.lock\); continue one of its "):
        train.main(cfg)
    assert sorted(os.listdir(run_dir)) == before


def test_a_read_only_run_directory_whose_lock_file_is_writable_is_refused_before_the_build(tmp_path):
    """`chmod a-w RUN_DIR` (a finished run kept from changes) leaves RUN_DIR/.lock writable: the lock opened, the run
    was built and failed at the TensorBoard writer with status 1, saying to free disk space."""
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.ppo.num_mini_batches, cfg.max_iterations = 4, 4, 1, 1
    cfg.log.root, cfg.log.print_every, cfg.dist.device = str(tmp_path), 100, "cpu"
    train.main(cfg)
    (run_dir,) = glob.glob(str(tmp_path / "cartpole" / "*"))
    before = sorted(os.listdir(run_dir))
    cfg.resume, cfg.max_iterations = run_dir, 2
    with read_only_folder(run_dir), pytest.raises(UsageError, match=rf"^run directory {re.escape(run_dir)} cannot "
                                                                     rf"be continued in place: "):
        train.main(cfg)
    assert sorted(os.listdir(run_dir)) == before
