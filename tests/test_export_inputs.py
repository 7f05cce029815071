"""What `make export` / `python -m ppo.export` does with inputs that are not a checkpoint it can deploy: one line,
`error: ...`, status 2, before any file is written (a checkpoint that is a string, a device file, a model or policy
config of the wrong kind, a dangling link at an output name, an --out below a file); and the Makefile passes CKPT to
it as one word, as typed."""

import os
import re
import subprocess
import sys
import threading
import zipfile

import pytest
import torch

from ppo import export
from ppo.actor_critic import ActorCritic, Gaussian
from tests.forked_python import run_python
from tests.test_export import small_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("taken", [".pt", ".pt2", ".onnx"])
def test_an_output_name_held_by_a_directory_is_refused_before_any_file_is_written(tmp_path, taken):
    """A folder named like one of the three outputs: torch.jit.save's (or ONNX's) traceback, after the formats
    before it were written."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    out = tmp_path / "out"
    (out / f"model_3.policy{taken}").mkdir(parents=True)
    with pytest.raises(ValueError, match=rf"^'{out}/model_3\.policy\{taken}' is a directory or not a regular file, "
                                         r"where the export writes a file; move it, or pass --out with another"):
        export.export(path, str(out))
    assert os.listdir(out) == [f"model_3.policy{taken}"]


@pytest.mark.parametrize("env, shown", [
    ("x", "its config's 'env' is a str, not a dict"),                       # an AttributeError after the files
    ({"action_scale": float("nan")}, "its config's action scale nan or clip None"),   # the note: "scaled them by nan"
    ({"action_scale": 0.0}, "its config's action scale 0.0 or clip None"),
    ({"action_scale": "big"}, "its config's action scale 'big' or clip None"),
    ({"action_clip": -1.0}, "its config's action scale 1.0 or clip -1.0"),
    ({"action_clip": float("inf")}, "its config's action scale 1.0 or clip inf"),
    # training's rule, not "nonzero and finite": the note told a deployment to flip its actions (scale -0.5)
    ({"action_scale": -0.5}, r"its config's action scale -0.5 or clip None is not one a run takes \(a positive scale, "
                             r"a positive clip or None, each in \[1.2e-38, 3.4e\+38\]\): damaged\?$"),
    ({"action_scale": 1e39}, "its config's action scale 1e\\+39 or clip None"),      # inf in float32
    ({"action_scale": 1e-50}, "its config's action scale 1e-50 or clip None"),       # 0 in float32
])
def test_an_action_scale_or_clip_no_run_takes_is_refused_before_any_file_is_written(tmp_path, env, shown):
    """The note the export prints is what a deployment applies to the actions: a value no run takes is damage."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    state = torch.load(path, weights_only=True)
    state["config"]["env"] = env
    torch.save(state, path)
    with pytest.raises(ValueError, match=f"^CKPT '{path}': {shown}"):
        export.export(path, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_an_exported_program_passed_back_is_named_as_one_and_a_pipe_is_not_a_regular_file(tmp_path):
    """Also a program as torch 2.5 and 2.7 save it, a missing file, a dangling link and an unexpanded pattern, each
    named as such.
    Mutant: export without the pattern's note -> the pattern's match fails; torch.export known by archive_format
    alone -> the older layout is read by torch.load and named unreadable."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    written = export.export(path, str(tmp_path / "out"))
    for kind, file in (("TorchScript", written["torchscript"]), ("torch.export", written["torch.export"])):
        with pytest.raises(ValueError, match=rf"is an exported policy \({kind}\), not a training checkpoint: pass "
                                             r"the model_<k>\.pt it was exported from$"):
            export.export(file, str(tmp_path / "again"))
    # torch 2.5 and 2.7 save a program as top-level files (2.13 in a folder with archive_format): their .pt2 is read
    # as torch.load's "file in archive is not in a subdirectory" error otherwise
    older = tmp_path / "model_3.policy.old.pt2"
    with zipfile.ZipFile(older, "w") as archive:
        for name in ("serialized_exported_program.json", "serialized_state_dict.pt", "version"):
            archive.writestr(name, "{}")
    with pytest.raises(ValueError, match=r"is an exported policy \(torch.export\), not a training checkpoint"):
        export.export(str(older), str(tmp_path / "again"))
    pipe = tmp_path / "model_4.pt"
    os.mkfifo(pipe)
    stop = threading.Event()

    def empty_writes():     # a regression that opens the pipe (each time) reads its end and fails instead of hanging
        while not stop.is_set():
            os.close(os.open(pipe, os.O_WRONLY))
    writer = threading.Thread(target=empty_writes, daemon=True)
    writer.start()
    try:
        with pytest.raises(ValueError, match=r"is not a regular file; pass a model_<iteration>\.pt file$"):
            export.export(str(pipe))                       # said "no such checkpoint file"
    finally:
        stop.set()
        release = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)   # a reader, so that the writer's last open returns
        writer.join()
        os.close(release)
    for run in ("a", "b"):   # `make export CKPT=runs/x/*/model_4.pt` passes the pattern as typed (h83's audit)
        (tmp_path / run).mkdir()
        (tmp_path / run / "model_4.pt").write_bytes(b"")
    last = re.escape(repr(str(tmp_path / "b" / "model_4.pt")))
    with pytest.raises(ValueError, match=r"no such checkpoint file \(a pattern, not expanded: it matches 2 file\(s\), "
                                         rf"the last by name {last}; pass one file\)$"):
        export.export(str(tmp_path / "*" / "model_4.pt"))
    (tmp_path / "model_5.pt").symlink_to(tmp_path / "gone.pt")
    with pytest.raises(ValueError, match=r"no such checkpoint file \(a symbolic link whose target does not exist\)$"):
        export.export(str(tmp_path / "model_5.pt"))
    result = run_python(["-m", "ppo.export", str(pipe)], cwd=REPO, timeout=120)
    assert (result.returncode, result.stderr) == (2, f"error: CKPT {str(pipe)!r} is not a regular file; pass a "
                                                     f"model_<iteration>.pt file\n")


@pytest.mark.parametrize("ckpt", ['x"; echo INJECTED; echo "', "$F/model_1.pt", "it's here/model_1.pt"])
def test_make_export_passes_ckpt_as_one_word_as_typed(ckpt):
    """CKPT went into the recipe inside double quotes: a path with " ran the rest as shell (and make's exit status
    was the injected command's), one with $F lost it to make's expansion."""
    result = subprocess.run(["make", "-n", "export", f"CKPT={ckpt}"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    quoted = "'" + ckpt.replace("'", "'\\''") + "'"
    assert f"-m ppo.export {quoted} " in result.stdout, result.stdout + result.stderr
    assert "INJECTED" not in result.stdout.replace(quoted, "")


def test_make_export_without_ckpt_says_so_before_building_anything(tmp_path):
    # Under `make test` this make is a sub-make, which would print "Entering directory" first.
    result = subprocess.run(["make", "--no-print-directory", "-n", "export"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert "make export needs CKPT=" in result.stdout.splitlines()[0], result.stdout    # before any venv step
    result = subprocess.run(["make", "export"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: make export needs CKPT=path/to/model_")


def test_deployment_takes_float32_max_and_refuses_a_boolean_scale_or_clip():
    """Training's rule: a bool is not a number of the config, and float32's largest finite value is still taken."""
    from ppo.export import deployment
    big = float(torch.finfo(torch.float32).max)
    assert deployment({"env": {"action_scale": big, "action_clip": big, "name": "x"}}, "m.pt") == (big, big, "x")
    for env in ({"action_scale": True}, {"action_clip": True}):
        with pytest.raises(ValueError, match="not one a run takes"):
            deployment({"env": env}, "m.pt")


def test_a_fifo_at_an_output_name_is_refused_before_any_file_is_written(tmp_path):
    """A FIFO where STEM.policy.pt goes is not a regular file: writing the export into it would block on a pipe
    nobody reads (or scatter it), so it is refused as a folder of that name is. A reader thread drains the pipe in
    case the check lets it through, so a regression fails instead of hanging."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    out = tmp_path / "out"
    out.mkdir()
    fifo = out / "model_3.policy.pt"
    os.mkfifo(fifo)
    reader = threading.Thread(target=fifo.read_bytes, daemon=True)
    reader.start()
    try:
        with pytest.raises(ValueError, match=rf"^'{out}/model_3\.policy\.pt' is a directory or not a regular file, "
                                             r"where the export writes a file; move it, or pass --out with another"):
            export.export(path, str(out))
    finally:
        for _ in range(200):      # release the reader: an empty write end (ENXIO until the reader has opened it)
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            reader.join(timeout=0.05)
            if not reader.is_alive():
                break
    assert os.listdir(out) == ["model_3.policy.pt"]   # nothing else written


def test_a_checkpoint_that_is_a_string_is_not_a_train_py_checkpoint(tmp_path):
    """A torch file holding a str that happens to contain the words "model" and "config" passes `in` tests: only the
    dict check turns it into the one-line refusal instead of a TypeError traceback (string indices).
    Mutant: `usable` without `not isinstance(state, dict)`."""
    path = str(tmp_path / "model_1.pt")
    torch.save("model and config", path)
    with pytest.raises(ValueError) as caught:
        export.export(path, str(tmp_path / "out"))
    assert str(caught.value) == (f"CKPT {path!r} is not a train.py checkpoint (it needs 'model' and 'config' "
                                 f"entries)")


@pytest.mark.parametrize("damage, said", [
    ("policy config a list", "AttributeError: 'list' object has no attribute 'items'"),
    ("first layer one-dimensional", "IndexError: tuple index out of range"),
])
def test_a_model_or_policy_config_of_the_wrong_kind_is_one_line(tmp_path, damage, said):
    """A 'policy' config that is a list (no .items()), or an actor's first weight with one dimension (no input
    size): the export says the checkpoint does not fit, naming the error, instead of a traceback.
    Mutant: AttributeError or IndexError left out of load_policy's `except`."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    state = torch.load(path, weights_only=True)
    if damage == "policy config a list":
        state["config"]["policy"] = [8, 8]
    else:
        state["model"]["actor.0.weight"] = torch.zeros(8)
    torch.save(state, path)
    with pytest.raises(ValueError) as caught:
        export.export(path, str(tmp_path / "out"))
    assert str(caught.value) == (f"CKPT {path!r}: its model or policy config does not fit this version's "
                                 f"actor-critic (damaged, or saved by another version?): {said}")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("dropped, said", [
    (("log_std",), "its model has no 'log_std' (export reads the number of actions from it, as the ActorCritic of "
     "ppo/actor_critic.py has it; an actor-critic forked without it needs ppo/export.py's load_policy changed to "
     "read its sizes another way)"),
    (("actor.0.weight", "log_std"), "its model has no 'actor.0.weight' or 'log_std' (export reads the actor's "
     "observation size and the number of actions from them, as the ActorCritic of ppo/actor_critic.py has them; an "
     "actor-critic forked without them needs ppo/export.py's load_policy changed to read its sizes another way)"),
    (("policy",), "its config has no 'policy' entry (the settings export builds the actor-critic from: saved by "
     "another version?)"),
])
def test_a_model_without_an_entry_the_sizes_are_read_from_is_refused_naming_it(tmp_path, dropped, said):
    """A model whose std is not a `log_std` parameter (a forked actor-critic that computes it another way), or a
    config without its policy settings: the export said the checkpoint was perhaps damaged (its CRCs had passed),
    with a bare `KeyError: 'log_std'`; it names the entry and what reads it, before any file is written.

    Mutant: the `missing` check, or the `"policy" not in config` check, left out of load_policy (the KeyError
    reaches the generic `does not fit` line)."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    state = torch.load(path, weights_only=True)
    for name in dropped:
        del state["config" if name == "policy" else "model"][name]
    torch.save(state, path)
    with pytest.raises(ValueError) as caught:
        export.export(path, str(tmp_path / "out"))
    assert str(caught.value) == f"CKPT {path!r}: {said}"
    assert not os.path.exists(tmp_path / "out")


def test_a_dangling_symlink_at_an_output_name_is_refused_and_its_target_not_made(tmp_path):
    """A symbolic link to nowhere where STEM.policy.pt goes is not a regular file: written through, the export would
    land wherever the link points. It is refused as a folder of that name is, before anything is written.
    Mutant: `os.path.exists` for `os.path.lexists` (a dangling link does not exist)."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model_3.policy.pt").symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(ValueError) as caught:
        export.export(path, str(out))
    assert str(caught.value) == (f"{str(out / 'model_3.policy.pt')!r} is a directory or not a regular file, where the "
                                 f"export writes a file; move it, or pass --out with another folder")
    assert os.listdir(out) == ["model_3.policy.pt"] and not os.path.lexists(tmp_path / "elsewhere.pt")


def test_an_out_below_a_file_is_one_line(tmp_path):
    """--out notes.txt/exported: makedirs fails with NotADirectoryError (not FileExistsError, as for --out notes.txt),
    said as the same one-line refusal with the system's reason.
    Mutant: `except FileExistsError` for `except OSError` around makedirs."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    (tmp_path / "notes.txt").write_text("hello")
    out = str(tmp_path / "notes.txt" / "exported")
    with pytest.raises(ValueError) as caught:
        export.export(path, out)
    assert str(caught.value) == f"--out {out!r} cannot be an output folder (Not a directory)"


def test_a_device_given_as_the_checkpoint_is_not_a_regular_file():
    """/dev/null exists and is no directory, but no regular file either: refused as such before it is opened (the
    FIFO test of test_export_inputs.py blocks forever on this mutant instead of failing; a device reads as empty).
    Mutant: the `not os.path.isfile(path)` check left out."""
    with pytest.raises(ValueError) as caught:
        export.export("/dev/null")
    assert str(caught.value) == "CKPT '/dev/null' is not a regular file; pass a model_<iteration>.pt file"


def test_a_model_whose_distribution_does_more_than_its_actor_mlp_is_refused_before_any_file_is_written(tmp_path,
                                                                                                   monkeypatch):
    """A fork that puts a (frozen, pretrained) encoder before the actor MLP inside `distribution` exported only the
    normalizer and `model.actor`: other actions than the checkpoint's policy, without an error (found adding an
    encoder to cartpole's policy and comparing the export with `distribution(obs).mean`).
    Mutant: `check_same_actions(policy, model, path)` left out of export()."""
    path = small_checkpoint(tmp_path / "model_3.pt", True)

    def with_encoder(self, obs):
        x = self.actor_normalizer(obs)
        return Gaussian(self.actor(x + 0.5 * x.tanh()), self.log_std)
    monkeypatch.setattr(ActorCritic, "distribution", with_encoder)
    with pytest.raises(ValueError, match=r"the exported actor \(the actor normalizer, then model.actor\) does not give "
                                         r"the model's mean action, .*DeterministicActor compute what distribution"):
        export.export(path, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_a_broken_onnx_install_skips_onnx_naming_the_import_error(tmp_path, monkeypatch, capsys):
    """onnxscript installed (find_spec finds it) but failing at import, as it does when its ml_dtypes was built for
    numpy 2 under numpy 1: the TorchScript and torch.export files are written and ONNX is skipped with that error
    and the reinstall line, where the exporter's import traceback had ended the export.
    Mutant: the import check dropped from onnx_missing (the export raises the ImportError)."""
    broken = tmp_path / "site" / "onnxscript"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('numpy.core.multiarray failed to import')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "onnxscript" or m.startswith("onnxscript.")]:
        monkeypatch.delitem(sys.modules, name)
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    written = export.export(path, str(tmp_path / "out"))
    assert list(written) == ["torchscript", "torch.export"] and all(map(os.path.isfile, written.values()))
    assert sorted(os.listdir(tmp_path / "out")) == ["model_3.policy.pt", "model_3.policy.pt2"]
    assert ("ONNX skipped, installed but onnxscript fails to import (ImportError: numpy.core.multiarray failed to "
            "import); reinstall it in this environment: pip install --force-reinstall onnx onnxscript"
            ) in capsys.readouterr().out
