"""ppo/restore.py: what restore takes from a checkpoint and what from the run. A checkpoint lacking a built object's
state, an Adam moment of another shape, param groups or a model tensor that do not fit are each one UsageError
naming the entry; each rank takes its own RNG states; the start-up lines of a resume (a new LR or a longer linear
schedule, said by rank 0 alone); and resumed_lr by hand where only the LR or the schedule changed or the config is
older."""

import re
from types import SimpleNamespace

import pytest
import torch

from configs.config import Config
from dist.checkpoint import rng_states
from dist.errors import UsageError
from ppo.minibatch_step import build_optimizer
from ppo.normalizer import RewardNormalizer
from ppo.restore import restore, resumed_lr
from tests.ppo_fixtures import A, N, make_model, ppo_cfg

CPU = torch.device("cpu")


def _run(**changes) -> Config:
    cfg = Config()
    for name, value in changes.items():
        obj, *path, field = [cfg, *name.split("__")]
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, field, value)
    return cfg


def _built(reward_normalizer: bool = False) -> dict:
    model = make_model()
    return {"model": model, "optimizer": build_optimizer(model.parameters(), ppo_cfg(), CPU), "env": None,
            "reward_normalizer": RewardNormalizer(N, 0.99, 10.0) if reward_normalizer else None}


def _checkpoint(built: dict, rngs: list, config: dict | None = None, **changes) -> dict:
    state = {key: obj.state_dict() for key, obj in built.items() if obj is not None}
    state.update(iteration=2, rng=rngs, layout=[len(rngs), 0],
                 config=config if config is not None else {"seed": 1, "ppo": {"learning_rate": 1e-3}})
    state.update(changes)
    return state


def _roles(rank: int = 0, learners: int = 1):
    return SimpleNamespace(rank=rank, num_learners=learners, num_rollouts=0)


def test_restore_refuses_a_checkpoint_without_the_state_of_a_built_object():
    """A run with a reward normalizer resuming a checkpoint saved without one: a UsageError naming the entry."""
    saved = _checkpoint(_built(), [rng_states()])
    with pytest.raises(UsageError, match=r"^--resume 'c\.pt' has no 'reward_normalizer' state, which its run's "
                                         r"settings need: the file is damaged; resume from another checkpoint$"):
        restore(saved, "c.pt", _built(reward_normalizer=True), None, _roles(), CPU, _run())


def test_restore_refuses_an_adam_moment_of_another_shape_naming_it():
    """Adam's load_state_dict does not compare moment shapes; restore does, before loading, and names the first."""
    built = _built()
    params = list(built["model"].parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    built["optimizer"].step()
    saved = _checkpoint(built, [rng_states()])
    saved["optimizer"]["state"][1]["exp_avg_sq"] = torch.zeros(params[1].numel() + 1)
    fresh = _built()
    with pytest.raises(UsageError, match=re.escape(
            f"--resume 'c.pt' is damaged (its optimizer's 'exp_avg_sq' for parameter 1 has shape "
            f"[{params[1].numel() + 1}], the parameter {list(params[1].shape)}); resume from another checkpoint")):
        restore(saved, "c.pt", fresh, None, _roles(), CPU, _run())


def test_restore_names_an_optimizer_whose_param_groups_do_not_fit():
    """load_state_dict refuses another number of param groups with a ValueError: one UsageError naming the entry."""
    built = _built()
    saved = _checkpoint(built, [rng_states()])
    group = saved["optimizer"]["param_groups"][0]
    saved["optimizer"]["param_groups"] = [{**group, "params": group["params"][:1]},
                                          {**group, "params": group["params"][1:]}]
    with pytest.raises(UsageError, match=r"^--resume 'c\.pt': its optimizer does not fit this run .*parameter groups"):
        restore(saved, "c.pt", _built(), None, _roles(), CPU, _run())


def test_restore_names_the_model_tensor_that_does_not_fit_on_one_line():
    """load_state_dict's first line is only its header ("Error(s) in loading state_dict for ActorCritic:"), and the
    message kept only that line: which tensor did not fit, and how, was on the lines it dropped."""
    saved = _checkpoint(_built(), [rng_states()])
    saved["model"]["log_std"] = torch.zeros(A + 1)
    with pytest.raises(UsageError, match=r"^--resume 'c\.pt': its model does not fit this run .*ActorCritic: size "
                                         rf"mismatch for log_std: .*Size\(\[{A + 1}\]\).*Size\(\[{A}\]\)") as info:
        restore(saved, "c.pt", _built(), None, _roles(), CPU, _run())
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("layout", [True, False], ids=["layout", "no-layout"])
def test_rank_1_of_two_learners_takes_its_own_rng_states(layout):
    """Each rank restores its own entry of the checkpoint's `rng` list; a checkpoint from before `layout` existed
    counts one learner per entry."""
    rngs = [{"torch": torch.Generator().manual_seed(10 + r).get_state(),
             "shuffle": torch.Generator().manual_seed(20 + r).get_state()} for r in range(2)]
    saved = _checkpoint(_built(), rngs)
    if not layout:
        del saved["layout"]
    shuffle, before = torch.Generator().manual_seed(0), torch.get_rng_state()
    try:
        restore(saved, "c.pt", _built(), shuffle, _roles(rank=1, learners=2), CPU, _run())
        assert torch.equal(torch.get_rng_state(), rngs[1]["torch"])
    finally:
        torch.set_rng_state(before)
    assert torch.equal(shuffle.get_state(), rngs[1]["shuffle"])


def test_the_start_up_lines_of_a_resume_with_a_new_lr_and_a_longer_linear_schedule(capsys):
    """Rank 0 says what it resumed and where the linear LR jumps, naming both settings that moved it: here
    iteration 3 (the first after the checkpoint of iteration 2) of a run that annealed 1e-3 to 0 at 4 runs at
    2e-4 * (1 - 2/8) = 1.5e-4 instead of 1e-3 * (1 - 2/4)."""
    config = {"seed": 1, "max_iterations": 4, "ppo": {"learning_rate": 1e-3, "schedule": "linear"}}
    saved = _checkpoint(_built(), [rng_states()], config)
    cfg = _run(max_iterations=8, ppo__learning_rate=2e-4, ppo__schedule="linear")
    restore(saved, "c.pt", _built(), None, _roles(), CPU, cfg)
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "[syncppo] resumed c.pt at iteration 2",
        "[syncppo] the linear LR re-anneals from --ppo.learning-rate 0.0002 to 0 at --max-iterations 8 (the "
        "checkpoint's run: --ppo.learning-rate 0.001, --max-iterations 4): iteration 3 runs at LR 0.00015, not 0.0005"]


