"""A new env's protocol mistakes (envs/base.py) are one line naming the thing to fix, from the runner's first contact
with the env: not a shape error inside the model, and not a run that trains on silently wrong numbers."""

import pytest
import torch

import train
from configs import preset
from dist.errors import RunError
from envs import CartPole
from ppo.actor_critic import build_actor_critic
from ppo.rollout import TRAIN_KEYS, EpisodeStats, collect_rollout


class Broken(CartPole):
    """Cart-pole with one mistake a newcomer makes."""

    def __init__(self, num_envs, device, seed, mistake):
        super().__init__(num_envs + 3 if mistake == "num_envs" else num_envs, device, seed)
        self.mistake = mistake
        if mistake == "no_critic_dim":
            self.obs_dims = {"policy": 4}
        if mistake in ("log_scalar", "log_one_element", "log_str"):
            self.log_keys = ("Episode/x",)
        if mistake == "log_keys_str":
            self.log_keys = ("Episode/x")                     # the missing comma is the mistake
        if mistake == "no_actions":
            self.num_actions = 0
        if mistake == "empty_critic":
            self.obs_dims = {"policy": 4, "critic": 0}
        if mistake == "no_sampler":
            del self.sampler
        if mistake == "no_generator_no_log_keys":
            del self.generator, self.log_keys
        if mistake == "generator_seed":
            self.generator = seed
        if mistake == "num_envs_float":
            self.num_envs = float(num_envs)                   # equal to 8, and a TypeError in torch.zeros later
        if mistake == "log_keys_return":                        # the runner's own episode-return metric
            self.log_keys = ("Episode/return",)
        if mistake in ("log_keys_runner", "log_keys_twice"):    # added into the runner's metric, or counted twice
            self.log_keys = ("Episode/x", "Train/mean_reward" if mistake == "log_keys_runner" else "Episode/x")
        if mistake == "sampler_object":
            self.sampler = object()
        self.saved = {"state_list": {"counts": [1, 2]}, "state_float": {"sampler": {"floor": 0.1}},
                      "state_slash": {"sampler/counts": torch.zeros(2)}, "state_tuple": ()}.get(mistake)

    def state_dict(self):
        return super().state_dict() if self.saved is None else self.saved

    def _observe(self):
        obs = super()._observe()
        if self.mistake == "obs_shape":
            obs["policy"] = obs["policy"][:, :3]
        if self.mistake == "obs_float64":
            obs["critic"] = obs["critic"].double()
        if self.mistake == "obs_device":          # meta: a device other than the run's, on a CPU-only machine too
            obs["policy"] = obs["policy"].to("meta")
        if self.mistake == "no_critic_obs":
            del obs["critic"]
        if self.mistake == "empty_critic":
            obs["critic"] = obs["critic"][:, :0]
        return obs

    def reset(self):
        obs, extras = super().reset()
        if self.mistake == "reset_nan":
            obs["critic"][2, 1] = torch.nan
        return obs if self.mistake == "reset_obs_only" else (obs, extras)

    def step(self, actions):
        obs, reward, terminated, truncated, extras = super().step(actions)
        if self.mistake == "reward_shape":
            reward = reward[:, None]
        if self.mistake == "done_int":
            terminated, truncated = terminated.long(), truncated.long()
        if self.mistake == "both":
            truncated = torch.ones_like(truncated)
            terminated = truncated
        if self.mistake == "no_final_obs":
            del extras["final_obs"]
        if self.mistake == "final_obs_float64":
            extras["final_obs"] = {**extras["final_obs"], "critic": extras["final_obs"]["critic"].double()}
        if self.mistake == "log_undeclared":
            extras["log"] = {"Episode/x": reward.mean()}
        if self.mistake == "log_scalar":
            extras["log"] = {"Episode/x": reward}
        if self.mistake == "log_keys_str":
            extras["log"] = {"Episode/x": reward.mean()}
        if self.mistake == "log_none":
            extras["log"] = None
        if self.mistake == "log_one_element":
            extras["log"] = {"Episode/x": reward.mean()[None]}
        if self.mistake == "log_str":
            extras["log"] = {"Episode/x": "high"}
        return obs, reward, terminated, truncated, extras


