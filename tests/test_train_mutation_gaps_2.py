"""Gaps a second mutation audit of train.py found (the lines changed since the first audit,
tests/test_train_mutation_gaps.py): each test here fails on a plausible change of train.py that every other test let
through. Expected values come from the docs and by hand, never from the code under test.

53 hand-made mutants, each run alone against the 62 test files that mention train (slow ones included): 42 killed
by them; 9 survivors pinned below (one test kills two); 2 equivalent: the saved env state read from the env instead of
the gathered one (gather_save_states refuses env states that differ by rank, so rank 0's is that one), and glibc's
freed-memory setting skipped (page faults only, no value changes).

Pinned here: the replica check after a checkpoint load covering the model's merged buffers and the reward normalizer
beside it (after the start-up broadcast); the periodic check covering the merged buffers; every rank logging the least
waiting update (the reduced learning time), not its own clock's; rollout ranks joining on cpu where CUDA exists; a live
run's directory refused before the process group forms; the first merge of observations far from 0 conditioned by the
reset observations; the signal handlers given back when a run ends; a typed --env.task that cart-pole does not read
refused as such by --resume auto, not as a missing checkpoint of that task.
"""

import fcntl
import glob
import os
import re
import signal

import numpy as np
import pytest
import torch

import train
from configs import preset
from dist.errors import UsageError
from ppo.normalizer import ObsNormalizer, RewardNormalizer
from tests.multirank import run_ranks
from tests.test_replica_check_reward_stats import trained_or_error
from tests.test_sync_contract import phase_times_body
from tests.test_train import small_tracking


def resumed_body(rank, world_size, root, resume, broken_rank):
    """A 2-iteration run with reward normalization, or its resume to 3 iterations; the periodic replica check off, so
    that only the check after the load runs. On `broken_rank` of the resume, the loaded return statistics (m2) and,
    after the start-up broadcast, the critic normalizer's count are off by a little. Returns the run's error message,
    or "trained"."""
    cfg = small_tracking(root, iterations=3 if resume else 2)
    cfg.ppo.normalize_rewards, cfg.dist.verify_every, cfg.dist.device = True, 0, "cpu"
    cfg.resume = "auto" if resume else ""
    if rank == broken_rank:
        load, broadcast = RewardNormalizer.load_state_dict, train.broadcast_module

        def broken_load(self, state, *args, **kwargs):
            loaded = load(self, state, *args, **kwargs)
            self.m2.copy_(torch.nextafter(self.m2, self.m2 + 1))
            return loaded

        def broken_broadcast(model):
            broadcast(model)
            model.critic_normalizer.count.add_(1)
        RewardNormalizer.load_state_dict, train.broadcast_module = broken_load, broken_broadcast
    return trained_or_error(cfg)


@pytest.mark.slow
def test_the_check_after_a_load_covers_merged_buffers_and_the_reward_statistics(tmp_path):
    """Mutants: the check after a checkpoint load without the model's buffer rules (parameters only), or without the
    reward normalizer beside the model. A rank whose merged statistics or return statistics differ after the load and
    the broadcast is named, with both tensors, before the first rollout."""
    assert run_ranks(resumed_body, 2, args=(str(tmp_path), False, None)) == ["trained", "trained"]
    for message in run_ranks(resumed_body, 2, args=(str(tmp_path), True, 1)):
        assert message.startswith("parameters after checkpoint load diverged across ranks: rank(s) [1] differ from "
                                  "rank(s) [0]"), message
        assert message.endswith("tensors that differ: ['critic_normalizer.count', 'RewardNormalizer.m2']"), message


def merged_stats_body(rank, world_size, root, broken_rank):
    """A 2-iteration run with the replica check every iteration; on `broken_rank`, every update of the observation
    normalizers (a merge over all ranks) is followed by one more count. Returns the run's error message, or
    "trained"."""
    if rank == broken_rank:
        merge = ObsNormalizer.update

        def broken_update(self, batch):
            merge(self, batch)
            self.count.add_(1)
        ObsNormalizer.update = broken_update
    cfg = small_tracking(root, iterations=2)
    cfg.dist.verify_every, cfg.dist.device = 1, "cpu"
    return trained_or_error(cfg)


@pytest.mark.slow
def test_the_periodic_check_covers_the_model_s_merged_buffers(tmp_path):
    """Mutant: --dist.verify-every checks parameters only, not the buffers the model's BUFFER_POLICY merges. A rank
    whose critic normalizer merged a different count is named with it after the first iteration."""
    assert run_ranks(merged_stats_body, 2, args=(str(tmp_path / "clean"), None)) == ["trained", "trained"]
    for message in run_ranks(merged_stats_body, 2, args=(str(tmp_path / "broken"), 1)):
        assert message.startswith("parameters diverged across ranks: rank(s) [1] differ from rank(s) [0]"), message
        assert message.endswith("tensors that differ: ['critic_normalizer.count']"), message


@pytest.mark.slow
def test_every_rank_logs_the_least_waiting_update_not_its_own(tmp_path):
    """Mutant: the learning time read from this rank's clock instead of the reduced one (the minimum over ranks). Rank
    1's updates read 1000 s long; every rank logs rank 0's (real, under a minute) and total_fps uses it."""
    logged = run_ranks(phase_times_body, 2, args=(str(tmp_path), "update"))
    for scalars in logged:
        assert 0.0 < scalars["Perf/learning_time"] < 60
        both = scalars["Perf/collection_time"] + scalars["Perf/learning_time"]
        assert scalars["Perf/total_fps"] == 2 * 8 * 8 / both
    assert logged[0]["Perf/learning_time"] == logged[1]["Perf/learning_time"]


