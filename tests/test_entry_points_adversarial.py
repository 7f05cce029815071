"""Inputs to the secondary entry points (make variables, bench flags and environment, `python -m ppo.export`) that
an adversarial sweep found going wrong: each is now one line naming the thing to fix, before any work starts."""

import os
import resource
import subprocess
import sys

import pytest
import torch

from tests.forked_python import run_python
from tests.test_bench_flags import Launched, bench_mujoco, usage_error  # noqa: F401 (bench_mujoco: a fixture)
from tests.test_export import small_checkpoint
from tests.test_tools import exit_code, load_bench

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPORT = os.path.join(REPO, "ppo", "export.py")     # run from another folder: -m would not find ppo


# ---- bench/bench_train.py -----------------------------------------------------------------------------

@pytest.fixture
def bench_train(monkeypatch):
    """bench_train that stops where its learners would start (Launched), with torch's thread count restored."""
    module = load_bench("bench_train")
    threads = torch.get_num_threads()

    def launch(cfg, tmp, shapes, device):
        raise Launched(torch.get_num_threads())
    monkeypatch.setattr(module, "run_interleaved", launch)
    yield module
    torch.set_num_threads(threads)


@pytest.mark.parametrize("threads", ["", "abc", "0", "-1", "4,2"])
def test_bench_train_omp_num_threads_that_is_not_a_count_is_one_line(bench_train, monkeypatch, capsys, threads):
    """`OMP_NUM_THREADS= python bench/bench_train.py` (or `make bench OMP_NUM_THREADS=`, which the Makefile exports)
    ended in a ValueError traceback from int(); OMP_NUM_THREADS=0 in torch.set_num_threads' RuntimeError.

    Mutant: torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1"))) with no check before it.
    """
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    line = usage_error(bench_train.main, monkeypatch, capsys, ["bench_train.py", "--settings", "small"])
    assert line.startswith(f"bench_train.py: error: OMP_NUM_THREADS={threads!r} is not a positive number of threads")


@pytest.mark.parametrize("threads, expected", [("1", 1), (None, 1)])
def test_bench_train_a_thread_count_or_none_reaches_the_learners(bench_train, monkeypatch, threads, expected):
    """A valid OMP_NUM_THREADS (or none: 1) is what the learners run with.

    Mutant: the check refuses every value (or an unset OMP_NUM_THREADS).
    """
    if threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
    monkeypatch.setattr("sys.argv", ["bench_train.py", "--settings", "small"])
    with pytest.raises(Launched) as launched:
        bench_train.main()
    assert launched.value.args[0] == expected


def test_bench_train_sizes_past_the_machine_s_memory_are_one_line():
    """`bench_train.py --num-envs 400000000` ended in the CPU allocator's RuntimeError traceback from the env's
    build (train.py says the same failure in one line naming the flag to lower). Run under an 8 GiB address-space
    limit, so the 9.6 GB the env asks for fails at once whatever the machine has.

    Mutant: main() without its out-of-memory handler around the settings' runs.
    """
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))
    result = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_train.py"), "--quick", "--settings",
                             "small", "--num-envs", "400000000"], cwd=REPO, capture_output=True, text=True,
                            timeout=120, preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("bench_train: out of memory: ") and last.endswith("; lower --num-envs (or leave out "
                                                                             "--settings large)"), result.stderr


@pytest.mark.parametrize("threads", ["", "abc", "0"])
def test_bench_grad_sync_omp_num_threads_that_is_not_a_count_is_one_line(monkeypatch, capsys, threads):
    """libgomp took `OMP_NUM_THREADS=abc` (or "" or 0) for unset, with a warning: every rank ran a thread per core
    (the oversubscription the bench's one-thread default is there to avoid) under a header reading
    OMP_NUM_THREADS=abc.

    Mutant: no check of OMP_NUM_THREADS in bench_grad_sync.main (its ranks start).
    """
    module = load_bench("bench_grad_sync")
    monkeypatch.setattr(module, "launch", lambda args, target, *rest: (_ for _ in ()).throw(Launched(args)))
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    line = usage_error(module.main, monkeypatch, capsys, ["bench_grad_sync.py", "--quick"])
    assert line == (f"bench_grad_sync.py: error: OMP_NUM_THREADS={threads!r} is not a positive number of threads; "
                    f"set it to one (or unset it: 1)")


