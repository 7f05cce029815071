"""The equivalence principle against an independent oracle: a plain single-process PPO written here in a few lines of
torch (torch.distributions.Normal for log-probs, entropy and KL, clip_grad_norm_, the adaptive rule by hand, a float64
normalizer merge by hand), run over the concatenated data of W ranks, against ppo_update on W gloo ranks with
micro-batches. tests/test_update_equivalence.py compares ppo_update with itself (q = 1 on the concatenated data);
this oracle shares none of its code but the model's forward."""

import pytest
import torch

from dist.grad_sync import GradSync
from ppo.actor_critic import ActorCritic
from ppo.minibatch_step import build_optimizer
from ppo.storage import RolloutStorage
from ppo.update import ppo_update
from tests.multirank import run_ranks
from tests.ppo_fixtures import A, OBS, T, ppo_cfg

ENVS, ITERATIONS = 16, 2    # envs over all ranks; updates in a row (the second one normalizes by the first's merge)


def make_model() -> ActorCritic:
    """Both observation normalizers on, with a prior state (the same on every rank) that is not the identity."""
    torch.manual_seed(0)
    model = ActorCritic(OBS["policy"], OBS["critic"], A, (16, 16), (16, 16), "elu", 1.0,
                        normalize_actor_obs=True, normalize_critic_obs=True)
    g = torch.Generator().manual_seed(5)
    for norm in model.normalizers().values():
        dim = norm.mean.numel()
        norm.count.fill_(100.0)
        norm.mean64.copy_(torch.randn(dim, generator=g).double())
        norm.m2.copy_(100 * (1 + torch.rand(dim, generator=g)).double())
        norm.mean.copy_(norm.mean64)
        norm.std.copy_((norm.m2 / 100).sqrt())
    return model


def rollout(rank: int, iteration: int, n: int, model: ActorCritic, nan_at) -> dict[str, torch.Tensor]:
    """Rank `rank`'s batch [T, n] of iteration `iteration`, collected by `model`; `nan_at` (rank, t, env) poisons one
    return of iteration 0: its value loss, so its gradient, is non-finite; its KL is not."""
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    actor_obs = torch.randn(T, n, OBS["policy"], generator=g) * 2 + 1
    critic_obs = torch.randn(T, n, OBS["critic"], generator=g) * 2 + rank
    with torch.no_grad():
        pi = model.distribution(actor_obs)
        actions = pi.mean + pi.stddev * torch.randn(T, n, A, generator=g)
        values = model.value(critic_obs)
        batch = dict(actor_obs=actor_obs, critic_obs=critic_obs, actions=actions, action_mean=pi.mean,
                     action_std=pi.stddev, log_probs=pi.log_prob(actions).sum(-1), values=values)
    batch["advantages"] = torch.randn(T, n, generator=g) * 3 + rank
    batch["returns"] = values + torch.randn(T, n, generator=g)
    if nan_at is not None and nan_at[0] == rank and iteration == 0:
        batch["returns"][nan_at[1], nan_at[2]] = float("nan")
    return batch


