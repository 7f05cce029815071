"""Every hyperparameter as a dataclass field with a one-line help string (the docstring under it).

tyro turns `Config` into the command line: `--ppo.num-epochs 5 --env.num-envs 1024`. One dataclass per
concern; `validate()` rejects bad values, and typed flags that would have no effect, with an error naming
the flag, before anything is built.
"""

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Literal

from configs.memory import check_env_memory
from configs.ranges import FLOAT32_MAX, FLOAT32_TINY, POSITIVE_FLOATS, UNIT_INTERVAL, check_finite, flag_value
from configs.typed_flags import check_typed_flags
from dist.errors import UsageError
from dist.log_root import nearest_directory


@dataclass
class EnvConfig:
    name: Literal["cartpole", "tracking", "gymnasium", "isaaclab"] = "tracking"
    """environment: embedded (cartpole, tracking) or a simulator adapter (gymnasium, isaaclab; see --env.task)"""
    num_envs: int = 256
    """environments per rank (per rollout rank with --rollout.ranks); total = num-envs x the ranks that collect"""
    global_num_envs: int = 0
    """if > 0: a global env budget split evenly across ranks (replaces --env.num-envs; must divide)"""
    episode_length_s: float = 10.0
    """cartpole/tracking: episode time limit in seconds (whole 0.02 s steps, rounded): a time-out, bootstrapped"""
    num_motions: int = 64
    """tracking only: reference motions in the procedurally generated motion library"""
    sampling_uniform_floor: float = 0.2
    """tracking only: share of motion sampling that stays uniform; the rest follows failure rates"""
    task: str = ""
    """gymnasium/isaaclab: registered task id, e.g. Hopper-v4, Isaac-Velocity-Rough-G1 (its time limit applies)"""
    action_scale: float = 1.0
    """gymnasium/isaaclab: multiply policy actions by this before they reach the simulator"""
    action_clip: float | None = None
    """gymnasium/isaaclab: clip scaled actions to [-C, C] (gymnasium also clips to the action space bounds)"""
    actor_obs_groups: tuple[str, ...] = ("policy",)
    """isaaclab: observation groups concatenated, in order, into the actor input"""
    critic_obs_groups: tuple[str, ...] = ("policy",)
    """isaaclab: observation groups concatenated, in order, into the critic input (e.g. policy critic)"""
    launcher_args: str = ""
    """isaaclab: Isaac Lab launcher flags, written --env.launcher-args='--viz kit' (never --device)"""
    task_overrides: tuple[str, ...] = ()
    """isaaclab: Hydra-style overrides of the task config for parse_env_cfg, e.g. physics=isaacsim_physx"""


@dataclass
class PolicyConfig:
    actor_hidden: tuple[int, ...] = (128, 128)
    """hidden layer sizes of the actor MLP; the flag with no sizes makes the actor linear"""
    critic_hidden: tuple[int, ...] = (128, 128)
    """hidden layer sizes of the critic MLP; the flag with no sizes makes the critic linear"""
    activation: Literal["elu", "tanh", "relu"] = "elu"
    """hidden activation of both MLPs"""
    init_noise_std: float = 1.0
    """initial action standard deviation (state-independent, learned)"""
    orthogonal_init: bool = False
    """orthogonal weights (gain sqrt 2; actor head 0.01, critic head 1) and zero biases, as in CleanRL"""
    normalize_critic_obs: bool = True
    """running mean/var normalizer on critic observations (frozen during an iteration)"""
    normalize_actor_obs: bool = False
    """running mean/var normalizer on actor observations (frozen during an iteration)"""


