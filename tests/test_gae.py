import numpy as np
import pytest
import torch

from ppo.gae import compute_gae


def test_gae_matches_hand_computation_with_termination_and_time_out():
    # One env, 4 steps. Step 1 terminates (no bootstrap). Step 2 times out: the runner has already
    # folded gamma * V(final obs) = 0.9 * 5.0 into its reward (1 + 4.5 = 5.5); then a new episode.
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[1.0], [2.0], [5.5], [3.0]])
    values = torch.tensor([[0.5], [1.0], [2.0], [1.5]])
    dones = torch.tensor([[False], [True], [True], [False]])
    last_value = torch.tensor([4.0])
    adv, ret = compute_gae(rewards, values, dones, last_value, gamma, lam)

    d3 = 3.0 + 0.9 * 4.0 - 1.5            # 5.1, bootstraps from last_value
    d2 = 5.5 - 2.0                         # 3.5, done: next obs belongs to a new episode
    d1 = 2.0 - 1.0                         # 1.0, terminated
    d0 = 1.0 + 0.9 * 1.0 - 0.5             # 1.4
    a3, a2, a1 = d3, d2, d1
    a0 = d0 + gamma * lam * a1             # 1.4 + 0.72 = 2.12
    expected = np.array([a0, a1, a2, a3])
    np.testing.assert_allclose(adv[:, 0].numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(ret[:, 0].numpy(), expected + values[:, 0].numpy(), rtol=1e-6)


def test_gae_with_lambda_one_and_no_dones_is_discounted_return_minus_value():
    torch.manual_seed(0)
    T, N, gamma = 6, 3, 0.95
    rewards, values, last = torch.randn(T, N), torch.randn(T, N), torch.randn(N)
    adv, ret = compute_gae(rewards, values, torch.zeros(T, N, dtype=torch.bool), last, gamma, 1.0)
    for t in range(T):
        discounted = sum(gamma ** (k - t) * rewards[k] for k in range(t, T)) + gamma ** (T - t) * last
        torch.testing.assert_close(ret[t], discounted, rtol=1e-5, atol=1e-5)


def test_time_out_bootstrap_on_timed_out_rows_equals_the_masked_full_forward():
    from ppo.gae import bootstrap_time_outs
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ELU(), torch.nn.Linear(16, 1))
    value = lambda obs: critic(obs).squeeze(-1)  # noqa: E731
    reward, final_obs = torch.randn(64), torch.randn(64, 5)
    truncated = torch.rand(64) < 0.2
    with torch.no_grad():
        full = reward + 0.99 * truncated * value(final_obs)
        subset = bootstrap_time_outs(reward, truncated, final_obs, value, 0.99)
        none = bootstrap_time_outs(reward, torch.zeros(64, dtype=torch.bool), final_obs, value, 0.99)
    torch.testing.assert_close(subset, full, rtol=0, atol=1e-6)
    assert torch.equal(subset[~truncated], reward[~truncated]) and not torch.equal(subset, reward)
    assert torch.equal(none, reward)


def test_time_out_bootstrap_of_a_bfloat16_critic_adds_in_the_rewards_float32():
    # A rollout rank's bfloat16 policy copy (--rollout.dtype bfloat16) gives bfloat16 values; the CPU path's
    # index_add refused them ("self (Float) and source (BFloat16)") at the first time-out.
    from ppo.gae import bootstrap_time_outs
    reward = torch.tensor([1.0, 2.0, 3.0])
    truncated = torch.tensor([False, True, False])
    value = lambda obs: obs.sum(-1).to(torch.bfloat16)  # noqa: E731
    final_obs = torch.tensor([[9.0], [4.0], [9.0]])
    out = bootstrap_time_outs(reward, truncated, final_obs, value, 0.99)
    # gamma times the value in float32, as an accelerator's masked sum does (in bfloat16, 0.99 x 4 is 3.953125)
    expected = np.float32(2.0) + np.float32(0.99) * np.float32(4.0)
    assert out.dtype == torch.float32 and out.tolist() == [1.0, float(expected), 3.0]


