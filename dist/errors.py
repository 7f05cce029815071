"""The two kinds of error the runner reports as one line instead of a traceback.

- `UsageError`: the user asked for something that cannot work (a flag, a path, a checkpoint that does
  not fit, a model's BUFFER_POLICY: dist/buffers.py). The runner prints `error: <message>` once and exits with
  status 2, like a parse error.
- `RunError`: training started and then met a condition outside the code (a write error, a
  non-finite observation, the launcher gone). The rank that met it prints one line and exits 1.

Anything else is a bug: the runner prints its traceback, then one line, and exits 1; except an allocation the device
could not serve (`out_of_memory`), said as such, since the way out is a smaller size.
"""

import contextlib
import json
import os
import time

import torch


class UsageError(ValueError):
    """Bad input; the message starts with the flag to fix. `say_here`: whether this rank prints it; None for
    an error every rank meets alike (said once per node), True or False where only some ranks can meet it
    (a rollout rank's env, which no learner builds)."""

    def __init__(self, message: str, say_here: bool | None = None):
        super().__init__(message)
        self.say_here = say_here


class RunError(RuntimeError):
    """A run-time failure with a message that says what happened and what was kept."""


def one_line(exc: BaseException) -> str:
    """`exc`'s message on one line. Not its first line: load_state_dict's is only the header ("Error(s) in loading
    state_dict for ActorCritic:"), and the tensor that does not fit is on the tab-indented lines after it."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def first_line(exc: BaseException) -> str:
    """`exc`'s first non-blank line, or its type's name when it has none: what a one-line report of a failure shows
    where the rest of the message is a traceback's or a backend's detail."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def tell_torchrun(message: str, after_peer: bool = False) -> None:
    """Write this rank's error where torchrun's failure summary reads its root cause (else `error_file: <N/A>`).

    torchrun names the failure with the smallest timestamp, in whole seconds, and a tie goes to whichever failed rank
    it recorded first: often one that only saw its peer die. `after_peer` (this rank failed because a peer died or
    stalled) dates the error one second later, so that the peer's own failure in the same second is the root cause.

    Written aside, then renamed into place: torchrun reads the file of every failed rank, and a rank it kills while
    writing (its SIGTERM after a peer failed: default handlers once a run failed) left it empty, which torchrun
    cannot parse: it crashed with a JSONDecodeError traceback instead of printing its failure summary."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        partial = f"{path}.{os.getpid()}.partial"
        with contextlib.suppress(OSError):
            with open(partial, "w") as f:
                json.dump({"message": message, "timestamp": int(time.time()) + after_peer}, f)
            os.replace(partial, path)


def out_of_memory(exc: BaseException) -> bool:
    """An allocation the device could not serve: CUDA's OutOfMemoryError, Python's MemoryError, or the RuntimeError
    of torch's CPU allocator or of a size past 2**63 bytes (--env.num-envs 2**62): no type of their own, only words."""
    oom = (torch.cuda.OutOfMemoryError, MemoryError)    # torch.OutOfMemoryError is its newer name: not in every torch
    words = ("DefaultCPUAllocator: can't allocate", "Storage size calculation overflowed")
    return isinstance(exc, oom) or any(w in str(exc) for w in words)
