"""What both strategies share: roles, the init handshake, strict key checks, the start check, whole tensors
in buckets (bucket syncs, the patch bootstrap, every resync), resync, the reader lock, the background
receive of a non-blocking apply, and the sync plan.

`Link` holds that state and offers it as plain methods (nothing to override); patch.py and bucket.py
each write their own init/sync/apply/resync on top of it, top to bottom.
"""

import threading
from concurrent.futures import Future
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from dist import comm
from dist.checksum import tensor_checksum
from dist.plan import PlanRow
from .config import WeightSyncConfig, check_config, is_int
from .handshake import describe, format_mismatch, named_dtype, receiver_problems, sender_problems, tensors_of
from .wire import (DENSE, FORMAT, JSON_HEAD_BYTES, KIND_RESYNC, RESYNC_HINT, SETUP, UPDATE, Frame, SyncIntegrityError,
                   SyncStats, UnexpectedKind, check_kind, lost_link, plan_buckets, recv_frame, recv_json, send_frame,
                   send_json)


class Link:
    def __init__(self, cfg: WeightSyncConfig, src: int, dsts: Sequence[int], group=None, device: str = "cpu"):
        """`src`, `dsts`: global ranks of the sender and receivers; `group`: their process group (None = WORLD).

        `device` is where messages are staged: cpu for gloo, cuda for NCCL (the current CUDA device, by index).
        Give the syncer its own group (dist.new_group) when the receiver runs collectives while apply receives.
        """
        check_config(cfg)
        if not is_int(src) or isinstance(dsts, (str, bytes)) or not isinstance(dsts, Sequence) or \
                not all(is_int(d) for d in dsts):
            raise TypeError(f"weight sync: src must be a rank and dsts a list of ranks, got src={src!r}, dsts={dsts!r}")
        self.cfg, self.src, self.dsts, self.group = cfg, src, tuple(dsts), group
        rank = dist.get_rank()
        if not self.dsts or src in self.dsts or len(set(self.dsts)) != len(self.dsts):
            raise ValueError(f"weight sync: need distinct receiver ranks other than the sender {src}, got {list(dsts)}")
        if rank != src and rank not in self.dsts:
            raise ValueError(f"weight sync: rank {rank} is neither the sender ({src}) nor a receiver ({list(dsts)})")
        ranks = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)  # else init waits for ever
        if src not in ranks or not set(self.dsts) <= set(ranks):
            raise ValueError(f"weight sync: src={src}, dsts={list(dsts)} name ranks outside the group's {ranks}")
        # By device: a group made without naming a backend is "undefined" to get_backend(), cuda:nccl alone on a GPU
        config = dist.get_backend_config(group)
        backend = dict(pair.split(":") for pair in config.split(",")).get(device, "no backend")
        if backend == "no backend" or (backend == "nccl") != (device == "cuda"):
            raise ValueError(f"weight sync: this process group sends {device} tensors with {backend} (its backends: "
                             f"{config}); use cpu with gloo and cuda with nccl")
        self.is_sender = rank == src
        # By index: a non-blocking apply receives in a thread, which starts on cuda:0 (CUDA's device is per thread)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
        self.version: Optional[int] = None  # None until init; then the version in place (receiver) or sent (sender)
        self.lock = threading.Lock()  # readers of the receiver's model hold it to never see a half-applied update
        self.stats: Optional[SyncStats] = None
        self.staging: list = []  # the receive buffer, made by the first frame and reused
        self._inflight: Optional[Future] = None
        self._broken: Optional[str] = None  # why the receiver refuses every update until resync()
        self.keys, self.synced, self._tie_of = [], [], {}  # set by init (_adopt); empty before, for require()

    # ----- init -----------------------------------------------------------------------------------------------

    def agree(self, tensors: dict, keys: Optional[Sequence[str]] = None, version: int = 0, problems=()) -> int:
        """The init handshake: each receiver sends its metadata; the sender checks it against its own state
        and replies; on a mismatch both sides raise the same error. Returns the starting version.

        Crosses ranks once at init: one JSON document from each receiver, one reply to each. Sender: `keys`
        are those every update carries (None = all), `problems` the strategy's own config errors.
        """
        mine = describe(tensors, self.cfg)
        if not self.is_sender:
            sent = send_json(mine, self.src, self.group, self.device)
            reply, received = recv_json(self.src, self.group, self.device)
            if reply is None:    # the sender goes on to init's next messages, which nothing here will take
                raise lost_link("weight sync init: the sender's handshake reply arrived corrupted")
            refusal = reply["error"] or format_mismatch(reply.get("format"), FORMAT)  # the sender's reasons first
            if refusal:
                raise ValueError("weight sync init: " + refusal)
            self._adopt(mine, reply["keys"], [(sent, received)])
            return reply["version"]
        keys, problems = sender_problems(tensors, keys, version, problems)
        metas = [recv_json(dst, self.group, self.device) for dst in self.dsts]
        # A damaged length word (-1): that receiver still sends its document, which nothing can take in, so it gets
        # no reply; the others get the refusal.
        lost = [dst for dst, (_, length) in zip(self.dsts, metas) if length < 0]
        problems += receiver_problems(mine, [meta for meta, _ in metas], self.dsts)
        reply = {"error": "; ".join(problems) or None, "version": version if is_int(version) else 0, "format": FORMAT,
                 "keys": [k for k in mine["keys"] if k in keys]}
        replied = [send_json(reply, dst, self.group, self.device) for dst in self.dsts if dst not in lost]
        if problems:
            raise ValueError("weight sync init: " + "; ".join(problems))
        self._adopt(metas[0][0], reply["keys"], [(n, r) for (_, n), r in zip(metas, replied)])
        self.sender_shapes = {k: tuple(t.shape) for k, t in tensors.items()}
        return version

    def _adopt(self, meta: dict, synced: list[str], documents: list[tuple[int, int]]) -> None:
        """Layout both sides agree on: the receivers' keys (their order gives each tensor its ordinal), shapes
        and dtypes; the synced keys in that order, tied keys once."""
        self.keys = meta["keys"]
        self.shapes = {k: tuple(s) for k, s in zip(self.keys, meta["shapes"])}
        self.dtypes = {k: named_dtype(d) for k, d in zip(self.keys, meta["dtypes"])}
        self.ordinal = {k: i for i, k in enumerate(self.keys)}
        self.numels = [int(torch.Size(self.shapes[k]).numel()) for k in self.keys]
        self._tie_of = {k: tuple(group) for group in meta["ties"] for k in group}
        self.synced = self.once_per_tie([k for k in self.keys if k in set(synced)])
        self._documents, self._checked = documents, []  # plan(): JSON bytes per receiver, keys checked at init

    def once_per_tie(self, keys: Sequence[str]) -> list[str]:
        """Keep only the first of several keys that are one tensor (tied weights travel once)."""
        first: dict = {}  # tensor (its tie group, else its key) -> its first key
        for key in keys:
            first.setdefault(self._tie_of.get(key, key), key)
        return list(first.values())

    def verify_same_start(self, tensors: dict, sent: list[str], why: str) -> None:
        """Updates assume the receivers hold the sender's weights for the keys outside `sent` (never sent by
        updates, or not bootstrapped): check that once, and raise on both sides naming the keys that differ.

        Crosses ranks at init: one int64 checksum per such key (tied keys once), each receiver -> sender, sender
        -> each.
        """
        keys = self._checked = [k for k in self.once_per_tie(self.keys) if k not in sent]
        if not keys:
            return
        mine = torch.stack([tensor_checksum(tensors[k].detach().to(self.dtypes[k]).contiguous()) for k in keys])
        mine = mine.to(self.device)
        if self.is_sender:
            theirs = {dst: comm.recv(torch.empty_like(mine), SETUP, dst, self.group) for dst in self.dsts}
            for work in [comm.isend(mine, SETUP, dst, self.group) for dst in self.dsts]:
                work.wait()
        else:
            comm.send(mine, SETUP, self.src, self.group)
            theirs = {dist.get_rank(): comm.recv(torch.empty_like(mine), SETUP, self.src, self.group)}
        differ = {rank: [keys[i] for i in (other != mine).nonzero().flatten().tolist()] for rank, other in theirs.items()}
        if any(differ.values()):
            raise SyncIntegrityError(f"weight sync: {why} must start equal on sender and receivers, but these differ "
                                     f"(by receiver rank): { {r: n for r, n in differ.items() if n} }; load the same "
                                     "weights on both sides")

    def plan(self, bootstrap: list[int], rule: str, update: list[int]) -> list[PlanRow]:
        """This rank's rows of the sync plan: the init traffic (handshake, the `bootstrap` messages, the start
        check) and one sync's messages `update` (bytes of each message to one receiver)."""
        self.require(sender=self.is_sender)
        n = len(self.dsts) if self.is_sender else 1
        out, back = ("send", "recv") if self.is_sender else ("recv", "send")
        metadata = [b for m, _ in self._documents for b in (JSON_HEAD_BYTES, m)]
        replies = [b for _, r in self._documents for b in (JSON_HEAD_BYTES, r)]
        rows = [PlanRow(SETUP, "handshake: metadata (JSON)", back, "setup", metadata),
                PlanRow(SETUP, "handshake: reply (JSON)", out, "setup", replies)]
        if bootstrap:
            rows.append(PlanRow(SETUP, "init bootstrap, whole tensors", out, "setup", bootstrap * n))
        rows += [PlanRow(SETUP, "start check: checksum per key", c, "setup", [8 * len(self._checked)] * n)
                 for c in ("send", "recv") if self._checked]
        return rows + [PlanRow(UPDATE, rule, out, "iteration", update * n)]

    # ----- strict checks on every call ------------------------------------------------------------------------

    def require(self, sender: bool, initialized: bool = True, version=...) -> None:
        """Refuse a call of the other role, before or after init as the call needs, or a `version` (when given)
        that is not an integer above the last one sent."""
        if sender != self.is_sender:
            role = "sender" if self.is_sender else "receiver"
            raise RuntimeError(f"weight sync: rank {dist.get_rank()} is the {role}; call the {role} methods")
        if initialized != (self.version is not None):  # a second init would wait for a handshake the peer never sends
            raise RuntimeError("weight sync: " + ("call init_sender/init_receiver first" if initialized else
                               "init already ran: call resync() on both sides to send the weights again"))
        if version is not ... and not is_int(version):
            raise TypeError(f"weight sync: version must be an integer, got {version!r}")
        if version is not ... and version <= self.version:
            raise ValueError(f"weight sync: version must increase, last sent {self.version}, got {version}")

    def tensors(self, model, sender: bool, version=...) -> dict:
        """A call's checks: `require(sender, version=version)`, then the state_dict `model` (sender: a state_dict
        or module) with the keys and shapes (receiver: and dtypes) of init; a KeyError lists missing and unexpected
        keys."""
        self.require(sender, version=version)
        tensors = tensors_of(model)
        shapes = self.sender_shapes if self.is_sender else self.shapes  # the receiver's: by its keys, in order
        missing, unexpected = [k for k in shapes if k not in tensors], [k for k in tensors if k not in shapes]
        if missing or unexpected:
            what = "sender state_dict keys differ from init_sender" if self.is_sender else \
                "receiver model keys differ from init_receiver"
            raise KeyError(f"weight sync: {what}: missing {missing}, unexpected {unexpected}")
        bad = [k for k, t in tensors.items()
               if tuple(t.shape) != shapes[k] or not self.is_sender and t.dtype != self.dtypes[k]]
        if bad:
            raise ValueError(f"weight sync: shape or dtype changed since init for {bad}")
        scattered = [k for k, t in tensors.items() if not self.is_sender and not t.is_contiguous()]
        if scattered:  # refused before anything is received: writes land in place
            raise ValueError(f"weight sync: receiver tensors {scattered} are not contiguous; pass the model's own "
                             "tensors")
        return tensors

    # ----- whole tensors in size-capped buckets -----------------------------------------------------------------

    def send_whole(self, state: dict, keys: Sequence[str], dtypes: Sequence[torch.dtype], bucket_size: int,
                   version: int, kind: int, purpose: str) -> SyncStats:
        """Send `keys` whole in `dtypes` (per ordinal), one frame of dense rows per bucket, to every receiver.

        Crosses ranks: one frame per bucket of at most `bucket_size` bytes to each receiver, once per bucket
        sync, bootstrap or resync. A tensor already in its wire dtype travels from its own memory; the
        checksums that end each frame are computed while its values are in flight. When they fail, the buckets
        after it still go out, each with a trailer the receivers refuse (they take in the rest of a refused
        update), and the first error is raised: the link stays in step for resync()."""
        ordinals = [self.ordinal[k] for k in keys]
        wire = raw = 0
        failure: Optional[BaseException] = None  # the first checksum failure: every later bucket is refused too
        for members in plan_buckets([self.numels[o] * dtypes[o].itemsize for o in ordinals], bucket_size):
            values = [state[keys[i]].detach().reshape(-1).to(dtypes[ordinals[i]]) for i in members]
            table = torch.tensor([[ordinals[i], v.numel(), DENSE, 0] for i, v in zip(members, values)],
                                 dtype=torch.int64).view(-1, 4)

            def sums(values=values):
                nonlocal failure
                if failure is None:
                    try:
                        return [tensor_checksum(v) for v in values]
                    except BaseException as error:
                        failure = error
                raise failure
            try:
                sent = send_frame(kind, version, -1, table, values, sums, self.dsts, self.group, self.device, purpose)
            except BaseException as error:
                if error is not failure:  # a send that failed: nothing more can go out
                    raise
                continue
            wire, raw = wire + sent[0], raw + sent[1]
        if failure is not None:
            raise failure
        return SyncStats(wire, raw, sum(self.numels[o] for o in ordinals), dense_tensors=len(keys))

    def recv_whole(self, tensors: dict, keys: Sequence[str], dtypes: Sequence[torch.dtype], bucket_size: int,
                   kind: int, purpose: str, staged: Optional[list] = None, drop: Optional[tuple] = None,
                   first: Optional[Frame] = None) -> int:
        """Receive what send_whole sent and write it into `tensors`, or, given a list `staged`, append its
        (ordinal, values) there (a fresh buffer per bucket); returns the version.

        Crosses ranks: one frame per bucket from the sender; with `drop` (a resync: what recv_frame expects of
        an update, its purpose, value dtypes and decompress) first any number of queued update frames, received
        whole and dropped, counted under the purpose they were sent with; without, a frame of another kind (a
        resync's) is received whole, unwritten, and refused. `first`: the first bucket's frame, already received
        (a resync's that a non-blocking apply met). Every tensor is checked against the trailer's checksums as
        soon as it arrived. When writing, values already in the receiver's dtype and on the transport device arrive
        straight in the model, so a failed check leaves it written (`model_written`: the receiver then refuses
        updates until resync()); a GPU model fed over gloo is written from a host staging buffer. The buckets
        after a refused one are received and dropped first.
        """
        ordinals = [self.ordinal[k] for k in keys]
        flat = {self.ordinal[k]: tensors[k].view(-1) for k in keys} if staged is None else {}
        into = None if staged is not None else (lambda o: flat[o] if o in flat and flat[o].dtype == dtypes[o]
                                                and flat[o].device == self.device else None)  # gloo: host
        plan = plan_buckets([self.numels[o] * dtypes[o].itemsize for o in ordinals], bucket_size)
        other = drop or (SETUP, [self.dtypes[k] for k in self.keys], None)
        version = None
        for index, members in enumerate(plan):
            frame = first if index == 0 else None
            while frame is None or index == 0 and drop and frame.kind != kind:
                if frame is not None:
                    frame.wait()
                frame = recv_frame(self.src, self.group, self.device, self.numels,
                                   lambda k: (purpose, dtypes, into) if k == kind else other,
                                   self.staging if staged is None else None)
            check_kind(frame, kind)
            expected, failure = [ordinals[i] for i in members], None
            if frame.table[:, 0].tolist() != expected or version not in (None, frame.version):
                frame.wait()  # its receives are posted: take them in, or the link stalls and resync() cannot drain it
                at = '' if version is None else f' at version {version}'
                failure = (f"weight sync: bucket {index} of {len(plan)} at version {frame.version} carries tensors "
                           f"{frame.table[:, 0].tolist()}, expected {expected}{at}; sender and receiver disagree on "
                           "the bucket plan")
            else:
                got = [tensor_checksum(frame.row(r)[1]) for r in range(len(members))]  # each as soon as it arrived
                try:
                    if (torch.stack(got).tolist() if got else []) != frame.sums():
                        failure = (f"weight sync: bucket {index} at version {frame.version} does not match its "
                                   f"checksums (corrupted on the way); {RESYNC_HINT}")
                except SyncIntegrityError as error:  # a refused trailer: values may already be in the model
                    failure = str(error)
            if failure is not None:
                # The rest of this update is queued behind it: take it in now (unwritten), so that the next frame
                # starts a new update (a later resync could not tell the rest of a refused resync from its own).
                for _ in plan[index + 1:]:
                    recv_frame(self.src, self.group, self.device, self.numels, lambda k: (purpose, dtypes, None),
                               self.staging).wait()
                raise SyncIntegrityError(failure, model_written=staged is None)
            for ordinal, (_, values) in zip(frame.table[:, 0].tolist(), frame.segments):  # `tensors` are detached
                if staged is not None:
                    staged.append((ordinal, values))
                elif values.data_ptr() != flat[ordinal].data_ptr():  # else it arrived in place
                    flat[ordinal].copy_(values)
            version = frame.version
        return version

    # ----- receiving ------------------------------------------------------------------------------------------

    def receive(self, blocking: bool, recv: Callable, write: Callable) -> int:
        """apply(): receive the next update with `recv()` and apply it with `write(update)` (returns its version).

        blocking=False never waits: the first call starts `recv` in a background thread; each call (the first too,
        when the update was already there) applies the update once it fully arrived, a Frame's payload and trailer
        too (on the caller's thread, under `self.lock`), and returns the new version, or else the current one (or
        raises what the receive met). Crosses ranks: `recv()`'s update, once per update."""
        if self._inflight is None and not blocking:
            self._inflight = _in_background(recv)
        if self._inflight is None:
            update = recv()
        elif blocking or self._inflight.done():
            future, self._inflight = self._inflight, None
            update = future.result()
        else:
            return self.version
        return self.write_update(lambda: write(update), update)

    def write_update(self, write: Callable[[], int], update=None, resync: bool = False) -> int:
        """Run `write()` (it writes one update into the model and returns its version) under the lock; once an
        update failed after writing, refuse every later one until a `resync` write succeeds. The refusal is read
        and cleared under the lock, so that a verify() on another thread never sees weights and refusal (or
        checksums) of two different moments. Crosses ranks once per update: what `write()` receives, then the
        rest of a received `update` frame (taken in whole even when refused)."""
        try:
            with self.lock:
                if self._broken and not resync:
                    raise SyncIntegrityError(f"weight sync: receiver needs resync() after: {self._broken}")
                try:
                    self.version = write()
                except SyncIntegrityError as error:
                    if error.model_written:
                        self._broken = str(error)
                    raise
                if resync:
                    self._broken = None
        finally:
            if isinstance(update, Frame):  # a refused frame is still received whole: the stream stays in step
                update.wait()
        return self.version

    def resync_whole(self, state_dict_or_model, version: Optional[int], keys: Sequence[str], bucket_size: int,
                     update_dtypes: Sequence[torch.dtype], update_decompress: Optional[Callable] = None,
                     written: Callable[[dict], None] = lambda tensors: None) -> None:
        """Both strategies' resync: the sender sends `keys` whole in the receivers' dtypes and both continue
        from `version`; a receiver first takes in the receive of a non-blocking apply still under way (an update
        is dropped; a resync's first frame starts this resync), then drops the updates still queued for it (any
        number, counted under the purpose they were sent with; `update_dtypes`: their value dtype per ordinal;
        `update_decompress`: how to take in their payload when compressed). Then `written(tensors)` runs, on a
        receiver under the lock once everything landed. Crosses ranks once per resync: the queued update
        frames, then one frame per bucket of `bucket_size`, under the setup purpose."""
        tensors = self.tensors(state_dict_or_model, sender=self.is_sender)
        receiver = [self.dtypes[k] for k in self.keys]
        if self.is_sender:
            if not is_int(version):
                raise ValueError(f"weight sync: the sender's resync needs the (integer) version to restart from, got "
                                 f"{version!r}")
            self.stats = self.send_whole(tensors, keys, receiver, bucket_size, version, KIND_RESYNC, SETUP)
            self.version = version
            written(tensors)
            return
        first = None
        if self._inflight is not None:
            future, self._inflight = self._inflight, None
            try:
                future.result()  # an update received whole: dropped, as the queued ones after it will be
            except UnexpectedKind as error:
                if error.frame.kind != KIND_RESYNC:
                    raise
                first = error.frame
            except SyncIntegrityError as error:  # refused but taken in whole: the link is in step, unless lost
                if error.link_lost:
                    raise

        def write() -> int:
            version = self.recv_whole(tensors, keys, receiver, bucket_size, KIND_RESYNC, SETUP, first=first,
                                      drop=(UPDATE, update_dtypes, None, update_decompress))
            written(tensors)
            return version
        self.write_update(write, resync=True)


def _in_background(recv) -> Future:
    """Run recv() in a daemon thread (a pending receive must not keep the process alive at exit); a Frame it
    returns is waited for whole there, so that applying it never waits for the payload holding the lock."""
    future: Future = Future()

    def run():
        try:
            update = recv()
            future.set_result(update.wait() if isinstance(update, Frame) else update)
        except BaseException as error:  # noqa: BLE001 - delivered to the caller of apply
            future.set_exception(error)

    threading.Thread(target=run, daemon=True, name="weight-sync-receive").start()
    return future
