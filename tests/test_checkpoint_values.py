"""What a checkpoint holds, beyond its types: values a healthy run never saves (nan, inf, a negative Adam
exp_avg_sq) and entries of the right type that still cannot be used (an Adam moment of another shape, an LR that is
not a number, an RNG state that is not a uint8 tensor, hidden sizes that are not ints) are each one UsageError naming
the entry and key, before training starts; `make export` reads a checkpoint through the same checks as --resume.
Saved settings this version does not know are listed at start-up, not dropped silently."""

import glob
import math
import os
import re
import shutil

import pytest
import torch

import train
from configs import preset
from configs.resume import continue_saved_config
from configs.typed_flags import typed_flags
from dist.checkpoint import save_checkpoint
from dist.checkpoint_read import load_checkpoint, nonfinite_entry
from dist.errors import UsageError
from ppo import export
from test_bad_input import flip_a_byte_of_tensor_data
from test_config_errors import cfg_with
from tests.forked_python import run_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A small tracking run with every kind of saved statistics: actor and critic observation normalizers, a reward
# normalizer, Adam's moments and steps, the motion sampler's counts.
SMALL = {"env__num_envs": 16, "ppo__num_steps": 8, "policy__actor_hidden": (16, 16), "policy__critic_hidden": (16,),
         "policy__normalize_actor_obs": True, "ppo__normalize_rewards": True, "log__print_every": 100}
DIVERGED = "the file is damaged or its run diverged"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """The model_1.pt of one training iteration of SMALL (about a second)."""
    root = tmp_path_factory.mktemp("trained")
    train.main(cfg_with(max_iterations=1, log__root=str(root), **SMALL))
    (path,) = glob.glob(str(root / "tracking" / "*" / "model_1.pt"))
    return path


def damaged(trained: str, tmp_path, change) -> str:
    """A copy of `trained` with `change(state)` applied, written as train.py writes (its CRC-32s match)."""
    state = torch.load(trained, weights_only=True)
    change(state)
    path = str(tmp_path / "model_1.pt")
    save_checkpoint(path, state)
    return path


def at(state: dict, keys: tuple):
    """(the dict or list holding state[k0][k1]...[kn], kn)."""
    *parents, last = keys
    for key in parents:
        state = state[key]
    return state, last


def set_last(*keys, value):
    """A change that sets the last element of the tensor (or the float) at state[k0][k1]... to `value`."""
    def change(state):
        node, last = at(state, keys)
        if isinstance(node[last], torch.Tensor):
            node[last].view(-1)[-1] = value
        else:
            node[last] = value
    return change


def replace(*keys, value):
    """A change that puts `value` in place of state[k0][k1]..."""
    def change(state):
        node, last = at(state, keys)
        node[last] = value
    return change


def test_a_healthy_checkpoint_holds_only_finite_values(trained):
    """No false alarm: what a real run saved (normalizer statistics, Adam state, sampler counts, a float LR) passes,
    and the run's statistics are really there to be checked."""
    state = load_checkpoint(trained)
    assert nonfinite_entry(state) == ""
    assert {"actor_normalizer.m2", "critic_normalizer.count"} <= set(state["model"])
    assert state["optimizer"]["state"][0]["step"].item() > 0 and "m2" in state["reward_normalizer"]


def test_integer_tensors_are_exempt_and_every_float_precision_is_checked():
    """Integer buffers (counters) may hold any value; nan is found in bfloat16 too, inf in a 0-dim float64 tensor,
    and a plain float LR is checked as well as a tensor one."""
    assert nonfinite_entry({"model": {"steps": torch.tensor([-5, 2**40]), "flags": torch.tensor([True])}}) == ""
    half = torch.tensor([1.0, math.nan, 2.0], dtype=torch.bfloat16)
    assert nonfinite_entry({"model": {"a": torch.ones(2), "b": half}}) == "nan in its model['b']"
    assert nonfinite_entry({"env": {"c": torch.tensor(-math.inf, dtype=torch.float64)}}) == "inf in its env['c']"
    assert nonfinite_entry({"learning_rate": math.inf}) == "inf in its learning_rate"


