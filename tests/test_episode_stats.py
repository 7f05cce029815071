"""EpisodeStats (ppo/rollout.py): the per-iteration (sum, count) of episode returns, lengths and env log values."""

import torch

from ppo.rollout import TRAIN_KEYS, EpisodeStats


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
