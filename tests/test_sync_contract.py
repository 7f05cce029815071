"""The sync contract end to end: plan == ledger, buffer rules, replica verification, sampler counts,
non-finite steps skipped everywhere."""

import pytest
import torch
from torch import nn

import train
from configs import preset
from dist import comm
from dist.buffers import resolve_buffer_policy, sync_buffers
from dist.grad_sync import GradSync
from dist.plan import expected_ledger
from dist.stats import sum_counts
from dist.verify import verify_replicas
from envs.motions import AdaptiveMotionSampler
from ppo.storage import RolloutStorage
from ppo.update import ppo_update
from tests.multirank import run_ranks
from tests.ppo_fixtures import A, N, OBS, T, fill, make_model, ppo_cfg


def ledger_body(rank, world_size, root, epochs, minibatches, micro, mode, iterations):
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 8, 4, iterations
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (16,)
    cfg.ppo.num_epochs, cfg.ppo.num_mini_batches, cfg.ppo.num_micro_batches = epochs, minibatches, micro
    cfg.dist.grad_sync, cfg.dist.bucket_mb = mode, 0.002
    cfg.dist.verify_every, cfg.dist.sampler_sync_every = 2, 2
    cfg.log.root, cfg.log.save_every, cfg.log.print_every = root, 2, 100
    cfg.dist.device = "cpu"          # gloo ranks on CPU even where a GPU is visible
    comm.reset_ledger()
    _, scalars, plan = train.main(cfg)
    return ({k: list(v) for k, v in comm.LEDGER.items()}, expected_ledger(plan, iterations, final_iteration=iterations),
            scalars)


@pytest.mark.slow
@pytest.mark.parametrize("epochs, minibatches, micro, mode",
                         [(2, 2, 1, "flat"), (1, 4, 2, "bucketed"), (3, 1, 4, "bucketed")])
def test_ledger_after_training_equals_the_printed_plan(tmp_path, epochs, minibatches, micro, mode):
    iterations = 3
    results = run_ranks(ledger_body, 2, args=(str(tmp_path), epochs, minibatches, micro, mode, iterations))
    for ledger, expected, scalars in results:
        assert ledger == expected
        steps = epochs * minibatches
        if mode == "bucketed":
            assert expected["gradients"][0] > steps * iterations    # several buckets per optimizer step
        assert expected["gradients"][0] % (steps * iterations) == 0
        assert scalars["Comm/metrics_calls"] == 1 and scalars["Comm/advantages_calls"] == 2   # (n, sum), then dev^2


def resumed_ledger_body(rank, world_size, root, resume):
    """3 iterations saved at 2 and 3; then (`resume`) from model_3.pt to 6: the every-2 rows (replica check, sampler
    sum, checkpoint) run after iterations 4 and 6, twice in 3 iterations, where counting from 0 gives once."""
    import os
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 8, 4, 3
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (16,)
    cfg.dist.verify_every, cfg.dist.sampler_sync_every, cfg.dist.device = 2, 2, "cpu"
    cfg.log.root, cfg.log.save_every, cfg.log.print_every = root, 2, 100
    if resume:
        (run,) = os.listdir(os.path.join(root, "tracking"))
        cfg.resume, cfg.max_iterations = os.path.join(root, "tracking", run, "model_3.pt"), 6
    comm.reset_ledger()
    _, _, plan = train.main(cfg)
    return {k: list(v) for k, v in comm.LEDGER.items()}, expected_ledger(plan, 3, final_iteration=6, start=3)


@pytest.mark.slow
def test_ledger_of_a_resumed_run_equals_its_plan_from_the_checkpoint_iteration(tmp_path):
    run_ranks(resumed_ledger_body, 2, args=(str(tmp_path), False))
    for ledger, expected in run_ranks(resumed_ledger_body, 2, args=(str(tmp_path), True)):
        assert ledger == expected
        assert expected["checksum"][0] == 1 + 2          # after the load, then after iterations 4 and 6


class WithBuffers(nn.Module):
    BUFFER_POLICY = {"shared": "broadcast", "averaged": "mean", "stats.*": "merge", "per_env": "local"}

    def __init__(self, rank):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        for name in ("shared", "averaged", "per_env"):
            self.register_buffer(name, torch.full((3,), float(rank + 1)))
        self.stats = nn.Module()
        self.stats.register_buffer("count", torch.tensor(float(rank)))


def buffers_body(rank, world_size):
    m = WithBuffers(rank)
    sync_buffers(m, resolve_buffer_policy(m, m.BUFFER_POLICY))
    return {k: v.clone() for k, v in m.named_buffers()}