NONFINITE = [   # (where, value, what the error says)
    (("model", "actor.0.weight"), math.nan, "nan in its model['actor.0.weight']"),
    (("model", "log_std"), math.inf, "inf in its model['log_std']"),
    (("model", "actor_normalizer.m2"), -math.inf, "inf in its model['actor_normalizer.m2']"),
    (("model", "critic_normalizer.count"), math.nan, "nan in its model['critic_normalizer.count']"),
    (("reward_normalizer", "std"), math.nan, "nan in its reward_normalizer['std']"),
    (("optimizer", "state", 0, "exp_avg"), math.nan, "nan in its optimizer['state'][0]['exp_avg']"),
    (("optimizer", "state", 2, "exp_avg_sq"), -0.5,
     "a negative value (-0.5) in its optimizer['state'][2]['exp_avg_sq'], a mean of squares"),
    (("optimizer", "state", 1, "step"), math.inf, "inf in its optimizer['state'][1]['step']"),
    (("optimizer", "param_groups", 0, "lr"), math.nan, "nan in its optimizer['param_groups'][0]['lr']"),
    (("env", "sampler", "global_counts"), math.nan, "nan in its env['sampler']['global_counts']"),
]


@pytest.mark.parametrize("keys, value, what", NONFINITE, ids=[w.split(" in its ")[-1] for *_, w in NONFINITE])
def test_a_value_a_healthy_run_never_saves_is_refused_by_resume_and_export_alike(trained, tmp_path, keys, value, what):
    """Each entry --resume restores (weights, normalizer statistics, Adam's moments, steps and LR, sampler counts)
    with one nan, inf or negative exp_avg_sq: load_checkpoint names entry and key and says what to do, and export
    refuses the same file with the same words (one check, two readers). These loaded silently, then trained on or
    blamed the env."""
    path = damaged(trained, tmp_path, set_last(*keys, value=value))
    with pytest.raises(UsageError) as resumed:
        load_checkpoint(path)
    assert str(resumed.value) == f"--resume {path!r} has {what}: {DIVERGED}; resume from an earlier model_<k>.pt"
    with pytest.raises(ValueError) as exported:
        export.export(path, str(tmp_path / "out"))
    assert str(exported.value) == f"CKPT {path!r} has {what}: {DIVERGED}; export an earlier model_<k>.pt"
    assert not (tmp_path / "out").exists()


def test_train_says_a_nan_weight_in_one_line_before_anything_is_built(trained, tmp_path, capsys):
    """From train.cli: exit status 2, one line naming the checkpoint's entry (not the env), no run directory."""
    path = damaged(trained, tmp_path, set_last("model", "actor.0.weight", value=math.nan))
    root = tmp_path / "runs"
    assert train.cli(cfg_with(max_iterations=2, resume=path, log__root=str(root), **SMALL)) == 2
    assert capsys.readouterr().err == (f"error: --resume {path!r} has nan in its model['actor.0.weight']: {DIVERGED}; "
                                       f"resume from an earlier model_<k>.pt\n")
    assert not root.exists()


