"""Rules of dist/grad_sync.py and dist/stats.py that the other tests left open (found by mutation testing):

- GradSync: a second (and every later) optimizer step is all-reduced again, bucketed as flat; `flat` issues its
  one all-reduce at synchronize(), never from a gradient hook; the summed extras it returns are the caller's
  copy (the next zero_grad()/arm() does not change them); a .grad replaced by another tensor (not None) is
  refused like one set to None; parameters of two dtypes are refused at construction.
- reduce_metrics: keys are matched by name, not by the order each rank happened to insert them; no keys, no entries.
- ppo/: collect_rollout sums log-probs over action dims (more than one action) and calls `check` on the first
  step only; EpisodeStats.start_iteration forgets the last iteration's ended returns; ppo_loss refuses inputs
  that all share one shape other than [B]; EpisodeStats.ended_returns gathers every rank's returns in end order,
  and a 2-rank run with --log.episode-returns logs them all (their mean is Train/mean_reward), its gather planned.

Expected values are computed here independently: one process over the concatenated data, or by hand.
"""

import pytest
import torch
from torch import nn

from dist.grad_sync import GradSync
from dist.stats import reduce_metrics
from ppo.actor_critic import ActorCritic
from ppo.loss import ppo_loss
from ppo.rollout import TRAIN_KEYS, EpisodeStats, collect_rollout, episode_returns_plan_rows
from tests.multirank import run_ranks

B = 4   # samples per rank per step


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _data(rank, step):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(B, 5, generator=g), torch.randn(B, 2, generator=g)


def _loss(net, x, y):
    return (net(x) - y).square().mean()


def three_steps(rank, world_size, mode):
    """Three synchronized SGD steps on this rank's data; the gradient and summed extras of each step."""
    net = _net()
    sync = GradSync(net.parameters(), mode, bucket_mb=1000 / 2**20, num_extras=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out = []
    for step in range(3):
        x, y = _data(rank, step)
        sync.zero_grad()
        sync.arm(torch.tensor([float(rank + 1)]))
        _loss(net, x, y).backward()
        extras = sync.synchronize()
        out.append(([p.grad.clone() for p in net.parameters()], extras.clone(), len(sync.buckets)))
        opt.step()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_every_optimizer_step_is_averaged_over_ranks_not_only_the_first(mode):
    """Steps 2 and 3 equal one process on the concatenated data too (a bucketed launch cursor left at the end
    after step 1 would all-reduce nothing later: each rank would step on its own gradient / world size)."""
    world_size = 2
    results = run_ranks(three_steps, world_size, args=(mode,))
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):
        xs, ys = zip(*(_data(r, step) for r in range(world_size)))
        opt.zero_grad()
        _loss(net, torch.cat(xs), torch.cat(ys)).backward()
        for res in results:
            grads, extras, num_buckets = res[step]
            if mode == "bucketed":
                assert num_buckets >= 3
            for g, p in zip(grads, net.parameters()):
                torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
            assert extras.tolist() == [1.0 + 2.0]
        opt.step()


class CallRecordingGradSync(GradSync):
    """Counts the all-reduces issued (in one process the collective itself is a no-op)."""

    def _all_reduce(self, buffer, async_op):
        self.calls += 1
        return super()._all_reduce(buffer, async_op)


def test_flat_issues_its_one_all_reduce_at_synchronize_and_bucketed_during_backward():
    """Module docstring: flat all-reduces once, "issued at synchronize(), after backward"; bucketed launches
    from the hooks of the armed backward. Two steps each, so every step issues its own collectives."""
    for mode, during_backward in (("flat", 0), ("bucketed", 3)):
        net = _net()
        sync = CallRecordingGradSync(net.parameters(), mode, bucket_mb=1000 / 2**20)
        assert len(sync.buckets) == (1 if mode == "flat" else 3)
        sync.calls = 0
        for step in range(2):
            x, y = _data(0, step)
            sync.zero_grad()
            sync.arm()
            _loss(net, x, y).backward()
            assert sync.calls == step * len(sync.buckets) + during_backward, mode
            sync.synchronize()
            assert sync.calls == (step + 1) * len(sync.buckets), mode


