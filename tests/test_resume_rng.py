"""ppo.restore puts back every RNG stream a checkpoint saved, or restarts them all when they cannot fit."""

from types import SimpleNamespace

import torch

from configs.config import Config
from dist.checkpoint import rng_states
from ppo.restore import restore
from rollout_ranks import restore_rollout_rng

ROLES_1 = SimpleNamespace(rank=0, num_learners=1, num_rollouts=0)
ROLLOUT_0 = SimpleNamespace(rank=1, rollout_index=0, num_learners=1, num_rollouts=1)   # 1 learner + 1 rollout rank


class _Env:
    """The two things ppo.restore touches on an env: its generator and load_state_dict."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def load_state_dict(self, state):
        pass


def _checkpoint(rng: dict) -> dict:
    return {"rng": [rng], "layout": [1, 0], "iteration": 4, "env": {}}


def _fake_cuda(monkeypatch) -> list:
    """A GPU generator on a CPU-only machine: get_rng_state gives 16 bytes, set_rng_state records what it got."""
    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.zeros(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state.clone()))
    return restored


def test_resume_restores_the_saved_cuda_rng_state(monkeypatch):
    """On CUDA, actions are sampled from the CUDA generator (Gaussian.sample on cuda tensors); its state is
    saved in every checkpoint (dist.checkpoint.rng_states) and must come back on resume, as the torch
    CPU, shuffle and env states do."""
    cuda_state = torch.arange(16, dtype=torch.uint8)
    restored = _fake_cuda(monkeypatch)
    saved_torch = torch.Generator().manual_seed(11).get_state()
    saved_shuffle = torch.Generator().manual_seed(12).get_state()
    saved_env = torch.Generator().manual_seed(13).get_state()
    env, shuffle = _Env(seed=1), torch.Generator().manual_seed(2)
    before = torch.get_rng_state()
    try:
        restore(_checkpoint({"torch": saved_torch, "shuffle": saved_shuffle, "env": saved_env,
                                   "cuda": cuda_state}), "ckpt.pt", {"env": env}, shuffle, ROLES_1,
                      torch.device("cuda"), Config())
        assert torch.equal(torch.get_rng_state(), saved_torch)
    finally:
        torch.set_rng_state(before)
    assert torch.equal(shuffle.get_state(), saved_shuffle)
    assert torch.equal(env.generator.get_state(), saved_env)
    assert len(restored) == 1 and torch.equal(restored[0], cuda_state)


def test_resume_with_rng_states_of_another_device_restarts_the_streams_instead_of_crashing(capsys):
    """A checkpoint written on a GPU (env generator on cuda: a 16-byte Philox state) resumed on the CPU
    with the same world size: the states do not fit this process's generators. It must restart the RNG
    streams from rank_seed(--seed, rank) and say so (as for another world size), not die with a RuntimeError."""
    cuda_env_state = torch.zeros(16, dtype=torch.uint8)    # what a cuda torch.Generator's get_state() returns
    saved = {"torch": torch.Generator().manual_seed(11).get_state(),
             "shuffle": torch.Generator().manual_seed(12).get_state(), "env": cuda_env_state}
    env, shuffle = _Env(seed=1), torch.Generator().manual_seed(2)
    env_before, shuffle_before, torch_before = env.generator.get_state(), shuffle.get_state(), torch.get_rng_state()
    try:
        restore(_checkpoint(saved), "ckpt.pt", {"env": env}, shuffle, ROLES_1, torch.device("cpu"), Config())
        assert torch.equal(torch.get_rng_state(), torch_before)    # all streams restart together
    finally:
        torch.set_rng_state(torch_before)
    assert torch.equal(env.generator.get_state(), env_before)
    assert torch.equal(shuffle.get_state(), shuffle_before)
    assert "RNG streams restart" in capsys.readouterr().out


def test_rng_states_ask_for_the_cuda_generator_only_on_a_gpu_device(monkeypatch):
    """A CPU rank on a GPU machine (rollout ranks, --dist.device cpu) must not touch CUDA: asking for its RNG
    state opens a context on GPU 0. A GPU rank saves its own device's generator."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda device="cuda": asked.append(device) or torch.ones(16, dtype=torch.uint8))
    assert set(rng_states(_Env(0), torch.Generator(), torch.device("cpu"))) == {"torch", "shuffle", "env"}
    assert asked == []
    on_gpu = rng_states(_Env(0), torch.Generator(), torch.device("cuda:1"))
    assert asked == [torch.device("cuda:1")] and torch.equal(on_gpu["cuda"], torch.ones(16, dtype=torch.uint8))


