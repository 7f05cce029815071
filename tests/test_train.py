"""End to end through train.main: ranks stay bitwise equal, resume works, cartpole learns, and the first merge of
the observation statistics is conditioned by the reset observations."""

import glob
import json
import os

import numpy as np
import pytest
import torch

import train
from configs import preset
from ppo.normalizer import ObsNormalizer
from tests.multirank import run_ranks


def small_tracking(root, iterations=3, **overrides):
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 16, 8, iterations
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (32, 32)
    cfg.log.root, cfg.log.save_every, cfg.log.print_every = str(root), 2, 100
    for key, value in overrides.items():
        assert hasattr(cfg, key), key                 # setattr would add a field nothing reads
        setattr(cfg, key, value)
    return cfg


def train_body(rank, world_size, cfg):
    cfg.dist.device = "cpu"          # gloo ranks on CPU even where a GPU is visible
    model, scalars, _ = train.main(cfg)
    return {k: v.clone() for k, v in model.state_dict().items()}, scalars


@pytest.mark.slow
def test_two_ranks_keep_parameters_bitwise_equal(tmp_path):
    results = run_ranks(train_body, 2, args=(small_tracking(tmp_path, iterations=4),))
    (state0, scalars0), (state1, scalars1) = results
    for key in state0:
        assert torch.equal(state0[key], state1[key]), f"{key} diverged across ranks"
    assert state0["critic_normalizer.count"].item() == 2 * 16 * 8 * 4     # merged over both ranks, 4 iterations
    for key in ("Train/mean_reward", "Loss/surrogate", "Loss/learning_rate", "Policy/kl"):
        assert scalars0[key] == scalars1[key], f"{key}: ranks must log the same reduced value"
    checkpoints = sorted(glob.glob(os.path.join(tmp_path, "tracking", "*", "model_*.pt")))
    assert [os.path.basename(p) for p in checkpoints] == ["model_2.pt", "model_4.pt"]


def test_resume_continues_from_the_saved_iteration_and_state(tmp_path):
    cfg = small_tracking(tmp_path / "a", iterations=2)
    model, _, _ = train.main(cfg)
    (ckpt,) = glob.glob(os.path.join(tmp_path, "a", "tracking", "*", "model_2.pt"))
    saved = torch.load(ckpt, weights_only=True)
    assert saved["iteration"] == 2 and len(saved["rng"]) == 1
    for key, value in model.state_dict().items():
        assert torch.equal(saved["model"][key], value)

    resumed = small_tracking(tmp_path / "b", iterations=3, resume=ckpt)
    model_b, _, _ = train.main(resumed)
    written = glob.glob(os.path.join(tmp_path, "b", "tracking", "*", "model_*.pt"))
    assert [os.path.basename(p) for p in written] == ["model_3.pt"]       # one more iteration, not three
    assert torch.load(written[0], weights_only=True)["iteration"] == 3

    # The optimizer continued rather than restarted: Adam's step count = 3 iterations x E x M steps.
    steps_per_iteration = cfg.ppo.num_epochs * cfg.ppo.num_mini_batches
    final = torch.load(written[0], weights_only=True)
    assert saved["optimizer"]["state"][0]["step"].item() == 2 * steps_per_iteration
    assert final["optimizer"]["state"][0]["step"].item() == 3 * steps_per_iteration
    assert final["config"]["resume"] == ckpt
    # Each start writes what it ran with, readable without torch: from iteration 0, and from 2 in the new directory.
    (first,) = glob.glob(os.path.join(tmp_path, "a", "tracking", "*", "config_*.json"))
    (second,) = glob.glob(os.path.join(tmp_path, "b", "tracking", "*", "config_*.json"))
    assert os.path.basename(first) == "config_0.json" and os.path.basename(second) == "config_2.json"
    assert json.load(open(first))["config"] == json.loads(json.dumps(saved["config"]))
    assert json.load(open(second))["config"]["resume"] == ckpt


def test_a_host_path_checkpoint_resumes_with_capture_step(tmp_path):
    """--ppo.capture-step changes how the step runs, not what is saved: a checkpoint of either resumes in the other."""
    train.main(small_tracking(tmp_path / "a", iterations=2))
    (ckpt,) = glob.glob(os.path.join(tmp_path, "a", "tracking", "*", "model_2.pt"))
    resumed = small_tracking(tmp_path / "b", iterations=3, resume=ckpt)
    resumed.ppo.capture_step = True
    train.main(resumed)
    (written,) = glob.glob(os.path.join(tmp_path, "b", "tracking", "*", "model_3.pt"))
    saved = torch.load(written, weights_only=True)
    final = saved["optimizer"]
    assert final["param_groups"][0]["fused"] is True           # the resumed run's Adam, not the saved one's
    assert isinstance(saved["learning_rate"], float) and saved["learning_rate"] == final["param_groups"][0]["lr"]
    assert isinstance(final["param_groups"][0]["lr"], float)   # exact: on CUDA the tensor the step reads is float32
    assert final["state"][0]["step"].item() == 3 * resumed.ppo.num_epochs * resumed.ppo.num_mini_batches
    back = small_tracking(tmp_path / "c", iterations=4, resume=written)   # and back to the host path
    train.main(back)
    (last,) = glob.glob(os.path.join(tmp_path, "c", "tracking", "*", "model_4.pt"))
    group = torch.load(last, weights_only=True)["optimizer"]["param_groups"][0]
    assert (group["fused"], group["capturable"]) == (True, False)   # the host path's Adam (capturable only on CUDA)


