"""The per-step GPU paths read nothing back to the host: an env step and a rollout step; an update reads once per
minibatch step (the host path) or once in all (--ppo.capture-step), its advantage statistics and normalizer merges
never.

A host read of a device value (`.item()`, a `nonzero`, an error-flag check), or a tensor made from Python
data (a blocking copy to the device), stalls a GPU's launch queue until the device catches up; once per
env step it caps the rollout's throughput. On CPU these tests look
for host-reading ops in the profiler trace; with `SYNCPPO_TEST_DEVICE=cuda` (bench/gpu_check.sh) the same
steps run under `torch.cuda.set_sync_debug_mode("error")`, where any device sync raises.
"""

import os

import pytest
import torch

from dist import comm
from dist.grad_sync import GradSync
from dist.stats import global_mean_std
from envs import CartPole, Tracking
from ppo.actor_critic import ActorCritic
from ppo.env_check import step_checker
from ppo.minibatch_step import build_optimizer
from ppo.normalizer import ObsNormalizer, RewardNormalizer
from ppo.rollout import TRAIN_KEYS, EpisodeStats, collect_rollout, fill_storage
from ppo.storage import RolloutStorage
from ppo.update import ppo_update
from tests.ppo_fixtures import A, N, OBS, T, fill, make_model, ppo_cfg

DEVICE = os.environ.get("SYNCPPO_TEST_DEVICE", "cpu")
HOST_READS = {"aten::_local_scalar_dense", "aten::_linalg_check_errors", "aten::nonzero", "aten::is_nonzero",
              "aten::lift_fresh"}   # a tensor from Python data: on a GPU a blocking host-to-device copy
# Host reads that exist only on CPU: the CPU LU kernel checks its pivots (its CUDA kernel does not), and the
# time-out bootstrap picks the timed-out rows on CPU (on other devices it masks instead; ppo/gae.py).
CPU_ONLY = ("aten::linalg_lu_solve", "bootstrap_time_outs")
# Steps per profiled run: episodes end (and envs reset) from the 3rd step of tracking and the 7th of cartpole, and the
# tests assert that some did; the profiler's events, the tests' time, grow with the steps.
STEPS = 16


def make_env(name: str, num_envs: int = 64):
    if name == "cartpole":
        return CartPole(num_envs, DEVICE, 0)
    return Tracking(num_envs, DEVICE, 0, base_seed=0, num_motions=8)


def host_reads(run) -> list[str]:
    """The host-reading ops `run()` issues, outside the CPU-only ones; on CUDA raises at the first sync."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return []
    with torch.profiler.profile(with_stack=True) as prof:
        run()

    def cpu_only(event):
        while event is not None:
            if any(name in event.name for name in CPU_ONLY):
                return True
            event = event.cpu_parent
        return False

    return sorted({e.name for e in prof.events() if e.name in HOST_READS and not cpu_only(e)})


@pytest.mark.parametrize("name", ["cartpole", "tracking"])
def test_env_step_reads_nothing_back_to_the_host(name):
    env = make_env(name)
    env.reset()
    actions = torch.randn(env.num_envs, env.num_actions, device=DEVICE)

    terminated = []

    def steps():
        for _ in range(STEPS):
            terminated.append(env.step(actions)[2])

    assert host_reads(steps) == [], f"{name}.step reads device values on the host: a device sync per step on a GPU"
    assert torch.stack(terminated).any()      # episodes ended and envs reset within these steps


def test_rollout_step_reads_nothing_back_to_the_host():
    """As train.py runs it: with the env protocol's checks, the episode returns recorded (--log.episode-returns),
    then the batch written into the storage through the reward normalizer and GAE."""
    env = make_env("tracking")
    model = ActorCritic(env.obs_dims["policy"], env.obs_dims["critic"], env.num_actions).to(DEVICE)
    obs = env.reset()[0]
    device = obs["policy"].device                   # indexed, as train.py's (the protocol checks compare devices)
    stats = EpisodeStats(env.num_envs, TRAIN_KEYS + env.log_keys, device)
    storage = RolloutStorage(STEPS, env.num_envs, env.obs_dims, env.num_actions, device)
    rewards = RewardNormalizer(env.num_envs, 0.99, 10.0).to(device)
    check = step_checker(env, "tracking", device, bootstrap=True)

    def rollout():
        batch, _ = collect_rollout(model, env, obs, STEPS, 0.99, True, stats, record_returns=True, check=check)
        fill_storage(storage, batch, model, rewards, 0.99, 0.95)

    reads = host_reads(rollout)
    assert reads == [], "sampling, the critic, the bootstrap, the checks, the episode statistics or the storage's " \
        "rewards and GAE read the device on the host"
    assert len(stats.ended) == STEPS and storage.dones.any()    # the rollout ran, with episodes ending in it


def test_the_update_s_statistics_read_nothing_back_to_the_host(monkeypatch):
    """Every update computes the advantage statistics (global_mean_std, first in ppo_update) and merges the
    normalizers (merge_moments, last); each made its sample count with torch.tensor from a Python number, a blocking
    host-to-device copy on a GPU: a device sync per statistic per update, beside --ppo.capture-step's single read."""
    values = torch.randn(T * N, OBS["critic"], generator=torch.Generator().manual_seed(0)).to(DEVICE)
    monkeypatch.setattr(comm, "_DEVICE", values.device)     # as init_distributed sets it for one process
    observations, rewards = ObsNormalizer(OBS["critic"]).to(DEVICE), RewardNormalizer(N, 0.99, 10.0).to(DEVICE)
    dones = torch.arange(N, device=DEVICE) % 3 == 0
    for t in range(T):
        rewards(values[t * N:(t + 1) * N, 0], dones)

    def statistics():
        global_mean_std(values[:, 0])
        observations.update(values)
        rewards.update()

    assert host_reads(statistics) == []
    assert observations.count.item() == T * N and rewards.count.item() == T * N   # all of it was merged


@pytest.mark.parametrize("capture", [False, True])
def test_an_update_reads_the_device_once_per_step_on_the_host_path_and_once_in_all_sync_free(capture, monkeypatch):
    """The host path reads KL, norm and the loss terms in one read per minibatch step: the terms were read again
    after optimizer.step(), a second drain of the GPU's queue per step. The sync-free step (--ppo.capture-step)
    reads once per update, in finish(). Counted at the Python reads (on CPU the profiler does not see tolist);
    both paths with the fused Adam, which reads nothing from Python (foreach reads its host step counts)."""
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, torch.device(DEVICE))
    fill(storage, 0, model)
    model.to(DEVICE)
    cfg = ppo_cfg(capture_step=capture)
    optimizer = build_optimizer(model.parameters(), ppo_cfg(capture_step=True), torch.device(DEVICE))
    sync = GradSync(model.parameters(), num_extras=2)
    reads = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, _f=original, _n=name: reads.append(_n) or _f(t))
    ppo_update(model, optimizer, storage, sync, cfg, generator=torch.Generator().manual_seed(0))
    assert len(reads) == (1 if capture else cfg.num_epochs * cfg.num_mini_batches), reads
