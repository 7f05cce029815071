"""Gaps found by a second mutation audit of dist/grad_sync.py (the lines changed since af08ece: gradient views with the
parameter's strides, _dense, the one-device check, the backward-after-synchronize refusal, unused="zero" launching at
synchronize(), the takeover check) and dist/setup.py (the lines changed since 0296cbd: the WORLD_SIZE wording, the
rendezvous notice and RunError, the allocator settings): each test below fails on a hand-made mutation that every
earlier test let through. Expected values are written by hand or come from plain autograd.

77 mutants (45 of grad_sync.py, 32 of setup.py): 52 killed by earlier tests (one, bucketed
unused="zero" launching from backward, only by a slow test of test_grad_sync_layouts.py: it is pinned here once more,
without ranks), 21 pinned here, 3 equivalent, 1 not worth a test.

Pinned: a parameter with overlaps (stride 0), or with a gap in a dimension of size 2, refused, the whole message with
its (.contiguous()) fix; a dense 3-D parameter, contiguous or permuted, taken; unused="zero" bucketed launching every
bucket at synchronize(), not from backward; synchronize() after remove_hooks() refused (its views are intact); the
takeover refusal naming parameter #0 and its fix; the whole messages of a replaced .grad, a missing gradient and a
second armed backward; the rendezvous notice's 10 s, daemon timer, start, cancel, wording and flush; the rendezvous
RunError quoting torch's message on one line without its final period, the timeout with :g, torch's error as cause.

Equivalent: the one-device check on device.type instead of str(device) (differs only for two devices of one type,
cuda:0 and cuda:1: no such pair on a CPU or one-GPU machine); mallopt(M_MMAP_MAX, 1) for 0 (importing torch leaves
six mmapped chunks alive, so glibc's n_mmaps < n_mmaps_max already fails at 1); KeyError caught with DistError and
RuntimeError around the rendezvous (MASTER_ADDR and MASTER_PORT are checked before it, nothing in it raises one).
Not worth a test: _synchronized starting True for num_extras > 99 (a contrived mutant no run sets).
"""

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

import dist.setup
from dist import comm
from dist.errors import RunError
from dist.grad_sync import GradSync
from tests.test_grad_sync_layouts import two_layers

REFUSED = ("a view with gaps or overlaps: its gradient cannot be a slice of a bucket; make it a parameter of its own "
           "(.contiguous())")


# ---- dist/grad_sync.py: _dense and the layout refusal ------------------------------------------------------------

@pytest.mark.parametrize("make, shape, strides", [
    (lambda: torch.randn(3).expand(4, 3), (4, 3), (0, 1)),       # every row the same 3 floats: overlaps
    (lambda: torch.randn(2, 6)[:, :3], (2, 3), (6, 1)),          # a gap after each row of a 2-row dimension
    (lambda: torch.randn(4)[::2], (2,), (2,)),                   # every other float of 4
])
def test_a_parameter_with_overlaps_or_a_gap_in_a_size_2_dimension_is_refused_whole_message(make, shape, strides):
    """A view whose elements overlap (stride 0) or skip slots in a dimension of size 2 is no slice of a bucket: it is
    refused naming its index, shape and strides and the fix (.contiguous()), not given a gradient laid out wrong.
    Mutant: `stride > expected` (overlaps taken); `size > 2` instead of `size != 1`; the message without
    (.contiguous())."""
    p = nn.Parameter(make())
    assert p.stride() == strides
    with pytest.raises(ValueError) as exc:
        GradSync([p])
    assert str(exc.value) == f"parameter #0 of shape {shape} has strides {strides}, {REFUSED}"


@pytest.mark.parametrize("make", [lambda: torch.randn(2, 3, 4), lambda: torch.randn(4, 3, 2).permute(2, 1, 0)])
def test_a_dense_3_d_parameter_in_any_dimension_order_is_taken_with_autograd_s_gradient(make):
    """A [2, 3, 4] parameter, contiguous (strides (12, 4, 1)) or permuted (strides (1, 2, 6)), fills 24 consecutive
    slots: GradSync takes it, its gradient keeps its strides and equals plain autograd's (the weights w).
    Mutant: `expected = size` instead of `expected *= size` in _dense (a third dimension refused)."""
    p = nn.Parameter(make())
    w = torch.randn(2, 3, 4)
    sync = GradSync([p])
    sync.zero_grad()
    sync.arm()
    (p * w).sum().backward()
    sync.synchronize()
    assert p.grad.stride() == p.stride()
    assert torch.equal(p.grad, w)


# ---- dist/grad_sync.py: when the buckets launch ------------------------------------------------------------------

