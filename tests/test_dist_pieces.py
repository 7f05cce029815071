"""The per-iteration state syncs (coalesced buffer collectives, global mean/std in float64), the gradient
buckets' launch rules, the learner/rollout roles and the sync plan's expected ledger, against values
computed by hand; float64 and int64 buffers and parameters keep every bit through the buffer sync and the
start-up broadcast."""

import pytest
import torch
from torch import nn

from dist.buffers import buffer_plan_rows, resolve_buffer_policy, sync_buffers
from dist.grad_sync import GradSync
from dist.params import broadcast_module
from tests.multirank import run_ranks


# ---- dist/buffers.py ---------------------------------------------------------------------------------

class ManyBuffers(nn.Module):
    """Several buffers per rule and dtype, so each coalesced collective carries more than one of them."""

    BUFFER_POLICY = {"b_*": "broadcast", "m_*": "mean", "keep": "local"}

    def __init__(self, rank):
        super().__init__()
        r = float(rank)
        self.register_buffer("b_first", torch.tensor([10.0, 11.0]) + 100 * r)
        self.register_buffer("b_second", torch.tensor([[20.0, 21.0], [22.0, 23.0]]) + 100 * r)
        self.register_buffer("b_double", torch.tensor([30.0], dtype=torch.float64) + 100 * r)
        self.register_buffer("b_steps", torch.tensor(5 + rank))                 # int64: broadcast
        self.register_buffer("m_first", torch.tensor([1.0, 2.0, 3.0]) * (r + 1))
        self.register_buffer("m_second", torch.tensor([4.0]) * (r + 1))
        self.register_buffer("m_double", torch.tensor([7.0, 8.0], dtype=torch.float64) * (r + 1))
        self.register_buffer("keep", torch.tensor([r]))


def many_buffers_body(rank, world_size):
    m = ManyBuffers(rank)
    sync_buffers(m, resolve_buffer_policy(m, m.BUFFER_POLICY))
    return {k: v.clone() for k, v in m.named_buffers()}


@pytest.mark.slow
def test_sync_buffers_puts_each_buffer_of_a_coalesced_collective_back_in_place():
    """Per rule and dtype the buffers travel in one flat tensor; each must get back its own slice: rank 0's
    value for `broadcast`, the mean over ranks (1, 2, 3 times the base) for `mean`, its own for `local`."""
    results = run_ranks(many_buffers_body, 3)
    rank0 = ManyBuffers(0)
    for rank, bufs in enumerate(results):
        for name in ("b_first", "b_second", "b_double", "b_steps"):
            assert torch.equal(bufs[name], getattr(rank0, name)), name
        for name in ("m_first", "m_second", "m_double"):
            torch.testing.assert_close(bufs[name], getattr(rank0, name) * 2.0, msg=name)   # mean of 1x, 2x, 3x
            assert bufs[name].dtype == getattr(rank0, name).dtype
        assert bufs["keep"].item() == rank


def buffers_in_a_group_body(rank, world_size):
    """Ranks 0 and 1 sync their buffers in their own group (as learners do beside a rollout rank, here rank 2)."""
    from dist import comm
    group = torch.distributed.new_group([0, 1])          # collective: every rank makes it
    if rank == 2:
        return None
    comm.use_group(group)
    try:
        m = ManyBuffers(rank)
        sync_buffers(m, resolve_buffer_policy(m, m.BUFFER_POLICY))
        return {k: v.clone() for k, v in m.named_buffers()}
    finally:
        comm.use_group(None)


@pytest.mark.slow
def test_a_mean_buffer_is_averaged_over_the_group_in_use_not_the_world():
    """Two learners of a 3-rank world: the mean of 1x and 2x the base is 1.5x (divided by the group's 2 ranks, not
    the world's 3); a broadcast buffer is rank 0's."""
    results = run_ranks(buffers_in_a_group_body, 3)
    rank0 = ManyBuffers(0)
    assert results[2] is None
    for bufs in results[:2]:
        for name in ("m_first", "m_second", "m_double"):
            torch.testing.assert_close(bufs[name], getattr(rank0, name) * 1.5, msg=name)
        assert torch.equal(bufs["b_first"], rank0.b_first)