@pytest.mark.slow
def test_buffer_rules_broadcast_mean_merge_local():
    for rank, bufs in enumerate(run_ranks(buffers_body, 2)):
        assert bufs["shared"].tolist() == [1.0] * 3                    # rank 0's value
        assert bufs["averaged"].tolist() == [1.5] * 3                  # mean of 1 and 2
        assert bufs["per_env"].tolist() == [float(rank + 1)] * 3      # untouched
        assert bufs["stats.count"].item() == float(rank)               # merged by its owner, not here


def test_undeclared_buffer_is_a_start_up_error_naming_it():
    m = WithBuffers(0)
    m.register_buffer("new_thing", torch.zeros(1))
    with pytest.raises(ValueError, match="new_thing"):
        resolve_buffer_policy(m, m.BUFFER_POLICY)
    with pytest.raises(ValueError, match="unknown buffer rules"):
        resolve_buffer_policy(m, {"*": "average"})


def diverge_body(rank, world_size, odd=2):
    model = make_model()
    verify_replicas(model)                      # equal: passes
    if rank == odd:
        with torch.no_grad():
            model.actor[0].weight[0, 0] += 1e-7   # one ulp-scale change on one rank
    return verify_message(model)


def verify_message(model) -> str:
    """What verify_replicas raised on this rank, or "no error"."""
    try:
        verify_replicas(model)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("odd", [2, 0])
def test_divergent_parameters_are_detected_naming_the_rank(odd):
    """The rank that differs from the two others is named, rank 0 too (not the two healthy ones)."""
    agree = [r for r in range(3) if r != odd]
    for message in run_ranks(diverge_body, 3, args=(odd,)):
        assert f"rank(s) [{odd}] differ from rank(s) {agree} (checksums" in message


def local_buffer_body(rank, world_size):
    """Equal parameters (one seed), buffers synchronized by their rules: `per_env` (local) and `stats.count`
    (merged by its owner) still differ across ranks, by design."""
    torch.manual_seed(0)
    m = WithBuffers(rank)
    sync_buffers(m, resolve_buffer_policy(m, m.BUFFER_POLICY))
    return verify_message(m)


@pytest.mark.slow
def test_buffers_a_rule_leaves_different_on_each_rank_are_not_a_divergence():
    """verify_replicas checks the parameters (and, given the rules, the non-local buffers); a `local` buffer (a per-env
    running return) differs across ranks by design and must not stop the run as a diverged replica."""
    assert run_ranks(local_buffer_body, 2) == ["no error", "no error"]


def last_parameter_body(rank, world_size):
    """Rank 1 moves the last parameter of a small model by one ulp; returns verify_replicas' message and this
    rank's checksum by the independent reference."""
    from test_checksum_reference import ref_checksum
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    if rank == 1:
        with torch.no_grad():
            model[1].bias.copy_(torch.nextafter(model[1].bias, torch.tensor(2.0)))
    try:
        verify_replicas(model)
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    return message, ref_checksum(list(model.parameters()))


@pytest.mark.slow
def test_a_change_to_the_last_parameter_on_a_middle_rank_names_that_rank_alone_with_every_checksum():
    """Every parameter is in the checksum (the last too), each rank is compared with rank 0 (not with a neighbour:
    rank 1 differing from both must not name ranks 0 and 2), and the message lists the exact int64 checksums, as
    the reference computes them."""
    (message, ref0), (_, ref1), (_, ref2) = results = run_ranks(last_parameter_body, 3)
    assert ref0 == ref2 != ref1
    for got, _ in results:
        assert got == (f"parameters diverged across ranks: rank(s) [1] differ from rank(s) [0, 2] (checksums "
                       f"{[ref0, ref1, ref2]}); something updated some replicas without the others; "
                       f"tensors that differ: ['1.bias']")


def sampler_body(rank, world_size):
    s = AdaptiveMotionSampler(3, 0.2, "cpu")
    s.record(torch.tensor([rank, rank]), torch.tensor([True, True]), torch.tensor([True, True]))
    local_probs = s.probabilities()
    sum_counts(s)
    return local_probs, s.probabilities(), s.global_counts.clone(), s.local_counts.clone()


@pytest.mark.slow
def test_sampler_counts_are_summed_not_averaged():
    results = run_ranks(sampler_body, 2)
    for local_probs, probs, global_counts, local_counts in results:
        assert global_counts.tolist() == [[2.0, 2.0, 0.0], [2.0, 2.0, 0.0]]   # visits, failures: sums over ranks
        assert local_counts.abs().sum() == 0
        torch.testing.assert_close(probs, results[0][1])
    assert not torch.equal(results[0][0], results[1][0])   # before the sync each rank sampled by its own counts