@pytest.mark.slow
def test_cartpole_learns_past_threshold(tmp_path):
    cfg = preset("cartpole")
    cfg.log.root, cfg.log.print_every, cfg.max_iterations = str(tmp_path), 1000, 40
    _, scalars, _ = train.main(cfg)
    # A random policy balances ~20 steps; the time limit is 500.
    assert scalars["Train/mean_episode_length"] > 150


def resume_body(rank, world_size, cfg):
    cfg.dist.device = "cpu"
    model, _, _ = train.main(cfg)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_a_one_rank_checkpoint_resumes_on_two_ranks(tmp_path):
    train.main(small_tracking(tmp_path / "one", iterations=2))
    (ckpt,) = glob.glob(os.path.join(tmp_path, "one", "tracking", "*", "model_2.pt"))
    state0, state1 = run_ranks(resume_body, 2, args=(small_tracking(tmp_path / "two", iterations=3, resume=ckpt),))
    for key in state0:
        assert torch.equal(state0[key], state1[key]), key
    (written,) = glob.glob(os.path.join(tmp_path, "two", "tracking", "*", "model_3.pt"))
    final = torch.load(written, weights_only=True)
    assert final["iteration"] == 3 and len(final["rng"]) == 2
    # The normalizer kept the 1-rank statistics and merged one more iteration from both ranks.
    assert final["model"]["critic_normalizer.count"].item() == 2 * 16 * 8 + 2 * 16 * 8


def test_dry_run_prints_the_plan_and_trains_nothing(tmp_path, capsys):
    cfg = small_tracking(tmp_path, dry_run=True)
    _, scalars, plan = train.main(cfg)
    out = capsys.readouterr().out
    assert scalars == {} and not os.path.exists(tmp_path / "tracking")
    assert "sync plan" in out and "1 rank x 16 envs x 8 steps = 128 transitions per iteration" in out
    # 48*32+32 + 32*32+32 + 32*6+6 (actor) + 73*32+32 + 32*32+32 + 32+1 (critic) + 6 (log std) = 6,285
    assert "[syncppo] actor 48-32-32-6, critic 73-32-32-1 (elu), 6,285 parameters\n" in out
    assert {row.purpose for row in plan} >= {"params", "gradients", "advantages", "normalizer", "metrics"}


def test_resume_restarts_per_env_state_declared_local(tmp_path, monkeypatch):
    cfg = small_tracking(tmp_path / "a", iterations=2)
    cfg.ppo.normalize_rewards = True
    train.main(cfg)
    (ckpt,) = glob.glob(os.path.join(tmp_path, "a", "tracking", "*", "model_2.pt"))
    saved = torch.load(ckpt, weights_only=True)["reward_normalizer"]
    assert saved["returns"].abs().sum() > 0 and saved["count"] > 0      # running returns were saved mid-episode

    loaded = {}
    original = train.restore
    def spy(state, path, stateful, *args):
        iteration = original(state, path, stateful, *args)
        loaded.update({k: v.clone() for k, v in stateful["reward_normalizer"].state_dict().items()})
        return iteration
    monkeypatch.setattr(train, "restore", spy)
    resumed = small_tracking(tmp_path / "b", iterations=3, resume=ckpt)
    resumed.ppo.normalize_rewards = True
    train.main(resumed)
    assert torch.equal(loaded["returns"], torch.zeros_like(saved["returns"]))   # envs restart, so do their returns
    for key in ("count", "mean64", "m2", "std"):                                # merged statistics are restored
        assert torch.equal(loaded[key], saved[key]), key