# ---- bench/bench_mujoco.py ----------------------------------------------------------------------------

@pytest.mark.parametrize("flags, twice", [
    (["--seeds", "1", "1"], "--seeds names 1 twice"),
    (["--seeds", "0", "00"], "--seeds names 0 twice"),          # the same integer, typed two ways
    (["--tasks", "Hopper-v4", "Hopper-v4"], "--tasks names Hopper-v4 twice"),
    (["--ranks", "1", "2", "1"], "--ranks names 1 twice"),
])
def test_bench_mujoco_a_run_named_twice_is_refused_before_any_run(bench_mujoco,  # noqa: F811 (the fixture)
                                                                   monkeypatch, capsys, tmp_path, flags, twice):
    """`--seeds 1 1` queued the same hour-long run twice (its results were not yet recorded when the queue was
    built): with --jobs 1 it ran again and rewrote the first one's train.log; with --jobs 2 both ran at once in one
    run directory.

    Mutant: no check for a value listed twice in --tasks, --seeds or --ranks.
    """
    line = usage_error(bench_mujoco.main, monkeypatch, capsys,
                       ["bench_mujoco.py", "--root", str(tmp_path), "--jobs", "2", *flags])
    assert line == f"bench_mujoco.py: error: {twice}; list each once"


GOOD = b'{"key": "Hopper-v4/ranks1/seed1/steps2048", "last_episodes_return": 1.0}\n'