def test_export_checks_the_crc_as_resume_does(trained, tmp_path):
    """A flipped bit of tensor data (the CRC-32 check of --resume): `python -m ppo.export` exits 2 with one line
    naming the damaged member, writes nothing, and --resume refuses the file with the same words."""
    path = tmp_path / "model_1.pt"
    shutil.copy(trained, path)
    flip_a_byte_of_tensor_data(path)
    with pytest.raises(UsageError) as resumed:
        load_checkpoint(str(path))
    damage = str(resumed.value).removeprefix(f"--resume {str(path)!r} is damaged (").split(")")[0]
    assert damage.startswith("archive/data/") and damage.endswith(" does not match its CRC-32")
    result = run_python(["-m", "ppo.export", str(path)], cwd=REPO, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"error: CKPT {str(path)!r} is damaged ({damage}); export another checkpoint\n"
    assert sorted(os.listdir(tmp_path)) == ["model_1.pt"]


# ---- entries of the right type that restore still cannot use --------------------------------------------------

@pytest.mark.parametrize("change, message", [
    (replace("optimizer", "param_groups", 0, "lr", value="abc"),              # was ValueError in restore
     "its optimizer param group 0 has lr 'abc', not a number"),
    (replace("optimizer", "param_groups", 0, "params", value="x"),
     "its optimizer param group 0 is not a dict with a 'params' list of indices"),
    (replace("optimizer", "state", 3, value=[1.0]),
     "its optimizer state for parameter 3 is a list, not a dict"),
    (replace("rng", 0, "torch", value=3),                                      # was AttributeError in restore
     "its rng[0]['torch'] is a int, not an RNG state (a 1-D uint8 tensor)"),
    (replace("rng", 0, "shuffle", value=torch.zeros(5056)),                   # was TypeError in restore
     "its rng[0]['shuffle'] is a torch.float32 tensor of 1 dimension(s), not an RNG state (a 1-D uint8 tensor)"),
    (lambda state: state.update(layout=[1, 1], rollout_rng=[{"torch": torch.zeros(2, 8, dtype=torch.uint8)}]),
     "its rollout_rng[0]['torch'] is a torch.uint8 tensor of 2 dimension(s), not an RNG state"),
    # Sizes no generator has, or a 5056-byte mt19937 state torch refuses: set_rng_state raised in restore.
    (replace("rng", 0, "env", value=torch.zeros(100, dtype=torch.uint8)),
     "its rng[0]['env'] (100 bytes) is not the state of a torch generator"),
    (replace("rng", 0, "torch", value=torch.zeros(16, dtype=torch.uint8)),   # torch's default generator is a CPU one
     "its rng[0]['torch'] (16 bytes) is not the state of a torch generator"),
    (replace("rng", 0, "env", value=torch.tensor([0] * 8 + [6] + [0] * 7, dtype=torch.uint8)),   # a GPU's, at
     "its rng[0]['env'] (16 bytes) is not the state of a torch generator"),   # a Philox offset of 6: not 4k
    (replace("rng", 0, "shuffle", value=torch.zeros(5056, dtype=torch.uint8)),
     "its rng[0]['shuffle'] (5056 bytes) is not the state of a torch generator"),
    (lambda state: state.update(layout=[1, 1], rollout_rng=[{"torch": torch.get_rng_state(),
                                                             "cuda": torch.get_rng_state()}]),
     "its rollout_rng[0]['cuda'] (5056 bytes) is not the state of a torch generator"),
])
def test_an_entry_restore_cannot_use_is_refused_when_the_file_is_read(trained, tmp_path, change, message):
    path = damaged(trained, tmp_path, change)
    with pytest.raises(UsageError, match=f"^--resume .* is damaged \\({re.escape(message)}"):
        load_checkpoint(path)


def test_an_adam_moment_of_another_shape_is_refused_before_the_first_rollout(trained, tmp_path):
    """Adam's load_state_dict does not compare shapes: a one-element exp_avg failed on a broadcast in the first
    update, after a rollout. Now restore refuses it, before the run directory exists. The parameter's shape is
    read from its undamaged exp_avg_sq."""
    shape = list(torch.load(trained, weights_only=True)["optimizer"]["state"][0]["exp_avg_sq"].shape)
    path = damaged(trained, tmp_path, lambda state: state["optimizer"]["state"][0].update(exp_avg=torch.zeros(1)))
    root = tmp_path / "runs"
    expected = f"its optimizer's 'exp_avg' for parameter 0 has shape [1], the parameter {shape}"
    with pytest.raises(UsageError, match=f"^--resume .* is damaged \\({re.escape(expected)}\\); resume from another "
                                         f"checkpoint$"):
        train.main(cfg_with(max_iterations=2, resume=path, log__root=str(root), **SMALL))
    assert not root.exists()


@pytest.mark.parametrize("section, field, saved, shown", [
    ("policy", "actor_hidden", ["a", "b"], "--policy.actor-hidden a b"),      # was TypeError in validate
    ("policy", "critic_hidden", [64, True], "--policy.critic-hidden 64 True"),
    ("policy", "actor_hidden", [64, 64.5], "--policy.actor-hidden 64 64.5"),
    ("env", "actor_obs_groups", ["policy", 3], "--env.actor-obs-groups policy 3"),
])
def test_saved_sequences_whose_elements_do_not_fit_are_refused_by_name(section, field, saved, shown):
    """Each element of a tuple setting is checked, not only that it is a sequence; the preset's own value, saved as
    a list, still fits."""
    flag = shown.split()[0]
    # the env's groups are Isaac Lab's flags: another env does not read them (a bad saved value is then left alone)
    env = {"env__name": "isaaclab"} if section == "env" else {}
    with pytest.raises(UsageError, match=f"^the checkpoint's run has {shown}, which this version does not accept "
                                         f"\\(tuple\\[(int|str), \\.\\.\\.\\]\\); pass {flag} to choose$"):
        continue_saved_config(cfg_with(**env), {section: {field: saved}}, frozenset())
    ours = list(getattr(getattr(cfg_with(**env), section), field))
    continue_saved_config(cfg_with(**env), {section: {field: ours}}, frozenset())


# ---- saved settings this version does not know ------------------------------------------------------------------

def test_saved_settings_this_version_does_not_know_are_listed_not_dropped_silently():
    """A newer version's setting in a known section, in a section of its own, and at the top level: each listed
    after the kept settings, as it would be typed; the known ones are kept as before."""
    saved = {"env": {"name": "tracking"}, "ppo": {"num_epochs": 2, "trust_region": 3},
             "curriculum": {"stage": "hard"}, "future_flag": True, "seed": 4}
    _, kept = continue_saved_config(cfg_with(), saved, frozenset())
    assert kept[-3:] == ["--ppo.trust-region 3 (not known to this version: dropped)",
                         "--curriculum.stage hard (not known to this version: dropped)",
                         "--future-flag (not known to this version: dropped)"]
    assert {"--ppo.num-epochs 2", "--seed 4"} <= set(kept[:-3]) and not [k for k in kept[:-3] if "not known" in k]


def test_the_start_up_line_names_an_unknown_saved_setting(trained, tmp_path, capsys):
    """From the command line (--dry-run), the resume report lists the setting the checkpoint has and this version
    does not."""
    path = damaged(trained, tmp_path, lambda state: state["config"]["ppo"].update(trust_region=3))
    root = str(tmp_path / "runs")
    argv = ["tracking", "--resume", path, "--dry-run", "--max-iterations", "2", "--log.root", root]
    train.main(cfg_with(resume=path, dry_run=True, max_iterations=2, log__root=root), typed_flags(argv))
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "resuming with the settings" in line]
    assert "--ppo.trust-region 3 (not known to this version: dropped)" in line