def test_buffer_plan_rows_give_the_bytes_of_each_coalesced_collective_by_hand():
    """One call per rule and dtype, in the order dtypes first appear: broadcast fp32 (2 + 4 elements x 4 bytes),
    fp64 (1 x 8), int64 (1 x 8); mean fp32 ((3 + 1) x 4), fp64 (2 x 8); `local` crosses nothing."""
    m = ManyBuffers(0)
    rows = buffer_plan_rows(m, resolve_buffer_policy(m, m.BUFFER_POLICY))
    assert [(r.purpose, r.collective, r.cadence, r.call_bytes) for r in rows] == [
        ("buffers", "broadcast", "iteration", [24, 8, 8]), ("buffers", "all_reduce", "iteration", [16, 16])]
    assert buffer_plan_rows(m, resolve_buffer_policy(m, {"*": "local"})) == []


def test_a_buffer_matched_by_patterns_with_different_rules_is_a_start_up_error():
    m = ManyBuffers(0)
    with pytest.raises(ValueError, match=r"'m_first' matches patterns with different rules \['local', 'mean'\]"):
        resolve_buffer_policy(m, {**m.BUFFER_POLICY, "m_f*": "local"})
    assert resolve_buffer_policy(m, {**m.BUFFER_POLICY, "m_f*": "mean"})["m_first"] == "mean"   # agreeing: fine



# ---- dist/stats.py -----------------------------------------------------------------------------------

def test_global_mean_std_of_float32_data_accumulates_in_float64():
    """Advantages arrive in float32; their mean and squared deviations must be summed in float64. Summed in
    float32, a mean of 1e4 carries an error near 1e-3, which shifts a 1e-2 std by about 2e-4 (relative)."""
    from dist.stats import global_mean_std
    g = torch.Generator().manual_seed(0)
    x = (1e4 + 1e-2 * torch.randn(10000, generator=g, dtype=torch.float64)).float()
    ref = x.double().numpy()
    mean, std = global_mean_std(x)
    assert mean.dtype == std.dtype == torch.float32
    assert std.item() == pytest.approx(ref.std(), rel=1e-6)
    assert mean.item() == pytest.approx(ref.mean(), rel=1e-7)   # float32 rounding of the float64 mean


# ---- dist/grad_sync.py -------------------------------------------------------------------------------

class RecordingGradSync(GradSync):
    """Snapshots each bucket at the moment its all-reduce is issued: what the collective would read."""

    def _all_reduce(self, buffer, async_op):
        self.launched.append(buffer.clone())
        return super()._all_reduce(buffer, async_op)


