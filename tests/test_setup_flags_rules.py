"""Hand-checked rules of dist/setup.py (launch variables, device and backend choice, seeding),
configs/typed_flags.py (which env reads each --env.* flag, the order and paths of refusals), dist/params.py
(start-up broadcast by dtype) and dist/buffers.py (ledger purposes, integer `mean` buffers)."""

import ast
import inspect
import os
import random
import textwrap
import typing

import numpy as np
import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from configs.config import EnvConfig
from configs.typed_flags import check_typed_flags, env_reads
from dist import comm
from dist.buffers import buffer_plan_rows, resolve_buffer_policy, sync_buffers
from dist.errors import UsageError
from dist.params import broadcast_module, broadcast_plan_rows
from dist.plan import PlanRow
from dist.setup import init_distributed, launch_int, resolve_device, seed_everything
from test_config_errors import cfg_with
from tests.multirank import run_ranks

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture
def launch_env(monkeypatch):
    """No torchrun variables; comm's device and group restored after the test."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(comm, "_DEVICE", comm._DEVICE)
    monkeypatch.setattr(comm, "_GROUP", comm._GROUP)
    return monkeypatch


@pytest.fixture
def two_gpus(launch_env):
    """torch sees two CUDA devices (none is touched: set_device is recorded, not run)."""
    chosen = []
    launch_env.setattr(torch.cuda, "is_available", lambda: True)
    launch_env.setattr(torch.cuda, "device_count", lambda: 2)
    launch_env.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


# ---- dist/setup.py: launch variables ---------------------------------------------------------------------

@pytest.mark.parametrize("name, value, low, suffix", [
    ("RANK", "", 0, ", or unset it to run one process"),            # set but empty: not "unset"
    ("LOCAL_RANK", "x", 0, ", or unset it to run one process"),
    ("WORLD_SIZE", "0", 1, ", or unset it to run one process"),
    ("MASTER_PORT", "0", 1, ""),                                      # not one of the three a single run leaves unset
    ("LOCAL_WORLD_SIZE", "-2", 1, ""),
])
def test_a_bad_launch_variable_is_refused_with_the_whole_message(launch_env, name, value, low, suffix):
    launch_env.setenv(name, value)
    with pytest.raises(UsageError) as exc:
        launch_int(name, 7, low=low)
    assert str(exc.value) == (f"environment variable {name}={value!r} is not an integer >= {low}: torchrun sets it; "
                              f"launch with torchrun{suffix}")


def test_launch_variables_read_padded_digits_and_default_only_when_unset(launch_env):
    assert launch_int("LOCAL_RANK", 7) == 7
    launch_env.setenv("LOCAL_RANK", " 3\n")
    assert launch_int("LOCAL_RANK", 7) == 3
    launch_env.setenv("WORLD_SIZE", "1")
    assert launch_int("WORLD_SIZE", 5, low=1) == 1


# ---- dist/setup.py: device and backend (CUDA faked: nothing runs on a GPU) ---------------------------------

def test_each_local_rank_gets_its_own_gpu_up_to_the_visible_count(two_gpus, launch_env):
    launch_env.setenv("LOCAL_RANK", "1")
    launch_env.setenv("LOCAL_WORLD_SIZE", "2")                      # exactly as many ranks as GPUs: fine
    assert resolve_device("auto") == torch.device("cuda:1")
    assert resolve_device("cuda") == torch.device("cuda:1")
    assert resolve_device("cpu") == torch.device("cpu")
    launch_env.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(UsageError) as exc:
        resolve_device("auto")
    assert str(exc.value) == ("--nproc-per-node 3 starts more ranks than the 2 visible GPU(s); start at most that "
                              "many processes per node")
    assert resolve_device("cpu") == torch.device("cpu")             # the CPU has no such limit


def test_without_local_world_size_local_rank_plus_one_ranks_are_assumed(two_gpus, launch_env):
    launch_env.setenv("LOCAL_RANK", "2")                            # a third rank on a node with two GPUs
    with pytest.raises(UsageError, match=r"^--nproc-per-node 3 starts more ranks than the 2 visible GPU\(s\)"):
        resolve_device("auto")
    launch_env.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cuda:1")


def test_auto_on_gpus_joins_with_nccl_and_stages_collectives_on_the_rank_s_gpu(two_gpus, launch_env):
    """A group made beforehand (is_initialized), so nothing is joined: what init_distributed chose is visible."""
    launch_env.setenv("WORLD_SIZE", "2")
    launch_env.setenv("RANK", "1")
    launch_env.setenv("LOCAL_RANK", "1")
    launch_env.setattr(torch_dist, "is_initialized", lambda: True)
    info = init_distributed("auto", "auto")
    assert (info.rank, info.world_size, info.backend, info.device) == (1, 2, "nccl", torch.device("cuda:1"))
    assert two_gpus == [torch.device("cuda:1")] and comm.device() == torch.device("cuda:1")
    info = init_distributed("gloo", "cuda")                         # gloo moves tensors through the host
    assert (info.backend, info.device, comm.device()) == ("gloo", torch.device("cuda:1"), torch.device("cpu"))


def test_only_nccl_is_bound_to_the_rank_s_gpu_when_the_group_is_made(two_gpus, launch_env):
    """init_process_group's device_id binds the group to a GPU (NCCL's eager init): with gloo moving CUDA tensors
    through the host it would bind a gloo group to cuda:1 (barriers and new_group splits then go by that device)."""
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29500")):
        launch_env.setenv(name, value)
    made = []
    launch_env.setattr(torch_dist, "init_process_group", lambda **kwargs: made.append(kwargs))
    init_distributed("nccl", "cuda")
    init_distributed("gloo", "cuda")
    assert [(kw["backend"], kw["device_id"]) for kw in made] == [("nccl", torch.device("cuda:1")), ("gloo", None)]


def test_one_process_on_a_gpu_stages_its_collectives_on_that_gpu(two_gpus, launch_env):
    """With one process no collective runs (each returns its input): what is staged for one stays where the run
    computes. Staged on the host, a one-GPU run copied its advantage statistics to the host and back twice per update
    (a device sync each way, inside the update that --ppo.capture-step keeps free of them), its sampler counts every
    --dist.sampler-sync-every iterations, and its start-up broadcast."""
    for backend in ("auto", "gloo"):
        info = init_distributed(backend, "cuda")
        assert (info.world_size, info.backend, info.device) == (1, "none", torch.device("cuda:0"))
        assert comm.device() == torch.device("cuda:0")


def test_one_process_has_backend_none_and_resets_comm_s_group(launch_env):
    launch_env.setattr(comm, "_GROUP", "a learners' group left by an earlier run")
    info = init_distributed("gloo", "cpu")
    assert (info.rank, info.world_size, info.backend, info.device) == (0, 1, "none", torch.device("cpu"))
    assert comm._GROUP is None and comm.device() == torch.device("cpu")


def test_a_rank_on_a_second_node_keeps_its_global_and_local_numbers_apart(launch_env):
    """Rank 5 of 8 is local rank 1 on its node (4 per node): DistInfo's rank is RANK, not LOCAL_RANK (which only picks
    the GPU: cuda:LOCAL_RANK, above)."""
    for name, value in (("RANK", "5"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "4")):
        launch_env.setenv(name, value)
    launch_env.setattr(torch_dist, "is_initialized", lambda: True)      # joined already: nothing is joined here
    info = init_distributed("gloo", "cpu")
    assert (info.rank, info.world_size, info.backend, info.device) == (5, 8, "gloo", torch.device("cpu"))


# ---- dist/setup.py: seeds ---------------------------------------------------------------------------------

def test_seed_everything_seeds_python_numpy_and_torch():
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        seed_everything(1234)
        drawn = random.random(), np.random.random_sample(), torch.rand(3)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
    assert drawn[0] == random.Random(1234).random()
    assert drawn[1] == np.random.RandomState(1234).random_sample()
    assert torch.equal(drawn[2], torch.rand(3, generator=torch.Generator().manual_seed(1234)))


# ---- configs/typed_flags.py ------------------------------------------------------------------------------

# Which env reads each env-specific flag, read off make_env (envs/__init__.py) and train.py (the sampler).
READ_BY = {
    "--env.episode-length-s": {"cartpole", "tracking"},
    "--env.num-motions": {"tracking"},
    "--env.sampling-uniform-floor": {"tracking"},
    "--dist.sampler-sync-every": {"tracking"},
    "--env.task": {"gymnasium", "isaaclab"},
    "--env.action-scale": {"gymnasium", "isaaclab"},
    "--env.action-clip": {"gymnasium", "isaaclab"},
    "--env.actor-obs-groups": {"isaaclab"},
    "--env.critic-obs-groups": {"isaaclab"},
    "--env.launcher-args": {"isaaclab"},
    "--env.task-overrides": {"isaaclab"},
}
ENVS = ("cartpole", "tracking", "gymnasium", "isaaclab")


@pytest.mark.parametrize("env", ENVS)
def test_every_env_specific_flag_is_accepted_exactly_by_the_envs_that_read_it(env):
    cfg = cfg_with(env__name=env)
    for flag, envs in READ_BY.items():
        assert env_reads(cfg, flag) == (env in envs), flag
        if env in envs:
            check_typed_flags(cfg, frozenset({flag}))
        else:
            with pytest.raises(UsageError, match=rf"^{flag} applies only with --env\.name .*\(the run uses {env}\)"):
                check_typed_flags(cfg, frozenset({flag}))
    assert env_reads(cfg, "--ppo.gamma") and env_reads(cfg, "--env.num-envs")     # read by every env


def test_envs_and_read_by_cover_every_env_name_and_its_help_strings_name_the_envs_that_read_them():
    """An env added by docs/design.md's five edits must be in ENVS (and READ_BY), so that the test above checks its
    ENV_ONLY entries; and --env.name's help and every env flag's help name the envs (`cartpole/tracking: ...`)."""
    assert set(ENVS) == set(typing.get_args(typing.get_type_hints(EnvConfig)["name"]))
    helps = field_helps(EnvConfig)
    assert all(env in helps["name"] for env in ENVS), helps["name"]
    for flag, envs in READ_BY.items():
        if flag.startswith("--env."):
            named = helps[flag.removeprefix("--env.").replace("-", "_")].split(":")[0].removesuffix(" only")
            assert set(named.split("/")) == envs, (flag, named)


def field_helps(cls) -> dict[str, str]:
    """{field: the help string under it} read off the class's source, as tyro reads it."""
    (tree,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    return {field.target.id: doc.value.value for field, doc in zip(tree.body, tree.body[1:])
            if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)}


