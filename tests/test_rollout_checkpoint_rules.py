"""dist/checkpoint.py and dist/setup.py's join of the process group, piece by piece: a save fsyncs its temporary,
renames it over the path, then fsyncs the directory, and a failed save leaves the old file as it was (a non-disk
error raised as itself); which run and which file a resume takes; the run lock never blocks and names its holder
alone; a read-only --root is only checked to be a directory; every rank's RNG states come back from the gather as
that rank's, and a learner team's rollout states go to learner 0 by a gather; init_distributed hands the process
group torchrun's store under a prefix of the restart count, this rank's number, the --dist.timeout-s and the rank's
GPU. (Rollout ranks at a resume: tests/test_rollout_resume_rules.py.)"""

import fnmatch
import os
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as torch_dist

from dist import comm
from dist.checkpoint import gather_rng_states, save_checkpoint
from dist.errors import RunError
from dist.setup import init_distributed
from tests.multirank import run_ranks

# ----- save_checkpoint: temporary, fsync, rename, directory fsync -------------------------------------------


def test_a_save_fsyncs_a_temporary_renames_it_over_the_path_then_fsyncs_the_directory(tmp_path, monkeypatch):
    """The order that makes a crash leave the old file or the new one, complete: the new bytes are fsynced under a
    temporary name of the same directory (one remove_stale_temporaries would clear), renamed over the path, and the
    directory entry is fsynced after the rename. Recorded by inode, so each fsync is known by what it synced."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino, src, dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "model_3.pt"
    path.write_bytes(b"the previous save")
    save_checkpoint(str(path), {"iteration": 3, "model": {"w": torch.arange(4.0)}})
    new, directory = os.stat(path).st_ino, os.stat(tmp_path).st_ino
    assert [e[:2] for e in events] == [("fsync", new), ("replace", new), ("fsync", directory)], events
    src, dst = events[1][2:]
    assert dst == str(path) and src != dst and os.path.dirname(src) == str(tmp_path)
    assert fnmatch.fnmatch(os.path.basename(src), "model_*.pt.tmp*"), src     # the pattern stale temporaries match
    assert os.listdir(tmp_path) == ["model_3.pt"]
    saved = torch.load(path, weights_only=False)
    assert saved["iteration"] == 3 and saved["model"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_failed_save_leaves_the_previous_file_as_it_was(tmp_path, monkeypatch):
    """A disk that fills mid-write: the previous checkpoint at that path is untouched (only the temporary was
    written and is removed), so a resume still finds a complete file."""
    def disk_full(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    path = tmp_path / "model_3.pt"
    path.write_bytes(b"the previous save")
    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(RunError, match="could not write checkpoint"):
        save_checkpoint(str(path), {"iteration": 3})
    assert os.listdir(tmp_path) == ["model_3.pt"] and path.read_bytes() == b"the previous save"


def test_a_save_that_fails_for_another_reason_than_the_disk_raises_that_error_and_leaves_no_temporary(tmp_path,
                                                                                                      monkeypatch):
    """Only an OSError is the disk's (RunError naming the path); anything else (a state torch cannot pickle, a bug)
    is raised as itself, not reported as a full disk, and its temporary is removed all the same."""
    def unpicklable(obj, f):
        f.write(b"partial")
        raise TypeError("cannot pickle 'generator' object")

    monkeypatch.setattr(torch, "save", unpicklable)
    with pytest.raises(TypeError, match="^cannot pickle 'generator' object$"):
        save_checkpoint(str(tmp_path / "model_3.pt"), {"iteration": 3})
    assert os.listdir(tmp_path) == []


# ----- run directories: which run and which checkpoint a resume takes -----------------------------------------

def test_the_newest_run_is_the_one_whose_checkpoint_was_written_last_not_the_newest_directory(tmp_path):
    """A run directory's own mtime changes with any file made in it (TensorBoard's, a lock): the run whose latest
    checkpoint file is newest wins, whatever the directories' times say."""
    from dist.checkpoint import newest_run_with_checkpoint
    runs = (("old-name", 2_000_000, 1_000_000), ("new-name", 1_000_000, 3_000_000))   # (run, checkpoint, directory)
    for run, checkpoint_time, directory_time in runs:
        (tmp_path / run).mkdir()
        (tmp_path / run / "model_4.pt").write_bytes(b"x")
        os.utime(tmp_path / run / "model_4.pt", (checkpoint_time, checkpoint_time))
        os.utime(tmp_path / run, (directory_time, directory_time))
    assert newest_run_with_checkpoint(str(tmp_path)) == str(tmp_path / "old-name")


def test_only_a_name_that_ends_in_model_k_pt_is_a_checkpoint(tmp_path):
    """model_<k>.pt exactly: a copy named model_12.pt.bak.pt (which the glob model_*.pt also lists) is not iteration
    12."""
    from dist.checkpoint import latest_checkpoint
    for name in ("model_3.pt", "model_12.pt.bak.pt", "model_x12.pt"):
        (tmp_path / name).write_bytes(b"x")
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "model_3.pt")


