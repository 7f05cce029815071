"""Start-up errors that used to end in a traceback, late or silently: device and backend flags, rollout ranks
with Isaac Lab, an Isaac Lab env that fails to build under Kit."""

import json
import os
import sys
import textwrap

import pytest
import torch

import train
import dist.setup
from configs import preset, validate
from dist.errors import RunError, UsageError
from tests.fake_isaaclab import Record, fake_modules
from tests.forked_python import run_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small(root):
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 8, 4, 1
    cfg.log.root = str(root)
    return cfg


# ---- device/backend errors are usage errors: one line naming the flag, status 2, no traceback ----------------

def test_cuda_device_without_cuda_is_one_line_naming_the_flag(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = small(tmp_path)
    cfg.dist.device = "cuda"
    assert train.cli(cfg) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --dist.device cuda") and "Traceback" not in err
    assert not os.path.exists(tmp_path / "cartpole")        # nothing written


def test_nccl_on_the_cpu_is_one_line_naming_the_flag(tmp_path, capsys):
    cfg = small(tmp_path)
    cfg.dist.backend, cfg.dist.device = "nccl", "cpu"
    assert train.cli(cfg) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --dist.backend nccl") and "Traceback" not in err
    assert not os.path.exists(tmp_path / "cartpole")


# ---- torchrun's variables set by hand: one line naming the variable, before anything is built -------------

@pytest.mark.parametrize("env, named", [
    ({"WORLD_SIZE": "abc"}, "environment variable WORLD_SIZE='abc' is not an integer >= 1"),
    ({"WORLD_SIZE": "0"}, "environment variable WORLD_SIZE='0' is not an integer >= 1"),
    ({"RANK": "x"}, "environment variable RANK='x' is not an integer >= 0"),
    ({"RANK": "\u00b2"}, "environment variable RANK='\u00b2' is not an integer >= 0"),      # a digit int() cannot read
    ({"LOCAL_RANK": "-1"}, "environment variable LOCAL_RANK='-1' is not an integer >= 0"),
    ({"TORCHELASTIC_RESTART_COUNT": "x"}, "environment variable TORCHELASTIC_RESTART_COUNT='x' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "environment variables RANK=2 and WORLD_SIZE=2: a rank must be below"),
    ({"RANK": "1"}, "environment variables RANK=1 and WORLD_SIZE unset (1): a rank must be below"),  # not "=1"
    ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE=2 without MASTER_ADDR and MASTER_PORT"),
    # torchrun's agent store is reached at MASTER_ADDR:MASTER_PORT too: without them this was a KeyError traceback
    ({"WORLD_SIZE": "2", "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": "29500"},
     "WORLD_SIZE=2 without MASTER_ADDR: "),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc"},
     "environment variable MASTER_PORT='abc' is not an integer >= 1"),
])
def test_torchrun_variables_set_by_hand_are_one_line_naming_the_variable(tmp_path, capsys, monkeypatch, env, named):
    """They were int() tracebacks, a ZeroDivisionError, torch's MASTER_ADDR traceback, or (WORLD_SIZE=0) silently one
    process."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert train.cli(small(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}") and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "cartpole")


def test_a_rank_that_never_comes_is_one_line_naming_the_timeout_flag(tmp_path, capsys, monkeypatch):
    """Rank 0 of two, alone: the rendezvous times out after --dist.timeout-s. It was torch's DistStoreError
    traceback reported as a bug; it is a run-time failure (status 1) whose line says what to check."""
    import socket
    with socket.socket() as s:          # a port nobody listens on once closed: rank 0's store binds it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name in ("LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    cfg = small(tmp_path)
    cfg.dist.timeout_s = 0.5
    monkeypatch.setattr(dist.setup, "WAIT_NOTICE_S", 0.0)    # what a late rendezvous says meanwhile, said at once
    assert train.cli(cfg) == 1
    out, err = capsys.readouterr()
    assert out == (f"[syncppo] rank 0: waiting for the other 1 rank(s) at 127.0.0.1:{port} (for up to "
                   f"--dist.timeout-s 0.5)\n")
    assert err.startswith(f"error: the 2 ranks did not all meet at 127.0.0.1:{port} within --dist.timeout-s 0.5 (")
    assert err.endswith("start every rank (torchrun --nnodes/--nproc-per-node), check that rank 0's host and port "
                        "are reachable, or raise --dist.timeout-s; a rank that refused its input (another node's one "
                        "line) never joins\n") and "Traceback" not in err
    assert not os.path.exists(tmp_path / "cartpole")


def test_a_process_group_the_program_made_itself_needs_no_master_address(monkeypatch):
    """A program that called init_process_group (file:// or tcp:// init) before train.main: torchrun's
    MASTER_ADDR/MASTER_PORT are not needed, and the group is used as it is."""
    import torch.distributed as torch_dist

    from dist.setup import init_distributed
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: True)
    info = init_distributed("gloo", "cpu")
    assert (info.rank, info.world_size, info.backend) == (1, 2, "gloo")


def test_one_process_says_the_process_group_flags_do_not_apply(tmp_path, capsys, monkeypatch):
    """`python train.py cartpole --dist.backend gloo` printed `backend none` and nothing about the typed flag; the
    other --dist flags but two (--dist.grad-sync, bucket-mb, verify-every, sampler-sync-every, timeout-s) change
    nothing in one process either."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    cfg = small(tmp_path)
    cfg.dist.backend, cfg.dry_run = "gloo", True
    assert train.cli(cfg) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("[syncppo] world size 1, backend none (one process: of --dist.* only device, "
                            "unused-params apply), device cpu"), first


# ---- rollout ranks with Isaac Lab: refused at validation, naming --rollout.ranks ---------------------------

def test_rollout_ranks_with_isaaclab_are_refused_before_anything_is_built(monkeypatch):
    for name, module in fake_modules(Record()).items():      # the package is "installed"
        monkeypatch.setitem(sys.modules, name, module)
    cfg = preset("isaaclab")
    cfg.rollout.ranks = 1
    # --dist.device auto: train.main turns it into cpu for rollout ranks, where Isaac Lab cannot simulate
    with pytest.raises(UsageError, match=r"--rollout.ranks .*--env.name isaaclab"):
        validate(cfg, world_size=2)
    cfg.rollout.ranks = 0
    validate(cfg, world_size=2)


# ---- an Isaac Lab start-up error under Kit reaches the runner instead of ending the process silently -------

KIT_RUN = """
import sys
import torch
torch.cuda.is_available = lambda: False
import train
from configs import preset
from tests.fake_isaaclab import install

install(rank=0)
cfg = preset("isaaclab")
cfg.env.num_envs, cfg.env.critic_obs_groups = 8, ("privileged",)       # a group the task does not have
cfg.env.task_overrides = ("physics=isaacsim_physx",)                   # Kit: closing it ends the process
cfg.ppo.num_steps, cfg.max_iterations, cfg.log.root = 8, 1, {root!r}
sys.exit(train.cli(cfg))
"""


def test_a_bad_obs_group_under_kit_is_reported_naming_the_flag(tmp_path):
    result = run_python(["-c", textwrap.dedent(KIT_RUN).format(root=str(tmp_path))], cwd=REPO, timeout=120,
                        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "error: --env.critic-obs-groups: this task has no observation group 'privileged'" in result.stderr, \
        result.stderr


def test_under_torchrun_parse_errors_print_once_per_node_and_our_errors_reach_torchrun_s_summary(tmp_path):
    """tyro's own messages (help, an unknown flag) would print once per rank; our one line goes to the error file
    torchrun names as the root cause (without it the summary says `error_file: <N/A>`)."""
    def run(*args, **env):
        return run_python(["train.py", "tracking", *args], cwd=REPO, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    parse_error = tmp_path / "parse_error.json"
    other_rank = run("--ppo.no-such-flag", "3", LOCAL_RANK="1", TORCHELASTIC_ERROR_FILE=str(parse_error))
    assert other_rank.returncode == 2 and other_rank.stdout == other_rank.stderr == ""
    assert json.loads(parse_error.read_text())["message"].startswith("error: the command line could not be parsed")
    first_rank = run("--ppo.no-such-flag", "3", LOCAL_RANK="0")
    assert first_rank.returncode == 2 and "--ppo.no-such-flag" in first_rank.stderr
    error_file = tmp_path / "error.json"
    ours = run("--env.num-envs", "0", LOCAL_RANK="1", TORCHELASTIC_ERROR_FILE=str(error_file))
    assert ours.returncode == 2 and ours.stderr == ""                  # said by local rank 0 only
    assert json.loads(error_file.read_text())["message"] == "error: --env.num-envs must be positive, got 0"


@pytest.mark.parametrize("message, caught", [
    ("Gloo connectFullMesh failed with [pair.h:311] Connect timeout [none]", True),
    ("an unrelated RuntimeError", False)])
def test_gloo_s_mesh_connect_timing_out_is_the_rendezvous_line_not_a_traceback(monkeypatch, message, caught):
    """A rendezvous whose store answered but whose gloo mesh connect ran past --dist.timeout-s (0.001 s on one of two
    ranks) raises a RuntimeError, not a DistError: it printed `unexpected RuntimeError` with a traceback beside the
    other rank's line. Only that failure is turned into the line; any other RuntimeError stays a bug."""
    for name in ("LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)

    def fails(**kwargs):
        raise RuntimeError(message)
    monkeypatch.setattr(dist.setup.torch_dist, "init_process_group", fails)
    with pytest.raises(RunError if caught else RuntimeError) as exc:
        dist.setup.init_distributed("gloo", "cpu", 0.001)
    assert (str(exc.value).startswith("the 2 ranks did not all meet at 127.0.0.1:29999 within --dist.timeout-s 0.001 "
                                      f"({message}); start every rank") if caught else str(exc.value) == message)


# ---- a module's BUFFER_POLICY that cannot work: one line naming the buffer and the fix, before training ---------

def with_buffer(name, value, persistent=True):
    """train.build_actor_critic, its model given one more buffer."""
    build = train.build_actor_critic

    def built(*args, **kwargs):
        model = build(*args, **kwargs)
        model.register_buffer(name, value, persistent=persistent)
        return model
    return built


RULES = "('broadcast', 'mean', 'merge', 'local')"


@pytest.mark.parametrize("extra, policy, expected", [
    (("extra", torch.zeros(3)), {}, f"buffers without a sync rule: ['extra']; declare each as one of {RULES} in "
     "ActorCritic's BUFFER_POLICY"),
    (None, {"actor_normalizer.*": "average"}, f"unknown buffer rules {{'actor_normalizer.*': 'average'}} in "
     f"ActorCritic's BUFFER_POLICY; use one of {RULES}"),
    (("count", torch.zeros((), dtype=torch.int64)), {"count": "mean"}, "buffers ['count'] are integer but declared "
     "`mean`: an average of counts is not an integer; declare them `broadcast` (e.g. BatchNorm's num_batches_tracked) "
     "or `local` in ActorCritic's BUFFER_POLICY"),
    (("scratch", torch.zeros(2), False), {"scratch": "broadcast"}, "buffers ['scratch'] are registered with "
     "persistent=False but declared synced: checkpoints and the rollout ranks' weight sync (state_dict) leave them "
     "out, so a resumed run or a rollout copy would silently keep another value; register them persistent, or "
     "declare them `local` in ActorCritic's BUFFER_POLICY (a constant every rank builds alike)"),
    (None, {"critic_normalizer.m*": "local"}, "buffer 'critic_normalizer.mean64' matches patterns with different rules "
     "['local', 'merge'] in ActorCritic's BUFFER_POLICY; give those patterns one rule, or narrow one so that it no "
     "longer matches"),
])
def test_a_buffer_policy_that_cannot_work_is_one_line_naming_the_fix(tmp_path, capsys, monkeypatch, extra, policy,
                                                                      expected):
    """An undeclared buffer, an unknown rule, an integer `mean`, a synced non-persistent buffer, patterns that
    disagree: each message already named the fix, but train.py reported it as a bug (`unexpected ValueError`, a
    traceback, status 1). Now a usage error: the one line, status 2, before anything is trained or written.

    Mutant: dist/buffers.py raises ValueError instead of UsageError."""
    from ppo.actor_critic import ActorCritic
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    if extra is not None:
        monkeypatch.setattr(train, "build_actor_critic", with_buffer(*extra))
    monkeypatch.setattr(ActorCritic, "BUFFER_POLICY", {**ActorCritic.BUFFER_POLICY, **policy})
    assert train.cli(small(tmp_path)) == 2
    assert capsys.readouterr().err == f"error: {expected}\n"
    assert not os.path.exists(tmp_path / "cartpole")        # nothing written


EXTRA_BUFFER = """
import sys
import torch
sys.path.insert(0, {root!r})
import tyro
import rollout_ranks
import train
from configs import cli_presets

build = train.build_actor_critic
def built(*args, **kwargs):
    model = build(*args, **kwargs)
    model.register_buffer("extra", torch.zeros(3))
    return model
train.build_actor_critic = rollout_ranks.build_actor_critic = built
sys.argv = ["train.py", *sys.argv[1:]]
sys.exit(train.cli(tyro.extras.overridable_config_cli(cli_presets(sys.argv[1:])),
                   sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["--rollout.ranks", "1"]], ids=["colocated", "rollout-rank"])
def test_an_undeclared_buffer_stops_every_rank_alike_with_one_line(tmp_path, layout):
    """Two ranks of a real run, a model with a buffer its BUFFER_POLICY does not name: both stop before training
    with status 2, the line said once (local rank 0), no traceback on either; neither waits for the other. A rollout
    rank, whose policy copy has the buffer too, stopped with status 1 and a second line ('learner rank 0 died').

    Mutant: dist/buffers.py raises ValueError instead of UsageError.
    Mutant: rollout_ranks.run_rollout_rank without its resolve_buffer_policy(copy, ...) (rollout-rank)."""
    from tests.multirank import run_processes
    script = tmp_path / "extra.py"
    script.write_text(EXTRA_BUFFER.format(root=REPO))
    codes, outputs = run_processes([sys.executable, str(script), "cartpole", "--max-iterations", "1", "--log.root",
                                    str(tmp_path), "--dist.timeout-s", "3600", *layout], 2, REPO, 90)
    assert codes == [2, 2], outputs
    assert outputs[0][1] == (f"error: buffers without a sync rule: ['extra']; declare each as one of {RULES} in "
                             "ActorCritic's BUFFER_POLICY\n"), outputs
    assert outputs[1][1] == "", outputs
    assert "Traceback" not in outputs[0][0] + outputs[1][0]
