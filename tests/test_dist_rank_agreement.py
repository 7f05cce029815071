"""Checks that every rank holds the same thing, on 2 or 3 gloo ranks: verify_replicas compares the buffers its rules
declare broadcast, mean or merge and no local one, and names ranks that hold other tensors; same_names_everywhere
takes the order of the names into account; same_env_state refuses an entry of another dtype as a layout difference,
compares every entry's values and names only the ranks that differ; the rollout ranks' env states are compared
bitwise, a 0-dim entry too."""

import pytest
import torch
from torch import nn

from dist.batches import to_bytes
from dist.buffers import resolve_buffer_policy
from dist.checkpoint import same_env_state
from dist.errors import RunError
from dist.verify import same_names_everywhere, verify_replicas
from rollout_ranks import unpack_team_states
from tests.multirank import run_ranks
from tests.test_sync_contract import verify_message


class FourRules(nn.Module):
    """One buffer per rule, the same values on every rank (one seed for the parameter)."""
    BUFFER_POLICY = {"shared": "broadcast", "averaged": "mean", "stats.*": "merge", "per_env": "local"}

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(2, 1)
        self.register_buffer("shared", torch.tensor([1.0, 2.0]))
        self.register_buffer("averaged", torch.tensor([0.5]))
        self.register_buffer("per_env", torch.zeros(3))
        self.stats = nn.Module()
        self.stats.register_buffer("count", torch.tensor(7.0, dtype=torch.float64))


def one_buffer_apart_body(rank, world_size):
    """For each buffer in turn, rank 1 moves it by one ulp; returns what verify_replicas (given the module's rules)
    raised for each, or "no error"."""
    said = {}
    for name in ("shared", "averaged", "stats.count", "per_env"):
        m = FourRules()
        if rank == 1:
            b = m.get_buffer(name)
            b.copy_(torch.nextafter(b, b + 1))
        try:
            verify_replicas(m, buffer_rules=resolve_buffer_policy(m, m.BUFFER_POLICY))
            said[name] = "no error"
        except RuntimeError as error:
            said[name] = str(error)
    return said


@pytest.mark.slow
def test_the_replica_check_covers_broadcast_mean_and_merge_buffers_by_the_rules_given_and_no_local_one():
    """verify_replicas(module, buffer_rules=...) checks the buffers the rules declare broadcast, mean or merge (the
    normalizers' statistics in the model are merge), each named when it alone differs on rank 1; a local one (a
    per-env running return) differs by design and passes."""
    for said in run_ranks(one_buffer_apart_body, 2, timeout=60):
        assert said["per_env"] == "no error"
        for name in ("shared", "averaged", "stats.count"):
            assert said[name].startswith("parameters diverged across ranks: rank(s) [1] differ from rank(s) [0] "
                                         "(checksums "), (name, said[name])
            assert said[name].endswith(f"; tensors that differ: [{name!r}]"), (name, said[name])


def extra_head_body(rank, world_size):
    """The last rank builds one more layer than the others; returns what verify_replicas raised, or "no error"."""
    torch.manual_seed(0)
    return verify_message(nn.Sequential(nn.Linear(2, 2), *([nn.Linear(2, 1)] if rank == world_size - 1 else [])))


@pytest.mark.slow
def test_a_rank_holding_other_tensors_is_named_as_such_not_aborted_by_the_per_tensor_gather():
    """Rank 2 of 3 holds 4 tensors, the others 2: every rank raises, naming rank 2 and the layout difference, with
    this rank's tensor count. The per-tensor all-gather that names differing values had gathered 2 int64 against 4:
    gloo terminated rank 2 ("Received data size doesn't match expected size"), ranks 0 and 1 waited out the timeout.
    Mutant: no layout check before differing_tensors in verify_replicas."""
    said = run_ranks(extra_head_body, 3, timeout=60)
    for rank, text in enumerate(said):
        assert text.startswith("parameters are not the same tensors (names, shapes, dtypes) on every rank: rank(s) [2] "
                               "differ from rank(s) [0, 1] (checksums "), text
        checks = 4 if rank == 2 else 2
        assert text.endswith(f"; the ranks built other modules (this rank checks {checks} tensors)"), text


