"""RSL-RL 5.5.1's PPO.update (rsl-rl-lib, from requirements-dev.txt) as the oracle for one whole syncppo update:
the same initial weights, rollout batch and minibatch order (one permutation, patched into both), the same
settings; then the parameters, the adaptive LR and the logged loss means are compared. What differs on purpose
(docs/simulators.md, the `isaaclab` preset's list) is shown to differ, so a doc that stops being true is caught."""

import contextlib

import pytest
import torch
from rsl_rl.algorithms import PPO
from rsl_rl.models import MLPModel
from rsl_rl.storage import RolloutStorage as RslStorage
from tensordict import TensorDict

from configs import PPOConfig
from dist.grad_sync import GradSync
from ppo.actor_critic import ActorCritic
from ppo.minibatch_step import build_optimizer
from ppo.storage import RolloutStorage
from ppo.update import ppo_update
from tests.multirank import run_ranks

T, N, A, OBS, HIDDEN = 8, 6, 3, 5, (16, 16)


@contextlib.contextmanager
def _one_permutation(perm: torch.Tensor):
    """Every torch.randperm returns `perm`: RSL-RL draws one per update, syncppo one per epoch (a documented
    difference), so this gives both the same minibatches in the same order in every epoch."""
    original = torch.randperm
    torch.randperm = lambda n, *args, **kwargs: perm.clone()
    try:
        yield
    finally:
        torch.randperm = original


def _models(std_type: str):
    torch.manual_seed(0)
    ours = ActorCritic(OBS, OBS, A, HIDDEN, HIDDEN, "elu", 1.0, normalize_actor_obs=False, normalize_critic_obs=False)
    obs = TensorDict({"policy": torch.zeros(N, OBS)}, batch_size=[N])
    groups = {"actor": ["policy"], "critic": ["policy"]}
    dist = {"class_name": "GaussianDistribution", "init_std": 1.0, "std_type": std_type}
    actor = MLPModel(obs, groups, "actor", A, list(HIDDEN), "elu", distribution_cfg=dist)
    critic = MLPModel(obs, groups, "critic", 1, list(HIDDEN), "elu")
    with torch.no_grad():
        for theirs, mine in ((actor.mlp, ours.actor), (critic.mlp, ours.critic)):
            for a, b in zip(theirs.parameters(), mine.parameters(), strict=True):
                a.copy_(b)
    return ours, actor, critic, obs


def _rollout(ours, seed=11):
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(T, N, OBS, generator=g)
    with torch.no_grad():
        pi = ours.distribution(obs)
        actions = pi.mean + pi.stddev * torch.randn(T, N, A, generator=g)
        return {"obs": obs, "actions": actions, "mean": pi.mean.clone(), "std": pi.stddev.clone(),
                "log_probs": pi.log_prob(actions).sum(-1), "values": ours.value(obs),
                "advantages": torch.randn(T, N, generator=g) * 2 + 0.5,
                "returns": ours.value(obs) + torch.randn(T, N, generator=g)}


def _run_both(max_grad_norm=1e6, per_minibatch=False, epochs=3, minibatches=4, lr=1e-3, std_type="log",
              rank=None, desired_kl=0.001):
    """One update by each; `rank` (in a process group): this rank's own rollout, RSL-RL's multi-GPU mode."""
    ours, actor, critic, obs0 = _models(std_type)
    data = _rollout(ours, 11 if rank is None else 100 + rank)
    if std_type == "log":
        with torch.no_grad():
            actor.distribution.log_std_param.copy_(ours.log_std)
    cfg = PPOConfig(num_steps=T, num_epochs=epochs, num_mini_batches=minibatches, learning_rate=lr,
                    schedule="adaptive", desired_kl=desired_kl, max_grad_norm=max_grad_norm, entropy_coef=0.008,
                    advantage_norm="minibatch" if per_minibatch else "none", minibatch_unit="transition")
    storage = RolloutStorage(T, N, {"policy": OBS, "critic": OBS}, A, torch.device("cpu"))
    storage.actor_obs, storage.critic_obs, storage.actions = data["obs"], data["obs"], data["actions"]
    storage.action_mean, storage.action_std, storage.log_probs = data["mean"], data["std"], data["log_probs"]
    storage.values, storage.advantages, storage.returns = data["values"], data["advantages"], data["returns"]
    rsl_storage = RslStorage("rl", N, T, obs0, [A], "cpu")
    rsl_storage.observations["policy"].copy_(data["obs"])
    rsl_storage.actions.copy_(data["actions"])
    rsl_storage.values.copy_(data["values"][..., None])
    rsl_storage.actions_log_prob.copy_(data["log_probs"][..., None])
    rsl_storage.returns.copy_(data["returns"][..., None])
    rsl_storage.advantages.copy_(data["advantages"][..., None])
    rsl_storage.distribution_params = (data["mean"].clone(), data["std"].clone())
    alg = PPO(actor, critic, rsl_storage, num_learning_epochs=epochs, num_mini_batches=minibatches,
              clip_param=cfg.clip_param, gamma=cfg.gamma, lam=cfg.lam, value_loss_coef=cfg.value_loss_coef,
              entropy_coef=cfg.entropy_coef, learning_rate=lr, max_grad_norm=max_grad_norm,
              use_clipped_value_loss=True, schedule="adaptive", desired_kl=cfg.desired_kl,
              normalize_advantage_per_mini_batch=per_minibatch,
              multi_gpu_cfg=None if rank is None else {"global_rank": rank, "world_size": 2})
    perm = torch.randperm(T * N, generator=torch.Generator().manual_seed(5))
    with _one_permutation(perm):
        theirs = alg.update()
        stats = ppo_update(ours, build_optimizer(ours.parameters(), cfg, torch.device("cpu")), storage,
                           GradSync(ours.parameters(), num_extras=2), cfg)
    return ours, actor, critic, alg, theirs, stats


