import pytest
import torch

from ppo.storage import RolloutStorage


def filled_storage(T=5, N=12):
    s = RolloutStorage(T, N, {"policy": 3, "critic": 4}, 2, torch.device("cpu"))
    ids, steps = torch.arange(N, dtype=torch.float32), torch.arange(T, dtype=torch.float32)[:, None]
    s.actor_obs = ids[None, :, None].expand(T, N, 3) + 100 * steps[:, :, None]
    s.action_std = torch.ones(T, N, 2)
    s.rewards.copy_(steps.expand(T, N))
    s.values = ids.expand(T, N)
    return s


def test_each_epoch_yields_every_trajectory_exactly_once_and_whole():
    T, N, M = 5, 12, 4
    s = filled_storage(T, N)
    g = torch.Generator().manual_seed(0)
    orders = []
    for _epoch in range(3):
        seen = []
        for batch in map(s.split, s.minibatches(M, g)):
            assert batch["actor_obs"].shape == (T * N // M, 3)
            env_ids = batch["values"].view(T, N // M)               # values hold the env id
            assert (env_ids == env_ids[0]).all(), "a minibatch must hold whole trajectories (all T steps)"
            steps = batch["actor_obs"][:, 0].view(T, N // M) - env_ids
            assert (steps == 100 * torch.arange(T)[:, None]).all(), "time order within a trajectory is kept"
            seen += env_ids[0].long().tolist()
        assert sorted(seen) == list(range(N))
        orders.append(seen)
    assert orders[0] != orders[1], "trajectories are reshuffled every epoch"


def test_indivisible_minibatches_raise():
    s = filled_storage(2, 10)
    try:
        next(s.minibatches(4))
    except ValueError as e:
        assert "divisible" in str(e)
    else:
        raise AssertionError("expected ValueError")



@pytest.mark.parametrize("unit, count, message", [
    ("trajectory", 4, r"^10 trajectories \(envs\) per rank are not divisible by num_mini_batches \(4\)$"),
    ("transition", 3, r"^20 transitions per rank are not divisible by num_mini_batches \(3\)$")])
def test_indivisible_minibatches_name_the_unit_and_the_count_they_split(unit, count, message):
    """Mutant: `what = "trajectories (envs)" if unit == "trajectory" else "transitions"` with the condition negated.
    T=2, N=10: the trajectory unit splits the 10 envs, the transition unit the 2 * 10 = 20 transitions; the message
    names which, so the fix (change the env count or the minibatch count) is clear."""
    with pytest.raises(ValueError, match=message):
        next(filled_storage(2, 10).minibatches(count, unit=unit))

def test_transition_minibatches_cover_every_transition_once():
    T, N, M = 5, 12, 6
    s = filled_storage(T, N)
    seen = []
    for batch in map(s.split, s.minibatches(M, torch.Generator().manual_seed(1), unit="transition")):
        assert batch["actor_obs"].shape == (T * N // M, 3)
        # (step, env) of each transition, recovered from the stored values: obs = env + 100 * step.
        seen += (batch["actor_obs"][:, 0] - batch["values"]).div(100).long().mul(N).add(batch["values"].long()).tolist()
    assert sorted(seen) == list(range(T * N))


PACKED_FIELDS = ("actor_obs", "critic_obs", "actions", "action_mean", "action_std", "log_probs", "values",
                 "advantages", "returns")


def test_packed_fields_match_per_field_gathers_and_assignment_keeps_the_packing():
    T, N = 4, 8
    s = RolloutStorage(T, N, {"policy": 3, "critic": 5}, 2, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    reference = {f: torch.randn(getattr(s, f).shape, generator=g) for f in PACKED_FIELDS}
    for f, value in reference.items():
        setattr(s, f, value)                     # assignment copies into the packed buffer
        assert getattr(s, f).data_ptr() != value.data_ptr()
        assert getattr(s, f)._base is s.data
    assert torch.equal(s.advantages, reference["advantages"])
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(5))
    for packed in s.minibatches(2, torch.Generator().manual_seed(5)):    # one contiguous [B, F] tensor each
        assert packed.shape == (T * N // 2, s.data.shape[-1]) and packed.is_contiguous()
        assert all(v.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
                   for v in s.split(packed).values())
    for i, batch in enumerate(map(s.split, s.minibatches(2, torch.Generator().manual_seed(5)))):
        ids = perm[i * N // 2:(i + 1) * N // 2]
        for f in PACKED_FIELDS:                  # the old per-field advanced indexing, time-major order
            assert torch.equal(batch[f], reference[f][:, ids].flatten(0, 1)), f
    flat_perm = torch.randperm(T * N, generator=torch.Generator().manual_seed(6))
    batch = s.split(next(s.minibatches(4, torch.Generator().manual_seed(6), unit="transition")))
    assert torch.equal(batch["actor_obs"], reference["actor_obs"].flatten(0, 1)[flat_perm[:T * N // 4]])


def test_fill_storage_recomputes_old_policy_outputs_with_the_learners_model():
    from ppo.actor_critic import ActorCritic
    from ppo.rollout import fill_storage
    torch.manual_seed(0)
    T, N, A = 3, 4, 2
    model = ActorCritic(5, 6, A)
    batch = {"actor_obs": torch.randn(T, N, 5), "critic_obs": torch.randn(T, N, 6), "actions": torch.randn(T, N, A),
             "action_mean": torch.randn(T, N, A), "action_std": torch.rand(T, N, A) + 0.5,
             "log_probs": torch.randn(T, N), "values": torch.randn(T, N), "rewards": torch.randn(T, N),
             "bootstrap": torch.zeros(T, N), "dones": torch.zeros(T, N, dtype=torch.bool),
             "last_critic_obs": torch.randn(N, 6)}
    storage = RolloutStorage(T, N, {"policy": 5, "critic": 6}, A, torch.device("cpu"))
    fill_storage(storage, batch, model, None, 0.99, 0.95, recompute=True)
    with torch.no_grad():
        pi = model.distribution(batch["actor_obs"])
        assert torch.equal(storage.log_probs, pi.log_prob(batch["actions"]).sum(-1))
        assert (torch.equal(storage.action_mean, pi.mean)
                and torch.equal(storage.values, model.value(batch["critic_obs"])))
    fill_storage(storage, batch, model, None, 0.99, 0.95, recompute=False)
    for name in ("actor_obs", "critic_obs", "actions", "action_mean", "action_std", "log_probs", "values"):
        assert torch.equal(getattr(storage, name), batch[name]), name      # the copy's numbers, as sent


def test_a_gpu_storage_queues_each_epochs_permutation_from_pinned_memory(monkeypatch):
    """The permutation is drawn on the host; on a GPU it was copied from pageable memory, a copy that synchronizes
    the stream (torch's memcpy_and_sync): a drain of the GPU's queue at every epoch, 5 per update, which the
    sync-free step (--ppo.capture-step) otherwise never waits for. It is now pinned and copied with non_blocking.
    Simulated on the CPU: the storage's buffer says it is on CUDA, and pinning and the copy are recorded."""
    s = filled_storage()
    expected = list(s.minibatches(3, torch.Generator().manual_seed(0)))
    calls, to = [], torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t is s.data))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append("pin_memory") or t)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *args, **kw: calls.append(("to", kw)) or to(t, *args, **kw))
    got = list(s.minibatches(3, torch.Generator().manual_seed(0)))
    assert calls == ["pin_memory", ("to", {"non_blocking": True})]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))   # the same permutation


@pytest.mark.parametrize("count, unit, message", [(0, "trajectory", "num_mini_batches must be an integer >= 1"),
                                                  (True, "trajectory", "num_mini_batches must be an integer >= 1"),
                                                  (2.0, "transition", "num_mini_batches must be an integer >= 1"),
                                                  (2, "trajectories", "unit must be 'trajectory' or 'transition'")])
def test_minibatches_refuse_a_bad_count_or_unit(count, unit, message):
    """A copied-out storage refuses what the CLI would: 0 minibatches (was a ZeroDivisionError), a bool (True is an
    int to Python, and would pass as 1 minibatch) or a float count, and a misspelt unit (was silently the transition
    unit)."""
    with pytest.raises(ValueError, match=message):
        next(filled_storage(2, 10).minibatches(count, unit=unit))
