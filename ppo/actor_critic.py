"""Gaussian actor and value critic as plain MLPs, with asymmetric observations and a learned,
state-independent action std. Optional observation normalizers live inside the module so their
statistics travel with the weights (checkpoints, weight sync). Changing the networks: docs/design.md's "Changing the
policy network" says what else touches the model (buffer rules, train mode, export, resume)."""

import functools
import math

import torch
from torch import nn

from ppo.normalizer import ObsNormalizer

# In place: the Linear before each activation does not keep its output for backward, so the activation can
# overwrite it (one activation buffer less per layer), and ELU's backward then reads its output
# (grad * (out + 1)) instead of evaluating exp(x) again: 0.85x -> 0.81x of RSL-RL's small update on CPU.
# exp(x) and out + 1 can differ in the last bit, so this is a rounding change (docs/benchmarks.md).
ACTIVATIONS = {"elu": functools.partial(nn.ELU, inplace=True), "tanh": nn.Tanh,
               "relu": functools.partial(nn.ReLU, inplace=True)}


def mlp(in_dim: int, hidden: tuple[int, ...], out_dim: int, activation: str) -> nn.Sequential:
    layers, dim = [], in_dim
    for h in hidden:
        layers += [nn.Linear(dim, h), ACTIVATIONS[activation]()]
        dim = h
    layers.append(nn.Linear(dim, out_dim))
    return nn.Sequential(*layers)


class Gaussian:
    """Diagonal Gaussian with a state-independent std [A]: the same numbers as
    `torch.distributions.Normal(mean, std.expand_as(mean))` (same formulas, same draws from the same
    generator), but the std terms (square, log) are computed once on [A] instead of on every sample [B, A],
    and nothing is validated."""

    def __init__(self, mean: torch.Tensor, log_std: torch.Tensor):
        self.mean, self.std = mean, log_std.exp()

    @property
    def stddev(self) -> torch.Tensor:
        return self.std.expand_as(self.mean)

    def sample(self) -> torch.Tensor:
        """What `torch.normal(mean, std)` draws (standard normals from the global generator, times std, plus
        mean, in that order), without its check that every std >= 0: a host read, so on a GPU a device sync
        at every rollout step. The std here is an exp, never negative."""
        with torch.no_grad():
            return torch.randn_like(self.mean).mul_(self.std).add_(self.mean)

    def log_prob(self, actions: torch.Tensor) -> torch.Tensor:
        """Per action dimension, [B, A]."""
        return -((actions - self.mean) ** 2) / (2 * self.std**2) - self.std.log() - math.log(math.sqrt(2 * math.pi))

    def entropy(self) -> torch.Tensor:
        """Per action dimension, [B, A] (a broadcast view: every sample has the same entropy)."""
        return (0.5 + 0.5 * math.log(2 * math.pi) + torch.log(self.std)).expand_as(self.mean)


class ActorCritic(nn.Module):
    # Cross-rank rule of every buffer (see dist/buffers.py): the normalizers merge their statistics.
    BUFFER_POLICY = {"actor_normalizer.*": "merge", "critic_normalizer.*": "merge"}

    def __init__(self, actor_obs_dim: int, critic_obs_dim: int, num_actions: int,
                 actor_hidden=(128, 128), critic_hidden=(128, 128), activation: str = "elu",
                 init_noise_std: float = 1.0, normalize_actor_obs: bool = False, normalize_critic_obs: bool = True,
                 orthogonal_init: bool = False):
        super().__init__()
        self.actor = mlp(actor_obs_dim, actor_hidden, num_actions, activation)
        self.critic = mlp(critic_obs_dim, critic_hidden, 1, activation)
        self.log_std = nn.Parameter(torch.full((num_actions,), float(torch.log(torch.tensor(init_noise_std)))))
        self.actor_normalizer = ObsNormalizer(actor_obs_dim) if normalize_actor_obs else nn.Identity()
        self.critic_normalizer = ObsNormalizer(critic_obs_dim) if normalize_critic_obs else nn.Identity()
        if orthogonal_init:
            for net, head_gain in ((self.actor, 0.01), (self.critic, 1.0)):
                linears = [m for m in net if isinstance(m, nn.Linear)]
                for layer in linears:
                    nn.init.orthogonal_(layer.weight, head_gain if layer is linears[-1] else 2**0.5)
                    nn.init.zeros_(layer.bias)

    def distribution(self, actor_obs: torch.Tensor) -> Gaussian:
        return Gaussian(self.actor(self.actor_normalizer(actor_obs)), self.log_std)

    def value(self, critic_obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self.critic_normalizer(critic_obs)).squeeze(-1)

    def describe(self) -> str:
        """The networks as the start-up prints them: `actor 17-128-128-6, critic 33-128-128-1 (elu), 44,167
        parameters` (an empty --policy.actor-hidden is a linear policy: it shows)."""
        def sizes(net):
            linears = [m for m in net if isinstance(m, nn.Linear)]
            return "-".join(str(n) for n in [linears[0].in_features] + [m.out_features for m in linears])
        kinds = tuple(type(make()) for make in ACTIVATIONS.values())     # not a LayerNorm a fork puts between
        activation = next((type(m).__name__.lower() for net in (self.actor, self.critic) for m in net
                           if isinstance(m, kinds)), "no activation")
        return (f"actor {sizes(self.actor)}, critic {sizes(self.critic)} ({activation}), "
                f"{sum(p.numel() for p in self.parameters()):,} parameters")

    def normalizers(self) -> dict[str, ObsNormalizer]:
        """Active normalizers keyed by the rollout-storage field they learn from."""
        pairs = {"actor_obs": self.actor_normalizer, "critic_obs": self.critic_normalizer}
        return {k: m for k, m in pairs.items() if isinstance(m, ObsNormalizer)}


def build_actor_critic(policy_cfg, obs_dims: dict[str, int], num_actions: int) -> ActorCritic:
    return ActorCritic(obs_dims["policy"], obs_dims["critic"], num_actions, policy_cfg.actor_hidden,
                       policy_cfg.critic_hidden, policy_cfg.activation, policy_cfg.init_noise_std,
                       policy_cfg.normalize_actor_obs, policy_cfg.normalize_critic_obs, policy_cfg.orthogonal_init)