def test_time_out_bootstrap_on_cpu_runs_no_critic_when_no_env_timed_out():
    """Mutant: the CPU path's `if ids.numel() == 0: return reward` dropped (the critic then ran on 0 rows).
    No env timed out: the critic is not called at all (a critic may refuse an empty batch; either way it is a wasted
    forward each env step), and the rewards come back as they are."""
    from ppo.gae import bootstrap_time_outs
    calls = []

    def value(obs):
        calls.append(obs.shape[0])
        return obs.sum(-1)

    reward = torch.tensor([1.0, -2.0, 0.5])
    out = bootstrap_time_outs(reward, torch.zeros(3, dtype=torch.bool), torch.ones(3, 2), value, 0.99)
    assert calls == [] and out.tolist() == [1.0, -2.0, 0.5]


class _OnAnAccelerator(torch.Tensor):
    """A CPU tensor that reports a non-CPU device, so bootstrap_time_outs takes its accelerator branch here."""

    @property
    def device(self):
        return torch.device("meta")


def test_time_out_bootstrap_of_the_accelerator_branch_by_hand_on_cpu():
    # The masked full-forward branch (reward + gamma * truncated * V) otherwise runs only on a GPU
    # (bench/gpu_check.sh); a dropped gamma or mask there would pass every CPU test.
    from ppo.gae import bootstrap_time_outs
    reward = torch.tensor([1.0, -2.0, 0.5, 3.0]).as_subclass(_OnAnAccelerator)
    final_obs = torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 4.0], [3.0, 3.0]])
    truncated = torch.tensor([False, True, True, False])
    calls = []

    def value(obs):                    # V(obs) = 2 * obs0 - obs1 = 1, 4, -4, 3
        calls.append(obs.shape[0])
        return obs[:, 0] * 2.0 - obs[:, 1]

    out = bootstrap_time_outs(reward, truncated, final_obs, value, 0.5)
    assert calls == [4]                # the branch under test: the critic ran on every row
    assert out.as_subclass(torch.Tensor).tolist() == [1.0, -2.0 + 0.5 * 4.0, 0.5 + 0.5 * -4.0, 3.0]


def test_time_out_bootstrap_on_an_accelerator_leaves_envs_that_did_not_time_out_alone_whatever_their_value():
    # The accelerator branch runs the critic on every row, also on the final observation of an env that terminated
    # (one a simulator blew up: nan, or values beyond float32). Multiplied by the mask, 0 * nan and 0 * inf are nan:
    # that env's reward became nan and check_finite stopped a GPU run that the CPU path, which evaluates only the
    # timed-out rows, continues.
    from ppo.gae import bootstrap_time_outs
    final_obs = torch.tensor([[float("nan")], [2.0], [float("inf")], [3.0]])
    truncated = torch.tensor([False, True, False, False])
    reward = torch.tensor([1.0, -2.0, 0.5, 4.0])

    def value(obs):                    # V(obs) = 3 * obs0: nan, 6, inf, 9
        return obs[:, 0] * 3.0

    on_accelerator = bootstrap_time_outs(reward.as_subclass(_OnAnAccelerator), truncated, final_obs, value, 0.5)
    on_cpu = bootstrap_time_outs(reward, truncated, final_obs, value, 0.5)
    assert on_accelerator.as_subclass(torch.Tensor).tolist() == [1.0, -2.0 + 0.5 * 6.0, 0.5, 4.0] == on_cpu.tolist()


def test_time_out_bootstrap_on_an_accelerator_multiplies_a_bfloat16_value_by_gamma_in_the_rewards_dtype():
    # A bfloat16 policy copy (--rollout.dtype) gives bfloat16 values. Both branches take them into the rewards'
    # float32 before gamma multiplies: in bfloat16, 0.99 x 4 rounds to 3.953125 and the two paths differ.
    from ppo.gae import bootstrap_time_outs
    reward = torch.tensor([1.0, 2.0, 3.0])
    truncated = torch.tensor([False, True, False])
    value = lambda obs: obs.sum(-1).to(torch.bfloat16)  # noqa: E731
    final_obs = torch.tensor([[9.0], [4.0], [9.0]])
    out = bootstrap_time_outs(reward.as_subclass(_OnAnAccelerator), truncated, final_obs, value, 0.99)
    expected = np.float32(2.0) + np.float32(0.99) * np.float32(4.0)    # gamma x V in float32, by hand
    assert out.dtype == torch.float32 and out.as_subclass(torch.Tensor).tolist() == [1.0, float(expected), 3.0]