def test_of_several_refused_flags_the_first_in_sorted_order_is_named():
    cfg = cfg_with(env__name="cartpole", ppo__schedule="fixed")
    typed = frozenset({"--rollout.mode", "--ppo.lr-max", "--env.num-motions", "--seed"})
    with pytest.raises(UsageError, match=r"^--env\.num-motions applies only with --env\.name tracking"):
        check_typed_flags(cfg, typed)
    with pytest.raises(UsageError, match=r"^--ppo\.lr-max applies only with --ppo\.schedule adaptive"):
        check_typed_flags(cfg, typed - {"--env.num-motions"})


def test_a_global_env_count_of_one_still_overrides_a_typed_env_count():
    with pytest.raises(UsageError, match=r"^--env\.num-envs applies only with --env\.global-num-envs 0 \(the run "
                                         r"uses 1, split across the ranks\)"):
        check_typed_flags(cfg_with(env__global_num_envs=1), frozenset({"--env.num-envs"}))
    check_typed_flags(cfg_with(env__global_num_envs=0), frozenset({"--env.num-envs"}))


def test_a_run_directory_reached_through_a_symlinked_log_root_is_in_the_experiment(tmp_path):
    """The comparison is of real paths: --log.root given as a link to where the run directory lies holds it."""
    run_dir = tmp_path / "real" / "tracking" / "2026-12-01_09-00-00"
    run_dir.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    flags = frozenset({"--log.root", "--log.experiment"})
    check_typed_flags(cfg_with(resume=str(run_dir), log__root=str(tmp_path / "link"), log__experiment="tracking"),
                      flags)
    linked_run = tmp_path / "link" / "tracking" / run_dir.name
    check_typed_flags(cfg_with(resume=str(linked_run), log__root=str(tmp_path / "real")), flags)
    with pytest.raises(UsageError, match=r"^--log\.root applies only with --resume auto"):
        check_typed_flags(cfg_with(resume=str(linked_run), log__root=str(tmp_path)), frozenset({"--log.root"}))


