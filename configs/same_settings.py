"""The same settings and the same code on every rank of one run, checked at start-up: a node launched with other
flags trained on silently (another env count) or aborted in gloo (another preset), and a node holding another version
of syncppo trained on or aborted at the first collective whose sizes its code changed. dist.checkpoint's
agree_on_checkpoint all-gathers settings_digest; differing_settings says what differs."""

import glob
import json
import os

import torch

from configs.resume import settings
from dist import comm
from dist.checksum import checksum
from dist.verify import differing_tensors

# What may differ between nodes: each reads its own files (--log.root, --resume: checked as the checkpoint loaded) and
# runs its own simulator launch; everything else decides what every rank computes or when it communicates.
PER_NODE = {"--log.root", "--resume", "--env.launcher-args", "--dist.timeout-s"}


def shared_settings(cfg) -> list[tuple[str, str]]:
    """(flag, repr of its value) of every setting but PER_NODE's: what every rank of one run must agree on."""
    return [(flag, repr(getattr(owner, field.name))) for flag, owner, field, _ in settings(cfg) if flag not in PER_NODE]


def settings_digest(cfg) -> int:
    """A checksum of shared_settings and the code (source_digest): equal on every rank (dist.checkpoint compares)."""
    text = json.dumps(shared_settings(cfg) + [source_digest()])
    return int(checksum([torch.tensor(list(text.encode()), dtype=torch.uint8)]))


def differing_settings(cfg) -> str:
    """Which settings differ from rank 0's, for the error once settings_digest found that some do: syncppo's code,
    else the flags by name. Crosses ranks on that failure path only: an all-gather of one int64 per rank (the code's
    checksum), then, where every rank runs the same code (so the same flags, in order), of one int64 per flag."""
    code = comm.all_gather(torch.tensor([source_digest()]).to(comm.device()), "resume").flatten().tolist()
    if any(c != code[0] for c in code):
        return f"syncppo's .py files differ on rank(s) {[rank for rank, c in enumerate(code) if c != code[0]]}"
    values = [(flag, torch.tensor(list(value.encode()), dtype=torch.uint8)) for flag, value in shared_settings(cfg)]
    return f"{', '.join(differing_tensors(values, 'resume'))} differ"


def source_digest(root: str = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) -> int:
    """A checksum of the code a run executes: every .py file at `root` and one folder down (tests/ and bench/
    excepted), by relative path and content. A node holding another version of syncppo (a copy not updated) would
    otherwise train on, or abort at the first collective whose sizes its code changed."""
    paths = sorted(p for p in glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "*", "*.py"))
                   if os.path.relpath(p, root).split(os.sep)[0] not in ("tests", "bench"))
    data = b"".join(os.path.relpath(p, root).encode() + b"\0" + _read(p) + b"\0" for p in paths)
    return int(checksum([torch.frombuffer(bytearray(data), dtype=torch.uint8)]))


def _read(path: str) -> bytes:
    """The file's bytes; for one that cannot be read (a dangling link, no permission: a file the run cannot import
    either, or one it never imports), why, so that start-up does not fail on it and ranks still compare it."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        return f"unreadable ({type(exc).__name__})".encode()
