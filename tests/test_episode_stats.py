"""EpisodeStats (ppo/rollout.py): the per-iteration (sum, count) of episode returns, lengths and env log values;
start_iteration forgetting the last iteration's ended returns; every rank's ended returns gathered to rank 0 in end
order, logged to TensorBoard by a 2-rank run with --log.episode-returns (their mean is Train/mean_reward), and their
gather's plan row; one rank's own ended returns without a process group."""

import pytest
import torch

from ppo.rollout import TRAIN_KEYS, EpisodeStats, episode_returns_plan_rows
from tests.multirank import run_ranks


def test_episode_stats_count_each_log_key_once_per_step_that_logs_it():
    """Each env log value counts once for its own key, whatever else the step logs: key a on 3 steps (1, 2, 3),
    key b on the middle one only (5): a = (6, 3), b = (5, 1), not a count per key logged beside it."""
    stats = EpisodeStats(1, TRAIN_KEYS + ("Episode/a", "Episode/b"), torch.device("cpu"))
    no = torch.tensor([False])
    stats.step(torch.ones(1), no, {"Episode/a": torch.tensor(1.0)}, False)
    stats.step(torch.ones(1), no, {"Episode/a": torch.tensor(2.0), "Episode/b": torch.tensor(5.0)}, False)
    stats.step(torch.ones(1), no, {"Episode/a": 3.0}, False)
    i = stats.index
    assert (stats.sums[i["Episode/a"]].item(), stats.counts[i["Episode/a"]].item()) == (6.0, 3.0)
    assert (stats.sums[i["Episode/b"]].item(), stats.counts[i["Episode/b"]].item()) == (5.0, 1.0)


def test_episode_stats_returns_add_negative_rewards_as_they_are():
    """Returns are plain sums of the raw rewards, negative ones included: env 0 gets -1 then 0.5 (return -0.5),
    env 1 gets -2 then -3 (return -5), both ending at the 2nd step."""
    stats = EpisodeStats(2, TRAIN_KEYS, torch.device("cpu"))
    stats.step(torch.tensor([-1.0, -2.0]), torch.tensor([False, False]), {}, True)
    stats.step(torch.tensor([0.5, -3.0]), torch.tensor([True, True]), {}, True)
    i = stats.index
    assert stats.sums[i["Train/mean_reward"]].item() == -0.5 - 5.0 and stats.counts[i["Train/mean_reward"]].item() == 2
    assert stats.ended[1].tolist() == [-0.5, -5.0]


def test_episode_stats_sum_each_finished_episode_once_and_count_log_entries():
    """Train/mean_reward and Train/mean_episode_length are (sum, count) over the episodes that ended this
    iteration, each episode's return and length restarting at its reset; env log values count once per step."""
    stats = EpisodeStats(2, TRAIN_KEYS + ("Episode/x",), torch.device("cpu"))
    rewards = torch.tensor([[1.0, 11], [2, 12], [1, 13], [2, 11]])
    dones = torch.tensor([[False, False], [True, False], [False, True], [True, False]])
    for r, d in zip(rewards, dones):
        stats.step(r, d, {"Episode/x": torch.tensor(1.5)}, record_returns=True)
    # Episodes that ended: env 0 at steps 1 and 3 (return 1 + 2 = 3, length 2 each), env 1 at step 2 (36, 3).
    i = stats.index
    assert stats.sums[i["Train/mean_reward"]].item() == 3 + 3 + 36
    assert stats.counts[i["Train/mean_reward"]].item() == 3
    assert stats.sums[i["Train/mean_episode_length"]].item() == 2 + 2 + 3
    assert stats.counts[i["Train/mean_episode_length"]].item() == 3
    assert stats.sums[i["Episode/x"]].item() == 4 * 1.5 and stats.counts[i["Episode/x"]].item() == 4
    ended = torch.stack(stats.ended)
    assert ended[1, 0].item() == 3 and ended[3, 0].item() == 3 and ended[2, 1].item() == 36
    assert torch.isnan(ended).sum().item() == 8 - 3
    assert stats.episode_return.tolist() == [0.0, 11.0] and stats.episode_length.tolist() == [0.0, 1.0]


