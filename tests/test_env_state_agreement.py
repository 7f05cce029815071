"""A checkpoint keeps one rank's env state and every rank loads it on resume (envs/base.py): a save refuses env state
that differs by rank, naming its entries, instead of silently keeping rank 0's."""

import glob
import os

import pytest
import torch

import train
from configs import preset
from dist import comm
from dist.batches import flatten_state, to_bytes
from dist.errors import RunError
from dist.plan import expected_ledger
from envs.cartpole import CartPole
from rollout_ranks import unpack_team_states
from tests.multirank import run_ranks


class CurriculumCartPole(CartPole):
    """CartPole with a curriculum level in its checkpointed state: `level(rank)` decides each rank's value."""

    def __init__(self, *args, level, **kwargs):
        super().__init__(*args, **kwargs)
        self.level = level

    def state_dict(self) -> dict:
        return {"curriculum": {"level": self.level.clone()}, "steps": torch.zeros(2)}

    def load_state_dict(self, state: dict) -> None:
        self.level.copy_(state["curriculum"]["level"])


def train_with_levels(rank, world_size, root, per_rank):
    levels = torch.tensor([[0.0, 1.0], [0.0, 2.0]]) if per_rank else torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    cartpole = train.make_env
    train.make_env = lambda cfg, device, seed, base_seed: CurriculumCartPole(
        cfg.num_envs, device, seed, cfg.episode_length_s, level=levels[rank].clone())
    try:
        cfg = preset("cartpole")
        cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 8, 8, 2
        cfg.policy.actor_hidden = cfg.policy.critic_hidden = (8,)
        cfg.log.root, cfg.log.save_every, cfg.log.print_every, cfg.dist.device = str(root), 1, 100, "cpu"
        comm.reset_ledger()
        try:
            plan = train.main(cfg)[2]
        except RunError as error:
            return str(error)
        return {k: list(v) for k, v in comm.LEDGER.items()}, expected_ledger(plan, 2, final_iteration=2)
    finally:
        train.make_env = cartpole


@pytest.mark.slow
def test_a_per_rank_env_state_stops_the_first_save_naming_its_entry_and_rank(tmp_path):
    said = run_ranks(train_with_levels, 2, args=(tmp_path, True), timeout=60)
    for message in said:          # every rank sees the same rows, so every rank stops with the same line
        assert message.startswith("env.state_dict() differs across ranks in 'curriculum/level' (nested names joined "
                                  "by '/'): rank(s) [1] hold other values than rank 0")
        assert "'steps'" not in message                # the same on both ranks: not named
    assert glob.glob(os.path.join(tmp_path, "**", "model_*.pt"), recursive=True) == []


@pytest.mark.slow
def test_an_env_state_the_same_on_every_rank_is_saved_at_the_planned_cost(tmp_path):
    (ledger0, plan0), (ledger1, plan1) = run_ranks(train_with_levels, 2, args=(tmp_path, False), timeout=60)
    assert ledger0["env_state"] == plan0["env_state"] == [2, 2 * 16]      # 2 saves, 2 int64 per rank each
    assert ledger0 == plan0 and ledger1 == plan1
    (path,) = glob.glob(os.path.join(tmp_path, "**", "model_2.pt"), recursive=True)
    assert torch.equal(torch.load(path, weights_only=True)["env"]["curriculum"]["level"], torch.tensor([0.0, 1.0]))


def test_rollout_ranks_whose_env_states_differ_are_refused_by_learner_0_naming_the_rollout_ranks():
    """With rollout ranks the learner gathers every rollout rank's state: it compares them, by bits (a NaN that
    every rank holds is the same state)."""
    def blob(level):
        state = {"rng/env": torch.zeros(16, dtype=torch.uint8),
                 **{f"env/{k}": v for k, v in flatten_state({"curriculum": {"level": level}}).items()}}
        return to_bytes(state), {name: (tuple(v.shape), v.dtype) for name, v in state.items()}

    nan = torch.tensor([float("nan"), 1.0])
    (same, layout), (other, _) = blob(nan), blob(torch.tensor([float("nan"), 2.0]))
    spec = {"state_bytes": same.numel(), "state_layout": layout}
    rngs, env = unpack_team_states(torch.cat([same, same]), spec)
    assert len(rngs) == 2 and torch.equal(env["curriculum"]["level"].view(torch.uint8), nan.view(torch.uint8))
    with pytest.raises(RunError, match=r"^env.state_dict\(\) differs across rollout ranks in 'curriculum/level' "
                                       r"\(nested names joined by '/'\): rollout rank\(s\) \[2\] hold other values"):
        unpack_team_states(torch.cat([same, same, other]), spec)
    for blobs in ([same, other], [same, other, same]):          # rollout rank 1 is compared too
        with pytest.raises(RunError, match=r"^env.state_dict\(\) differs across rollout ranks in 'curriculum/level' "
                                           r"\(nested names joined by '/'\): rollout rank\(s\) \[1\] hold other"):
            unpack_team_states(torch.cat(blobs), spec)


def same_env_state_body(rank, world_size):
    from dist.checkpoint import same_env_state
    state = {"sampler": {"counts": torch.zeros(2 + rank)}, "steps": torch.zeros(2)}   # rank 1: 3 counts, not 2
    try:
        same_env_state(state)
    except RunError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_an_env_state_whose_entries_differ_in_shape_by_rank_is_named_as_a_layout_difference():
    """A per-rank env state of another shape (a sampler sized by the rank's own env count) is refused by the first
    check, of names, shapes and dtypes, naming rank 1 and this rank's entries: not compared value by value as if
    the entries lined up."""
    for message in run_ranks(same_env_state_body, 2, timeout=60):
        assert message.startswith("env.state_dict() has other entries, shapes or dtypes on rank(s) [1] than on "
                                  "rank 0 (this rank's: sampler/counts, steps)"), message
