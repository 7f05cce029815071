"""What a resumed run takes from its flags and what from the checkpoint: the optimizer's eps always from the
flags, its LR from the checkpoint only where it is the adaptive schedule's state (an adaptive run resumed adaptive
with its own LR: a restart with the same command line continues the adapted LR exactly), and a policy's start
(init std, orthogonal init) never: a checkpoint replaces it, so a flag that asks for another one is refused. A
--seed other than the checkpoint run's restarts the RNG streams from it; what the envs share (the tracking motion
library) stays the checkpoint's. A restored reward normalizer takes the checkpoint's merged statistics and keeps its
own per-env running returns; a fixed schedule's LR line names the checkpoint's LR only where it differs; an env state
lacking a key the env reads is one UsageError.
From the command line, everything not typed (launch settings aside) continues the checkpoint run's settings."""

import glob

import pytest
import torch

import train
from envs.motions import MotionLibrary
from dist.errors import UsageError
from configs.resume import continue_saved_config, resume_command
from configs.typed_flags import typed_flags
from dist.checkpoint import rng_states
from ppo.minibatch_step import saved_state_for
from ppo.normalizer import RewardNormalizer
from ppo.restore import restore, resumed_lr
from tests.test_config_errors import cfg_with
from tests.test_restore import CPU, N, _built, _checkpoint, _roles, _run


