"""What both strategies share and neither varies: roles, the init handshake, strict key checks, the
start check, versions, the reader lock, the background receive of a non-blocking apply, draining queued
updates before a resync, and the setup rows of the sync plan.

`Link` holds that state and offers it as plain methods (nothing to override); patch.py and bucket.py
each write their own init/sync/apply/resync on top of it, top to bottom.
"""

import json
import threading
from concurrent.futures import Future
from dataclasses import asdict
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from dist import comm
from dist.checksum import tensor_checksum
from dist.plan import PlanRow
from .config import WeightSyncConfig
from .wire import (KIND_RESYNC, SETUP, UPDATE, Frame, SyncIntegrityError, SyncStats, frame_messages, plan_buckets, recv_frame,
                   recv_json, send_json)


class Link:
    def __init__(self, cfg: WeightSyncConfig, src: int, dsts: Sequence[int], group=None, device: str = "cpu"):
        """`src`, `dsts`: global ranks of the sender and receivers; `group`: their process group (None = WORLD).

        `device` is where messages are staged: cpu for gloo, cuda for NCCL. Give the syncer a group of its
        own (dist.new_group) when the receiver also runs collectives while a non-blocking apply is receiving.
        """
        self.cfg, self.src, self.dsts, self.group = cfg, src, tuple(dsts), group
        rank = dist.get_rank()
        if not self.dsts or src in self.dsts or len(set(self.dsts)) != len(self.dsts):
            raise ValueError(f"weight sync: need distinct receiver ranks other than the sender {src}, got {list(dsts)}")
        if rank != src and rank not in self.dsts:
            raise ValueError(f"weight sync: rank {rank} is neither the sender ({src}) nor a receiver ({list(dsts)})")
        backend = dist.get_backend(group)
        if (backend == "nccl") != (device == "cuda"):
            raise ValueError(f"weight sync: the {backend} backend cannot send from device {device!r}; "
                             "use cpu with gloo and cuda with nccl")
        self.is_sender = rank == src
        self.device = torch.device(device)
        self.version: Optional[int] = None  # None until init; then the version in place (receiver) or sent (sender)
        self.lock = threading.Lock()  # readers of the receiver's model hold it to never see a half-applied update
        self.stats: Optional[SyncStats] = None
        self.staging = [torch.empty(0, dtype=torch.uint8, device=self.device)]  # receive buffer, reused
        self._inflight: Optional[Future] = None
        self._broken: Optional[str] = None

    # ----- init handshake -------------------------------------------------------------------------------

    def agree_as_sender(self, state: dict, keys: Optional[Sequence[str]], version: int, problems: list[str]) -> None:
        """Check every receiver's metadata against `state`; both sides raise the same error on a mismatch.

        Crosses ranks once at init: one JSON document from each receiver, one reply to each.
        `keys`: the keys every update carries (None = all); `problems`: the strategy's own config errors.
        """
        keys = list(state) if keys is None else list(keys)
        if set(keys) - set(state):
            problems.append(f"keys to sync not in the sender's state_dict: {sorted(set(keys) - set(state))}")
        if not keys:
            problems.append("the list of keys to sync is empty")
        metas = [recv_json(dst, self.group, self.device) for dst in self.dsts]
        mine = _describe(state, self.cfg)
        for dst, (meta, _) in zip(self.dsts, metas):
            problems += [f"receiver rank {dst}: {p}" for p in _compare(mine, meta)]
            if any(meta[field] != metas[0][0][field] for field in ("keys", "shapes", "dtypes", "ties")):
                problems.append(f"receiver rank {dst} differs from receiver rank {self.dsts[0]} in key order, shapes, "
                                "dtypes or tied keys; one syncer serves identical receivers (use one per kind)")
        reply = {"error": "; ".join(problems) or None, "version": version, "keys": [k for k in mine["keys"] if k in keys]}
        replied = [send_json(reply, dst, self.group, self.device) for dst in self.dsts]
        if problems:
            raise ValueError("weight sync init: " + "; ".join(problems))
        self._adopt(metas[0][0], reply["keys"], [(n, r) for (_, n), r in zip(metas, replied)])
        self.sender_shapes = {k: tuple(t.shape) for k, t in state.items()}

    def agree_as_receiver(self, tensors: dict) -> int:
        """The receiver's half of `agree_as_sender`; returns the starting version."""
        meta = _describe(tensors, self.cfg)
        sent = send_json(meta, self.src, self.group, self.device)
        reply, received = recv_json(self.src, self.group, self.device)
        if reply["error"]:
            raise ValueError("weight sync init: " + reply["error"])
        self._adopt(meta, reply["keys"], [(sent, received)])
        return reply["version"]

    def _adopt(self, meta: dict, synced: list[str], documents: list[tuple[int, int]]) -> None:
        """Layout both sides agree on: receiver keys, shapes and dtypes; synced keys with ties sent once."""
        self.keys = meta["keys"]
        self.shapes = {k: tuple(s) for k, s in zip(meta["keys"], meta["shapes"])}
        self.dtypes = {k: _dtype(d) for k, d in zip(meta["keys"], meta["dtypes"])}
        self.ordinal = {k: i for i, k in enumerate(self.keys)}
        self.numels = [int(torch.Size(self.shapes[k]).numel()) for k in self.keys]
        self._tie_of = {k: tuple(group) for group in meta["ties"] for k in group}
        self.synced = self.once_per_tie(synced)
        self._documents = documents  # (metadata, reply) JSON bytes per receiver, for plan_rows
        self._checked: list[str] = []  # keys compared at init by verify_same_start

    def once_per_tie(self, keys: Sequence[str]) -> list[str]:
        """Keep only the first of several keys that are one tensor (tied weights travel once)."""
        seen, unique = set(), []
        for key in keys:
            tie = self._tie_of.get(key, key)
            if tie not in seen:
                seen.add(tie)
                unique.append(key)
        return unique

    def verify_same_start(self, tensors: dict, keys: list[str], why: str) -> None:
        """Updates assume the receivers hold the sender's weights for `keys` (never sent by updates, or not
        bootstrapped): check that once, and raise on both sides naming the keys that differ.

        Crosses ranks at init: one int64 checksum per key, each receiver -> sender, sender -> each.
        """
        self._checked = keys
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
            theirs = {self.src: comm.recv(torch.empty_like(mine), SETUP, self.src, self.group)}
        differ = {rank: [keys[i] for i in (other != mine).nonzero().flatten().tolist()] for rank, other in theirs.items()}
        differ = {rank: names for rank, names in differ.items() if names}
        if differ:
            raise SyncIntegrityError(f"weight sync: {why} must start equal on sender and receivers, but these differ "
                                     f"(by receiver rank): {differ}; load the same weights on both sides")

    def setup_plan_rows(self, bootstrap: Sequence[str], bucket_size: int) -> list[PlanRow]:
        """This rank's init traffic (see agree_as_sender, send_buckets, verify_same_start) as sync-plan rows."""
        n = len(self.dsts) if self.is_sender else 1
        out, back = ("send", "recv") if self.is_sender else ("recv", "send")
        boot = bucket_messages([self.numels[self.ordinal[k]] * self.dtypes[k].itemsize for k in bootstrap], bucket_size)
        rows = [PlanRow(SETUP, "handshake: metadata (JSON)", back, "setup", [b for m, _ in self._documents for b in (8, m)]),
                PlanRow(SETUP, "handshake: reply (JSON)", out, "setup", [b for _, r in self._documents for b in (8, r)])]
        if bootstrap:
            rows.append(PlanRow(SETUP, "init bootstrap, whole tensors", out, "setup", boot * n))
        if self._checked:
            for collective in ("send", "recv"):
                rows.append(PlanRow(SETUP, "start check: checksum per key", collective, "setup", [8 * len(self._checked)] * n))
        return rows

    def update_plan_row(self, rule: str, messages: list[int]) -> PlanRow:
        """One sync's frames (`messages`: bytes of each message to one receiver) as this rank's plan row."""
        return PlanRow(UPDATE, rule, "send" if self.is_sender else "recv", "iteration",
                       messages * (len(self.dsts) if self.is_sender else 1))

    # ----- strict checks on every call ----------------------------------------------------------------------

    def require(self, sender: bool, initialized: bool = True) -> None:
        if sender != self.is_sender:
            role = "sender" if self.is_sender else "receiver"
            raise RuntimeError(f"weight sync: rank {dist.get_rank()} is the {role}; call the {role} methods")
        if initialized and self.version is None:
            raise RuntimeError("weight sync: call init_sender/init_receiver first")

    def sender_tensors(self, state_dict) -> dict:
        state = tensors_of(state_dict)
        _check_keys(state.keys(), self.sender_shapes.keys(), "sender state_dict", "init_sender")
        bad = [k for k, t in state.items() if tuple(t.shape) != self.sender_shapes[k]]
        if bad:
            raise ValueError(f"weight sync: shapes changed since init_sender for {bad}")
        return state

    def receiver_tensors(self, model) -> dict:
        tensors = tensors_of(model)
        _check_keys(tensors.keys(), self.keys, "receiver model", "init_receiver")
        bad = [k for k, t in tensors.items() if tuple(t.shape) != self.shapes[k] or t.dtype != self.dtypes[k]]
        if bad:
            raise ValueError(f"weight sync: shape or dtype changed since init_receiver for {bad}")
        return tensors

    # ----- receiving ------------------------------------------------------------------------------------------

    def receive(self, tensors: dict, blocking: bool, recv_update: Callable, write: Callable) -> int:
        """apply(): receive the next update with `recv_update()` and apply it with `write(tensors, update)`.

        blocking=False never waits: the first call starts `recv_update` in a background thread and returns
        the current version; a later call applies the update once it fully arrived (on the caller's thread,
        under `self.lock`) and returns the new version.
        """
        if self._inflight is None:
            if blocking:
                return self.write_update(tensors, recv_update(), write)
            self._inflight = _in_background(recv_update)
            return self.version
        if not blocking and not self._inflight.done():
            return self.version
        future, self._inflight = self._inflight, None
        return self.write_update(tensors, future.result(), write)

    def write_update(self, tensors: dict, update, write: Callable) -> int:
        """Apply one received update under the lock; once an update failed after writing, refuse every
        later one until resync()."""
        try:
            if self._broken:
                raise SyncIntegrityError(f"weight sync: receiver needs resync() after: {self._broken}")
            with self.lock:
                try:
                    write(tensors, update)
                except SyncIntegrityError as error:
                    if error.model_written:
                        self._broken = str(error)
                    raise
                self.version = update.version
        finally:
            if isinstance(update, Frame):  # a refused frame is still received whole: the stream stays in step
                update.wait()
        return self.version

    def drain_until_resync(self, update_dtypes: Sequence[torch.dtype]):
        """Resync on the receiver: discard queued updates (any number, counted under the purpose the sender
        sent them with) until the first frame of the resync arrives, and return it. Crosses ranks: receives
        those frames. `update_dtypes`: the value dtype per ordinal in updates (resync frames: the receiver's)."""
        if self._inflight is not None:
            raise RuntimeError("weight sync: a non-blocking apply is still receiving; finish it with apply(model) "
                               "before resync()")
        receiver = [self.dtypes[k] for k in self.keys]
        while True:
            frame = recv_frame(self.src, self.group, self.device, lambda kind: SETUP if kind == KIND_RESYNC else UPDATE,
                               self.numels, lambda kind: receiver if kind == KIND_RESYNC else update_dtypes, self.staging)
            if frame.kind == KIND_RESYNC:
                return frame
            frame.wait()