@dataclass
class PPOConfig:
    num_steps: int = 24
    """rollout length T per iteration, in environment steps"""
    num_epochs: int = 5
    """passes over the rollout per iteration"""
    num_mini_batches: int = 4
    """minibatches per epoch per rank: num-envs / num-mini-batches whole trajectories each, or with --ppo.minibatch-unit transition, num-envs x num-steps / num-mini-batches transitions"""
    num_micro_batches: int = 1
    """split each minibatch into this many micro-batches for memory only (one gradient sync per minibatch)"""
    learning_rate: float = 1e-3
    """Adam learning rate (initial value for the adaptive and linear schedules)"""
    adam_eps: float = 1e-8
    """Adam epsilon (PyTorch's default 1e-8; CleanRL uses 1e-5)"""
    schedule: Literal["adaptive", "fixed", "linear"] = "adaptive"
    """adaptive: scale the LR by the global KL each minibatch; fixed: constant; linear: anneal to 0 over the run"""
    desired_kl: float = 0.01
    """target KL for the adaptive schedule"""
    lr_min: float = 1e-5
    """lower bound of the adaptive LR"""
    lr_max: float = 1e-2
    """upper bound of the adaptive LR"""
    gamma: float = 0.99
    """discount factor"""
    lam: float = 0.95
    """GAE lambda"""
    clip_param: float = 0.2
    """PPO ratio clip epsilon (also the value-clip range)"""
    clip_value_loss: bool = True
    """clip the value prediction around the rollout value"""
    value_loss_coef: float = 1.0
    """weight of the value loss (no 1/2 factor in it: CleanRL's vf_coef c is c / 2 here)"""
    entropy_coef: float = 0.005
    """weight of the entropy bonus"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm (after cross-rank averaging) to this value"""
    advantage_norm: Literal["global", "local", "minibatch", "none"] = "global"
    """normalize advantages over all ranks (3 float64 sums), per rank, per minibatch on each rank (CleanRL), or not"""
    minibatch_unit: Literal["trajectory", "transition"] = "trajectory"
    """split minibatches by whole env trajectories (SONIC) or single transitions (CleanRL, RSL-RL)"""
    normalize_rewards: bool = False
    """divide rewards by the running std of the discounted return (CleanRL's NormalizeReward), merged across ranks"""
    reward_clip: float = 10.0
    """with --ppo.normalize-rewards: clip normalized rewards to [-C, C] (CleanRL clips at 10)"""
    bootstrap_time_outs: bool = True
    """bootstrap time-outs from the value of the final observation; off treats them like terminations"""
    capture_step: bool = False
    """minibatch step with no host sync (LR rule and non-finite skip on the device, fused Adam); on CUDA captured as a CUDA graph"""


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """process-group backend; auto = nccl on CUDA devices (see --dist.device), else gloo"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda:LOCAL_RANK when CUDA is available, else cpu (always cpu with --rollout.ranks)"""
    grad_sync: Literal["flat", "bucketed"] = "flat"
    """flat: one all-reduce of all gradients after backward; bucketed: per-bucket async all-reduce overlapping backward"""
    bucket_mb: float = 25.0
    """bucketed: bucket size cap in MB (a larger tensor gets its own bucket)"""
    unused_params: Literal["error", "zero"] = "error"
    """a parameter without gradient in a step: error naming it, or average it as a zero gradient"""
    verify_every: int = 100
    """all-gather a parameter checksum every K iterations and raise naming diverging ranks (0 = only after loads)"""
    sampler_sync_every: int = 10
    """sum the adaptive-sampling counts across ranks every K iterations (and at every checkpoint)"""
    timeout_s: float = 600.0
    """a collective that makes no progress for this many seconds fails, naming what it was waiting for"""


@dataclass
class LogConfig:
    root: str = "runs"
    """TensorBoard and checkpoint root; a run writes to ROOT/EXPERIMENT/TIMESTAMP"""
    experiment: str = ""
    """experiment name; empty = the env name (--env.name)"""
    save_every: int = 50
    """write a checkpoint every K iterations (and always at the end)"""
    print_every: int = 1
    """console line every K iterations"""
    episode_returns: bool = False
    """every finished episode's raw return, on any rank, to TensorBoard as Episode/return (CleanRL's statistic)"""


@dataclass
class RolloutConfig:
    ranks: int = 0
    """rollout ranks K that run the envs and a policy copy; the other W - K ranks learn (0 = every rank does both)"""
    mode: Literal["sync", "async"] = "sync"
    """sync: batch k is collected with the weights after update k - 1 (on-policy); async: the next batch is collected while the learners update, with weights up to --rollout.max-staleness versions old"""
    max_staleness: int = 1
    """async: a batch may be collected with weights at most this many versions older than the iteration"""
    sync: Literal["patch", "bucket"] = "patch"
    """how weights travel to the rollout ranks: patch (changed elements only) or bucket (whole tensors); see sync/"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """precision of the rollout ranks' policy copy"""
    recompute: Literal["auto", "on", "off"] = "auto"
    """recompute old log-probs, action mean/std and values with the learner's weights (auto: for async or bfloat16)"""


