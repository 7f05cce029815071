"""Checkpoints: rank 0 writes atomically (tmp file + rename); every rank reads the same file.

A checkpoint is a dict with FORMAT, the model/optimizer state, the iteration, LR, the env's
sampler state, the config, and every rank's RNG states (gathered once at save time).
"""

import os

import torch

FORMAT = "syncppo-checkpoint-v1"
REQUIRED_KEYS = ("format", "model", "optimizer", "iteration", "learning_rate", "env", "config", "rng")


def check_checkpoint_path(path: str) -> None:
    """Fail early (before any env is built) when --resume does not point at a readable checkpoint file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--resume {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"--resume {path!r} is a directory; pass a model_<iteration>.pt file inside it")
    load_checkpoint(path)


def load_checkpoint(path: str, map_location="cpu") -> dict:
    """Load and validate a checkpoint; a file that is not one of ours raises naming what is wrong."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"--resume {path!r} is not a readable torch checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"--resume {path!r} is not a syncppo checkpoint (expected format {FORMAT!r})")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"--resume {path!r} is missing {missing}; the file is truncated or from another tool")
    return state


def save_checkpoint(path: str, state: dict) -> None:
    """Write `state` to `path` atomically: a crash mid-write never leaves a half-written checkpoint."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save({"format": FORMAT, **state}, tmp)
    os.replace(tmp, path)
