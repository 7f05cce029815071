"""RSL-RL driven by syncppo's settings, for bench/bench_train.py: our VecEnv behind RSL-RL's env interface, and an
OnPolicyRunner configured from a syncppo Config (the same env, T, N, epochs, minibatches, networks, losses and LR
schedule). Needs rsl-rl-lib and tensordict (requirements-dev.txt). Nothing here crosses ranks."""

import contextlib
import os

import torch

from envs import make_env


class RslRlEnv:
    """Our VecEnv seen through RSL-RL's interface: TensorDict observations, dones, extras['time_outs']."""

    def __init__(self, env):
        from tensordict import TensorDict
        self.env, self.TensorDict = env, TensorDict
        self.num_envs, self.num_actions, self.device = env.num_envs, env.num_actions, env.device
        self.max_episode_length, self.cfg = env.max_episode_length, {}
        self.episode_length_buf = torch.zeros(env.num_envs, dtype=torch.long, device=env.device)
        self.obs, _ = env.reset()

    def get_observations(self):
        return self.TensorDict(self.obs, batch_size=[self.num_envs])

    def step(self, actions):
        # A copy, as syncppo's rollout passes: envs may change actions in place (envs/base.py), and RSL-RL keeps
        # this tensor as the transition's action.
        self.obs, reward, terminated, truncated, extras = self.env.step(actions.clone())
        log = {f"/{k}": v for k, v in extras["log"].items()}
        return self.get_observations(), reward, terminated | truncated, {"time_outs": truncated, "log": log}


def rsl_rl_runner(cfg, log_dir: str, device: torch.device):
    from rsl_rl.runners import OnPolicyRunner
    env = RslRlEnv(make_env(cfg.env, device, seed=cfg.seed, base_seed=cfg.seed))
    p, policy = cfg.ppo, cfg.policy
    train_cfg = {
        "num_steps_per_env": p.num_steps, "save_interval": 10**6,
        "obs_groups": {"actor": ["policy"], "critic": ["critic"]},
        "algorithm": {"class_name": "PPO", "num_learning_epochs": p.num_epochs,
                      "num_mini_batches": p.num_mini_batches, "clip_param": p.clip_param, "gamma": p.gamma,
                      "lam": p.lam, "value_loss_coef": p.value_loss_coef, "entropy_coef": p.entropy_coef,
                      "learning_rate": p.learning_rate, "max_grad_norm": p.max_grad_norm,
                      "use_clipped_value_loss": p.clip_value_loss, "schedule": p.schedule,
                      "desired_kl": p.desired_kl},
        "actor": {"class_name": "MLPModel", "hidden_dims": list(policy.actor_hidden), "activation": policy.activation,
                  "obs_normalization": policy.normalize_actor_obs,
                  # syncppo learns log(std) (ppo/actor_critic.py); RSL-RL's default learns std itself
                  "distribution_cfg": {"class_name": "GaussianDistribution", "init_std": policy.init_noise_std,
                                       "std_type": "log"}},
        "critic": {"class_name": "MLPModel", "hidden_dims": list(policy.critic_hidden),
                   "activation": policy.activation,
                   "obs_normalization": policy.normalize_critic_obs},
    }
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        return OnPolicyRunner(env, train_cfg, log_dir=log_dir, device=str(device))