def bucket_messages(nbytes: Sequence[int], bucket_size: int) -> list[int]:
    """Bytes of each message that send_buckets sends one receiver for tensors of these sizes."""
    return [b for members in plan_buckets(nbytes, bucket_size)
            for b in frame_messages(len(members), [nbytes[i] for i in members if nbytes[i]])]


def trainable_keys(module: torch.nn.Module) -> list[str]:
    """State-dict keys of parameters with requires_grad and of persistent buffers: what changes in training."""
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return [k for k in module.state_dict() if k not in frozen]


def tensors_of(model) -> dict:
    if isinstance(model, torch.nn.Module):
        return model.state_dict()  # detached tensors sharing the module's memory
    if isinstance(model, Mapping):
        return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in model.items()}
    raise TypeError(f"weight sync: expected an nn.Module or a state_dict, got {type(model).__name__}")


def _describe(tensors: dict, cfg: WeightSyncConfig) -> dict:
    """The handshake document: everything both sides must agree on for the wire format to line up."""
    not_tensors = [k for k, t in tensors.items() if not isinstance(t, torch.Tensor)]
    return {
        "config": json.loads(json.dumps(asdict(cfg))),
        "keys": list(tensors),
        "shapes": [list(t.shape) if isinstance(t, torch.Tensor) else [] for t in tensors.values()],
        "dtypes": [str(t.dtype) if isinstance(t, torch.Tensor) else "?" for t in tensors.values()],
        "ties": _tie_groups(tensors),
        "not_tensors": not_tensors,
        "not_contiguous": [k for k, t in tensors.items() if k not in not_tensors and not t.is_contiguous()],
    }