@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_each_bucket_is_all_reduced_only_once_its_whole_minibatch_gradient_is_in_it(mode):
    """Bucketed, an all-reduce launches from a gradient hook while backward still runs: launched one
    gradient early, it would carry a partial sum, and whether gloo/NCCL read the buffer before or after the
    last gradient lands is a race (the multi-rank tests can pass by luck). Deterministic here: every bucket
    is issued exactly once per step, in order, after the armed (last) micro-batch, holding the complete
    accumulated gradient (the autograd gradient of the mean loss) and, in the last bucket, the extras."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    sync = RecordingGradSync(net.parameters(), mode, bucket_mb=1000 / 2**20, num_extras=2)
    sync.launched = []
    if mode == "bucketed":
        assert len(sync.buckets) >= 3 and any(len(b.params) > 1 for b in sync.buckets)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(9, 6, generator=g), torch.randn(9, 3, generator=g)
    sync.zero_grad()
    for i, (xm, ym) in enumerate(zip(x.chunk(3), y.chunk(3))):
        if i == 2:
            sync.arm(torch.tensor([0.25, 9.0]))
        ((net(xm) - ym).square().mean() / 3).backward()
    sync.synchronize()
    expected = torch.autograd.grad((net(x) - y).square().mean(), list(net.parameters()))
    assert len(sync.launched) == len(sync.buckets)
    for snapshot, bucket in zip(sync.launched, sync.buckets):
        offset = 0
        for p in bucket.params:
            i = next(j for j, q in enumerate(net.parameters()) if q is p)
            torch.testing.assert_close(snapshot[offset:offset + p.numel()].view_as(p), expected[i],
                                       rtol=1e-5, atol=1e-7)
            offset += p.numel()
    assert sync.launched[-1][-2:].tolist() == [0.25, 9.0]


class ArrivalRecordingGradSync(GradSync):
    """Notes, for each bucket launch, how many of the armed backward's gradients had arrived by then."""

    def _all_reduce(self, buffer, async_op):
        self.arrived_at_launch.append(len(self._armed_received))
        return super()._all_reduce(buffer, async_op)


def test_bucketed_all_reduces_start_while_backward_is_still_running():
    """Backward produces the last layer's gradients first, so buckets are filled from the last registered
    parameter backwards: the first bucket holds the output layer and its all-reduce launches before the first
    layer's gradients exist (the overlap `bucketed` is for). Filled in registration order, the first bucket
    would hold the first layer, whose gradients come last, and every all-reduce would wait for the whole
    backward, as in `flat`."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    sync = ArrivalRecordingGradSync(net.parameters(), "bucketed", bucket_mb=1000 / 2**20)
    sync.arrived_at_launch = []
    assert len(sync.buckets) == 3
    assert {id(p) for p in sync.buckets[0].params} >= {id(net[4].weight), id(net[4].bias)}
    assert {id(p) for p in sync.buckets[-1].params} == {id(net[0].weight), id(net[0].bias)}
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    sync.zero_grad()
    sync.arm()
    net(x).square().mean().backward()
    sync.synchronize()
    assert len(sync.arrived_at_launch) == 3
    assert sync.arrived_at_launch[0] < 6 and sync.arrived_at_launch[1] < 6    # launched during backward


def test_flat_issues_its_one_all_reduce_at_synchronize_not_from_a_gradient_hook():
    """flat is the no-overlap path (one all-reduce per step, issued at synchronize(), after backward): the armed
    backward launches nothing, even once every gradient of its one bucket has arrived."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    sync = ArrivalRecordingGradSync(net.parameters(), "flat")
    sync.arrived_at_launch = []
    sync.zero_grad()
    sync.arm()
    net(torch.randn(5, 6, generator=torch.Generator().manual_seed(1))).square().mean().backward()
    assert sync.arrived_at_launch == []
    sync.synchronize()
    assert sync.arrived_at_launch == [4]       # once, at synchronize, with all 4 gradients in


def test_a_bucket_is_filled_up_to_and_including_the_cap():
    """Buckets hold at most bucket_mb: two 1 KB gradients with a 2 KB cap share one bucket (one all-reduce)."""
    params = [nn.Parameter(torch.zeros(256)), nn.Parameter(torch.zeros(256))]
    assert GradSync(params, "bucketed", bucket_mb=2048 / 2**20).bucket_bytes() == [2048]      # exactly the cap
    assert GradSync(params, "bucketed", bucket_mb=2047 / 2**20).bucket_bytes() == [1024, 1024]
    # Bytes of the parameters' own dtype: two float64 gradients of 128 elements are 1 KB each as well.
    params = [nn.Parameter(torch.zeros(128, dtype=torch.float64)), nn.Parameter(torch.zeros(128, dtype=torch.float64))]
    assert GradSync(params, "bucketed", bucket_mb=2048 / 2**20).bucket_bytes() == [2048]
    assert GradSync(params, "bucketed", bucket_mb=2047 / 2**20).bucket_bytes() == [1024, 1024]