# ---- dist/params.py --------------------------------------------------------------------------------------

class Mixed(nn.Module):
    """Parameters and buffers of three dtypes, different on every rank (rank r adds 100 r)."""

    def __init__(self, rank):
        super().__init__()
        r = float(rank)
        self.w = nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]) + 100 * r)
        self.b = nn.Parameter(torch.tensor([5.0, 6.0, 7.0]) + 100 * r)
        self.register_buffer("shift", torch.tensor([8.0, 9.0], dtype=torch.float64) + 100 * r)
        self.register_buffer("steps", torch.tensor([10 + 100 * rank, 11], dtype=torch.int64))
        self.register_buffer("scale", torch.tensor([12.0]) + 100 * r)       # float32, after the parameters


def broadcast_body(rank, world_size):
    comm.reset_ledger()
    m = Mixed(rank)
    broadcast_module(m)
    state = {k: v.detach().clone() for k, v in [*m.named_parameters(), *m.named_buffers()]}
    return state, [p.requires_grad for p in m.parameters()], comm.ledger_snapshot()


@pytest.mark.slow
def test_broadcast_module_gives_every_rank_rank_0_s_tensors_in_one_call_per_dtype():
    rank0 = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([5.0, 6.0, 7.0]),
             "shift": torch.tensor([8.0, 9.0], dtype=torch.float64), "steps": torch.tensor([10, 11]),
             "scale": torch.tensor([12.0])}
    for state, requires_grad, ledger in run_ranks(broadcast_body, 3):
        assert state.keys() == rank0.keys()
        for name, value in rank0.items():
            assert state[name].dtype == value.dtype and torch.equal(state[name], value), name
        assert requires_grad == [True, True]
        # float32: 4 + 3 + 1 elements x 4 bytes; float64: 2 x 8; int64: 2 x 8
        assert ledger == {"shapes": (1, 8), "params": (3, 32 + 16 + 16)}   # the layout checksum, then the tensors


