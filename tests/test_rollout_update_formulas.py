"""Rollout collection, storage filling (reward normalization, time-out bootstrap, GAE) and one update's
step and statistics against the PPO formulas written out in the test, never against the code under test."""

import math

import numpy as np
import pytest
import torch

from dist.grad_sync import GradSync
from ppo.actor_critic import ActorCritic
from ppo.minibatch_step import backward_minibatch
from ppo.normalizer import RewardNormalizer
from ppo.rollout import TRAIN_KEYS, EpisodeStats, collect_rollout, fill_storage
from ppo.storage import RolloutStorage
from ppo.update import normalize_advantages, ppo_update
from tests.ppo_fixtures import A, N, OBS, T, fill, ppo_cfg

LOG_SQRT_2PI_E = 0.5 + 0.5 * math.log(2 * math.pi)     # entropy of N(0, 1)


# ---- ppo/rollout.py: fill_storage, collect_rollout, EpisodeStats -------------------------------------

def gae_by_definition(rewards, values, dones, last_values, gamma, lam):
    """A_t = sum_k (gamma lam)^(k-t) delta_k over the rest of the episode (float64 numpy), no recursion."""
    T_, N_ = rewards.shape
    adv = np.zeros((T_, N_))
    for n in range(N_):
        for t in range(T_):
            coef = 1.0
            for k in range(t, T_):
                next_value = last_values[n] if k == T_ - 1 else values[k + 1, n]
                delta = rewards[k, n] + gamma * (1.0 - dones[k, n]) * next_value - values[k, n]
                adv[t, n] += coef * delta
                if dones[k, n]:
                    break
                coef *= gamma * lam
    return adv


