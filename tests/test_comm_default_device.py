"""A copy of dist/comm.py in another project (README's Layout: grad_sync/stats with comm and plan) has no dist.setup to
call set_device: under NCCL, dist.stats' staged sums must still go to the GPU, which NCCL needs (it refuses host
tensors), and under gloo or without a process group to the host, as before."""

import importlib.util
import os

import torch
import torch.distributed as torch_dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fresh_copy():
    """dist/comm.py loaded as another module, as a copy would be: set_device never called on it."""
    spec = importlib.util.spec_from_file_location("copied_comm", os.path.join(REPO, "dist", "comm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_unset_device_follows_the_backend_of_the_process_group(monkeypatch):
    copied = fresh_copy()
    assert copied.device() == torch.device("cpu")              # no process group: the host
    backend = ["nccl"]
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch_dist, "get_backend", lambda group=None: backend[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)   # what torch.cuda.set_device(LOCAL_RANK) chose
    assert copied.device() == torch.device("cuda", 3)
    backend[0] = "gloo"
    assert copied.device() == torch.device("cpu")


def test_set_device_wins_over_the_backend(monkeypatch):
    copied = fresh_copy()
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch_dist, "get_backend", lambda group=None: "nccl")
    copied.set_device("cpu")                                   # dist.setup's choice is kept as it was
    assert copied.device() == torch.device("cpu")


def test_an_unset_device_follows_the_backend_of_the_group_in_use_not_the_world_s(monkeypatch):
    """A copy that runs its collectives in a gloo group (use_group) inside an NCCL world stages them on the host:
    the backend asked is the current group's."""
    copied = fresh_copy()
    gloo_group = object()
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch_dist, "get_backend", lambda group=None: "gloo" if group is gloo_group else "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert copied.device() == torch.device("cuda", 1)              # the whole NCCL world
    copied.use_group(gloo_group)
    assert copied.device() == torch.device("cpu")
