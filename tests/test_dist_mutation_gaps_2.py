"""Gaps found by a second mutation audit of dist/checkpoint.py, dist/checkpoint_read.py, dist/verify.py and
dist/stats.py, aimed at the code added since 2026-12-03 (env state refused when it differs by rank, the buffers
verify_replicas checks, reduce_metrics' maxima and plan rows, what counts as a damaged checkpoint): each test below
fails on a hand-made mutation that every earlier test let through. Expected values are written by hand.

Pinned: a betas list of any length >= 2, a bool weight decay, an integer-tensor LR, Adam moments with an extra tensor,
a seed that is a float or a bool, a 12-byte RNG state, a non-dict config section 'dist', any one founding setting
dropped from the list (ppo.advantage_norm was untested), a negative std or local sampler count, all accepted; a
checkpoint without "layout" read as 1 learner; verify_replicas ignoring buffer_rules, or checking merge (and
broadcast) buffers only; same_names_everywhere order-insensitive; same_env_state blind to dtypes, comparing the first
entry's values only, naming every rank but 0, or saying "" for no entries; the env-state, sampler and metrics plan
rows at another cadence, byte count or rule.

Equivalent or not worth a test: comparing every rank with the last one instead of rank 0 in an any/all test
(same_env_state's two checks, differing_tensors): "all equal to one of them" is the same predicate; the parameters
checksummed after the buffers instead of before (same on every rank; only the order of names in the error when a
parameter and a buffer both differ); "syncppo-checkpoint" without its "-" as the prefix of another version's format
(only the wording for a format no syncppo wrote); weight decay refused from 1 up (no run sets one: Adam's 0.0)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dist.buffers import resolve_buffer_policy
from dist.checkpoint import checkpoint_plan_rows, same_env_state
from dist.checkpoint_read import load_checkpoint
from dist.errors import RunError, UsageError
from dist.plan import PlanRow
from dist.stats import metrics_plan_rows, sum_counts_plan_rows
from dist.verify import same_names_everywhere, verify_replicas
from tests.multirank import run_ranks
from tests.test_checkpoint_read_rules import _config_without, _saved, _state, _with_group, _with_moments

DIVERGED = ": the file is damaged or its run diverged; resume from an earlier model_<k>.pt"


def test_adam_betas_of_three_numbers_are_damage(tmp_path):
    """Adam unpacks `beta1, beta2 = group["betas"]` at its first step: a third number, each in [0, 1), is not Adam's
    settings and must be refused when the file is read, not as a ValueError traceback after the first rollout."""
    path = _saved(tmp_path, _with_group(betas=(0.9, 0.999, 0.5)))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its optimizer param group 0 has betas (0.9, 0.999, 0.5) "
                              f"and weight_decay 0.0, not Adam's settings); resume from another checkpoint")


def test_an_integer_tensor_lr_is_not_a_number(tmp_path):
    """A run saves its LR as a number, or under --ppo.capture-step as a one-element float tensor: an integer tensor is
    no LR any run writes (a damaged file), refused by name like a two-element one."""
    path = _saved(tmp_path, _with_group(lr=torch.tensor(3)))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its optimizer param group 0 has lr tensor(3), not a "
                              f"number); resume from another checkpoint")


def test_adam_moments_with_an_extra_tensor_are_not_adam_s(tmp_path):
    """Adam's state per parameter is exactly step, exp_avg and exp_avg_sq: a fourth tensor (AMSGrad's
    max_exp_avg_sq, which this version never writes) is refused, not carried into the resumed optimizer."""
    path = _saved(tmp_path, _with_moments(max_exp_avg_sq=torch.zeros(2)))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its optimizer state for parameter 0 is not Adam's "
                              f"(tensors exp_avg, exp_avg_sq and a one-element step), got ['exp_avg', 'exp_avg_sq', "
                              f"'max_exp_avg_sq', 'step']); resume from another checkpoint")


def test_a_weight_decay_of_true_is_not_adam_s_setting(tmp_path):
    """A bool is no number here (True is 1 to Python, and Adam would decay every weight by 1.0 per step): the group
    is refused as not Adam's settings."""
    path = _saved(tmp_path, _with_group(weight_decay=True))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its optimizer param group 0 has betas (0.9, 0.999) and "
                              f"weight_decay True, not Adam's settings); resume from another checkpoint")