def names_in_order_body(rank, world_size):
    """Rank 1 lists the same names as rank 0 in another order; returns what same_names_everywhere raised."""
    try:
        same_names_everywhere(["w", "b"] if rank == 0 else ["b", "w"], "shapes", "the layouts differ", "build alike")
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_the_same_names_in_another_order_are_not_the_same_list():
    """A packed collective pairs tensors by position (the model's layout at start-up is checked this way): the same
    names in another order on rank 1 must stop every rank, naming rank 1."""
    for said in run_ranks(names_in_order_body, 2, timeout=60):
        assert said.startswith("the layouts differ: rank(s) [1] differ from rank(s) [0] (checksums "), said
        assert said.endswith("); build alike"), said


def env_states_body(rank, world_size):
    """Two saves' env states on 3 ranks: (a) rank 1's `steps` int32 zeros where the others hold float32 zeros (the
    same bytes); (b) rank 1's `level` (the last entry) other values, ranks 0 and 2 the same; (c) an entry on rank 1
    alone. Returns what same_env_state raised at each."""
    said = []
    for state in ({"steps": torch.zeros(2, dtype=torch.int32 if rank == 1 else torch.float32)},
                  {"steps": torch.zeros(2), "level": torch.tensor([1.0, 2.0 if rank == 1 else 1.0])},
                  {"steps": torch.zeros(2)} if rank == 1 else {}):
        try:
            same_env_state(state)
            said.append("no error")
        except RunError as error:
            said.append(str(error))
    return said


@pytest.mark.slow
def test_env_state_of_another_dtype_is_a_layout_difference_and_only_the_ranks_that_differ_are_named():
    """An entry of another dtype on one rank is refused as a layout difference even where its bytes equal rank 0's
    (zeros: a checkpoint would have handed rank 1 a float32 entry for its int32 one); the values of every entry are
    compared, the last one too; and of 3 ranks only rank 1, whose values differ, is named (rank 2 holds rank 0's). A
    rank without entries says so ("none")."""
    for rank, (dtype_apart, values_apart, only_one) in enumerate(run_ranks(env_states_body, 3, timeout=60)):
        assert dtype_apart.startswith("env.state_dict() has other entries, shapes or dtypes on rank(s) [1] than on "
                                      "rank 0 (this rank's: steps); "), dtype_apart
        assert values_apart.startswith("env.state_dict() differs across ranks in 'level' (nested names joined by "
                                       "'/'): rank(s) [1] hold other values than rank 0, whose state a checkpoint "
                                       "keeps; "), values_apart
        assert only_one.startswith("env.state_dict() has other entries, shapes or dtypes on rank(s) [1] than on rank 0 "
                                   f"(this rank's: {'steps' if rank == 1 else 'none'}); "), only_one


def test_rollout_ranks_env_states_with_a_scalar_entry_are_compared():
    """An env state may hold a 0-dim tensor (a curriculum level): the bitwise comparison of the rollout ranks' states
    flattens it first (a 0-dim float32 has no uint8 view), keeps it when equal and names it when not.

    Mutant: .reshape(-1) dropped before .view(torch.uint8) in unpack_team_states."""
    def blob(level):
        state = {"rng/env": torch.zeros(4, dtype=torch.uint8), "env/level": torch.tensor(level)}
        return to_bytes(state), {name: (tuple(v.shape), v.dtype) for name, v in state.items()}

    (same, layout), (other, _) = blob(2.5), blob(3.0)
    spec = {"state_bytes": same.numel(), "state_layout": layout}
    rngs, env = unpack_team_states(torch.cat([same, same]), spec)
    assert len(rngs) == 2 and env["level"].shape == () and env["level"].item() == 2.5
    with pytest.raises(RunError, match=r"^env.state_dict\(\) differs across rollout ranks in 'level' \(nested names "
                                       r"joined by '/'\): rollout rank\(s\) \[1\] hold other values"):
        unpack_team_states(torch.cat([same, other]), spec)