def nonfinite_body(rank, world_size):
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, torch.device("cpu"))
    fill(storage, rank, model)
    if rank == 1:
        storage.returns[0, 0] = float("nan")    # poisons every minibatch that holds env 0 of rank 1
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sync = GradSync(model.parameters(), num_extras=2)
    stats = ppo_update(model, optimizer, storage, sync, ppo_cfg(advantage_norm="local"),
                       generator=torch.Generator().manual_seed(rank))
    return stats["skipped_steps"], {k: v.clone() for k, v in model.state_dict().items() if "normalizer" not in k}


@pytest.mark.slow
def test_nonfinite_gradient_on_one_rank_is_skipped_by_every_rank():
    (skipped0, state0), (skipped1, state1) = run_ranks(nonfinite_body, 2)
    cfg = ppo_cfg()
    assert skipped0 == skipped1 == cfg.num_epochs        # one poisoned minibatch per epoch, on both ranks
    for key in state0:
        assert torch.isfinite(state0[key]).all(), key
        assert torch.equal(state0[key], state1[key]), key


def test_mean_rule_on_an_integer_buffer_is_a_start_up_error():
    bn = nn.BatchNorm1d(3)
    with pytest.raises(ValueError, match=r"\['num_batches_tracked'\] are integer but declared `mean`"):
        resolve_buffer_policy(bn, {"running_*": "mean", "num_batches_tracked": "mean"})
    resolve_buffer_policy(bn, {"running_*": "mean", "num_batches_tracked": "broadcast"})


def phase_times_body(rank, world_size, root, slow="collection"):
    """Rank 1's clock reads its collections (or, `slow` "update", its updates) 1000 s long: train.finished shifted
    on that phase's ends only."""
    import itertools
    import time
    calls, ends = itertools.count(), 0 if slow == "collection" else 1
    if rank == 1:
        train.finished = lambda device: time.time() + (1000.0 if next(calls) % 2 == ends else 0.0)
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 8, 8, 2
    cfg.log.root, cfg.dist.device = root, "cpu"
    _, scalars, _ = train.main(cfg)
    return scalars


@pytest.mark.slow
def test_phase_times_are_the_slowest_collection_and_the_least_waiting_update(tmp_path):
    """Perf/* by declared ops, not rank 0's clock: the collection time is the slowest rank's (rank 1's 1000 s), the
    learning time the shortest update (rank 1's, which waited least: here rank 0's, whose clock is not shifted, is
    the same real update) and total_fps uses both, on every rank."""
    for scalars in run_ranks(phase_times_body, 2, args=(str(tmp_path),)):
        assert 1000.0 < scalars["Perf/collection_time"] < 1000.0 + 60
        assert 0.0 < scalars["Perf/learning_time"] < 60
        steps = 2 * 8 * 8
        assert scalars["Perf/total_fps"] == steps / (scalars["Perf/collection_time"] + scalars["Perf/learning_time"])


def other_log_keys_body(rank, world_size, root, keys):
    """Cart-pole declaring `keys[rank]` as its log_keys (it logs none of them)."""
    make_env = train.make_env

    def env_with_keys(*args, **kwargs):
        env = make_env(*args, **kwargs)
        env.log_keys = keys[rank]
        return env
    train.make_env = env_with_keys
    return one_cartpole_iteration(root)


def one_cartpole_iteration(root: str, change=None) -> str:
    """What one iteration of a small cartpole run ends with: "trained", or its one-line error. `change`: (field,
    value) set in the config first."""
    from dist.errors import RunError, UsageError
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations, cfg.log.root = 8, 8, 1, root
    if change is not None:
        section, field = change[0].split(".")
        setattr(getattr(cfg, section), field, change[1])
    try:
        train.main(cfg)
    except (RunError, UsageError) as exc:
        return str(exc)
    return "trained"


@pytest.mark.slow
@pytest.mark.parametrize("keys", [((), ("Episode/x",)), (("Episode/a",), ("Episode/b",)),
                                  (("Episode/a", "Episode/b"), ("Episode/b", "Episode/a"))],
                         ids=["one-more", "as-many-other", "other-order"])