def ranks_update(rank, world_size, q, mode, nan_at):
    model, cfg = make_model(), ppo_cfg(num_micro_batches=q)
    optimizer = build_optimizer(model.parameters(), cfg, torch.device("cpu"))
    sync = GradSync(list(model.parameters()), mode, bucket_mb=0.001, num_extras=2)
    shuffle, stats = torch.Generator().manual_seed(7 + rank), []
    for iteration in range(ITERATIONS):
        storage = RolloutStorage(T, ENVS // world_size, OBS, A, torch.device("cpu"))
        for field, value in rollout(rank, iteration, ENVS // world_size, model, nan_at).items():
            setattr(storage, field, value)
        stats.append(ppo_update(model, optimizer, storage, sync, cfg, generator=shuffle))
    return {k: v.clone() for k, v in model.state_dict().items()}, stats


def plain_ppo(world_size, nan_at):
    """One process over the union: minibatch i = every rank's minibatch i (their shuffles, seeded 7 + rank)."""
    model, cfg, n = make_model(), ppo_cfg(), ENVS // world_size
    optimizer = torch.optim.Adam(list(model.parameters()), lr=cfg.learning_rate, eps=cfg.adam_eps, fused=True)
    shuffles = [torch.Generator().manual_seed(7 + r) for r in range(world_size)]
    lr, stats, normal = cfg.learning_rate, [], torch.distributions.Normal
    for iteration in range(ITERATIONS):
        ranks = [rollout(r, iteration, n, model, nan_at) for r in range(world_size)]
        data = {k: torch.cat([b[k] for b in ranks], 1) for k in ranks[0]}
        adv = data["advantages"].double()
        data["advantages"] = ((adv - adv.mean()) / (adv.std(unbiased=False) + 1e-8)).float()
        skipped, kls, norms, clipped = 0, [], [], []
        for _epoch in range(cfg.num_epochs):
            perms = [torch.randperm(n, generator=g) + r * n for r, g in enumerate(shuffles)]
            size = n // cfg.num_mini_batches
            for i in range(cfg.num_mini_batches):
                envs = torch.cat([p[i * size:(i + 1) * size] for p in perms])
                b = {k: v[:, envs].flatten(0, 1) for k, v in data.items()}
                pi = model.distribution(b["actor_obs"])
                new = normal(pi.mean, pi.stddev)
                ratio = (new.log_prob(b["actions"]).sum(-1) - b["log_probs"]).exp()
                eps = cfg.clip_param
                surrogate = -torch.min(ratio * b["advantages"], ratio.clamp(1 - eps, 1 + eps) * b["advantages"]).mean()
                v = model.value(b["critic_obs"])
                v_clipped = b["values"] + (v - b["values"]).clamp(-eps, eps)
                value_loss = torch.max((v - b["returns"]) ** 2, (v_clipped - b["returns"]) ** 2).mean()
                loss = surrogate + cfg.value_loss_coef * value_loss - cfg.entropy_coef * new.entropy().sum(-1).mean()
                optimizer.zero_grad()
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                if not torch.isfinite(norm):
                    skipped += 1
                    continue
                norms.append(norm.item())
                clipped.append(((ratio - 1).abs() > eps).double().mean().item())
                with torch.no_grad():
                    kl = torch.distributions.kl_divergence(normal(b["action_mean"], b["action_std"]), new)
                    kl = kl.sum(-1).mean().item()
                if kl > 2 * cfg.desired_kl:
                    lr /= 1.5
                elif 0 < kl < cfg.desired_kl / 2:
                    lr *= 1.5
                lr = min(max(lr, cfg.lr_min), cfg.lr_max)
                optimizer.param_groups[0]["lr"] = lr
                optimizer.step()
                kls.append(kl)
        with torch.no_grad():   # Chan's merge of the union's observations into the prior statistics, float64
            for field, norm in model.normalizers().items():
                x = data[field].flatten(0, 1).double()
                count, nb, mean_b = norm.count.item(), x.shape[0], x.mean(0)
                delta = mean_b - norm.mean64
                norm.m2 += ((x - mean_b) ** 2).sum(0) + delta ** 2 * count * nb / (count + nb)
                norm.mean64 += delta * nb / (count + nb)
                norm.count.fill_(count + nb)
                norm.mean.copy_(norm.mean64)
                norm.std.copy_((norm.m2 / norm.count).sqrt())
        stats.append({"learning_rate": lr, "skipped_steps": float(skipped), "kl": sum(kls) / len(kls),
                      "grad_norm": sum(norms) / len(norms), "clip_fraction": sum(clipped) / len(clipped)})
    return model.state_dict(), stats


@pytest.mark.slow
@pytest.mark.parametrize("world_size, q, mode", [(4, 2, "bucketed"), (2, 4, "flat")])
def test_w_ranks_with_micro_batches_equal_a_plain_ppo_over_the_concatenated_data(world_size, q, mode):
    """Two updates of 3 epochs x 2 minibatches (adaptive LR, global advantage normalization, value and gradient-norm
    clipping, both normalizers merged), rank 1's first rollout holding one non-finite return: the whole step of each
    minibatch holding it (one micro-batch of it) is skipped on every rank, one per epoch, as by the oracle; every other
    step, the LR sequence's decisions and the normalizers' statistics are the oracle's.
    Mutant: ppo_update skipping a step when its KL, not its gradient norm, is non-finite (`math.isfinite(kl)`).
    Mutant: backward_minibatch arming the KL count of the last micro-batch instead of the minibatch's.
    The logged means: the gradient norm before clipping, and the clip fraction, each rank's averaged over ranks
    (train.py).
    Mutant: ppo_update averaging the clipped norm, min(norm, cfg.max_grad_norm).
    Mutant: backward_minibatch summing the clip fraction of the first micro-batch only (`if i == 0`)."""
    results = run_ranks(ranks_update, world_size, args=(q, mode, (1, 2, 3)))
    ref_state, ref_stats = plain_ppo(world_size, (1, 2, 3))
    assert [s["skipped_steps"] for s in ref_stats] == [3.0, 0.0]     # the oracle skipped: the test is not trivial
    assert len({s["learning_rate"] for s in ref_stats}) == 2          # and its LR moved between the updates
    assert ref_stats[1]["clip_fraction"] > 0 and ref_stats[1]["grad_norm"] > ppo_cfg().max_grad_norm  # both act
    for state, stats in results:
        for key, ref in ref_state.items():
            torch.testing.assert_close(state[key], ref.to(state[key].dtype), rtol=1e-5, atol=1e-6, msg=key)
        for ours, ref in zip(stats, ref_stats):
            assert ours["skipped_steps"] == ref["skipped_steps"]
            assert ours["learning_rate"] == pytest.approx(ref["learning_rate"], rel=1e-12)
            assert ours["kl"] == pytest.approx(ref["kl"], rel=1e-3)
            assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        for key in state:       # ranks bit-identical: they took identical synchronized steps
            assert torch.equal(state[key], results[0][0][key]), key
    for i, ref in enumerate(ref_stats):   # equal minibatches per rank: the mean over ranks is the union's fraction
        ours = sum(stats[i]["clip_fraction"] for _, stats in results) / world_size
        assert ours == pytest.approx(ref["clip_fraction"], abs=1e-7)   # float32 means; one sample: 3e-3
