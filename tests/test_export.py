"""`make export`: the exported deterministic actor gives the checkpoint's model's mean actions on raw
observations, as TorchScript, a torch.export program and ONNX, for checkpoints of two presets (one with an
actor observation normalizer, one without); what it prints, a config without env settings, the ONNX exporter kept
quiet (its log level given back, its pytree warning filtered), and which exporter or packages count as missing; the
ONNX graph's interface (input `obs`, output `actions`, a free batch dimension), where the files go when no --out is
given, the refusal of an unwritable --out and of a checkpoint dict without a run config, the summary line and the
note about the run's action scale/clip."""

import dataclasses
import functools
import glob
import logging
import os
import pickle
import sys
import warnings

import numpy as np
import pytest
import torch

import train
from configs import preset
from configs.config import PolicyConfig
from ppo import export
from ppo.actor_critic import build_actor_critic
from tests.forked_python import run_python
from tests.read_only import read_only_folder
from tests.test_tools import numpy_actions as numpy_actions_of_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkpoint(tmp_path, name: str) -> str:
    """A real train.py checkpoint of preset `name` after one short iteration."""
    cfg = preset(name)
    cfg.ppo.num_steps, cfg.ppo.num_mini_batches, cfg.max_iterations = 64, 4, 1
    cfg.env.num_envs = 2 if name == "mujoco" else 8
    cfg.log.root, cfg.log.print_every = str(tmp_path / "runs"), 100
    train.main(cfg)
    (path,) = glob.glob(str(tmp_path / "runs" / "*" / "*" / "model_1.pt"))
    return path


def reference_actions(path: str, obs: torch.Tensor) -> torch.Tensor:
    """The mean action of the model rebuilt here from the checkpoint, through the training forward pass."""
    state = torch.load(path, weights_only=True)
    weights = state["model"]
    model = build_actor_critic(PolicyConfig(**state["config"]["policy"]),
                               {"policy": weights["actor.0.weight"].shape[1],
                                "critic": weights["critic.0.weight"].shape[1]},
                               weights["log_std"].shape[0])
    model.load_state_dict(weights)
    with torch.no_grad():
        return model.distribution(obs).mean


# onnx's reference ELU evaluates expm1 on both branches of its where(): large inputs overflow the unused one.
@pytest.mark.filterwarnings("ignore:overflow encountered in expm1:RuntimeWarning")
@pytest.mark.parametrize("name", ["mujoco", "cartpole"])
def test_exported_policy_acts_like_the_checkpoint(tmp_path, name, capfd):
    path = checkpoint(tmp_path, name)
    capfd.readouterr()
    written = export.export(path, str(tmp_path / "exported"))
    assert capfd.readouterr().err == ""              # no exporter log lines or torch-internal warnings
    assert set(written) == {"torchscript", "torch.export", "onnx"}
    assert sorted(os.listdir(tmp_path / "exported")) == ["model_1.policy.onnx", "model_1.policy.pt",   # one file each
                                                         "model_1.policy.pt2"]
    scripted = torch.jit.load(written["torchscript"])
    dim = torch.load(path, weights_only=True)["model"]["actor.0.weight"].shape[1]
    # Raw observations, wide enough that the normalizer's clip at 10 is hit (mujoco) as well as not.
    obs = torch.randn(64, dim, generator=torch.Generator().manual_seed(0)) * torch.logspace(-1, 2, 64)[:, None]
    expected = reference_actions(path, obs)
    normalizer_std = torch.load(path, weights_only=True)["model"].get("actor_normalizer.std")
    assert (normalizer_std is not None) == (name == "mujoco")       # one preset with, one without a normalizer
    assert not scripted(obs).requires_grad           # a deployed call builds no autograd graph
    with torch.no_grad():
        torch.testing.assert_close(scripted(obs), expected, rtol=0, atol=0)
    program = torch.export.load(written["torch.export"]).module()
    assert not program(obs).requires_grad
    with torch.no_grad():
        torch.testing.assert_close(program(obs), expected, rtol=0, atol=0)
        # Any batch size, 1 included (exported with a batch of 2); against the model on that batch, as the GEMM's
        # kernel, hence its rounding, depends on the batch size.
        torch.testing.assert_close(program(obs[:1]), reference_actions(path, obs[:1]), rtol=0, atol=0)
    import onnx
    from onnx.reference import ReferenceEvaluator

    graph = onnx.load(written["onnx"])
    onnx.checker.check_model(graph)
    (onnx_actions,) = ReferenceEvaluator(graph).run(None, {"obs": obs.numpy()})
    np.testing.assert_allclose(onnx_actions, expected.numpy(), rtol=1e-5, atol=1e-5)


