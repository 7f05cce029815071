"""Put a checkpoint back into a run's built objects: model, optimizer, normalizers, env state, RNG streams.

Nothing crosses ranks here: every rank loads the same file (train.py broadcasts and verifies the weights
afterwards). What the run's flags change on resume (LR, Adam's eps, --seed) is decided here too.
"""

import torch

from dist.checkpoint import rng_states_fit, set_rng_states
from dist.errors import UsageError, one_line
from ppo.minibatch_step import saved_state_for
from ppo.normalizer import RewardNormalizer

ROLLOUT_SEEDS = "rank_seed(--seed, j) on rollout rank L + j of L learners"   # the seeds colocated rank j would use


def restore(state: dict, path: str, stateful: dict, shuffle, roles, device: torch.device, cfg) -> None:
    """Load checkpoint `state` into the built objects (`stateful`: model, optimizer, env, reward_normalizer; None
    where the run has none; `cfg` is the run's Config); RNG states are restored per rank when the layout and --seed
    match the checkpoint's run (a --seed typed on resume restarts the streams from it instead).

    Buffers declared `local` (per-env running state such as the reward normalizer's running returns)
    keep their fresh values: envs restart their episodes, so that state restarts too. The optimizer takes
    this run's --ppo.adam-eps, and the LR resumed_lr decides.
    """
    ppo, saved_run = cfg.ppo, state.get("config", {})
    saved_seed, lr_line = saved_run.get("seed"), None
    for key, obj in stateful.items():
        if obj is None:
            continue
        if key not in state:
            # not other flags: those that build these objects (--ppo.normalize-rewards) a resume keeps (MUST_MATCH)
            raise UsageError(f"--resume {path!r} has no {key!r} state, which its run's settings need: the file is "
                             f"damaged; resume from another checkpoint")
        saved = state[key]
        if isinstance(obj, RewardNormalizer):
            saved = {**saved, **{k: v for k, v in obj.state_dict().items() if obj.BUFFER_POLICY.get(k) == "local"}}
        if isinstance(obj, torch.optim.Optimizer):   # this run's Adam implementation, the saved values
            misfit = misshapen_moment(obj, saved)
            if misfit:
                raise UsageError(f"--resume {path!r} is damaged ({misfit}); resume from another checkpoint")
            lr, lr_line = resumed_lr(cfg, saved_run, float(saved["param_groups"][0]["lr"]), state["iteration"])
            saved = saved_state_for(obj, saved, {"eps": ppo.adam_eps, **({"lr": lr} if lr is not None else {})})
        try:
            obj.load_state_dict(saved)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise UsageError(f"--resume {path!r}: its {key} does not fit this run (other env or --policy.* sizes, "
                             f"or code changed since the save?): {one_line(exc)}") from None
    if stateful.get("model") is not None:
        # Finite log_std whose exp is inf or 0 in float32 (past about +-88): every action would be nan, and the env
        # blamed for it after a whole rollout.
        std = stateful["model"].log_std.detach().exp()
        if not (std.isfinite().all() and (std > 0).all()):
            raise UsageError(f"--resume {path!r} has an action noise std of "
                             f"{' to '.join(dict.fromkeys(f'{v:g}' for v in std.aminmax()))} (exp of its "
                             f"model['log_std']), which no policy can act with: the file is damaged or its run "
                             f"diverged; resume from an earlier model_<k>.pt")
    saved_layout = state.get("layout", [len(state["rng"]), 0])
    same_layout = saved_layout == [roles.num_learners, roles.num_rollouts]
    rng = state["rng"][roles.rank] if same_layout else {}
    seeds = f"their seeds (rank_seed(--seed, rank) on a learner, {ROLLOUT_SEEDS})" if roles.num_rollouts else \
        "rank_seed(--seed, rank)"
    fits = same_layout and rng_states_fit(rng, stateful["env"], shuffle, device)
    if fits and saved_seed in (None, cfg.seed):
        set_rng_states(rng, stateful["env"], shuffle, device)
    elif fits:
        if roles.rank == 0:
            print(f"[syncppo] --seed {cfg.seed} is not the checkpoint run's ({saved_seed}): RNG streams restart from "
                  f"{seeds}; everything else is restored (the env's content, e.g. the tracking motion "
                  f"library, stays the checkpoint run's)", flush=True)
    elif same_layout:
        if roles.rank == 0:
            print("[syncppo] resuming a checkpoint whose RNG states do not fit this run's generators (saved on "
                  f"another device): RNG streams restart from {seeds}; everything else is restored", flush=True)
    elif roles.rank == 0:
        print(f"[syncppo] resuming a checkpoint of {saved_layout[0]} learner(s) + {saved_layout[1]} rollout rank(s) "
              f"on {roles.num_learners} + {roles.num_rollouts}: RNG streams restart from {seeds}; "
              f"everything else is restored", flush=True)
    if roles.rank == 0:
        print(f"[syncppo] {'would resume' if cfg.dry_run else 'resumed'} {path} at iteration {state['iteration']}",
              flush=True)
        if lr_line is not None:
            print(f"[syncppo] {lr_line}", flush=True)