def test_ranks_whose_envs_declare_other_log_keys_stop_at_start_up(tmp_path, keys):
    """The metrics all-reduce packs each rank's names in sorted order: as many other names added one rank's metric
    into another's without a word (a custom env's success rate read 0.12 for 0.0), one more aborted the process in
    gloo. Both are refused on every rank before the first iteration; the same names in another order (a set's) pair
    up by name, and train."""
    for said in run_ranks(other_log_keys_body, 2, args=(str(tmp_path), keys)):
        if keys[0] == tuple(reversed(keys[1])):
            assert said == "trained"
            continue
        assert said.startswith("the metric names differ: rank(s) [1] differ from rank(s) [0] (checksums ") and \
            said.endswith("); every rank's env must declare the same log_keys (envs/base.py)"), said
        assert not list(tmp_path.rglob("events.out.*"))


def other_settings_body(rank, world_size, root, change):
    """Cart-pole on every rank, rank 1 with `change` (field, value) of its config."""
    return one_cartpole_iteration(f"{root}/{rank}", change if rank == 1 else None)


@pytest.mark.slow
@pytest.mark.parametrize("change, said", [
    (("env.num_envs", 16), "rank(s) [1] run with other settings than rank 0: --env.num-envs differ ("),  # trained on
    (("ppo.num_epochs", 3), "rank(s) [1] run with other settings than rank 0: --ppo.num-epochs differ ("),  # aborted
    (("dist.timeout_s", 120.0), "trained"),           # per node, as --log.root (each rank has its own here)
])
def test_ranks_started_with_other_settings_stop_at_start_up(tmp_path, change, said):
    """Nodes started with other flags: another env count trained to the end with unequal batches (and the start-up
    line and config_0.json said rank 0's), another epoch count aborted the process in gloo (SIGABRT, no line).
    Now every rank stops before anything is built, naming the ranks and the flags; what may differ per node does not
    stop it.
    Mutant: train.py's agree_on_checkpoint call without `explain` (the flags unnamed)."""
    for result in run_ranks(other_settings_body, 2, args=(str(tmp_path), change)):
        assert result.startswith(said), result


def merge_buffer_body(rank, world_size):
    """Equal parameters; the `merge` buffer stats.count differs (its owner's merge went wrong on one rank), then only
    the `local` per_env does."""
    torch.manual_seed(0)
    m = WithBuffers(rank)
    rules = resolve_buffer_policy(m, m.BUFFER_POLICY)
    sync_buffers(m, rules)
    messages = []
    for _ in range(2):
        try:
            verify_replicas(m, buffer_rules=rules)
            messages.append("no error")
        except RuntimeError as e:
            messages.append(str(e))
        m.stats.count.fill_(7.0)                   # now only the local buffer differs
    return messages


@pytest.mark.slow
def test_a_diverged_merge_buffer_is_detected_naming_it_and_a_local_one_is_not():
    """The normalizers' statistics (`merge`) must be equal on every rank like the parameters; verify_replicas given
    the buffer rules checks them and names the tensor, and still leaves `local` buffers alone."""
    for first, second in run_ranks(merge_buffer_body, 2):
        assert "rank(s) [1] differ from rank(s) [0]" in first and first.endswith("tensors that differ: ['stats.count']")
        assert second == "no error"


def combo_body(rank, world_size, root, name, flags, iterations):
    """A short run of preset `name` with `flags` ({"section.field": value}); this rank's ledger and the plan's."""
    cfg = preset(name)
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 8, 4, iterations
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (16,)
    cfg.log.root, cfg.log.print_every, cfg.dist.device = root, 100, "cpu"
    for key, value in flags.items():
        section, field = key.split(".")
        setattr(getattr(cfg, section), field, value)
    comm.reset_ledger()
    _, _, plan = train.main(cfg)
    return {k: list(v) for k, v in comm.LEDGER.items()}, expected_ledger(plan, iterations, final_iteration=iterations)


@pytest.mark.slow
@pytest.mark.parametrize("name, flags", [
    ("cartpole", {"ppo.normalize_rewards": True, "log.episode_returns": True, "ppo.advantage_norm": "local",
                  "dist.verify_every": 1, "log.save_every": 1, "dist.grad_sync": "flat"}),
    ("cartpole", {"policy.normalize_actor_obs": True, "policy.normalize_critic_obs": False,
                  "ppo.advantage_norm": "minibatch", "dist.grad_sync": "bucketed", "dist.verify_every": 3}),
    ("tracking", {"ppo.normalize_rewards": True, "policy.normalize_actor_obs": True, "ppo.advantage_norm": "none",
                  "log.episode_returns": True, "dist.verify_every": 2, "log.save_every": 3}),
])
def test_ledger_equals_the_plan_for_other_flag_combinations(tmp_path, name, flags):
    for ledger, expected in run_ranks(combo_body, 2, args=(str(tmp_path), name, flags, 3)):
        assert ledger == expected
