"""Surviving mutants of ppo/rollout.py and ppo/env_check.py killed without processes: a gather faked in-process, and the
protocol checks called on a stand-in env."""

from types import SimpleNamespace

import pytest
import torch

import ppo.env_check as env_check
from dist import comm
from dist.errors import RunError
from ppo.env_check import check_obs, check_step, step_checker
from ppo.rollout import TRAIN_KEYS, EpisodeStats

CPU = torch.device("cpu")


def stats_of_rank(rank):
    """Rank r ends, over 2 steps of 2 envs: step 0 env 1 (10 + r), step 1 env 0 (20 + r) and, on rank 1 only, step 1
    env 1 (30)."""
    stats = EpisodeStats(2, TRAIN_KEYS, CPU)
    stats.step(torch.tensor([1.0, 10.0 + rank]), torch.tensor([False, True]), {}, record_returns=True)
    stats.step(torch.tensor([19.0 + rank, 30.0]), torch.tensor([True, rank == 1]), {}, record_returns=True)
    return stats


def test_ended_returns_of_two_ranks_come_by_step_then_rank_then_env(monkeypatch):
    """The gather (faked: rank 0's [T, N] returns stacked with rank 1's, as comm.gather stacks them on rank 0) is read
    back in end order, by step, then rank, then env, worked out by hand: step 0 gives 10 (rank 0) and 11 (rank 1),
    step 1 gives 20 (rank 0), then 21 and 30 (rank 1). Not rank 0's all before rank 1's.

    Mutant: rollout.py `flat = gathered.flatten().cpu()` (for `gathered.transpose(0, 1).flatten()`)."""
    other = torch.stack(stats_of_rank(1).ended).float()
    monkeypatch.setattr(comm, "device", lambda: CPU)
    monkeypatch.setattr(comm, "gather", lambda tensor, purpose: torch.stack([tensor, other]))
    assert stats_of_rank(0).ended_returns() == [10.0, 11.0, 20.0, 21.0, 30.0]


ENV = SimpleNamespace(num_envs=8, obs_dims={"policy": 4, "critic": 5}, log_keys=())


def obs(n=8):
    return {"policy": torch.zeros(n, 4), "critic": torch.zeros(n, 5)}


def a_step(**changes):
    step = {"obs": obs(), "reward": torch.zeros(8), "terminated": torch.zeros(8, dtype=torch.bool),
            "truncated": torch.zeros(8, dtype=torch.bool), "extras": {"log": {}, "final_obs": obs()}}
    step.update(changes)
    return tuple(step.values())


@pytest.mark.parametrize("rows", [7, 1, 9])
def test_an_observation_group_with_another_number_of_envs_is_refused(rows):
    """obs['critic'] of `rows` envs, of the right width 5, for 8 envs: refused naming the shape it has and the one
    expected (a rollout would store a row per env that the model never matches).

    Mutant: env_check.py check_obs comparing only the width, `if value.shape[-1] != expected[1]:`."""
    bad = {"policy": torch.zeros(8, 4), "critic": torch.zeros(rows, 5)}
    expected = (rf"^env 'x': step\(\)'s obs\['critic'\] has shape \[{rows}, 5\], expected \[num_envs, "
                rf"obs_dims\['critic'\]\] = \[8, 5\] ")
    with pytest.raises(RunError, match=expected):
        check_obs(bad, ENV, "x", "step()'s obs", CPU)


@pytest.mark.parametrize("what", ["reward", "terminated", "truncated"])
@pytest.mark.parametrize("length", [1, 7])
def test_a_one_dimensional_reward_or_flag_of_another_length_is_refused(what, length):
    """A [1] or [7] reward, terminated or truncated for 8 envs (a [1] broadcasts silently into every env's row of the
    batch): refused as not a [num_envs] = [8] tensor, naming its shape.

    Mutant: env_check.py check_step's `or value.dim() != 1:` (for `or tuple(value.shape) != (env.num_envs,):`)."""
    dtype = torch.float32 if what == "reward" else torch.bool
    result = a_step(**{what: torch.zeros(length, dtype=dtype)})
    with pytest.raises(RunError, match=rf"^env 'x': step\(\)'s {what} must be a \[num_envs\] = \[8\] tensor, got "
                                       rf"\[{length}\] "):
        check_step(ENV, result, "x", CPU, bootstrap=True)


def test_the_step_checker_checks_the_whole_step_once_and_the_extras_on_every_step(monkeypatch):
    """step_checker's contract (ppo/env_check.py): check_step on the run's first step, check_extras alone on the
    others (the obs, reward and flag checks are not repeated every step). Counted over 4 steps: check_step once,
    check_extras 4 times (once inside check_step).

    Mutant: env_check.py step_checker without `checked_first = True` (the whole step checked every step)."""
    calls = {"check_step": 0, "check_extras": 0}
    for name in calls:
        real = getattr(env_check, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(env_check, name, counted)
    check = step_checker(ENV, "x", CPU, bootstrap=True)
    for _ in range(4):
        check(a_step())
    assert calls == {"check_step": 1, "check_extras": 4}