@pytest.mark.parametrize("saved_ppo, max_iterations, line", [
    ({"schedule": "fixed"}, 4, "--ppo.schedule linear (the checkpoint's run: fixed) anneals the LR from "
                               "--ppo.learning-rate 0.001 to 0 at --max-iterations 8, as a new run would: iteration 3 "
                               "runs at LR 0.00075 (the checkpoint's LR 0.001 was its fixed schedule's)"),
    ({"schedule": "linear"}, None, "the linear LR continues (from --ppo.learning-rate 0.001 to 0 at --max-iterations "
                                   "8): iteration 3 runs at LR 0.00075")],
    ids=["other-schedule", "no-max-iterations"])
def test_no_re_anneal_line_unless_both_runs_anneal_linearly_to_a_known_end(capsys, saved_ppo, max_iterations, line):
    """The jump is only said when the checkpoint's run was linear too and its --max-iterations is known (an older
    checkpoint without it resumes without one, rather than failing on the arithmetic); a dry run says 'would'. The
    LR line says where iteration 3 starts all the same: 1e-3 * (1 - 2/8)."""
    config = {"seed": 1, "ppo": {"learning_rate": 1e-3, **saved_ppo}}
    if max_iterations is not None:
        config["max_iterations"] = max_iterations
    saved = _checkpoint(_built(), [rng_states()], config)
    restore(saved, "c.pt", _built(), None, _roles(), CPU, _run(max_iterations=8, ppo__schedule="linear", dry_run=True))
    assert capsys.readouterr().out.splitlines() == ["[syncppo] would resume c.pt at iteration 2", f"[syncppo] {line}"]


def test_only_rank_0_says_that_a_new_seed_restarts_the_rng_streams(capsys):
    """Every rank restarts its streams on a --seed unlike the checkpoint's; the line is said once, by rank 0."""
    rngs = [rng_states(None, torch.Generator()) for _ in range(2)]
    for rank in (1, 0):
        restore(_checkpoint(_built(), rngs), "c.pt", _built(), torch.Generator(), _roles(rank, 2), CPU, _run(seed=5))
        out = capsys.readouterr().out
        assert ("--seed 5 is not the checkpoint run's (1): RNG streams restart" in out) == (rank == 0), rank