MISTAKES = {
    "num_envs": r"env.num_envs is 11, but 8 envs were asked for",
    "no_critic_dim": r"env.obs_dims has no 'critic' group \(it has \['policy'\]\)",
    "log_none": r"step\(\)'s extras must be a dict with 'log', a dict \(\{\} when the env logs nothing\)",
    "log_keys_str": r"env.log_keys is the str 'Episode/x', not a tuple of names; a tuple of one name needs its "
                    r"comma: \('Episode/x',\)",
    "no_actions": r"env.num_actions is 0; the policy needs at least one action and one observation feature in "
                  r"each group: check the env's action space and observation groups",
    "empty_critic": r"env.obs_dims\['critic'\] is 0; the policy needs at least one action",
    "no_critic_obs": r"reset\(\)'s obs has no observation group 'critic' \(it has \['policy'\]\)",
    "obs_shape": r"reset\(\)'s obs\['policy'\] has shape \[8, 3\], expected \[num_envs, "
                 r"obs_dims\['policy'\]\] = \[8, 4\]",
    "obs_float64": r"reset\(\)'s obs\['critic'\] has dtype torch.float64, expected torch.float32",
    "obs_device": r"reset\(\)'s obs\['policy'\] is on meta, expected the run's device cpu \(the env gets it from "
                  r"make_env\)",
    "reward_shape": r"step\(\)'s reward must be a \[num_envs\] = \[8\] tensor, got \[8, 1\]",
    "done_int": r"step\(\)'s terminated has dtype torch.int64, expected torch.bool",
    "no_final_obs": r"step\(\)'s extras has no 'final_obs'",
    "final_obs_float64": r"step\(\)'s extras\['final_obs'\]\['critic'\] has dtype torch.float64, expected "
                         r"torch.float32",
    "reset_obs_only": r"reset\(\) must return \(obs, extras\)",   # a dict of its two groups: also of length 2
    "reset_nan": r"reset\(\)'s obs\['critic'\] holds nan at env 2 feature 1; make the env's reset produce finite "
                 r"observations",
    "log_undeclared": r"step\(\) logged 'Episode/x', which env.log_keys \(\) does not declare",
    "log_scalar": r"step\(\)'s extras\['log'\]\['Episode/x'\] must be a scalar .* got shape \[8\]",
    "log_one_element": r"step\(\)'s extras\['log'\]\['Episode/x'\] must be a scalar \(a 0-d tensor or a number: "
                       r"one value per step, e.g. a mean over the envs\), got shape \[1\]",
    "no_sampler": r"the env has no sampler \(the runner reads the attributes num_envs, num_actions, obs_dims, "
                  r"log_keys, sampler, generator and calls reset, step, state_dict, load_state_dict\)",
    "no_generator_no_log_keys": r"the env has no log_keys, generator \(the runner reads",
    "generator_seed": r"env.generator is an int, not a torch.Generator \(the env's RNG, seeded with the seed "
                      r"make_env passes; checkpoints save its state per rank\)",
    "state_list": r"env.state_dict\(\)\['counts'\] is a list, not a tensor: the sampler or curriculum state that "
                  r"checkpoints save is tensors in \(nested\) dicts",
    "state_float": r"env.state_dict\(\)\['sampler'\]\['floor'\] is a float, not a tensor",
    "state_slash": r"env.state_dict\(\) has the key 'sampler/counts'; a key must be a str without '/'",
    "state_tuple": r"env.state_dict\(\) must be a dict of tensors \(\{\} when the env has no sampler or "
                   r"curriculum\), got tuple",
    "log_str": r"step\(\)'s extras\['log'\]\['Episode/x'\] must be a scalar .* got a str",
    "num_envs_float": r"env.num_envs is 8.0, but 8 envs were asked for \(.* exactly that many, an int\)",
    "log_keys_runner": r"env.log_keys names 'Train/mean_reward' twice or as one of the runner's metrics \(its names: "
                       r"Episode/return and those under Train/, Loss/, Policy/, Perf/, Comm/, Control/\); give",
    "log_keys_twice": r"env.log_keys names 'Episode/x' twice or as one of the runner's metrics",
    "log_keys_return": r"env.log_keys names 'Episode/return' twice or as one of the runner's metrics",
    "sampler_object": r"env.sampler is an object without a tensor local_counts and a commit_global\(summed\) method",
}


def train_with(env_class, mistake: str, iterations: int, tmp_path, monkeypatch, error: str) -> None:
    """A short cartpole run on `env_class(..., mistake)` must end with the one line `error` names."""
    monkeypatch.setattr(train, "make_env", lambda cfg, device, seed, base_seed: env_class(cfg.num_envs, device, seed,
                                                                                           mistake))
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.ppo.num_mini_batches, cfg.max_iterations = 8, 4, 2, iterations
    cfg.log.root = str(tmp_path)
    with pytest.raises(RunError, match=r"^env 'cartpole': " + error):
        train.main(cfg)


