"""Tests written to kill mutants of envs/gymnasium.py, envs/isaaclab.py and dist/setup.py that the other tests let
survive (see each test's Mutant line)."""

import re
import sys

import numpy as np
import pytest
import torch
import torch.distributed as torch_dist

import envs.isaaclab
from dist import comm
from dist.errors import RunError, UsageError
from dist.setup import init_distributed, rank_seed
from envs.base import MissingSimulator
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


def test_a_runtime_that_exits_without_a_status_is_reported_as_exit_1(fake, monkeypatch):
    """Isaac Lab's launcher ending with a bare SystemExit() (code None: Python exits with status 1) when Kit cannot
    start: the one-line refusal says exit 1, not `exit None`.
    Mutant: the message's `exc.code or 1` -> `exc.code`."""
    def launch_simulation(cfg, launcher_args=None):
        raise SystemExit()
    monkeypatch.setattr(sys.modules["isaaclab.app"], "launch_simulation", launch_simulation)
    with pytest.raises(MissingSimulator, match=r"could not start the Isaac Sim \(Kit\) runtime that this task's "
                                               r"physics or renderer needs \(its error above, exit 1\);"):
        IsaacLabEnv(TASK, 2, torch.device("cpu"), 0, critic_obs_groups=("policy", "critic"))


@pytest.mark.parametrize("empty", ["MASTER_ADDR", "MASTER_PORT"])
def test_an_empty_master_addr_or_port_is_refused_as_missing(monkeypatch, empty):
    """WORLD_SIZE=2 with MASTER_ADDR or MASTER_PORT set but empty (`export MASTER_ADDR=` in a job script) cannot
    reach rank 0 any more than unset ones: refused by name before any process group is made.
    Mutant: the check `not os.environ.get(name)` -> `name not in os.environ`."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, "" if name == empty else value)
    with pytest.raises(UsageError, match=f"^WORLD_SIZE=2 without {empty}: the ranks cannot find each other"):
        init_distributed("gloo", "cpu", timeout_s=5.0)


@pytest.mark.parametrize("error, becomes", [(RuntimeError("an unrelated bug"), RuntimeError),
                                            (RuntimeError("[gloo] connectFullMesh failed: timed out"), "RunError")])
def test_only_gloo_s_mesh_timeout_among_runtime_errors_becomes_the_rendezvous_message(monkeypatch, error, becomes):
    """A RuntimeError from init_process_group that is not gloo's connectFullMesh (a bug, a wrong argument) passes
    through as it is; the mesh's timeout becomes the RunError naming --dist.timeout-s.
    Mutant: every RuntimeError turned into the rendezvous RunError."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(comm, "_DEVICE", comm._DEVICE)
    monkeypatch.setattr(comm, "_GROUP", comm._GROUP)
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: False)

    def init_process_group(**kwargs):
        raise error
    monkeypatch.setattr(torch_dist, "init_process_group", init_process_group)
    if becomes is RuntimeError:
        with pytest.raises(RuntimeError, match="^an unrelated bug$") as caught:
            init_distributed("gloo", "cpu", timeout_s=5.0)
        assert not isinstance(caught.value, RunError)
    else:
        with pytest.raises(RunError, match=r"did not all meet at 127\.0\.0\.1:29500 within --dist\.timeout-s 5 "):
            init_distributed("gloo", "cpu", timeout_s=5.0)