@pytest.mark.parametrize("saved_run, changes, lr, line", [
    ({"max_iterations": 8, "ppo": {"learning_rate": 1e-3, "schedule": "linear"}},
     {"ppo__learning_rate": 2e-4, "ppo__schedule": "linear"}, 1.5e-4,
     "the linear LR re-anneals from --ppo.learning-rate 0.0002 to 0 at --max-iterations 8 (the checkpoint's run: "
     "--ppo.learning-rate 0.001): iteration 3 runs at LR 0.00015, not 0.00075"),
    ({"ppo": {"learning_rate": 3e-4, "schedule": "fixed"}}, {"ppo__learning_rate": 1e-3}, 1e-3,
     "--ppo.schedule adaptive (the checkpoint's run: fixed) starts from --ppo.learning-rate 0.001, as a new run "
     "would (the checkpoint's LR 0.0003 was its fixed schedule's)"),
    ({"ppo": {"learning_rate": 1e-3}}, {"ppo__learning_rate": 1e-3}, None,
     "the LR continues at 0.0003, where the checkpoint's adaptive schedule left it (its run started at 0.001; "
     "another --ppo.learning-rate restarts the schedule from that)"),
    ({}, {"ppo__learning_rate": 1e-3}, None,
     "the LR continues at 0.0003, where the checkpoint's adaptive schedule left it (another --ppo.learning-rate "
     "restarts the schedule from that)"),
    ({"ppo": {"learning_rate": 1e-4}}, {"ppo__learning_rate": 1e-4, "ppo__lr_max": 2e-4}, 2e-4,
     "the LR continues at 0.0002: the checkpoint's adaptive schedule left it at 0.0003, outside this run's "
     "[--ppo.lr-min 1e-05, --ppo.lr-max 0.0002] (its run started at 0.0001; another --ppo.learning-rate restarts "
     "the schedule from that)"),
    ({"ppo": {"learning_rate": 1e-3}}, {"ppo__learning_rate": 1e-3, "ppo__lr_min": 5e-4}, 5e-4,
     "the LR continues at 0.0005: the checkpoint's adaptive schedule left it at 0.0003, outside this run's "
     "[--ppo.lr-min 0.0005, --ppo.lr-max 0.01] (its run started at 0.001; another --ppo.learning-rate restarts "
     "the schedule from that)"),
    ({"ppo": {"learning_rate": 1e-4}}, {"ppo__learning_rate": 1e-4, "ppo__lr_max": 3e-4}, None,
     "the LR continues at 0.0003, where the checkpoint's adaptive schedule left it (its run started at 0.0001; "
     "another --ppo.learning-rate restarts the schedule from that)"),
    ({"max_iterations": 8, "ppo": {"schedule": "linear"}}, {"ppo__learning_rate": 1e-3, "ppo__schedule": "linear"},
     7.5e-4, "the linear LR continues (from --ppo.learning-rate 0.001 to 0 at --max-iterations 8): iteration 3 runs "
             "at LR 0.00075")],
    ids=["linear-new-lr-same-end", "fixed-to-adaptive", "no-schedule-saved", "no-config-saved", "lr-max-narrowed",
         "lr-min-raised", "lr-on-lr-max", "linear-no-lr-saved"])
def test_resumed_lr_by_hand_where_only_the_lr_or_the_schedule_changed_or_the_config_is_older(saved_run, changes, lr,
                                                                                              line):
    """resumed_lr at iteration 2 of a run to --max-iterations 8, restoring LR 3e-4, by hand (docs/fault_tolerance.md,
    "Resuming: the rules"). A new --ppo.learning-rate alone re-anneals the linear LR to 2e-4 * (1 - 2/8), against
    1e-3 * (1 - 2/8), and names only the LR as changed (not the unchanged --max-iterations). Adaptive after fixed (a
    fixed run at 3e-4) starts from --ppo.learning-rate as a new run would and says so, not that a typed LR replaces
    an adaptive one. A config that recorded no schedule ran the default, adaptive: its LR continues; one that
    recorded no LR continues it too (the line without 'its run started at'), also under linear (1e-3 * (1 - 2/8));
    neither formats the missing LR. An adapted LR outside narrower bounds of this run (3e-4 against an --ppo.lr-max
    of 2e-4 on a run that started at 1e-4, or an --ppo.lr-min of 5e-4; bounds that still hold --ppo.learning-rate,
    as validation requires) continues clamped to them from the first step, not from the first adaptive step, and the
    line says from what; one on a bound (3e-4 against an --ppo.lr-max of 3e-4) is inside them and continues as it
    was."""
    got, said = resumed_lr(_run(max_iterations=8, **changes), saved_run, 3e-4, 2)
    assert (got is None) == (lr is None) and (lr is None or got == pytest.approx(lr, rel=1e-12))
    assert said == line
