"""Two nodes for real: two torchrun agents that meet through c10d rendezvous, as the README's multi-node command
starts them, here on one machine. Everything else tests multi-node behaviour with the variables set by hand or
with ranks spawned by one process; this is the launch path itself (the rendezvous, a second node whose only rank
is local rank 0 but global rank 1)."""

import glob
import os
import subprocess
import sys

import pytest
import torch

from dist.checkpoint_read import load_checkpoint
from tests.multirank import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TRAIN = ["train.py", "cartpole", "--max-iterations", "2", "--env.num-envs", "16", "--ppo.num-steps", "16"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def final_model(root) -> dict:
    (path,) = glob.glob(os.path.join(root, "cartpole", "*", "model_2.pt"))
    return load_checkpoint(path)["model"]


@pytest.mark.slow
def test_two_nodes_train_what_one_node_with_as_many_ranks_trains(tmp_path, one_node_two_ranks):
    """Rank r seeds with rank_seed(--seed, r) (its global rank, not its local one), so 2 nodes x 1 rank and 1 node
    x 2 ranks learn the same weights bit for bit. Node 1's agent runs in a directory of its own: --log.root is absolute,
    so both nodes see the run (a relative one would be refused under --max-restarts, tests/test_checkpoint_rules.py)."""
    # The one-node run (tests/conftest.py, shared with tests/test_slurm.py; started first, if no test did yet) and the
    # two nodes run at once (independent runs in folders of their own): their start-ups (torch's import, the
    # rendezvous) overlap instead of following each other.
    one_node = one_node_two_ranks(TRAIN[1:])
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"localhost:{free_port()}", "--rdzv-id", "two-nodes"]
    (tmp_path / "node1").mkdir()
    nodes = [subprocess.Popen([TORCHRUN, *rendezvous, os.path.join(REPO, TRAIN[0]), *TRAIN[1:], "--log.root",
                               str(tmp_path / "two")], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for cwd in (REPO, tmp_path / "node1")]
    try:
        outputs = [job.communicate(timeout=120) for job in nodes]
    finally:
        for job in nodes:
            job.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err for _, err in outputs]
    # Rank 0 (on whichever node the rendezvous made node 0) prints the run; the other node's rank prints nothing.
    printed = sorted(("world size 2" in out, "it     2/2" in out) for out, _ in outputs)
    assert printed == [(False, False), (True, True)], outputs

    one, two = one_node(), final_model(tmp_path / "two")
    assert one.keys() == two.keys()
    for key in one:
        assert torch.equal(one[key], two[key]), key