def test_phase_times_wait_for_the_device(monkeypatch):
    """Perf/collection_time and Perf/learning_time (hence Perf/total_fps and bench_train on a GPU) end once the
    GPU has run what the phase queued: the clock is read after a device sync, on CUDA only."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))
    monkeypatch.setattr(train.time, "time", lambda: events.append(("clock",)) or 123.0)
    assert train.finished(torch.device("cuda:1")) == 123.0
    assert events == [("sync", "cuda:1"), ("clock",)]
    events.clear()
    assert train.finished(torch.device("cpu")) == 123.0
    assert events == [("clock",)]


def resume_on_rank_0_only(rank, world_size, resumed, fresh):
    from dist.errors import UsageError
    try:
        train_body(rank, world_size, resumed if rank == 0 else fresh)
    except UsageError as exc:
        return str(exc)
    return "trained"


@pytest.mark.slow
def test_a_rank_that_cannot_see_the_checkpoint_stops_every_rank_before_anything_is_written(tmp_path):
    """What a node without the shared --log.root does: rank 0 resumes iteration 2, rank 1 starts fresh. Before,
    both trained (rank 1's Adam moments, normalizer and iteration its own) until a collective count differed."""
    train.main(small_tracking(tmp_path / "a", iterations=2))
    (ckpt,) = glob.glob(os.path.join(tmp_path, "a", "tracking", "*", "model_2.pt"))
    resumed = small_tracking(tmp_path / "b", iterations=4, resume=ckpt)
    said = run_ranks(resume_on_rank_0_only, 2, args=(resumed, small_tracking(tmp_path / "b", iterations=4)))
    assert said[0] == said[1] and said[0].startswith("ranks did not load the same checkpoint: rank(s) [0] loaded "
                                                     "iteration 2 (weights checksum ")
    assert "rank(s) [1] loaded no checkpoint" in said[0]
    assert not (tmp_path / "b").exists()


def restart_body(rank, world_size, roots, run_id):
    """A torchrun restart (restart count 1) of job `run_id` on this rank's --log.root: the agreement's error, or
    what train.main returned."""
    from dist.errors import UsageError
    os.environ.update(TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="1")
    try:
        return train_body(rank, world_size, small_tracking(roots[rank], iterations=2))
    except UsageError as exc:
        return str(exc)


@pytest.mark.slow
def test_a_restart_of_a_finished_run_is_done_on_every_rank_or_on_none(tmp_path, monkeypatch, capsys):
    """A torchrun restart whose run already reached --max-iterations trains nothing and says so. When only some
    ranks see that run (a --log.root not shared), the finished ranks used to exit 0 before the process group
    formed, leaving the others waiting out --dist.timeout-s; now the agreement stops every rank at once."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    train.main(small_tracking(tmp_path / "shared", iterations=2))
    (ckpt,) = glob.glob(os.path.join(tmp_path, "shared", "tracking", "*", "model_2.pt"))
    capsys.readouterr()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert train.main(small_tracking(tmp_path / "shared", iterations=2)) == (None, {}, [])
    assert f"[syncppo] {ckpt} already reached --max-iterations 2: done" in capsys.readouterr().out
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    said = run_ranks(restart_body, 2, args=([tmp_path / "shared", tmp_path / "elsewhere"], "job-7"))
    assert said[0] == said[1] and said[0].startswith("ranks did not load the same checkpoint: rank(s) [0] loaded "
                                                     "iteration 2")
    assert "rank(s) [1] loaded no checkpoint" in said[0]


def test_a_run_whose_every_update_step_is_skipped_says_so(tmp_path, capsys):
    """--ppo.entropy-coef 1e30 is within float32 (accepted) but squares to inf in the gradient norm: all 2 epochs x
    2 minibatches = 4 steps of each iteration are skipped, and the console says it instead of training nothing. No
    step, no loss or KL: they are left out (`-` on the console), not logged as 0 (the policy's entropy is ~1.42)."""
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.ppo.num_epochs, cfg.ppo.num_mini_batches = 4, 8, 2, 2
    cfg.ppo.entropy_coef, cfg.max_iterations = 1e30, 2
    cfg.log.root, cfg.dist.device = str(tmp_path), "cpu"
    model, scalars, _ = train.main(cfg)
    out = capsys.readouterr().out
    assert scalars["Train/nonfinite_skipped_steps"] == 4
    assert out.count("[syncppo] warning: 4 of 4 update steps at iteration 1 had a non-finite gradient norm") == 1
    assert [line[-16:] for line in out.splitlines() if line.startswith("it ")] == ["min  skipped 4/4"] * 2
    assert not [key for key in scalars if key.startswith("Loss/") and key != "Loss/learning_rate" or key == "Policy/kl"]
    assert [line.split("kl")[1].split()[0] for line in out.splitlines() if line.startswith("it ")] == ["-"] * 2


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


def test_a_run_leaves_float32_matmuls_at_full_precision(tmp_path):
    """docs/gpu.md: TF32 stays off (torch's default), which nothing here changes, so a GPU run rounds as a CPU run.
    allow_tf32 reflects both torch.backends.cuda.matmul.allow_tf32 and set_float32_matmul_precision("high").

    Mutant: train.main sets torch.backends.cuda.matmul.allow_tf32 = True -> True after the run."""
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
    train.main(small_tracking(tmp_path, iterations=1))
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"


@pytest.mark.slow
def test_config_json_says_how_many_ranks_ran_the_start(tmp_path):
    """A sweep over NPROC: a 1-rank and a 2-rank run of one command wrote the same config_0.json (torchrun's options
    are not in sys.argv), though they train on other batches and seeds (rank r seeds from --seed and r), so the runs
    could not be told apart (found comparing a sweep's runs). Each start now records its world size.
    Mutant: train.py writes config_<k>.json without "world_size" (before the fix).
    Mutant: train.py writes "world_size": 1."""
    run_ranks(train_body, 2, args=(small_tracking(tmp_path / "two", iterations=1),))
    train.main(small_tracking(tmp_path / "one", iterations=1))
    for root, world in (("two", 2), ("one", 1)):
        (written,) = glob.glob(os.path.join(tmp_path, root, "tracking", "*", "config_0.json"))
        assert json.load(open(written))["world_size"] == world