def test_without_onnx_it_writes_torchscript_and_says_why(tmp_path, monkeypatch, capsys):
    path = checkpoint(tmp_path, "cartpole")
    real_find_spec = export.importlib.util.find_spec
    monkeypatch.setattr(export.importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxscript" else real_find_spec(name, *a))
    written = export.export(path, str(tmp_path / "exported"))
    assert list(written) == ["torchscript", "torch.export"] and all(map(os.path.isfile, written.values()))
    assert not glob.glob(str(tmp_path / "exported" / "*.onnx"))
    assert "ONNX skipped, not installed: onnxscript (pip install onnx onnxscript)" in capsys.readouterr().out


def test_a_torch_without_the_export_based_onnx_exporter_writes_torchscript_and_says_why(tmp_path, monkeypatch,
                                                                                          capsys):
    # torch 2.4's torch.onnx.export, the TorchScript exporter alone (its parameters, in its order): requirements.txt
    # allows 2.4, and the call with dynamic_shapes and external_data was a TypeError after the TorchScript was written
    def export_of_torch_2_4(model, args, f=None, export_params=True, verbose=False, training=None, input_names=None,
                            output_names=None, operator_export_type=None, opset_version=None,
                            do_constant_folding=True, dynamic_axes=None, keep_initializers_as_inputs=None,
                            custom_opsets=None, export_modules_as_functions=False, autograd_inlining=True,
                            dynamo=False):
        raise AssertionError("an exporter without the options export() passes was called")

    path = checkpoint(tmp_path, "cartpole")
    monkeypatch.setattr(torch.onnx, "export", export_of_torch_2_4)
    written = export.export(path, str(tmp_path / "exported"))
    assert list(written) == ["torchscript", "torch.export"] and all(map(os.path.isfile, written.values()))
    assert not glob.glob(str(tmp_path / "exported" / "*.onnx"))
    assert (f"ONNX skipped, torch {torch.__version__}'s torch.onnx.export has no dynamic_shapes, external_data "
            f"(torch 2.5 or later)") in capsys.readouterr().out


def test_bad_checkpoint_path_is_one_line_and_status_2(tmp_path):
    not_a_checkpoint = tmp_path / "notes.txt"
    not_a_checkpoint.write_text("hello")
    for path, message in ((tmp_path / "missing.pt", "no such checkpoint file"),
                          (tmp_path, "is a directory; pass a model_<iteration>.pt file inside it"),   # a run dir
                          (not_a_checkpoint, "is not a torch checkpoint (torch.save writes a zip archive")):
        result = run_python(["-m", "ppo.export", str(path)], cwd=REPO, timeout=120)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_the_script_path_exports_from_any_folder_like_the_module(tmp_path):
    """`python ppo/export.py CKPT`, the way one runs a forked file, failed with ModuleNotFoundError ('configs'):
    only `python -m ppo.export` from the repository root put the root on the import path. Run from another folder
    by path, it writes the same policy, acting like the checkpoint's actor."""
    path = small_checkpoint(tmp_path / "model_3.pt")
    result = run_python([os.path.join(REPO, "ppo", "export.py"), path, "--out", str(tmp_path / "out")],
                        cwd=str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr
    policy = torch.jit.load(str(tmp_path / "out" / "model_3.policy.pt"))
    obs = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    np.testing.assert_allclose(policy(torch.from_numpy(obs)).detach().numpy(), numpy_actions(path, obs), rtol=1e-5,
                               atol=1e-6)


def test_an_out_folder_that_refuses_writes_is_one_line_even_for_root(tmp_path):
    """os.access says yes to root where writing fails (/proc here; an NFS mount that squashes root): the export
    passed that check and died in torch.jit.save with a RuntimeError traceback, status 1."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    result = run_python(["-m", "ppo.export", path, "--out", "/proc"], cwd=REPO, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: --out '/proc' is not writable (") and result.stderr.count("\n") == 1


def test_a_read_only_run_folder_names_itself_and_the_way_out_not_an_out_never_typed(tmp_path):
    """Exporting from a finished run kept read-only (no --out): the error said `--out '<run dir>' is not writable`."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = small_checkpoint(run_dir / "model_3.pt", False)
    with read_only_folder(run_dir):
        result = run_python(["-m", "ppo.export", path], cwd=REPO, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: the checkpoint's folder {str(run_dir)!r} (the default --out) is not "
                                    f"writable (") and "; pass --out with a folder you can write to" in result.stderr
    assert sorted(os.listdir(run_dir)) == ["model_3.pt"]


def test_a_checkpoint_written_on_a_gpu_resumes_and_exports_on_a_cpu_only_machine(tmp_path, monkeypatch):
    """A GPU rank's checkpoint holds CUDA tensors (torch.save tags each storage with its device, cuda:0 on rank 0):
    read as torch.load reads by default, it fails on a machine without CUDA. Every reader here maps it to the host
    (dist/checkpoint_read.py), then loads it into the run's device. Written here with the storages tagged cuda:0."""
    import torch.serialization
    tag = torch.serialization.location_tag
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    path = checkpoint(tmp_path, "cartpole")
    monkeypatch.setattr(torch.serialization, "location_tag", tag)
    # the file is a GPU one, as far as torch can tell (torch 2.4's weights_only reader says so as an UnpicklingError)
    with pytest.raises((RuntimeError, pickle.UnpicklingError), match="on a CUDA device but torch.cuda.is_available"):
        torch.load(path, weights_only=True)
    written = export.export(path, str(tmp_path / "exported"))
    assert torch.jit.load(written["torchscript"])(torch.zeros(1, 4)).shape == (1, 1)
    cfg = preset("cartpole")
    cfg.ppo.num_steps, cfg.ppo.num_mini_batches, cfg.env.num_envs = 64, 4, 8
    cfg.log.root, cfg.log.print_every, cfg.resume, cfg.max_iterations = str(tmp_path / "resumed"), 100, path, 2
    model, scalars, _ = train.main(cfg)
    assert "Policy/kl" in scalars and next(model.parameters()).device == torch.device("cpu")


def test_a_checkpoint_whose_weights_do_not_fit_its_policy_config_is_one_line(tmp_path):
    """Sizes come from the weights, the hidden layers from the config: a checkpoint whose config names other hidden
    sizes than its weights have (edited, or from another version) fails load_state_dict, said as one ValueError."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    state = torch.load(path, weights_only=True)
    state["config"]["policy"]["actor_hidden"] = [16, 16]           # the weights are 8 -> 8
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"its model or policy config does not fit this version's actor-critic .*"
                                         r"RuntimeError: .*size mismatch"):
        export.export(path, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_a_config_without_env_settings_exports_with_nothing_to_note(tmp_path, capsys, torchscript_only):
    """A config with no 'env' section (the env's settings are optional to export) means scale 1 and no clip: the
    policy is written and no note about actions printed.
    Mutant: `config["env"]` for `config.get("env", {})`."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    state = torch.load(path, weights_only=True)
    del state["config"]["env"]
    torch.save(state, path)
    written = export.export(path, str(tmp_path / "out"))
    assert written == {"torchscript": str(tmp_path / "out" / "model_3.policy.pt"),
                       "torch.export": str(tmp_path / "out" / "model_3.policy.pt2")}
    assert "note:" not in capsys.readouterr().out


def test_each_file_written_is_printed_with_its_format(tmp_path, capsys, torchscript_only):
    """After the summary line, one line per file: its format and where it went (what a user copies to the robot).
    Mutant: the loop printing `[export] {fmt}: {file}` left out."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    export.export(path, str(tmp_path / "out"))
    out = capsys.readouterr().out
    assert (f"[export] torchscript: {tmp_path}/out/model_3.policy.pt\n"
            f"[export] torch.export: {tmp_path}/out/model_3.policy.pt2\n") in out


def test_the_onnx_exporter_is_quiet_while_it_runs_and_its_log_level_given_back(tmp_path, monkeypatch):
    """The export sets the ONNX exporter's registration logger to ERROR while torch.onnx.export runs (it logs each
    torchvision operator it skips: not installed here, so the level is read inside the call), then restores the
    level it found: a program that exports and then debugs the exporter gets its own setting back.
    Mutant: `registration.setLevel(logging.ERROR)` left out; the `finally` without `registration.setLevel(level)`."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    real, seen = torch.onnx.export, []

    @functools.wraps(real)          # its signature too: onnx_missing reads the exporter's parameters
    def watched(*args, **kwargs):
        seen.append(registration.level)
        return real(*args, **kwargs)
    monkeypatch.setattr(torch.onnx, "export", watched)
    before = registration.level
    registration.setLevel(logging.DEBUG)
    try:
        written = export.export(small_checkpoint(tmp_path / "model_3.pt", False), str(tmp_path / "out"))
        assert "onnx" in written and seen == [logging.ERROR] and registration.level == logging.DEBUG
    finally:
        registration.setLevel(before)


def test_the_exporter_s_pytree_deprecation_warning_is_not_passed_on(tmp_path):
    """torch.onnx.export warns (FutureWarning) about torch's own pytree internals (LeafSpec), which no user can act
    on: the export filters it even where every warning is shown.
    Mutant: the LeafSpec filter left out."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        written = export.export(path, str(tmp_path / "out"))
    assert "onnx" in written
    assert [str(w.message) for w in shown if "LeafSpec" in str(w.message)] == []


@pytest.mark.parametrize("absent, said", [({"onnx"}, "onnx"), ({"onnx", "onnxscript"}, "onnx, onnxscript")])
def test_onnx_missing_names_each_package_not_installed(monkeypatch, absent, said):
    """ONNX needs both onnx and onnxscript: either one absent is said by name, with the pip line.
    Mutant: only onnxscript looked for."""
    real = export.importlib.util.find_spec
    monkeypatch.setattr(export.importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a))
    assert export.onnx_missing() == f"not installed: {said} (pip install onnx onnxscript)"


def test_an_exporter_without_the_dynamo_option_is_not_called(monkeypatch):
    """export() passes dynamo=True: a torch.onnx.export without that parameter (nor the other two) is named as
    lacking each of the three, in the order export() passes them.
    Mutant: "dynamo" left out of EXPORTER_OPTIONS."""
    def old_exporter(model, args, f=None, export_params=True, verbose=False, input_names=None, output_names=None):
        raise AssertionError("called")
    monkeypatch.setattr(torch.onnx, "export", old_exporter)
    assert export.onnx_missing() == (f"torch {torch.__version__}'s torch.onnx.export has no dynamo, dynamic_shapes, "
                                     f"external_data (torch 2.5 or later)")


def small_checkpoint(path, normalize_actor_obs: bool = True, env: dict | None = None) -> str:
    """A checkpoint with the entries export reads: actor 5 -> 8 -> 8 -> 3 (ELU), critic 6 -> 8 -> 1."""
    torch.manual_seed(0)
    cfg = PolicyConfig(actor_hidden=(8, 8), critic_hidden=(8,), normalize_actor_obs=normalize_actor_obs)
    model = build_actor_critic(cfg, {"policy": 5, "critic": 6}, 3)
    if normalize_actor_obs:
        model.actor_normalizer.mean.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0, 100.0]))
        model.actor_normalizer.std.copy_(torch.tensor([2.0, 0.5, 1.0, 1e-3, 10.0]))
    torch.save({"model": model.state_dict(), "config": {"policy": dataclasses.asdict(cfg), "env": env or {}}}, path)
    return str(path)


def numpy_actions(path: str, obs: np.ndarray) -> np.ndarray:
    """The mean action by hand in float64 (tests/test_tools.py), from the checkpoint at `path`."""
    state = torch.load(path, weights_only=True)["model"]
    return numpy_actions_of_state(state, obs, "actor_normalizer.mean" in state)


@pytest.fixture
def torchscript_only(monkeypatch):
    """Skip the ONNX file (seconds per export) in tests about other things than the ONNX graph."""
    monkeypatch.setattr(export, "onnx_missing", lambda: "not installed: onnx (left out by this test)")


@pytest.mark.filterwarnings("ignore:overflow encountered in expm1:RuntimeWarning")
def test_onnx_graph_reads_obs_writes_actions_for_any_batch(tmp_path):
    """A deployment feeds `obs` and fetches `actions` by name, with its own batch size (not the export's 1)."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    path = small_checkpoint(tmp_path / "model_3.pt")
    written = export.export(path, str(tmp_path / "out"))
    graph = onnx.load(written["onnx"])
    assert [i.name for i in graph.graph.input] == ["obs"] and [o.name for o in graph.graph.output] == ["actions"]
    (batch, obs_dim) = graph.graph.input[0].type.tensor_type.shape.dim
    assert batch.dim_param and not batch.HasField("dim_value") and obs_dim.dim_value == 5
    (batch_out, actions_dim) = graph.graph.output[0].type.tensor_type.shape.dim
    assert batch_out.dim_param and actions_dim.dim_value == 3
    obs = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32) * 30.0
    (actions,) = ReferenceEvaluator(graph).run(["actions"], {"obs": obs})
    assert actions.shape == (7, 3) and actions.dtype == np.float32
    np.testing.assert_allclose(actions, numpy_actions(path, obs), rtol=1e-4, atol=1e-5)


def test_without_out_the_files_go_next_to_the_checkpoint(tmp_path, monkeypatch, torchscript_only):
    """Not into the working directory: also from the command line, whose --out defaults to the same folder."""
    run_dir, elsewhere = tmp_path / "runs" / "cartpole" / "2026", tmp_path / "elsewhere"
    run_dir.mkdir(parents=True)
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = small_checkpoint(run_dir / "model_3.pt")
    written = export.export(path)
    assert written["torchscript"] == str(run_dir / "model_3.policy.pt")
    assert os.listdir(elsewhere) == []
    os.remove(written["torchscript"])
    monkeypatch.setattr(sys, "argv", ["ppo.export", path])
    export.main()
    assert os.path.isfile(run_dir / "model_3.policy.pt") and os.listdir(elsewhere) == []


def test_an_unwritable_out_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    # The tests run as root, for whom every folder is writable: the write probe is refused here instead.
    from dist import log_root as write_check       # dist.log_root.write_refusal, export's probe
    path = small_checkpoint(tmp_path / "model_3.pt")
    out = tmp_path / "read-only"
    out.mkdir()
    real_mkdtemp = write_check.tempfile.mkdtemp

    def mkdtemp(prefix, dir):
        if os.path.samefile(dir, out):
            raise PermissionError(13, "Permission denied")
        return real_mkdtemp(prefix=prefix, dir=dir)
    monkeypatch.setattr(write_check.tempfile, "mkdtemp", mkdtemp)
    with pytest.raises(ValueError, match=r"--out .*read-only.* is not writable"):
        export.export(path, str(out))
    assert os.listdir(out) == []


@pytest.mark.parametrize("state", [{"model": {}}, {"config": {}}, [1, 2]])
def test_a_checkpoint_without_model_or_config_is_a_one_line_error(tmp_path, state):
    path = tmp_path / "model_1.pt"
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"is not a train.py checkpoint \(it needs 'model' and 'config' entries\)"):
        export.export(str(path), str(tmp_path / "out"))


@pytest.mark.parametrize("normalized, words", [(True, "with"), (False, "no")])
def test_summary_line_names_sizes_and_the_normalizer(tmp_path, capsys, torchscript_only, normalized, words):
    path = small_checkpoint(tmp_path / "model_3.pt", normalized)
    export.export(path, str(tmp_path / "out"))
    out = capsys.readouterr().out
    assert f"[export] {path}: obs dim 5 -> 3 actions ({words} observation normalizer)\n" in out


@pytest.mark.parametrize("env, note", [
    ({}, None),
    ({"action_scale": 1.0, "action_clip": None}, None),
    ({"action_scale": 0.5}, "scaled them by 0.5"),                               # was "... clipped them to None"
    ({"action_scale": 1.0, "action_clip": 2.0}, "clipped them to [-2.0, 2.0]"),
    ({"action_scale": 0.25, "action_clip": 3.0}, "scaled them by 0.25, then clipped them to [-3.0, 3.0]"),
    ({"name": "gymnasium", "action_scale": 2.0}, "scaled them by 2.0, then clipped them to the action space's bounds"),
    ({"name": "gymnasium"}, "clipped them to the action space's bounds"),      # always: envs/gymnasium.py
])
def test_export_notes_what_the_run_did_to_actions_before_the_simulator(tmp_path, capsys, torchscript_only, env,
                                                                       note):
    path = small_checkpoint(tmp_path / "model_3.pt", env=env)
    export.export(path, str(tmp_path / "out"))
    out = capsys.readouterr().out
    if note is None:
        assert "note:" not in out
    else:
        assert (f"[export] note: before the simulator, the run {note}; the exported policy outputs actions without "
                f"that") in out
