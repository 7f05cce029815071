"""Reading a checkpoint back, every check in one path (--resume, export): a torch archive whose CRC-32s match,
entries of the types this version writes, and no value a healthy run never saves (nan, inf, a negative count,
step, std or mean of squares). Each failure is one UsageError naming the file and the way out. dist/checkpoint.py
writes them."""

import math
import os
import zipfile
from collections.abc import Callable

import torch

from dist.checkpoint import FORMAT
from dist.errors import UsageError

REQUIRED_KEYS = ("format", "model", "optimizer", "iteration", "learning_rate", "env", "config", "rng")


def read_torch_file(path: str):
    """torch.load(weights_only=True) of a file meant to be a training checkpoint; ValueError says what the file is
    instead (torch's own message advises weights_only=False, which is neither safe nor the fix)."""
    try:
        with open(path, "rb") as f:
            started = f.read(4) == b"PK\x03\x04"       # a zip's first entry, without its closing directory
    except OSError as exc:                  # is_zipfile below would take an unreadable file for one that is no zip
        raise ValueError(f"a file this process cannot read ({exc.strerror or exc}): check its permissions") from None
    if not zipfile.is_zipfile(path):
        raise ValueError("a truncated or damaged checkpoint (its zip archive does not end); use another one"
                         if started else
                         "not a torch checkpoint (torch.save writes a zip archive; this file is not one): pass a "
                         "model_<iteration>.pt file train.py wrote")
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as exc:     # an end record found, the index behind it unreadable
        raise ValueError(f"a damaged checkpoint (its zip archive's index is unreadable: {exc}); use another one") \
            from None
    # torch.export's archive: a folder holding archive_format (torch 2.13), or top-level files (torch 2.5 and 2.7)
    kind = "TorchScript" if any(name.endswith("/constants.pkl") for name in names) else \
        "torch.export" if any(name.endswith("/archive_format") or name == "serialized_exported_program.json"
                              for name in names) else ""
    if kind:
        raise ValueError(f"an exported policy ({kind}), not a training checkpoint: pass the model_<k>.pt it was "
                         "exported from")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        text = str(exc)
        detail = next((line.strip() for line in text.splitlines() if "Unpickler error" in line),
                      text.split(" In PyTorch 2.6")[0].splitlines()[0] if text else "")
        raise ValueError(f"not a readable torch checkpoint ({type(exc).__name__}: {detail}): pass a "
                         f"model_<iteration>.pt file train.py wrote") from None


def load_checkpoint(path: str, run_dir: str | None = None) -> dict:
    """Load and validate a checkpoint; a file that is not one of ours raises naming what is wrong. `run_dir`: the run
    directory whose newest checkpoint `path` is (--resume auto or RUN_DIR), which the resume continues in place."""
    try:
        return checked_checkpoint(path)
    except UsageError as error:
        if run_dir is None or not os.path.isfile(path):
            raise
        # Another file passed by hand would start a new run directory: the way to continue in place is to set it aside.
        raise UsageError(f"{error} (it is the newest checkpoint of {run_dir!r}, the run this resume continues in "
                         f"place: move it out of that directory, and the resume continues from the newest one "
                         f"left)") from None


