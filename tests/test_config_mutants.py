"""configs/resume.py's check of what a resume must keep, and configs/same_settings.py's agreement of settings and code
across ranks, at the edges the other tests left open: in one process, with dist.comm's all-gather replaced by the
answer two ranks would give. Expected messages and values are written out by hand."""

import dataclasses

import pytest
import torch

from configs import preset
from configs import same_settings
from configs.config import validate
from configs.resume import check_resume_fits
from dist import comm
from dist.errors import UsageError


def _saved(env: dict, iteration: int = 5) -> dict:
    """A checkpoint's state as check_resume_fits reads it: the run's config (only the env section: the others are
    taken as their defaults, what a checkpoint from before them did) and its iteration."""
    return {"config": {"env": env}, "iteration": iteration}


def test_a_tracking_resume_with_another_motion_count_is_refused_naming_the_flag():
    """The tracking sampler's counts and the motion library are sized by --env.num-motions: a checkpoint of 64
    motions cannot continue with 32, and the refusal names the flag with both values and the checkpoint.
    Mutant: "--env.num-motions" dropped from MUST_MATCH."""
    cfg = preset("tracking")                                  # 512 envs, 64 motions
    cfg.env.num_motions = 32
    with pytest.raises(UsageError) as caught:
        check_resume_fits(_saved({"name": "tracking", "num_envs": 512, "num_motions": 64}), cfg, "ckpt.pt", False)
    assert str(caught.value) == ("--env.num-motions 32 does not match the checkpoint's --env.num-motions 64 "
                                 "('ckpt.pt'); leave the flag out to keep the checkpoint's")
    cfg.env.num_motions = 64
    assert check_resume_fits(_saved({"name": "tracking", "num_envs": 512, "num_motions": 64}), cfg, "ckpt.pt", False)


def test_a_cartpole_resume_ignores_the_tracking_and_simulator_settings_it_never_reads():
    """Cart-pole reads neither --env.num-motions (tracking's) nor --env.task (the simulators'): a program's config
    that leaves other values there than the checkpoint's fits all the same (iteration 5 of 150: True).
    Mutant: `if not env_reads(cfg, flag): continue` dropped from check_resume_fits."""
    cfg = preset("cartpole")
    saved = {"config": dataclasses.asdict(cfg), "iteration": 5}       # the checkpoint's run: this preset as it is
    saved["config"]["env"].update(num_motions=64, task="")
    cfg.env.num_motions, cfg.env.task = 8, "Hopper-v4"
    assert cfg.max_iterations > 5 and check_resume_fits(saved, cfg, "ckpt.pt", False) is True


def test_the_settings_digest_covers_the_code_as_well_as_the_settings(monkeypatch):
    """Two ranks with the same flags but another version of syncppo (another source_digest) must disagree at
    start-up: the digest changes with the code's checksum alone, and not when neither changes.
    Mutant: `json.dumps(shared_settings(cfg))` without `+ [source_digest()]` in settings_digest."""
    cfg = preset("cartpole")
    monkeypatch.setattr(same_settings, "source_digest", lambda: 1)
    first, again = same_settings.settings_digest(cfg), same_settings.settings_digest(cfg)
    monkeypatch.setattr(same_settings, "source_digest", lambda: 2)
    assert first == again != same_settings.settings_digest(cfg)


def _two_ranks_gathering(monkeypatch, answers: list) -> list:
    """comm.all_gather as two ranks would answer it: each call returns the next of `answers` (called with this
    rank's tensor), and the tensors this rank sent are recorded."""
    sent = []

    def all_gather(tensor, purpose):
        sent.append((tensor.clone(), purpose))
        return answers[len(sent) - 1](tensor)
    monkeypatch.setattr(comm, "all_gather", all_gather)
    return sent


def test_differing_settings_names_the_ranks_whose_code_differs_before_any_flag(monkeypatch):
    """Rank 1 of three runs another version (code checksum 6 where ranks 0 and 2 have 5): the error names syncppo's
    files and rank 1, after one all-gather of the code's checksum for "resume"; the flags are not compared (their
    order could differ between versions).
    Mutant: `if False:` in place of the code check in differing_settings."""
    sent = _two_ranks_gathering(monkeypatch, [lambda t: torch.tensor([[5], [6], [5]]),
                                              lambda t: torch.stack([t, t + 1])])
    assert same_settings.differing_settings(preset("cartpole")) == "syncppo's .py files differ on rank(s) [1]"
    assert len(sent) == 1 and sent[0][1] == "resume" and sent[0][0].dtype == torch.int64


def test_differing_settings_names_the_flag_whose_value_differs_when_the_code_agrees(monkeypatch):
    """Both ranks run the same code (checksum 5): the flags are compared one checksum each, and the one whose
    checksum differs on rank 1 (--seed here) is named.
    Mutant: `if True:` in place of the code check in differing_settings (every rank blamed for the code)."""
    cfg = preset("cartpole")
    flags = [flag for flag, _ in same_settings.shared_settings(cfg)]
    seed = flags.index("--seed")

    def other_seed(t):
        theirs = t.clone()
        theirs[seed] += 1
        return torch.stack([t, theirs])
    _two_ranks_gathering(monkeypatch, [lambda t: torch.tensor([[5], [5]]), other_seed])
    assert same_settings.differing_settings(cfg) == "--seed differ"


@pytest.mark.parametrize("field, value", [("seed", 2), ("max_iterations", 151), ("env__num_envs", 128),
                                          ("ppo__learning_rate", 3e-4), ("dist__grad_sync", "bucketed"),
                                          ("rollout__ranks", 1), ("log__save_every", 7)])
def test_the_settings_digest_changes_with_each_setting_every_rank_computes_with(field, value, monkeypatch):
    """Only --log.root, --resume, --env.launcher-args and --dist.timeout-s may differ between nodes: another seed,
    iteration count, env count, LR, gradient sync, rollout split or save interval on one node changes its digest
    (with the code the same), so the ranks stop at start-up.
    Mutant: "--seed" added to PER_NODE."""
    monkeypatch.setattr(same_settings, "source_digest", lambda: 12345)
    cfg = preset("cartpole")
    base = same_settings.settings_digest(cfg)
    section, _, name = field.rpartition("__")
    owner = getattr(cfg, section) if section else cfg
    assert getattr(owner, name) != value
    setattr(owner, name, value)
    assert same_settings.settings_digest(cfg) != base


def test_local_advantage_norm_over_one_transition_per_rank_is_refused_on_any_number_of_ranks():
    """--ppo.advantage-norm local normalizes each rank's advantages alone: one env and one step per rank is one
    transition, turned into 0, on 1 rank or on 4 (global pools the 4 ranks' 4 transitions and is accepted there).
    Mutant: the world size multiplied into the pooled count of every norm (`else world_size` for `else 1`)."""
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.ppo.num_mini_batches, cfg.ppo.advantage_norm = 1, 1, 1, "local"
    for world_size in (1, 4):
        with pytest.raises(UsageError) as caught:
            validate(cfg, world_size)
        assert str(caught.value) == ("--ppo.advantage-norm local normalizes over 1 transition, which it turns into 0 "
                                     "(no policy gradient); use more --env.num-envs or --ppo.num-steps, or another "
                                     "--ppo.advantage-norm"), world_size
    cfg.ppo.advantage_norm = "global"
    validate(cfg, 4)
