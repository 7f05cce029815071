"""Checkpoints and run directories: rank 0 writes atomically; every rank reads the same file (dist/checkpoint_read.py).

A checkpoint is a dict with FORMAT, the model/optimizer state, the iteration, LR, the env's sampler
state, the config, and every rank's RNG states (gathered once at save time). A run directory
ROOT/EXPERIMENT/TIMESTAMP holds one run's TensorBoard files and `model_<iteration>.pt` files; under
torchrun it also holds `run_id` so a restarted job (same TORCHELASTIC_RUN_ID) finds it again.
"""

import contextlib
import errno
import fcntl
import glob
import os
import pathlib
import re
import socket
import time
import uuid

import torch

from dist import comm
from dist.batches import flatten_state
from dist.checksum import checksum
from dist.errors import RunError, UsageError
from dist.log_root import make_probe, probe_path, write_refusal
from dist.plan import PlanRow
from dist.verify import differing_tensors, names_checksum

FORMAT = "syncppo-checkpoint-v1"
_CHECKPOINT = re.compile(r"model_(\d+)\.pt$")


def save_checkpoint(path: str, state: dict) -> None:
    """Write `state` to `path` so that a crash at any moment leaves either the old file or the new one.

    The bytes go to a temporary name unique to this process, are flushed and fsynced, renamed over
    `path`, and the directory entry is fsynced. A write error (disk full, permissions) raises RunError
    naming the path; the temporary is removed. So it is on an interrupt (a second Ctrl-C), which is re-raised
    as itself.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        # An interrupt or a write error (a disk filling up) while torch.save writes tensors leaves its zip writer
        # mid-record; closing it then raises RuntimeError ("unexpected pos ...") over the first, which cli() would
        # report as a bug (traceback, status 1) instead of the interrupt (130) or the write error's one line.
        first = exc.__context__
        if isinstance(first, (KeyboardInterrupt, OSError)) and not isinstance(exc, (KeyboardInterrupt, OSError)):
            if isinstance(first, KeyboardInterrupt):
                raise first from None
            exc = first
        if not isinstance(exc, OSError):
            raise
        raise RunError(f"could not write checkpoint {path}: {write_error_advice(exc, directory)}") from None


def write_error_advice(exc: OSError, run_dir: str) -> str:
    """What failed, what to fix (by errno: a read-only directory needs no space) and which checkpoint to resume."""
    fix = (f"make {run_dir} writable again" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else
           "free space on that disk or point --log.root elsewhere")
    last = latest_checkpoint(run_dir) or "none: this run saved none yet"
    return f"{exc.strerror or exc}; {fix}, then resume from the last checkpoint, {last}"


def remove_stale_temporaries(run_dir: str) -> list[str]:
    """Delete half-written checkpoint temporaries left by a killed save; return what was removed."""
    stale = glob.glob(os.path.join(glob.escape(run_dir), "model_*.pt.tmp*"))
    for path in stale:
        with contextlib.suppress(OSError):
            os.remove(path)
    return stale


def latest_checkpoint(run_dir: str) -> str | None:
    """The model_<k>.pt file with the largest k in `run_dir` (complete by construction: saves are atomic)."""
    found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(glob.escape(run_dir), "model_*.pt"))
             if (m := _CHECKPOINT.search(os.path.basename(p))) and os.path.isfile(p)]
    return max(found)[1] if found else None


def find_run_dir(experiment_dir: str, run_id: str) -> str | None:
    """The run directory a previous attempt of the same torchrun job (same run id) created, if any: of several (an id
    reused, as `--rdzv-id myrun` by every job of a sweep), the one whose marker was written last, this job's."""
    markers = glob.glob(os.path.join(glob.escape(experiment_dir), "*", "run_id"))
    found = [(os.path.getmtime(m), m) for m in markers if pathlib.Path(m).read_text().strip() == run_id]
    return os.path.dirname(max(found)[1]) if found else None


def newest_run_with_checkpoint(experiment_dir: str, accept=lambda run_dir: True) -> str | None:
    """The run directory under `experiment_dir` whose latest checkpoint was written last, of those `accept`s."""
    runs = [(os.path.getmtime(ckpt), d) for d in glob.glob(os.path.join(glob.escape(experiment_dir), "*"))
            if os.path.isdir(d) and (ckpt := latest_checkpoint(d)) and accept(d)]
    return max(runs)[1] if runs else None