@pytest.mark.parametrize("mistake", MISTAKES)
def test_env_protocol_mistake_is_one_line_naming_it(mistake, tmp_path, monkeypatch):
    train_with(Broken, mistake, 1, tmp_path, monkeypatch, MISTAKES[mistake])
    if not MISTAKES[mistake].startswith(r"step"):        # found before the run starts: nothing of a run is written
        assert not any(tmp_path.rglob("events.out.*")) and not any(tmp_path.rglob("model_*.pt"))


def test_a_correct_env_passes_and_no_final_obs_is_fine_without_bootstrap(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "make_env", lambda cfg, device, seed, base_seed: Broken(cfg.num_envs, device, seed,
                                                                                        "no_final_obs"))
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.ppo.num_mini_batches, cfg.max_iterations = 8, 4, 2, 1
    cfg.log.root, cfg.ppo.bootstrap_time_outs = str(tmp_path), False
    train.main(cfg)
    monkeypatch.setattr(train, "make_env", lambda cfg, device, seed, base_seed: Broken(cfg.num_envs, device, seed, ""))
    cfg.ppo.bootstrap_time_outs = True
    train.main(cfg)


def test_a_step_flagged_both_terminated_and_truncated_is_a_termination_never_bootstrapped():
    env = Broken(8, "cpu", 0, "both")         # every env, every step: both flags set
    model = build_actor_critic(preset("cartpole").policy, env.obs_dims, env.num_actions)
    batch, _ = collect_rollout(model, env, env.reset()[0], 3, 0.99, True, EpisodeStats(8, TRAIN_KEYS, "cpu"))
    assert batch["dones"].all()
    assert torch.equal(batch["bootstrap"], torch.zeros(3, 8))     # gamma * V(final obs) would be nonzero


class LateMistake(CartPole):
    """Cart-pole whose extras go wrong only from its 6th step on (the second iteration of 4 steps), as those of an
    env that fills them on the steps where episodes end first go wrong mid-run."""

    def __init__(self, num_envs, device, seed, mistake):
        super().__init__(num_envs, device, seed)
        self.mistake, self.steps, self.log_keys = mistake, 0, ("Episode/x",)

    def step(self, actions):
        obs, reward, terminated, truncated, extras = super().step(actions)
        self.steps += 1
        if self.steps < 6:
            return obs, reward, terminated, truncated, {**extras, "log": {"Episode/x": reward.mean()}}
        if self.mistake == "undeclared":
            extras["log"] = {"Episode/y": reward.mean()}
        if self.mistake == "per_env":
            extras["log"] = {"Episode/x": reward}
        if self.mistake == "no_final_obs":
            del extras["final_obs"]
        if self.mistake == "no_log":
            del extras["log"]
        return obs, reward, terminated, truncated, extras


LATE_MISTAKES = {
    "undeclared": r"step\(\) logged 'Episode/y', which env.log_keys \('Episode/x',\) does not declare",
    "per_env": r"step\(\)'s extras\['log'\]\['Episode/x'\] must be a scalar .* got shape \[8\]",
    "no_final_obs": r"step\(\)'s extras has no 'final_obs'",
    "no_log": r"step\(\)'s extras must be a dict with 'log'",
}


@pytest.mark.parametrize("mistake", LATE_MISTAKES)
def test_a_mistake_in_the_extras_of_a_later_step_is_named_too(mistake, tmp_path, monkeypatch):
    train_with(LateMistake, mistake, 2, tmp_path, monkeypatch, LATE_MISTAKES[mistake])


class ClampsInPlace(CartPole):
    """Cart-pole that clamps its actions to +-0.1 in place, or (`in_place=False`) into a new tensor: same dynamics."""

    def __init__(self, num_envs, device, seed, in_place):
        super().__init__(num_envs, device, seed)
        self.in_place = in_place

    def step(self, actions):
        return super().step(actions.clamp_(-0.1, 0.1) if self.in_place else actions.clamp(-0.1, 0.1))


def rollouts_of(env_class) -> list[dict]:
    """5 steps of 8 envs of `env_class(..., False)`, then of `env_class(..., True)`, from the same seeds: batches
    that must be equal when the rollout is immune to what the True variant does."""
    batches = []
    for variant in (False, True):
        torch.manual_seed(0)
        env = env_class(8, "cpu", 0, variant)
        model = build_actor_critic(preset("cartpole").policy, env.obs_dims, env.num_actions)
        stats = EpisodeStats(8, TRAIN_KEYS, "cpu")
        batches.append(collect_rollout(model, env, env.reset()[0], 5, 0.99, True, stats)[0])
    return batches


