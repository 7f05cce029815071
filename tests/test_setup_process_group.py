"""Joining and leaving the process group (dist/setup.py): under torchrun's agent store every rank, rank 0 included,
joins as a client of the agent's store, and shutdown() collects unreachable objects before it destroys the groups.
No group forms: torch.distributed's calls are recorded or stood in for."""

from dist.setup import init_distributed
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