def _max_difference(ours, actor, critic, std_type="log"):
    """The largest difference between the two updated models' parameters (std compared as log std)."""
    std = actor.distribution.log_std_param if std_type == "log" else actor.distribution.std_param.log()
    theirs = [*actor.mlp.parameters(), *critic.mlp.parameters(), std]
    mine = [*ours.actor.parameters(), *ours.critic.parameters(), ours.log_std]
    return max((a - b).abs().max().item() for a, b in zip(theirs, mine, strict=True))


@pytest.mark.parametrize("per_minibatch", [False, True])
def test_one_update_equals_rsl_rl_ppo_update(per_minibatch):
    """3 epochs x 4 minibatches of transitions, adaptive KL (target 0.001: the LR falls 1e-3 -> 8.78e-5), clipped
    value loss, entropy 0.008; advantages as stored, or per minibatch (RSL-RL's normalize_advantage_per_mini_batch,
    syncppo's `minibatch`: both the unbiased std). No gradient reaches the clip norm here (next test).
    Mutant: ppo/kl_schedule.py dividing the LR by 2 instead of 1.5 when the KL is over twice the target."""
    ours, actor, critic, alg, theirs, stats = _run_both(per_minibatch=per_minibatch)
    assert _max_difference(ours, actor, critic) < 1e-6
    assert stats["learning_rate"] == pytest.approx(alg.learning_rate, rel=1e-12) and alg.learning_rate < 1e-4
    for mine, key in (("surrogate", "surrogate"), ("value_function", "value"), ("entropy", "entropy")):
        assert stats[mine] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key


def test_gradient_clipping_is_one_global_norm_where_rsl_rl_clips_actor_and_critic_apart(monkeypatch):
    """max_grad_norm 1 (the isaaclab preset's, G1RoughPPORunnerCfg's): RSL-RL clips the actor's gradient (its std
    included) and the critic's to norm 1 each; syncppo the norm of both together (docs/simulators.md, the isaaclab
    preset's deliberate differences). With RSL-RL's two clips made one over all parameters the updates agree, so
    that is the whole difference.
    Mutant: GradSync.clip_ scaling by the square root of max_norm / norm."""
    ours, actor, critic, *_ = _run_both(max_grad_norm=1.0)
    assert _max_difference(ours, actor, critic) > 1e-4
    clip, held = torch.nn.utils.clip_grad_norm_, []

    def one_clip(params, max_norm):    # RSL-RL calls it for the actor, then the critic, before each step
        held.extend(params)
        if len(held) > len(list(actor.parameters())):   # the critic's call: clip both together
            clip(held, max_norm)
            held.clear()

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", one_clip)
    ours, actor, critic, *_ = _run_both(max_grad_norm=1.0)
    assert _max_difference(ours, actor, critic) < 1e-6


