"""Joining and leaving the process group (dist/setup.py): under torchrun's agent store every rank, rank 0 included,
joins as a client of the agent's store, and shutdown() collects unreachable objects before it destroys the groups;
torchrun's launch variables read or refused with the whole message, the device and backend each rank gets (CUDA
faked: nothing runs on a GPU), one process's backend `none`, a second node's global and local ranks, and the seeds of
python, numpy and torch. No group forms: torch.distributed's calls are recorded or stood in for."""

import random

import numpy as np
import pytest
import torch
import torch.distributed as torch_dist

from dist import comm
from dist.errors import UsageError
from dist.setup import init_distributed, launch_int, resolve_device, seed_everything
from tests.test_rollout_checkpoint_rules import joined  # noqa: F401 (a fixture: torchrun's variables, recorded joins)


def test_rank_0_under_the_agent_store_joins_as_a_client_too(joined):
    """Under torchrun's agent store the agent serves the store on MASTER_PORT: every rank, rank 0 included, is a
    client (is_master False). Rank 0 as master would try to serve on the port the agent already holds. The existing
    test joins as rank 1, where `is_master=rank == 0` passed as well."""
    monkeypatch, calls = joined
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    init_distributed("gloo", "cpu", timeout_s=9.0)
    args, kwargs = calls["store"]
    assert args == ("10.1.2.3", 29411, 2) and kwargs["is_master"] is False
    assert calls["group"]["rank"] == 0


def test_shutdown_collects_unreachable_objects_before_it_destroys_the_groups(monkeypatch):
    """shutdown()'s docstring: gloo work held by a reference cycle must be destroyed while the group still exists, so
    unreachable objects are collected first. A cycle whose finalizer records whether the group was still there (the
    collector disabled, so that only shutdown's own collection can free it)."""
    import gc

    import torch.distributed as torch_dist
    from dist.setup import shutdown
    events = []
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: "destroyed" not in events)
    monkeypatch.setattr(torch_dist, "destroy_process_group", lambda: events.append("destroyed"))

    class HeldWork:          # stands for a gloo work object in a cycle through a gradient hook
        def __del__(self):
            events.append("collected" if torch_dist.is_initialized() else "collected after the group")
    enabled = gc.isenabled()
    gc.disable()
    try:
        work = HeldWork()
        work.cycle = work
        del work
        shutdown()
    finally:
        if enabled:
            gc.enable()
    assert events == ["collected", "destroyed"]


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
