"""Command-line input found by trying to break train.py as a careless user would: each is refused in one line naming
the flag to fix (exit status 2, no traceback), where it used to crash, name nothing, or be silently ignored."""

import os
import sys

import pytest
import torch

import train

from configs import preset, resolve_num_envs, validate
from configs.typed_flags import check_typed_flags
from dist.errors import UsageError
from dist.log_root import check_writable_root
from envs.gymnasium import GymnasiumEnv
from test_config_errors import cfg_with, run_cli, saved_run
from test_startup_errors import small
from tests.forked_python import run_python


def assert_one_line_error(result, starts: str) -> None:
    """Exit status 2, no traceback, and stderr's one line starts with `starts`."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(starts), result.stderr[-2000:]


@pytest.mark.parametrize("task", [":Hopper-v4", ".hopper_tasks:Hopper-v4", "Hopper-v4:", "gymnasium:envs:Hopper-v4"])
def test_a_malformed_module_colon_task_id_names_env_task(task):
    """`--env.task :Hopper-v4` passed the registry check (TaskId alone is registered) and failed inside gymnasium's
    make with importlib's "Empty module name", naming no flag; `.mod:Task` (a relative module) was a TypeError
    traceback; `Hopper-v4:` blamed a missing package "that registers " nothing.
    Mutant: import_task_module without the check of an empty, relative or doubled module:TaskId."""
    with pytest.raises(ValueError, match=r"^--env\.task .* is not TaskId or module:TaskId"):
        GymnasiumEnv(task, 1, torch.device("cpu"), seed=0)


@pytest.mark.parametrize("task", [":Hopper-v4", ".foo:Hopper-v4"])
def test_cli_says_a_malformed_env_task_in_one_line(tmp_path, task):
    """The same through the command line: one line naming --env.task, exit status 2, no traceback.
    Mutant: import_task_module without the check of an empty, relative or doubled module:TaskId."""
    result = run_cli("mujoco", "--env.task", task, "--ppo.num-steps", "8", "--ppo.num-mini-batches", "1",
                     "--max-iterations", "1", "--log.root", str(tmp_path), "--dry-run")
    assert_one_line_error(result, f"error: --env.task {task!r} is not TaskId or module:TaskId")


def test_activation_typed_with_no_hidden_layer_is_refused():
    """With --policy.actor-hidden and --policy.critic-hidden both empty (a linear actor and critic) no activation is
    ever applied: a typed --policy.activation trained exactly as without it. It applies as soon as either has a layer.
    Mutant: requirement() without the rule for --policy.activation."""
    linear = cfg_with(policy__actor_hidden=(), policy__critic_hidden=())
    with pytest.raises(UsageError, match=r"^--policy\.activation applies only with a hidden layer in "
                                         r"--policy\.actor-hidden or --policy\.critic-hidden"):
        check_typed_flags(linear, frozenset({"--policy.activation"}))
    check_typed_flags(linear, frozenset())                                   # the preset's or default value: fine
    for changes in ({"policy__actor_hidden": (8,), "policy__critic_hidden": ()},
                    {"policy__actor_hidden": (), "policy__critic_hidden": (8,)}):
        check_typed_flags(cfg_with(**changes), frozenset({"--policy.activation"}))


def test_cli_refuses_an_activation_for_a_linear_policy(tmp_path):
    """Mutant: requirement() without the rule for --policy.activation."""
    result = run_cli("cartpole", "--policy.actor-hidden", "--policy.critic-hidden", "--policy.activation", "tanh",
                     "--log.root", str(tmp_path), "--dry-run")
    assert_one_line_error(result, "error: --policy.activation applies only with a hidden layer")


@pytest.mark.parametrize("flag, field", [("--env.actor-obs-groups", "actor_obs_groups"),
                                         ("--env.critic-obs-groups", "critic_obs_groups")])
def test_an_observation_group_named_twice_is_refused_before_the_simulator_starts(monkeypatch, flag, field):
    """`--env.critic-obs-groups policy critic policy` concatenated the policy group into the critic's input twice
    (a wider critic, fed the same numbers twice), unsaid; groups named once each pass.
    Mutant: validate_simulator_env without the check of an observation group named more than once."""
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())      # as if Isaac Lab were installed
    cfg = preset("isaaclab")
    setattr(cfg.env, field, ("policy", "critic", "policy"))
    with pytest.raises(UsageError, match=rf"^{flag} names 'policy' more than once; name each observation group once$"):
        validate(cfg, 1, frozenset({flag}))
    setattr(cfg.env, field, ("policy", "critic"))
    validate(cfg, 1, frozenset({flag}))


def test_a_log_root_of_undecodable_bytes_is_one_line(tmp_path):
    """`--log.root $'/data/\\xff'` (a Latin-1 name under a UTF-8 file system) arrives as a lone surrogate: measuring
    its bytes for the file system's limits raised a UnicodeEncodeError traceback. Refused by name, exit status 2.
    Mutant: check_writable_root without the check of undecodable bytes."""
    root = os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xff")
    with pytest.raises(UsageError, match=r"^--log\.root .* holds bytes that are not text in the file system's"):
        check_writable_root(root)
    result = run_cli("cartpole", "--log.root", root, "--dry-run")
    assert_one_line_error(result, "error: --log.root ")


@pytest.mark.parametrize("below", ["", "runs"])
def test_a_log_root_through_a_dangling_symlink_is_refused_before_the_build(tmp_path, below):
    """`--log.root LINK` or `LINK/runs`, LINK a symbolic link to a folder that is gone (an unmounted disk): the
    writability probe looked at LINK's parent and passed, and the run's directory failed once everything was built
    (a FileNotFoundError traceback after the first iteration, on rank 0; its peers blamed a dead rank).
    Mutant: check_writable_root without the check of a dangling symbolic link."""
    (tmp_path / "disk").symlink_to(tmp_path / "unmounted")
    root = os.path.join(tmp_path, "disk", below)
    with pytest.raises(UsageError, match=r"^--log\.root .*disk' is a symbolic link whose target does not exist"):
        check_writable_root(root)
    result = run_cli("cartpole", "--log.root", root, "--dry-run")
    assert_one_line_error(result, "error: --log.root ")
    assert not (tmp_path / "unmounted").exists()


@pytest.mark.parametrize("port", ["65536", "99999"])
def test_a_master_port_beyond_tcp_s_range_is_one_line_naming_it(tmp_path, capsys, monkeypatch, port):
    """RANK/WORLD_SIZE/MASTER_* set by hand with MASTER_PORT=99999 (a typo): torch's TCPStore raised "port must have
    value from 0 to 65535", a ValueError traceback reported as a bug.
    Mutant: init_distributed without the upper bound of MASTER_PORT."""
    for name in ("LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}.items():
        monkeypatch.setenv(name, value)
    assert train.cli(small(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err == f"error: environment variable MASTER_PORT={port!r} is not a TCP port (1-65535): set it to a free " \
                  f"port of rank 0's host, or launch with torchrun (it sets it)\n"
    assert not os.path.exists(tmp_path / "cartpole")


def test_a_resume_path_of_undecodable_bytes_is_one_line(tmp_path):
    """A checkpoint copied into a folder whose name is not UTF-8 (`$'\\xff'`): loaded, and then the start-up's
    "resuming with the settings of PATH" line raised a UnicodeEncodeError traceback on a strict stdout (a terminal
    under en_US.UTF-8; PYTHONIOENCODING here). Refused by name before anything is read, exit status 2.
    Mutant: resolve_resume without the check of undecodable bytes."""
    folder = os.fsencode(str(tmp_path)) + b"/\xff"
    os.mkdir(folder)
    with open(saved_run(tmp_path, iterations=1), "rb") as f, open(folder + b"/model_1.pt", "wb") as g:
        g.write(f.read())
    ckpt = os.fsdecode(folder + b"/model_1.pt")
    result = run_python(["train.py", "tracking", "--resume", ckpt, "--max-iterations", "2", "--log.root",
                         str(tmp_path / "b"), "--dry-run"], env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"})
    assert_one_line_error(result, f"error: --resume {ckpt!r} holds bytes that are not text in the file system's")


def test_export_to_a_folder_of_undecodable_bytes_names_it(tmp_path):
    """`make export CKPT=...` of a checkpoint in a folder named `$'\\xff'` (its default --out), or `--out $'\\xff'`:
    torch.jit.save refused the path string, a TypeError traceback (status 1) after the checkpoint was read.
    Mutant: export() without the check of undecodable bytes in the output folder."""
    from ppo.export import export
    ckpt = saved_run(tmp_path, iterations=1)
    bad = os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xff")
    with pytest.raises(ValueError, match=r"^--out .* holds bytes that are not text in the file system's encoding"):
        export(ckpt, bad)
    os.mkdir(bad)
    with open(ckpt, "rb") as f, open(os.path.join(bad, "model_1.pt"), "wb") as g:
        g.write(f.read())
    with pytest.raises(ValueError, match=r"^the checkpoint's folder .* \(the default --out\) holds bytes that are not"):
        export(os.path.join(bad, "model_1.pt"))
    assert os.listdir(bad) == ["model_1.pt"]


@pytest.mark.parametrize("norm", ["global", "local"])
def test_one_transition_to_normalize_names_the_env_count_flag_the_run_can_take(norm):
    """`--env.global-num-envs 1 --ppo.num-steps 1`: the error said "use more --env.num-envs", and typing that was
    refused next ("--env.num-envs applies only with --env.global-num-envs 0"). It names the count flag the run takes.
    Mutant: the one-transition advantage-norm message naming --env.num-envs whatever set the count."""
    cfg = cfg_with(env__global_num_envs=1, ppo__num_steps=1, ppo__num_mini_batches=1, ppo__advantage_norm=norm)
    typed = frozenset({"--env.global-num-envs", "--ppo.num-steps", "--ppo.num-mini-batches"})
    resolve_num_envs(cfg, 1)
    with pytest.raises(UsageError, match=rf"^--ppo\.advantage-norm {norm} normalizes over 1 transition") as exc:
        validate(cfg, 1, typed)
    advice = str(exc.value).split("; use more ", 1)[1].split(" ", 1)[0]
    assert advice == "--env.global-num-envs", exc.value
    check_typed_flags(cfg, typed | {advice})                                 # the flag it names applies here


def test_out_of_memory_advice_names_the_env_count_flag_the_run_can_take(monkeypatch, capsys):
    """`--env.global-num-envs 2**62`: out of memory said "lower --env.num-envs", which is refused when typed beside
    --env.global-num-envs. The advice names the count flag the run takes; without the split, --env.num-envs.
    Mutant: cli's out-of-memory line naming --env.num-envs whatever set the count."""
    with pytest.raises(RuntimeError) as overflow:
        torch.empty(2**62, 4)
    monkeypatch.setattr(train, "main", lambda cfg, typed: (_ for _ in ()).throw(overflow.value))
    monkeypatch.setattr(train, "tell_torchrun", lambda *args, **kwargs: None)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(sys, "last_value", None, raising=False)    # cli leaves its failure there, for exit handlers
    monkeypatch.setattr(sys, "last_exc", None, raising=False)
    for total, named in ((2**62, "--env.global-num-envs"), (0, "--env.num-envs")):
        assert train.cli(cfg_with(env__global_num_envs=total)) == 1
        last = capsys.readouterr().err.splitlines()[-1]
        assert last.startswith("error: out of memory") and f"lower {named}, --ppo.num-steps" in last, last