class Joined(Exception):
    """Raised in place of joining the process group: carries the device main() asked for."""


def test_rollout_ranks_take_auto_as_cpu_where_cuda_exists(tmp_path, monkeypatch):
    """Mutant: --dist.device auto left as it is with --rollout.ranks. Where torch sees a GPU, auto would mean cuda;
    with rollout ranks main() joins the process group on cpu (docs/rollout_ranks.md) and checks the device as cpu."""
    monkeypatch.setenv("RANK", "0"), monkeypatch.setenv("WORLD_SIZE", "2"), monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    checked = []
    validate_device = train.validate_device
    monkeypatch.setattr(train, "validate_device", lambda cfg, world, kind: checked.append(kind) or
                        validate_device(cfg, world, kind))

    def join(backend, device, timeout_s):
        raise Joined(device)
    monkeypatch.setattr(train, "init_distributed", join)
    cfg = preset("cartpole")
    cfg.rollout.ranks, cfg.log.root = 1, str(tmp_path)
    assert cfg.dist.device == "auto"
    with pytest.raises(Joined) as joined:
        train.main(cfg)
    assert joined.value.args == ("cpu",) and checked == ["cpu"]


def test_a_live_run_s_directory_is_refused_before_the_process_group_forms(tmp_path, monkeypatch):
    """Mutant: the early lock of a run continued in place dropped (the run directory is then locked only when it is
    opened for writing, after the process group, the env and the model exist). While another open file holds the
    lock, `--resume auto` is refused naming the directory as in use, and no process group was joined."""
    train.main(small_tracking(tmp_path, iterations=1))
    (run_dir,) = glob.glob(os.path.join(tmp_path, "tracking", "*"))

    def join(*args):
        raise AssertionError("the process group was joined before the refusal")
    monkeypatch.setattr(train, "init_distributed", join)
    cfg = small_tracking(tmp_path, iterations=2)
    cfg.resume = "auto"
    with open(os.path.join(run_dir, ".lock"), "a+") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)   # another run's, through another open file
        with pytest.raises(UsageError, match=f"^run directory {re.escape(run_dir)} is in use by another run"):
            train.main(cfg)


def test_the_first_merge_of_far_off_observations_keeps_their_spread(tmp_path, monkeypatch):
    """Mutant: the critic normalizer's first merge left unshifted (set_first_shift not called with the reset
    observations). Critic observations moved 1e6 away (float32 keeps steps of 1/16 there) merge as plain sums of
    squares of about 1e12 each: their variance then loses digits. With the shift, the statistics after the first
    iteration equal numpy's float64 mean and variance of the very batch that was merged, to 1e-9."""
    make_env, merged = train.make_env, []

    def far_off_env(*args, **kwargs):
        env = make_env(*args, **kwargs)
        reset, step = env.reset, env.step

        def moved(obs):
            return {**obs, "critic": obs["critic"] + 1e6}
        env.reset = lambda: (lambda obs, extras: (moved(obs), extras))(*reset())
        env.step = lambda actions: (lambda obs, *rest: (moved(obs), *rest))(*step(actions))
        return env
    update = ObsNormalizer.update

    def recorded(self, batch):
        merged.append(batch.detach().double().numpy().copy())
        update(self, batch)
    monkeypatch.setattr(train, "make_env", far_off_env)
    monkeypatch.setattr(ObsNormalizer, "update", recorded)
    model = train.main(small_tracking(tmp_path, iterations=1))[0]
    (batch,) = merged                                   # tracking normalizes the critic's observations only
    assert batch.shape == (16 * 8, model.critic_normalizer.mean64.numel()) and batch.mean() > 1e6 - 100
    stats = model.critic_normalizer
    assert stats.count.item() == len(batch)
    np.testing.assert_allclose(stats.mean64.numpy(), batch.mean(0), rtol=1e-12)
    np.testing.assert_allclose(stats.m2.numpy() / len(batch), batch.var(0), rtol=1e-9, atol=1e-9)


def test_a_finished_run_gives_the_signals_back(tmp_path):
    """Mutant: main() returning with its stop-request handlers still installed. A program that trains and then goes on
    (a sweep, a notebook) must get Ctrl-C back as KeyboardInterrupt and SIGTERM as the default end, not a stop request
    noted for an iteration that never comes."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)          # something else, so that the test sees them set back
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        train.main(small_tracking(tmp_path, iterations=1))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_a_typed_env_task_the_env_does_not_read_is_refused_as_such_on_resume_auto(tmp_path):
    """Mutant: a typed --env.task narrowing `--resume auto`'s search even where the env does not read it. Cart-pole
    has no task: the run is found, and the flag is refused as one that applies only to the simulator adapters, not
    as a missing checkpoint of that task."""
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 8, 8, 1
    cfg.log.root, cfg.log.print_every = str(tmp_path), 100
    train.main(cfg)
    cfg.max_iterations, cfg.resume, cfg.env.task = 2, "auto", "Hopper-v4"
    with pytest.raises(UsageError, match=r"^--env.task applies only with --env.name gymnasium or isaaclab \(the run "
                                         r"uses cartpole\)"):
        train.main(cfg, frozenset({"--env.task", "--resume", "--max-iterations"}))