def test_the_batch_keeps_the_sampled_actions_when_the_env_changes_them_in_place():
    reference, batch = rollouts_of(ClampsInPlace)
    assert batch["actions"].abs().max() > 0.1           # the policy's std is 1: what it sampled, not what the env ran
    for field in ("actions", "log_probs", "actor_obs", "rewards"):
        assert torch.equal(batch[field], reference[field]), field


class ReusesBuffers(CartPole):
    """Cart-pole that writes each observation and reward into the tensors it returned before (one buffer each, as
    simulators keep them), or (`reuse=False`) returns new ones: the same numbers."""

    def __init__(self, num_envs, device, seed, reuse):
        super().__init__(num_envs, device, seed)
        self.reuse, self.buffers = reuse, {}

    def into_buffer(self, name, value):
        if not self.reuse:
            return value
        self.buffers.setdefault(name, torch.empty_like(value)).copy_(value)
        return self.buffers[name]

    def reset(self):
        obs, extras = super().reset()
        return {group: self.into_buffer(group, value) for group, value in obs.items()}, extras

    def step(self, actions):
        obs, reward, terminated, truncated, extras = super().step(actions)
        obs = {group: self.into_buffer(group, value) for group, value in obs.items()}
        return obs, self.into_buffer("reward", reward), terminated, truncated, extras


def test_the_batch_keeps_every_step_of_an_env_that_reuses_its_observation_and_reward_tensors():
    reference, batch = rollouts_of(ReusesBuffers)
    assert not torch.equal(reference["actor_obs"][0], reference["actor_obs"][1])     # the steps differ
    for field in ("actor_obs", "critic_obs", "rewards", "last_critic_obs", "actions", "log_probs"):
        assert torch.equal(batch[field], reference[field]), field


def test_a_batch_stays_as_collected_while_an_env_that_reuses_its_buffers_keeps_stepping():
    """The batch is the rollout's own copy, `last_critic_obs` (the observation GAE bootstraps from) included: the
    next collection steps an env that writes into the tensors it returned, and must leave an earlier batch (kept,
    sent or not yet filled into storage) as it was."""
    torch.manual_seed(0)
    env = ReusesBuffers(8, "cpu", 0, True)
    model = build_actor_critic(preset("cartpole").policy, env.obs_dims, env.num_actions)
    stats = EpisodeStats(8, TRAIN_KEYS, "cpu")
    batch, obs = collect_rollout(model, env, env.reset()[0], 3, 0.99, True, stats)
    kept = {name: value.clone() for name, value in batch.items()}
    later, _ = collect_rollout(model, env, obs, 3, 0.99, True, stats)
    assert not torch.equal(later["last_critic_obs"], kept["last_critic_obs"])      # the env's buffer moved on
    for name, value in kept.items():
        assert torch.equal(batch[name], value), name


class StepOnlyMistake(CartPole):
    """Cart-pole whose reset is correct and whose every step returns one wrong thing: the check of the run's first
    step must see it there, since the reset's checks cannot."""

    def __init__(self, num_envs, device, seed, mistake):
        super().__init__(num_envs, device, seed)
        self.mistake = mistake

    def step(self, actions):
        obs, reward, terminated, truncated, extras = super().step(actions)
        if self.mistake == "obs_shape":
            obs = {**obs, "policy": obs["policy"][:, :3]}
        if self.mistake == "obs_float64":
            obs = {**obs, "critic": obs["critic"].double()}
        if self.mistake == "truncated_int":
            truncated = truncated.long()
        if self.mistake == "reward_float64":
            reward = reward.double()
        if self.mistake == "reward_device":
            reward = reward.to("meta")
        if self.mistake == "obs_numpy":
            obs = {**obs, "policy": obs["policy"].numpy()}
        if self.mistake == "four_values":                # gym's old API: (obs, reward, done, info)
            return obs, reward, terminated | truncated, extras
        return obs, reward, terminated, truncated, extras