def test_broadcast_plan_row_is_one_setup_call_per_dtype_by_hand():
    (layout, row) = broadcast_plan_rows(Mixed(0))
    assert layout == PlanRow("shapes", "same names everywhere", "all_gather", "setup", [8])
    assert (row.purpose, row.rule, row.collective, row.cadence, row.rounds) == \
        ("params", "broadcast from rank 0", "broadcast", "setup", 1)
    assert sorted(row.call_bytes) == [16, 16, 32]          # the calls' order follows the dtypes' first appearance
    assert broadcast_plan_rows(nn.Linear(3, 2))[1:] == [PlanRow("params", "broadcast from rank 0", "broadcast", "setup",
                                                            [(6 + 2) * 4])]


def layout_body(rank, world_size):
    m = nn.Linear(3 + rank, 2)          # e.g. an env that reports another observation size on rank 1
    try:
        broadcast_module(m)
    except RuntimeError as e:
        return str(e)
    return f"no error, weight {tuple(m.weight.shape)}"


@pytest.mark.slow
def test_ranks_with_other_parameter_shapes_stop_before_the_broadcast_naming_the_ranks_and_their_layouts():
    """gloo broadcasts rank 0's 8 floats into rank 1's 10 without an error: the shapes must be compared first."""
    first, second = run_ranks(layout_body, 2)
    for message, shape in ((first, "(2, 3)"), (second, "(2, 4)")):
        assert "(name, shape, dtype) differ: rank(s) [1] differ from rank(s) [0]" in message, message
        assert f"weight {shape} torch.float32" in message


