"""Per-rank seeds (dist/setup.py rank_seed): no (--seed, rank) pair shares another's streams, so a sweep over --seed
on several ranks runs independent experiments (--seed + rank made rank 1 of --seed 0 replay rank 0 of --seed 1)."""

import glob
import os

import pytest
import torch

import train
from configs import preset
from dist.setup import rank_seed
from envs import make_env
from tests.multirank import run_ranks
from tests.test_train import small_tracking, train_body


def test_rank_seeds_of_a_sweep_never_coincide():
    """Every (seed, rank) of a 64-seed sweep on up to 8 ranks gets its own 32-bit seed, the same on every call.
    Mutant: rank_seed returns seed + rank."""
    seeds = {(s, r): rank_seed(s, r) for s in range(64) for r in range(8)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(type(v) is int and 0 <= v < 2**32 for v in seeds.values())
    assert all(rank_seed(s, r) == v for (s, r), v in seeds.items())                 # a pure function of the pair
    assert all(0 <= rank_seed(2**32 - 1, r) < 2**32 for r in range(8))       # the largest --seed validate() takes


def test_the_env_and_shuffle_a_rank_builds_differ_from_the_next_seeds_other_rank():
    """What train.py builds for rank 1 of --seed 0 (env via make_env, minibatch shuffle generator) draws other
    numbers than what it builds for rank 0 of --seed 1: the env's first reset and the first shuffle differ.
    Mutant: rank_seed returns seed + rank."""
    cfg = preset("cartpole")
    cfg.env.num_envs = 64
    built = {}
    for seed, rank in ((0, 1), (1, 0)):
        env = make_env(cfg.env, torch.device("cpu"), seed=rank_seed(seed, rank), base_seed=seed)
        shuffle = torch.Generator().manual_seed(rank_seed(seed, rank))
        built[seed, rank] = env.reset()[0]["policy"], torch.randperm(1024, generator=shuffle)
    (obs_a, perm_a), (obs_b, perm_b) = built[0, 1], built[1, 0]
    assert not torch.equal(obs_a, obs_b) and not torch.equal(perm_a, perm_b)


@pytest.mark.slow
def test_a_two_rank_run_shares_no_stream_with_the_next_seeds_run(tmp_path):
    """Through train.py: rank 1 of a 2-rank run with --seed 1 and rank 0 of a 1-rank run with --seed 2 train on as
    many envs and steps; their saved torch and shuffle RNG states after an iteration differ (with seed + rank both
    were seeded 2 and made the same number of draws, so the states were equal).
    Mutant: train.py seeds its shuffle generator with cfg.seed + rank.
    Mutant: train.py calls seed_everything(cfg.seed + rank)."""
    run_ranks(train_body, 2, args=(small_tracking(tmp_path / "two", iterations=2, seed=1),))
    train.main(small_tracking(tmp_path / "one", iterations=2, seed=2))
    saved = {}
    for root in ("two", "one"):
        (path,) = glob.glob(os.path.join(tmp_path, root, "tracking", "*", "model_2.pt"))
        saved[root] = torch.load(path, weights_only=True)["rng"]
    assert len(saved["two"]) == 2 and len(saved["one"]) == 1
    rank1, other = saved["two"][1], saved["one"][0]
    for key in ("torch", "shuffle"):
        assert not torch.equal(rank1[key], other[key]), key