def test_a_checkpoint_of_two_learners_written_before_layout_was_saved_loads(tmp_path):
    """Without "layout" a checkpoint says [one learner per saved RNG state, no rollout rank] (ppo/restore.py reads it
    so too): a 2-rank run's file is not refused as a layout of 1 learner."""
    state = _state(rng=[{"torch": torch.get_rng_state()}, {"torch": torch.get_rng_state()}])
    del state["layout"]
    loaded = load_checkpoint(_saved(tmp_path, state))
    assert len(loaded["rng"]) == 2 and "layout" not in loaded


def test_an_rng_state_shorter_than_a_gpu_generator_s_is_refused(tmp_path):
    """A cuda generator's state is exactly 16 bytes (Philox seed and offset), a CPU one's 5056: a 12-byte state (a
    truncated one, whose bytes past the 8th read as an offset of 0) fits neither generator."""
    path = _saved(tmp_path, _state(rng=[{"torch": torch.get_rng_state(), "env": torch.zeros(12, dtype=torch.uint8)}]))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its rng[0]['env'] (12 bytes) is not the state of a torch "
                              f"generator); resume from another checkpoint")


@pytest.mark.parametrize("section", ["env", "policy", "ppo", "dist", "log", "rollout"])
def test_every_config_section_that_is_not_a_dict_is_damage_naming_it(tmp_path, section):
    path = _saved(tmp_path, _state(config={**_config_without(), section: 3}))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its config section {section!r} is not a dict); resume "
                              f"from another checkpoint")


@pytest.mark.parametrize("changes, shown", [
    ({"env_seed": 3.0}, "its env_seed is 3.0"),
    ({"config": {**_config_without(), "seed": True}}, "its config's seed is True"),
], ids=["float-env_seed", "bool-seed"])
def test_a_seed_that_is_a_float_or_a_bool_is_not_an_integer(tmp_path, changes, shown):
    path = _saved(tmp_path, _state(**changes))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged ({shown}, not an integer in [0, 2**32)); resume from "
                              f"another checkpoint")


# The settings the first checkpoint format already saved, written out by hand (a config lacking one resumed at the
# dataclass default instead of the run's value).
FOUNDING = ["env.name", "env.num_envs", "env.episode_length_s", "env.num_motions", "env.sampling_uniform_floor",
            "policy.actor_hidden", "policy.critic_hidden", "policy.activation", "policy.init_noise_std",
            "policy.normalize_critic_obs", "policy.normalize_actor_obs", "ppo.num_steps", "ppo.num_epochs",
            "ppo.num_mini_batches", "ppo.learning_rate", "ppo.schedule", "ppo.desired_kl", "ppo.lr_min", "ppo.lr_max",
            "ppo.gamma", "ppo.lam", "ppo.clip_param", "ppo.clip_value_loss", "ppo.value_loss_coef",
            "ppo.entropy_coef", "ppo.max_grad_norm", "ppo.advantage_norm", "max_iterations", "seed"]


@pytest.mark.parametrize("name", FOUNDING)
def test_a_config_lacking_any_one_founding_setting_is_damage_naming_it(tmp_path, name):
    path = _saved(tmp_path, _state(config=_config_without(name)))       # a fresh config, one setting deleted
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == f"--resume {path!r} is damaged (its config lacks {name}); resume from another checkpoint"


