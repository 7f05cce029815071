"""README's promise, checked as a user would: copy the files out, import them from the copy only, run 2 gloo ranks.

- ppo/loss.py, ppo/gae.py alone (torch only);
- dist/grad_sync.py and dist/stats.py with dist/comm.py and dist/plan.py, in a package of another name: the
  gradient equals the mean of the ranks' own gradients bit for bit (flat and bucketed, micro-batches,
  extras), and merge_moments equals numpy over all ranks' samples;
- sync/ with dist/comm.py, dist/plan.py and dist/checksum.py as a top-level `dist` (docs/weight_sync.md):
  patch and bucket copies equal the sender's weights, from a test's script and from that doc's own example.
Each script runs in a fresh interpreter whose path holds only the copy (not this repository).
"""

import os
import shutil
import subprocess
import sys

import pytest


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SPAWN = """
import os, sys
import torch.distributed as tdist, torch.multiprocessing as mp

def main(rank):      # a rendezvous file, not a port: nothing to race for, nothing left listening
    tdist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=int(sys.argv[2]))
    try:
        body(rank)
    finally:
        tdist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(main, nprocs=int(sys.argv[2]))
"""

GRAD_AND_STATS = """
import numpy as np, torch
from myproject.parallel.grad_sync import GradSync
from myproject.parallel.stats import merge_moments

def data(rank, step, q):
    g = torch.Generator().manual_seed(100 * rank + step)
    return [(torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)) for _ in range(q)]

def body(rank):
    torch.manual_seed(0)                              # GradSync broadcasts nothing: same start on every rank
    net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    own = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    for mode, q in (("flat", 1), ("bucketed", 3)):
        sync = GradSync(net.parameters(), mode=mode, bucket_mb=0.0005, num_extras=2)
        for step in range(2):
            sync.zero_grad()
            for i, (x, y) in enumerate(data(rank, step, q)):
                if i == q - 1:
                    sync.arm(torch.tensor([rank + 1.0, 8.0]))
                ((net(x) - y).square().mean() / q).backward()
            extras = sync.synchronize()
            own.load_state_dict(net.state_dict())
            own.zero_grad()
            for x, y in data(rank, step, q):
                ((own(x) - y).square().mean() / q).backward()
            mine = torch.cat([p.grad.flatten() for p in own.parameters()])
            both = [torch.empty_like(mine) for _ in range(2)]
            torch.distributed.all_gather(both, mine)
            assert torch.equal(torch.cat([p.grad.flatten() for p in net.parameters()]), (both[0] + both[1]) / 2), mode
            assert extras.tolist() == [3.0, 16.0], extras
            sync.clip_(0.1)
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad
    batches = [np.random.default_rng(r).normal(5.0, 1.0 + r, size=(7 + 4 * r, 3)) for r in range(2)]
    zeros = torch.zeros(3, dtype=torch.float64)
    n, mean, m2 = merge_moments(torch.zeros((), dtype=torch.float64), zeros, zeros, torch.from_numpy(batches[rank]))
    union = np.concatenate(batches)
    assert int(n) == len(union)
    np.testing.assert_allclose(mean.numpy(), union.mean(0), rtol=1e-12)
    np.testing.assert_allclose((m2 / n).numpy(), union.var(0), rtol=1e-12)
"""

SYNC = """
import torch
from sync import WeightSyncConfig, make_weight_syncer, trainable_keys

def body(rank):
    for kind in ("patch", "bucket"):
        torch.manual_seed(0 if rank == 0 or kind == "bucket" else 1)   # patch bootstraps the receiver
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
        syncer = make_weight_syncer(WeightSyncConfig(type=kind), src=0, dsts=[1])
        if rank == 0:
            syncer.init_sender(model, trainable_keys(model))
        else:
            syncer.init_receiver(model)
        for version in (1, 2):
            if rank == 0:
                with torch.no_grad():
                    model[2].weight.add_(0.5 * version)
                    model[0].bias[0] += 1.0
                syncer.sync(model, version=version)
            else:
                assert syncer.apply(model) == version
            state = torch.cat([t.flatten() for t in model.state_dict().values()])
            both = [torch.empty_like(state) for _ in range(2)]
            torch.distributed.all_gather(both, state)
            assert torch.equal(both[0], both[1]), kind
"""


