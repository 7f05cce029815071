"""Every hyperparameter as a dataclass field with a one-line help string (the docstring under it).

tyro turns `Config` into the command line: `--ppo.num-epochs 5 --env.num-envs 1024`. One dataclass per
concern; `validate()` rejects bad values with an error naming the flag, before anything is built.
"""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class EnvConfig:
    name: Literal["cartpole", "tracking"] = "tracking"
    """embedded environment to train on"""
    num_envs: int = 256
    """environments per rank (total = world size x num-envs)"""
    episode_length_s: float = 10.0
    """episode time limit in seconds; reaching it is a time-out (bootstrapped), not a termination"""
    num_motions: int = 64
    """tracking only: reference motions in the procedurally generated motion library"""
    sampling_uniform_floor: float = 0.2
    """tracking only: share of motion sampling that stays uniform; the rest follows failure rates"""


@dataclass
class PolicyConfig:
    actor_hidden: tuple[int, ...] = (128, 128)
    """hidden layer sizes of the actor MLP"""
    critic_hidden: tuple[int, ...] = (128, 128)
    """hidden layer sizes of the critic MLP"""
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
    """minibatches per epoch; each is num-envs / num-mini-batches whole trajectories per rank"""
    learning_rate: float = 1e-3
    """Adam learning rate (initial value for the adaptive and linear schedules)"""
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
    """weight of the value loss"""
    entropy_coef: float = 0.005
    """weight of the entropy bonus"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm (after cross-rank averaging) to this value"""
    advantage_norm: Literal["global", "local", "none"] = "global"
    """normalize advantages over all ranks (3 float64 sums), per rank, or not at all"""
    minibatch_unit: Literal["trajectory", "transition"] = "trajectory"
    """split minibatches by whole env trajectories (SONIC, RSL-RL) or by single transitions (CleanRL)"""
    normalize_rewards: bool = False
    """divide rewards by the running std of the discounted return (CleanRL's NormalizeReward), merged across ranks"""
    bootstrap_time_outs: bool = True
    """bootstrap time-outs from the value of the final observation; off treats them like terminations"""


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """process-group backend; auto = nccl when CUDA is available, else gloo"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda:LOCAL_RANK when CUDA is available, else cpu"""


@dataclass
class LogConfig:
    root: str = "runs"
    """TensorBoard and checkpoint root; a run writes to ROOT/EXPERIMENT/TIMESTAMP"""
    experiment: str = ""
    """experiment name; empty = the preset name"""
    save_every: int = 50
    """write a checkpoint every K iterations (and always at the end)"""
    print_every: int = 1
    """console line every K iterations"""


@dataclass
class Config:
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)
    max_iterations: int = 150
    """PPO iterations to run (rollout + update each)"""
    seed: int = 1
    """base seed; rank r uses seed + r"""
    resume: str = ""
    """checkpoint (.pt) to continue from; training resumes at its iteration"""


def validate(cfg: Config) -> None:
    """Raise ValueError naming the flag for every value that cannot work. Runs before anything is built."""
    positive = {
        "--env.num-envs": cfg.env.num_envs, "--ppo.num-steps": cfg.ppo.num_steps,
        "--ppo.num-epochs": cfg.ppo.num_epochs, "--ppo.num-mini-batches": cfg.ppo.num_mini_batches,
        "--max-iterations": cfg.max_iterations, "--log.save-every": cfg.log.save_every,
        "--log.print-every": cfg.log.print_every, "--env.episode-length-s": cfg.env.episode_length_s,
        "--ppo.learning-rate": cfg.ppo.learning_rate, "--ppo.clip-param": cfg.ppo.clip_param,
        "--ppo.max-grad-norm": cfg.ppo.max_grad_norm, "--policy.init-noise-std": cfg.policy.init_noise_std,
        "--env.num-motions": cfg.env.num_motions, "--ppo.desired-kl": cfg.ppo.desired_kl,
    }
    for flag, value in positive.items():
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    for flag, value in {"--ppo.gamma": cfg.ppo.gamma, "--ppo.lam": cfg.ppo.lam,
                        "--env.sampling-uniform-floor": cfg.env.sampling_uniform_floor}.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{flag} must be in [0, 1], got {value}")
    if cfg.ppo.minibatch_unit == "transition":
        if (cfg.env.num_envs * cfg.ppo.num_steps) % cfg.ppo.num_mini_batches:
            raise ValueError(f"--env.num-envs x --ppo.num-steps ({cfg.env.num_envs * cfg.ppo.num_steps}) must be "
                             f"divisible by --ppo.num-mini-batches ({cfg.ppo.num_mini_batches})")
    elif cfg.env.num_envs % cfg.ppo.num_mini_batches:
        raise ValueError(f"--env.num-envs ({cfg.env.num_envs}) must be divisible by --ppo.num-mini-batches "
                         f"({cfg.ppo.num_mini_batches}): minibatches are whole trajectories, never a silent remainder")
    if not 0 < cfg.ppo.lr_min <= cfg.ppo.learning_rate <= cfg.ppo.lr_max:
        raise ValueError(f"need 0 < --ppo.lr-min <= --ppo.learning-rate <= --ppo.lr-max, got "
                         f"{cfg.ppo.lr_min}, {cfg.ppo.learning_rate}, {cfg.ppo.lr_max}")
    if cfg.ppo.value_loss_coef < 0 or cfg.ppo.entropy_coef < 0:
        raise ValueError("--ppo.value-loss-coef and --ppo.entropy-coef must be >= 0")
    if any(h <= 0 for h in (*cfg.policy.actor_hidden, *cfg.policy.critic_hidden)):
        raise ValueError("--policy.actor-hidden and --policy.critic-hidden sizes must be positive")
