"""A rollout rank that stops responding is the one the learner names, not a healthy one of its team; the healthy
rollout rank, which waits on the learner, says that the learner may itself be waiting for another rank."""

import re
import time
from pathlib import Path

import pytest

import rollout_ranks
import train
from configs import preset
from tests.multirank import run_ranks

TIMEOUT_S = 3.0


def stall_body(rank, world_size, root, stalled):
    """1 learner (rank 0) + rollout ranks 1, 2: rollout rank `stalled` stops, inside its second collection, until
    both other ranks have failed (past every wait on it; then its own next wait fails too); every rank returns the
    line it failed with."""
    done = [Path(root) / f"done_{other}" for other in range(world_size) if other != stalled]
    if rank == stalled:
        collect = rollout_ranks.collect_rollout
        calls = []

        def stalling(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                deadline = time.monotonic() + 10 * TIMEOUT_S
                while not all(path.exists() for path in done) and time.monotonic() < deadline:
                    time.sleep(0.05)
            return collect(*args, **kwargs)
        rollout_ranks.collect_rollout = stalling
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 8, 8, 4
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (8,)
    cfg.log.root, cfg.log.print_every, cfg.dist.device = str(root), 100, "cpu"
    cfg.rollout.ranks, cfg.dist.timeout_s = 2, TIMEOUT_S
    try:
        train.main(cfg)
        said = "finished"
    except Exception as error:  # noqa: BLE001 - the line each rank fails with is what is tested
        said = str(error)
    if rank != stalled:
        (Path(root) / f"done_{rank}").touch()
    return said


@pytest.mark.slow
@pytest.mark.parametrize("stalled, healthy", [(2, 1), (1, 2)])
def test_the_learner_names_the_stalled_rollout_rank_not_a_healthy_one(tmp_path, stalled, healthy):
    learner, *rollouts = run_ranks(stall_body, 3, args=(tmp_path, stalled), timeout=50)
    assert learner.startswith(f"rollout rank {stalled} died or stalled: "), learner
    assert f"rollout rank {healthy} " not in learner
    said = rollouts[healthy - 1]
    assert re.match(r"learner rank 0 died or stalled, or a rank it waits for \(another rollout rank of its team "
                    r"or another learner\): ", said), said
