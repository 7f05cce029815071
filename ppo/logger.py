"""Rank-0 logging: TensorBoard scalars under RSL-RL's tag names where RSL-RL has the quantity (not
`Perf/collection_time`: RSL-RL's has a space), and a console line every --log.print-every iterations (and after the
last). docs/running.md lists every tag."""

import contextlib
import math
import os
import threading
import time

from torch.utils.tensorboard import SummaryWriter

from dist.checkpoint import write_error_advice
from dist.errors import RunError


class RunLogger:
    def __init__(self, run_dir: str, max_iterations: int, start_iteration: int, steps_per_iteration: int):
        # purge_step: when a run continues in its own directory (restart, --resume auto), TensorBoard drops
        # whatever an earlier attempt logged after the checkpoint, so no step appears twice. Also from step 1: a
        # torchrun restart before the first checkpoint continues in the same directory from iteration 0.
        wait_past_earlier_event_files(run_dir)
        if not getattr(threading.excepthook, "leaves_writer_oserrors", False):
            threading.excepthook = leave_writer_oserrors(threading.excepthook)
        self.run_dir = run_dir
        with self.writing():
            self.writer = SummaryWriter(run_dir, purge_step=start_iteration + 1)
        self.max_iterations, self.start_iteration = max_iterations, start_iteration
        self.start_time = time.time()
        self.warned: set[str] = set()       # tags already said to be non-finite
        self.steps_per_iteration = steps_per_iteration      # E x M optimizer steps: the "of n" of skipped steps
        self.warned_skips = False

    def log(self, scalars: dict[str, float], step: int, episode_returns: list[float] = ()) -> None:
        """One iteration's scalars, and each episode return that ended in it (`Episode/return`, in end order).
        Flushed at once: a process that ends abruptly (a failed thread's exit, kill -9) keeps its curves up to
        here, not only up to the writer's last periodic flush (every 2 minutes)."""
        for tag, value in scalars.items():
            with self.writing():
                self.writer.add_scalar(tag, value, step)
            if not math.isfinite(value) and tag not in self.warned:   # a curve that stops drawing, unexplained
                self.warned.add(tag)
                print(f"[syncppo] warning: {tag} is {value} at iteration {step} (written as is; said once per tag; "
                      f"for a metric averaged over ranks, one rank's NaN or inf is enough)", flush=True)
        skipped = int(scalars.get("Train/nonfinite_skipped_steps", 0))
        if skipped and not self.warned_skips:   # a finite but huge reward or loss weight skipped every step, unsaid
            self.warned_skips = True
            print(f"[syncppo] warning: {skipped} of {self.steps_per_iteration} update steps at iteration {step} had a "
                  f"non-finite gradient norm and were skipped (the weights did not change in them; said once, then as "
                  f"'skipped k/n' on the console line of each iteration that skips): a reward, observation, loss "
                  f"weight or action std (--ppo.entropy-coef, --ppo.value-loss-coef, --policy.init-noise-std) too "
                  f"large for float32, or a diverging run", flush=True)
        with self.writing():
            for value in episode_returns:
                self.writer.add_scalar("Episode/return", value, step)
            self.writer.flush()

    def print_line(self, iteration: int, scalars: dict[str, float]) -> None:
        done = iteration + 1 - self.start_iteration
        elapsed = time.time() - self.start_time
        eta = elapsed / done * (self.max_iterations - iteration - 1)
        reward, length = (_fmt(scalars.get(key), width, ".1f" if "length" in key else ".2f") for key, width in
                          (("Train/mean_reward", 8), ("Train/mean_episode_length", 6)))
        skipped = int(scalars.get("Train/nonfinite_skipped_steps", 0))
        skipped = f"  skipped {skipped}/{self.steps_per_iteration}" if skipped else ""
        print(f"it {iteration + 1:>5}/{self.max_iterations}  {scalars['Perf/total_fps']:>9.0f} steps/s  "
              f"reward {reward}  ep_len {length}  kl {_fmt(scalars.get('Policy/kl'), 6, '.4f')}  "
              f"lr {scalars['Loss/learning_rate']:.1e}  ETA {eta / 60:5.1f} min{skipped}", flush=True)

    def close(self) -> None:
        with self.writing():
            self.writer.close()

    @contextlib.contextmanager
    def writing(self):
        """TensorBoard's writer thread meets a full or read-only disk as an OSError that the next write or flush
        re-raises: said as a checkpoint write error is (dist/checkpoint.py's advice), naming the run directory, not
        as a bug (`unexpected OSError`, traceback)."""
        try:
            yield
        except OSError as exc:
            raise RunError(f"could not write TensorBoard events in {self.run_dir}: "
                           f"{write_error_advice(exc, self.run_dir)}") from None


def leave_writer_oserrors(hook):
    """threading.excepthook `hook`, but silent for an OSError that ends TensorBoard's writer thread: the thread keeps
    it for the next write or flush, which says it in one line (RunLogger.writing); its own traceback, printed at the
    same moment, cut into that line and buried it (a full disk)."""
    def excepthook(args):
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            hook(args)
    excepthook.leaves_writer_oserrors = True
    return excepthook


def _fmt(value: float | None, width: int, spec: str) -> str:
    """`-` when no episode ended in the iteration (the metric is absent), never `nan`."""
    return f"{'-':>{width}}" if value is None or not math.isfinite(value) else f"{value:{width}{spec}}"


def wait_past_earlier_event_files(run_dir: str) -> None:
    """Sleep until the clock is past the second in which the newest event file of `run_dir` was made.

    TensorBoard reads a directory's event files in name order, and a name starts with its creation second,
    then host and pid. A restart within the same second as the attempt before could sort first; read last,
    the older attempt's steps would then purge the newer ones. At most a second, and only on a restart.
    """
    if not os.path.isdir(run_dir):
        return
    seconds = [int(part[3]) for part in (name.split(".") for name in os.listdir(run_dir))
               if part[:3] == ["events", "out", "tfevents"] and len(part) > 3 and part[3].isdigit()]
    while seconds and int(time.time()) <= max(seconds):
        time.sleep(0.05)
