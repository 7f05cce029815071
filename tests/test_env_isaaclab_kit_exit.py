"""How a process that started Isaac Lab's Kit ends: Kit (PhysX physics) ends the process itself when its runtime
closes, so the adapter must hand it the real status (an error in training must not end with status 0, bad input
must still end with 2, a recorded SystemExit its own status), close the runtime even when the env's build or close
fails, and take its exit handler back once closed. The end-to-end cases are each a process of its own, forked from
one that imported torch (tests/forked_python.py), running the adapter against tests/fake_isaaclab.py; the others run
in this process against the same fake. The adapter's other rules are in tests/test_env_isaaclab.py.
"""

import os
import sys
import textwrap

import pytest
import torch

import envs.isaaclab
from envs.isaaclab import IsaacLabEnv, process_exit_code
from tests.fake_isaaclab import TASK, FakeRLEnv
from tests.forked_python import run_python
from tests.test_env_isaaclab import fake, make  # noqa: F401 - the fixtures that install the fake and build adapters

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


@pytest.mark.parametrize("recorded, status", [(SystemExit(0), 0), (SystemExit("bad input"), 1), (SystemExit(), 0)],
                         ids=["zero", "message", "none"])
def test_a_recorded_system_exit_of_zero_or_a_message_gives_its_real_status(monkeypatch, recorded, status):
    """SystemExit(0) and SystemExit() (sys.exit() with no status) end a process with 0, SystemExit("message")
    (sys.exit's form that prints the message) with 1, as CPython does; Kit is handed that status.
    Mutant: `exc.code or 1` (0 became 1, a message was handed on as the status) or `else 0` for a non-int code; a
    code of None read as a failure (1; fixed since)."""
    monkeypatch.setattr(sys, "last_exc", recorded, raising=False)
    monkeypatch.setattr(sys, "last_value", recorded, raising=False)
    assert process_exit_code() == status


def test_a_failed_env_build_still_closes_the_runtime_at_exit(fake, monkeypatch):
    """Once the runtime has started, the exit handler is registered before the env is built: an env whose build
    raises still has its runtime closed at exit (Kit would otherwise end the process without the real status).
    Mutant: atexit.register(self.close) moved after gym.make."""
    closers = []
    monkeypatch.setattr(envs.isaaclab.atexit, "register", closers.append)

    def entry_point(cfg, **kw):
        raise RuntimeError("the task's scene does not build")

    fake.entry_point = entry_point
    with pytest.raises(RuntimeError, match="scene does not build"):
        IsaacLabEnv(TASK, 2, torch.device("cpu"), 0)
    (launch,) = fake.launches
    assert len(closers) == 1 and fake.runtime_open and launch["exit_code"] is None
    closers[0]()                                         # the exit handler: no uncaught exception recorded, status 0
    assert not fake.runtime_open and launch["exit_code"] == 0


def test_close_drops_the_exit_handler(make, monkeypatch):
    """A closed adapter takes its exit handler back (atexit.unregister), so the process does not hold every closed env
    (and its simulation) until it ends.
    Mutant: the atexit.unregister in close left out."""
    handlers = []
    monkeypatch.setattr(envs.isaaclab.atexit, "register", handlers.append)
    monkeypatch.setattr(envs.isaaclab.atexit, "unregister", handlers.remove)
    env = make()
    assert handlers == [env.close]
    env.close()
    assert handlers == []


def test_the_runtime_is_closed_with_the_status_even_when_closing_the_env_fails(fake):
    """An env whose own close raises still has its runtime closed, with the status given (Kit ends the process there
    with that status; left open, Kit's own exit handler would end it with another).
    Mutant: the try/finally around env.close() made sequential."""
    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)

        def failing_close():
            raise RuntimeError("the scene could not be torn down")

        env.close = failing_close
        return env

    fake.entry_point = entry_point
    env = IsaacLabEnv(TASK, 2, torch.device("cpu"), 0, critic_obs_groups=("policy", "critic"))
    with pytest.raises(RuntimeError, match="could not be torn down"):
        env.close(3)
    assert not fake.runtime_open and fake.launches[0]["exit_code"] == 3
