"""Bad input fails before anything is built, with a message naming the flag to fix."""

import contextlib
import glob
import os
import re

import pytest
import torch

import train
from configs import preset, resolve_num_envs, validate
from dist.errors import RunError, UsageError
from ppo.logger import RunLogger
from ppo.normalizer import ObsNormalizer
from tests.forked_python import run_python
from tests.read_only import read_only_folder


def cfg_with(**changes):
    cfg = preset("tracking")
    for dotted, value in changes.items():
        section, field = dotted.split("__") if "__" in dotted else (None, dotted)
        assert hasattr(getattr(cfg, section) if section else cfg, field), dotted   # else a field nothing reads
        setattr(getattr(cfg, section) if section else cfg, field, value)
    return cfg


@pytest.mark.parametrize("changes, flag", [
    ({"env__num_envs": 510}, "--env.num-envs"),                 # not divisible by 4 minibatches
    ({"env__num_envs": 0}, "--env.num-envs"),
    ({"ppo__num_steps": -1}, "--ppo.num-steps"),
    ({"ppo__num_mini_batches": 0}, "--ppo.num-mini-batches"),
    ({"ppo__num_epochs": 0}, "--ppo.num-epochs"),
    ({"max_iterations": 0}, "--max-iterations"),
    ({"ppo__gamma": 1.5}, "--ppo.gamma"),
    ({"ppo__lam": -0.1}, "--ppo.lam"),
    ({"ppo__learning_rate": 1.0}, "--ppo.learning-rate"),
    ({"policy__actor_hidden": (64, 0)}, "--policy.actor-hidden"),
    ({"ppo__num_micro_batches": 5}, "--ppo.num-micro-batches"),   # 512 x 24 / 4 = 3072 transitions, not / 5
    ({"dist__bucket_mb": 0.0}, "--dist.bucket-mb"),
    ({"dist__verify_every": -1}, "--dist.verify-every"),
    ({"dist__sampler_sync_every": 0}, "--dist.sampler-sync-every"),
])
def test_bad_values_name_the_flag(changes, flag):
    with pytest.raises(ValueError, match=flag.replace(".", r"\.")):
        validate(cfg_with(**changes))


def test_global_env_budget_splits_across_ranks_or_fails():
    cfg = cfg_with(env__global_num_envs=1024)
    assert "512 per rank" in resolve_num_envs(cfg, 2) and cfg.env.num_envs == 512
    with pytest.raises(ValueError, match="--env.global-num-envs 1000 is not divisible by the world size 3"):
        resolve_num_envs(cfg_with(env__global_num_envs=1000), 3)
    per_rank = cfg_with()
    assert "per rank" in resolve_num_envs(per_rank, 4) and per_rank.env.num_envs == 512


