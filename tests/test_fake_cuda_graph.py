"""tests/fake_cuda_graph.py behaves as a CUDA graph where the sync-free step's tests rely on it (CPU only: it is
the stand-in for the GPU)."""

import pytest
import torch

from tests import fake_cuda_graph


def test_recording_runs_the_python_once_and_leaves_memory_as_it_was_and_a_replay_runs_the_ops_again():
    w = torch.nn.Parameter(torch.full((3,), 2.0))
    w.grad = torch.zeros(3)
    x, calls = torch.tensor([1.0, 2.0, 3.0]), []
    graph = fake_cuda_graph.CUDAGraph()
    with fake_cuda_graph.graph(graph):
        calls.append(1)                      # Python: once, at capture
        loss = (x * w).sum()
        loss.backward()                      # accumulates into the existing .grad
        with torch.no_grad():
            w.add_(1.0)
    assert calls == [1] and torch.equal(w, torch.full((3,), 2.0)) and torch.equal(w.grad, torch.zeros(3))
    assert loss.isnan()                      # made inside: unset until a replay
    graph.replay()
    assert torch.equal(w.detach(), torch.full((3,), 3.0)) and torch.equal(w.grad, x) and loss.item() == 12.0
    x.fill_(10.0)                            # a new input, in place, as the step copies each minibatch in
    graph.replay()
    assert torch.equal(w.detach(), torch.full((3,), 4.0)) and torch.equal(w.grad, torch.tensor([11.0, 12.0, 13.0]))
    assert loss.item() == 90.0 and calls == [1] and graph.replays == 2


@pytest.mark.parametrize("read", [lambda t: t.sum().item(), lambda t: bool(t.sum() > 0), lambda t: t[t > 1]])
def test_a_host_read_inside_the_recording_raises(read):
    with pytest.raises(RuntimeError, match="host read"), fake_cuda_graph.graph(fake_cuda_graph.CUDAGraph()):
        read(torch.arange(4.0))


def test_a_replay_raises_on_memory_made_before_the_capture_and_freed_since():
    """A GPU's graph holds the tensors made before its capture by address: one replaced after the capture (rather than
    written in place) is freed, and a replay would work on whatever reuses the memory. The stand-in raises, where
    holding the old tensor would only read stale values: equal ones pass unnoticed."""
    w, lr = torch.ones(3), torch.tensor(0.5)
    graph = fake_cuda_graph.CUDAGraph()
    with fake_cuda_graph.graph(graph):
        w.sub_(lr * 2.0)
    graph.replay()
    lr.fill_(0.25)                                  # in place: the graph reads it
    graph.replay()
    assert torch.equal(w, torch.full((3,), -0.5))
    lr = torch.tensor(0.25)                         # replaced, the same value: the old memory is freed
    with pytest.raises(RuntimeError, match="freed after capture"):
        graph.replay()