def checked_checkpoint(path: str) -> dict:
    """load_checkpoint's checks, each failure one UsageError naming `path` as --resume's and the way out."""
    if path.endswith(os.sep) and os.path.isfile(path.rstrip(os.sep)):   # ENOTDIR: exists() says False
        raise UsageError(f"--resume {path!r} ends in a slash, but {path.rstrip(os.sep)!r} is a file, not a folder; "
                         f"drop the trailing slash")
    if not os.path.exists(path):
        dangling = os.path.islink(path)      # exists() follows links: a dangling or looping one reads as missing
        tilde = (" (the shell does not expand a '~' after '--resume=': write --resume ~/..., with a space)"
                 if path.startswith("~") else "")
        raise UsageError(f"--resume {path!r} " + ("is a symbolic link whose target does not exist (or that loops)"
                                                  if dangling else f"does not exist{tilde}")
                         + "; pass an existing model_<iteration>.pt file, a run directory, or auto")
    if os.path.isdir(path):
        raise UsageError(f"--resume {path!r} is a directory; pass a model_<iteration>.pt file inside it, or auto")
    if not os.path.isfile(path):      # a device or a pipe: reading it could block or never end
        raise UsageError(f"--resume {path!r} is not a regular file; pass a model_<iteration>.pt file, or auto")

    def usable(state) -> None:
        written = state.get("format") if isinstance(state, dict) else None
        if isinstance(written, str) and written != FORMAT and written.startswith(FORMAT.rsplit("-", 1)[0] + "-"):
            raise UsageError(f"--resume {path!r} was written by another syncppo version (format {written!r}; this one "
                             f"reads {FORMAT!r}): resume it with the version that wrote it")
        if written != FORMAT:
            raise UsageError(f"--resume {path!r} is not a syncppo checkpoint (expected format {FORMAT!r}); pass a "
                             f"model_<iteration>.pt file train.py wrote")
        missing = [k for k in REQUIRED_KEYS if k not in state]
        if missing:
            raise UsageError(f"--resume {path!r} is missing {missing}; the file is truncated or from another tool: "
                             f"resume from another checkpoint")
        damage = malformed_entry(state)
        if damage:
            raise UsageError(f"--resume {path!r} is damaged ({damage}); resume from another checkpoint")
    return read_checkpoint(path, "--resume", "resume from", usable)


def read_checkpoint(path: str, flag: str, use: str, usable: Callable[[object], None]) -> dict:
    """The checks every reader of a checkpoint makes (--resume, export), in this order: a torch archive
    (read_torch_file) whose CRC-32s match (corrupt_member); `usable(state)`, which raises (a ValueError) for entries
    this reader cannot use (its own error, passed on); then no value a healthy run never saves (nonfinite_entry).
    Each failure of these checks is one UsageError naming the file as `flag PATH` and the way out as `use`
    ("resume from", "export") a checkpoint."""
    try:
        state = read_torch_file(path)
    except ValueError as exc:
        raise UsageError(f"{flag} {path!r} is {exc}") from None
    damage = corrupt_member(path)
    if damage:
        raise UsageError(f"{flag} {path!r} is damaged ({damage}); {use} another checkpoint")
    usable(state)
    bad = nonfinite_entry(state)
    if bad:
        raise UsageError(f"{flag} {path!r} has {bad}: the file is damaged or its run diverged; {use} an earlier "
                         f"model_<k>.pt")
    return state