def test_fill_storage_normalizes_rewards_then_adds_the_time_out_bootstrap_and_runs_gae():
    """Stored reward = clip(raw / (std + eps)) + bootstrap (the bootstrap gamma * V is already in the
    critic's normalized units, so it is added after scaling), and GAE bootstraps the last step from
    V(last_critic_obs), not from the last stored observation. With `recompute`, the old-policy std is the
    learner's as well (a copy collected with another std would bias the KL)."""
    torch.manual_seed(0)
    T_, N_, A_ = 4, 3, 2
    model = ActorCritic(5, 6, A_, (8,), (8,), init_noise_std=0.5, normalize_critic_obs=False)
    g = torch.Generator().manual_seed(4)
    bootstrap = torch.zeros(T_, N_)
    bootstrap[1, 0], bootstrap[3, 2] = 0.7, -1.3
    dones = torch.zeros(T_, N_, dtype=torch.bool)
    dones[1, 0], dones[3, 2], dones[2, 1] = True, True, True
    batch = {"actor_obs": torch.randn(T_, N_, 5, generator=g), "critic_obs": torch.randn(T_, N_, 6, generator=g),
             "actions": torch.randn(T_, N_, A_, generator=g), "action_mean": torch.zeros(T_, N_, A_),
             "action_std": torch.ones(T_, N_, A_), "log_probs": torch.zeros(T_, N_),
             "values": torch.randn(T_, N_, generator=g), "rewards": torch.randn(T_, N_, generator=g) * 3,
             "bootstrap": bootstrap, "dones": dones, "last_critic_obs": torch.randn(N_, 6, generator=g)}
    storage = RolloutStorage(T_, N_, {"policy": 5, "critic": 6}, A_, torch.device("cpu"))
    rn = RewardNormalizer(N_, gamma=0.9, clip=10.0)
    rn.std.fill_(2.0)                                         # as if earlier iterations had measured it
    fill_storage(storage, batch, model, rn, gamma=0.9, lam=0.8, recompute=False)
    rewards = np.clip(batch["rewards"].double().numpy() / (2.0 + 1e-8), -10, 10) + bootstrap.double().numpy()
    np.testing.assert_allclose(storage.rewards.numpy(), rewards, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        last = model.value(batch["last_critic_obs"]).double().numpy()
    adv = gae_by_definition(rewards, batch["values"].double().numpy(), dones.numpy(), last, 0.9, 0.8)
    np.testing.assert_allclose(storage.advantages.numpy(), adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(storage.returns.numpy(), adv + batch["values"].numpy(), rtol=1e-5, atol=1e-5)

    fill_storage(storage, batch, model, None, gamma=0.9, lam=0.8, recompute=True)
    torch.testing.assert_close(storage.action_std, torch.full((T_, N_, A_), 0.5))
    with torch.no_grad():
        values = model.value(batch["critic_obs"]).double().numpy()
    adv = gae_by_definition(batch["rewards"].double().numpy() + bootstrap.double().numpy(), values, dones.numpy(),
                            last, 0.9, 0.8)
    np.testing.assert_allclose(storage.advantages.numpy(), adv, rtol=1e-5, atol=1e-5)


def test_fill_storage_restarts_the_reward_normalizers_returns_where_episodes_end():
    """fill_storage hands each step's dones to the reward normalizer, so its running discounted return restarts
    after every episode end (terminations and time-outs alike): the statistics the next iteration scales by are
    those of G_t = r_t + gamma * G_{t-1} * (1 - done_{t-1}) per env, and each env's carried return is 0 when its
    last step ended an episode. Written out in numpy below."""
    torch.manual_seed(0)
    T_, N_, gamma = 5, 3, 0.9
    model = ActorCritic(2, 2, 1, (4,), (4,), normalize_critic_obs=False)
    g = torch.Generator().manual_seed(8)
    rewards = torch.rand(T_, N_, generator=g) * 4 + 1          # all positive: a missed restart only adds up
    dones = torch.zeros(T_, N_, dtype=torch.bool)
    dones[1, 0], dones[2, 1], dones[4, 1], dones[4, 2] = True, True, True, True
    batch = {"actor_obs": torch.zeros(T_, N_, 2), "critic_obs": torch.zeros(T_, N_, 2),
             "actions": torch.zeros(T_, N_, 1), "action_mean": torch.zeros(T_, N_, 1),
             "action_std": torch.ones(T_, N_, 1), "log_probs": torch.zeros(T_, N_), "values": torch.zeros(T_, N_),
             "rewards": rewards, "bootstrap": torch.zeros(T_, N_), "dones": dones,
             "last_critic_obs": torch.zeros(N_, 2)}
    storage = RolloutStorage(T_, N_, {"policy": 2, "critic": 2}, 1, torch.device("cpu"))
    rn = RewardNormalizer(N_, gamma=gamma, clip=10.0)
    fill_storage(storage, batch, model, rn, gamma=gamma, lam=0.95)
    r, d = rewards.double().numpy(), dones.numpy()
    returns, carried = np.zeros((T_, N_)), np.zeros(N_)
    for t in range(T_):
        carried = gamma * carried + r[t]
        returns[t] = carried
        carried = np.where(d[t], 0.0, carried)
    np.testing.assert_allclose(rn.returns.numpy(), carried, rtol=1e-6)
    assert rn.returns[1].item() == 0.0 and rn.returns[0].item() > 0.0
    rn.update()
    assert rn.count.item() == T_ * N_
    assert rn.std.item() == pytest.approx(returns.std(), rel=1e-6)


class CountingEnv:
    """Two envs whose observation is (steps into the episode k, env id, k^2) and reward k + 10 * env id.
    Env 0 terminates on every 2nd step of its episode, env 1 times out on its 3rd step."""

    num_envs, num_actions = 2, 1

    def __init__(self):
        self.k = torch.zeros(2)

    def observe(self):
        obs = torch.stack([self.k, torch.tensor([0.0, 1.0]), self.k**2], 1)
        return {"policy": obs[:, :2].clone(), "critic": obs.clone()}

    def reset(self):
        self.k.zero_()
        return self.observe(), {"log": {}}

    def step(self, actions):
        self.k += 1
        reward = self.k + torch.tensor([0.0, 10.0])
        terminated = torch.stack([self.k[0] == 2, torch.tensor(False)])
        truncated = torch.stack([torch.tensor(False), self.k[1] == 3])
        final = self.observe()
        self.k[terminated | truncated] = 0
        return (self.observe(), reward, terminated, truncated,
                {"final_obs": final, "log": {"Episode/x": torch.tensor(1.5)}})


def test_collect_rollout_records_pre_step_observations_dones_and_time_out_bootstraps():
    """Step t stores the observation the action was taken in; done = terminated | truncated; a time-out's
    bootstrap is gamma * V(the observation BEFORE the env reset it), 0 elsewhere; GAE continues from the
    observation after the last step (the reset one when the last step ended an episode)."""
    torch.manual_seed(0)
    model = ActorCritic(2, 3, 1, (8,), (8,), init_noise_std=0.6, normalize_critic_obs=False)
    env = CountingEnv()
    obs, _ = env.reset()
    stats = EpisodeStats(2, TRAIN_KEYS + ("Episode/x",), torch.device("cpu"))
    batch, next_obs = collect_rollout(model, env, obs, 4, 0.9, True, stats, record_returns=True)
    k_before = torch.tensor([[0.0, 0.0], [1, 1], [0, 2], [1, 0]])        # env 0: 1, 2|reset, 1, 2|reset
    assert torch.equal(batch["critic_obs"][..., 0], k_before)
    assert torch.equal(batch["critic_obs"][..., 2], k_before**2)
    assert torch.equal(batch["actor_obs"][..., 0], k_before)
    assert batch["dones"].tolist() == [[False, False], [True, False], [False, True], [True, False]]
    assert torch.equal(batch["rewards"], torch.tensor([[1.0, 11], [2, 12], [1, 13], [2, 11]]))
    with torch.no_grad():
        v_final = model.value(torch.tensor([[3.0, 1.0, 9.0]]))[0].item()     # env 1 before its reset
        expected_bootstrap = torch.zeros(4, 2)
        expected_bootstrap[2, 1] = 0.9 * v_final
        torch.testing.assert_close(batch["bootstrap"], expected_bootstrap)
        assert torch.equal(batch["last_critic_obs"], torch.tensor([[0.0, 0, 0], [1, 1, 1]]))
        assert torch.equal(next_obs["critic"], batch["last_critic_obs"])
        mean = model.actor(batch["actor_obs"])
        ref = torch.distributions.Normal(mean, model.log_std.exp().expand_as(mean))
        torch.testing.assert_close(batch["log_probs"], ref.log_prob(batch["actions"]).sum(-1))
        torch.testing.assert_close(batch["values"], model.critic(batch["critic_obs"]).squeeze(-1))
        # the old policy the KL is measured from: its mean and std (0.6, not 1) in every state
        torch.testing.assert_close(batch["action_mean"], mean)
        torch.testing.assert_close(batch["action_std"], torch.full((4, 2, 1), 0.6))
    # Episodes end at terminations and time-outs alike, with their raw rewards (no bootstrap): env 0 ends 1 + 2 twice
    # (length 2), env 1 times out after 11 + 12 + 13 (length 3).
    i = stats.index
    assert stats.sums[i["Train/mean_reward"]].item() == 3 + 3 + 36 and stats.counts[i["Train/mean_reward"]].item() == 3
    assert stats.sums[i["Train/mean_episode_length"]].item() == 2 + 2 + 3


class BothFlagsEnv(CountingEnv):
    """CountingEnv, but env 1's time-out on its 3rd step is also flagged terminated (a failure on the last step)."""

    def step(self, actions):
        obs, reward, terminated, truncated, extras = super().step(actions)
        return obs, reward, terminated | truncated, truncated, extras


def test_collect_rollout_takes_a_step_flagged_terminated_and_truncated_as_a_termination():
    """envs/base.py: an env that sets both flags for a step is taken as terminated: the episode ends (done) and is
    not bootstrapped, so every bootstrap term is 0 although env 1's value before its reset is not."""
    torch.manual_seed(0)
    model = ActorCritic(2, 3, 1, (8,), (8,), init_noise_std=0.6, normalize_critic_obs=False)
    env = BothFlagsEnv()
    obs, _ = env.reset()
    stats = EpisodeStats(2, TRAIN_KEYS + ("Episode/x",), torch.device("cpu"))
    batch, _ = collect_rollout(model, env, obs, 4, 0.9, True, stats)
    with torch.no_grad():
        assert model.value(torch.tensor([[3.0, 1.0, 9.0]]))[0].item() != 0      # what a bootstrap would have added
    assert batch["dones"].tolist() == [[False, False], [True, False], [False, True], [True, False]]
    assert torch.equal(batch["bootstrap"], torch.zeros(4, 2))


class ThreeActionEnv:
    """4 envs, 3 actions, random observations; nothing ends."""

    num_envs, num_actions = 4, 3

    def __init__(self):
        self.g = torch.Generator().manual_seed(7)

    def observe(self):
        obs = torch.randn(self.num_envs, 2, generator=self.g)
        return {"policy": obs, "critic": obs.clone()}

    def step(self, actions):
        no = torch.zeros(self.num_envs, dtype=torch.bool)
        return self.observe(), torch.ones(self.num_envs), no, no.clone(), {"log": {}}


def test_collect_rollout_sums_log_probs_over_action_dims_and_checks_every_step():
    torch.manual_seed(0)
    model = ActorCritic(2, 2, 3, (8,), (8,), normalize_critic_obs=False)
    env = ThreeActionEnv()
    stats = EpisodeStats(env.num_envs, TRAIN_KEYS, torch.device("cpu"))
    checked = []
    batch, _ = collect_rollout(model, env, env.observe(), 3, 0.9, False, stats, check=checked.append)
    assert len(checked) == 3          # every step's result (step_checker: all of the first, the others' extras)
    with torch.no_grad():
        mean = model.actor(batch["actor_obs"])
        ref = torch.distributions.Normal(mean, model.log_std.exp().expand_as(mean))
        log_probs = ref.log_prob(batch["actions"]).sum(-1)
    assert batch["actions"].shape == (3, 4, 3) and batch["log_probs"].shape == (3, 4)
    torch.testing.assert_close(batch["log_probs"], log_probs)


def test_local_and_none_advantage_normalization():
    """"local": (A - mean) / (population std + 1e-8) over this rank's rollout (the same statistic the
    "global" mode computes over all ranks, so 1 rank of "global" == "local"); "none" leaves A untouched, and so
    does "minibatch" (ppo_update normalizes each minibatch's gathered copy; the storage keeps the raw ones)."""
    for mode in ("local", "global", "none", "minibatch"):
        s = RolloutStorage(3, 4, {"policy": 1, "critic": 1}, 1, torch.device("cpu"))
        adv = torch.randn(3, 4, generator=torch.Generator().manual_seed(5)) * 3 + 2
        s.advantages = adv
        normalize_advantages(s, mode)
        a = adv.double().numpy()
        expected = a if mode in ("none", "minibatch") else (a - a.mean()) / (a.std() + 1e-8)
        np.testing.assert_allclose(s.advantages.numpy(), expected, rtol=1e-6, atol=1e-6, err_msg=mode)



def test_update_statistics_of_a_single_step_equal_the_formulas_on_the_rollout():
    """One epoch of one minibatch in two micro-batches: the reported loss terms and KL are those of the
    policy that collected the data (nothing has stepped yet, and the normalizers stay frozen until after
    learning), so they follow from the rollout alone: surrogate = -mean(A) (ratio 1), value = mean((V - R)^2),
    entropy = A * (1/2 + log(2 pi)/2 + log sigma), KL = mean of KL(old || new) (torch.distributions).
    Afterwards the normalizers have merged this rollout's observations."""
    torch.manual_seed(0)
    model = ActorCritic(OBS["policy"], OBS["critic"], A, (16, 16), (16, 16), normalize_actor_obs=True,
                        normalize_critic_obs=True)
    storage = RolloutStorage(T, N, OBS, A, torch.device("cpu"))
    fill(storage, 0, model)
    storage.action_std = storage.action_std * 1.5        # the old policy differed: KL(old || new) != KL(new || old)
    storage.action_mean = storage.action_mean + 0.3
    with torch.no_grad():
        mean = model.actor(storage.actor_obs)              # the identity normalizer: nothing merged yet
        new = torch.distributions.Normal(mean.double(), model.log_std.exp().double().expand_as(mean))
    old = torch.distributions.Normal(storage.action_mean.double(), storage.action_std.double())
    kl = torch.distributions.kl_divergence(old, new).sum(-1).mean().item()
    value = (storage.values.double() - storage.returns.double()).square().mean().item()
    surrogate = -storage.advantages.double().mean().item()
    actor_obs, critic_obs = storage.actor_obs.clone(), storage.critic_obs.clone()
    cfg = ppo_cfg(num_epochs=1, num_mini_batches=1, num_micro_batches=2, advantage_norm="none", schedule="fixed")
    stats = ppo_update(model, torch.optim.Adam(model.parameters(), lr=1e-3), storage,
                       GradSync(model.parameters(), num_extras=2), cfg, generator=torch.Generator().manual_seed(0))
    assert stats["kl"] == pytest.approx(kl, rel=1e-5)
    assert stats["surrogate"] == pytest.approx(surrogate, rel=1e-5)
    assert stats["value_function"] == pytest.approx(value, rel=1e-5)
    assert stats["entropy"] == pytest.approx(A * LOG_SQRT_2PI_E, rel=1e-6)
    assert stats["learning_rate"] == 1e-3 and stats["skipped_steps"] == 0.0
    for normalizer, data in ((model.actor_normalizer, actor_obs), (model.critic_normalizer, critic_obs)):
        d = data.flatten(0, 1).double().numpy()
        assert normalizer.count.item() == T * N
        np.testing.assert_allclose(normalizer.mean64.numpy(), d.mean(0), rtol=1e-9, atol=1e-12)


def reference_ppo_loss(model, batch, clip, value_coef, entropy_coef):
    """The PPO loss written out from its definition, with torch.distributions for log-probs and entropy."""
    mean = model.actor(batch["actor_obs"])
    pi = torch.distributions.Normal(mean, model.log_std.exp().expand_as(mean))
    ratio = torch.exp(pi.log_prob(batch["actions"]).sum(-1) - batch["log_probs"])
    adv = batch["advantages"]
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()
    v, v_old, ret = model.critic(batch["critic_obs"]).squeeze(-1), batch["values"], batch["returns"]
    v_clipped = v_old + (v - v_old).clamp(-clip, clip)
    value = torch.maximum((v - ret).square(), (v_clipped - ret).square()).mean()
    return surrogate + value_coef * value - entropy_coef * pi.entropy().sum(-1).mean()


def test_minibatch_gradient_equals_autograd_of_the_ppo_loss_and_clips_only_when_too_large():
    """backward_minibatch's synchronized gradient is the gradient of the whole minibatch's loss for any
    number of micro-batches (each backward scaled by 1/q), the returned norm is its norm before clipping,
    clipping scales it to max_grad_norm and never scales a smaller gradient up. The batch has ratios and
    value predictions outside the clip range, so both clips and both loss weights shape the gradient. One
    GradSync serves every call, as in the update: each minibatch must start from zero gradients."""
    torch.manual_seed(0)
    model = ActorCritic(4, 5, 2, (8,), (8,), normalize_critic_obs=False)
    g = torch.Generator().manual_seed(6)
    B = 12
    batch = {"actor_obs": torch.randn(B, 4, generator=g), "critic_obs": torch.randn(B, 5, generator=g),
             "actions": torch.randn(B, 2, generator=g), "action_mean": torch.randn(B, 2, generator=g),
             "action_std": torch.rand(B, 2, generator=g) + 0.5}
    with torch.no_grad():
        mean = model.actor(batch["actor_obs"])
        logp = torch.distributions.Normal(mean, model.log_std.exp().expand_as(mean)).log_prob(batch["actions"]).sum(-1)
        batch["log_probs"] = logp + 0.4 * torch.randn(B, generator=g)
        batch["values"] = model.critic(batch["critic_obs"]).squeeze(-1) + 0.5 * torch.randn(B, generator=g)
    batch["advantages"], batch["returns"] = torch.randn(B, generator=g), torch.randn(B, generator=g)
    params = list(model.parameters())
    loss = reference_ppo_loss(model, batch, clip=0.2, value_coef=0.7, entropy_coef=0.05)
    reference = torch.autograd.grad(loss, params)
    ref_norm = torch.linalg.vector_norm(torch.cat([r.flatten() for r in reference])).item()
    with torch.no_grad():
        old = torch.distributions.Normal(batch["action_mean"], batch["action_std"])
        kl_sum = torch.distributions.kl_divergence(old, torch.distributions.Normal(
            mean, model.log_std.exp().expand_as(mean))).sum().item()

    sync = GradSync(params, num_extras=2)         # one for all calls: each minibatch starts from zero gradients
    for q, max_norm, scale in ((1, 4 * ref_norm, 1.0), (3, 4 * ref_norm, 1.0), (3, 0.25 * ref_norm, 0.25)):
        cfg = ppo_cfg(num_micro_batches=q, max_grad_norm=max_norm, clip_param=0.2, clip_value_loss=True,
                      value_loss_coef=0.7, entropy_coef=0.05)
        kl_stats, norm, _ = backward_minibatch(model, batch, sync, cfg)
        assert norm.item() == pytest.approx(ref_norm, rel=1e-5)
        for p, r in zip(params, reference):
            torch.testing.assert_close(p.grad, r * scale, rtol=1e-4, atol=1e-6)
        assert kl_stats[0].item() == pytest.approx(kl_sum, rel=1e-5) and kl_stats[1].item() == B



def test_an_infinite_gradient_norm_skips_the_step_and_the_statistics_average_taken_steps_only():
    """A return of 1e25 overflows the squared gradient norm to +inf while every gradient entry stays finite
    (not NaN). That step must be skipped like a NaN one (clipping would scale it to zeros, and Adam would
    still step on its momentum), and the reported loss means average the steps TAKEN. Minibatch 0 holds the
    poisoned env, so the one step taken, minibatch 1, still sees the rollout policy: its statistics are the
    formulas on its own envs (see the single-step test above)."""
    torch.manual_seed(0)
    model = ActorCritic(OBS["policy"], OBS["critic"], A, (16, 16), (16, 16), normalize_critic_obs=False)
    storage = RolloutStorage(T, N, OBS, A, torch.device("cpu"))
    fill(storage, 0, model)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(3))   # the update's env permutation
    poisoned, taken = perm[0].item(), perm[N // 2:]
    storage.returns[0, poisoned] = 1e25
    value = (storage.values[:, taken].double() - storage.returns[:, taken].double()).square().mean().item()
    surrogate = -storage.advantages[:, taken].double().mean().item()
    cfg = ppo_cfg(num_epochs=1, num_mini_batches=2, advantage_norm="none", schedule="fixed", clip_value_loss=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    stats = ppo_update(model, optimizer, storage, GradSync(model.parameters(), num_extras=2), cfg,
                       generator=torch.Generator().manual_seed(3))
    assert stats["skipped_steps"] == 1.0
    assert all(float(s["step"]) == 1.0 for s in optimizer.state.values())
    assert stats["value_function"] == pytest.approx(value, rel=1e-5)
    assert stats["surrogate"] == pytest.approx(surrogate, rel=1e-5)
    assert stats["kl"] == pytest.approx(0.0, abs=1e-6)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---- ppo/gae.py on the device the suite targets ----------------------------------------------------------

def test_time_out_bootstrap_by_hand_on_the_test_device():
    """reward + gamma * V(final obs) on timed-out envs only, with V known exactly (a linear critic with
    integer weights). On CPU this runs the row-subset path; with SYNCPPO_TEST_DEVICE=cuda (bench/gpu_check.sh)
    it runs the full-forward path (every row, the timed-out ones selected) on a real device; tests/test_gae.py
    reaches that path on CPU through a tensor that reports another device."""
    import os
    device = torch.device(os.environ.get("SYNCPPO_TEST_DEVICE", "cpu"))
    from ppo.gae import bootstrap_time_outs

    def value(obs):                    # V(obs) = 2 * obs0 - obs1
        return obs[:, 0] * 2.0 - obs[:, 1]

    reward = torch.tensor([1.0, -2.0, 0.5, 3.0], device=device)
    final_obs = torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 4.0], [3.0, 3.0]], device=device)   # V = 1, 4, -4, 3
    truncated = torch.tensor([False, True, True, False], device=device)
    out = bootstrap_time_outs(reward, truncated, final_obs, value, 0.5)
    assert out.cpu().tolist() == [1.0, -2.0 + 0.5 * 4.0, 0.5 + 0.5 * -4.0, 3.0]