@pytest.mark.parametrize("changes, what", [
    # the observation normalizer's std, a model buffer: a negative one flips the sign of a normalized observation
    ({"model": {"w": torch.tensor([0.5, -1.0]), "obs_normalizer.std": torch.tensor([1.0, -0.5])}},
     "a negative value (-0.5) in its model['obs_normalizer.std'], a standard deviation"),
    ({"reward_normalizer": {"count": torch.tensor(4.0, dtype=torch.float64), "std": torch.tensor(-2.0)}},
     "a negative value (-2) in its reward_normalizer['std'], a standard deviation"),
    # the motion sampler's counts of this rank's episodes, saved beside the summed ones (envs/motions.py)
    ({"env": {"sampler": {"global_counts": torch.zeros(3, dtype=torch.float64),
                          "local_counts": torch.tensor([1.0, -3.0, 0.0], dtype=torch.float64)}}},
     "a negative value (-3) in its env['sampler']['local_counts'], a count"),
], ids=["obs-std", "reward-std", "local-counts"])
def test_a_negative_std_or_local_sampler_count_is_refused_naming_it(tmp_path, changes, what):
    path = _saved(tmp_path, _state(**changes))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == f"--resume {path!r} has {what}{DIVERGED}"


class FourRules(nn.Module):
    """One buffer per rule, the same values on every rank (one seed for the parameter)."""
    BUFFER_POLICY = {"shared": "broadcast", "averaged": "mean", "stats.*": "merge", "per_env": "local"}

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(2, 1)
        self.register_buffer("shared", torch.tensor([1.0, 2.0]))
        self.register_buffer("averaged", torch.tensor([0.5]))
        self.register_buffer("per_env", torch.zeros(3))
        self.stats = nn.Module()
        self.stats.register_buffer("count", torch.tensor(7.0, dtype=torch.float64))


def one_buffer_apart_body(rank, world_size):
    """For each buffer in turn, rank 1 moves it by one ulp; returns what verify_replicas (given the module's rules)
    raised for each, or "no error"."""
    said = {}
    for name in ("shared", "averaged", "stats.count", "per_env"):
        m = FourRules()
        if rank == 1:
            b = m.get_buffer(name)
            b.copy_(torch.nextafter(b, b + 1))
        try:
            verify_replicas(m, buffer_rules=resolve_buffer_policy(m, m.BUFFER_POLICY))
            said[name] = "no error"
        except RuntimeError as error:
            said[name] = str(error)
    return said


@pytest.mark.slow
def test_the_replica_check_covers_broadcast_mean_and_merge_buffers_by_the_rules_given_and_no_local_one():
    """verify_replicas(module, buffer_rules=...) checks the buffers the rules declare broadcast, mean or merge (the
    normalizers' statistics in the model are merge), each named when it alone differs on rank 1; a local one (a
    per-env running return) differs by design and passes."""
    for said in run_ranks(one_buffer_apart_body, 2, timeout=60):
        assert said["per_env"] == "no error"
        for name in ("shared", "averaged", "stats.count"):
            assert said[name].startswith("parameters diverged across ranks: rank(s) [1] differ from rank(s) [0] "
                                         "(checksums "), (name, said[name])
            assert said[name].endswith(f"; tensors that differ: [{name!r}]"), (name, said[name])


def names_in_order_body(rank, world_size):
    """Rank 1 lists the same names as rank 0 in another order; returns what same_names_everywhere raised."""
    try:
        same_names_everywhere(["w", "b"] if rank == 0 else ["b", "w"], "shapes", "the layouts differ", "build alike")
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_the_same_names_in_another_order_are_not_the_same_list():
    """A packed collective pairs tensors by position (the model's layout at start-up is checked this way): the same
    names in another order on rank 1 must stop every rank, naming rank 1."""
    for said in run_ranks(names_in_order_body, 2, timeout=60):
        assert said.startswith("the layouts differ: rank(s) [1] differ from rank(s) [0] (checksums "), said
        assert said.endswith("); build alike"), said


