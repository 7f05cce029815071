"""Export a checkpoint's policy to run without this repository (on a robot, in a C++ stack): the
deterministic actor (the action mean) with its observation normalizer folded in, so it takes raw
observations. Writes TorchScript (loadable by libtorch), a `torch.export` program (torch 2.13 deprecates
TorchScript in its favour) and, when the `onnx` and `onnxscript` packages are installed, ONNX.

    make export CKPT=runs/mujoco/2026-01-01_12-00-00/model_488.pt
    python -m ppo.export runs/mujoco/.../model_488.pt --out exported/     # or: python ppo/export.py ...

Output: DIR/STEM.policy.pt, DIR/STEM.policy.pt2 and DIR/STEM.policy.onnx (DIR defaults to the checkpoint's
folder), mapping `obs` [batch, actor obs dim] float32 to `actions` [batch, actions] float32, any batch size.
The actions are the policy's, before the env adapter's --env.action-scale / --env.action-clip (and
gymnasium's clip to the action space), which the deployment applies as the simulator did; the export
prints them when they are set. It cannot print what an env does to actions itself (cartpole clamps to [-1, 1]
before scaling by its force; a robot's env may clamp to joint limits): the deployment repeats that too.
"""

import argparse
import copy
import glob
import importlib.util
import inspect
import logging
import os
import sys
import warnings

import torch
from torch import nn

if __name__ == "__main__" and not __package__:  # `python ppo/export.py`: import from the repository, as -m does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs.config import PolicyConfig  # noqa: E402
from dist.log_root import dangling_link, undecodable, write_refusal  # noqa: E402
from dist.checkpoint_read import read_checkpoint  # noqa: E402
from dist.errors import one_line  # noqa: E402
from ppo.actor_critic import ActorCritic, build_actor_critic  # noqa: E402
from ppo.normalizer import ObsNormalizer  # noqa: E402


class DeterministicActor(nn.Module):
    """obs -> clamp((obs - mean) / (std + eps), -clip, clip) -> actor MLP: the mean action. Without an actor
    normalizer, mean 0, divisor 1 and clip inf leave the observation exactly as it is."""

    def __init__(self, model: ActorCritic):
        super().__init__()
        self.actor = copy.deepcopy(model.actor)
        norm = model.actor_normalizer
        dim = self.actor[0].in_features
        normalized = isinstance(norm, ObsNormalizer)
        # The same float32 values the training forward pass computes, so actions match bit for bit.
        self.register_buffer("obs_mean", norm.mean.clone() if normalized else torch.zeros(dim))
        self.register_buffer("obs_divisor", norm.std + norm.eps if normalized else torch.ones(dim))
        self.obs_clip = float(norm.clip) if normalized else float("inf")

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor(((obs - self.obs_mean) / self.obs_divisor).clamp(-self.obs_clip, self.obs_clip))


def check_same_actions(policy: DeterministicActor, model: ActorCritic, path: str) -> None:
    """Refuse an export whose actor does not give the model's mean action, `model.distribution(obs).mean`, on a few
    observations: DeterministicActor copies only the actor normalizer and `model.actor`, so a forked ActorCritic
    whose `distribution` computes more (an encoder before the MLP, ...) would otherwise export other actions."""
    obs = torch.randn(8, policy.actor[0].in_features, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        mine, theirs = policy(obs), model.distribution(obs).mean
    if mine.shape != theirs.shape or not torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6):
        gap = (mine - theirs).abs().max().item() if mine.shape == theirs.shape else f"shape {tuple(mine.shape)}"
        raise ValueError(f"CKPT {path!r}: the exported actor (the actor normalizer, then model.actor) does not give "
                         f"the model's mean action, ActorCritic.distribution(obs).mean (largest difference {gap}): "
                         f"make ppo/export.py's DeterministicActor compute what distribution() does")