@pytest.mark.parametrize("content, line", [
    (GOOD + b'{"key": "Hopper-v4/ranks1/seed2/steps2048", "last_ep', 2),     # killed while appending its line
    (b"garbage\n", 1),
    (b"[1, 2]\n", 1),
    (b'{"key": 1}\n', 1),                   # the table's join of the old results' keys: a TypeError traceback
    (GOOD + b"\xff\xfe\x00\n", 2),           # a UnicodeDecodeError traceback
])
def test_bench_mujoco_results_file_it_cannot_read_is_one_line_naming_the_line(monkeypatch, tmp_path, content, line):
    """A results.jsonl with a line this bench did not write (a run killed while appending its line leaves half
    of one) ended every later call, --table-only included, in a JSONDecodeError (or TypeError, UnicodeDecodeError)
    traceback.

    Mutant: load_results parses each line with json.loads and no handler.
    """
    (tmp_path / "results.jsonl").write_bytes(content)
    module = load_bench("bench_mujoco")
    monkeypatch.setattr("sys.argv", ["bench_mujoco.py", "--root", str(tmp_path), "--table-only"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    said = str(exit_info.value.code)
    assert said.startswith(f"bench_mujoco: {tmp_path / 'results.jsonl'} line {line} is not a result this bench "
                           f"wrote (") and said.endswith("); delete that line, or pick another --root"), said


def test_bench_mujoco_results_file_that_is_a_folder_is_one_line(monkeypatch, tmp_path):
    """--root whose results.jsonl is a folder: an IsADirectoryError traceback.

    Mutant: load_results opens the file with no OSError handler.
    """
    (tmp_path / "results.jsonl").mkdir()
    module = load_bench("bench_mujoco")
    monkeypatch.setattr("sys.argv", ["bench_mujoco.py", "--root", str(tmp_path), "--table-only"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == (f"bench_mujoco: {tmp_path / 'results.jsonl'} cannot be read (Is a directory); "
                                    f"pick another --root")


def test_bench_mujoco_a_run_with_too_few_episodes_is_one_line(monkeypatch, tmp_path):
    """A run that finished fewer episodes than --last-episodes ended the bench in the RuntimeError's traceback
    (raised in a worker thread, re-raised by future.result()), after the run.

    Mutant: run() lets final_returns' RuntimeError through.
    """
    from torch.utils.tensorboard import SummaryWriter
    module = load_bench("bench_mujoco")

    def finished_run(cmd, cwd=None, **kwargs):       # what train.py leaves: 3 episodes in 1 iteration
        writer = SummaryWriter(os.path.join(cmd[cmd.index("--log.root") + 1], "mujoco", "2026-01-01_00-00-00"))
        writer.add_scalar("Train/mean_reward", 1.0, 1)
        for value in (1.0, 2.0, 3.0):
            writer.add_scalar("Episode/return", value, 1)
        writer.close()
        return 0
    monkeypatch.setattr(module, "run_child", finished_run)
    monkeypatch.setattr("sys.argv", ["bench_mujoco.py", "--root", str(tmp_path), "--tasks", "Hopper-v4", "--seeds",
                                     "1", "--ranks", "1", "--total-steps", "2048", "--last-iterations", "1",
                                     "--last-episodes", "5"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    root = tmp_path / module.run_key("Hopper-v4", 1, 1, 2048)
    assert exit_info.value.code == (f"bench_mujoco: {root}: only 3 episodes finished, fewer than --last-episodes 5; "
                                    f"lower --last-episodes")


def _job_dirs(module, monkeypatch, name: str) -> list:
    """Replace `module`'s `name` (its run_child, bench/_common.py's) by one that notes the folder each job's
    --log.root names, read from the job's working directory, then stops the bench (Launched)."""
    seen = []

    def job(cmd, cwd=None, **kwargs):
        seen.append(os.path.join(cwd or os.getcwd(), cmd[cmd.index("--log.root") + 1]))
        raise Launched(cmd)
    monkeypatch.setattr(module, name, job)
    return seen


def test_bench_mujoco_relative_root_is_where_the_runs_write_from_any_folder(monkeypatch, tmp_path):
    """From a folder other than the repository, `--root rel` made ./rel/<run>/train.log while train.py (run in the
    repository) wrote its TensorBoard files under <repo>/rel/<run>: the bench then failed with an IndexError
    traceback reading them back, after the run (hours).

    Mutant: --root passed on to train.py as typed (relative), not made absolute.
    """
    module = load_bench("bench_mujoco")
    seen = _job_dirs(module, monkeypatch, "run_child")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["bench_mujoco.py", "--root", "rel", "--tasks", "Hopper-v4", "--seeds", "1",
                                     "--ranks", "1", "--total-steps", "2048", "--last-iterations", "1"])
    with pytest.raises(Launched):
        module.main()
    assert seen == [str(tmp_path / "rel" / module.run_key("Hopper-v4", 1, 1, 2048))]


def test_bench_rollout_relative_out_is_where_the_jobs_write_from_any_folder(monkeypatch, tmp_path):
    """`bench_rollout.py --out rel` from another folder: its jobs (run in the repository) wrote under <repo>/rel while
    the bench looked for their run directories under ./rel (an IndexError traceback after each job).

    Mutant: --out used as typed (relative) for the jobs' --log.root.
    """
    module = load_bench("bench_rollout")
    seen = _job_dirs(module, monkeypatch, "run_child")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["bench_rollout.py", "--quick", "--parts", "throughput", "--out", "rel"])
    with pytest.raises(Launched):
        module.main()
    assert len(seen) == 1 and seen[0].startswith(str(tmp_path / "rel") + os.sep), seen


# ---- python -m ppo.export -----------------------------------------------------------------------------

def test_export_an_empty_out_is_refused_not_taken_for_the_default(tmp_path):
    """`--out ''` wrote the policy beside the checkpoint, as if --out had not been typed (bench_mujoco's --root ''
    and bench_rollout's --out '' are refused).

    Mutant: `--out ''` passed on to export() as its default "" (the checkpoint's folder).
    """
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    result = run_python([EXPORT, path, "--out", ""], cwd=str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == ["error: --out is empty; pass a folder ('.' for the current one), or leave "
                                          "--out out to write beside the checkpoint"]
    assert sorted(os.listdir(tmp_path)) == ["model_3.pt"]


def test_export_out_dot_still_writes_to_the_current_folder(tmp_path):
    """'.' is the way to name the current folder: it still exports there.

    Mutant: every --out that is not a folder's full path refused.
    """
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    (tmp_path / "here").mkdir()
    result = run_python([EXPORT, path, "--out", "."], cwd=str(tmp_path / "here"), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert {"model_3.policy.pt", "model_3.policy.pt2"} <= set(os.listdir(tmp_path / "here"))


@pytest.mark.parametrize("ext, link", [(".pt", "symlink"), (".onnx", "hard link")])
def test_export_refuses_to_write_over_its_checkpoint_through_a_link(tmp_path, ext, link):
    """A link to the checkpoint at an output's name (out/model_3.policy.pt -> ../model_3.pt): the export wrote the
    TorchScript policy through it, over the training checkpoint.

    Mutant: no check that an output name is the checkpoint itself (os.path.samefile).
    """
    from ppo import export
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    before = open(path, "rb").read()
    out = tmp_path / "out"
    out.mkdir()
    target = out / f"model_3.policy{ext}"
    if link == "symlink":
        os.symlink(path, target)
    else:
        os.link(path, target)
    with pytest.raises(ValueError) as info:
        export.export(path, str(out))
    assert str(info.value) == (f"{str(target)!r} is the checkpoint itself (a link to it), where the export writes a "
                               f"file; remove that link, or pass --out with another folder")
    assert open(path, "rb").read() == before and sorted(os.listdir(out)) == [target.name]


# ---- Makefile -----------------------------------------------------------------------------------------

def _make_train(tmp_path, nproc: str) -> subprocess.CompletedProcess:
    """`make train NPROC=nproc` where a passing check goes on to build a venv that cannot be built (PY=false)."""
    return subprocess.run(["make", "train", f"NPROC={nproc}", "ARGS=--help", f"VENV={tmp_path / 'fresh'}", "PY=false"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("over", [1, 10**22])
def test_make_train_refuses_more_ranks_than_the_machine_can_host(tmp_path, over):
    """`make train NPROC=99999999999999999999999` hung with no output: torchrun builds a worker spec per rank
    before starting any (memory growing until killed); NPROC=1000 would start a thousand ranks.

    Mutant: no upper bound on NPROC in train-settings (or one of 4 per core + 1).
    """
    cores = int(subprocess.run(["getconf", "_NPROCESSORS_ONLN"], capture_output=True, text=True).stdout)
    nproc = 4 * cores + over
    result = _make_train(tmp_path, str(nproc))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[0] == (f"error: NPROC={nproc} is more ranks than this machine can host: at "
                                             f"most 4 per CPU core ({cores} cores, so NPROC={4 * cores})")
    assert "torchrun" not in result.stdout and not (tmp_path / "fresh").exists()


def test_make_train_takes_four_ranks_per_core(tmp_path):
    """NPROC = 4 x cores passes the check (it goes on to build the venv, here with a Python that fails).

    Mutant: the bound is 4 per core exclusive (-ge), or counts something else than the cores.
    """
    cores = int(subprocess.run(["getconf", "_NPROCESSORS_ONLN"], capture_output=True, text=True).stdout)
    result = _make_train(tmp_path, str(4 * cores))
    assert "error: NPROC" not in result.stderr and "venv" in result.stdout, result.stdout + result.stderr
