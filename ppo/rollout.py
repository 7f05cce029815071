"""Collect one iteration's [T, N] batch with a policy, and turn a batch into the storage the update reads.

The two halves are apart on purpose: a colocated rank runs both; with rollout ranks, a rollout rank
runs `collect_rollout` with its policy copy and sends the batch, and its learner runs `fill_storage` on
the batches of its rollout ranks concatenated along the env axis. Rewards travel raw (the reward
normalizer's per-env running returns follow the batch's envs on the learner) with the time-out
bootstrap term beside them, so both layouts compute the stored rewards with the same operations.
"""

import torch

from dist import comm
from dist.errors import RunError
from dist.plan import PlanRow
from ppo.gae import bootstrap_time_outs, compute_gae

# ppo_update's per-rank means -> their tags (logged as the mean over ranks)
TERM_TAGS = {"surrogate": "Loss/surrogate", "value_function": "Loss/value_function", "entropy": "Loss/entropy",
             "clip_fraction": "Policy/clip_fraction"}
TRAIN_KEYS = ("Train/mean_reward", "Train/mean_episode_length", *TERM_TAGS.values())
BATCH_FIELDS = ("actor_obs", "critic_obs", "actions", "action_mean", "action_std", "log_probs", "values", "rewards",
                "bootstrap", "dones")


class EpisodeStats:
    """Per-env running episode return and length, and this iteration's (sum, count) of every metric."""

    def __init__(self, num_envs: int, keys: tuple[str, ...], device):
        self.keys, self.device = keys, device
        self.index = {key: i for i, key in enumerate(keys)}
        self.episode_return = torch.zeros(num_envs, device=device)
        self.episode_length = torch.zeros(num_envs, device=device)
        self.start_iteration()

    def start_iteration(self) -> None:
        self.sums = torch.zeros(len(self.keys), dtype=torch.float64, device=self.device)
        self.counts = torch.zeros(len(self.keys), dtype=torch.float64, device=self.device)
        self.ended = []           # [N] per step: the return of each env whose episode ended, else NaN

    def add(self, key: str, total, count) -> None:
        i = self.index[key]
        self.sums[i] += total
        self.counts[i] += count

    def step(self, raw_reward: torch.Tensor, done: torch.Tensor, log: dict, record_returns: bool) -> None:
        self.episode_return += raw_reward
        self.episode_length += 1
        ended = done.sum()
        self.add("Train/mean_reward", (self.episode_return * done).sum(), ended)
        self.add("Train/mean_episode_length", (self.episode_length * done).sum(), ended)
        if record_returns:
            self.ended.append(torch.where(done, self.episode_return, torch.nan))
        self.episode_return *= ~done
        self.episode_length *= ~done
        for key, value in log.items():
            self.add(key, value, 1)

    def ended_returns(self) -> list[float]:
        """The raw return of every episode that ended this iteration on any rank, in end order (by step, then
        rank, then env), on rank 0 (the rank that logs); [] on the others. Call on every rank, only when returns
        were recorded (--log.episode-returns).

        Crosses ranks: one gather to rank 0 of this rank's [T, N] float32 returns (NaN where no episode ended), once
        per iteration: the same size on every rank whatever ended where, so one call, where exact counts would take
        two; a gather, not an all-gather, because no other rank uses them.
        """
        gathered = comm.gather(torch.stack(self.ended).float().to(comm.device()), "episode_returns")
        if gathered is None:
            return []
        flat = gathered.transpose(0, 1).flatten().cpu()
        return flat[~flat.isnan()].tolist()


def episode_returns_plan_rows(recorded: bool, num_steps: int, num_envs: int) -> list[PlanRow]:
    """EpisodeStats.ended_returns' row of the sync plan, when --log.episode-returns records them."""
    return [PlanRow("episode_returns", "every rank's [T, N] returns to rank 0 (NaN: none ended)", "gather",
                    "iteration", [num_steps * num_envs * 4])] if recorded else []