# The model entries load_policy reads the sizes from, as the ActorCritic of ppo/actor_critic.py names them.
SIZES_FROM = {"actor.0.weight": "the actor's observation size", "critic.0.weight": "the critic's observation size",
              "log_std": "the number of actions"}


def load_policy(path: str) -> tuple[ActorCritic, dict]:
    """The checkpoint's actor-critic (on the CPU, eval mode) and its run config (a dict). The file passes the checks
    of a --resume (dist.checkpoint_read.read_checkpoint: CRC-32s, no nan or inf in what it holds), except that only
    'model' and 'config' entries are needed."""
    model, state = policy_and_entries(path)
    return model, state["config"]


def policy_and_entries(path: str, use: str = "export") -> tuple[ActorCritic, dict]:
    """load_policy's model, and every entry of the checkpoint (ppo/evaluate.py also reads `env_seed`); `use` is what
    a refusal says to do with another checkpoint ("export", "evaluate")."""
    def usable(state) -> None:
        if not isinstance(state, dict) or "model" not in state or "config" not in state:
            raise ValueError(f"CKPT {path!r} is not a train.py checkpoint (it needs 'model' and 'config' entries)")
    state = read_checkpoint(path, "CKPT", use, usable)
    config, weights = state["config"], state["model"]
    missing = [name for name in SIZES_FROM if name not in weights] if isinstance(weights, dict) else []
    if missing:        # the CRCs passed: not damage, but another actor-critic (a std computed another way, say)
        it, sizes = "them" if missing[1:] else "it", " and ".join(SIZES_FROM[name] for name in missing)
        raise ValueError(f"CKPT {path!r}: its model has no {' or '.join(map(repr, missing))} (export reads {sizes} "
                         f"from {it}, as the ActorCritic of ppo/actor_critic.py has {it}; an actor-critic forked "
                         f"without {it} needs ppo/export.py's load_policy changed to read its sizes another way)")
    if isinstance(config, dict) and "policy" not in config:
        raise ValueError(f"CKPT {path!r}: its config has no 'policy' entry (the settings export builds the "
                         f"actor-critic from: saved by another version?)")
    try:
        policy_cfg = PolicyConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in config["policy"].items()})
        # Sizes come from the weights: the first layer of each MLP reads the observation, the actor's last writes
        # actions.
        obs_dims = {"policy": weights["actor.0.weight"].shape[1], "critic": weights["critic.0.weight"].shape[1]}
        model = build_actor_critic(policy_cfg, obs_dims, weights["log_std"].shape[0])
        model.load_state_dict(weights)
    except (KeyError, TypeError, AttributeError, IndexError, RuntimeError) as exc:
        raise ValueError(f"CKPT {path!r}: its model or policy config does not fit this version's actor-critic "
                         f"(damaged, or saved by another version?): {type(exc).__name__}: "
                         f"{one_line(exc)}") from None
    return model.eval(), state


FLOAT32 = torch.finfo(torch.float32)


def deployment(config: dict, path: str) -> tuple[float, float | None, str | None]:
    """(--env.action-scale, --env.action-clip, --env.name) of the checkpoint's run: what the export's note tells a
    deployment to do to the actions, so checked before anything is written."""
    env = config.get("env", {})
    if not isinstance(env, dict):
        raise ValueError(f"CKPT {path!r}: its config's 'env' is a {type(env).__name__}, not a dict (damaged?)")
    scale, clip = env.get("action_scale", 1.0), env.get("action_clip")

    def takes(x) -> bool:  # training's rule (configs/config.py): positive, and neither 0 nor inf in float32
        return isinstance(x, (int, float)) and not isinstance(x, bool) and FLOAT32.tiny <= x <= FLOAT32.max
    if not takes(scale) or not (clip is None or takes(clip)):
        raise ValueError(f"CKPT {path!r}: its config's action scale {scale!r} or clip {clip!r} is not one a run takes "
                         f"(a positive scale, a positive clip or None, each in [{FLOAT32.tiny:.1e}, "
                         f"{FLOAT32.max:.1e}]): damaged?")
    return scale, clip, env.get("name")