def test_a_refused_setting_taken_from_the_checkpoint_says_it_came_from_there(trained, tmp_path, capsys):
    """`--ppo.num-epochs must be positive, got 0` read as if typed; the same error for a typed value stays as it was."""
    path = damaged(trained, tmp_path, lambda state: state["config"]["ppo"].update(num_epochs=0))
    root = str(tmp_path / "runs")
    argv = ["tracking", "--resume", path, "--dry-run", "--log.root", root]
    with pytest.raises(UsageError) as exc:
        train.main(cfg_with(resume=path, dry_run=True, log__root=root), typed_flags(argv))
    assert str(exc.value) == (f"--ppo.num-epochs must be positive, got 0 (the value of the checkpoint's run, {path!r}: "
                              f"pass --ppo.num-epochs to change it)")
    with pytest.raises(UsageError) as exc:
        train.main(cfg_with(resume=path, dry_run=True, log__root=root, ppo__num_epochs=0),
                   typed_flags([*argv, "--ppo.num-epochs", "0"]))
    assert str(exc.value) == "--ppo.num-epochs must be positive, got 0"


def test_a_refused_env_split_taken_from_the_checkpoint_says_it_came_from_there(trained, tmp_path):
    """A run saved with --env.global-num-envs, resumed with rollout ranks: the split it refuses was not typed."""
    path = damaged(trained, tmp_path, lambda state: state["config"]["env"].update(global_num_envs=16))
    root = str(tmp_path / "runs")
    argv = ["tracking", "--resume", path, "--dry-run", "--rollout.ranks", "1", "--log.root", root]
    with pytest.raises(UsageError) as exc:
        train.main(cfg_with(resume=path, dry_run=True, log__root=root, rollout__ranks=1), typed_flags(argv))
    assert str(exc.value) == ("--env.global-num-envs with --rollout.ranks: give --env.num-envs per rollout rank "
                              f"instead (--env.global-num-envs 16 is the checkpoint's run's, {path!r}: pass "
                              f"--env.global-num-envs 0 to keep its per-rank --env.num-envs)")
    with pytest.raises(UsageError) as exc:      # as told: refused next only for want of a second rank here
        train.main(cfg_with(resume=path, dry_run=True, log__root=root, rollout__ranks=1, env__global_num_envs=0),
                   typed_flags([*argv, "--env.global-num-envs", "0"]))
    assert str(exc.value).startswith("--rollout.ranks 1 leaves no learner among 1 rank(s)")


