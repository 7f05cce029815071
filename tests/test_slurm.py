"""slurm/train.sbatch run for real under bash, with stand-ins for SLURM's `srun`, `scontrol` and `scancel` first on
PATH: the fake srun starts one copy of its command per node (SLURM_JOB_NUM_NODES), each with SLURM_NODEID /
SLURM_PROCID / SLURM_LOCALID and a working directory of its own, and waits for them all; like real srun (Slurm's
src/srun/signals.c) it answers a SIGTERM by SIGKILLing its step (FAKE_SRUN_LINGER: it stays after its tasks end, until
the step is signalled, as a step tearing down). The fake `scancel --signal=SIG JOBID` sends SIG to every process of the
step (tasks and their descendants, as slurmstepd does: the ranks get it from it and from torchrun, which dist/stop.py
takes as one request), not to the batch shell (scancel(1)). The fake scontrol names localhost as every node and records
`scontrol requeue JOBID` in a file (FAKE_REQUEUE_REFUSED: refuses it with real scontrol's error). What this cannot
show: real SLURM's `--signal=B:USR1@...` timing and what a real requeue does to the running job (it ends it: SIGTERM,
KillWait, SIGKILL to what is left, here only the batch shell)."""

import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from bench._common import dying_with_this_process
from dist.checkpoint_read import load_checkpoint
from tests.multirank import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "slurm", "train.sbatch")
TRAIN = ["cartpole", "--max-iterations", "2", "--env.num-envs", "16", "--ppo.num-steps", "16"]

# Every process of the fake step: its tasks (FAKE_STEP_PIDS, written by the fake srun) and all their descendants, as
# slurmstepd signals its step's whole process tree (the ranks too, not only each node's torchrun).
STEP_SIGNAL = r"""
step_signal() {
    local todo=() pids=() pid
    [ -f "$FAKE_STEP_PIDS" ] && mapfile -t todo <"$FAKE_STEP_PIDS"
    while ((${#todo[@]})); do
        pid=${todo[0]}; todo=("${todo[@]:1}"); pids+=("$pid")
        todo+=($(ps -o pid= --ppid "$pid"))
    done
    ((${#pids[@]} == 0)) || kill -"$1" "${pids[@]}" 2>/dev/null
}
"""

FAKE_SRUN = r"""#!/bin/bash
# srun's options (all --name=value here) up to the command; one copy per node, each in its own folder.
""" + STEP_SIGNAL + r"""
while [[ $1 == -* ]]; do shift; done
pids=()
: >"$FAKE_STEP_PIDS"
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
    mkdir -p "$FAKE_NODES/$node"
    (cd "$FAKE_NODES/$node" && SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 exec "$@") &
    pids+=($!)
    echo $! >>"$FAKE_STEP_PIDS"
done
# Real srun does not forward SIGTERM: it SIGKILLs every task of its step (Slurm's src/srun/signals.c).
trap 'echo "srun: forcing job termination"; step_signal KILL' TERM
status=0
for pid in "${pids[@]}"; do
    while :; do
        wait "$pid"; code=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    [ "$code" -gt "$status" ] && status=$code
done
if [ -n "${FAKE_SRUN_LINGER:-}" ]; then    # a step still tearing down after its tasks ended: until it is signalled
    sleep infinity & sleeper=$!
    echo "$sleeper" >>"$FAKE_STEP_PIDS"
    echo "fake srun: tasks ended"
    while kill -0 "$sleeper" 2>/dev/null; do wait "$sleeper"; done
fi
exit "$status"
"""

FAKE_SCONTROL = r"""#!/bin/bash
if [ "$1" = requeue ] && [ $# = 2 ]; then    # recorded; FAKE_REQUEUE_REFUSED: as for a job without --requeue
    [ -z "${FAKE_REQUEUE_REFUSED:-}" ] || { echo "Requested operation is presently disabled for job $2" >&2; exit 1; }
    echo "requeue $2" >>"$FAKE_REQUEUES"
    exit 0
fi
[ "$1 $2" = "show hostnames" ] || { echo "fake scontrol: only 'show hostnames' and 'requeue JOBID'" >&2; exit 1; }
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do echo localhost; done
"""