def test_env_scope_line_with_rollout_ranks_says_per_rollout_rank():
    # a learner runs no envs: the count is each rollout rank's (the start-up line said "per rank")
    assert resolve_num_envs(cfg_with(rollout__ranks=2), 3) == "--env.num-envs 512 is per rollout rank"
    assert resolve_num_envs(cfg_with(rollout__ranks=1), 2) == "--env.num-envs 512 is per rollout rank"
    assert resolve_num_envs(cfg_with(), 3) == "--env.num-envs 512 is per rank"


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_resume_path_errors(tmp_path):
    with pytest.raises(UsageError, match=r"^--resume .* does not exist; pass an existing model_<iteration>.pt file, "
                                         r"a run directory, or auto$"):
        train.main(cfg_with(resume=str(tmp_path / "missing.pt")))
    (tmp_path / "loop.pt").symlink_to(tmp_path / "loop.pt")
    (tmp_path / "dangling.pt").symlink_to(tmp_path / "missing.pt")
    for link in ("loop.pt", "dangling.pt"):
        with pytest.raises(UsageError, match=r"--resume .* is a symbolic link whose target does not exist \(or that "
                                             r"loops\); pass an existing model_<iteration>.pt file, a run "
                                             r"directory, or auto$"):
            train.main(cfg_with(resume=str(tmp_path / link)))
    # A directory is a run to continue: one without a checkpoint says so (a bare "directory" also matched
    # load_checkpoint's "is a directory; pass a model_<iteration>.pt file inside it", which denies run directories).
    with pytest.raises(ValueError, match=r"is a directory without a model_<iteration>.pt checkpoint; pass a run "
                                         r"directory that has one, a checkpoint file, or auto$"):
        train.main(cfg_with(resume=str(tmp_path)))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"is not a torch checkpoint \(torch.save writes a zip archive; this file is "
                                         r"not one\): pass a model_<iteration>.pt file train.py wrote$"):
        train.main(cfg_with(resume=str(garbage)))
    truncated = tmp_path / "truncated.pt"
    torch.save({"iteration": 3}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"is a truncated or damaged checkpoint \(its zip archive does not end\)"):
        train.main(cfg_with(resume=str(truncated)))
    exported = tmp_path / "model_3.policy.pt"
    torch.jit.script(torch.nn.Linear(2, 1)).save(str(exported))
    with pytest.raises(ValueError, match=r"is an exported policy \(TorchScript\), not a training checkpoint: pass the "
                                         r"model_<k>.pt it was exported from$"):
        train.main(cfg_with(resume=str(exported)))
    pickled = tmp_path / "pickled.pt"
    torch.save({"a": torch.nn.Linear(2, 1)}, pickled)                # a module: refused by weights_only loading
    with pytest.raises(ValueError, match=r"is not a readable torch checkpoint \(UnpicklingError: .*Unsupported global"
                                         r".*\): pass a model_<iteration>.pt file train.py wrote$"):
        train.main(cfg_with(resume=str(pickled)))
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(ValueError, match=r"not a syncppo checkpoint \(expected format '\S+'\); pass a "
                                         r"model_<iteration>.pt file train.py wrote$"):
        train.main(cfg_with(resume=str(foreign)))
    newer = tmp_path / "newer.pt"                                   # a later format: said as such, not as foreign
    torch.save({"format": "syncppo-checkpoint-v2"}, newer)
    with pytest.raises(ValueError, match=r"newer.pt' was written by another syncppo version \(format "
                                         r"'syncppo-checkpoint-v2'; this one reads 'syncppo-checkpoint-v1'\)"):
        train.main(cfg_with(resume=str(newer)))


def run_cli(*args):
    """`python train.py ARGS` in a process of its own (forked from one that imported torch: tests/forked_python.py)."""
    return run_python(["train.py", *args], timeout=120)


def test_cli_unknown_preset_and_help():
    bad = run_cli("walker")
    assert bad.returncode != 0 and "cartpole" in bad.stderr + bad.stdout       # lists the valid presets
    help_text = run_cli("tracking", "--help").stdout
    for flag in ("--env.num-envs", "--ppo.num-epochs", "--ppo.desired-kl", "--log.save-every", "--resume"):
        assert flag in help_text
    assert "environments per rank" in help_text                                 # field help strings are shown
    typo = run_cli("tracking", "--ppo.num-epoch", "3")
    assert typo.returncode != 0 and "num-epochs" in typo.stderr + typo.stdout


@pytest.mark.parametrize("changes, flag", [
    ({"ppo__entropy_coef": float("nan")}, "--ppo.entropy-coef"),
    ({"ppo__value_loss_coef": float("inf")}, "--ppo.value-loss-coef"),
    ({"policy__init_noise_std": float("inf")}, "--policy.init-noise-std"),
    ({"ppo__clip_param": float("inf")}, "--ppo.clip-param"),
    ({"ppo__desired_kl": float("inf")}, "--ppo.desired-kl"),
    ({"ppo__lr_max": float("inf")}, "--ppo.lr-max"),
    ({"env__episode_length_s": float("inf")}, "--env.episode-length-s"),
    ({"env__episode_length_s": 1e-9}, "--env.episode-length-s"),
    ({"seed": -1}, "--seed"),
    ({"seed": 18446744073709551616}, "--seed"),
    ({"log__experiment": "../../x"}, "--log.experiment"),
    ({"log__experiment": ".."}, "--log.experiment"),
    ({"log__experiment": " "}, "--log.experiment ' ' is blank or holds a character that is not printable"),
    ({"log__experiment": "a\nb"}, "--log.experiment 'a\\\\nb' is blank or holds a character that is not printable"),
    ({"log__experiment": "run\udcff"}, "--log.experiment 'run\\\\udcff' is blank or holds a character that is not "
                                       "printable [(]a newline, a tab, a byte the file system's encoding"),
    ({"dist__timeout_s": 0.0}, "--dist.timeout-s"),
    ({"max_iterations": 2**63}, "--max-iterations must fit in 64 bits"),   # one past the largest int64
])
def test_inputs_that_used_to_train_for_hours_or_crash_name_the_flag(changes, flag):
    with pytest.raises(UsageError, match=flag.replace(".", r"\.")):
        validate(cfg_with(**changes))