def test_the_newest_run_is_found_by_its_checkpoint_s_time_whichever_name_sorts_last(tmp_path):
    """Directory names sort the other way round from the checkpoints' times here (a clock set back, a run named by
    hand): "b-run" sorts after "a-run", but a-run's checkpoint was written last, and a-run it is."""
    from dist.checkpoint import newest_run_with_checkpoint
    for run, written in (("a-run", 3_000_000), ("b-run", 1_000_000)):
        (tmp_path / run).mkdir()
        (tmp_path / run / "model_5.pt").write_bytes(b"x")
        os.utime(tmp_path / run / "model_5.pt", (written, written))
    assert newest_run_with_checkpoint(str(tmp_path)) == str(tmp_path / "a-run")


def test_a_restart_finds_the_run_of_its_own_job_id_not_of_one_that_contains_it(tmp_path):
    """find_run_dir compares whole run ids: job "job-1" is not the run of job "job-12" (listed first here)."""
    from dist.checkpoint import find_run_dir
    for run, run_id in (("2024-01-01_00-00-00", "job-12\n"), ("2024-01-02_00-00-00", "job-1\n")):
        (tmp_path / run).mkdir()
        (tmp_path / run / "run_id").write_text(run_id)
    assert find_run_dir(str(tmp_path), "job-1") == str(tmp_path / "2024-01-02_00-00-00")
    assert find_run_dir(str(tmp_path), "job-") is None


def test_every_stale_temporary_is_removed_not_only_the_first(tmp_path):
    """Two saves killed in turn leave two temporaries; continuing the run removes both, and only them."""
    from dist.checkpoint import remove_stale_temporaries
    names = ["model_4.pt.tmp-11-aaaaaaaa", "model_8.pt.tmp-12-bbbbbbbb", "model_4.pt"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(remove_stale_temporaries(str(tmp_path))) == [str(tmp_path / name) for name in names[:2]]
    assert os.listdir(tmp_path) == ["model_4.pt"]


def test_the_run_directory_lock_never_waits_and_names_only_its_holder(tmp_path, monkeypatch):
    """lock_run_dir asks flock for an exclusive lock without blocking (a second run is refused at once, never left
    waiting for the first to end), and the lock file then names this process alone, even over a longer line a
    dead run left there."""
    import fcntl
    import socket
    from dist import checkpoint
    asked, real_flock = [], fcntl.flock
    monkeypatch.setattr(checkpoint.fcntl, "flock", lambda f, flags: (asked.append(flags), real_flock(f, flags)))
    (tmp_path / ".lock").write_text("pid 4000000 on a-much-longer-host-name-of-a-run-that-died.example.org\n")
    try:
        checkpoint.lock_run_dir(str(tmp_path))
        assert asked == [fcntl.LOCK_EX | fcntl.LOCK_NB]
        assert (tmp_path / ".lock").read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
    finally:
        checkpoint.release_run_dirs()


def test_a_root_that_is_only_read_is_checked_to_be_a_directory_and_never_written(tmp_path, monkeypatch):
    """check_writable_root(write=False) (a bench that only prints its table from --root) asks only that the root
    be a directory: no probe is made there, so a read-only results folder is fine; write=True probes and refuses."""
    from dist import log_root
    from dist.errors import UsageError

    def read_only(prefix, dir):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(log_root.tempfile, "mkdtemp", read_only)
    log_root.check_writable_root(str(tmp_path / "results"), "--root", write=False)
    with pytest.raises(UsageError, match=r"^--root .*: .* is not writable \(Permission denied\)"):
        log_root.check_writable_root(str(tmp_path / "results"), "--root")
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match=r"is a file, not a directory"):
        log_root.check_writable_root(str(tmp_path / "file" / "results"), "--root", write=False)


# ----- gather_rng_states on several ranks --------------------------------------------------------------------

def gather_body(rank, world_size):
    """States of sizes 5, 2 and 3 whose bytes name the rank and the state: rank r's "torch" is 10r + 0..4."""
    states = {"torch": torch.arange(5, dtype=torch.uint8) + 10 * rank,
              "shuffle": torch.tensor([100 + rank, 150 + rank], dtype=torch.uint8),
              "env": torch.full((3,), 200 + rank, dtype=torch.uint8)}
    return gather_rng_states(states)


@pytest.mark.slow
def test_rank_0_gets_each_rank_s_rng_states_under_their_names_in_rank_order():
    """The checkpoint keeps rng[r] for rank r: each row of the gather is unpacked as that rank's, on rank 0, which
    writes the checkpoint (one process cannot tell rows apart); the other ranks send theirs and get nothing."""
    got, *others = run_ranks(gather_body, 3)
    expected = [{"torch": [10 * r + i for i in range(5)], "shuffle": [100 + r, 150 + r], "env": [200 + r] * 3}
                for r in range(3)]
    assert [{k: v.tolist() for k, v in states.items()} for states in got] == expected
    assert all(list(states) == ["torch", "shuffle", "env"] for states in got)
    assert others == [[], []]


