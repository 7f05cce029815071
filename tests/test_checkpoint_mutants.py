"""dist/checkpoint.py where a hand-picked mutation survived the other tests: a disk that fills up while torch.save
is writing tensors, and the start-up agreement on the settings every rank runs with."""

import errno
import io
import os

import pytest
import torch

import dist.checkpoint
from dist.checkpoint import save_checkpoint
from dist.errors import RunError


class _FillsUpAfter(io.FileIO):
    """A file that takes LIMIT bytes, then raises ENOSPC on the write that would pass them, as a full disk does."""
    LIMIT = 300

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.written = 0

    def write(self, b):
        if self.written + len(b) > self.LIMIT:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.written += len(b)
        return super().write(b)


def test_a_disk_filling_up_inside_torch_save_is_the_write_error_s_one_line_not_torch_s_zip_error(
        tmp_path, monkeypatch):
    """A full disk in the middle of torch.save's tensor records: torch's zip writer then raises RuntimeError
    ("unexpected pos ...") with the OSError as its context. save_checkpoint reports the OSError's cause as the
    RunError of a failed write (what to fix, the last checkpoint), leaves the previous checkpoint and no temporary.
    The file is a real file whose writes fail past 300 bytes, so the RuntimeError is torch's own.
    Mutant: only a KeyboardInterrupt context is unwrapped (`isinstance(first, KeyboardInterrupt)`): the
    RuntimeError escapes as a bug."""
    save_checkpoint(str(tmp_path / "model_5.pt"), {"iteration": 5})
    monkeypatch.setattr(dist.checkpoint, "open", lambda path, mode: _FillsUpAfter(path, mode), raising=False)
    path = str(tmp_path / "model_10.pt")
    with pytest.raises(RunError) as info:
        save_checkpoint(path, {"iteration": 10, "model": {"w": torch.arange(1000.0)}})
    assert str(info.value) == (f"could not write checkpoint {path}: No space left on device; free space on that disk "
                               f"or point --log.root elsewhere, then resume from the last checkpoint, "
                               f"{tmp_path / 'model_5.pt'}")
    assert os.listdir(tmp_path) == ["model_5.pt"]
    monkeypatch.undo()
    assert torch.load(tmp_path / "model_5.pt", weights_only=True)["iteration"] == 5


def agree_with_settings_body(rank, world_size, settings):
    """agree_on_checkpoint with no checkpoint and no --log.root on every rank, rank r running settings[r]; the
    UsageError's text on every rank, or "agreed"."""
    from dist.checkpoint import agree_on_checkpoint
    from dist.errors import UsageError
    try:
        agree_on_checkpoint(None, None, settings=settings[rank], explain=lambda: "--ppo.num-epochs differ")
        return "agreed"
    except UsageError as exc:
        return str(exc)


@pytest.mark.slow
def test_ranks_started_with_other_settings_than_rank_0_stop_every_rank_naming_them():
    """Three ranks, the same checkpoint (none) everywhere, settings checksums 5, 9, 5: every rank stops with one
    error naming rank 1 and what explain() says differs; the same checksums everywhere agree.
    Mutant: the settings column of the all-gather never compared (`others = []`): ranks with another env count
    trained on silently."""
    from tests.multirank import run_ranks
    said = run_ranks(agree_with_settings_body, 3, args=([5, 9, 5],))
    for text in said:
        assert text.startswith("rank(s) [1] run with other settings than rank 0: --ppo.num-epochs differ (a checksum "
                               "of every flag but --log.root"), text
        assert text.endswith("start every node with the same preset, flags and syncppo version")
    assert run_ranks(agree_with_settings_body, 3, args=([7, 7, 7],)) == ["agreed"] * 3


def _healthy(**changes) -> dict:
    """The smallest dict load_checkpoint accepts (test_checkpoint_rules' _minimal_checkpoint), with `changes`."""
    import dataclasses
    from configs import preset
    state = {"model": {}, "optimizer": {"param_groups": [], "state": {}}, "iteration": 2, "learning_rate": 1e-3,
             "env": {}, "config": dataclasses.asdict(preset("cartpole")), "rng": [{"torch": torch.get_rng_state()}],
             "layout": [1, 0]}
    return {**state, **changes}