def resumed_lr(cfg, saved_run: dict, restored: float, iteration: int) -> tuple[float | None, str]:
    """(the LR a resumed run's optimizer loads instead of the checkpoint's `restored` one, or None to keep it; the
    start-up line saying which LR the run continues at and why). `saved_run`: the checkpoint run's config.

    The restored LR is schedule state only under the adaptive schedule: it continues when this run is adaptive, the
    checkpoint's run was too and --ppo.learning-rate is its run's (a restart with the same flags continues exactly).
    Another --ppo.learning-rate restarts the adaptive schedule from it. --ppo.schedule fixed runs at
    --ppo.learning-rate, which is what its config says, never at a value another schedule left; linear anneals from
    --ppo.learning-rate to 0 at --max-iterations (train.py sets it every iteration). A schedule other than the
    checkpoint run's starts as a new run of that schedule would, from --ppo.learning-rate. An adaptive LR that
    continues outside this run's [--ppo.lr-min, --ppo.lr-max] continues clamped into them."""
    ppo, saved_ppo, k = cfg.ppo, saved_run.get("ppo", {}), iteration
    saved_lr, saved_schedule = saved_ppo.get("learning_rate"), saved_ppo.get("schedule")
    other = saved_schedule not in (None, ppo.schedule)     # an old checkpoint without one ran the default, adaptive
    was = f"the checkpoint's LR {restored:.4g} was its {saved_schedule} schedule's" if other else \
        f"the checkpoint's LR was {restored:.4g}"
    if ppo.schedule == "linear":
        now, end = ppo.learning_rate * (1.0 - k / cfg.max_iterations), saved_run.get("max_iterations")
        span = f"from --ppo.learning-rate {ppo.learning_rate:g} to 0 at --max-iterations {cfg.max_iterations}"
        if other:
            return now, (f"--ppo.schedule linear (the checkpoint's run: {saved_schedule}) anneals the LR {span}, as a "
                         f"new run would: iteration {k + 1} runs at LR {now:.4g} ({was})")
        new_lr = saved_lr not in (None, ppo.learning_rate)
        if end in (None, cfg.max_iterations) and not new_lr:    # an older checkpoint without its end: not known
            return now, f"the linear LR continues ({span}): iteration {k + 1} runs at LR {now:.4g}"
        then = (saved_lr or ppo.learning_rate) * (1 - k / (end or cfg.max_iterations))   # where its run would be
        theirs = ([f"--ppo.learning-rate {saved_lr:g}"] if new_lr else []) + \
            ([f"--max-iterations {end}"] if end not in (None, cfg.max_iterations) else [])
        return now, (f"the linear LR re-anneals {span} (the checkpoint's run: {', '.join(theirs)}): iteration {k + 1} "
                     f"runs at LR {now:.4g}, not {then:.4g}")
    if ppo.schedule == "fixed":
        return ppo.learning_rate, (f"--ppo.schedule fixed: the LR is --ppo.learning-rate {ppo.learning_rate:g}"
                                   + ("" if restored == ppo.learning_rate else f" ({was})"))
    if other:
        return ppo.learning_rate, (f"--ppo.schedule adaptive (the checkpoint's run: {saved_schedule}) starts from "
                                   f"--ppo.learning-rate {ppo.learning_rate:g}, as a new run would ({was})")
    if saved_lr not in (None, ppo.learning_rate):
        return ppo.learning_rate, (f"--ppo.learning-rate {ppo.learning_rate:g} replaces the checkpoint's LR "
                                   f"{restored:.4g} (its run started at {saved_lr:g}): the adaptive schedule restarts "
                                   f"from it")
    started = f"its run started at {saved_lr:g}; " if saved_lr is not None else ""
    if not ppo.lr_min <= restored <= ppo.lr_max:    # narrower bounds: the first adaptive step would clamp it too late
        clamped = min(max(restored, ppo.lr_min), ppo.lr_max)
        return clamped, (f"the LR continues at {clamped:.4g}: the checkpoint's adaptive schedule left it at "
                         f"{restored:.4g}, outside this run's [--ppo.lr-min {ppo.lr_min:g}, --ppo.lr-max "
                         f"{ppo.lr_max:g}] ({started}another --ppo.learning-rate restarts the schedule from that)")
    return None, (f"the LR continues at {restored:.4g}, where the checkpoint's adaptive schedule left it ({started}"
                  f"another --ppo.learning-rate restarts the schedule from that)")


def misshapen_moment(optimizer: torch.optim.Optimizer, saved: dict) -> str:
    """A saved per-parameter state (Adam's exp_avg, exp_avg_sq; the step count aside) whose shape is not its
    parameter's, or "". Adam's load_state_dict does not compare shapes: the first step would fail on a broadcast.
    Parameters pair up in order, as load_state_dict pairs them (which refuses a count that differs)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [i for group in saved["param_groups"] for i in group["params"]]
    for index, param in zip(indices, params):
        for name, value in saved["state"].get(index, {}).items():
            if name != "step" and isinstance(value, torch.Tensor) and value.shape != param.shape:
                return (f"its optimizer's {name!r} for parameter {index} has shape {list(value.shape)}, the "
                        f"parameter {list(param.shape)}")
    return ""
