"""Fault drills under torchrun (2 gloo ranks, cartpole): what a cluster does to a job, and what survives.

    .venv/bin/python bench/fault_drills.py          # about 3 minutes on 2 cores; prints a table
    .venv/bin/python bench/fault_drills.py --keep   # keep each drill's run directory (printed) to look at

Each drill starts a fresh `torchrun ... train.py cartpole` job, waits until it trains, does one thing to
it, and measures the seconds from that act until every process is gone, the exit status, and what is
on disk afterwards (checkpoints, half-written temporaries, TensorBoard steps). Each job writes under its
own temporary directory (one drill saves a 1024 x 1024 model every iteration: ~170 MB), removed after the
drill unless --keep; it is torchrun's TMPDIR too (its torchelastic_* log folders). Ctrl-C or SIGTERM stops the
drill's job, removes its directory and exits 130 or 143 with one line.
"""

import argparse
import glob
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._common import refuse_torchrun, stopped_main  # noqa: E402
from tests.test_faults import tb_steps  # noqa: E402
from tests.torchrun_job import Job, alive  # noqa: E402


def kept(root) -> str:
    ckpts = sorted(glob.glob(os.path.join(root, "cartpole", "*", "model_*.pt")),
                   key=lambda p: int(p.rsplit("_", 1)[1][:-3]))
    temps = glob.glob(os.path.join(root, "cartpole", "*", "*.tmp-*"))
    runs = glob.glob(os.path.join(root, "cartpole", "*"))
    last = os.path.basename(ckpts[-1]) if ckpts else "none"
    return f"{len(runs)} run dir, {len(ckpts)} checkpoints (last {last}), {len(temps)} temporaries"


def drill(name: str, act, keep: bool, restarts: int = 0, iterations: int = 100000, save_every: int = 5,
          extra=()) -> tuple:
    """Start a job, wait for iteration 7, `act` on it, time until the launcher and every rank are gone."""
    root = tempfile.mkdtemp(prefix="drill-")
    print(f"{name}: ", end="", flush=True)
    job = Job(["cartpole", "--max-iterations", str(iterations), "--log.save-every", str(save_every),
               "--log.root", root, *extra], max_restarts=restarts, env={"TMPDIR": root})
    workers = []
    try:
        job.wait_for(r"^it +7/")
        workers = job.workers()
        t0 = time.monotonic()
        note = act(job, root) or ""
        while (job.proc.poll() is None or any(alive(p) for p in job.workers() + workers)) \
                and time.monotonic() - t0 < 300:
            time.sleep(0.05)
        code = job.proc.returncode if job.proc.returncode is not None else "-"
        if code == -signal.SIGKILL:
            code = "killed"
        row = name, code, f"{time.monotonic() - t0:.1f}", kept(root) + note
        print(f"exit {code} after {row[2]} s" + (f" (kept {root})" if keep else ""), flush=True)
        return row
    except KeyboardInterrupt:      # Ctrl-C or SIGTERM (stopped_main): its line starts below the drill's name
        print(flush=True)
        raise
    finally:
        job.kill_all()
        for pid in workers:       # ranks a drill orphaned (kill -9 the launcher) are no longer torchrun's children
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def kill_rank(job, root):
    os.kill(job.workers()[1], signal.SIGKILL)


def kill_launcher(job, root):
    os.kill(job.proc.pid, signal.SIGKILL)


def kill_during_save(job, root):
    deadline = time.monotonic() + 60
    while not glob.glob(os.path.join(root, "cartpole", "*", "*.tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(job.workers()[0], signal.SIGKILL)        # rank 0 is the writer


def ctrl_c(job, root):
    os.killpg(job.proc.pid, signal.SIGINT)           # a terminal's Ctrl-C reaches the launcher and every rank


def sigterm_launcher(job, root):
    os.kill(job.proc.pid, signal.SIGTERM)            # what a scheduler sends on preemption


def stall_rank(job, root):
    os.kill(job.workers()[1], signal.SIGSTOP)        # alive but making no progress


def restart_three_times(job, root):
    for _ in range(3):
        os.kill(job.workers()[-1], signal.SIGKILL)
        job.wait_for(r"^\[syncppo\] resumed")
        job.wait_for(r"^it ")
    job.proc.wait(300)
    (run_dir,) = glob.glob(os.path.join(root, "cartpole", "*"))
    # TensorBoard's reader warns of each purge: the writer's purge_step dropping what an attempt logged past the
    # checkpoint the next one resumed from, which is how the curves stay single (docs/fault_tolerance.md).
    logging.getLogger("tensorboard").setLevel(logging.ERROR)
    steps = tb_steps(run_dir)
    return f"; {job.output().count('[syncppo] resumed')} resumes; TensorBoard steps 1..{max(steps)}, " \
           f"{'each once' if steps == list(range(1, max(steps) + 1)) else 'NOT contiguous'}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep each drill's run directory (default: removed)")
    keep = parser.parse_args().keep
    refuse_torchrun(parser)
    rows = [
        drill("kill -9 one rank", kill_rank, keep),
        drill("kill -9 the launcher", kill_launcher, keep),
        drill("kill -9 rank 0 during a save (big model)", kill_during_save, keep, save_every=1,
              extra=("--policy.actor-hidden", "1024", "1024", "--policy.critic-hidden", "1024", "1024")),
        drill("Ctrl-C (SIGINT to the process group)", ctrl_c, keep),
        drill("SIGTERM to the launcher", sigterm_launcher, keep),
        drill("stalled rank (SIGSTOP), --dist.timeout-s 10", stall_rank, keep, extra=("--dist.timeout-s", "10")),
        drill("kill -9 a rank 3x under --max-restarts 3 (run to 40 it)", restart_three_times, keep, restarts=3,
              iterations=40),
    ]
    print(f"\n| drill | exit status (torchrun) | seconds to exit | kept |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    stopped_main("fault_drills", main)