def test_saved_state_for_replaces_the_named_settings_and_keeps_the_state():
    params = [torch.nn.Parameter(torch.tensor([1.0, -2.0]))]
    before = torch.optim.Adam(params, lr=1e-3, eps=1e-8, foreach=True)
    params[0].grad = torch.tensor([0.5, 0.25])
    before.step()
    saved = before.state_dict()
    after = torch.optim.Adam(params, lr=7.0, eps=7.0, foreach=True)
    after.load_state_dict(saved_state_for(after, saved, {"eps": 1e-5}))
    assert after.param_groups[0]["eps"] == 1e-5 and after.param_groups[0]["lr"] == 1e-3   # saved LR, new eps
    after.load_state_dict(saved_state_for(after, saved, {"lr": 5e-4}))
    assert after.param_groups[0]["lr"] == 5e-4 and after.param_groups[0]["eps"] == 1e-8
    assert torch.equal(after.state_dict()["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])
    assert after.state_dict()["state"][0]["step"].item() == 1


def saved_run(tmp_path, **changes):
    cfg = cfg_with(env__num_envs=16, ppo__num_steps=8, max_iterations=2, log__root=str(tmp_path / "a"),
                   log__print_every=100, **changes)
    train.main(cfg)
    (ckpt,) = glob.glob(str(tmp_path / "a" / "tracking" / "*" / "model_2.pt"))
    return ckpt, torch.load(ckpt, weights_only=True)


def resumed_optimizer(tmp_path, ckpt, name, **changes):
    """One more iteration from `ckpt`; the optimizer settings it saved (under the fixed schedule the LR it
    ran with)."""
    train.main(cfg_with(env__num_envs=16, ppo__num_steps=8, max_iterations=3, resume=ckpt,
                        log__root=str(tmp_path / name), log__print_every=100, **changes))
    (written,) = glob.glob(str(tmp_path / name / "tracking" / "*" / "model_3.pt"))
    return torch.load(written, weights_only=True)["optimizer"]["param_groups"][0]


def first_update_lr(tmp_path, monkeypatch, ckpt, name, **changes):
    """The LR the first resumed update starts with (the adaptive schedule moves it during that update), and the
    optimizer settings the resumed run saved."""
    seen, update = [], train.ppo_update

    def recording_update(model, optimizer, *args, **kwargs):
        seen.append(float(optimizer.param_groups[0]["lr"]))
        return update(model, optimizer, *args, **kwargs)

    monkeypatch.setattr(train, "ppo_update", recording_update)
    group = resumed_optimizer(tmp_path, ckpt, name, **changes)
    return seen[0], group


def test_a_resumed_run_takes_a_new_lr_and_eps_and_keeps_the_adapted_lr_otherwise(tmp_path, monkeypatch, capsys):
    ckpt, saved = saved_run(tmp_path, ppo__learning_rate=1e-3)
    adapted = saved["optimizer"]["param_groups"][0]["lr"]
    assert adapted != 1e-3                           # the adaptive schedule moved it in 2 iterations
    lr, same = first_update_lr(tmp_path, monkeypatch, ckpt, "same", ppo__learning_rate=1e-3)
    assert lr == adapted and same["eps"] == saved["optimizer"]["param_groups"][0]["eps"]
    assert (f"the LR continues at {adapted:.4g}, where the checkpoint's adaptive schedule left it (its run started "
            f"at 0.001; ") in capsys.readouterr().out
    lr, new = first_update_lr(tmp_path, monkeypatch, ckpt, "new", ppo__learning_rate=2e-4, ppo__adam_eps=1e-5)
    assert lr == 2e-4 and new["eps"] == 1e-5
    assert f"--ppo.learning-rate 0.0002 replaces the checkpoint's LR {adapted:.4g} (its run started at 0.001)" in \
        capsys.readouterr().out


@pytest.mark.parametrize("before, after", [("adaptive", "fixed"), ("linear", "adaptive"), ("adaptive", "linear")])
def test_a_schedule_other_than_the_checkpoints_starts_as_a_new_run_of_it_would(tmp_path, monkeypatch, capsys,
                                                                              before, after):
    """The checkpoint's LR is where its schedule left it: the adaptive schedule's state, the linear one's value at
    iteration 2 of 2 (0). Another schedule starts from --ppo.learning-rate as in a new run; --ppo.schedule fixed
    had continued at the adapted LR, not at the --ppo.learning-rate its config then recorded."""
    ckpt, saved = saved_run(tmp_path, ppo__learning_rate=1e-3, ppo__schedule=before)
    left = saved["optimizer"]["param_groups"][0]["lr"]
    assert left != 1e-3
    capsys.readouterr()
    lr, _ = first_update_lr(tmp_path, monkeypatch, ckpt, "other", ppo__learning_rate=1e-3, ppo__schedule=after)
    assert lr == (1e-3 * (1.0 - 2 / 3) if after == "linear" else 1e-3)     # iteration 3 of 3 starts at 2/3 annealed
    out = capsys.readouterr().out
    expected = {"fixed": "--ppo.schedule fixed: the LR is --ppo.learning-rate 0.001 (",
                "adaptive": "--ppo.schedule adaptive (the checkpoint's run: linear) starts from --ppo.learning-rate "
                            "0.001, as a new run would (",
                "linear": f"--ppo.schedule linear (the checkpoint's run: adaptive) anneals the LR from "
                          f"--ppo.learning-rate 0.001 to 0 at --max-iterations 3, as a new run would: iteration 3 runs "
                          f"at LR {1e-3 / 3:.4g} ("}[after]
    assert expected + f"the checkpoint's LR {left:.4g} was its {before} schedule's)" in out


def test_a_resume_with_another_max_iterations_says_where_the_linear_lr_jumps(tmp_path, capsys):
    """The linear schedule anneals to 0 at --max-iterations: resuming with another one moves the LR at once (here
    from 0, the end of a 2-iteration run, to 1/3 of the start for 3). The start-up says so with both values."""
    ckpt, _ = saved_run(tmp_path, ppo__learning_rate=1e-3, ppo__schedule="linear")
    capsys.readouterr()
    resumed = resumed_optimizer(tmp_path, ckpt, "longer", ppo__learning_rate=1e-3, ppo__schedule="linear")
    assert resumed["lr"] == 1e-3 * (1.0 - 2 / 3)          # what iteration 3, the first resumed one, ran with
    out = capsys.readouterr().out
    assert (f"the linear LR re-anneals from --ppo.learning-rate 0.001 to 0 at --max-iterations 3 (the checkpoint's "
            f"run: --max-iterations 2): iteration 3 runs at LR {1e-3 / 3:.4g}, not 0") in out
    # the iteration it names is the console's: the line `it 3/3` shows that LR (it had said iteration 2, the
    # checkpoint's last, in the loop's 0-based count)
    (line,) = [line for line in out.splitlines() if line.startswith("it ")]
    assert line.split()[1] == "3/3" and f"lr {1e-3 / 3:.1e}" in line


@pytest.mark.parametrize("flag, change", [("--policy.init-noise-std", {"policy__init_noise_std": 0.3}),
                                          ("--policy.orthogonal-init", {"policy__orthogonal_init": True})])
def test_a_resumed_run_refuses_another_policy_start(tmp_path, flag, change):
    ckpt, _ = saved_run(tmp_path)
    with pytest.raises(UsageError, match=f"^{flag}.* does not match the checkpoint's --policy\\."):
        train.main(cfg_with(env__num_envs=16, ppo__num_steps=8, max_iterations=3, resume=ckpt,
                            log__root=str(tmp_path / "b"), **change))


def test_a_global_env_count_that_does_not_fit_names_the_global_count_that_does(tmp_path):
    ckpt, _ = saved_run(tmp_path)                     # 16 envs per rank, one rank
    with pytest.raises(UsageError, match=r"--env.global-num-envs 32 gives 32 envs per rank on 1 rank\(s\), the "
                                         r"checkpoint .* has 16 per rank; pass --env.global-num-envs 16 to resume it"):
        train.main(cfg_with(env__global_num_envs=32, ppo__num_steps=8, max_iterations=3, resume=ckpt,
                            log__root=str(tmp_path / "b")))


def test_a_new_seed_on_resume_restarts_the_rng_streams_and_keeps_the_motion_library(tmp_path, monkeypatch, capsys):
    ckpt, saved = saved_run(tmp_path, seed=1)
    built, restored = [], []
    make_env, restore = train.make_env, train.restore

    def recording_make_env(*args, **kwargs):
        built.append(make_env(*args, **kwargs))
        return built[-1]

    def recording_restore(*args):
        before = torch.get_rng_state()                # the stream seeded from rank_seed(--seed, rank)
        restore(*args)
        restored.append((before, torch.get_rng_state()))

    monkeypatch.setattr(train, "make_env", recording_make_env)
    monkeypatch.setattr(train, "restore", recording_restore)
    for seed in (1, 2):
        train.main(cfg_with(env__num_envs=16, ppo__num_steps=8, max_iterations=3, resume=ckpt, seed=seed,
                            log__root=str(tmp_path / f"seed{seed}"), log__print_every=100))
    assert torch.equal(restored[0][1], saved["rng"][0]["torch"])     # same --seed: the saved streams continue
    before, after = restored[1]                                  # another: they restart from rank_seed(--seed, rank)
    assert torch.equal(after, before) and not torch.equal(after, saved["rng"][0]["torch"])
    assert "--seed 2 is not the checkpoint run's (1): RNG streams restart" in capsys.readouterr().out
    # The seed-2 run saves the seed its motions came from; resuming that checkpoint (its config says seed 2) must
    # not regenerate them from 2 (a torchrun restart of the resumed run would have switched motions mid-run).
    (reseeded,) = glob.glob(str(tmp_path / "seed2" / "tracking" / "*" / "model_3.pt"))
    assert torch.load(reseeded, weights_only=True)["env_seed"] == 1
    train.main(cfg_with(env__num_envs=16, ppo__num_steps=8, max_iterations=4, resume=reseeded, seed=2,
                        log__root=str(tmp_path / "again"), log__print_every=100))
    library = MotionLibrary(built[1].motions.duration.numel(), built[1].num_joints, 1, torch.device("cpu"))
    assert len(built) == 3
    for env in built:                                 # the checkpoint run's motions, which its policy learned
        assert torch.equal(env.motions.sines, library.sines) and torch.equal(env.motions.bias, library.bias)


def test_a_resume_from_the_command_line_continues_the_runs_settings_and_takes_only_the_typed_flags(tmp_path, capsys):
    """Not the preset's defaults: `--resume auto` after a stop must go on with the run's own batch size, entropy
    bonus and seed, while a typed flag changes its setting and is listed, and launch settings (where runs go)
    come from this command line."""
    ckpt, _ = saved_run(tmp_path, ppo__entropy_coef=0.02, ppo__num_epochs=2, seed=3)
    root = str(tmp_path / "b")
    argv = ["tracking", "--resume", ckpt, "--max-iterations", "3", "--ppo.num-epochs", "4", "--log.root", root]
    train.main(cfg_with(resume=ckpt, max_iterations=3, ppo__num_epochs=4, log__root=root), typed_flags(argv))
    (written,) = glob.glob(str(tmp_path / "b" / "tracking" / "*" / "model_3.pt"))
    config = torch.load(written, weights_only=True)["config"]
    assert config["ppo"]["entropy_coef"] == 0.02 and config["seed"] == 3          # the preset has 0.005 and 1
    assert config["env"]["num_envs"] == 16 and config["ppo"]["num_steps"] == 8     # the preset: 512 x 24
    assert config["log"]["print_every"] == 100 and config["ppo"]["num_epochs"] == 4 and config["log"]["root"] == root
    out = capsys.readouterr().out
    assert "'s run (unlike the preset: --env.num-envs 16, --ppo.num-steps 8, --ppo.entropy-coef 0.02, " \
           "--log.print-every 100, --seed 3); changed by this command line: --ppo.num-epochs 4 (the checkpoint's " \
           "run: --ppo.num-epochs 2), --max-iterations 3 (the checkpoint's run: --max-iterations 2)\n" in out


def test_typed_flags_are_checked_against_the_settings_the_run_continues_with(tmp_path):
    """--ppo.reward-clip applies only with reward normalization: on resume that is the checkpoint run's setting,
    not the preset's (which does not normalize rewards), so the flag must be accepted and applied."""
    ckpt, _ = saved_run(tmp_path, ppo__normalize_rewards=True)
    root = str(tmp_path / "b")
    argv = ["tracking", "--resume", ckpt, "--max-iterations", "3", "--ppo.reward-clip", "5", "--log.root", root]
    train.main(cfg_with(resume=ckpt, max_iterations=3, ppo__reward_clip=5.0, log__root=root), typed_flags(argv))
    (written,) = glob.glob(str(tmp_path / "b" / "tracking" / "*" / "model_3.pt"))
    ppo = torch.load(written, weights_only=True)["config"]["ppo"]
    assert ppo["normalize_rewards"] is True and ppo["reward_clip"] == 5.0


def test_continue_saved_config_by_field_kind():
    """Launch settings stay this command line's (layout, transport, Kit's flags); how rollout ranks collect is
    the run's; a field the checkpoint's version lacked takes its default, not the preset's value; a saved value
    this version does not accept is refused by name; another env kind is refused before anything is taken."""
    cfg = cfg_with(ppo__entropy_coef=0.3)            # stands for a preset whose value differs from the default
    saved = {"env": {"name": "tracking", "launcher_args": "--viz kit", "num_motions": 8},
             "rollout": {"ranks": 3, "mode": "async", "dtype": "bfloat16"}, "dist": {"backend": "nccl"},
             "ppo": {"num_epochs": 2}, "log": {"root": "/elsewhere"}, "seed": 7}
    typed = frozenset({"--ppo.num-epochs"})          # as if `--ppo.num-epochs 5` was typed
    changed, kept = continue_saved_config(cfg, saved, typed)
    assert changed == ["--ppo.num-epochs 5 (the checkpoint's run: --ppo.num-epochs 2)"]
    assert {"--env.num-motions 8", "--ppo.entropy-coef 0.005", "--seed 7"} <= set(kept)   # what differs from `cfg`
    # (the preset); launch settings are not; how rollout ranks collect is kept, and said to be unread on 0 of them
    assert {"--rollout.mode async (not read by this run)",
            "--rollout.dtype bfloat16 (not read by this run)"} <= set(kept)
    assert not [k for k in kept if k.startswith(("--rollout.ranks", "--dist.", "--env.launcher", "--log.root"))]
    assert cfg.ppo.num_epochs == 5
    assert (cfg.rollout.mode, cfg.rollout.dtype, cfg.rollout.ranks) == ("async", "bfloat16", 0)
    assert (cfg.dist.backend, cfg.env.launcher_args, cfg.log.root) == ("auto", "", "runs")
    assert (cfg.env.num_motions, cfg.seed, cfg.ppo.entropy_coef) == (8, 7, 0.005)
    with pytest.raises(UsageError, match=r"^the checkpoint's run has --ppo.schedule cosine, which this version does "
                                         r"not accept .*; pass --ppo.schedule to choose$"):
        continue_saved_config(cfg_with(), {"ppo": {"schedule": "cosine"}}, frozenset())
    with pytest.raises(UsageError, match=r"^the checkpoint's run has --ppo.num-epochs 5.0, "):
        continue_saved_config(cfg_with(), {"ppo": {"num_epochs": 5.0}}, frozenset())
    with pytest.raises(UsageError, match=r"^--env.name cartpole does not match the checkpoint's --env.name tracking: "
                                         r"resume it with the preset it was trained with"):
        continue_saved_config(cfg_with(env__name="cartpole"), {"env": {"name": "tracking"}}, frozenset())


@pytest.mark.parametrize("typed", ["--env.num-envs", "--env.global-num-envs"])
def test_either_env_count_flag_typed_keeps_both_count_fields_of_this_command_line(typed):
    """--env.num-envs and --env.global-num-envs are one setting in two fields: typing either keeps both as this
    command line has them (the other is not taken from the checkpoint), and the start-up lists the count as
    changed from the form the checkpoint's run had it in."""
    cfg = cfg_with(env__num_envs=16, env__global_num_envs=64 if typed == "--env.global-num-envs" else 0)
    saved = {"env": {"num_envs": 8, "global_num_envs": 32 if typed == "--env.num-envs" else 0}}
    changed, kept = continue_saved_config(cfg, saved, frozenset({typed}))
    assert (cfg.env.num_envs, cfg.env.global_num_envs) == ((16, 64) if typed == "--env.global-num-envs" else (16, 0))
    assert [s for s in changed + kept if "num-envs" in s] == [
        "--env.num-envs 16 (the checkpoint's run: --env.global-num-envs 32)" if typed == "--env.num-envs" else
        "--env.global-num-envs 64 (the checkpoint's run: --env.num-envs 8)"]


def test_a_typed_env_count_equal_to_the_checkpoints_is_not_listed_as_changed():
    cfg = cfg_with(env__num_envs=16, env__global_num_envs=32)
    changed, kept = continue_saved_config(cfg, {"env": {"num_envs": 8, "global_num_envs": 32}},
                                          frozenset({"--env.global-num-envs"}))
    assert not [s for s in changed + kept if "num-envs" in s]


def test_the_resume_command_is_this_run_s_own_with_its_directory():
    argv = ["cartpole", "--resume", "auto", "--seed", "3", "--resume=x.pt", "--log.root", "my runs"]
    assert resume_command(argv, "/r/cartpole/2026") == \
        "train.py cartpole --seed 3 --log.root 'my runs' --resume /r/cartpole/2026"


def test_a_typed_global_env_count_of_0_continues_the_checkpoints_per_rank_count():
    """`--env.global-num-envs 0` (what a refused global split of the checkpoint's run asks for) turns the split off;
    the per-rank count it leaves to --env.num-envs is the checkpoint run's, not the preset's, which no resume fits."""
    cfg = cfg_with(env__num_envs=512, env__global_num_envs=0)
    changed, kept = continue_saved_config(cfg, {"env": {"num_envs": 16, "global_num_envs": 32}},
                                          frozenset({"--env.global-num-envs"}))
    assert (cfg.env.num_envs, cfg.env.global_num_envs) == (16, 0)
    assert "--env.global-num-envs 0 (the checkpoint's run: --env.global-num-envs 32)" in changed
    assert "--env.num-envs 16" in kept


def test_a_restored_reward_normalizer_keeps_its_running_returns_and_takes_the_saved_statistics():
    """The checkpoint's count, mean, M2 and std (rule `merge`) are restored; the per-env discounted returns (rule
    `local`) stay the fresh run's zeros, as its envs restart their episodes rather than continue the saved ones."""
    saved_norm = RewardNormalizer(N, 0.99, 10.0)
    saved_norm.returns.fill_(7.0)
    saved_norm.count.fill_(12.0)
    saved_norm.mean64.fill_(2.5)
    saved_norm.m2.fill_(30.0)
    saved_norm.std.fill_(1.5)
    built = _built(reward_normalizer=True)
    built["reward_normalizer"] = saved_norm
    saved = _checkpoint(built, [rng_states()])
    fresh = _built(reward_normalizer=True)
    restore(saved, "c.pt", fresh, None, _roles(), CPU, _run())
    norm = fresh["reward_normalizer"]
    assert torch.equal(norm.returns, torch.zeros(N))
    assert (norm.count.item(), norm.mean64.tolist(), norm.m2.tolist(), norm.std.item()) == (12.0, [2.5], [30.0], 1.5)


@pytest.mark.parametrize("restored, said", [(1e-3, ""), (3e-4, " (the checkpoint's LR was 0.0003)")])
def test_a_fixed_schedule_resume_names_the_checkpoint_s_lr_only_where_it_differs(restored, said):
    """--ppo.schedule fixed runs at --ppo.learning-rate 1e-3 whatever the checkpoint's LR; the line adds that LR only
    when it was another one (an adaptive LR 3e-4 under the fixed run's own --ppo.learning-rate, say)."""
    cfg = _run(ppo__schedule="fixed", ppo__learning_rate=1e-3, max_iterations=8)
    lr, line = resumed_lr(cfg, {"ppo": {"learning_rate": 1e-3, "schedule": "fixed"}}, restored, 2)
    assert lr == 1e-3 and line == "--ppo.schedule fixed: the LR is --ppo.learning-rate 0.001" + said


def test_an_env_state_without_a_key_the_env_reads_is_one_usage_error_naming_the_env():
    """An env's load_state_dict reads its entries by key: one missing (another env's state, an older version's) is
    the KeyError restore turns into its one-line refusal, like a model or optimizer that does not fit; the state
    that fits is loaded into the env."""
    class KeyedEnv:
        generator = torch.Generator()

        def state_dict(self):
            return {"counts": torch.zeros(3)}

        def load_state_dict(self, state):
            self.counts = state["counts"]
    built = {**_built(), "env": KeyedEnv()}
    saved = _checkpoint(built, [rng_states(built["env"])], env={"visits": torch.zeros(3)})
    with pytest.raises(UsageError, match=r"^--resume 'c\.pt': its env does not fit this run \(other env or "
                                         r"--policy\.\* sizes, or code changed since the save\?\): .*counts"):
        restore(saved, "c.pt", {**_built(), "env": KeyedEnv()}, None, _roles(), CPU, _run())
    env = KeyedEnv()
    restore({**saved, "env": {"counts": torch.tensor([1.0, 2.0, 3.0])}}, "c.pt", {**_built(), "env": env}, None,
            _roles(), CPU, _run())
    assert env.counts.tolist() == [1.0, 2.0, 3.0]          # the sampler counts the checkpoint holds