# The torch.export-based exporter's options export() passes: torch 2.4, inside requirements.txt's range, has the
# TorchScript exporter alone (no dynamic_shapes, no external_data), and would fail the call with a TypeError.
EXPORTER_OPTIONS = ("dynamo", "dynamic_shapes", "external_data")


def onnx_missing() -> str:
    """Why ONNX cannot be written here ("" when it can)."""
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (pip install onnx onnxscript)"
    for name in ("onnx", "onnxscript"):
        try:   # installed but broken (e.g. ml_dtypes built for numpy 2 under numpy 1): the exporter would raise this
            importlib.import_module(name)
        except Exception as exc:
            return (f"installed but {name} fails to import ({type(exc).__name__}: {one_line(exc)}); reinstall it in "
                    f"this environment: pip install --force-reinstall onnx onnxscript")
    lacking = [name for name in EXPORTER_OPTIONS if name not in inspect.signature(torch.onnx.export).parameters]
    return f"torch {torch.__version__}'s torch.onnx.export has no {', '.join(lacking)} (torch 2.5 or later)" \
        if lacking else ""


def check_ckpt_path(path: str) -> None:
    """Refuse a CKPT that is not a file to read (a folder, a pattern make passed unexpanded, a pipe), naming it."""
    if os.path.isdir(path):
        raise ValueError(f"CKPT {path!r} is a directory; pass a model_<iteration>.pt file inside it")
    if path.endswith(os.sep) and os.path.isfile(path.rstrip(os.sep)):   # ENOTDIR: exists() says False
        raise ValueError(f"CKPT {path!r} ends in a slash, but {path.rstrip(os.sep)!r} is a file, not a folder; drop "
                         f"the trailing slash")
    if not os.path.exists(path):
        dangling = " (a symbolic link whose target does not exist)" if os.path.islink(path) else ""
        # make passes CKPT as typed, so `CKPT=runs/tracking/*/model_400.pt` arrives as a pattern
        matches = sorted(glob.glob(path)) if glob.has_magic(path) else []
        pattern = (f" (a pattern, not expanded: it matches {len(matches)} file(s), the last by name {matches[-1]!r}; "
                   "pass one file)") if matches else ""
        raise ValueError(f"CKPT {path!r}: no such checkpoint file{dangling}{pattern}")
    if not os.path.isfile(path):      # a device or a pipe: reading it could block or never end
        raise ValueError(f"CKPT {path!r} is not a regular file; pass a model_<iteration>.pt file")


