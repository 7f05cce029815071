"""One PPO update over a filled rollout: E epochs x M minibatches x q micro-batches.

Reads top to bottom as the algorithm. What crosses ranks, per iteration:
  - advantages: two all-reduces (count, sum; then squared deviations), when advantage_norm == "global";
  - per minibatch: the gradient all-reduce (one flat; one per bucket bucketed), the last also carrying
    (KL sum, KL count), so every rank sees the global KL and applies the same LR; clipping and the
    non-finite check use the synchronized gradient, so all ranks take (or skip) the same step;
  - normalizers: one all-reduce each, after learning (statistics frozen until then).
Micro-batches only split memory: they accumulate gradients locally, and the accumulation window
is exactly one minibatch, so it never crosses a minibatch, epoch or iteration boundary.
"""

import math

import torch

from dist.errors import RunError
from dist.plan import PlanRow
from dist.stats import global_mean_std, mean_std_plan_rows
from ppo.kl_schedule import adaptive_lr
from ppo.minibatch_step import STEP_MEANS, backward_minibatch, sync_free_step


def normalize_advantages(storage, mode: str) -> None:
    """In place: "global" over all ranks (3 float64 sums), "local" over this rank's rollout, or nothing for
    "none" and "minibatch" (normalized per minibatch in ppo_update instead). Crosses ranks only when "global":
    global_mean_std's two all-reduces, once per call (once per iteration)."""
    if mode in ("none", "minibatch"):
        return
    adv = storage.advantages
    if mode == "global":
        mean, std = global_mean_std(adv)
    else:
        mean, std = adv.mean(), adv.std(unbiased=False)
    storage.advantages = (adv - mean) / (std + 1e-8)


def ppo_update(model, optimizer, storage, grad_sync, cfg, generator: torch.Generator | None = None) -> dict[str, float]:
    """Run the update in place on `model`/`optimizer`; return STEP_MEANS (this rank's loss terms, the global KL and
    the gradient norm before clipping: means over the steps taken, NaN when every step was skipped), the final LR and
    the number of skipped (non-finite) steps.

    Crosses ranks (the module docstring's list, once per call): the advantage statistics when global, the
    gradient all-reduce(s) of each minibatch (KL riding in the last), then one merge per observation normalizer."""
    normalize_advantages(storage, cfg.advantage_norm)
    num_micro_batches = cfg.num_micro_batches
    lr = optimizer.param_groups[0]["lr"]
    totals = dict.fromkeys(STEP_MEANS, 0.0)
    num_steps = skipped = 0
    step = sync_free_step(model, optimizer, grad_sync, cfg) if cfg.capture_step else None
    if step is not None:
        step.begin()
    for _epoch in range(cfg.num_epochs):
        for packed in storage.minibatches(cfg.num_mini_batches, generator, cfg.minibatch_unit):
            batch = storage.split(packed)      # the fields: views of the packed minibatch
            batch_size = packed.shape[0]
            if cfg.advantage_norm == "minibatch":   # CleanRL: this rank's minibatch alone, unbiased std
                adv = batch["advantages"]
                # Into the minibatch's column (a fresh gather: the storage keeps the raw ones), so that the packed
                # minibatch, all the sync-free step takes, carries them.
                adv.copy_((adv - adv.mean()) / (adv.std() + 1e-8))
            if batch_size % num_micro_batches:
                raise ValueError(f"minibatch of {batch_size} transitions is not divisible by "
                                 f"--ppo.num-micro-batches {num_micro_batches}")
            if step is not None:     # --ppo.capture-step: the same step, decided on the device
                step(packed, storage.widths)
                continue
            kl_stats, grad_norm, terms_mean = backward_minibatch(model, batch, grad_sync, cfg)
            # One host read per step, the loss terms in it (read apart after optimizer.step(), they drained the GPU
            # again).
            kl, norm, *terms = torch.cat([(kl_stats[0] / kl_stats[1]).reshape(1), grad_norm.reshape(1),
                                          terms_mean]).tolist()
            if not math.isfinite(norm):
                # Identical on every rank: the norm is of the synchronized gradient. The LR stays too: the policy
                # does not move, so the next KL would read as "too small" and skip after skip would climb to lr-max.
                skipped += 1
                continue
            if cfg.schedule == "adaptive" and math.isfinite(kl):
                lr = adaptive_lr(lr, kl, cfg.desired_kl, cfg.lr_min, cfg.lr_max)
                for group in optimizer.param_groups:
                    group["lr"] = lr
            optimizer.step()
            num_steps += 1
            for key, value in zip(STEP_MEANS, (*terms, kl, norm)):
                totals[key] += value
    for storage_field, normalizer in model.normalizers().items():
        normalizer.update(getattr(storage, storage_field).flatten(0, 1))
    if step is not None:
        return step.finish()
    stats = {k: v / num_steps if num_steps else math.nan for k, v in totals.items()}   # no step taken: no mean
    stats.update(learning_rate=lr, skipped_steps=float(skipped))
    return stats


def checked_noise_std(model, iteration: int, lr: float) -> float:
    """The policy's mean action noise std after an update (logged), read in the same host read as a check that
    the update left every weight finite and the noise std in (0, inf). A step with a finite gradient can still
    leave neither (a fixed LR of 1e4: log_std moves by about 1e4): every later step would be skipped and every action
    be nan, which the env would be blamed for. No communication: the replicas are equal, so every learner raises."""
    params = dict(model.named_parameters())
    std = model.log_std.exp()
    usable = [p.isfinite().all() for p in params.values()] + [(std > 0).all() & std.isfinite().all()]
    mean_std, *ok = torch.cat([std.mean().reshape(1), torch.stack(usable).to(std.dtype)]).tolist()
    if all(ok):
        return mean_std
    broken = [name for name, good in zip(params, ok) if not good]
    more = f" and {len(broken) - 3} more" if len(broken) > 3 else ""
    what = f"non-finite weights in {', '.join(broken[:3])}{more}" if broken else \
        f"an action noise std of {' to '.join(dict.fromkeys(f'{v:g}' for v in std.aminmax()))} (log_std)"
    raise RunError(f"the update of iteration {iteration} left the policy unusable: {what}, at LR {lr:g}; its steps "
                   f"were too large: lower --ppo.learning-rate (adaptive: --ppo.lr-max) or the loss weights, and "
                   f"resume from a checkpoint before it (nothing of this iteration was saved)")


def update_plan_rows(model, grad_sync, cfg) -> list[PlanRow]:
    """The sync-plan rows of one ppo_update per iteration, declared next to the code that communicates."""
    rows = grad_sync.plan_rows(cfg.num_epochs * cfg.num_mini_batches)
    rows += [PlanRow("kl", "global mean (sum, count)", "in gradients"),
             PlanRow("nonfinite", "norm of synced gradient", "-"),
             PlanRow("optimizer", "local, same by construction", "-")]
    if cfg.advantage_norm == "global":
        rows += mean_std_plan_rows()
    for field, normalizer in model.normalizers().items():
        rows += normalizer.plan_rows(field)
    return rows
