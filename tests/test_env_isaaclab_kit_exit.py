"""How a process that started Isaac Lab's Kit ends: Kit (PhysX physics) ends the process itself when its runtime
closes, so the adapter must hand it the real status (an error in training must not end with status 0, bad input
must still end with 2). Each case is a process of its own, forked from one that imported torch
(tests/forked_python.py), running the adapter against tests/fake_isaaclab.py; the adapter's other rules are in
tests/test_env_isaaclab.py.
"""

import os
import textwrap

import pytest

from tests.forked_python import run_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


KIT_SCRIPT = """
import torch
from envs.isaaclab import IsaacLabEnv
from tests.fake_isaaclab import TASK, install

record = install(rank=0)
env = IsaacLabEnv(TASK, 4, torch.device("cpu"), 0, task_overrides=("physics=isaacsim_physx",))
env.reset()
env.step(torch.zeros(4, 2))
{end}
"""


@pytest.mark.parametrize("end, status", [("pass", 0), ("raise RuntimeError('training failed')", 1),
                                         ("raise KeyboardInterrupt", 130), ("env.close(3)", 3)])
def test_kit_ends_the_process_with_its_real_status(end, status):
    # Kit (PhysX physics) ends the process when its runtime closes, with the status it is given: an error in
    # training must not turn into status 0.
    # A process of its own, forked from one that imported torch (tests/forked_python.py), ending as Kit ends it.
    result = run_python(["-c", textwrap.dedent(KIT_SCRIPT).format(end=end)], cwd=REPO, timeout=120)
    assert result.returncode == status, result.stderr
    if status == 1:
        assert "training failed" in result.stderr


KIT_RUN = """
import sys
import torch
torch.cuda.is_available = lambda: False      # the fake simulates on the CPU
from tests.fake_isaaclab import install
import train
from configs import preset

record = install(rank=0)
cfg = preset("isaaclab")
cfg.env.num_envs, cfg.env.task_overrides = 8, ("physics=isaacsim_physx",)
cfg.env.actor_obs_groups = ("policy", "no_such_group")
cfg.ppo.num_steps, cfg.log.root = 8, sys.argv[1]
sys.exit(train.cli(cfg))
"""


def test_bad_input_met_after_kit_started_still_ends_the_process_with_status_2(tmp_path):
    """An error only the built env can find (an observation group the task does not have) is bad input: status 2,
    also when Kit, started by then, is what ends the process (with the status train.cli records, not 1)."""
    result = run_python(["-c", KIT_RUN, str(tmp_path)], cwd=REPO, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.endswith("error: --env.actor-obs-groups: this task has no observation group 'no_such_group'; "
                                  "it has ['critic', 'policy']\n")