def test_gae_in_float64_keeps_gamma_in_float64():
    """With float64 inputs (an oracle's), no step rounds gamma to float32: 50 rewards of 1 with lambda 1 and no done
    give sum(0.99**k) to float64 precision (a float32 not_done was 8.5e-6 off)."""
    rewards = torch.ones(50, 1, dtype=torch.float64)
    adv, _ = compute_gae(rewards, torch.zeros_like(rewards), torch.zeros(50, 1, dtype=torch.bool),
                         torch.zeros(1, dtype=torch.float64), 0.99, 1.0)
    assert adv.dtype == torch.float64
    assert abs(adv[0, 0].item() - sum(0.99 ** k for k in range(50))) < 1e-12


def per_step_gae(rewards, values, dones, last_values, gamma, lam):
    """GAE as the per-step recursion from its definition, one step at a time, in the dtype of the inputs."""
    advantages, next_advantage, next_values = torch.empty_like(rewards), torch.zeros_like(last_values), last_values
    for t in reversed(range(rewards.shape[0])):
        not_done = 1.0 - dones[t].to(rewards.dtype)
        delta = rewards[t] + gamma * not_done * next_values - values[t]
        next_advantage = delta + gamma * lam * not_done * next_advantage
        advantages[t] = next_advantage
        next_values = values[t]
    return advantages


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gae_has_the_bits_of_the_per_step_recursion(dtype):
    """compute_gae precomputes delta and the decay for all steps, in the per-step recursion's operations and order:
    the advantages are the same bits, not only close (gamma 0.998 and lam 0.95 round differently in float32 when
    grouped as lam * (gamma * not_done)).

    Mutant: delta = rewards - values + gamma * not_done * next_values; decay = lam * (gamma * not_done)."""
    g = torch.Generator().manual_seed(7)
    rewards, values = torch.randn(32, 6, generator=g, dtype=dtype), torch.randn(32, 6, generator=g, dtype=dtype)
    dones, last = torch.rand(32, 6, generator=g) < 0.1, torch.randn(6, generator=g, dtype=dtype)
    advantages, returns = compute_gae(rewards, values, dones, last, 0.998, 0.95)
    expected = per_step_gae(rewards, values, dones, last, 0.998, 0.95)
    assert torch.equal(advantages, expected)
    assert torch.equal(returns, expected + values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gae_of_cleanrl_dones_moved_up_one_row_equals_cleanrl_loop(dtype):
    """CleanRL's ppo_continuous_action keeps a step's done with the next obs (dones[t]: obs t starts an episode;
    next_done after the last step); compute_gae gets them one row up, as its docstring says.
    Mutant: not_done taken from the row before (`torch.cat([torch.ones_like(not_done[:1]), not_done[:-1]])`)."""
    gen = torch.Generator().manual_seed(3)
    T, N, gamma, lam = 9, 4, 0.97, 0.9
    rewards, values = torch.randn(T, N, generator=gen, dtype=dtype), torch.randn(T, N, generator=gen, dtype=dtype)
    next_value = torch.randn(N, generator=gen, dtype=dtype)
    cleanrl_dones = (torch.rand(T, N, generator=gen) < 0.3).to(dtype)
    cleanrl_dones[1, 0] = cleanrl_dones[T - 1, 1] = 1.0     # an episode ends at step 0 of env 0; at step T-2 of env 1
    next_done = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=dtype)
    expected = np.zeros((T, N))                               # CleanRL's loop, in float64 numpy
    r, v, d, nv, nd = (x.double().numpy() for x in (rewards, values, cleanrl_dones, next_value, next_done))
    lastgaelam = 0.0
    for t in reversed(range(T)):
        nextnonterminal, nextvalues = (1.0 - nd, nv) if t == T - 1 else (1.0 - d[t + 1], v[t + 1])
        delta = r[t] + gamma * nextvalues * nextnonterminal - v[t]
        expected[t] = lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam
    adv, ret = compute_gae(rewards, values, torch.cat([cleanrl_dones[1:], next_done[None]]), next_value, gamma, lam)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    np.testing.assert_allclose(adv.double().numpy(), expected, rtol=tol, atol=tol)
    np.testing.assert_allclose(ret.double().numpy(), expected + v, rtol=tol, atol=tol)
