"""compute_gae refuses shapes that would broadcast (a critic's unsqueezed [T, N, 1] values, [N, 1] last values), as
ppo_loss does: copied into another project (README's Layout), it is called with whatever a user's critic returns.
Before, N > 1 failed inside the loop with torch's `expand(...)` message, and N = 1 (CleanRL's one env) silently
returned [T, T, 1] returns."""

import pytest
import torch

from ppo.gae import bootstrap_time_outs, compute_gae

T, N = 5, 4


def args(values_shape, last_shape, num_envs=N):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(T, num_envs, generator=g), torch.randn(values_shape, generator=g),
            torch.zeros(T, num_envs, dtype=torch.bool), torch.randn(last_shape, generator=g), 0.99, 0.95)


@pytest.mark.parametrize("values_shape, last_shape, num_envs", [
    ((T, N, 1), (N,), N),          # critic output not squeezed
    ((T, N), (N, 1), N),           # last values not squeezed
    ((T, 1, 1), (1,), 1),          # one env: broadcast silently to [T, T, 1] returns before
])
def test_values_that_would_broadcast_are_refused_naming_the_shapes(values_shape, last_shape, num_envs):
    expected = (f"compute_gae expects rewards, values and dones of shape [T, N] and last_values [N] (squeeze the "
                f"critic's last dim), got [{T}, {num_envs}], {list(values_shape)}, [{T}, {num_envs}] and "
                f"{list(last_shape)}")
    with pytest.raises(ValueError) as raised:
        compute_gae(*args(values_shape, last_shape, num_envs))
    assert str(raised.value) == expected


def test_one_step_of_one_env_by_hand():
    """Matching shapes still compute: T = 1, N = 1, not done, A = r + gamma * V(next) - V = 1 + 0.5 * 2 - 1 = 1."""
    adv, ret = compute_gae(torch.tensor([[1.0]]), torch.tensor([[1.0]]), torch.tensor([[False]]), torch.tensor([2.0]),
                           0.5, 0.9)
    assert adv.tolist() == [[1.0]] and ret.tolist() == [[2.0]]


@pytest.mark.parametrize("device", ["cpu", "meta"])     # meta: the accelerator path (any non-CPU device), shapes only
def test_bootstrap_time_outs_refuses_a_critic_output_that_is_not_squeezed(device):
    """An accelerator's path had broadcast [N] + [N, 1] into an [N, N] reward with no error; the CPU path failed inside
    index_add with torch's words."""
    reward, truncated = torch.zeros(N, device=device), torch.tensor([True, False, True, False], device=device)
    final_obs = torch.zeros(N, 3, device=device)
    rows = N if device == "meta" else 2          # the CPU path evaluates the timed-out rows only
    with pytest.raises(ValueError, match=rf"^bootstrap_time_outs: value_fn must return one value per row, \[{rows}\] "
                                         rf"\(squeeze the critic's last dim\), got \[{rows}, 1\]$"):
        bootstrap_time_outs(reward, truncated, final_obs, lambda obs: obs[:, :1], 0.5)


def test_bootstrap_time_outs_by_hand():
    """Envs 0 and 2 timed out: reward + 0.5 * V, V = the first feature (2 and 4); the others keep their reward."""
    final_obs = torch.tensor([[2.0, 0.0], [3.0, 0.0], [4.0, 0.0], [5.0, 0.0]])
    out = bootstrap_time_outs(torch.ones(N), torch.tensor([True, False, True, False]), final_obs,
                              lambda obs: obs[:, 0], 0.5)
    assert out.tolist() == [2.0, 1.0, 3.0, 1.0]
