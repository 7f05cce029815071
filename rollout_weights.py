"""How rollout ranks get weights: pulled, one request per collection, answered by a thread on the learner.

Both ends of the protocol and its plan rows: `WeightServer` on the learner (one thread per rollout rank
answers its requests, so the learner's loop never waits for a rollout rank to take weights) and
`request_weights` on the rollout rank. Each request is (have, need): the version the rollout rank holds
and the oldest its staleness bound allows; the reply is the newest published version and, if newer than
`have`, one sync/ update straight from `have` to it (patch or bucket, see sync/), however many versions
were missed. docs/rollout_ranks.md has the whole iteration.
"""

import atexit
import dataclasses
import os
import sys
import threading
import traceback

import torch

from dist import comm
from dist.batches import naming
from dist.errors import RunError, tell_torchrun
from dist.plan import PlanRow
from sync import SyncIntegrityError, WeightSyncConfig, make_weight_syncer
from sync.wire import LINK_LOST, RESYNC_HINT


class WeightServer:
    """A learner's weights for its rollout ranks, served on request by one thread per rollout rank.

    The learner publishes each new version (a copy of its state dict; nothing crosses ranks). Before every
    collection a rollout rank asks for the newest version, at least `need` (its staleness bound), and gets
    it as one sync/ update from the version it holds, however many versions it missed; when it already holds
    the newest, a one-number reply says so. The learner never waits for a rollout rank to take weights (only,
    in publish, for an answer already being sent), and each rollout rank has its own sync/ sender (patch keeps
    one snapshot per receiver).
    """

    def __init__(self, sync: WeightSyncConfig, rank: int, rollouts: list[int], group, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s
        self.closing = False          # set at exit after a failure: the threads stop serving
        self.syncers = {dst: make_weight_syncer(sync, rank, [dst], group) for dst in rollouts}
        self.state, self.version = None, -1
        self.failures: dict[int, Exception] = {}     # by rollout rank, in the order they failed
        self.published = threading.Condition()
        self.threads = [threading.Thread(target=self.serve, args=(dst,), name=f"weights-to-rank-{dst}", daemon=True)
                        for dst in rollouts]

    def start(self, model, version: int) -> None:
        """Crosses ranks once per rollout rank: sync/'s init handshake, as version - 1 (the first request then
        carries the weights of `version`, whatever sync/ bootstraps: bucket mode sends no weights at init)."""
        for dst, syncer in self.syncers.items():
            with naming(dst):
                syncer.init_sender(model.state_dict(), None, version - 1)
        self.publish(model, version)
        for thread in self.threads:
            thread.start()
        # After a failure the learner exits without close(): a thread still blocked in a gloo receive that wakes
        # once the interpreter finalizes (its rollout rank exiting) aborts the process (status 134, "terminate
        # called without an active exception") instead of the one-line error and status 1.
        atexit.register(self.abandon)

    def publish(self, model, version: int) -> None:
        """Make `version` the one served (a copy, so the next update cannot change it mid-send)."""
        self.check()
        with self.published:
            if self.state is None:
                self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                for k, v in model.state_dict().items():
                    self.state[k].copy_(v)
            self.version = version
            self.published.notify_all()

    def serve(self, dst: int) -> None:
        """Crosses ranks per request of rollout rank `dst` (one before each collection, one for the final
        weights, one to say done): (have, need) in, the served version out, then sync/'s update if newer."""
        try:
            request = torch.empty(2, dtype=torch.int64)
            while True:
                with naming(dst):
                    have, need = comm.recv(request, "weight_request", dst, self.group).tolist()
                if need < 0:
                    return
                # The lock spans the whole answer: publish() must not overwrite the state mid-send, so it waits
                # for an answer in flight (the rollout rank is already receiving it).
                with self.published:
                    self.published.wait_for(lambda: self.closing or self.version >= need)
                    if self.closing:
                        return
                    with naming(dst):
                        comm.send(torch.tensor([self.version]), "weight_request", dst, self.group)
                        if self.version > have:
                            self.syncers[dst].sync(self.state, self.version)
        except Exception as exc:  # noqa: BLE001 - re-raised on the learner's main thread by check()
            if self.closing or not torch.distributed.is_initialized():
                return        # the learner already failed and tore the groups down; its error is already reported
            self.failures.setdefault(dst, exc)
            if isinstance(exc, comm.CollectiveError):
                # Its rollout rank died or stalled, or waits on the learner, itself stuck on another rollout rank
                # (this thread's receive of the next request then times out too): the main thread's wait for the
                # batch that did not come names the rank at fault, with this failure when it is that rank's
                # (check(dst)). A line from here as well was a second one for the same failure.
                return
            # Anything else (a bug): the rollout rank waits for these weights, and the main thread for its next
            # batch, in receives that nothing else ends before --dist.timeout-s. End the process now, as a failed
            # rank would be: the rollout rank then fails at once on the closed connection.
            traceback.print_exc()
            message = f"error: serving weights to rank {dst} failed: unexpected {type(exc).__name__}: {exc}"
            print(f"{message}\n", end="", file=sys.stderr, flush=True)
            tell_torchrun(message)
            sys.stdout.flush()
            os._exit(1)

    def check(self, dst: int | None = None) -> None:
        """Raise the failure of the thread serving rollout rank `dst` (default: the first thread that failed)."""
        failure = self.failures.get(dst) if dst is not None else next(iter(self.failures.values()), None)
        if failure is not None:
            raise failure

    def close(self) -> None:
        for thread in self.threads:
            thread.join()
        atexit.unregister(self.abandon)
        self.check()

    def abandon(self) -> None:
        """At exit without close() (the learner failed): stop serving and wait until every thread is out of its
        gloo receive, which ends once its rollout rank exits, or fails within the process group's timeout."""
        with self.published:
            self.closing = True
            self.published.notify_all()
        for thread in self.threads:
            thread.join(self.timeout_s + 5)

    def plan_rows(self) -> list[PlanRow]:
        rows = request_plan_rows("recv", "send", len(self.syncers))
        for syncer in self.syncers.values():
            rows += weight_plan_rows(syncer)
        return rows


def request_weights(syncer, copy, learner: int, group, have: int, need: int) -> int:
    """A rollout rank's request (see WeightServer.serve): the newest weights, at least version `need`. Crosses
    ranks: (have, need) up, the served version down, sync/'s update when it is newer than `have`. Returns the
    version now in `copy`; `need` < 0 says done (nothing comes back). Weights that fail sync/'s integrity checks
    raise RunError (integrity_failure)."""
    with naming(learner, "learner"):
        comm.send(torch.tensor([have, need]), "weight_request", learner, group)
        if need < 0:
            return have
        served = int(comm.recv(torch.empty(1, dtype=torch.int64), "weight_request", learner, group))
        if served <= have:
            return have
        try:
            version = syncer.apply(copy)
        except SyncIntegrityError as error:
            raise integrity_failure(error, f"the weights (version {served}) from learner rank {learner}") from error
    if version != served:
        raise RunError(f"the learner announced weights version {served} but sent version {version}")
    return version


def integrity_failure(error: SyncIntegrityError, what: str) -> RunError:
    """sync/'s integrity error as the one line a rollout rank ends with: nothing in the run recovers the weights
    (sync/'s resync() hint is for a caller that keeps going), a restart from the last checkpoint does."""
    reason = str(error).removesuffix(f"; {RESYNC_HINT}").removesuffix(f"; {LINK_LOST}")
    return RunError(f"{what} failed their integrity check: {reason}. A run-time failure, not a setting: torchrun "
                    f"--max-restarts restarts the job from its last checkpoint, or continue with --resume auto")


def request_plan_rows(out: str, back: str, peers: int) -> list[PlanRow]:
    """One request and reply per collection; at the end, one for the final weights and a last `done`."""
    return [PlanRow("weight_request", "ask for the newest weights (have, need)", out, "iteration", [16] * peers),
            PlanRow("weight_request", "the version served (an update follows if newer)", back, "iteration",
                    [8] * peers),
            PlanRow("weight_request", "ask for the final weights; done", out, "setup", [16, 16] * peers),
            PlanRow("weight_request", "the final version", back, "setup", [8] * peers)]


def weight_plan_rows(syncer) -> list[PlanRow]:
    """sync/'s rows, plus the one update after the last iteration that gives the copy the final weights. In
    async mode a rollout rank that misses versions gets fewer updates: the rows are then an upper bound."""
    rows = syncer.plan_rows()
    final = [dataclasses.replace(r, cadence="setup", rule="final weights") for r in rows if r.cadence == "iteration"]
    return rows + final