def test_the_rng_plan_row_is_one_gather_of_every_state_s_bytes_at_each_save():
    from dist.checkpoint import rng_plan_row
    row = rng_plan_row({"torch": torch.zeros(5056, dtype=torch.uint8), "env": torch.zeros(16, dtype=torch.uint8)}, 7)
    assert (row.purpose, row.collective, row.cadence, row.call_bytes, row.every) == \
        ("checkpoint", "gather", "checkpoint", [5056 + 16], 7)


@pytest.mark.parametrize("stop, save", [(False, False), (False, True), (True, True)])
def test_a_learner_team_gathers_its_rollout_states_to_learner_0_at_a_save_alone_and_publishes_unless_stopped(
        monkeypatch, stop, save):
    """LearnerTeam.finish after iteration 4: the decision goes down; at a save the team's states (the receiver's blob)
    go to learner 0 by one gather, not an all-gather that would bring every learner the states learner 0 alone
    writes (one process: the gather is a stack of one); weights 5 are published unless the learners stopped (the
    rollout ranks ask for none after a stop: a copy of the model for nobody)."""
    from rollout_ranks import LearnerTeam
    blob, calls, gather = torch.arange(10, dtype=torch.uint8), [], comm.gather

    def no_all_gather(*args, **kwargs):
        raise AssertionError("an all-gather: every learner would receive the states learner 0 alone writes")

    def gathered(tensor, purpose, dst=0):
        calls.append(("gather", purpose, dst))
        return gather(tensor, purpose, dst)

    monkeypatch.setattr(comm, "all_gather", no_all_gather)
    monkeypatch.setattr(comm, "gather", gathered)
    team = object.__new__(LearnerTeam)
    team.receiver = SimpleNamespace(decide=lambda *decision: calls.append(("decide", decision)), states=lambda: blob)
    team.weights = SimpleNamespace(publish=lambda model, version: calls.append(("publish", version)))
    got = team.finish(None, 4, stop, save)
    assert calls == [("decide", (stop, save))] + ([("gather", "checkpoint", 0)] if save else []) + \
        ([] if stop else [("publish", 5)])
    assert got.tolist() == [list(range(10))] if save else got is None


# ----- init_distributed: what the process group is given -----------------------------------------------------

@pytest.fixture
def joined(monkeypatch):
    """torchrun's variables for rank 1 of 2 on one node; init_process_group, TCPStore and PrefixStore recorded, not
    run (no group is joined)."""
    for name in ("LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "10.1.2.3"),
                        ("MASTER_PORT", "29411")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(comm, "_DEVICE", comm._DEVICE)
    monkeypatch.setattr(comm, "_GROUP", comm._GROUP)
    calls = {}
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch_dist, "init_process_group", lambda **kw: calls.setdefault("group", kw))
    monkeypatch.setattr(torch_dist, "TCPStore", lambda *a, **kw: calls.setdefault("store", (a, kw)) and "tcp")
    monkeypatch.setattr(torch_dist, "PrefixStore", lambda prefix, store: calls.setdefault("prefix", (prefix, store))
                        and "prefixed")
    return monkeypatch, calls


def test_a_plain_launch_joins_with_the_backend_and_the_timeout_and_no_store(joined):
    monkeypatch, calls = joined
    info = init_distributed("gloo", "cpu", timeout_s=7.5)
    assert calls == {"group": {"backend": "gloo", "timeout": timedelta(seconds=7.5), "device_id": None}}
    assert (info.rank, info.world_size, info.backend, info.device) == (1, 2, "gloo", torch.device("cpu"))


def test_a_restart_under_the_agent_store_joins_its_own_prefix_as_a_client_with_this_rank(joined):
    """Under torchrun's agent store, restart 3 of the job: a client (is_master False: the agent serves the store) of
    MASTER_ADDR:MASTER_PORT for WORLD_SIZE ranks, keys under syncppo/restart3 so that no key of an earlier round is
    read, and this rank's own number."""
    monkeypatch, calls = joined
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    init_distributed("gloo", "cpu", timeout_s=9.0)
    args, kwargs = calls["store"]
    assert args == ("10.1.2.3", 29411, 2) and kwargs == {"is_master": False, "timeout": timedelta(seconds=9.0)}
    assert calls["prefix"] == ("syncppo/restart3", "tcp")
    assert calls["group"] == {"backend": "gloo", "timeout": timedelta(seconds=9.0), "device_id": None,
                              "store": "prefixed", "rank": 1, "world_size": 2}


def test_a_gpu_rank_joins_nccl_bound_to_its_own_device(joined):
    monkeypatch, calls = joined
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    init_distributed("auto", "auto", timeout_s=5.0)
    assert calls["group"] == {"backend": "nccl", "timeout": timedelta(seconds=5.0), "device_id": torch.device("cuda:1")}