def corrupt_member(path: str) -> str:
    """torch.load does not check the archive's CRC-32s: a flipped bit in tensor data would load as wrong weights.
    Called after read_torch_file, which has refused a file that is not a zip archive."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"{bad} does not match its CRC-32" if bad else ""


# Settings every checkpoint has had since the first version: one missing is damage, not a setting newer than the
# checkpoint (those take their earlier behaviour: configs/resume.py setting_before). A config without env.num_envs
# resumed at the dataclass default (256 envs), and the resume's env-count check compared against that.
FOUNDING_SETTINGS = (
    *(f"env.{k}" for k in ("name", "num_envs", "episode_length_s", "num_motions", "sampling_uniform_floor")),
    *(f"policy.{k}" for k in ("actor_hidden", "critic_hidden", "activation", "init_noise_std", "normalize_critic_obs",
                              "normalize_actor_obs")),
    *(f"ppo.{k}" for k in ("num_steps", "num_epochs", "num_mini_batches", "learning_rate", "schedule", "desired_kl",
                           "lr_min", "lr_max", "gamma", "lam", "clip_param", "clip_value_loss", "value_loss_coef",
                           "entropy_coef", "max_grad_norm", "advantage_norm")),
    "max_iterations", "seed")


ADAM_VARIANTS = ("amsgrad", "maximize", "differentiable", "decoupled_weight_decay")   # False in every file written


def malformed_entry(state: dict) -> str:
    """What in the loaded dict has the wrong type or size for `ppo.restore` to use, or "" when all fits."""
    def plain_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    def in_range(x, high):     # a number in [0, high); nan and inf are nonfinite_entry's to name
        return isinstance(x, (int, float)) and not isinstance(x, bool) and (not math.isfinite(x) or 0 <= x < high)
    for key in ("model", "optimizer", "env", "config"):
        if not isinstance(state[key], dict):
            return f"its {key!r} is a {type(state[key]).__name__}, not a dict"
    optimizer = state["optimizer"]
    if not isinstance(optimizer.get("param_groups"), list) or not isinstance(optimizer.get("state"), dict):
        return "its 'optimizer' has no 'param_groups' list and 'state' dict"
    for i, group in enumerate(optimizer["param_groups"]):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list) or \
                not all(plain_int(index) for index in group["params"]):
            return f"its optimizer param group {i} is not a dict with a 'params' list of indices"
        lr = group.get("lr")      # a float, or a one-element tensor (--ppo.capture-step)
        if not (plain_int(lr) or isinstance(lr, float) or isinstance(lr, torch.Tensor) and lr.is_floating_point()
                and lr.numel() == 1):
            return f"its optimizer param group {i} has lr {lr!r}, not a number"
        betas, decay = group.get("betas", (0.9, 0.999)), group.get("weight_decay", 0.0)
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(in_range(b, 1) for b in betas)
                and in_range(decay, math.inf)):
            return f"its optimizer param group {i} has betas {betas!r} and weight_decay {decay!r}, not Adam's settings"
        # Loaded as saved (saved_state_for replaces only the implementation and eps): amsgrad would fail the first
        # step (no max_exp_avg_sq), maximize would make Adam ascend the loss silently.
        variants = {k: group[k] for k in ADAM_VARIANTS if group.get(k, False) is not False}
        if variants:
            return f"its optimizer param group {i} has {variants}, which the Adam syncppo builds never has"
    for index, moments in optimizer["state"].items():
        if not isinstance(moments, dict):
            return f"its optimizer state for parameter {index!r} is a {type(moments).__name__}, not a dict"
        step = moments.get("step")
        if set(moments) != {"exp_avg", "exp_avg_sq", "step"} or not all(
                isinstance(v, torch.Tensor) for v in moments.values()) or step.numel() != 1:
            return (f"its optimizer state for parameter {index!r} is not Adam's (tensors exp_avg, exp_avg_sq and a "
                    f"one-element step), got {sorted(map(str, moments))}")
    indices = [index for group in optimizer["param_groups"] for index in group["params"]]
    if optimizer["state"] and set(optimizer["state"]) != set(indices):
        # Adam steps every parameter (GradSync hands each a gradient): a state for some is a damaged file, and the
        # parameters without one would restart their moments silently.
        return (f"its optimizer state covers parameters {sorted(optimizer['state'], key=str)}, its param groups "
                f"{sorted(indices)} (every one after the first step, none before)")
    sections = [k for k, v in state["config"].items() if not isinstance(v, dict) and k in
                ("env", "policy", "ppo", "dist", "log", "rollout")]
    if sections:
        return f"its config section {sections[0]!r} is not a dict"
    config = state["config"]
    names = [k for k in config] + [k for v in config.values() if isinstance(v, dict) for k in v]
    if not all(isinstance(name, str) for name in names):
        return f"its config has a setting named {next(n for n in names if not isinstance(n, str))!r}, not a name"
    lacking = [name for name in FOUNDING_SETTINGS if name.rpartition(".")[2] not in
               (config.get(name.partition(".")[0], {}) if "." in name else config)]
    if lacking:
        return f"its config lacks {', '.join(lacking)}"
    if not isinstance(config["env"]["name"], str):   # None skipped the check that the env is this run's
        return f"its config's env.name is {config['env']['name']!r}, not an env's name"
    if not plain_int(state["iteration"]) or state["iteration"] < 0:
        return f"its iteration is {state['iteration']!r}, not an integer >= 0"
    for name, seed in (("env_seed", state.get("env_seed", 0)), ("config's seed", state["config"].get("seed", 0))):
        if not plain_int(seed) or not 0 <= seed < 2**32:
            return f"its {name} is {seed!r}, not an integer in [0, 2**32)"
    rng = state["rng"]
    if not isinstance(rng, list) or not rng or not all(isinstance(r, dict) for r in rng):
        return "its 'rng' is not a non-empty list of per-rank dicts"
    layout = state.get("layout", [len(rng), 0])
    if not (isinstance(layout, list) and len(layout) == 2 and all(plain_int(n) for n in layout)
            and layout[0] == len(rng) and layout[1] >= 0):
        return f"its layout {layout!r} does not say [{len(rng)} learner(s), rollout ranks]"
    rollout_rng = state.get("rollout_rng", [])
    if layout[1] and not (isinstance(rollout_rng, list) and len(rollout_rng) == layout[1]
                          and all(isinstance(r, dict) for r in rollout_rng)):
        return f"its layout has {layout[1]} rollout rank(s) but not as many 'rollout_rng' dicts"
    ranks = [(f"rng[{i}]", r) for i, r in enumerate(rng)]
    ranks += [(f"rollout_rng[{i}]", r) for i, r in enumerate(rollout_rng)] if layout[1] else []
    for where, states in ranks:
        for name, value in states.items():
            if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1):
                kind = (f"a {value.dtype} tensor of {value.dim()} dimension(s)" if isinstance(value, torch.Tensor)
                        else f"a {type(value).__name__}")
                return f"its {where}[{name!r}] is {kind}, not an RNG state (a 1-D uint8 tensor)"
            if not fits_a_generator(name, value):
                return f"its {where}[{name!r}] ({value.numel()} bytes) is not the state of a torch generator"
    return ""


def fits_a_generator(name: str, state: torch.Tensor) -> bool:
    """Whether a saved RNG state is one that a generator could have: a CPU generator's (a valid mt19937 state;
    'torch' and 'shuffle' are always one) or a cuda generator's (16 bytes of Philox seed and offset; 'cuda' is
    always one; torch's set_state refuses a Philox offset that is not a multiple of 4)."""
    cpu = torch.get_rng_state().numel()
    if state.numel() == 16:
        return name not in ("torch", "shuffle") and int.from_bytes(bytes(state[8:].tolist()), "little") % 4 == 0
    if state.numel() != cpu or name == "cuda":
        return False
    try:
        torch.Generator().set_state(state)
    except RuntimeError:      # torch checks the mt19937 state's position and seeding fields
        return False
    return True


