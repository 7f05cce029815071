"""train.main with --ppo.capture-step, the step captured and replayed as on a GPU (on CPU, through
tests/fake_cuda_graph.py), trains exactly as the host path: what train.py does between updates (the LR schedule, the
normalizer merges, checkpoints) keeps the recorded step valid. CPU only: on CUDA the captured step's Adam reads its LR
as float32, so the two paths differ in the last bit there (tests/test_minibatch_step.py covers CUDA)."""

import torch

import train
from ppo import minibatch_step
from tests import fake_cuda_graph
from tests.test_train import small_tracking


def test_training_with_the_step_captured_and_replayed_equals_the_host_path(tmp_path, monkeypatch):
    fake_cuda_graph.install(monkeypatch)
    built, steps = minibatch_step.SyncFreeStep.__init__, []

    def captured_on_cpu(self, *args, **kwargs):
        built(self, *args, **kwargs)
        self.capture = True
        steps.append(self)
    monkeypatch.setattr(minibatch_step.SyncFreeStep, "__init__", captured_on_cpu)
    runs = []
    for capture in (False, True):
        cfg = small_tracking(tmp_path / str(capture), iterations=4)     # checkpoints at 2 and 4
        cfg.dist.device, cfg.ppo.capture_step = "cpu", capture
        model, scalars, _ = train.main(cfg)
        runs.append((model.state_dict(), {k: v for k, v in scalars.items() if not k.startswith("Perf/")}))
    (host_state, host_scalars), (dev_state, dev_scalars) = runs
    assert host_state.keys() == dev_state.keys()
    for key in host_state:
        assert torch.equal(host_state[key], dev_state[key]), key
    assert dev_scalars == host_scalars
    (step,) = steps
    # Captured in thread-local mode: in the default global mode another thread's CUDA call that capture forbids (NCCL's
    # watchdog querying an event, a weight-serving thread allocating) would fail this capture (torch PR #104555).
    assert step.graph.capture_error_mode == "thread_local"
    assert step.graph.replays == 4 * cfg.ppo.num_epochs * cfg.ppo.num_mini_batches - minibatch_step.CAPTURE_WARMUP_STEPS