STEP_ONLY_MISTAKES = {
    "obs_shape": r"step\(\)'s obs\['policy'\] has shape \[8, 3\], expected \[num_envs, "
                 r"obs_dims\['policy'\]\] = \[8, 4\]",
    "obs_float64": r"step\(\)'s obs\['critic'\] has dtype torch.float64, expected torch.float32",
    "truncated_int": r"step\(\)'s truncated has dtype torch.int64, expected torch.bool",
    "reward_float64": r"step\(\)'s reward has dtype torch.float64, expected torch.float32",
    "reward_device": r"step\(\)'s reward is on meta, expected the run's device cpu",
    "obs_numpy": r"step\(\)'s obs\['policy'\] must be a torch.Tensor, got ndarray",
    "four_values": r"step\(\) must return \(obs, reward, terminated, truncated, extras\)",
}


@pytest.mark.parametrize("mistake", STEP_ONLY_MISTAKES)
def test_a_mistake_only_the_step_makes_is_named_by_the_first_step_check(mistake):
    """The reset passes its checks; the first step's own observation, reward and flags are checked as well."""
    from ppo.env_check import check_reset, step_checker
    env = StepOnlyMistake(8, "cpu", 0, mistake)
    check_reset(env, env.reset(), "mine", torch.device("cpu"))
    check = step_checker(env, "mine", torch.device("cpu"), True)
    with pytest.raises(RunError, match=r"^env 'mine': " + STEP_ONLY_MISTAKES[mistake]):
        check(env.step(torch.zeros(8, 1)))
    correct = StepOnlyMistake(8, "cpu", 0, "")
    correct.reset()
    step_checker(correct, "mine", torch.device("cpu"), True)(correct.step(torch.zeros(8, 1)))


@pytest.mark.parametrize("mistake, said", [
    (lambda g: g[:, :3], r"\['policy'\] has shape \[8, 3\], expected \[num_envs, obs_dims\['policy'\]\] = \[8, 4\]"),
    (lambda g: g.double(), r"\['policy'\] has dtype torch.float64, expected torch.float32"),
    (lambda g: g.numpy(), r"\['policy'\] must be a torch.Tensor, got ndarray"),
], ids=["shape", "float64", "numpy"])
def test_a_final_obs_wrong_only_on_a_later_step_is_named_there(mistake, said):
    """Only the first step's final_obs had its shapes and types checked: one built wrong on the steps where episodes
    end (mid-run) went into the time-out bootstrap as a torch error, `unexpected RuntimeError (traceback above)`."""
    from ppo.env_check import step_checker
    env = CartPole(8, "cpu", 0)
    env.reset()
    check = step_checker(env, "mine", torch.device("cpu"), True)
    check(env.step(torch.zeros(8, 1)))
    obs, reward, terminated, truncated, extras = env.step(torch.zeros(8, 1))
    extras = {**extras, "final_obs": {**extras["final_obs"], "policy": mistake(extras["final_obs"]["policy"])}}
    with pytest.raises(RunError, match=r"^env 'mine': step\(\)'s extras\['final_obs'\]" + said):
        check((obs, reward, terminated, truncated, extras))


def test_a_state_key_that_is_not_a_str_is_named():
    """Rollout ranks send the env's state as 'a/b' names and rebuild str keys: an int key would not come back as
    itself, so it is refused like a key with '/' in it."""
    from ppo.env_check import check_state
    error = r"^env 'mine': env.state_dict\(\)\['sampler'\] has the key 3; a key must be a str without '/'"
    with pytest.raises(RunError, match=error):
        check_state({"sampler": {3: torch.zeros(2)}}, "mine")
    check_state({"sampler": {"counts": torch.zeros(2)}}, "mine")


def test_a_non_finite_reset_observation_is_named_at_its_first_env_and_feature():
    """Of several NaN/inf in the reset's observations, the one named is the first in (env, feature) order."""
    from ppo.env_check import check_reset
    env = CartPole(8, "cpu", 0)
    obs, extras = env.reset()
    obs["policy"][5, 0], obs["policy"][2, 3], obs["policy"][2, 1] = torch.nan, torch.inf, -torch.inf
    with pytest.raises(RunError, match=r"^env 'mine': reset\(\)'s obs\['policy'\] holds -inf at env 2 feature 1;"):
        check_reset(env, (obs, extras), "mine", torch.device("cpu"))


def test_a_bool_num_envs_is_refused_though_it_equals_the_number_asked_for():
    """True == 1: one env asked for, and an env whose num_envs is True passed the size comparison."""
    from ppo.env_check import check_built
    env = CartPole(1, "cpu", 0)
    check_built(env, "mine", 1)
    env.num_envs = True
    with pytest.raises(RunError, match=r"^env 'mine': env.num_envs is True, but 1 envs were asked for"):
        check_built(env, "mine", 1)