def export(path: str, out_dir: str = "") -> dict[str, str]:
    """Write the TorchScript, torch.export (and, if possible, ONNX) policy of checkpoint `path`; return
    {format: file}."""
    check_ckpt_path(path)
    typed_out, out_dir = bool(out_dir), out_dir or os.path.dirname(os.path.abspath(path))
    where = f"--out {out_dir!r}" if typed_out else f"the checkpoint's folder {out_dir!r} (the default --out)"
    if undecodable(out_dir):   # torch's savers take no such str
        raise ValueError(f"{where} holds bytes that are not text in the file system's encoding; pass --out with a "
                         f"folder whose path is text")
    link = dangling_link(out_dir)
    if link is not None:     # makedirs would fail with a bare "File exists", the link being there but not its target
        at = "" if link == os.path.abspath(out_dir) else f": {link!r}"
        raise ValueError(f"{where}{at} is a symbolic link whose target does not exist (or that loops); create its "
                         f"target, or pass --out with another folder")
    model, config = load_policy(path)
    scale, clip, env_name = deployment(config, path)
    policy = DeterministicActor(model).eval().requires_grad_(False)   # deployed calls build no autograd graph
    check_same_actions(policy, model, path)                           # before anything is written
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:     # a file of that name, a read-only place: the user's error, not a traceback
        raise ValueError(f"{where} cannot be an output folder ({exc.strerror or type(exc).__name__})") from None
    refused = write_refusal(out_dir)
    if refused:
        raise ValueError(f"{where} is not writable ({refused}); pass --out with a folder you can write to")
    stem = os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0] + ".policy")
    taken = [stem + ext for ext in (".pt", ".pt2", ".onnx") if os.path.lexists(stem + ext)
             and (os.path.isdir(stem + ext) or not os.path.isfile(stem + ext))]
    if taken:       # checked before writing any: a half export would otherwise be left behind
        raise ValueError(f"{taken[0]!r} is a directory or not a regular file, where the export writes a file; move "
                         f"it, or pass --out with another folder")
    same = [stem + ext for ext in (".pt", ".pt2", ".onnx") if os.path.isfile(stem + ext)
            and os.path.samefile(stem + ext, path)]
    if same:        # a link to the checkpoint at an output's name: writing it would overwrite the checkpoint
        raise ValueError(f"{same[0]!r} is the checkpoint itself (a link to it), where the export writes a file; "
                         f"remove that link, or pass --out with another folder")
    # A batch of 2: torch.export specializes a dimension of size 1 to that size, which would refuse every other batch
    # (and torch 2.5's ONNX exporter then writes a graph for batch 1 alone).
    example = torch.zeros(2, policy.actor[0].in_features)
    written = {}
    with warnings.catch_warnings():
        # TorchScript is deprecated in favour of torch.export, but it is what libtorch (C++) loads today.
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=DeprecationWarning)
        torch.jit.script(policy).save(stem + ".pt")
    written["torchscript"] = stem + ".pt"
    # torch.export.load(file).module() runs it.
    program = torch.export.export(policy, (example,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, stem + ".pt2")
    written["torch.export"] = stem + ".pt2"
    if not onnx_missing():
        # The exporter logs every torchvision operator it skips and warns about torch's own pytree internals:
        # nothing a user can act on.
        registration = logging.getLogger("torch.onnx._internal.exporter._registration")
        level = registration.level
        registration.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
                torch.onnx.export(policy, (example,), stem + ".onnx", input_names=["obs"], output_names=["actions"],
                                  dynamic_shapes=({0: torch.export.Dim("batch")},), dynamo=True, external_data=False,
                                  verbose=False)
        finally:
            registration.setLevel(level)
        written["onnx"] = stem + ".onnx"
    print(f"[export] {path}: obs dim {example.shape[1]} -> {policy.actor[-1].out_features} actions "
          f"({'with' if policy.obs_clip != float('inf') else 'no'} observation normalizer)")
    for fmt, file in written.items():
        print(f"[export] {fmt}: {file}")
    if "onnx" not in written:
        print(f"[export] ONNX skipped, {onnx_missing()}")
    steps = ([f"scaled them by {scale}"] if scale != 1.0 else []) + \
        ([f"clipped them to [-{clip}, {clip}]"] if clip is not None else []) + \
        (["clipped them to the action space's bounds"] if env_name == "gymnasium" else [])
    if steps:       # what envs/ did to the actions in training: a deployment must do the same
        print(f"[export] note: before the simulator, the run {', then '.join(steps)}; the exported policy outputs "
              f"actions without that")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt", help="a checkpoint written by train.py (model_<iteration>.pt)")
    parser.add_argument("--out", default=None, help="output folder (default: the checkpoint's folder)")
    args = parser.parse_args()
    if args.out is not None and not args.out:      # else '' is the default: the checkpoint's folder, not the typed one
        parser.exit(2, "error: --out is empty; pass a folder ('.' for the current one), or leave --out out to write "
                       "beside the checkpoint\n")
    try:
        export(args.ckpt, args.out or "")
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")


if __name__ == "__main__":
    main()