def test_the_returned_extras_are_a_copy_that_the_next_step_does_not_change():
    """synchronize() returns the summed extras; zero_grad() and arm() of the next step rewrite the bucket the
    extras rode in, and must not rewrite what the caller holds (e.g. the KL statistic it has yet to read)."""
    net = _net()
    sync = GradSync(net.parameters(), "flat", num_extras=2)
    x, y = _data(0, 0)
    sync.zero_grad()
    sync.arm(torch.tensor([0.25, 3.0]))
    _loss(net, x, y).backward()
    summed = sync.synchronize()
    sync.clip_(1e-3)
    sync.zero_grad()
    sync.arm(torch.tensor([7.0, 1.0]))
    assert summed.tolist() == [0.25, 3.0]


def test_a_grad_replaced_by_another_tensor_is_refused_like_one_set_to_none():
    """A .grad rebound to a fresh tensor (p.grad = torch.zeros_like(p), or p.grad = p.grad * 2) is no longer
    a view into the bucket: its gradient would never be all-reduced, so synchronize() must refuse."""
    net = _net()
    sync = GradSync(net.parameters(), "flat")
    x, y = _data(0, 0)
    sync.zero_grad()
    net[2].weight.grad = torch.zeros_like(net[2].weight)
    sync.arm()
    _loss(net, x, y).backward()
    with pytest.raises(RuntimeError, match=r"parameter #2's \.grad is no longer a view"):
        sync.synchronize()


@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_parameters_of_two_dtypes_are_refused_at_construction(mode):
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(300, dtype=torch.float64))]
    with pytest.raises(ValueError, match=r"one parameter dtype.*float32.*float64"):
        GradSync(params, mode, bucket_mb=1000 / 2**20)


def metrics_in_rank_order(rank, world_size):
    # Rank 1 builds its dicts in the other order: the keys must still meet their own key on rank 0.
    order = ["a", "b"] if rank == 0 else ["b", "a"]
    sums = {"a": [1.0, 5.0], "b": [100.0, 300.0]}
    counts = {"a": [1.0, 3.0], "b": [10.0, 10.0]}
    return reduce_metrics({k: torch.tensor(sums[k][rank]) for k in order},
                          {k: torch.tensor(counts[k][rank]) for k in order})


@pytest.mark.slow
def test_reduce_metrics_matches_keys_by_name_whatever_order_each_rank_built_them_in():
    for out in run_ranks(metrics_in_rank_order, 2):
        assert out == {"a": pytest.approx((1.0 + 5.0) / (1 + 3), rel=1e-12),
                       "b": pytest.approx((100.0 + 300.0) / (10 + 10), rel=1e-12)}


def test_reduce_metrics_of_no_keys_is_an_empty_dict():
    """Nothing to log (no metric registered): no entries, not an error from stacking an empty list."""
    assert reduce_metrics({}, {}) == {}


# ---- ppo/rollout.py, ppo/storage.py -------------------------------------------------------------------

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


def test_start_iteration_forgets_the_previous_iterations_ended_returns_and_sums():
    stats = EpisodeStats(2, TRAIN_KEYS, torch.device("cpu"))
    stats.step(torch.tensor([1.0, 2.0]), torch.tensor([True, False]), {}, record_returns=True)
    assert len(stats.ended) == 1
    stats.start_iteration()
    assert stats.ended == [] and stats.sums.abs().sum() == 0 and stats.counts.abs().sum() == 0
    stats.step(torch.tensor([5.0, 1.0]), torch.tensor([False, True]), {}, record_returns=True)
    assert len(stats.ended) == 1 and torch.isnan(stats.ended[0][0]) and stats.ended[0][1].item() == 2.0 + 1.0


