"""Stopping together: a signal or a dead launcher on any rank stops every rank at the same iteration.

Signals and the launcher check are per process; the agreement costs no collective of its own: the
runner adds `local_flags()` to the metrics it already all-reduces once per iteration, and every rank
reads the same summed flags back.

- SIGINT (Ctrl-C) or SIGTERM: finish the iteration, stop, rank 0 writes a checkpoint.
- A second Ctrl-C raises SecondInterrupt (a KeyboardInterrupt) at once: a SIGTERM after a SIGINT, or a SIGINT more
  than a second after the first. (Where torchrun starts each rank in its own session, as torch 2.13 does, only
  torchrun gets the terminal's Ctrl-C: it forwards the first as SIGINT and answers the second with SIGTERM. Where
  the ranks share the terminal's process group, torchrun forwards the terminal's Ctrl-C to ranks that already got
  it: that duplicate SIGINT, within the second, is not a second request.)
- The launcher (torchrun) gone, i.e. this process re-parented: stop without writing anything, since
  no launcher is left to restart or collect the job.
"""

import os
import signal
import time

import torch

STOP_KEYS = ("Control/stop_signal", "Control/launcher_gone")


class SecondInterrupt(KeyboardInterrupt):
    """The Ctrl-C that does not wait for the iteration to end (a plain KeyboardInterrupt is one that came before
    the handlers were installed, or after they were restored)."""


class StopRequests:
    def __init__(self, watch_launcher: bool):
        self.signal_name: str | None = None
        self._first_sigint = None
        self._launcher_pid = os.getppid() if watch_launcher else None
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first_sigint is not None and (signum == signal.SIGTERM or now - self._first_sigint > 1.0):
            raise SecondInterrupt
        if signum == signal.SIGINT:
            self._first_sigint = self._first_sigint or now
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def launcher_gone(self) -> bool:
        return self._launcher_pid is not None and os.getppid() != self._launcher_pid

    def gone_message(self, iteration: int) -> str:
        """Why the ranks stop when some rank's launcher died. Read after the all-reduce that carried the flag, so a
        rank whose own launcher is gone sees it here too: one that does not is on another node than the dead one."""
        whose = "the launcher (torchrun) is gone" if self.launcher_gone() else \
            "another node's launcher (torchrun) is gone (this node's is alive: that node's machine or agent died)"
        return f"{whose}: stopped after iteration {iteration} without saving; the last periodic checkpoint is kept"

    def local_flags(self, device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(sum, count) pairs for the metrics all-reduce: the summed sum is how many ranks raised each flag."""
        one = torch.ones((), device=device)
        return {"Control/stop_signal": (one * (self.signal_name is not None), one),
                "Control/launcher_gone": (one * self.launcher_gone(), one)}

    @staticmethod
    def restore_default_handlers() -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