@pytest.mark.parametrize("saved", [0, 1, 3])
def test_a_layout_of_two_rollout_ranks_needs_exactly_two_rollout_rng_states(tmp_path, saved):
    """A checkpoint whose layout says 2 rollout ranks loads with 2 rollout RNG dicts and is refused, naming the
    layout, with 1 or 3 (each rollout rank restores the one at its index: one too few left a rank without its
    stream) or none.
    Mutant: the length of 'rollout_rng' not compared with the layout (`isinstance(rollout_rng, list)` alone)."""
    from dist.checkpoint_read import load_checkpoint
    from dist.errors import UsageError
    path = str(tmp_path / "model_2.pt")
    rollout = [{"torch": torch.get_rng_state()} for _ in range(2)]
    save_checkpoint(path, _healthy(layout=[1, 2], rollout_rng=rollout))
    assert len(load_checkpoint(path)["rollout_rng"]) == 2
    save_checkpoint(path, _healthy(layout=[1, 2], rollout_rng=[{"torch": torch.get_rng_state()}] * saved))
    with pytest.raises(UsageError) as info:
        load_checkpoint(path)
    assert str(info.value) == (f"--resume {path!r} is damaged (its layout has 2 rollout rank(s) but not as many "
                               f"'rollout_rng' dicts); resume from another checkpoint")


def test_a_format_that_only_begins_like_syncppo_s_name_is_not_a_syncppo_checkpoint(tmp_path):
    """Only a format "syncppo-checkpoint-<version>" is another syncppo version; "syncppo-checkpointer" (no dash
    after the name) is some other tool's file, and is called not a syncppo checkpoint.
    Mutant: the version test without its dash (`startswith("syncppo-checkpoint")`)."""
    from dist.checkpoint_read import load_checkpoint
    from dist.errors import UsageError
    path = str(tmp_path / "model_2.pt")
    torch.save({**_healthy(), "format": "syncppo-checkpointer"}, path)
    with pytest.raises(UsageError) as info:
        load_checkpoint(path)
    assert str(info.value) == (f"--resume {path!r} is not a syncppo checkpoint (expected format "
                               f"'syncppo-checkpoint-v1'); pass a model_<iteration>.pt file train.py wrote")
    torch.save({**_healthy(), "format": "syncppo-checkpoint-v0"}, path)
    with pytest.raises(UsageError, match=r"was written by another syncppo version \(format 'syncppo-checkpoint-v0'"):
        load_checkpoint(path)


@pytest.mark.parametrize("head", [b"PK", b"PK\x05\x06", b"PKG-INFO\nName: x\n"])
def test_a_file_that_begins_with_pk_but_no_zip_entry_is_no_torch_checkpoint_not_a_truncated_one(tmp_path, head):
    """Only a zip's local-entry signature (PK\\x03\\x04) makes an unreadable file a truncated checkpoint; a file
    that merely begins with "PK" (a package's PKG-INFO, another zip record) is not a torch checkpoint at all.
    Mutant: the first 2 bytes compared (`f.read(2) == b"PK"`): it calls them truncated checkpoints."""
    from dist.checkpoint_read import load_checkpoint
    from dist.errors import UsageError
    path = tmp_path / "model_2.pt"
    path.write_bytes(head + b"\0" * 4)
    with pytest.raises(UsageError) as info:
        load_checkpoint(str(path))
    assert str(info.value) == (f"--resume {str(path)!r} is not a torch checkpoint (torch.save writes a zip archive; "
                               f"this file is not one): pass a model_<iteration>.pt file train.py wrote")
    path.write_bytes(b"PK\x03\x04" + b"\0" * 40)
    with pytest.raises(UsageError, match=r"is a truncated or damaged checkpoint \(its zip archive does not end\)"):
        load_checkpoint(str(path))


