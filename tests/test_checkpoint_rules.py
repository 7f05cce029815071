"""Checkpoints and resume: entries ppo.restore cannot use are refused by name, a run directory's newest checkpoint
(which run a resume picks: test_resume_which_run.py), which saved configs fit, named tensors and RNG states
round trips, and the plan rows of the replica check and of a save (RNG gather, env-state check)."""

import contextlib
import dataclasses
import io
import os

import pytest
import torch

from configs import preset
from dist.checkpoint import checkpoint_plan_rows
from dist.plan import PlanRow
from dist.verify import verify_plan_rows
from test_sync_common import bits_equal


# ----- checkpoints: what load_checkpoint refuses --------------------------------------------------------------

def _minimal_checkpoint(**changes) -> dict:
    """The smallest dict load_checkpoint accepts (what train.main saves, with empty model and env)."""
    state = {"model": {}, "optimizer": {"param_groups": [], "state": {}}, "iteration": 2, "learning_rate": 1e-3,
             "env": {}, "config": dataclasses.asdict(preset("cartpole")), "rng": [{"torch": torch.get_rng_state()}],
             "layout": [1, 0]}
    state.update(changes)
    return {k: v for k, v in state.items() if v is not _DROP}


_DROP = object()


@pytest.mark.parametrize("changes, message", [
    ({"rng": _DROP}, r"is missing \['rng'\]; the file is truncated or from another tool: resume from another "
                     r"checkpoint$"),
    ({"iteration": True}, r"its iteration is True, not an integer >= 0"),
    ({"layout": [2, 0]}, r"its layout \[2, 0\] does not say \[1 learner\(s\), rollout ranks\]"),
    ({"layout": [1, -1]}, r"its layout \[1, -1\] does not say \[1 learner\(s\), rollout ranks\]"),
    ({"layout": [1, 1], "rollout_rng": [3]}, r"1 rollout rank\(s\) but not as many 'rollout_rng' dicts"),
    ({"config": {"env": 3}}, r"its config section 'env' is not a dict"),
    ({"config": {"rollout": [2]}}, r"its config section 'rollout' is not a dict"),     # the last section named
    # params holds indices into the model's parameters: a name, a float or a bool is none
    *[({"optimizer": {"param_groups": [{"params": [0, index], "lr": 1e-3}], "state": {}}},
       r"its optimizer param group 0 is not a dict with a 'params' list of indices") for index in ("1", 1.0, True)],
    # The shuffle generator is always a CPU one: a 16-byte (cuda-sized) state could never fit it.
    ({"rng": [{"torch": torch.get_rng_state(), "shuffle": torch.zeros(16, dtype=torch.uint8)}]},
     r"its rng\[0\]\['shuffle'\] \(16 bytes\) is not the state of a torch generator"),
    ({"optimizer": {"param_groups": [], "state": []}}, r"its 'optimizer' has no 'param_groups' list and 'state' dict"),
])
def test_checkpoint_entries_train_restore_cannot_use_are_refused_by_name(tmp_path, changes, message):
    """load_checkpoint's promise: a file ppo.restore cannot use is one UsageError naming what is wrong, not a
    KeyError, TypeError or a silent run from a wrong layout. The entries no other test damaged: a missing RNG
    list, a bool iteration (True is an int to Python), a layout that disagrees with the number of learner RNG
    states or counts negative rollout ranks, rollout RNG states that are not dicts, a config section that is
    not a dict, an optimizer param group whose 'params' are not all integer indices, and an optimizer whose
    'state' is not a dict. The undamaged file loads."""
    from dist.checkpoint import save_checkpoint
    from dist.checkpoint_read import load_checkpoint
    from dist.errors import UsageError
    path = str(tmp_path / "model_2.pt")
    save_checkpoint(path, _minimal_checkpoint())
    assert load_checkpoint(path)["iteration"] == 2
    save_checkpoint(path, _minimal_checkpoint(**changes))
    with pytest.raises(UsageError, match=message):
        load_checkpoint(path)