def test_a_typed_flag_refused_for_a_setting_taken_from_the_checkpoint_blames_that_setting(trained, tmp_path):
    """--ppo.desired-kl typed to continue a linear-schedule run: the schedule it needs came from the checkpoint."""
    path = damaged(trained, tmp_path, lambda state: state["config"]["ppo"].update(schedule="linear"))
    root = str(tmp_path / "runs")
    argv = ["tracking", "--resume", path, "--dry-run", "--ppo.desired-kl", "0.02", "--log.root", root]
    with pytest.raises(UsageError) as exc:
        train.main(cfg_with(resume=path, dry_run=True, log__root=root, ppo__desired_kl=0.02), typed_flags(argv))
    assert str(exc.value) == ("--ppo.desired-kl applies only with --ppo.schedule adaptive (the run uses linear) (the "
                              f"value of the checkpoint's run, {path!r}: pass --ppo.schedule to change it)")


def refused_resume(trained, tmp_path, team_run) -> tuple[str, str]:
    """(the checkpoint `team_run` edited, the UsageError a --dry-run resume of it gives)."""
    path = damaged(trained, tmp_path, team_run)
    root = str(tmp_path / "runs")
    argv = ["tracking", "--resume", path, "--dry-run", "--log.root", root]
    with pytest.raises(UsageError) as exc:
        train.main(cfg_with(resume=path, dry_run=True, log__root=root), typed_flags(argv))
    return path, str(exc.value)


def test_a_refused_env_count_taken_from_the_checkpoint_names_the_flag_a_resume_can_change(trained, tmp_path):
    """A run of 1 learner + 2 rollout ranks of 2 envs (the learner minibatches 4) resumed colocated: 2 envs per rank
    do not split into 4 minibatches. --env.num-envs is one a resume must keep, so the way out is the minibatch count
    (the error said 'pass --env.num-envs to change it', which the next start refused as not matching the checkpoint)."""
    def team_run(state):
        state["config"]["env"].update(num_envs=2)
        state["config"]["ppo"].update(num_mini_batches=4)    # what a 1 + 2 run saves (its layout aside)
    path, refusal = refused_resume(trained, tmp_path, team_run)
    assert refusal == ("--env.num-envs (2) must be divisible by --ppo.num-mini-batches (4): minibatches are "
                              "whole trajectories, never a silent remainder (--env.num-envs is the checkpoint's run's, "
                              f"{path!r}, which a resume keeps: change --ppo.num-mini-batches)")