@torch.inference_mode()
def collect_rollout(model, env, obs: dict, num_steps: int, gamma: float, bootstrap: bool, stats: EpisodeStats,
                    record_returns: bool = False, check=None) -> tuple[dict[str, torch.Tensor], dict]:
    """T steps of every env with `model`; returns the batch ([T, N, ...] fields + `last_critic_obs`) and the
    observation to continue from. No communication. `check`: called with every step's result (the env's protocol,
    ppo/env_check.py: all of it on the run's first step, the extras on the others)."""
    batch: dict[str, torch.Tensor] = {}
    for step in range(num_steps):
        pi = model.distribution(obs["policy"])
        actions = pi.sample()
        values = model.value(obs["critic"])
        # Copied before the step: an env that writes its next observation into the tensors it returned (a buffer
        # it reuses) would otherwise change this one. The env gets a copy of the actions: one that clamps or
        # scales them in place would otherwise change the stored actions, which the policy never sampled.
        keep(batch, step, num_steps, actor_obs=obs["policy"], critic_obs=obs["critic"])
        result = env.step(actions.clone())
        if check is not None:
            check(result)
        next_obs, raw_reward, terminated, truncated, extras = result
        truncated = truncated & ~terminated     # flagged both: a termination, never bootstrapped (as the adapters do)
        done = terminated | truncated
        bootstrap_term = torch.zeros_like(raw_reward)
        if bootstrap:   # a time-out is not a failure: gamma * V(obs before the reset), added to the reward later
            bootstrap_term = bootstrap_time_outs(bootstrap_term, truncated, extras["final_obs"]["critic"], model.value,
                                                 gamma)
        keep(batch, step, num_steps, actions=actions, action_mean=pi.mean, action_std=pi.stddev,
             log_probs=pi.log_prob(actions).sum(-1), values=values, rewards=raw_reward, bootstrap=bootstrap_term,
             dones=done)
        stats.step(raw_reward, done, extras["log"], record_returns)
        obs = next_obs
    batch = {name: batch[name] for name in BATCH_FIELDS}
    batch["last_critic_obs"] = obs["critic"].clone()
    return batch, obs


def keep(batch: dict[str, torch.Tensor], step: int, num_steps: int, **fields: torch.Tensor) -> None:
    """Copy each field into row `step` of its [T, ...] tensor in `batch` (made at step 0): one copy, as a stack at
    the end would make, but made before the env can write into what it returned."""
    for name, value in fields.items():
        if step == 0:
            batch[name] = torch.empty((num_steps, *value.shape), dtype=value.dtype, device=value.device)
        batch[name][step].copy_(value)


def check_finite(batch: dict[str, torch.Tensor], env_name: str, rank: int, iteration: int) -> None:
    """Raise naming the env, observation group and feature of the first NaN/inf the env produced, and where: the step
    within `iteration` (numbered as the console numbers it), the env and the rank.

    One host sync per iteration in the common case (all finite); the search for the culprit only on failure."""
    fields = ("actor_obs", "critic_obs", "rewards", "bootstrap")
    # The extremes are finite exactly when every value is (min and max propagate NaN): one pass over each
    # field, where isfinite().all() takes four and allocates (3 ms of a 512-env rollout's 135 ms).
    extremes = [torch.stack(torch.aminmax(batch[f])) for f in fields]
    if torch.isfinite(torch.cat(extremes)).all():
        return
    for field, what in (("actor_obs", "observation group 'policy'"), ("critic_obs", "observation group 'critic'"),
                        ("rewards", "reward"), ("bootstrap", "time-out bootstrap value of extras['final_obs']")):
        data = batch[field]
        bad = ~torch.isfinite(data)
        if bad.any():
            t, n, *feature = (int(i) for i in bad.nonzero()[0])
            where = f" feature {feature[0]}" if feature else ""
            # An observation is stored with the step that acts on it: the step before produced it (or a reset).
            t -= field.endswith("obs")
            at = f"at step {t} (0-based) of iteration {iteration}" if t >= 0 else \
                f"before iteration {iteration} (at the last step of the one before, or a reset)"
            raise RunError(f"env {env_name!r} produced {data[bad][0].item()} in {what}{where} {at} in env {n} on rank "
                           f"{rank}; stopped before it reached a normalizer (fix the env or its config)")


@torch.inference_mode()
def fill_storage(storage, batch: dict[str, torch.Tensor], model, reward_normalizer, gamma: float, lam: float,
                 recompute: bool = False) -> None:
    """Write `batch` into `storage`: rewards normalized then bootstrapped, GAE with `model`'s critic.

    `recompute`: old log-probs, action mean/std and values from `model` rather than from the policy copy
    that collected the batch (a lower-precision copy would otherwise bias the PPO ratio and the KL).
    """
    for name in ("actor_obs", "critic_obs", "actions", "action_mean", "action_std", "log_probs", "values"):
        setattr(storage, name, batch[name])
    if recompute:
        pi = model.distribution(batch["actor_obs"])
        storage.action_mean, storage.action_std = pi.mean, pi.stddev
        storage.log_probs = pi.log_prob(batch["actions"]).sum(-1)
        storage.values = model.value(batch["critic_obs"])
    dones = batch["dones"].bool()
    if reward_normalizer is None:
        torch.add(batch["rewards"], batch["bootstrap"], out=storage.rewards)
    else:     # step by step: the normalizer carries each env's running return from one step to the next
        for t in range(batch["rewards"].shape[0]):
            storage.rewards[t] = reward_normalizer(batch["rewards"][t], dones[t]) + batch["bootstrap"][t]
    storage.dones.copy_(dones)
    storage.advantages, storage.returns = compute_gae(storage.rewards, storage.values, storage.dones,
                                                      model.value(batch["last_critic_obs"]), gamma, lam)