@pytest.mark.parametrize("mode, unused, launched", [
    ("bucketed", "error", ["backward", "backward"]),          # overlapping backward, one bucket per layer
    ("bucketed", "zero", ["synchronize", "synchronize"]),    # all at synchronize(): a parameter may be unused somewhere
    ("flat", "error", ["synchronize"]),                      # the one bucket, after backward
])
def test_which_buckets_launch_during_backward_and_which_at_synchronize(monkeypatch, mode, unused, launched):
    """Bucketed with unused="error" each bucket's all-reduce is launched from the backward that completes it (the
    overlap bucketing exists for); with unused="zero" and flat, every all-reduce is issued by synchronize(). One
    process issues no collective, so comm.all_reduce is replaced by one that records the phase it was called in.
    Mutant: the launch gate without `self.unused == "error"`, with "zero" for "error", or `mode == "bucketed" or
    unused == "error"` (flat launching from backward)."""
    phase, calls = ["backward"], []

    class Done:
        def wait(self):
            pass

    def recorded(tensor, purpose, async_op=False):
        calls.append(phase[0])
        return Done()
    monkeypatch.setattr(comm, "all_reduce", recorded)
    first, head = two_layers()
    sync = GradSync([first.weight, head.weight], mode, bucket_mb=1e-6, unused=unused)   # bucketed: a bucket each
    sync.zero_grad()
    sync.arm()
    head(first(torch.ones(2, 3))).sum().backward()
    phase[0] = "synchronize"
    sync.synchronize()
    assert calls == launched


# ---- dist/grad_sync.py: the refusals, whole -------------------------------------------------------------------------

NOT_SERVED = ("is no longer served by this GradSync: one built over it later took it over (its gradient view and "
              "hooks), or remove_hooks() ran; build one GradSync over all the parameters (actor and critic with their "
              "shared trunk together)")


def armed_two_layers(unused="zero"):
    """(GradSync over both weights of two_layers(), first layer, head), after zero_grad() and arm()."""
    first, head = two_layers()
    sync = GradSync([first.weight, head.weight], unused=unused)
    sync.zero_grad()
    sync.arm()
    return sync, first, head


def test_synchronize_after_a_takeover_of_parameter_0_names_it_and_the_fix():
    """A second GradSync over the first weight only takes it over (and drops the first GradSync's hooks): the first's
    synchronize() names parameter #0, what happened and the fix.
    Mutant: the index off by one; the check skipping parameter #0; the message without the fix."""
    sync, first, _ = armed_two_layers()
    successor = GradSync([first.weight])     # kept: a freed one would serve nothing
    with pytest.raises(RuntimeError) as exc:
        sync.synchronize()
    assert str(exc.value) == f"parameter #0 {NOT_SERVED}"
    assert successor.params == [first.weight]


def test_synchronize_after_remove_hooks_is_refused_although_the_gradient_views_are_intact():
    """remove_hooks() leaves the .grad views in place but no longer serves the parameters (a later backward would not
    be counted): synchronize() after it refuses by name rather than average what happens to be in the buckets.
    Mutant: `_served_by(p) is not None and _served_by(p) is not self` (a parameter served by nobody passes)."""
    sync, first, head = armed_two_layers()
    head(first(torch.ones(2, 3))).sum().backward()
    sync.remove_hooks()
    with pytest.raises(RuntimeError) as exc:
        sync.synchronize()
    assert str(exc.value) == f"parameter #0 {NOT_SERVED}"


def test_a_grad_replaced_after_the_armed_backward_is_refused_naming_every_cause():
    """A .grad that is no longer the bucket view (here set to None, as optimizer.zero_grad() does; casting the model
    or create_graph=True replace it too) is refused naming the parameter and all three causes.
    Mutant: the message without "build the GradSync after casting or moving the model ... create_graph=True"."""
    sync, first, head = armed_two_layers()
    head(first(torch.ones(2, 3))).sum().backward()
    head.weight.grad = None
    with pytest.raises(RuntimeError) as exc:
        sync.synchronize()
    assert str(exc.value) == ("parameter #1's .grad is no longer a view into its gradient bucket, so it would not be "
                              "synchronized: zero gradients with sync.zero_grad(), never with optimizer.zero_grad() or "
                              "model.zero_grad() (they set grads to None); build the GradSync after casting or moving "
                              "the model, and do not backward with create_graph=True (both replace the grads)")