def test_ppo_loss_refuses_seven_inputs_of_one_shape_other_than_b():
    """Equal shapes are not enough: [B, 1] everywhere (an unsqueezed critic and unsummed log-probs) is refused too,
    as the docstring says: every input is [B]."""
    for shape in ((4, 1), ()):
        t = torch.zeros(shape)
        with pytest.raises(ValueError, match=r"shape \[B\]"):
            ppo_loss(t, t, t, t, t, t, t, 0.2, True, 0.5, 0.0)


def ended_returns_of_two_ranks(rank, world_size):
    """Rank r ends, over 2 steps of 2 envs: step 0 env 1 (10 + r), step 1 env 0 (20 + r) and, on rank 1 only,
    step 1 env 1 (30): different numbers of episodes per rank."""
    stats = EpisodeStats(2, TRAIN_KEYS, torch.device("cpu"))
    stats.step(torch.tensor([1.0, 10.0 + rank]), torch.tensor([False, True]), {}, record_returns=True)
    stats.step(torch.tensor([19.0 + rank, 30.0]), torch.tensor([True, rank == 1]), {}, record_returns=True)
    torch.distributed.all_gather = _no_all_gather           # this forked rank's own copy of torch
    return stats.ended_returns()


def _no_all_gather(*args, **kwargs):
    raise AssertionError("an all-gather: every rank would receive W x T x N returns that rank 0 alone writes")


@pytest.mark.slow
def test_ended_returns_are_every_ranks_in_end_order():
    """By step, then rank, then env, worked out by hand from the per-rank endings above, on rank 0, which logs them;
    the other sends its own by a gather (no all-gather) and keeps nothing."""
    assert run_ranks(ended_returns_of_two_ranks, 2) == [[10.0, 11.0, 20.0, 21.0, 30.0], []]


@pytest.mark.slow
def test_every_ranks_episode_returns_reach_tensorboard_and_the_plan(tmp_path):
    """--log.episode-returns on 2 ranks: Episode/return holds the episodes that ended on either rank (per iteration
    they average to Train/mean_reward, computed over both ranks by the separate (sum, count) all-reduce; until this
    version rank 0 logged its own alone), and their gather to rank 0 is in the sync plan: plan == ledger on each
    rank."""
    import glob

    import numpy as np
    from test_rollout_ranks import body, small
    from test_tools import tb_scalars
    cfg = small(tmp_path, iterations=3)
    cfg.log.episode_returns = True
    for rank, (_, _, ledger, expected) in enumerate(run_ranks(body, 2, args=(cfg, 3))):
        assert ledger == expected and ledger["episode_returns"] == [3, 3 * 8 * 16 * 4], rank   # 3 x [T, N] float32
    (run,) = glob.glob(str(tmp_path / "tracking" / "*"))
    returns: dict[int, list[float]] = {}
    for step, value in tb_scalars(run, "Episode/return"):
        returns.setdefault(step, []).append(value)
    means = dict(tb_scalars(run, "Train/mean_reward"))
    assert set(returns) == set(means) == {1, 2, 3}
    for step, values in returns.items():
        assert np.mean(values) == pytest.approx(means[step], rel=1e-5), step


def test_the_episode_returns_plan_row_is_one_gather_of_a_ranks_t_by_n_float32_returns_each_iteration():
    """The printed sync plan names the collective: the returns go to rank 0 alone (a gather); the ledger counts a
    gather as an all-gather (this rank's tensor), so plan == ledger cannot tell the two apart. None unrecorded."""
    (row,) = episode_returns_plan_rows(True, 8, 16)
    assert (row.purpose, row.collective, row.cadence, row.call_bytes) == ("episode_returns", "gather", "iteration",
                                                                         [8 * 16 * 4])
    assert episode_returns_plan_rows(False, 8, 16) == []