# `scancel --signal=SIG JOBID`: the signal to every process of the job's steps, not to the batch shell; recorded.
FAKE_SCANCEL = r"""#!/bin/bash
""" + STEP_SIGNAL + r"""
[[ $# = 2 && $1 == --signal=* && $2 = "$SLURM_JOB_ID" ]] || { echo "fake scancel: only --signal=SIG JOBID" >&2
    exit 1; }
echo "scancel $*" >>"$FAKE_SCANCELS"
step_signal "${1#--signal=}"
"""


class Batch:
    """The batch script as sbatch would start it: bash, a job's SLURM_* variables, stdout read line by line."""

    def __init__(self, tmp_path, args, job_id="4242", restart_count=0, **extra_env):
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
               "SLURM_JOB_ID": job_id, "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
               "SLURM_SUBMIT_DIR": REPO, "SLURM_RESTART_COUNT": str(restart_count), "SLURM_CPUS_PER_TASK": "1",
               "NPROC": "1", "RDZV_PORT": str(free_port()), "LOG_ROOT": str(tmp_path / "runs"),
               "VENV": os.path.dirname(os.path.dirname(sys.executable)),
               "FAKE_NODES": str(tmp_path / f"nodes-{restart_count}"), "FAKE_REQUEUES": str(tmp_path / "requeues"),
               "FAKE_STEP_PIDS": str(tmp_path / f"step-{restart_count}"), "FAKE_SCANCELS": str(tmp_path / "scancels"),
               **extra_env}
        env.pop("SLURM_GPUS_ON_NODE", None)
        if "REQUEUE" not in extra_env:                 # the script's default, whatever this shell's
            env.pop("REQUEUE", None)
        self.env = env
        self.lines: list[str] = []
        self.proc = subprocess.Popen([SCRIPT, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     preexec_fn=dying_with_this_process())
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        """Poll the output for a line matching `pattern`; fail, with the output, if none comes in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r}:\n{self.output()}")

    def finish(self, timeout: float = 180) -> int:
        try:
            code = self.proc.wait(timeout)
        finally:
            self.kill()
        self.reader.join(10)
        return code

    def kill(self) -> None:
        """What is left of the job: the script's process group (fake srun, torchruns); torchrun's ranks, in
        sessions of their own, stop at their iteration's end once their launcher is gone (dist/stop.py)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_dirs(root) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "cartpole", "*")))


def requeues(tmp_path, name="requeues") -> list[str]:
    """The `scontrol requeue JOBID` calls the fake scontrol took (name="scancels": the fake scancel's), in order."""
    path = tmp_path / name
    return path.read_text().splitlines() if path.exists() else []


def scancel_steps(batch: Batch) -> None:
    """`scancel --signal=TERM JOBID` typed by hand: SIGTERM to the job's steps, not to the batch shell."""
    subprocess.run([str(batch.env["PATH"].split(":")[0] + "/scancel"), "--signal=TERM", batch.env["SLURM_JOB_ID"]],
                   env=batch.env, check=True)


@pytest.mark.slow
def test_two_fake_nodes_train_what_one_node_with_two_ranks_trains(tmp_path, one_node_two_ranks):
    """The script's torchrun per node meets the other through c10d rendezvous at the first node of
    `scontrol show hostnames`, one rank each (NPROC=1), and learns the weights of `torchrun --standalone
    --nproc-per-node 2` bit for bit (tests/test_multi_node.py: rank r seeds from its global rank).
    Mutant: `--nnodes 1` instead of "$SLURM_JOB_NUM_NODES" -> each node a world of 1 of its own: the job fails.
    Mutant: `--rdzv-id run` instead of the job id -> the run_id marker is not the job's (a requeue could not find it).
    Mutant: `NPROC=${SLURM_GPUS_ON_NODE:-}` (no NPROC override) -> exit 2, ranks per node unknown."""
    one_node = one_node_two_ranks(TRAIN)     # tests/conftest.py: one run for this test and tests/test_multi_node.py
    batch = Batch(tmp_path, TRAIN)
    try:
        one = one_node()
        code = batch.finish()
    finally:
        batch.kill()
    assert code == 0, batch.output()
    (run_dir,) = run_dirs(tmp_path / "runs")
    assert open(os.path.join(run_dir, "run_id")).read() == "4242"          # --rdzv-id is the job id
    two = load_checkpoint(os.path.join(run_dir, "model_2.pt"))
    assert two["config"]["max_iterations"] == 2
    assert one.keys() == two["model"].keys()
    for key in one:
        assert torch.equal(one[key], two["model"][key]), key
    assert "world size 2" in batch.output()


LONG = ["cartpole", "--max-iterations", "100000", "--log.save-every", "100000", "--env.num-envs", "16",
        "--ppo.num-steps", "16"]
STOPPED = r"stopped on request \(SIGINT/SIGTERM\) after iteration (\d+); saved (\S+);"


def signalled_while_training(tmp_path, signum, **extra_env) -> tuple[str, int, int, str]:
    """A long run whose batch shell gets `signum` (as SLURM sends it; None: the steps get SIGTERM, `scancel_steps`)
    once iteration 3 is out: the job's output and exit status, and the iteration and checkpoint rank 0 says it
    stopped after and saved."""
    batch = Batch(tmp_path, LONG, **extra_env)
    try:
        batch.wait_for(r"^it +3/")
        if signum is None:
            scancel_steps(batch)
        else:
            os.kill(batch.proc.pid, signum)
        stopped = batch.wait_for(STOPPED)
        code = batch.finish()
    finally:
        batch.kill()
    k, path = int(stopped.group(1)), stopped.group(2)
    (run_dir,) = run_dirs(tmp_path / "runs")
    assert path == os.path.join(run_dir, f"model_{k}.pt") and k >= 3, batch.output()
    assert load_checkpoint(path)["iteration"] == k
    assert sorted(f for f in os.listdir(run_dir) if f.startswith("model_")) == [f"model_{k}.pt"]
    return batch.output(), code, k, path


def requeued_job_continues(tmp_path, k: int, path: str) -> None:
    """The requeued job (same job id, SLURM_RESTART_COUNT=1) continues the run directory of `path` from it."""
    run_dir = os.path.dirname(path)
    args = [*LONG[:2], str(k + 2), *LONG[3:]]    # the requeued job's own end, so the test need not stop it too
    requeued = Batch(tmp_path, args, restart_count=1)
    try:
        code = requeued.finish()
    finally:
        requeued.kill()
    assert code == 0, requeued.output()
    assert run_dirs(tmp_path / "runs") == [run_dir], requeued.output()
    assert f"[syncppo] resumed {path} at iteration {k}" in requeued.output()
    assert load_checkpoint(os.path.join(run_dir, f"model_{k + 2}.pt"))["iteration"] == k + 2


@pytest.mark.slow
def test_sigterm_to_the_batch_shell_saves_and_a_requeue_continues_that_run(tmp_path):
    """SIGTERM to the batch shell alone (`scancel --batch --signal=TERM JOBID`): the script has SLURM send SIGTERM to
    every process of the step (`scancel --signal=TERM JOBID`; a SIGTERM to srun would have it SIGKILL the step),
    torchrun passes it to its ranks too, which finish the iteration; rank 0 saves model_k.pt and says so; the ranks
    exit 0 and torchrun 1 (it got the signal), so the job ends with 1, not requeued by the script (a cancelled job
    stays cancelled). A requeued job (same job id, SLURM_RESTART_COUNT=1) continues that run directory from
    model_k.pt, whose run_id is the job's.
    Mutant: the `trap ... TERM` line replaced by `:` -> the shell dies alone, srun and the run go on, nothing is saved.
    Mutant: srun in the foreground (no `&`, `wait "$!"` after it) -> the trap waits for srun's end: nothing is saved.
    Mutant: the TERM trap's scancel replaced by `kill -TERM "$srun_pid"` -> srun SIGKILLs the step: nothing is saved.
    Mutant: the TERM trap's `requeue=0` replaced by `warned=1` -> a scancel'd job is requeued.
    Mutant: the requeue block removed -> the requeued job starts a second run directory from iteration 0."""
    output, code, k, path = signalled_while_training(tmp_path, signal.SIGTERM)
    assert code == 1, output
    assert requeues(tmp_path) == [], output
    assert requeues(tmp_path, "scancels") == ["scancel --signal=TERM 4242"], output
    requeued_job_continues(tmp_path, k, path)


@pytest.mark.slow
def test_the_time_limit_warning_saves_requeues_once_and_the_requeued_job_continues_that_run(tmp_path):
    """`--signal=B:USR1@...`: the script stops the run as for SIGTERM (rank 0 saves model_k.pt), and once srun has
    ended runs `scontrol requeue JOBID`, once; the requeued job continues the run from model_k.pt.
    Mutant: the USR1 trap without `warned=1` -> the run saves, no requeue.
    Mutant: the USR1 trap's scancel replaced by `kill -TERM "$srun_pid"` -> srun SIGKILLs the step: nothing is saved.
    Mutant: the requeue decided in the USR1 trap, before srun ends -> no checkpoint yet: no requeue."""
    output, code, k, path = signalled_while_training(tmp_path, signal.SIGUSR1)
    assert code == 1, output
    assert requeues(tmp_path) == ["requeue 4242"], output
    assert requeues(tmp_path, "scancels") == ["scancel --signal=TERM 4242"], output
    assert f"requeueing job 4242 to continue {os.path.dirname(path)}" in output
    requeued_job_continues(tmp_path, k, path)


@pytest.mark.slow
def test_requeue_0_ends_a_warned_job_without_requeue(tmp_path):
    """REQUEUE=0: the time-limit warning saves and ends the job as a SIGTERM does, with no `scontrol requeue`.
    Mutant: `requeue=1` in place of `requeue=${REQUEUE:-1}` -> requeue recorded."""
    output, code, _, _ = signalled_while_training(tmp_path, signal.SIGUSR1, REQUEUE="0")
    assert code == 1, output
    assert requeues(tmp_path) == [], output


@pytest.mark.slow
def test_a_warning_once_the_run_reached_max_iterations_requeues_nothing(tmp_path):
    """A warning that comes as the last iteration ends, with srun still tearing down (a fake srun that lingers after
    its tasks): the run is complete, and its requeue would only be refused (exit 2), so the job ends 0, unrequeued.
    Mutant: `unfinished "$run_dir"` replaced by `true` (requeue whenever the warning came) -> requeue recorded.
    Mutant: the status of the wait the trap ended kept (no last `wait` for srun's own) -> the job ends 138."""
    batch = Batch(tmp_path, TRAIN, FAKE_SRUN_LINGER="1")
    try:
        batch.wait_for(r"^fake srun: tasks ended")
        os.kill(batch.proc.pid, signal.SIGUSR1)
        code = batch.finish()
    finally:
        batch.kill()
    assert code == 0, batch.output()
    assert requeues(tmp_path) == [], batch.output()
    (run_dir,) = run_dirs(tmp_path / "runs")
    assert load_checkpoint(os.path.join(run_dir, "model_2.pt"))["iteration"] == 2


@pytest.mark.slow
def test_a_refused_requeue_says_how_to_continue_and_fails(tmp_path):
    """`scontrol requeue` failing (a job submitted without --requeue, a cluster that forbids it): after the save,
    one error line names the `--resume RUN_DIR` to submit, and the job fails.
    Mutant: `scontrol requeue ... || true` -> no error line."""
    output, code, k, path = signalled_while_training(tmp_path, signal.SIGUSR1, FAKE_REQUEUE_REFUSED="1")
    assert code == 1, output
    assert requeues(tmp_path) == [], output
    errors = [line for line in output.splitlines() if line.startswith("error: scontrol requeue 4242 failed")]
    assert len(errors) == 1 and errors[0].endswith(f"submit again with --resume {os.path.dirname(path)} to continue"), \
        output


@pytest.mark.slow
def test_scancel_signal_term_to_the_steps_saves_and_ends_the_job_unrequeued(tmp_path):
    """`scancel --signal=TERM JOBID` (docs/running.md: stop a job and keep its progress) signals every process of the
    step and not the batch shell (scancel(1)): rank 0 saves model_k.pt, srun ends with torchrun's 1, and the script,
    warned of nothing, ends with that status and requeues nothing.
    Mutant: `[ "$warned" = 1 ]` replaced by `true` in the requeue test -> requeue recorded.
    Mutant: `exit "$status"` replaced by `exit 0` -> the job ends 0."""
    output, code, _, _ = signalled_while_training(tmp_path, None)
    assert code == 1, output
    assert requeues(tmp_path) == [], output


def test_a_requeued_job_appends_to_its_output_file():
    """A requeued job keeps its id, so `--output=%x-%j.out` names the same file, which SLURM truncates at each start
    unless `--open-mode=append` (sbatch(1); slurm.conf's JobFileAppend defaults to 0): the first start's output, with
    the --resume line of the checkpoint it saved, would be lost.
    Mutant: the `#SBATCH --open-mode=append` line removed -> fails."""
    with open(SCRIPT) as f:
        options = [line.split()[1] for line in f if line.startswith("#SBATCH ")]
    assert "--requeue" in options and "--open-mode=append" in options, options