def buffer_layout_body(rank, world_size):
    m = nn.Linear(3, 2)                 # the same parameters everywhere; a normalizer of another size on rank 1
    m.register_buffer("obs_mean", torch.zeros(3 + rank, dtype=torch.float64))
    try:
        broadcast_module(m)
    except RuntimeError as e:
        return str(e)
    return f"no error, obs_mean {tuple(m.obs_mean.shape)}"


@pytest.mark.slow
def test_ranks_whose_buffers_alone_differ_in_shape_stop_before_the_broadcast():
    """The layout compared before the broadcast covers the buffers too (normalizer statistics are buffers): with equal
    parameters, a buffer of another size on rank 1 must stop every rank, naming it, not be filled by gloo from rank
    0's smaller tensor."""
    first, second = run_ranks(buffer_layout_body, 2)
    for message, shape in ((first, "(3,)"), (second, "(4,)")):
        assert "(name, shape, dtype) differ: rank(s) [1] differ from rank(s) [0]" in message, message
        assert f"obs_mean {shape} torch.float64" in message, message


# ---- dist/buffers.py -------------------------------------------------------------------------------------

class Rules(nn.Module):
    BUFFER_POLICY = {"b_*": "broadcast", "m_*": "mean", "keep": "local"}

    def __init__(self, rank):
        super().__init__()
        self.register_buffer("b_float", torch.tensor([1.0, 2.0]) + 10 * rank)
        self.register_buffer("b_count", torch.tensor(3 + rank, dtype=torch.int32))
        self.register_buffer("m_float", torch.tensor([4.0, 6.0, 8.0]) * (rank + 1))
        self.register_buffer("keep", torch.tensor([float(rank)]))


def rules_body(rank, world_size):
    comm.reset_ledger()
    m = Rules(rank)
    sync_buffers(m, resolve_buffer_policy(m, m.BUFFER_POLICY))
    return {k: v.clone() for k, v in m.named_buffers()}, comm.ledger_snapshot()


@pytest.mark.slow
def test_sync_buffers_counts_its_collectives_as_buffers_as_its_plan_says():
    rows = buffer_plan_rows(Rules(0), resolve_buffer_policy(Rules(0), Rules.BUFFER_POLICY))
    assert [(r.collective, r.call_bytes) for r in rows] == [("broadcast", [8, 4]), ("all_reduce", [12])]
    for rank, (bufs, ledger) in enumerate(run_ranks(rules_body, 2)):
        assert torch.equal(bufs["b_float"], torch.tensor([1.0, 2.0]))
        assert bufs["b_count"].dtype == torch.int32 and bufs["b_count"].item() == 3
        assert torch.equal(bufs["m_float"], torch.tensor([6.0, 9.0, 12.0]))      # mean of 1x and 2x
        assert bufs["keep"].item() == rank
        assert ledger == {"buffers": (3, 8 + 4 + 12)}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_a_mean_rule_on_any_non_floating_buffer_is_a_start_up_error(dtype):
    m = nn.Module()
    m.register_buffer("flags", torch.zeros(2, dtype=dtype))
    with pytest.raises(ValueError, match=r"^buffers \['flags'\] are integer but declared `mean`"):
        resolve_buffer_policy(m, {"flags": "mean"})
    assert resolve_buffer_policy(m, {"flags": "broadcast"}) == {"flags": "broadcast"}
