"""Batched continuous-force cart-pole (classic Barto/Sutton dynamics) in pure torch, CPU or GPU.

Reward 1 per step while the pole is up; terminated when the pole falls (|theta| > 12 deg) or the cart
leaves the track (|x| > 2.4); truncated at the time limit. A random policy lasts ~20 steps.
"""

import math

import torch


class CartPole:
    gravity, mass_cart, mass_pole, half_length, force_mag, dt = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    theta_limit, x_limit = 12 * math.pi / 180, 2.4
    num_actions = 1     # the force on the cart

    @classmethod
    def observation_dims(cls) -> dict[str, int]:
        return {"policy": 4, "critic": 4}

    def __init__(self, num_envs: int, device: torch.device, seed: int, episode_length_s: float = 10.0):
        self.num_envs, self.device = num_envs, torch.device(device)
        self.obs_dims = self.observation_dims()
        self.log_keys, self.sampler = (), None
        self.max_episode_length = int(round(episode_length_s / self.dt))
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.state = torch.zeros(num_envs, 4, device=self.device)
        self.episode_length = torch.zeros(num_envs, dtype=torch.long, device=self.device)

    def _observe(self) -> dict[str, torch.Tensor]:
        return {"policy": self.state.clone(), "critic": self.state.clone()}

    def _reset_envs(self, mask: torch.Tensor) -> None:
        """Fresh start states where `mask` is set; masked instead of indexed so a GPU never syncs."""
        fresh = (torch.rand(self.num_envs, 4, generator=self.generator, device=self.device) - 0.5) * 0.1
        self.state = torch.where(mask[:, None], fresh, self.state)
        self.episode_length = torch.where(mask, 0, self.episode_length)

    def reset(self):
        self._reset_envs(torch.ones(self.num_envs, dtype=torch.bool, device=self.device))
        # Spread episode ends over the time limit so rollouts do not see every env time out at once.
        self.episode_length = torch.randint(0, self.max_episode_length, (self.num_envs,),
                                            generator=self.generator, device=self.device)
        return self._observe(), {"log": {}}

    def step(self, actions: torch.Tensor):
        force = self.force_mag * actions[:, 0].clamp(-1.0, 1.0)
        x, x_dot, theta, theta_dot = self.state.unbind(1)
        cos, sin = torch.cos(theta), torch.sin(theta)
        total_mass = self.mass_cart + self.mass_pole
        pole_ml = self.mass_pole * self.half_length
        temp = (force + pole_ml * theta_dot**2 * sin) / total_mass
        theta_acc = (self.gravity * sin - cos * temp) / (
            self.half_length * (4.0 / 3.0 - self.mass_pole * cos**2 / total_mass))
        x_acc = temp - pole_ml * theta_acc * cos / total_mass
        x_dot = x_dot + self.dt * x_acc
        theta_dot = theta_dot + self.dt * theta_acc
        self.state = torch.stack([x + self.dt * x_dot, x_dot, theta + self.dt * theta_dot, theta_dot], 1)
        self.episode_length += 1

        terminated = (self.state[:, 0].abs() > self.x_limit) | (self.state[:, 2].abs() > self.theta_limit)
        truncated = (self.episode_length >= self.max_episode_length) & ~terminated
        reward = torch.ones(self.num_envs, device=self.device)
        final_obs = self._observe()
        self._reset_envs(terminated | truncated)
        return self._observe(), reward, terminated, truncated, {"final_obs": final_obs, "log": {}}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"cartpole has no checkpointed state, got keys {sorted(state)}")
