"""Fixed rollouts for equivalence tests: per-rank data, and one storage holding all ranks' envs."""

import torch

from configs import PPOConfig
from ppo.actor_critic import ActorCritic
from ppo.storage import RolloutStorage

OBS = {"policy": 5, "critic": 7}
T, N, A = 6, 8, 3


def make_model() -> ActorCritic:
    torch.manual_seed(0)
    return ActorCritic(OBS["policy"], OBS["critic"], A, (16, 16), (16, 16), "elu", 1.0,
                       normalize_actor_obs=False, normalize_critic_obs=True)


def ppo_cfg(**overrides) -> PPOConfig:
    base = dict(num_epochs=3, num_mini_batches=2, learning_rate=1e-3, schedule="adaptive", desired_kl=0.002,
                max_grad_norm=0.5, advantage_norm="global", entropy_coef=0.01)
    base.update(overrides)
    return PPOConfig(**base)


def fill(storage: RolloutStorage, rank: int, model: ActorCritic, env_offset: int = 0) -> None:
    """Write rank `rank`'s fixed rollout into envs [env_offset, env_offset + N) of `storage`."""
    g = torch.Generator().manual_seed(1000 + rank)
    envs = slice(env_offset, env_offset + N)
    actor_obs = torch.randn(T, N, OBS["policy"], generator=g)
    critic_obs = torch.randn(T, N, OBS["critic"], generator=g) * 2 + rank
    with torch.no_grad():   # computed where the model is (the host), then written into the storage's device
        pi = model.distribution(actor_obs)
        actions = pi.mean + pi.stddev * torch.randn(T, N, A, generator=g)
        values = model.value(critic_obs)
        storage.actor_obs[:, envs], storage.critic_obs[:, envs] = actor_obs, critic_obs
        storage.actions[:, envs] = actions
        storage.action_mean[:, envs], storage.action_std[:, envs] = pi.mean, pi.stddev
        storage.log_probs[:, envs] = pi.log_prob(actions).sum(-1)
        storage.values[:, envs] = values
    storage.advantages[:, envs] = torch.randn(T, N, generator=g) + rank
    storage.returns[:, envs] = values + torch.randn(T, N, generator=g)


class ConcatStorage(RolloutStorage):
    """All ranks' envs side by side; minibatch i = the union of every rank's minibatch i, drawn with
    the same per-rank generators, so one process sees exactly the data W ranks see together."""

    def __init__(self, world_size: int, seeds: list[int]):
        super().__init__(T, N * world_size, OBS, A, torch.device("cpu"))
        self.world_size, self.generators = world_size, [torch.Generator().manual_seed(s) for s in seeds]

    def minibatches(self, num_mini_batches, generator=None, unit="trajectory"):
        if unit == "transition":    # rank r's flat row t * N + n is row t * W * N + r * N + n of the union
            size = T * N // num_mini_batches
            local = [torch.randperm(T * N, generator=g) for g in self.generators]
            perms = [p // N * N * self.world_size + r * N + p % N for r, p in enumerate(local)]
            for i in range(num_mini_batches):
                yield self.data.flatten(0, 1)[torch.cat([p[i * size:(i + 1) * size] for p in perms])]
            return
        size = N // num_mini_batches
        perms = [torch.randperm(N, generator=g) + r * N for r, g in enumerate(self.generators)]
        for i in range(num_mini_batches):
            envs = torch.cat([p[i * size:(i + 1) * size] for p in perms])
            yield self.data[:, envs].flatten(0, 1)     # packed, as RolloutStorage.minibatches yields