def test_episode_stats_count_every_episode_that_ends_in_the_same_step():
    """Three of four envs end in one step: three episodes, their returns and lengths summed, not one of them."""
    stats = EpisodeStats(4, TRAIN_KEYS, torch.device("cpu"))
    stats.step(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([False, True, False, False]), {}, False)
    stats.step(torch.tensor([5.0, 6.0, 7.0, 8.0]), torch.tensor([True, True, False, True]), {}, False)
    i = stats.index
    assert stats.counts[i["Train/mean_reward"]].item() == 1 + 3
    assert stats.sums[i["Train/mean_reward"]].item() == 2 + (1 + 5) + 6 + (4 + 8)
    assert stats.sums[i["Train/mean_episode_length"]].item() == 1 + 2 + 1 + 2
    assert stats.episode_return.tolist() == [0.0, 0.0, 10.0, 0.0] and stats.episode_length.tolist() == [0, 0, 2, 0]


def test_episode_stats_accumulate_sums_and_counts_in_float64():
    """An iteration's sums and counts add up across steps in float64: a float32 accumulator would drop the 1
    from 2**24 + 1 (its spacing there is 2), in a sum of returns as in a count."""
    stats = EpisodeStats(1, TRAIN_KEYS + ("Episode/x",), torch.device("cpu"))
    stats.step(torch.tensor([2.0 ** 24]), torch.tensor([True]), {}, record_returns=False)
    stats.step(torch.tensor([1.0]), torch.tensor([True]), {}, record_returns=False)
    i = stats.index
    assert stats.sums[i["Train/mean_reward"]].item() == 2 ** 24 + 1
    stats.add("Episode/x", 0.5, 2 ** 24)
    stats.add("Episode/x", 0.5, 1)
    assert stats.counts[i["Episode/x"]].item() == 2 ** 24 + 1 and stats.sums[i["Episode/x"]].item() == 1.0


# ---- ppo/update.py, ppo/minibatch_step.py ------------------------------------------------------------


def test_start_iteration_forgets_the_previous_iterations_ended_returns_and_sums():
    stats = EpisodeStats(2, TRAIN_KEYS, torch.device("cpu"))
    stats.step(torch.tensor([1.0, 2.0]), torch.tensor([True, False]), {}, record_returns=True)
    assert len(stats.ended) == 1
    stats.start_iteration()
    assert stats.ended == [] and stats.sums.abs().sum() == 0 and stats.counts.abs().sum() == 0
    stats.step(torch.tensor([5.0, 1.0]), torch.tensor([False, True]), {}, record_returns=True)
    assert len(stats.ended) == 1 and torch.isnan(stats.ended[0][0]) and stats.ended[0][1].item() == 2.0 + 1.0


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


def test_one_rank_s_ended_returns_are_its_own_in_end_order():
    """One process (no process group; the gather is a stack of one): the raw return of every episode that ended, by
    step then env, worked out by hand (env 1 at step 0: 2; envs 0 and 2 at step 1: 1 + 4, 3 + 6; env 2 again at
    step 2: 10), none of the NaN placeholders of the envs that did not end.
    Mutant: `if gathered is None` negated (one rank got []); `flat[~flat.isnan()]` -> `flat[flat.isnan()]`."""
    stats = EpisodeStats(3, TRAIN_KEYS, torch.device("cpu"))
    for rewards, done in (([1.0, 2.0, 3.0], [False, True, False]), ([4.0, 5.0, 6.0], [True, False, True]),
                          ([7.0, 8.0, 10.0], [False, False, True])):
        stats.step(torch.tensor(rewards), torch.tensor(done), {}, record_returns=True)
    assert stats.ended_returns() == [2.0, 5.0, 9.0, 10.0]
