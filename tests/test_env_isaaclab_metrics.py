"""The metrics the Isaac Lab adapter hands on from the task's extras["log"], against tests/fake_isaaclab.py: each a
float32 0-d tensor filled in on the device (a Python int or bool, an int64 or float64 tensor, a one-element tensor),
a value that is not one number named, nothing logged by reset() itself or by a task that logs nothing."""

import re

import pytest
import torch

from envs.isaaclab import IsaacLabEnv
from tests.fake_isaaclab import MAX_EPISODE_LENGTH, TASK, FakeRLEnv
from tests.test_env_isaaclab import fake, make  # noqa: F401 - the fixtures that install the fake and build adapters


def test_reset_hands_no_log(make):
    """The build's reset already named the metrics and the first step hands its values (Isaac Lab keeps them in
    extras["log"]): reset() itself logs nothing, or the runner would count the reset's values once more.
    Mutant: reset() returning the converted extras["log"] of the env."""
    env = make()
    assert env.reset()[1] == {"log": {}}
    env.step(torch.zeros(4, 2))
    assert env.reset()[1] == {"log": {}}              # a later, real reset too


def make_logging(fake, extra_log):
    """An adapter over the fake whose every reset also logs `extra_log` (closed by the caller)."""
    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)
        env.extra_log = extra_log
        return env

    fake.entry_point = entry_point
    return IsaacLabEnv(TASK, 4, torch.device("cpu"), 0, critic_obs_groups=("policy", "critic"))


def test_integer_and_bool_metrics_are_filled_in_on_the_device_too(fake):
    """Isaac Lab's termination counts are Python ints (`.item()` of an integer tensor) and a flag may be a bool: like
    a float, each is filled in on the device, not copied from the host (aten::lift_fresh) at every step.
    Mutant: `isinstance(value, float)` instead of `numbers.Real` in _scalar."""
    env = make_logging(fake, {"Episode_Termination/base_contact": 3, "Metrics/flag": True})
    try:
        env.reset()
        env.unwrapped.episode_length_buf[:] = 0                 # nothing resets in the profiled step
        with torch.profiler.profile() as prof:
            _, _, _, _, extras = env.step(torch.zeros(4, 2))
        assert "aten::lift_fresh" not in {event.name for event in prof.events()}
        assert extras["log"]["Episode_Termination/base_contact"].item() == 3.0
        assert extras["log"]["Metrics/flag"].item() == 1.0
    finally:
        env.close()


def test_integer_and_double_tensor_metrics_are_handed_on_as_float32(fake):
    """Every logged value becomes a float32 0-d tensor, whatever the task's tensor dtype (an int64 count, a float64
    mean), as a logged Python number does.
    Mutant: torch.as_tensor without dtype=torch.float32 for tensors."""
    count, mean = torch.tensor(7), torch.tensor(0.25, dtype=torch.float64)
    env = make_logging(fake, {"Metrics/count": count, "Metrics/mean": mean})
    try:
        env.reset()
        _, _, _, _, extras = env.step(torch.zeros(4, 2))
        for key, value in (("Metrics/count", 7.0), ("Metrics/mean", 0.25)):
            logged = extras["log"][key]
            assert logged.dtype == torch.float32 and logged.shape == () and logged.item() == value
    finally:
        env.close()


@pytest.mark.parametrize("value, what", [([[1.0], [1.0, 2.0]], "list"), (10 ** 400, "int")], ids=["ragged", "huge-int"])
def test_a_logged_value_torch_or_float_cannot_convert_is_named(fake, value, what):
    """A ragged list (torch's ValueError) or an int past float range (float()'s OverflowError) is named like any value
    that is not one number, not torch's or Python's own error from inside the adapter.
    Mutant: `except (TypeError,)` only, in _scalar."""
    message = (f"--env.task {TASK}: extras['log']['Metrics/odd'] is {what}, not one number; make the task log one "
               f"value per name (e.g. the mean over its envs)")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make_logging(fake, {"Metrics/odd": value})


def test_a_one_element_tensor_metric_is_handed_on_as_a_0d_tensor(fake):
    """A metric logged as a one-element tensor ([1]: a per-env mean kept with keepdim) is one number: handed on as a
    0-d tensor like every other metric.
    Mutant: _scalar returning the converted tensor without reshape(())."""
    env = make_logging(fake, {"Metrics/kept_dim": torch.tensor([0.75])})
    try:
        env.reset()
        logged = env.step(torch.zeros(4, 2))[4]["log"]["Metrics/kept_dim"]
        assert logged.shape == () and logged.item() == 0.75
    finally:
        env.close()


def test_a_task_that_logs_nothing_has_no_metrics(fake):
    """A task whose resets leave extras without a "log" entry (nothing to log) builds and steps with no metrics,
    rather than failing on a missing key.
    Mutant: extras["log"] instead of extras.get("log", {}) (in _describe or in _log)."""
    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)
        reset_idx = env._reset_idx

        def reset_without_log(ids):
            reset_idx(ids)
            del env.extras["log"]

        env._reset_idx = reset_without_log
        return env

    fake.entry_point = entry_point
    env = IsaacLabEnv(TASK, 2, torch.device("cpu"), 0, critic_obs_groups=("policy", "critic"))
    try:
        assert env.log_keys == ()
        env.reset()
        env.unwrapped.episode_length_buf[:] = MAX_EPISODE_LENGTH - 1     # both envs time out this step
        _, _, _, truncated, extras = env.step(torch.zeros(2, 2))
        assert truncated.all() and extras["log"] == {}
    finally:
        env.close()