def test_a_gradient_from_an_earlier_micro_batch_counts_as_received():
    """unused="error" asks whether a parameter got a gradient in the STEP (the whole minibatch), not in its
    last micro-batch: a head used only by the first micro-batch's samples has a real, non-zero gradient."""
    torch.manual_seed(0)
    trunk, head_a, head_b = nn.Linear(3, 4), nn.Linear(4, 1), nn.Linear(4, 1)
    params = [*trunk.parameters(), *head_a.parameters(), *head_b.parameters()]
    sync = GradSync(params, "flat", unused="error")
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    sync.zero_grad()
    (head_b(trunk(x[:2])).square().mean() / 2).backward()          # micro-batch 1 uses head b
    sync.arm()
    (head_a(trunk(x[2:])).square().mean() / 2).backward()          # micro-batch 2 (armed) uses head a only
    sync.synchronize()
    expected = torch.autograd.grad(head_b(trunk(x[:2])).square().mean() / 2, list(head_b.parameters()))
    for p, e in zip(head_b.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
        assert p.grad.abs().sum() > 0


# ---- dist/roles.py ----------------------------------------------------------------------------------

def test_roles_teams_seeds_and_description_by_hand():
    """6 ranks with 4 rollout ranks: learners 0, 1; learner 0 owns ranks 2, 3 and learner 1 ranks 4, 5 (module
    docstring: L + l*K/L ... L + (l+1)*K/L - 1); rollout rank L + j has rollout_index j (it seeds like colocated
    rank j); colocated runs have every rank learn."""
    from dist.roles import Roles, assign_roles
    roles = [Roles(r, 6, 2, 4) for r in range(6)]
    assert [r.is_learner for r in roles] == [True, True, False, False, False, False]
    assert [r.rollout_index for r in roles[2:]] == [0, 1, 2, 3]
    assert roles[0].team_of(0) == [0, 2, 3] and roles[0].team_of(1) == [1, 4, 5]
    assert roles[0].describe() == ("2 learner(s) + 4 rollout rank(s): learner 0 <- rollout ranks [2, 3]; "
                                   "learner 1 <- rollout ranks [4, 5]")
    one = Roles(1, 2, 1, 1)
    assert not one.colocated and one.team_of(0) == [0, 1] and not one.is_learner and one.rollout_index == 0
    co = assign_roles(3, 4, 0)
    assert co.colocated and co.is_learner and co.per_learner == 0
    assert co.describe() == "4 colocated rank(s): each collects and learns"


def test_every_rank_makes_the_same_groups_in_order_and_keeps_its_own_team_s(monkeypatch):
    """6 ranks, 4 rollout ranks, --dist.timeout-s 5: every rank (new_group is collective) makes, in this order, the
    learners' group [0, 1], the rollout ranks' [2, 3, 4, 5], then per learner its team's batches and weights groups
    (two distinct groups each: [0, 2, 3] twice, [1, 4, 5] twice), all with the timeout; each rank keeps its team's
    two. new_group is recorded, not run: a group is its call's number."""
    from datetime import timedelta

    import torch.distributed as torch_dist
    from dist.roles import assign_roles
    expected = [[0, 1], [2, 3, 4, 5], [0, 2, 3], [0, 2, 3], [1, 4, 5], [1, 4, 5]]
    for rank in range(6):
        calls = []
        monkeypatch.setattr(torch_dist, "new_group", lambda ranks, timeout: calls.append((ranks, timeout))
                            or len(calls) - 1)
        roles = assign_roles(rank, 6, 4, timeout_s=5.0)
        assert calls == [(ranks, timedelta(seconds=5.0)) for ranks in expected], rank
        mine = (2, 3) if rank in (0, 2, 3) else (4, 5)
        assert (roles.learner_group, roles.rollout_group, roles.batches_group, roles.weights_group) == (0, 1, *mine)
        assert roles.team == expected[mine[0]], rank
    monkeypatch.setattr(torch_dist, "new_group", lambda *a, **kw: pytest.fail("a colocated run makes no group"))
    assert assign_roles(3, 4, 0).team == []


def _silent_partner_in_a_team_group(rank, world_size):
    """Rank 0 waits for a message rank 1 never sends, in their team's batches group made with a 2 s timeout;
    rank 1 waits (on the world group, torch's long default) until rank 0 says how its receive ended."""
    import torch.distributed as dist
    from dist.roles import assign_roles
    roles = assign_roles(rank, world_size, 1, timeout_s=2.0)
    if rank == 1:
        return dist.recv(torch.zeros(1), src=0)
    try:
        dist.recv(torch.zeros(1), src=1, group=roles.batches_group)
        outcome = "received"
    except RuntimeError as error:           # gloo: a timeout (DistBackendError is a RuntimeError)
        outcome = "timed out" if "timed out" in str(error).lower() or "timeout" in str(error).lower() else str(error)
    dist.send(torch.zeros(1), dst=1)
    return outcome


@pytest.mark.slow
def test_rollout_groups_wait_for_a_peer_only_as_long_as_dist_timeout_s():
    """--dist.timeout-s bounds every wait in the rollout layout's groups too (new_group does not inherit the
    world group's timeout: without passing it, a stalled partner held the other rank for 30 minutes)."""
    outcome, _ = run_ranks(_silent_partner_in_a_team_group, 2, timeout=60)
    assert outcome == "timed out"


# ---- dist/plan.py -----------------------------------------------------------------------------------

def test_plan_occurrences_and_expected_ledger_by_hand():
    """Calls and bytes a plan predicts, by hand: setup once; iteration every iteration; `every K` floor(n/K)
    times; a checkpoint row also at the final iteration when that is not a multiple of the interval; rounds
    multiply calls and bytes; collectives drop out for a one-member group while point-to-point stays."""
    from dist.plan import PlanRow, expected_ledger, format_plan
    rows = [PlanRow("a", "r", "broadcast", "setup", [100, 20]),
            PlanRow("b", "r", "all_reduce", "iteration", [8], rounds=3),
            PlanRow("c", "r", "send", "every", [5], every=4),
            PlanRow("d", "r", "all_gather", "checkpoint", [7], every=4),
            PlanRow("e", "r", "-", "-", [])]
    assert rows[1].calls == 3
    assert expected_ledger(rows, 10) == {"a": [2, 120], "b": [30, 240], "c": [2, 10], "d": [2, 14]}
    assert expected_ledger(rows, 10, final_iteration=10) == {"a": [2, 120], "b": [30, 240], "c": [2, 10], "d": [3, 21]}
    assert expected_ledger(rows, 8, final_iteration=8)["d"] == [2, 14]
    assert expected_ledger(rows, 10, collectives=False) == {"c": [2, 10]}
    everyone = PlanRow("f", "r", "all_gather", "setup", [24], all_ranks=True)   # runs before the learners' group exists
    assert expected_ledger([*rows, everyone], 10, collectives=False) == {"c": [2, 10], "f": [1, 24]}
    text = format_plan([PlanRow("p", "r", "send", "iteration", [1] * 4),
                        PlanRow("q", "r", "send", "iteration", [1024] * 5),
                        PlanRow("s", "r", "send", "iteration", [1023, 1024, 2 ** 20], rounds=2)], 1)
    assert "1 B + 1 B + 1 B + 1 B" in text and "5 messages, 5.0 KB in all" in text
    assert "1023 B + 1.0 KB + 1.0 MB  (x2 steps)" in text
    assert "at world size 1 none of these collectives runs: the rows say what they carry on more ranks" in text
    assert text.startswith("sync plan (1 rank; ") and format_plan(rows, 2).startswith("sync plan (2 ranks)")
    one_learner = "one learner: its collectives run in a group of one, so only those over all ranks and point-to-point"
    assert one_learner in format_plan(rows, 2, 1).splitlines()[0]         # 1 learner + 1 rollout rank
    assert "all_gather (all ranks)" in format_plan([everyone], 2, 1) and "(all ranks)" not in format_plan([everyone], 2)
    assert "collective" not in format_plan(rows, 3, 2).splitlines()[0]       # 2 learners: they do


def test_a_resumed_run_s_plan_counts_the_multiples_of_every_in_its_own_iterations():
    """From checkpoint iteration 6, 10 more iterations are 7..16: an `every 4` row runs after 8, 12 and 16 (3 times,
    not 10 // 4 = 2); from 3, one iteration is iteration 4 (once, not 1 // 4 = 0). A checkpoint row the same, plus
    the final save when the last iteration (17) is no multiple of 4."""
    from dist.plan import PlanRow, expected_ledger
    every = PlanRow("c", "r", "send", "every", [5], every=4)
    saves = PlanRow("d", "r", "all_gather", "checkpoint", [7], every=4)
    assert [every.occurrences(10, start=6), every.occurrences(1, start=3), every.occurrences(3, start=4)] == [3, 1, 0]
    assert expected_ledger([every, saves], 10, final_iteration=16, start=6) == {"c": [3, 15], "d": [3, 21]}
    assert expected_ledger([every, saves], 11, final_iteration=17, start=6) == {"c": [3, 15], "d": [4, 28]}


def test_a_gather_is_a_collective_that_a_one_member_group_does_not_run():
    """gather runs in the group like the other collectives: with collectives=False (one learner) it drops out, as
    all_reduce does, while a send stays."""
    from dist.plan import PlanRow, expected_ledger
    rows = [PlanRow("checkpoint", "r", "gather", "setup", [16]), PlanRow("metrics", "r", "all_reduce", "setup", [8]),
            PlanRow("batches", "r", "send", "setup", [4])]
    assert expected_ledger(rows, 1, collectives=False) == {"batches": [1, 4]}
    assert expected_ledger(rows, 1) == {"checkpoint": [1, 16], "metrics": [1, 8], "batches": [1, 4]}


class Wide(nn.Module):
    """float64 and int64 state whose values have no float32 twin (2**53 + 2 and 1 + 2**-40)."""
    BUFFER_POLICY = {"b_*": "broadcast", "m_*": "mean"}

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor([1 + 2**-40, -3.0], dtype=torch.float64))
        self.register_buffer("b_double", torch.tensor([1 + 2**-40, 2.0**53 + 2], dtype=torch.float64))
        self.register_buffer("b_steps", torch.tensor([2**53 + 1], dtype=torch.int64))
        self.register_buffer("m_double", torch.tensor([1 - 2**-45], dtype=torch.float64))


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in [*m.named_parameters(), *m.named_buffers()]}


def test_buffer_sync_keeps_every_bit_and_dtype_of_float64_and_int64_buffers():
    """Normalizer statistics are float64 and step counters int64: the coalesced tensor must travel in the buffers'
    own dtype, or a round trip through float32 rounds them (here on one rank, where the values must come back
    exactly as they were)."""
    m = Wide()
    before = _state(m)
    sync_buffers(m, resolve_buffer_policy(m, m.BUFFER_POLICY))
    after = _state(m)
    for name, value in before.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name


def test_the_start_up_broadcast_keeps_every_bit_and_dtype_of_float64_and_int64_tensors():
    """broadcast_module coalesces per dtype: a float64 parameter or an int64 counter must not pass through float32
    (on one rank every tensor must come back bit for bit)."""
    m = Wide()
    before = _state(m)
    broadcast_module(m)
    after = _state(m)
    for name, value in before.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name