def create_run_dir(experiment_dir: str, run_id: str | None) -> str:
    """A new directory EXPERIMENT_DIR/TIMESTAMP (suffixed -2, -3, ... when taken): never shared by two runs."""
    os.makedirs(experiment_dir, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    for n in range(1, 1000):
        path = os.path.join(experiment_dir, stamp if n == 1 else f"{stamp}-{n}")
        try:
            os.mkdir(path)      # atomic: of two runs started in the same second, one gets -2
        except FileExistsError:
            continue
        if run_id:
            with open(os.path.join(path, "run_id"), "w") as f:
                f.write(run_id)
        return path
    raise RunError(f"could not create a run directory under {experiment_dir}: 999 runs started in one second?")


_LOCKED: dict[str, object] = {}     # run directory -> its open lock file, held until release_run_dirs


def lock_run_dir(run_dir: str) -> None:
    """Hold RUN_DIR/.lock (flock) until release_run_dirs() (the run's end) or the process's: a second run
    continuing the same directory at the same time (`--resume auto` typed twice, or picking a live run) would
    overwrite its checkpoints, remove its in-progress saves as stale and write its curves twice. The OS releases
    the lock when the process dies. Rank 0 only; a directory this process holds already is kept."""
    path = os.path.realpath(run_dir)
    if path in _LOCKED:
        return
    refused = write_refusal(path)   # the directory itself, not only .lock: one made read-only keeps a writable .lock
    if refused:
        raise UsageError(f"run directory {run_dir} cannot be continued in place: {refused} (creating a file "
                         f"there); continue one of its checkpoints in a new directory with --resume PATH")
    try:
        lock = open(os.path.join(path, ".lock"), "a+")
    except OSError as exc:   # another user's run, a read-only mount: continuing in place would write there
        raise UsageError(f"run directory {run_dir} cannot be continued in place: {exc.strerror} ({exc.filename}); "
                         f"continue one of its checkpoints in a new directory with --resume PATH") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise UsageError(f"run directory {run_dir} is in use by another run ({holder}); wait for it to end, or "
                         f"resume from one of its checkpoints with --resume PATH (a new directory)") from None
    except OSError as exc:        # a file system without locks (some network mounts): say so, and go on
        print(f"[syncppo] cannot lock {run_dir} ({exc.strerror}): two runs continuing it at once would overwrite "
              f"each other's checkpoints", flush=True)
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    _LOCKED[path] = lock


def release_run_dirs() -> None:
    """Let other runs continue the directories this process locked (its run ended, or failed)."""
    while _LOCKED:
        _LOCKED.popitem()[1].close()


def open_run_dir(existing: str | None, experiment_dir: str, run_id: str | None) -> str:
    """Rank 0, once the run is known good: continue in `existing` (stale temporaries removed) or create one,
    and lock it for this run (lock_run_dir).

    The run id (torchrun's TORCHELASTIC_RUN_ID) is recorded so that a restart of this job finds it.
    """
    if existing is None:
        run_dir = create_run_dir(experiment_dir, run_id)
        lock_run_dir(run_dir)
        return run_dir
    lock_run_dir(existing)        # before anything is removed: a live run's save in progress is not stale
    for path in remove_stale_temporaries(existing):
        print(f"[syncppo] removed {path}, a checkpoint whose save was interrupted", flush=True)
    if run_id:
        with open(os.path.join(existing, "run_id"), "w") as f:
            f.write(run_id)
    return existing


def rng_states(env=None, shuffle: torch.Generator | None = None,
               device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """This process's RNG states: torch (action sampling on CPU), the env's generator, the minibatch shuffle,
    and `device`'s generator when it is a GPU (action sampling there). Only then: asking a CPU rank on a GPU
    machine would open a CUDA context (hundreds of MB) on GPU 0 for nothing."""
    state = {"torch": torch.get_rng_state()}
    if shuffle is not None:
        state["shuffle"] = shuffle.get_state()
    if env is not None:
        state["env"] = env.generator.get_state()
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def rng_states_fit(saved: dict, env=None, shuffle: torch.Generator | None = None,
                   device: torch.device | None = None) -> bool:
    """Whether states that `rng_states` saved fit this process's generators: the same ones, of the same sizes. A
    checkpoint of another device does not (a cuda generator's state is 16 bytes, a CPU one's 5056), nor one saved
    without the GPU generator that this process samples from."""
    ours = rng_states(env, shuffle, device)
    return saved.keys() == ours.keys() and all(saved[k].numel() == ours[k].numel() for k in ours)


def set_rng_states(saved: dict, env=None, shuffle: torch.Generator | None = None,
                   device: torch.device | None = None) -> None:
    """Put back what `rng_states(env, shuffle, device)` saved (check `rng_states_fit` first)."""
    torch.set_rng_state(saved["torch"].cpu())
    if shuffle is not None:
        shuffle.set_state(saved["shuffle"].cpu())
    if env is not None:
        env.generator.set_state(saved["env"].cpu())
    if device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(saved["cuda"].cpu(), device)


def agree_on_checkpoint(checkpoint: dict | None, log_root: str | None, settings: int = 0, explain=None) -> None:
    """Refuse to start unless every rank runs the same `settings` (a checksum of them) and loaded the same checkpoint,
    or none did; and say when some ranks do not see `log_root` as rank 0 does (None: a dry run, which writes nothing
    there). Nodes started with other flags trained on silently (another env count) or aborted in gloo at the first
    collective whose sizes differ (another preset).

    Each rank resolves --resume (and an elastic restart its run directory) on its own filesystem: where
    nodes do not share one, a node that cannot see the run starts fresh while rank 0 resumes, and the
    optimizer states, normalizers and iteration counts differ silently (the weights alone are broadcast).
    The same mistake on a fresh launch is harmless until the first restart or resume, so rank 0 leaves a probe
    at --log.root (its nearest existing directory) for every rank to look for: a run that torchrun may restart
    stops now, and any other run is told that only rank 0's node holds its checkpoints.
    Crosses ranks once at start-up: a broadcast of rank 0's probe name (one int64; -1 when it could not make one,
    and every rank stops) and an all-gather of 5 int64 per rank (loaded or not, iteration, checksum of the saved
    weights, probe seen, settings); see `agree_plan_rows`. Where the settings differ, `explain()` (called on every
    rank: it may cross ranks) says which.
    """
    if comm.world_size() == 1:
        return
    probe, failed = None, None
    if torch.distributed.get_rank() == 0 and log_root is not None:
        try:
            probe = make_probe(log_root)
        except UsageError as error:
            failed = error   # raised after the broadcast below, which tells the other ranks to stop too
    try:
        nonce = int(comm.broadcast(torch.tensor([-1 if failed else probe[1] if probe else 0], dtype=torch.int64)
                                   .to(comm.device()), "resume", src=0).item())
        if failed:
            raise failed
        if nonce == -1:
            raise UsageError("stopped at start-up: rank 0 could not create its probe directory in its --log.root "
                             "(rank 0's error says why)")
        seen = int(nonce == 0 or os.path.isdir(probe_path(log_root, nonce)))
        mine = [0, 0, 0] if checkpoint is None else \
            [1, checkpoint["iteration"], int(checksum([t for t in checkpoint["model"].values()]))]
        rows = comm.all_gather(torch.tensor(mine + [seen, settings], dtype=torch.int64).to(comm.device()),
                               "resume").tolist()
    finally:
        if probe:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(probe[0])
    loads, blind = [row[:3] for row in rows], [rank for rank, row in enumerate(rows) if not row[3]]
    if any(row != loads[0] for row in loads):
        groups: dict[tuple, list[int]] = {}
        for rank, row in enumerate(loads):
            groups.setdefault(tuple(row), []).append(rank)
        said = "; ".join(f"rank(s) {ranks} " + (f"loaded iteration {row[1]} (weights checksum {row[2]})" if row[0]
                                                 else "loaded no checkpoint") for row, ranks in groups.items())
        raise UsageError(f"ranks did not load the same checkpoint: {said}. Every rank reads --resume (and, after a "
                         f"restart, its run directory under --log.root) from its own filesystem: put them where "
                         f"every node sees the same files")
    others = [rank for rank, row in enumerate(rows) if row[4] != rows[0][4]]
    if others:
        which = f": {explain()}" if explain else ""
        raise UsageError(f"rank(s) {others} run with other settings than rank 0{which} (a checksum of every flag but "
                         "--log.root, --resume, --env.launcher-args and --dist.timeout-s, and of syncppo's .py files): "
                         "start every node with the same preset, flags and syncppo version")
    if not blind:
        return
    where = (f"--log.root {log_root!r} is not the same directory on every node: rank(s) {blind} do not see what "
             f"rank 0 wrote there")
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
        raise UsageError(f"{where}, so a torchrun restart (--max-restarts) could not continue this run on them; put "
                         f"--log.root on a filesystem every node sees, or launch without --max-restarts")
    if torch.distributed.get_rank() == 0:
        print(f"[syncppo] warning: {where}: only rank 0's node will hold this run's checkpoints; to --resume on "
              f"several nodes, copy the run directory to each, or put --log.root on a filesystem every node sees",
              flush=True)


def agree_plan_rows() -> list[PlanRow]:
    return [PlanRow("resume", "rank 0's --log.root probe", "broadcast", "setup", [8], all_ranks=True),
            PlanRow("resume", "same settings and checkpoint, probe seen", "all_gather", "setup", [40], all_ranks=True)]


def gather_rng_states(states: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every rank's RNG states ({name: uint8 state tensor}, same names and sizes on every rank), by rank, on rank 0
    (which writes the checkpoint); [] on the others.

    Crosses ranks: one gather to rank 0 of the states packed into one uint8 tensor (a few KB), once per
    checkpoint; see `rng_plan_row`.
    """
    packed = torch.cat([s.reshape(-1) for s in states.values()]).to(comm.device())
    gathered = comm.gather(packed, "checkpoint")
    out = []
    for row in gathered.cpu() if gathered is not None else []:
        offsets, ranks_states = 0, {}
        for name, s in states.items():
            ranks_states[name] = row[offsets:offsets + s.numel()].clone()
            offsets += s.numel()
        out.append(ranks_states)
    return out


def gather_save_states(env, shuffle: torch.Generator, device: torch.device) -> tuple[list[dict], dict | None]:
    """What a save takes from every rank: (every rank's RNG states on rank 0, [] elsewhere; the env's state, checked
    to be the same on every rank, or None without an env). Crosses ranks as `same_env_state`, then
    `gather_rng_states` do, once per save."""
    state = env.state_dict() if env is not None else None
    if state is not None:
        same_env_state(state)
    return gather_rng_states(rng_states(env, shuffle, device)), state


def same_env_state(state: dict) -> None:
    """Refuse, naming the entries and the ranks, an env state (`env.state_dict()`) that is not the same on every rank:
    a checkpoint keeps rank 0's and every rank loads it on resume (envs/base.py), so state that differs by rank (a
    per-env curriculum) was silently replaced by rank 0's. Called at every save, before rank 0 writes.

    Crosses ranks at every save: one all-gather of 2 int64 per rank (checksums of the state's names, shapes and
    dtypes and of its values); only when the values differ, one more of an int64 per entry, to name those that
    differ (every rank raises: they all see the same rows). See `checkpoint_plan_rows`."""
    flat = flatten_state(state)
    mine = [names_checksum([f"{k} {list(v.shape)} {v.dtype}" for k, v in flat.items()]),
            checksum([v.detach().cpu() for v in flat.values()])]
    rows = comm.all_gather(torch.stack(mine).to(comm.device()), "env_state").cpu().tolist()
    why = ("a checkpoint keeps one rank's env state and every rank loads it on resume: make it the same everywhere "
           "(summed across ranks, as the sampler's counts are) or re-derivable after a load (envs/base.py)")
    if any(row[0] != rows[0][0] for row in rows):
        raise RunError(f"env.state_dict() has other entries, shapes or dtypes on rank(s) "
                       f"{[r for r, row in enumerate(rows) if row[0] != rows[0][0]]} than on rank 0 (this rank's: "
                       f"{', '.join(flat) or 'none'}); {why}")
    if all(row[1] == rows[0][1] for row in rows):
        return
    keys = differing_tensors([(k, v.cpu()) for k, v in flat.items()], "env_state")
    ranks = [r for r in range(len(rows)) if rows[r][1] != rows[0][1]]
    raise RunError(f"env.state_dict() differs across ranks in {', '.join(map(repr, keys))} (nested names joined by "
                   f"'/'): rank(s) {ranks} hold other values than rank 0, whose state a checkpoint keeps; {why}")


def checkpoint_plan_rows(states: dict[str, torch.Tensor], save_every: int, env_state: bool) -> list[PlanRow]:
    """The rows of a save: `rng_plan_row`, and with `env_state` (this rank's env is checkpointed) `same_env_state`'s
    all-gather (its second one runs only on the way to an error)."""
    rows = [rng_plan_row(states, save_every)]
    if env_state:
        rows.append(PlanRow("env_state", "env state the same on every rank", "all_gather", "checkpoint", [16],
                            every=save_every))
    return rows


def rng_plan_row(states: dict[str, torch.Tensor], save_every: int) -> PlanRow:
    return PlanRow("checkpoint", "RNG states of every rank to rank 0", "gather", "checkpoint",
                   [sum(s.numel() for s in states.values())], every=save_every)
