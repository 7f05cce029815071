"""Put a checkpoint back into a run's built objects: model, optimizer, normalizers, env state, RNG streams.

Nothing crosses ranks here: every rank loads the same file (train.py broadcasts and verifies the weights
afterwards). What the run's flags change on resume (LR, Adam's eps, --seed) is decided here too.
"""

import torch

from dist.checkpoint import rng_states_fit, set_rng_states
from dist.errors import UsageError, one_line
from ppo.minibatch_step import saved_state_for
from ppo.normalizer import RewardNormalizer

ROLLOUT_SEEDS = "--seed + j on rollout rank L + j of L learners"   # the seeds colocated rank j would use


def restore(state: dict, path: str, stateful: dict, shuffle, roles, device: torch.device, cfg) -> None:
    """Load checkpoint `state` into the built objects (`stateful`: model, optimizer, env, reward_normalizer; None
    where the run has none; `cfg` is the run's Config); RNG states are restored per rank when the layout and --seed
    match the checkpoint's run (a --seed typed on resume restarts the streams from it instead).

    Buffers declared `local` (per-env running state such as the reward normalizer's running returns)
    keep their fresh values: envs restart their episodes, so that state restarts too. The optimizer takes
    this run's --ppo.adam-eps, and its --ppo.learning-rate where that differs from the checkpoint's run
    (else the restored LR, which the adaptive schedule moved): a restart with the same flags continues
    exactly, a new LR typed on resume is used.
    """
    ppo, saved_run = cfg.ppo, state.get("config", {})
    saved_seed, saved_lr = saved_run.get("seed"), saved_run.get("ppo", {}).get("learning_rate")
    settings = {"eps": ppo.adam_eps, **({"lr": ppo.learning_rate} if saved_lr not in (None, ppo.learning_rate) else {})}
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
            saved = saved_state_for(obj, saved, settings)
        try:
            obj.load_state_dict(saved)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise UsageError(f"--resume {path!r}: its {key} does not fit this run (other env or --policy.* "
                             f"sizes?): {one_line(exc)}") from None
    saved_layout = state.get("layout", [len(state["rng"]), 0])
    same_layout = saved_layout == [roles.num_learners, roles.num_rollouts]
    rng = state["rng"][roles.rank] if same_layout else {}
    seeds = f"their seeds (--seed + rank on a learner, {ROLLOUT_SEEDS})" if roles.num_rollouts else \
        "--seed + rank"
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
        if "lr" in settings:
            print(f"[syncppo] --ppo.learning-rate {ppo.learning_rate:g} replaces the checkpoint's LR (its run "
                  f"started at {saved_lr:g})", flush=True)
        end, k = saved_run.get("max_iterations"), state["iteration"]
        both_linear = ppo.schedule == "linear" == saved_run.get("ppo", {}).get("schedule")
        if both_linear and end not in (None, cfg.max_iterations):
            now, was = ppo.learning_rate * (1 - k / cfg.max_iterations), (saved_lr or ppo.learning_rate) * (1 - k / end)
            print(f"[syncppo] --max-iterations {cfg.max_iterations} re-anneals the linear LR (the checkpoint's run "
                  f"reached 0 at {end}): iteration {k + 1} runs at LR {now:.4g}, not {was:.4g}", flush=True)


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