def test_a_missing_gradient_names_a_replaced_parameter_as_a_cause():
    """A parameter with no gradient: the error names it, both fixes, and the third cause (a parameter replaced after
    the GradSync was built, which then never gets a hook call).
    Mutant: the message without "(or they were replaced ... build it again)"."""
    sync, first, _ = armed_two_layers(unused="error")
    first(torch.ones(2, 3)).sum().backward()
    with pytest.raises(RuntimeError) as exc:
        sync.synchronize()
    assert str(exc.value) == ("1 parameter(s) received no gradient this step (#1 of shape (3, 3)); fix the loss, or "
                              "average them as zero gradients: GradSync(..., unused=\"zero\"), --dist.unused-params "
                              "zero in train.py (or they were replaced after the GradSync was built, e.g. "
                              "load_state_dict(assign=True): build it again)")


def test_a_second_armed_backward_names_reentrant_checkpointing_as_a_cause():
    """Two gradients for one parameter after arm(): the error says one backward was declared, and that a parameter
    used inside and outside a reentrant checkpoint gets two as well.
    Mutant: the message without the reentrant-checkpoint cause."""
    sync, first, head = armed_two_layers()
    head(first(torch.ones(2, 3))).sum().backward()
    with pytest.raises(RuntimeError) as exc:
        head(first(torch.ones(2, 3))).sum().backward()
    assert str(exc.value) == ("a second backward after arm(): arm() declares that exactly one more backward (the "
                              "minibatch's last micro-batch) follows before synchronize() (a parameter used inside "
                              "and outside a reentrant torch.utils.checkpoint also gets two)")


# ---- dist/setup.py: the rendezvous notice and its failure ---------------------------------------------------------

class Timer:
    """threading.Timer that only records: (interval, function, args, kwargs), daemon, and start/cancel in `log`."""

    def __init__(self, log, interval, function, args, kwargs):
        self.log, self.daemon = log, False
        log.append(("Timer", interval, function, args, kwargs))

    def start(self):
        self.log.append(("start", self.daemon))

    def cancel(self):
        self.log.append(("cancel",))


@pytest.fixture
def rendezvous(monkeypatch):
    """Rank 1 of 2 at 10.1.2.3:29400 (no agent store, no real group): a namespace whose `log` Timer and
    init_process_group append to, and whose `error`, when set, init_process_group raises."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(name, value)
    state = SimpleNamespace(log=[], error=None)

    def init_process_group(**kwargs):
        state.log.append(("init_process_group",))
        if state.error is not None:
            raise state.error
    monkeypatch.setattr(threading, "Timer", lambda *args, **kwargs: Timer(state.log, *args, **kwargs))
    monkeypatch.setattr(torch_dist, "init_process_group", init_process_group)
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: False)
    return state


def test_the_rendezvous_notice_is_due_after_10_s_started_before_the_join_and_cancelled_after_it(rendezvous):
    """A rendezvous says what it waits for once it has taken 10 s, from a daemon timer (it never holds the process)
    started before init_process_group and cancelled once that returns: a quick one says nothing.
    Mutant: WAIT_NOTICE_S 0 or 600, or divided by 1000; the timer not a daemon, not started or not cancelled; the
    message counting this rank among the others or the timeout without :g; print without flush=True."""
    info = dist.setup.init_distributed("gloo", "cpu")
    assert (info.rank, info.world_size, info.backend) == (1, 2, "gloo")
    assert rendezvous.log == [
        ("Timer", 10.0, print, ["[syncppo] rank 1: waiting for the other 1 rank(s) at 10.1.2.3:29400 (for up to "
                                "--dist.timeout-s 600)"], {"flush": True}),
        ("start", True), ("init_process_group",), ("cancel",)]


def test_a_rendezvous_that_fails_is_a_run_error_with_torch_s_message_on_one_line(rendezvous):
    """A store timeout (DistError) over several lines ending in ".": the RunError quotes it on one line without its
    final period, gives the timeout as --dist.timeout-s takes it (12.5, 600 without ".0"), keeps torch's error as its
    cause, and the notice is cancelled all the same.
    Mutant: str(error) for one_line(error); no rstrip("."); {timeout_s} without :g; `from None`."""
    rendezvous.error = torch_dist.DistError("Timed out after 601 seconds waiting for clients.\n  2/1 clients joined.")
    for timeout_s, shown in ((12.5, "12.5"), (600.0, "600")):
        rendezvous.log.clear()
        with pytest.raises(RunError) as exc:
            dist.setup.init_distributed("gloo", "cpu", timeout_s)
        assert str(exc.value) == (
            f"the 2 ranks did not all meet at 10.1.2.3:29400 within --dist.timeout-s {shown} (Timed out after 601 "
            "seconds waiting for clients. 2/1 clients joined); start every rank (torchrun --nnodes/--nproc-per-node), "
            "check that rank 0's host and port are reachable, or raise --dist.timeout-s; a rank that refused its "
            "input (another node's one line) never joins")
        assert exc.value.__cause__ is rendezvous.error
        assert rendezvous.log[-2:] == [("init_process_group",), ("cancel",)]