def test_a_refused_minibatch_count_taken_from_the_checkpoint_is_named_when_the_error_leads_with_another_flag(
        trained, tmp_path):
    """A 1 + 3 run of the preset's 512 envs per rollout rank (its learner minibatches 1,536 envs in 3) resumed
    colocated: 512 envs do not split into 3. The error leads with --env.num-envs, the preset's value; the 3 came
    from the checkpoint, which the error did not say (only a first flag taken from the checkpoint was blamed)."""
    def team_run(state):
        state["config"]["env"].update(num_envs=preset("tracking").env.num_envs)
        state["config"]["ppo"].update(num_mini_batches=3)
    path, refusal = refused_resume(trained, tmp_path, team_run)
    assert refusal == ("--env.num-envs (512) must be divisible by --ppo.num-mini-batches (3): minibatches are "
                              "whole trajectories, never a silent remainder (--ppo.num-mini-batches 3 is the value of "
                              f"the checkpoint's run, {path!r}: pass --ppo.num-mini-batches to change it)")
    from configs.resume import blame_checkpoint     # a split names --env.global-num-envs as a source, not a cause
    split = "--env.num-envs (2 = --env.global-num-envs 16 / 8 rank(s)) must be divisible by --ppo.num-mini-batches (4)"
    assert blame_checkpoint(error := UsageError(split), ["--env.global-num-envs 16"], "c.pt") is error


def test_a_refused_micro_batch_count_taken_from_the_checkpoint_says_it_came_from_there(trained, tmp_path):
    """The micro-batch error (which once started with words, not its flag) is blamed, not read as if typed."""
    path = damaged(trained, tmp_path, lambda state: state["config"]["ppo"].update(num_micro_batches=3))
    root = str(tmp_path / "runs")
    argv = ["tracking", "--resume", path, "--dry-run", "--log.root", root]
    with pytest.raises(UsageError) as exc:
        train.main(cfg_with(resume=path, dry_run=True, log__root=root), typed_flags(argv))
    saved = torch.load(path, weights_only=True)["config"]            # the whole message: this error, blamed
    minibatch = saved["env"]["num_envs"] * saved["ppo"]["num_steps"] // saved["ppo"]["num_mini_batches"]
    assert minibatch % 3
    assert str(exc.value) == (f"--ppo.num-micro-batches (3) does not divide a minibatch of {minibatch} transitions "
                              f"per rank; micro-batches must be equal for the accumulated gradient to equal the "
                              f"minibatch gradient: use a divisor of {minibatch} (the value of the checkpoint's run, "
                              f"{path!r}: pass --ppo.num-micro-batches to change it)")