def test_a_cpu_checkpoint_resumed_on_a_gpu_restarts_every_stream_and_says_so(monkeypatch, capsys):
    """Saved on the CPU there is no GPU generator state; on a GPU, actions are drawn from one. Restoring the CPU
    streams alone (as before) left the sampling stream at its rank_seed(--seed, rank) start while saying nothing."""
    restored = _fake_cuda(monkeypatch)
    saved = {"torch": torch.Generator().manual_seed(11).get_state(),
             "shuffle": torch.Generator().manual_seed(12).get_state(),
             "env": torch.Generator().manual_seed(13).get_state()}
    env, shuffle = _Env(seed=1), torch.Generator().manual_seed(2)
    env_before, torch_before = env.generator.get_state(), torch.get_rng_state()
    try:
        restore(_checkpoint(saved), "ckpt.pt", {"env": env}, shuffle, ROLES_1, torch.device("cuda"), Config())
        assert torch.equal(torch.get_rng_state(), torch_before)
    finally:
        torch.set_rng_state(torch_before)
    assert torch.equal(env.generator.get_state(), env_before) and restored == []
    assert "do not fit this run's generators" in capsys.readouterr().out


def _rollout_checkpoint(states: dict, seed: int = 1) -> dict:
    return {"layout": [1, 1], "rollout_rng": [states], "config": {"seed": seed}}


def test_a_gpu_rollout_rank_saves_and_restores_the_generator_it_samples_from(monkeypatch):
    """A rollout rank on a GPU samples actions from the GPU generator: its checkpoint states hold it (they held the
    CPU and env streams only) and a resume puts all three back."""
    restored = _fake_cuda(monkeypatch)
    env = _Env(seed=1)
    states = rng_states(env, device=torch.device("cuda:0"))
    assert set(states) == {"torch", "env", "cuda"}
    saved = {"torch": torch.Generator().manual_seed(21).get_state(),
             "env": torch.Generator().manual_seed(22).get_state(), "cuda": torch.arange(16, dtype=torch.uint8)}
    cfg = Config(seed=1)
    torch_before = torch.get_rng_state()
    try:
        restore_rollout_rng(_rollout_checkpoint(saved), cfg, ROLLOUT_0, env, torch.device("cuda:0"))
        assert torch.equal(torch.get_rng_state(), saved["torch"])
    finally:
        torch.set_rng_state(torch_before)
    assert torch.equal(env.generator.get_state(), saved["env"])
    assert len(restored) == 1 and torch.equal(restored[0], saved["cuda"])


def test_a_rollout_rank_given_states_of_another_device_restarts_its_streams_instead_of_crashing(capsys):
    """A checkpoint of GPU rollout ranks (16-byte env and cuda states) resumed on CPU rollout ranks: set_state
    raised a RuntimeError on the rollout rank. Now its streams restart and rollout rank 0 says so."""
    env = _Env(seed=1)
    saved = {"torch": torch.Generator().manual_seed(21).get_state(), "env": torch.zeros(16, dtype=torch.uint8),
             "cuda": torch.zeros(16, dtype=torch.uint8)}
    env_before, torch_before = env.generator.get_state(), torch.get_rng_state()
    try:
        restore_rollout_rng(_rollout_checkpoint(saved), Config(seed=1), ROLLOUT_0, env, torch.device("cpu"))
        assert torch.equal(torch.get_rng_state(), torch_before)
    finally:
        torch.set_rng_state(torch_before)
    assert torch.equal(env.generator.get_state(), env_before)
    assert "their streams restart" in capsys.readouterr().out


def test_a_gpu_checkpoint_whose_cpu_streams_fit_still_restarts_every_stream_on_the_cpu(capsys):
    """Saved on a GPU with CPU-side env and shuffle generators: the torch, shuffle and env states have the CPU sizes,
    plus the GPU generator's state that actions were drawn from. On the CPU there is no such generator: the states
    are not the same set, so every stream restarts (and says so) rather than resuming three of the four."""
    saved = {"torch": torch.Generator().manual_seed(11).get_state(),
             "shuffle": torch.Generator().manual_seed(12).get_state(),
             "env": torch.Generator().manual_seed(13).get_state(), "cuda": torch.arange(16, dtype=torch.uint8)}
    env, shuffle = _Env(seed=1), torch.Generator().manual_seed(2)
    env_before, shuffle_before, torch_before = env.generator.get_state(), shuffle.get_state(), torch.get_rng_state()
    try:
        restore(_checkpoint(saved), "ckpt.pt", {"env": env}, shuffle, ROLES_1, torch.device("cpu"), Config())
        assert torch.equal(torch.get_rng_state(), torch_before)
    finally:
        torch.set_rng_state(torch_before)
    assert torch.equal(env.generator.get_state(), env_before)
    assert torch.equal(shuffle.get_state(), shuffle_before)
    assert "do not fit this run's generators" in capsys.readouterr().out