VALUED_ENTRIES = ("model", "optimizer", "reward_normalizer", "env", "learning_rate")
# Saved values that are never negative, by their last name: Adam's, the normalizers' (dist/stats.py merge_moments)
# and the motion sampler's (envs/motions.py).
NON_NEGATIVE = {"exp_avg_sq": "a mean of squares", "step": "a step count", "count": "a count",
                "m2": "a sum of squares", "std": "a standard deviation", "global_counts": "a count",
                "local_counts": "a count"}


def nonfinite_entry(state: dict) -> str:
    """The first value in VALUED_ENTRIES that a healthy run never saves, as "nan in its model['log_std']", or "":
    a nan or inf in a floating tensor or float (weights, normalizer statistics, Adam's moments, step counts and
    LR, sampler counts), or a negative value where NON_NEGATIVE names it (counts, steps, stds, M2, Adam's
    exp_avg_sq). A healthy run keeps them finite: the update skips a step whose gradient norm is not finite and
    clips the others, and non-finite observations or rewards stop the run before a normalizer sees them. Integer
    tensors (counters) are exempt, and RNG states (uint8) are not among the entries. One aminmax per tensor: a single
    pass that copies nothing (nan reaches both ends)."""
    for entry in VALUED_ENTRIES:
        for where, value in _numbers(state.get(entry), entry):
            if isinstance(value, float):
                low = high = value
            elif value.is_floating_point() and value.numel():
                low, high = (float(end) for end in torch.aminmax(value))
            else:
                continue
            if not math.isfinite(low) or not math.isfinite(high):
                return f"{'nan' if math.isnan(low) or math.isnan(high) else 'inf'} in its {where}"
            what = NON_NEGATIVE.get(where.rpartition("[")[2].strip("']").rpartition(".")[2])
            if low < 0 and what:
                return f"a negative value ({low:g}) in its {where}, {what}"
    return ""


def _numbers(value, where: str):
    """(where, value) of every tensor and float inside nested dicts and lists, `where` as Python would index it:
    `optimizer['state'][0]['exp_avg']`."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{where}[{i}]")
    elif isinstance(value, (torch.Tensor, float)):
        yield where, value