def test_a_refused_setting_a_resume_keeps_names_each_other_flag_of_the_error_once():
    """blame_checkpoint alone, on errors whose first flag a resume must keep (MUST_MATCH): the way out is every other
    flag the error names, each once and without its punctuation; never the flag itself, another MUST_MATCH flag, or
    --env.global-num-envs (named by a split as where the per-rank count came from). With no other flag named, only a
    new run can change it (it said "pass --policy.init-noise-std to change it", which the resume then refused)."""
    from configs.resume import blame_checkpoint
    kept = ["--env.num-envs 2", "--env.global-num-envs 16", "--policy.init-noise-std 1e-30", "--ppo.num-epochs 2"]
    split = ("--env.num-envs x --ppo.num-steps (2 = --env.global-num-envs 16 / 8 rank(s) x 4 = 8) must be divisible "
             "by --ppo.num-mini-batches (3)")
    assert str(blame_checkpoint(UsageError(split), kept, "c.pt")) == (
        f"{split} (--env.num-envs is the checkpoint's run's, 'c.pt', which a resume keeps: change --ppo.num-steps or "
        f"--ppo.num-mini-batches)")
    twice = ("--env.num-envs (2) must be divisible by --ppo.num-mini-batches (3); use fewer --ppo.num-mini-batches, "
             "or more --policy.actor-hidden")
    assert str(blame_checkpoint(UsageError(twice), kept, "c.pt")) == (
        f"{twice} (--env.num-envs is the checkpoint's run's, 'c.pt', which a resume keeps: change "
        f"--ppo.num-mini-batches)")
    alone = "--policy.init-noise-std 1e-30: the action variance (its square, or that of a draw 10 std away) is 0 or " \
        "inf in float32"
    blamed = str(blame_checkpoint(UsageError(alone), kept, "c.pt"))
    assert blamed == f"{alone} (--policy.init-noise-std is the checkpoint's run's, 'c.pt', which a resume keeps: " \
                     "start a new run to change it)"
    negative = "--env.num-envs must be positive, got -2"      # "-2" is a number, not a flag to change
    blamed = str(blame_checkpoint(UsageError(negative), ["--env.num-envs -2"], "c.pt"))
    assert blamed == f"{negative} (--env.num-envs is the checkpoint's run's, 'c.pt', which a resume keeps: start a " \
                     "new run to change it)"                  # not "change -2"
    assert blame_checkpoint(error := UsageError("--env.num-envs must be positive, got 0"), [], "c.pt") is error
    # the setting must be that flag: --env.task-overrides taken from the checkpoint is not --env.task
    assert blame_checkpoint(error := UsageError("--env.task X: no such task"), ["--env.task-overrides {}"], "") is error


def test_a_setting_taken_from_the_checkpoint_that_it_does_not_fit_says_it_came_from_there(trained, tmp_path):
    """check_resume_fits's errors were not blamed: `--resume auto --seed 3` of a short run ended with `--max-iterations
    1: ... is already at iteration 1`, a flag never typed; a run saved with a global env budget, resumed on another
    world size, with `--env.global-num-envs 2N gives 2N envs per rank`, the same."""
    def budget(state):
        state["config"]["env"]["global_num_envs"] = 2 * state["config"]["env"]["num_envs"]   # as saved by 2 ranks
    root = str(tmp_path / "runs")
    saved = torch.load(trained, weights_only=True)
    iterations, per_rank = saved["config"]["max_iterations"], saved["config"]["env"]["num_envs"]
    assert iterations == saved["iteration"] and iterations != preset("tracking").max_iterations
    with pytest.raises(UsageError) as exc:
        train.main(cfg_with(resume=trained, dry_run=True, log__root=root, seed=3),
                   typed_flags(["tracking", "--resume", trained, "--dry-run", "--log.root", root, "--seed", "3"]))
    assert str(exc.value).endswith(f"pass a larger --max-iterations to train further (the value of the checkpoint's "
                                   f"run, {trained!r}: pass --max-iterations to change it)")
    path = damaged(trained, tmp_path, budget)
    argv = ["tracking", "--resume", path, "--dry-run", "--log.root", root, "--max-iterations", str(iterations + 1)]
    with pytest.raises(UsageError) as exc:
        train.main(cfg_with(resume=path, dry_run=True, log__root=root, max_iterations=iterations + 1),
                   typed_flags(argv))
    assert str(exc.value) == (f"--env.global-num-envs {2 * per_rank} gives {2 * per_rank} envs per rank on 1 rank(s), "
                              f"the checkpoint {path!r} has {per_rank} per rank; pass --env.global-num-envs {per_rank} "
                              f"to resume it (--env.global-num-envs {2 * per_rank} is the checkpoint's run's)")