@dataclass
class Config:
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    max_iterations: int = 150
    """PPO iterations in all (rollout + update each); a resumed run continues from its checkpoint's iteration to this"""
    seed: int = 1
    """base seed; rank r seeds from (seed, r) by rank_seed (dist/setup.py): 32-bit seeds, alike only by chance"""
    resume: str = ""
    """checkpoint (.pt) to continue from in a new run directory, a run directory to continue in place, or auto: the run of this experiment whose checkpoint was written last, in place"""
    dry_run: bool = False
    """print the start-up summary and the sync plan, then exit without training"""


def validate(cfg: Config, world_size: int = 1, typed: frozenset[str] = frozenset()) -> None:
    """Raise UsageError naming the flag for every value that cannot work. Runs before anything is built.
    `typed`: the flags on the command line (configs/typed_flags.py); one that has no effect here is refused."""
    check_typed_flags(cfg, typed)     # first: a flag that does not apply is the thing to fix, whatever its value
    if "--resume" in typed and not cfg.resume:   # --resume "$CKPT", unset: "" is the default, a fresh run, unsaid
        raise UsageError("--resume is empty; pass a model_<iteration>.pt file, a run directory or auto, or leave "
                         "the flag out to start a new run")
    if not 0 <= cfg.seed < 2**32:
        raise UsageError(f"--seed must be in [0, {2**32 - 1}] (checkpoints and the shared env seed take 32 bits; "
                         f"each rank's own seed is rank_seed(--seed, rank), dist/setup.py), got {cfg.seed}")
    check_finite(cfg)
    check_experiment_name(cfg.log.experiment, cfg.log.root)
    if cfg.env.name in ("cartpole", "tracking") and cfg.env.episode_length_s < EMBEDDED_STEP_S:
        raise UsageError(f"--env.episode-length-s {cfg.env.episode_length_s} is shorter than one control step of "
                         f"{cfg.env.name} ({EMBEDDED_STEP_S} s); an episode needs at least one step")
    if cfg.env.name in ("cartpole", "tracking") and cfg.env.episode_length_s / EMBEDDED_STEP_S > 2**62:
        raise UsageError(f"--env.episode-length-s {cfg.env.episode_length_s} is too long: the episode step counter "
                         f"is int64, so at most {2**62 * EMBEDDED_STEP_S:.1e} s of {EMBEDDED_STEP_S} s steps")
    if not 1e-3 <= cfg.dist.timeout_s <= 1e9:   # c10d counts whole ms; gloo's deadline overflows int64 ns past ~9e9 s
        raise UsageError(f"--dist.timeout-s must be in [0.001, 1e9] seconds (torch.distributed counts whole "
                         f"milliseconds and overflows beyond), got {cfg.dist.timeout_s}")
    for flag in ("--env.num-envs", "--ppo.num-steps", "--ppo.num-epochs", "--ppo.num-mini-batches", "--max-iterations",
                 "--log.save-every", "--log.print-every", "--env.episode-length-s", "--env.num-motions",
                 "--ppo.num-micro-batches", "--dist.sampler-sync-every", *POSITIVE_FLOATS):
        if not flag_value(cfg, flag) > 0:
            raise UsageError(f"{flag} must be positive, got {flag_value(cfg, flag)}")
    for flag in UNIT_INTERVAL:
        value = flag_value(cfg, flag)
        if not 0.0 <= value <= 1.0:
            raise UsageError(f"{flag} must be in [0, 1], got {value}")
    # with --env.global-num-envs the per-rank count was split from it (resolve_num_envs): say which flag to fix
    split = (f" = --env.global-num-envs {cfg.env.global_num_envs} / {world_size} rank(s)"
             if cfg.env.global_num_envs else "")
    # A learner with rollout ranks minibatches the envs of all its rollout ranks (K / L of them) as one batch.
    k = cfg.rollout.ranks
    team = k // (world_size - k) if 0 < k < world_size and k % (world_size - k) == 0 else 1
    envs = cfg.env.num_envs * team
    if team > 1:
        split += f" x {team} rollout ranks per learner = {envs}"
    if cfg.ppo.minibatch_unit == "transition":
        if (envs * cfg.ppo.num_steps) % cfg.ppo.num_mini_batches:
            raise UsageError(f"--env.num-envs x --ppo.num-steps ({cfg.env.num_envs}{split} x {cfg.ppo.num_steps} = "
                             f"{envs * cfg.ppo.num_steps}) must be divisible by --ppo.num-mini-batches "
                             f"({cfg.ppo.num_mini_batches})")
    elif envs % cfg.ppo.num_mini_batches:
        raise UsageError(f"--env.num-envs ({cfg.env.num_envs}{split}) must be divisible by --ppo.num-mini-batches "
                         f"({cfg.ppo.num_mini_batches}): minibatches are whole trajectories, never a silent remainder")
    if cfg.dist.verify_every < 0:
        raise UsageError(f"--dist.verify-every must be >= 0, got {cfg.dist.verify_every}")
    samples_per_rank = envs * cfg.ppo.num_steps
    minibatch = samples_per_rank // cfg.ppo.num_mini_batches
    if minibatch % cfg.ppo.num_micro_batches:
        raise UsageError(f"--ppo.num-micro-batches ({cfg.ppo.num_micro_batches}) does not divide a minibatch of "
                         f"{minibatch} transitions per rank; micro-batches must be equal for the accumulated gradient "
                         f"to equal the minibatch gradient: use a divisor of {minibatch}")
    if cfg.ppo.advantage_norm == "minibatch" and minibatch < 2:     # unbiased std of one value: nan, every step skipped
        raise UsageError(f"--ppo.advantage-norm minibatch needs at least 2 transitions per rank in a minibatch (the "
                         f"std of one is nan), got {minibatch} = --env.num-envs{f' x {team}' if team > 1 else ''} x "
                         f"--ppo.num-steps / --ppo.num-mini-batches; use fewer minibatches or another "
                         f"--ppo.advantage-norm")
    pooled = samples_per_rank * ((world_size - k if 0 < k < world_size else world_size) if cfg.ppo.advantage_norm ==
                                 "global" else 1)
    if cfg.ppo.advantage_norm in ("local", "global") and pooled < 2:   # (a - mean) / (0 + 1e-8): every advantage 0
        raise UsageError(f"--ppo.advantage-norm {cfg.ppo.advantage_norm} normalizes over 1 transition, which it turns "
                         f"into 0 (no policy gradient); use more {env_count_flag(cfg)} or --ppo.num-steps, or another "
                         "--ppo.advantage-norm")
    if not 0 < cfg.ppo.lr_min <= cfg.ppo.lr_max:
        raise UsageError(f"--ppo.lr-min {cfg.ppo.lr_min} must be positive and at most --ppo.lr-max {cfg.ppo.lr_max}")
    # the bounds clamp only the adaptive schedule: fixed and linear never read them
    if cfg.ppo.schedule == "adaptive" and not cfg.ppo.lr_min <= cfg.ppo.learning_rate <= cfg.ppo.lr_max:
        raise UsageError(f"--ppo.learning-rate {cfg.ppo.learning_rate} is outside [--ppo.lr-min {cfg.ppo.lr_min}, "
                         f"--ppo.lr-max {cfg.ppo.lr_max}], the bounds of --ppo.schedule adaptive; pass a rate within "
                         f"them or widen them")
    # log_prob divides (action - mean)**2 by std**2: both must be finite, for draws up to 10 std away too
    if not FLOAT32_TINY <= cfg.policy.init_noise_std * cfg.policy.init_noise_std <= FLOAT32_MAX / 100:
        raise UsageError(f"--policy.init-noise-std {cfg.policy.init_noise_std}: the action variance (its square, or "
                         f"that of a draw 10 std away) is 0 or inf in float32; use a value in "
                         f"[{FLOAT32_TINY**0.5:.1e}, {(FLOAT32_MAX / 100)**0.5:.1e}]")
    for flag, value in {"--ppo.value-loss-coef": cfg.ppo.value_loss_coef,
                        "--ppo.entropy-coef": cfg.ppo.entropy_coef}.items():
        if value < 0:       # each its own error: blame_checkpoint blames the first flag of the message
            raise UsageError(f"{flag} must be >= 0, got {value}")
    for flag, sizes in {"--policy.actor-hidden": cfg.policy.actor_hidden,
                        "--policy.critic-hidden": cfg.policy.critic_hidden}.items():
        if any(h <= 0 for h in sizes):
            raise UsageError(f"{flag} sizes must be positive, got {' '.join(map(str, sizes))}")
    validate_simulator_env(cfg)
    validate_rollout(cfg, world_size)