def run_copy(tmp_path, script, ranks=2):
    (tmp_path / "check.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(tmp_path), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "check.py", str(tmp_path / "rendezvous"), str(ranks)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


LOSS_AND_GAE = """
import torch, loss, gae
t = torch.tensor
# ratio 1, so the surrogate is -mean(A) = -1; value loss mean((1 - 2)^2, (1 - 0)^2) = 1; entropy 0.5
terms = loss.ppo_loss(t([0., 0.]), t([0., 0.]), t([2., 0.]), t([1., 1.]), t([1., 1.]), t([2., 0.]), t([.5, .5]),
                      0.2, True, 0.5, 0.25)
print(float(terms["surrogate"]), float(terms["value_function"]), float(terms["loss"]))
# one env, two steps, gamma = lam = 0.5, V = 0.5 everywhere: deltas 1 + 0.25 - 0.5 = 0.75; A0 = 0.75 + 0.25 * 0.75
adv, ret = gae.compute_gae(t([[1.], [1.]]), t([[.5], [.5]]), t([[0.], [0.]]), t([.5]), 0.5, 0.5)
print(adv.flatten().tolist(), ret.flatten().tolist())
"""


def test_loss_and_gae_copied_alone(tmp_path):
    for name in ("loss.py", "gae.py"):
        shutil.copy(os.path.join(REPO, "ppo", name), tmp_path / name)
    out = run_copy(tmp_path, LOSS_AND_GAE).splitlines()
    assert out == ["-1.0 1.0 -0.625", "[0.9375, 0.75] [1.4375, 1.25]"]      # -1 + 0.5 * 1 - 0.25 * 0.5


@pytest.mark.slow
def test_grad_sync_and_stats_copied_into_another_package_on_2_ranks(tmp_path):
    package = tmp_path / "myproject" / "parallel"
    package.mkdir(parents=True)
    for name in ("grad_sync.py", "stats.py", "comm.py", "plan.py"):
        shutil.copy(os.path.join(REPO, "dist", name), package / name)
    run_copy(tmp_path, GRAD_AND_STATS + SPAWN)


@pytest.mark.slow
def test_sync_copied_with_a_top_level_dist_on_2_ranks(tmp_path):
    copy_sync(tmp_path)
    run_copy(tmp_path, SYNC + SPAWN)


def copy_sync(tmp_path):
    """What docs/weight_sync.md says to take: sync/*.py, and dist/comm.py, plan.py, checksum.py as `dist`."""
    shutil.copytree(os.path.join(REPO, "sync"), tmp_path / "sync", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "dist").mkdir()
    for name in ("comm.py", "plan.py", "checksum.py"):
        shutil.copy(os.path.join(REPO, "dist", name), tmp_path / "dist" / name)


DOC_EXAMPLE = """
import torch

def body(rank):
    for kind in ("patch", "bucket"):
        torch.manual_seed(rank)                       # every rank starts from other weights
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

        def step(model):                              # the example's `...`: the trainer's step, nothing on a copy
            if rank == 0:
                with torch.no_grad():
                    model[2].weight.add_(0.5)
        names = dict(rank=rank, model=model, iteration=0, step=step)
        exec(EXAMPLE.replace('type="patch"', f'type="{kind}"'), names)
        assert rank == 0 or names["version"] == 1, (kind, names["version"])
        state = torch.cat([t.flatten() for t in model.state_dict().values()])
        every = [torch.empty_like(state) for _ in range(3)]
        torch.distributed.all_gather(every, state)
        assert all(torch.equal(every[0], other) for other in every[1:]), kind
"""


@pytest.mark.slow
def test_the_weight_sync_docs_example_runs_on_a_copy_on_3_ranks(tmp_path):
    """docs/weight_sync.md's first python block, run as written on the copy (its `...` made the trainer's step, its
    `type="patch"` also "bucket"): both kinds, the receivers end with the sender's weights and version 1.

    Mutant: the doc's example passes `synced_keys=trainable_keys(model)` to init_sender (no such argument)."""
    with open(os.path.join(REPO, "docs", "weight_sync.md")) as f:
        example = f.read().split("```python\n", 1)[1].split("```", 1)[0]
    assert example.count("...;") == 2 and 'type="patch"' in example, example
    copy_sync(tmp_path)
    script = f"EXAMPLE = {example.replace('...;', 'step(model);')!r}\n" + DOC_EXAMPLE + SPAWN
    run_copy(tmp_path, script, ranks=3)