def test_minibatches_are_reshuffled_every_epoch_where_rsl_rl_draws_one_permutation_per_update(monkeypatch):
    """RSL-RL's mini_batch_generator draws one permutation and walks it in every epoch (the same minibatches, in the
    same order); syncppo draws a fresh one per epoch (docs/simulators.md, the isaaclab preset's deliberate
    differences). The test above patches one permutation into both so that their minibatches agree.
    Mutant: RolloutStorage.minibatches drawing its permutation once and reusing it in later epochs."""
    counts = {}
    original = torch.randperm

    def counting(*args, **kwargs):
        counts[who] = counts.get(who, 0) + 1
        return original(*args, **kwargs)

    ours, actor, critic, obs0 = _models("log")
    storage = RslStorage("rl", N, T, obs0, [A], "cpu")
    storage.distribution_params = (torch.zeros(T, N, A), torch.ones(T, N, A))
    monkeypatch.setattr(torch, "randperm", counting)
    who = "rsl_rl"
    assert sum(1 for _ in storage.mini_batch_generator(4, num_epochs=3)) == 12
    who = "syncppo"
    mine = RolloutStorage(T, N, {"policy": OBS, "critic": OBS}, A, torch.device("cpu"))
    assert sum(1 for _epoch in range(3) for _ in mine.minibatches(4, torch.Generator(), "transition")) == 12
    assert counts == {"rsl_rl": 1, "syncppo": 3}


def test_advantage_normalization_over_the_rollout_differs_from_rsl_rl_by_the_std_s_ddof_alone():
    """RSL-RL's compute_returns normalizes the rank's rollout with the unbiased std; syncppo's `local` (and `global`
    on one rank) with the population std (docs/simulators.md): the results differ by the factor sqrt(n / (n - 1)).
    Mutant: normalize_advantages' `local` branch without subtracting the mean."""
    from ppo.update import normalize_advantages
    adv = torch.randn(T, N, generator=torch.Generator().manual_seed(2)) * 3 + 1
    rsl = (adv - adv.mean()) / (adv.std() + 1e-8)      # ppo.py compute_returns, normalize_advantage_per_mini_batch off
    storage = RolloutStorage(T, N, {"policy": OBS, "critic": OBS}, A, torch.device("cpu"))
    storage.advantages = adv
    normalize_advantages(storage, "local")
    n = T * N
    torch.testing.assert_close(storage.advantages, rsl * (n / (n - 1)) ** 0.5)


def test_observation_normalizer_statistics_equal_rsl_rl_s_after_each_update():
    """Both update once per iteration after learning, from that iteration's observations; the running mean and
    (population) std then agree. Only the forward differs: RSL-RL divides by std + 1e-2 and does not clip, syncppo
    divides by std + 1e-8 and clips at 10 (docs/simulators.md's table of RSL-RL fields).
    Mutant: ObsNormalizer.update computing std as sqrt(M2 / (count - 1))."""
    from rsl_rl.modules.normalization import EmpiricalNormalization
    from ppo.normalizer import ObsNormalizer
    g = torch.Generator().manual_seed(9)
    theirs, mine = EmpiricalNormalization(OBS), ObsNormalizer(OBS)
    for scale in (1.0, 3.0, 0.5):
        batch = torch.randn(T * N, OBS, generator=g) * scale + 2.0
        theirs.update(batch)
        mine.update(batch)
        torch.testing.assert_close(mine.mean, theirs.mean)
        torch.testing.assert_close(mine.std, theirs.std)


def _two_ranks(rank, world_size):
    # KL target 0.003: the ranks' own KLs fall on both sides of its thresholds, so a rank that used its own would
    # step with another LR (the LR falls 1e-3 -> 2.96e-4, held at some steps)
    ours, actor, critic, alg, theirs, stats = _run_both(rank=rank, per_minibatch=True, desired_kl=0.003)
    return _max_difference(ours, actor, critic), stats["learning_rate"], alg.learning_rate, ours.log_std.clone()


@pytest.mark.slow
def test_two_ranks_update_equals_rsl_rl_multi_gpu_update():
    """RSL-RL's multi-GPU mode (gradients all-reduced and averaged, each rank's mean KL averaged, rank 0's LR
    broadcast) against syncppo's on the same 2 gloo ranks, each with its own rollout: equal batches, so the
    transition-weighted KL is the mean of the ranks' means (docs/simulators.md); advantages per minibatch (per rank in
    both). RSL-RL's broadcast sends the LR as float32, hence the LR's tolerance.
    Mutant: backward_minibatch returning this rank's own (KL sum, count) instead of the all-reduced one."""
    results = run_ranks(_two_ranks, 2)
    for difference, lr, rsl_lr, _ in results:
        assert difference < 1e-6 and lr == pytest.approx(rsl_lr, rel=1e-6) and lr < 1e-3
    assert torch.equal(results[0][3], results[1][3])        # and the ranks agree with each other