def test_runs_started_in_the_same_second_get_the_stamp_then_2_then_3_each_with_its_run_id(tmp_path, monkeypatch):
    """create_run_dir names the first run of a second by its time stamp alone, the next ones -2, -3, ..., and
    writes the torchrun job id into each (none without one). The clock is fixed, so all three share a second.
    Mutant: the first run suffixed too (`n == 0` for `n == 1`: STAMP-1); the run_id file never written."""
    from dist.checkpoint import create_run_dir, find_run_dir
    monkeypatch.setattr(dist.checkpoint.time, "strftime", lambda fmt: "2026-01-02_03-04-05")
    made = [create_run_dir(str(tmp_path / "exp"), run_id) for run_id in ("job-a", None, "job-c")]
    stamp = str(tmp_path / "exp" / "2026-01-02_03-04-05")
    assert made == [stamp, f"{stamp}-2", f"{stamp}-3"]
    assert [os.listdir(d) for d in made] == [["run_id"], [], ["run_id"]]
    assert find_run_dir(str(tmp_path / "exp"), "job-c") == f"{stamp}-3"
    assert find_run_dir(str(tmp_path / "exp"), "job-a") == stamp


class _InterruptedAfter(_FillsUpAfter):
    """A file whose write past LIMIT bytes gets a KeyboardInterrupt, as a second Ctrl-C inside torch.save does."""

    def write(self, b):
        if self.written + len(b) > self.LIMIT:
            raise KeyboardInterrupt
        self.written += len(b)
        return io.FileIO.write(self, b)


def test_an_interrupt_inside_torch_save_is_re_raised_as_the_interrupt_not_torch_s_zip_error(tmp_path, monkeypatch):
    """A Ctrl-C while torch.save writes tensor records: its zip writer raises RuntimeError over the interrupt;
    save_checkpoint re-raises the KeyboardInterrupt itself (cli() reports it as an interrupt, status 130) and
    removes its temporary.
    Mutant: a bare `raise` for `raise first from None`: the RuntimeError escapes, reported as a bug."""
    monkeypatch.setattr(dist.checkpoint, "open", lambda path, mode: _InterruptedAfter(path, mode), raising=False)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(tmp_path / "model_1.pt"), {"iteration": 1, "model": {"w": torch.arange(1000.0)}})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("changes, damage", [
    ({"rng": []}, "its 'rng' is not a non-empty list of per-rank dicts"),
    ({"rng": [], "layout": [0, 0]}, "its 'rng' is not a non-empty list of per-rank dicts"),
    ({"env_name": 3}, "its config's env.name is 3, not an env's name"),
    ({"weight_decay": -0.5}, "its optimizer param group 0 has betas (0.9, 0.999) and weight_decay -0.5, not Adam's "
                             "settings"),
])
def test_entries_past_their_bounds_are_refused_and_a_large_weight_decay_loads(tmp_path, changes, damage):
    """Refused by name: no learner RNG state at all (with the layout saying 1 learner, or 0), an env name that is
    a number, a negative weight decay; a weight decay of 2 (large, but Adam's setting) loads.
    Mutant: `not rng` dropped (an empty list passed, with the layout's message or none); env.name checked only
    against None (`is None`); weight decay bounded by 1 (`in_range(decay, 1)`)."""
    from dist.checkpoint_read import load_checkpoint
    from dist.errors import UsageError

    def group(decay):
        return {"params": [], "lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": decay}
    path = str(tmp_path / "model_2.pt")
    save_checkpoint(path, _healthy(optimizer={"param_groups": [group(2.0)], "state": {}}))
    assert load_checkpoint(path)["optimizer"]["param_groups"][0]["weight_decay"] == 2.0
    state = _healthy(**{k: v for k, v in changes.items() if k in ("rng", "layout")})
    if "env_name" in changes:
        state["config"]["env"]["name"] = changes["env_name"]
    if "weight_decay" in changes:
        state["optimizer"] = {"param_groups": [group(changes["weight_decay"])], "state": {}}
    save_checkpoint(path, state)
    with pytest.raises(UsageError) as info:
        load_checkpoint(path)
    assert str(info.value) == f"--resume {path!r} is damaged ({damage}); resume from another checkpoint"