def env_count_flag(cfg: Config) -> str:
    """The flag that set the env count, the one advice names: --env.global-num-envs when given (--env.num-envs beside
    it is refused)."""
    return "--env.global-num-envs" if cfg.env.global_num_envs else "--env.num-envs"


def check_experiment_name(name: str, root: str) -> None:
    """--log.experiment `name` must name one directory that --log.root `root` can hold. Also run by resolve_resume
    before --resume auto looks there: a name too long to exist read as "no checkpoint under ...", the wrong fix."""
    if name in (".", "..") or any(sep in name for sep in ("/", "\\", os.sep)):
        raise UsageError(f"--log.experiment {name!r} must be a plain name without path separators "
                         f"(runs go to --log.root/EXPERIMENT/TIMESTAMP); use --log.root to write elsewhere")
    if name and not (name.strip() and name.isprintable()):
        raise UsageError(f"--log.experiment {name!r} is blank or holds a character that is not printable "
                         f"(a newline, a tab, a byte the file system's encoding cannot decode); a run directory's name "
                         f"must be printable text: leave it out for the env's name")
    try:        # the file system's per-name limit where the directory goes (255 on most)
        name_max = os.pathconf(nearest_directory(root), "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    if len(name.encode()) > name_max:     # the run directory's mkdir would fail after the build
        raise UsageError(f"--log.experiment is {len(name.encode())} bytes long; a directory name can have at most "
                         f"{name_max}: use a shorter name")


def validate_rollout(cfg: Config, world_size: int) -> None:
    """The learner/rollout split must leave at least one learner and give every learner the same share."""
    k = cfg.rollout.ranks
    if k < 0:
        raise UsageError(f"--rollout.ranks must be >= 0, got {k}")
    if cfg.rollout.max_staleness < 1:
        raise UsageError(f"--rollout.max-staleness must be >= 1 (0 is --rollout.mode sync), "
                         f"got {cfg.rollout.max_staleness}")
    if k == 0:
        return
    learners = world_size - k
    if learners < 1:
        raise UsageError(f"--rollout.ranks {k} leaves no learner among {world_size} rank(s); start more ranks "
                         f"(torchrun --nproc-per-node) or use fewer rollout ranks")
    if k % learners:
        fits = [str(r) for r in range(1, world_size) if r % (world_size - r) == 0]
        raise UsageError(f"--rollout.ranks {k} is not a multiple of the {learners} learner(s) left of {world_size} "
                         f"ranks; each learner owns the same number of rollout ranks: with {world_size} ranks use "
                         f"--rollout.ranks {' or '.join(fits)} (or 0)")
    if cfg.env.global_num_envs:
        raise UsageError(GLOBAL_ENVS_WITH_ROLLOUT_RANKS)
    if cfg.dist.device == "cuda":
        raise UsageError("--rollout.ranks runs on CPU devices only for now (batches and weights are staged on the "
                         "host over gloo, and the CUDA path is untested); use --dist.device cpu or auto")
    if cfg.dist.backend == "nccl":    # else init_distributed's "nccl needs CUDA devices", wrong on a GPU machine
        raise UsageError("--rollout.ranks runs on CPU devices only for now (batches and weights are staged on the "
                         "host over gloo), and --dist.backend nccl moves CUDA tensors only; use --dist.backend gloo "
                         "or auto")
    if cfg.env.name == "isaaclab":    # --dist.device auto means cpu with rollout ranks: the adapter would refuse it
        raise UsageError("--rollout.ranks runs on CPU devices only for now, and --env.name isaaclab simulates on "
                         "GPUs; use --rollout.ranks 0 (colocated) with Isaac Lab")


GLOBAL_ENVS_WITH_ROLLOUT_RANKS = ("--env.global-num-envs with --rollout.ranks: give --env.num-envs per rollout rank "
                                  "instead")
EMBEDDED_STEP_S = 0.02    # control step of both embedded envs (cartpole: dt; tracking: 4 x 5 ms substeps)
SIMULATOR_PACKAGES = {"gymnasium": ("gymnasium", "`make setup-mujoco`"),
                      "isaaclab": ("isaaclab", "`make setup-isaaclab`, then run in .venv-isaaclab "
                                               "(`make train PRESET=isaaclab` does)")}


def validate_device(cfg: Config, world_size: int, device_type: str) -> None:
    """The checks that need the device (`device_type` "cpu" or "cuda"), which --dist.device auto leaves to the
    machine: train.py runs them once it is resolved, still before anything is built."""
    if cfg.ppo.capture_step and device_type == "cuda" and world_size > 1 and cfg.dist.backend == "gloo":
        raise UsageError("--ppo.capture-step captures each minibatch step, its gradient all-reduce included, as a "
                         "CUDA graph, and gloo's all-reduce of CUDA tensors (host copies on its own thread) cannot "
                         "be captured; use --dist.backend nccl (auto picks it on GPUs) or drop --ppo.capture-step")
    check_env_memory(cfg, device_type, env_count_flag(cfg))  # the device decides which memory: its own, or the host's


def validate_simulator_env(cfg: Config) -> None:
    """Checks for the gymnasium and Isaac Lab adapters that need no simulator to be started."""
    if cfg.env.name not in SIMULATOR_PACKAGES:
        return
    package, setup = SIMULATOR_PACKAGES[cfg.env.name]
    if not cfg.env.task:
        raise UsageError(f"--env.name {cfg.env.name} needs --env.task, a registered task id "
                         f"(e.g. Hopper-v4, Isaac-Velocity-Rough-G1)")
    if importlib.util.find_spec(package) is None:
        raise UsageError(f"--env.name {cfg.env.name} needs the {package} package, which is not installed: {setup}")
    if cfg.env.name == "isaaclab" and cfg.dist.device == "cpu":
        raise UsageError("--env.name isaaclab simulates on GPUs (one per rank); it cannot run with --dist.device cpu: "
                         "use --dist.device cuda or auto")
    if not cfg.env.action_scale > 0:
        raise UsageError(f"--env.action-scale must be positive, got {cfg.env.action_scale}")
    if cfg.env.action_clip is not None and not cfg.env.action_clip > 0:
        raise UsageError(f"--env.action-clip must be positive (or None for no clip), got {cfg.env.action_clip}")
    for flag, groups in {"--env.actor-obs-groups": cfg.env.actor_obs_groups,
                         "--env.critic-obs-groups": cfg.env.critic_obs_groups}.items():
        if not groups:
            raise UsageError(f"{flag} is empty; name at least one observation group (e.g. policy)")
        twice = next((group for group in groups if groups.count(group) > 1), None)
        if twice is not None:    # concatenated as listed: the input would hold the group twice, unsaid
            raise UsageError(f"{flag} names {twice!r} more than once; name each observation group once")


def resolve_num_envs(cfg: Config, world_size: int) -> str:
    """Apply --env.global-num-envs (split across ranks) if set; return a line saying which scope is used."""
    if cfg.env.global_num_envs < 0:
        raise UsageError(f"--env.global-num-envs must be >= 0, got {cfg.env.global_num_envs}")
    if cfg.env.global_num_envs == 0:     # with rollout ranks a learner has no envs of its own: theirs are counted
        return f"--env.num-envs {cfg.env.num_envs} is per {'rollout rank' if cfg.rollout.ranks else 'rank'}"
    if cfg.env.global_num_envs >= 2**63:
        raise UsageError(f"--env.global-num-envs must fit in 64 bits ([0, 2**63 - 1]), got {cfg.env.global_num_envs}")
    if cfg.rollout.ranks:         # first: whatever the budget, it is the thing to change (validate_rollout says it too)
        raise UsageError(GLOBAL_ENVS_WITH_ROLLOUT_RANKS)
    if cfg.env.global_num_envs % world_size:
        raise UsageError(f"--env.global-num-envs {cfg.env.global_num_envs} is not divisible by the world size "
                         f"{world_size}; pick a multiple of {world_size} or use per-rank --env.num-envs")
    cfg.env.num_envs = cfg.env.global_num_envs // world_size
    return (f"--env.global-num-envs {cfg.env.global_num_envs} split over {world_size} ranks = {cfg.env.num_envs} "
            "per rank")