def env_states_body(rank, world_size):
    """Two saves' env states on 3 ranks: (a) rank 1's `steps` int32 zeros where the others hold float32 zeros (the
    same bytes); (b) rank 1's `level` (the last entry) other values, ranks 0 and 2 the same; (c) an entry on rank 1
    alone. Returns what same_env_state raised at each."""
    said = []
    for state in ({"steps": torch.zeros(2, dtype=torch.int32 if rank == 1 else torch.float32)},
                  {"steps": torch.zeros(2), "level": torch.tensor([1.0, 2.0 if rank == 1 else 1.0])},
                  {"steps": torch.zeros(2)} if rank == 1 else {}):
        try:
            same_env_state(state)
            said.append("no error")
        except RunError as error:
            said.append(str(error))
    return said


@pytest.mark.slow
def test_env_state_of_another_dtype_is_a_layout_difference_and_only_the_ranks_that_differ_are_named():
    """An entry of another dtype on one rank is refused as a layout difference even where its bytes equal rank 0's
    (zeros: a checkpoint would have handed rank 1 a float32 entry for its int32 one); the values of every entry are
    compared, the last one too; and of 3 ranks only rank 1, whose values differ, is named (rank 2 holds rank 0's). A
    rank without entries says so ("none")."""
    for rank, (dtype_apart, values_apart, only_one) in enumerate(run_ranks(env_states_body, 3, timeout=60)):
        assert dtype_apart.startswith("env.state_dict() has other entries, shapes or dtypes on rank(s) [1] than on "
                                      "rank 0 (this rank's: steps); "), dtype_apart
        assert values_apart.startswith("env.state_dict() differs across ranks in 'level' (nested names joined by "
                                       "'/'): rank(s) [1] hold other values than rank 0, whose state a checkpoint "
                                       "keeps; "), values_apart
        assert only_one.startswith("env.state_dict() has other entries, shapes or dtypes on rank(s) [1] than on rank 0 "
                                   f"(this rank's: {'steps' if rank == 1 else 'none'}); "), only_one


def test_the_metrics_plan_row_says_max_only_when_there_are_maxima():
    """The printed plan describes the metrics all-reduce: count-weighted means alone, or with the maxima's slot per
    rank (one process: 8 bytes per maximum)."""
    assert metrics_plan_rows(3) == [PlanRow("metrics", "count-weighted mean", "all_reduce", "iteration", [48])]
    assert metrics_plan_rows(3, num_maxima=2) == [PlanRow("metrics", "count-weighted mean, max (a slot per rank)",
                                                          "all_reduce", "iteration", [48 + 16])]


def test_the_env_state_check_is_planned_at_the_save_interval_like_the_rng_gather():
    """Both rows of a save recur every --log.save-every iterations (5 here), so the ledger of a run saving every 5
    iterations matches its plan; the env-state row only when the env is checkpointed."""
    states = {"torch": torch.zeros(7, dtype=torch.uint8), "env": torch.zeros(16, dtype=torch.uint8)}
    rng_row = PlanRow("checkpoint", "RNG states of every rank to rank 0", "gather", "checkpoint", [23], every=5)
    assert checkpoint_plan_rows(states, 5, env_state=False) == [rng_row]
    assert checkpoint_plan_rows(states, 5, env_state=True) == [
        rng_row, PlanRow("env_state", "env state the same on every rank", "all_gather", "checkpoint", [16], every=5)]


def test_the_sampler_rows_plan_the_counts_in_their_own_dtype():
    """sum_counts all-reduces the counts in their own dtype (float64 in envs/motions.py; a curriculum may keep int32):
    6 int32 counts are 24 bytes a call, every 3 iterations and before each save (every 4)."""
    sampler = SimpleNamespace(local_counts=torch.zeros(2, 3, dtype=torch.int32))
    assert sum_counts_plan_rows(sampler, 3, 4) == [
        PlanRow("sampler", "sum of counts", "all_reduce", "every", [24], every=3),
        PlanRow("sampler", "sum of counts before save", "all_reduce", "checkpoint", [24], every=4)]
    assert sum_counts_plan_rows(None, 3, 4) == []