# ----- run directories: which checkpoint a resume starts from ---------------------------------------------------

def _touch(path, mtime=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    if mtime is not None:
        import os
        os.utime(path, (mtime, mtime))


def test_latest_checkpoint_is_the_highest_iteration_and_never_a_temporary(tmp_path):
    """`--resume auto` and torchrun restarts continue from latest_checkpoint(run_dir): the highest iteration by
    number (model_10 after model_9, which a string comparison gets wrong), and never a half-written temporary
    (model_<k>.pt.tmp-..., left by a save that was killed, which resolve_resume sees before open_run_dir removes
    it). Files are compared by name only, so empty files stand in for checkpoints."""
    from dist.checkpoint import latest_checkpoint, remove_stale_temporaries
    run = tmp_path / "run"
    assert latest_checkpoint(str(run)) is None
    for name in ("model_2.pt", "model_9.pt", "model_10.pt", "model_12.pt.tmp-77-abcdef12", "notes.txt"):
        _touch(run / name)
    assert latest_checkpoint(str(run)) == str(run / "model_10.pt")
    (run / "model_11.pt").mkdir()       # a directory named like a checkpoint is not one
    assert latest_checkpoint(str(run)) == str(run / "model_10.pt")
    (run / "model_11.pt").rmdir()
    assert remove_stale_temporaries(str(run)) == [str(run / "model_12.pt.tmp-77-abcdef12")]
    assert sorted(p.name for p in run.iterdir()) == ["model_10.pt", "model_2.pt", "model_9.pt", "notes.txt"]


def test_resume_auto_picks_the_run_whose_latest_checkpoint_was_written_last(tmp_path):
    """newest_run_with_checkpoint: among run directories, the one whose latest checkpoint is newest by
    modification time (not by name or iteration), skipping runs without one; find_run_dir: the run whose run_id
    file holds the torchrun job id."""
    from dist.checkpoint import find_run_dir, newest_run_with_checkpoint
    _touch(tmp_path / "2024-01-01_00-00-00" / "model_50.pt", mtime=1_000_000)
    _touch(tmp_path / "2024-01-02_00-00-00" / "model_3.pt", mtime=2_000_000)
    _touch(tmp_path / "2024-01-03_00-00-00" / "events.out", mtime=3_000_000)
    assert newest_run_with_checkpoint(str(tmp_path)) == str(tmp_path / "2024-01-02_00-00-00")
    (tmp_path / "2024-01-01_00-00-00" / "run_id").write_text("job-a")
    (tmp_path / "2024-01-02_00-00-00" / "run_id").write_text("job-b\n")
    assert find_run_dir(str(tmp_path), "job-b") == str(tmp_path / "2024-01-02_00-00-00")
    assert find_run_dir(str(tmp_path), "job-a") == str(tmp_path / "2024-01-01_00-00-00")
    assert find_run_dir(str(tmp_path), "job-c") is None


# ----- resume: which checkpoints fit the config -----------------------------------------------------------------

def _tracking_cfg(**changes):
    cfg = preset("tracking")                 # actor/critic hidden (128, 128), 512 envs, 64 motions, 400 iterations
    for dotted, value in changes.items():
        section, name = dotted.split("__")
        assert hasattr(getattr(cfg, section), name), dotted    # setattr would add a field nothing reads
        setattr(getattr(cfg, section), name, value)
    return cfg


def _saved(iteration=5, **sections):
    return {"config": {"env": {"name": "tracking", "num_envs": 512, "num_motions": 64}, **sections},
            "iteration": iteration}


def test_resume_fits_when_shapes_match_in_any_sequence_type_or_are_absent_from_an_older_checkpoint():
    """check_resume_fits compares the fields that decide tensor shapes: equal values stored as a list (a config
    round-tripped through YAML or JSON) fit a tuple, and a field an older checkpoint did not record is not a
    mismatch (it would make every older checkpoint unresumable)."""
    from configs.resume import check_resume_fits
    saved = _saved(policy={"actor_hidden": [128, 128], "critic_hidden": [128, 128], "activation": "elu"})
    assert check_resume_fits(saved, _tracking_cfg(), "ckpt.pt", restarted=False) is True
    assert check_resume_fits(_saved(), _tracking_cfg(), "ckpt.pt", restarted=False) is True


@pytest.mark.parametrize("sections, ours, theirs", [
    ({"policy": {"actor_hidden": [64, 64]}}, "--policy.actor-hidden 128 128", "--policy.actor-hidden 64 64"),
    ({"policy": {"critic_hidden": (256,)}}, "--policy.critic-hidden 128 128", "--policy.critic-hidden 256"),
    ({"policy": {"activation": "tanh"}}, "--policy.activation elu", "--policy.activation tanh"),
    ({"policy": {"normalize_actor_obs": True}}, "--policy.no-normalize-actor-obs", "--policy.normalize-actor-obs"),
    ({"ppo": {"normalize_rewards": True}}, "--ppo.no-normalize-rewards", "--ppo.normalize-rewards"),
])
def test_resume_refuses_a_checkpoint_whose_shapes_or_states_differ_naming_the_flag(sections, ours, theirs):
    """Each field of MUST_MATCH decides a tensor shape or which states a checkpoint holds (a reward normalizer,
    observation normalizers): a mismatch must fail before anything is built, naming the flag and the checkpoint's
    value as it would be typed."""
    from configs.resume import check_resume_fits
    from dist.errors import UsageError
    with pytest.raises(UsageError, match=f"^{ours} does not match the checkpoint's {theirs} \\('ckpt.pt'\\); leave "
                                         f"the flag out to keep the checkpoint's$"):
        check_resume_fits(_saved(**sections), _tracking_cfg(), "ckpt.pt", restarted=False)


def test_resume_of_a_finished_run():
    """A checkpoint at or past --max-iterations has nothing left to train: a user's --resume is told to raise
    --max-iterations (iteration == max included: the loop would run zero iterations), while a torchrun restart
    of a run that already finished returns False (the job is done, not an error)."""
    from configs.resume import check_resume_fits
    from dist.errors import UsageError
    cfg = _tracking_cfg()
    assert check_resume_fits(_saved(iteration=cfg.max_iterations - 1), cfg, "ckpt.pt", restarted=False) is True
    with pytest.raises(UsageError, match=f"--max-iterations {cfg.max_iterations}: 'ckpt.pt' is already at iteration"):
        check_resume_fits(_saved(iteration=cfg.max_iterations), cfg, "ckpt.pt", restarted=False)
    assert check_resume_fits(_saved(iteration=cfg.max_iterations), cfg, "ckpt.pt", restarted=True) is False


def test_named_tensors_travel_as_bytes_and_back_exactly():
    """to_bytes / from_bytes carry a rollout rank's checkpoint state (RNG states, flattened env state) as one
    uint8 tensor: each tensor is read back from its own offset, in its dtype and shape, bit for bit;
    flatten_state / unflatten_state turn nested dicts into "a/b" names and back."""
    from dist.batches import flatten_state, from_bytes, to_bytes, unflatten_state
    nested = {"rng": torch.tensor([1, 2, 3], dtype=torch.uint8),
              "env": {"steps": torch.tensor([[7, -8]], dtype=torch.int64), "obs": {"mean": torch.tensor([0.5, -0.0])}},
              "done": torch.tensor([True, False, True])}
    flat = flatten_state(nested)
    assert list(flat) == ["rng", "env/steps", "env/obs/mean", "done"]
    blob = to_bytes(flat)
    assert blob.dtype == torch.uint8 and blob.numel() == 3 + 16 + 8 + 3
    assert blob[3:11].tolist() == list((7).to_bytes(8, "little"))
    back = from_bytes(blob, {k: (tuple(v.shape), v.dtype) for k, v in flat.items()})
    assert bits_equal(back, flat)
    restored = unflatten_state(back)
    assert bits_equal(restored["env"]["obs"], nested["env"]["obs"]) and restored["env"]["steps"].shape == (1, 2)



def test_rng_states_gathered_come_back_under_their_own_names():
    """gather_rng_states packs each RNG state into one uint8 tensor for a single gather and unpacks it per
    rank: every state must come back from its own offset (one process: the gather is the identity)."""
    from dist.checkpoint import gather_rng_states
    states = {"torch": torch.arange(5, dtype=torch.uint8), "shuffle": torch.tensor([200, 201], dtype=torch.uint8),
              "env": torch.tensor([7, 8, 9], dtype=torch.uint8)}
    (got,) = gather_rng_states(states)
    assert list(got) == list(states) and all(torch.equal(got[k], states[k]) for k in states)


def test_continuing_a_run_directory_records_the_new_job_and_clears_temporaries(tmp_path):
    """open_run_dir on an existing run (`--resume auto` under a new torchrun job): the run_id file must name the
    new job, so that this job's restarts find the directory again, and half-written checkpoints of the killed
    save are removed while complete ones stay."""
    from dist.checkpoint import find_run_dir, open_run_dir
    run = tmp_path / "2024-01-01_00-00-00"
    _touch(run / "model_4.pt")
    _touch(run / "model_6.pt.tmp-12-0123abcd")
    (run / "run_id").write_text("job-old")
    assert open_run_dir(str(run), str(tmp_path), "job-new") == str(run)
    assert (run / "run_id").read_text() == "job-new" and find_run_dir(str(tmp_path), "job-new") == str(run)
    assert sorted(p.name for p in run.iterdir()) == [".lock", "model_4.pt", "run_id"]



def test_replica_check_plan_rows():
    """verify_plan_rows gives the sync plan (checked against the ledger) its checksum all-gathers: one 8-byte
    all-gather every K iterations only when K > 0 (--dist.verify-every 0 turns the check off), and one after a
    checkpoint load only when a checkpoint was loaded."""
    from dist.verify import verify_plan_rows
    assert verify_plan_rows(0, False) == []
    rows = verify_plan_rows(3, True)
    assert [(r.purpose, r.collective, r.cadence, r.call_bytes, r.every) for r in rows] == \
        [("checksum", "all_gather", "every", [8], 3), ("checksum", "all_gather", "setup", [8], 1)]
    assert [(r.cadence, r.every) for r in verify_plan_rows(0, True)] == [("setup", 1)]


def test_a_replica_check_every_iteration_has_its_plan_row():
    """--dist.verify-every 1 checks the replicas after every iteration: the plan (compared with the ledger after a
    run) must hold its 8-byte all-gather with every=1, not only for K > 1."""
    assert verify_plan_rows(1, False) == [PlanRow("checksum", "all ranks equal rank 0", "all_gather", "every", [8],
                                                  every=1)]


def test_the_env_state_check_is_planned_at_the_save_interval_like_the_rng_gather():
    """Both rows of a save recur every --log.save-every iterations (5 here), so the ledger of a run saving every 5
    iterations matches its plan; the env-state row only when the env is checkpointed."""
    states = {"torch": torch.zeros(7, dtype=torch.uint8), "env": torch.zeros(16, dtype=torch.uint8)}
    rng_row = PlanRow("checkpoint", "RNG states of every rank to rank 0", "gather", "checkpoint", [23], every=5)
    assert checkpoint_plan_rows(states, 5, env_state=False) == [rng_row]
    assert checkpoint_plan_rows(states, 5, env_state=True) == [
        rng_row, PlanRow("env_state", "env state the same on every rank", "all_gather", "checkpoint", [16], every=5)]


def agree_body(rank, world_size, loads, roots=(None, None, None), max_restarts=None):
    """agree_on_checkpoint on this rank with the checkpoint `loads[rank]` (None: no checkpoint) and the log root
    `roots[rank]` (None: a dry run), under torchrun's TORCHELASTIC_MAX_RESTARTS when given; the error or "ok", the
    ledger's counts and what was printed."""
    from dist import comm
    from dist.checkpoint import agree_on_checkpoint
    from dist.errors import UsageError
    comm.reset_ledger()
    if max_restarts is not None:
        os.environ["TORCHELASTIC_MAX_RESTARTS"] = str(max_restarts)
    spec = loads[rank]
    checkpoint = None if spec is None else {"iteration": spec[0], "model": {"w": torch.full((3,), float(spec[1]))}}
    if spec is not None and len(spec) > 2:           # (iteration, w, log_std): a second saved tensor
        checkpoint["model"]["log_std"] = torch.full((2,), float(spec[2]))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            agree_on_checkpoint(checkpoint, roots[rank])
        said = "ok"
    except UsageError as exc:
        said = str(exc)
    return said, dict(comm.LEDGER), printed.getvalue()


@pytest.mark.slow
def test_ranks_that_loaded_another_checkpoint_or_none_stop_every_rank_at_start():
    """Each rank reads --resume on its own filesystem: a node without the run directory started fresh while rank 0
    resumed, and only the broadcast weights agreed (not Adam's moments, normalizers or the iteration). All ranks now
    gather (loaded, iteration, checksum of the saved weights) once and stop together when they differ."""
    from dist.checksum import checksum
    from tests.multirank import run_ranks
    same = run_ranks(agree_body, 3, args=([(4, 1.0), (4, 1.0), (4, 1.0)],))
    assert [said for said, _, _ in same] == ["ok"] * 3
    # the plan rows: 8-byte broadcast, 32-byte all-gather
    assert all(ledger["resume"] == [2, 8 + 40] for _, ledger, _ in same)
    weights = int(checksum([torch.full((3,), 1.0)]))
    fresh = run_ranks(agree_body, 3, args=([(4, 1.0), None, (4, 2.0)],))
    other = int(checksum([torch.full((3,), 2.0)]))
    expected = (f"ranks did not load the same checkpoint: rank(s) [0] loaded iteration 4 (weights checksum {weights}); "
                f"rank(s) [1] loaded no checkpoint; rank(s) [2] loaded iteration 4 (weights checksum {other}). Every "
                f"rank reads --resume")
    assert all(said.startswith(expected) and "every node sees the same files" in said for said, _, _ in fresh)


@pytest.mark.slow
def test_checkpoints_that_differ_only_past_their_first_tensor_are_not_the_same_checkpoint():
    """The gathered checksum covers every saved model tensor: rank 2's checkpoint of the same iteration and the same
    first tensor but another log_std stops every rank, naming both checksums (from the independent reference)."""
    from test_checksum_reference import ref_checksum
    from tests.multirank import run_ranks
    results = run_ranks(agree_body, 3, args=([(4, 1.0, 0.5), (4, 1.0, 0.5), (4, 1.0, -0.5)],))
    ours, theirs = (ref_checksum([torch.full((3,), 1.0), torch.full((2,), x)]) for x in (0.5, -0.5))
    expected = (f"ranks did not load the same checkpoint: rank(s) [0, 1] loaded iteration 4 (weights checksum {ours}); "
                f"rank(s) [2] loaded iteration 4 (weights checksum {theirs}). Every rank reads --resume")
    assert all(said.startswith(expected) for said, _, _ in results), results[0][0]


@pytest.mark.slow
def test_a_log_root_that_some_ranks_do_not_share_stops_a_restartable_run_and_warns_otherwise(tmp_path):
    """A --log.root that is not one filesystem for every node trained fine and failed at the first torchrun restart
    (the other nodes could not find the run). Rank 0 now leaves a probe there at launch: a run that torchrun may
    restart stops on every rank, naming the ranks that did not see it; any other run gets one warning from rank 0.
    The probe is gone afterwards, and a --log.root that does not exist yet is not created."""
    from tests.multirank import run_ranks
    shared, other = tmp_path / "shared", tmp_path / "other"
    shared.mkdir(), other.mkdir()
    fresh = [None, None, None]
    split = (str(shared / "runs"), str(shared / "runs"), str(other / "runs"))   # rank 2's node has its own disk
    stopped = run_ranks(agree_body, 3, args=(fresh, split, 1))      # --max-restarts 1 is enough to stop
    for (said, _, _), root in zip(stopped, split):        # each rank names its own --log.root
        assert said.startswith(f"--log.root {root!r} is not the same directory on every node: rank(s) [2] do not "
                               f"see what rank 0 wrote there, so a torchrun restart"), said
    warned = run_ranks(agree_body, 3, args=(fresh, split, 0))
    assert [said for said, _, _ in warned] == ["ok"] * 3
    assert "[syncppo] warning: --log.root" in warned[0][2] and "rank(s) [2] do not see" in warned[0][2]
    assert [printed for _, _, printed in warned[1:]] == ["", ""]
    together = run_ranks(agree_body, 3, args=(fresh, (split[0],) * 3, 2))
    assert [(said, printed) for said, _, printed in together] == [("ok", "")] * 3
    dry = run_ranks(agree_body, 3, args=(fresh, (None, None, str(other)), 2))   # a dry run: no probe, no verdict
    assert [(said, ledger["resume"]) for said, ledger, _ in dry] == [("ok", [2, 8 + 40])] * 3
    assert sorted(os.listdir(shared)) == [] and sorted(os.listdir(other)) == []
    (tmp_path / "file").write_text("")      # rank 0's --log.root lies under a file: it cannot make its probe
    blocked = run_ranks(agree_body, 3, args=(fresh, (str(tmp_path / "file" / "runs"), split[1], split[2]), 0))
    assert blocked[0][0].startswith(f"--log.root {str(tmp_path / 'file' / 'runs')!r}: cannot create"), blocked[0][0]
    assert [said for said, _, _ in blocked[1:]] == ["stopped at start-up: rank 0 could not create its probe directory "
                                                    "in its --log.root (rank 0's error says why)"] * 2


def agree_in_a_second_run_body(rank, world_size):
    """A second train.main in one process, as init_distributed and agree_on_checkpoint see it: the first run had
    1 learner + 1 rollout rank and raised (no shutdown), so dist.comm was left on this rank's group of one."""
    import torch.distributed as torch_dist
    from dist import comm
    from dist.checkpoint import agree_on_checkpoint
    from dist.errors import UsageError
    from dist.setup import init_distributed
    init_distributed("gloo", "cpu", 60.0)
    groups = [torch_dist.new_group([0]), torch_dist.new_group([1])]     # every rank creates every group
    comm.use_group(groups[rank])
    init_distributed("gloo", "cpu", 60.0)        # the second run: the process group is already there
    try:
        agree_on_checkpoint(None if rank else {"iteration": 4, "model": {"w": torch.ones(3)}}, None)
        return "ok"
    except UsageError as exc:
        return str(exc)


@pytest.mark.slow
def test_the_agreement_spans_every_rank_after_an_earlier_run_in_the_same_process():
    """Before init_distributed reset comm's group, each rank's stale group of one made the agreement a no-op:
    rank 0 resumed and rank 1 started fresh without a word. (After a shutdown the destroyed group reads as size 1
    too.)"""
    from tests.multirank import run_ranks
    said = run_ranks(agree_in_a_second_run_body, 2, init_group=False)
    assert all(s.startswith("ranks did not load the same checkpoint: rank(s) [0] loaded iteration 4") for s in said)


def test_agree_plan_rows_are_a_broadcast_of_one_int64_and_an_all_gather_of_five_at_setup():
    from dist.checkpoint import agree_plan_rows
    rows = agree_plan_rows()
    assert [(row.purpose, row.collective, row.cadence, row.call_bytes, row.all_ranks) for row in rows] == \
        [("resume", "broadcast", "setup", [8], True),            # before the learners' group exists: every rank
         ("resume", "all_gather", "setup", [5 * 8], True)]