@pytest.mark.parametrize("changes", [
    {"env__episode_length_s": 0.02},                          # exactly one 0.02 s control step
    {"dist__timeout_s": 0.001},                               # the lower end of [0.001, 1e9]
    {"dist__timeout_s": 1e9},                                 # the upper end
    {"ppo__gamma": 0.0, "ppo__lam": 0.0},                     # both ends of [0, 1]
    {"ppo__gamma": 1.0, "ppo__lam": 1.0},
    {"ppo__lr_min": 1e-3, "ppo__lr_max": 1e-3, "ppo__learning_rate": 1e-3},   # 0 < lr-min <= lr-max, all equal
    {"ppo__value_loss_coef": 0.0, "ppo__entropy_coef": 0.0},  # ">= 0"
    {"max_iterations": 2**63 - 1},                            # the largest int64
], ids=["one-step-episode", "timeout-min", "timeout-max", "gamma-lam-0", "gamma-lam-1", "lr-bounds-equal",
        "zero-coefs", "int64-max"])
def test_values_at_the_documented_bounds_are_accepted(changes):
    """Each bound validate() states is inclusive where its message says so: a value on it must pass."""
    validate(cfg_with(**changes))


def test_seed_range_is_32_bits_whatever_the_world_size():    # each rank derives its own seed (rank_seed)
    with pytest.raises(UsageError, match=r"^--seed must be in \[0, 4294967295\] .*, got 4294967296$"):
        validate(cfg_with(seed=2**32), world_size=8)
    validate(cfg_with(seed=2**32 - 1), world_size=8)


def test_cli_errors_are_one_line_exit_2_and_write_nothing(tmp_path):
    root = tmp_path / "runs"
    for args in (["--ppo.entropy-coef", "nan"], ["--seed", "-1"], ["--log.experiment", "../../x"],
                 ["--resume", str(tmp_path / "missing.pt")]):
        out = run_cli("tracking", "--log.root", str(root), *args)
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith(f"error: {args[0]}") and out.stderr.count("\n") == 1, out.stderr
        assert "Traceback" not in out.stderr and out.stdout == ""
    assert not root.exists()


def test_an_env_build_error_over_several_lines_is_said_on_one(tmp_path, monkeypatch):
    """`error: <message>` is one line: a simulator's own message (gym.make's, an ImportError's) may span several."""
    def refuse(*args, **kwargs):
        raise ValueError("--env.task Hopper-v4: first line\n\tsecond line\n")
    monkeypatch.setattr(train, "make_env", refuse)
    with pytest.raises(UsageError) as exc:
        train.main(cfg_with(log__root=str(tmp_path / "runs")))
    assert str(exc.value) == "--env.task Hopper-v4: first line second line"


