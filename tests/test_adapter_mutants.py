"""Tests written to kill mutants of envs/gymnasium.py, envs/isaaclab.py and dist/setup.py that the other tests let
survive (see each test's Mutant line)."""

import re

import numpy as np
import pytest
import torch

import envs.isaaclab
from dist.setup import rank_seed
from envs.isaaclab import IsaacLabEnv, simulation_device
from tests.fake_isaaclab import TASK, FakeRLEnv, install_for_test


@pytest.mark.parametrize("seed, rank", [(0, 1), (1, 0), (7, 3), (2**32 - 1, 5)])
def test_rank_seed_is_the_first_word_of_numpys_seed_sequence_of_seed_then_rank(seed, rank):
    """docs/design.md: rank_seed(--seed, rank) is numpy's `SeedSequence([seed, rank])`, its first 32-bit word, so a
    run's streams stay what that derivation gives (a saved run replays with the same --seed), and the pair is ordered:
    (seed 0, rank 1) and (seed 1, rank 0) are other seeds.
    Mutant: SeedSequence([rank, seed]).
    Mutant: generate_state(2)[1] instead of generate_state(1)[0]."""
    expected = int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint32)[0])
    assert rank_seed(seed, rank) == expected


@pytest.fixture
def fake(monkeypatch):
    """The fake Isaac Lab 3.0 (tests/fake_isaaclab.py); every adapter built is closed at the end."""
    record = install_for_test(monkeypatch)
    closers = []
    monkeypatch.setattr(envs.isaaclab.atexit, "register", closers.append)
    yield record
    for close in closers:
        close()


def test_an_empty_tensor_logged_is_named_at_start_up_not_a_reshape_error(fake):
    """extras['log'] holding a tensor of no element (a mean over no env, left unreduced) is no number either: named
    like a per-env tensor, not torch's "shape '[]' is invalid for input of size 0".
    Mutant: the logged value's check `numel() != 1` -> `numel() > 1`."""
    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)
        env.extra_log = {"Metrics/none": torch.ones(0)}
        return env

    fake.entry_point = entry_point
    message = (f"--env.task {TASK}: extras['log']['Metrics/none'] is a tensor of shape [0], not one number; make the "
               f"task log one value per name (e.g. the mean over its envs)")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        IsaacLabEnv(TASK, 2, torch.device("cpu"), 0, critic_obs_groups=("policy", "critic"))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_isaac_lab_simulates_on_cuda_only_refusing_any_other_device_by_name(device):
    """Not only the CPU: any device that is not CUDA (a meta or mps device) is refused, naming it; cuda:1 is taken.
    Mutant: simulation_device refuses `device.type == "cpu"` only."""
    with pytest.raises(ValueError, match=f"simulates on GPUs .*but this rank's device is {device}"):
        simulation_device(torch.device(device))
    assert simulation_device(torch.device("cuda", 1)) == "cuda:1"