def _compare(sender: dict, receiver: dict) -> list[str]:
    """Reasons the receiver's metadata cannot take the sender's updates (empty when it can)."""
    if receiver["config"] != sender["config"]:
        diff = {k: (sender["config"][k], receiver["config"][k]) for k in sender["config"]
                if sender["config"][k] != receiver["config"][k]}
        return [f"weight sync config differs from the sender's (sender, receiver): {diff}"]
    problems = [f"{what} on the {side}: {meta[what]}" for side, meta in (("sender", sender), ("receiver", receiver))
                for what in ("not_tensors", "not_contiguous") if meta[what]]
    missing = [k for k in sender["keys"] if k not in receiver["keys"]]
    unexpected = [k for k in receiver["keys"] if k not in sender["keys"]]
    if missing or unexpected:
        problems.append(f"state_dict keys differ: missing on the receiver {missing}, unexpected on the receiver {unexpected}")
        return problems
    mine = dict(zip(sender["keys"], zip(sender["shapes"], sender["dtypes"])))
    for key, shape, dtype in zip(receiver["keys"], receiver["shapes"], receiver["dtypes"]):
        sender_shape, sender_dtype = mine[key]
        if shape != sender_shape:
            problems.append(f"{key!r} has shape {shape} on the receiver and {sender_shape} on the sender")
        elif dtype != sender_dtype and not (_dtype(dtype).is_floating_point and _dtype(sender_dtype).is_floating_point):
            problems.append(f"{key!r} is {dtype} on the receiver and {sender_dtype} on the sender "
                            "(only floating dtypes may differ)")
    if sorted(receiver["ties"]) != sorted(sender["ties"]):
        problems.append(f"tied keys differ: sender {sender['ties']}, receiver {receiver['ties']}")
    return problems


def _tie_groups(tensors: dict) -> list[list[str]]:
    """Keys whose tensors are the same memory (tied weights): sent once, under the first key."""
    groups: dict = {}
    for key, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.numel():
            place = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            groups.setdefault(place, []).append(key)
    return [g for g in groups.values() if len(g) > 1]


def _check_keys(actual, expected, what: str, where: str) -> None:
    actual, expected = list(actual), list(expected)
    missing = [k for k in expected if k not in set(actual)]
    unexpected = [k for k in actual if k not in set(expected)]
    if missing or unexpected:
        raise KeyError(f"weight sync: {what} keys differ from {where}: missing {missing}, unexpected {unexpected}")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r} in metadata")
    return dtype


def _in_background(fn) -> Future:
    """Run fn in a daemon thread (a pending receive must not keep the process alive at exit)."""
    future: Future = Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as error:  # noqa: BLE001 - delivered to the caller of apply
            future.set_exception(error)

    threading.Thread(target=run, daemon=True, name="weight-sync-receive").start()
    return future