def test_log_root_that_is_a_file_fails_before_the_env_is_built(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setattr(train, "make_env", lambda *a, **k: pytest.fail("env built before the check"))
    with pytest.raises(UsageError, match="--log.root .* is a file"):
        train.main(cfg_with(log__root=str(blocker / "runs")))
    # /proc refuses new directories even to root, for whom os.access(W_OK) says yes: the check must try one
    with pytest.raises(UsageError, match=r"^--log.root '/proc/syncppo-runs': '/proc' is not writable \("):
        train.main(cfg_with(log__root="/proc/syncppo-runs"))


def saved_run(tmp_path, iterations=2, **changes):
    cfg = cfg_with(env__num_envs=16, ppo__num_steps=8, max_iterations=iterations, log__root=str(tmp_path / "a"),
                   log__print_every=100, **changes)
    train.main(cfg)
    (ckpt,) = glob.glob(str(tmp_path / "a" / "tracking" / "*" / f"model_{iterations}.pt"))
    return ckpt


def test_checkpoint_that_does_not_fit_fails_before_the_env_is_built(tmp_path, monkeypatch):
    ckpt = saved_run(tmp_path)
    monkeypatch.setattr(train, "make_env", lambda *a, **k: pytest.fail("env built before the check"))
    new_root = str(tmp_path / "b")
    with pytest.raises(UsageError, match=r"--env.num-envs 32 does not match the checkpoint's --env.num-envs 16 "
                                         r"per rank"):
        train.main(cfg_with(env__num_envs=32, ppo__num_steps=8, resume=ckpt, log__root=new_root))
    with pytest.raises(UsageError, match=r"--policy.actor-hidden 64 64 does not match the "
                                         r"checkpoint's --policy.actor-hidden 128 128 "):
        train.main(cfg_with(env__num_envs=16, ppo__num_steps=8, resume=ckpt, log__root=new_root,
                            policy__actor_hidden=(64, 64)))
    with pytest.raises(UsageError, match=r"--max-iterations 2: .* is already at iteration 2"):
        train.main(cfg_with(env__num_envs=16, ppo__num_steps=8, resume=ckpt, log__root=new_root, max_iterations=2))
    assert not os.path.exists(new_root)


class NaNAfter:
    """Wraps an env; from step `at` on, feature 2 of env 3 in the critic group is NaN."""

    def __init__(self, env, at):
        self.env, self.at, self.steps = env, at, 0

    def __getattr__(self, name):
        return getattr(self.env, name)

    def step(self, actions):
        obs, reward, terminated, truncated, extras = self.env.step(actions)
        self.steps += 1
        if self.steps >= self.at:
            obs["critic"] = obs["critic"].clone()
            obs["critic"][3, 2] = float("nan")
        return obs, reward, terminated, truncated, extras


def test_non_finite_observation_names_env_group_and_feature_before_the_normalizer(tmp_path, monkeypatch):
    make_env = train.make_env
    monkeypatch.setattr(train, "make_env", lambda *a, **k: NaNAfter(make_env(*a, **k), at=12))
    cfg = cfg_with(env__num_envs=16, ppo__num_steps=8, max_iterations=3, log__root=str(tmp_path))
    seen = []
    monkeypatch.setattr(ObsNormalizer, "update", lambda self, batch: seen.append(batch))
    with pytest.raises(RunError, match=r"env 'tracking' produced nan in observation group 'critic' feature 2 "
                                       r"at step 3 \(0-based\) of iteration 2 in env 3 on rank 0"):  # env step 12
        # the 12th step (1-based) is iteration 2's 4th, step 3 (0-based); its observation is stored with step 4
        train.main(cfg)
    assert len(seen) == 1            # iteration 1 was clean; iteration 2's NaN never reached a normalizer


@pytest.mark.parametrize("field, t, said", [
    ("critic_obs", 2, "in observation group 'critic' feature 1 at step 1 (0-based) of iteration 5"),
    ("rewards", 1, "in reward at step 1 (0-based) of iteration 5"),      # the call that returned the obs above
    ("actor_obs", 0, "in observation group 'policy' feature 1 before iteration 5 (at the last step of the one "
                     "before, or a reset)"),
])
def test_a_non_finite_value_is_dated_by_the_step_that_returned_it(field, t, said):
    """An observation is stored with the step that acts on it, one after the step that returned it: a NaN put into
    the observation and the reward of one env call was dated step 2 for the one and step 1 for the other."""
    from ppo.rollout import check_finite
    batch = {"actor_obs": torch.zeros(3, 2, 4), "critic_obs": torch.zeros(3, 2, 4), "rewards": torch.zeros(3, 2),
             "bootstrap": torch.zeros(3, 2)}
    batch[field][(t, 1, 1) if field.endswith("obs") else (t, 1)] = float("nan")
    with pytest.raises(RunError) as exc:
        check_finite(batch, "x", 0, 5)
    assert str(exc.value) == f"env 'x' produced nan {said} in env 1 on rank 0; stopped before it reached a " \
                             f"normalizer (fix the env or its config)"


def test_console_prints_a_dash_when_no_episode_ended(tmp_path, capsys):
    logger = RunLogger(str(tmp_path), 10, 0, 4)
    logger.print_line(0, {"Perf/total_fps": 1.0, "Policy/kl": 0.0, "Loss/learning_rate": 1e-3})
    line = capsys.readouterr().out
    assert "reward        -  ep_len      -" in line and "nan" not in line
    logger.close()


@pytest.mark.parametrize("world, ranks, message", [
    (2, 2, r"--rollout.ranks 2 leaves no learner among 2 rank"),
    (5, 3, r"^--rollout.ranks 3 is not a multiple of the 2 learner\(s\) left of 5 ranks; each learner owns the same "
           r"number of rollout ranks: with 5 ranks use --rollout.ranks 4 \(or 0\)$"),
    (6, 1, r": with 6 ranks use --rollout.ranks 3 or 4 or 5 \(or 0\)$"),
    (2, -1, r"--rollout.ranks must be >= 0"),
])
def test_impossible_rollout_layouts_name_the_flag(world, ranks, message):
    cfg = cfg_with()
    cfg.rollout.ranks = ranks
    with pytest.raises(UsageError, match=message):
        validate(cfg, world_size=world)


def test_rollout_ranks_on_a_cuda_device_are_refused_naming_the_flag():
    cfg = cfg_with()
    cfg.rollout.ranks, cfg.dist.device = 1, "cuda"
    with pytest.raises(UsageError, match=r"--rollout.ranks runs on CPU devices only .* --dist.device cpu or auto"):
        validate(cfg, world_size=2)
    cfg.dist.device = "auto"              # resolves to cpu with rollout ranks (train.main)
    validate(cfg, world_size=2)


def test_rollout_ranks_with_nccl_are_refused_naming_both_flags_not_missing_cuda():
    """With --rollout.ranks every rank runs on the host, so --dist.backend nccl cannot work; it was left to
    init_distributed, whose "nccl needs CUDA devices" is wrong on a machine with GPUs.
    Mutant: validate_rollout without the --dist.backend nccl check -> validate passes."""
    cfg = cfg_with()
    cfg.rollout.ranks, cfg.dist.backend = 1, "nccl"
    with pytest.raises(UsageError, match=r"--rollout.ranks runs on CPU .* --dist.backend nccl .* gloo or auto"):
        validate(cfg, world_size=2)
    cfg.rollout.ranks = 0                 # colocated: nccl is init_distributed's to check against the device
    validate(cfg, world_size=2)


def test_capture_step_with_gloo_on_cuda_devices_is_refused_once_the_device_is_known(monkeypatch, tmp_path):
    """gloo's all-reduce of CUDA tensors copies through the host on its own thread, which a CUDA graph cannot
    capture: such a run failed at its first capture, after a rollout. train.main refuses it before building."""
    from configs import validate_device
    cfg = cfg_with(ppo__capture_step=True, dist__backend="gloo")
    message = r"^--ppo.capture-step captures .* use --dist.backend nccl \(auto picks it on GPUs\) or drop"
    with pytest.raises(UsageError, match=message):
        validate_device(cfg, 2, "cuda")
    for world, device, backend in ((1, "cuda", "gloo"), (2, "cpu", "gloo"), (2, "cuda", "nccl"), (2, "cuda", "auto")):
        cfg.dist.backend = backend           # one rank (no all-reduce), the host path the tests use, NCCL
        validate_device(cfg, world, device)
    cfg.dist.backend, cfg.ppo.capture_step = "gloo", False
    validate_device(cfg, 2, "cuda")          # the host path's all-reduce over gloo is not captured
    cfg.ppo.capture_step, cfg.log.root = True, str(tmp_path)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(train, "resolve_device", lambda device: torch.device("cuda:0"))   # as on a GPU machine
    with pytest.raises(UsageError, match=message):
        train.main(cfg)
    assert os.listdir(tmp_path) == []        # refused before anything was written


@pytest.mark.parametrize("field", ["actor_obs", "critic_obs", "rewards", "bootstrap"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_check_finite_finds_every_kind_of_non_finite_value_in_every_field(field, value):
    from ppo.rollout import check_finite
    batch = {"actor_obs": torch.randn(4, 3, 5), "critic_obs": torch.randn(4, 3, 7), "rewards": torch.randn(4, 3),
             "bootstrap": torch.zeros(4, 3)}
    batch["rewards"][0, 0] = 3.4e38                         # the largest finite values are finite
    batch["actor_obs"][1, 1, 1] = -3.4e38
    check_finite(batch, "tracking", 0, 1)
    batch[field].view(-1)[-1] = value
    with pytest.raises(RunError, match=f"produced {value}"):
        check_finite(batch, "tracking", 1, 1)


def test_minibatches_divide_the_envs_a_learner_holds_from_all_its_rollout_ranks():
    """1 learner + 2 rollout ranks of 1 env each: the learner minibatches 2 envs (rollout_ranks.py stacks its rollout
    ranks' batches), so 2 trajectory minibatches fit, and 4 are refused with the learner's count."""
    validate(cfg_with(env__num_envs=1, ppo__num_mini_batches=2, rollout__ranks=2), world_size=3)
    validate(cfg_with(env__num_envs=3, ppo__num_mini_batches=6, rollout__ranks=2, ppo__minibatch_unit="transition",
                      ppo__num_steps=1), world_size=3)
    with pytest.raises(UsageError) as exc:
        validate(cfg_with(env__num_envs=1, ppo__num_mini_batches=4, rollout__ranks=2), world_size=3)
    assert str(exc.value) == ("--env.num-envs (1 x 2 rollout ranks per learner = 2) must be divisible by "
                              "--ppo.num-mini-batches (4): minibatches are whole trajectories, never a silent "
                              "remainder")
    with pytest.raises(UsageError, match=r"^--env.num-envs \(1\) must be divisible"):    # 2 learners, 2 rollout ranks
        validate(cfg_with(env__num_envs=1, ppo__num_mini_batches=2, rollout__ranks=2), world_size=4)


def test_the_minibatch_norm_refusal_counts_a_learner_s_rollout_ranks():
    """1 learner + 2 rollout ranks of 1 env, 1 step, 2 minibatches: 1 transition each, the count said with its x 2."""
    with pytest.raises(UsageError) as exc:
        validate(cfg_with(env__num_envs=1, ppo__num_steps=1, ppo__num_mini_batches=2, rollout__ranks=2,
                          ppo__advantage_norm="minibatch"), world_size=3)
    assert str(exc.value) == ("--ppo.advantage-norm minibatch needs at least 2 transitions per rank in a minibatch "
                              "(the std of one is nan), got 1 = --env.num-envs x 2 x --ppo.num-steps / "
                              "--ppo.num-mini-batches; use fewer minibatches or another --ppo.advantage-norm")


@pytest.mark.parametrize("blocker", ["file", "read-only folder"])
def test_an_experiment_folder_that_cannot_take_a_run_fails_before_the_env_is_built(tmp_path, monkeypatch, blocker):
    """--log.root was checked, not --log.root/--log.experiment in it: a file of the experiment's name (or a folder
    another user made) passed, the run was built, then `error: unexpected FileExistsError (traceback above)`."""
    experiment = tmp_path / "tracking"
    experiment.write_text("x") if blocker == "file" else experiment.mkdir()
    monkeypatch.setattr(train, "make_env", lambda *a, **k: pytest.fail("env built before the check"))
    with read_only_folder(experiment) if blocker != "file" else contextlib.nullcontext():
        with pytest.raises(UsageError, match=rf"^--log.root/--log.experiment {re.escape(repr(str(experiment)))}: "):
            train.main(cfg_with(log__root=str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == ["tracking"]
    assert blocker == "file" or os.listdir(experiment) == []
