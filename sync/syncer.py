"""The sender/receiver flow shared by the patch and bucket strategies.

One sender rank (the trainer) feeds one or more receiver ranks (rollout copies) of a process group:

    sender:   init_sender(state_dict, keys, version)   ... sync(state_dict, version) each iteration
    receiver: init_receiver(model)                     ... apply(model) -> version of what is in place

Init is a handshake: each receiver sends its metadata (the config, ordered keys, shapes, dtypes, tied
keys); the sender checks it strictly against its own state_dict and replies with either an error that
both sides raise, or the keys every update will carry and the starting version. After that, updates are
typed tensors only (see transport.py).

A strategy (bucket.py, patch.py) provides `_send`, `recv_update` and `_write`; this class owns roles,
versions, the strict key checks, the lock that keeps readers from seeing a half-applied update, the
background receive of `apply(model, blocking=False)`, and `resync()`.
"""

import json
import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from .bucket_transfer import copy_into, recv_buckets, send_buckets
from .config import WeightSyncConfig
from .transport import SyncIntegrityError, dtype_from_name, recv_json, send_json


@dataclass
class SyncStats:
    """What the sender's last sync or resync put on the wire, per receiver."""
    wire_bytes: int  # headers, tables and payloads as sent (after compression)
    payload_bytes: int  # index and value bytes before compression
    changed_elements: int  # elements whose bits differ from the previous version (bucket: all of them)
    sparse_tensors: int = 0
    dense_tensors: int = 0


class WeightSyncer:
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
        self._inflight: Optional[Future] = None
        self._broken: Optional[str] = None

    # ----- init: handshake -----------------------------------------------------------------------------

    def init_sender(self, state_dict, keys: Optional[Sequence[str]] = None, version: int = 0) -> None:
        """Handshake with every receiver, then the strategy's own setup (patch: bootstrap and snapshot).

        Crosses ranks once: one metadata document from each receiver, one reply to each.
        `keys`: the keys every update carries (None = all); typically trainable parameters and persistent
        buffers (see `trainable_keys`), so frozen parameters travel only in the init bootstrap and resync.
        """
        self._require_role(sender=True)
        state = _tensors_of(state_dict)
        keys = list(state) if keys is None else list(keys)
        problems = [f"keys to sync not in the sender's state_dict: {sorted(set(keys) - set(state))}"] \
            if set(keys) - set(state) else []
        if not keys:
            problems.append("the list of keys to sync is empty")
        problems += self._config_problems(state)
        metas = [recv_json(dst, self.group, self.device) for dst in self.dsts]
        mine = _describe(state, self.cfg)
        for dst, meta in zip(self.dsts, metas):
            problems += [f"receiver rank {dst}: {p}" for p in _compare(mine, meta)]
            if any(meta[field] != metas[0][field] for field in ("keys", "shapes", "dtypes", "ties")):
                problems.append(f"receiver rank {dst} differs from receiver rank {self.dsts[0]} in key order, shapes, "
                                "dtypes or tied keys; one syncer serves identical receivers (use one per kind)")
        reply = {"error": "; ".join(problems) or None, "version": version, "keys": [k for k in mine["keys"] if k in keys]}
        for dst in self.dsts:
            send_json(reply, dst, self.group, self.device)
        if problems:
            raise ValueError("weight sync init: " + "; ".join(problems))
        self._adopt(metas[0], reply["keys"])
        self._sender_shapes = {k: tuple(t.shape) for k, t in state.items()}
        self.version = version
        self._setup_sender(state)

    def init_receiver(self, model) -> int:
        """Handshake with the sender (see init_sender), then the strategy's own setup; returns the version."""
        self._require_role(sender=False)
        tensors = _tensors_of(model)
        meta = _describe(tensors, self.cfg)
        send_json(meta, self.src, self.group, self.device)
        reply = recv_json(self.src, self.group, self.device)
        if reply["error"]:
            raise ValueError("weight sync init: " + reply["error"])
        self._adopt(meta, reply["keys"])
        with self.lock:
            self._setup_receiver(tensors)
            self.version = reply["version"]
        return self.version

    def _adopt(self, meta: dict, synced: list[str]) -> None:
        """Layout both sides agree on: receiver keys, shapes and dtypes; synced keys with ties sent once."""
        self.keys = meta["keys"]
        self.shapes = {k: tuple(s) for k, s in zip(meta["keys"], meta["shapes"])}
        self.dtypes = {k: dtype_from_name(d) for k, d in zip(meta["keys"], meta["dtypes"])}
        self._tie_of = {k: tuple(group) for group in meta["ties"] for k in group}
        self.synced = self._once_per_tie(synced)

    def _once_per_tie(self, keys: list[str]) -> list[str]:
        """Keep only the first of several keys that are one tensor (tied weights travel once)."""
        seen, unique = set(), []
        for key in keys:
            tie = self._tie_of.get(key, key)
            if tie not in seen:
                seen.add(tie)
                unique.append(key)
        return unique

    # ----- updates ---------------------------------------------------------------------------------------

    def sync(self, state_dict, version: int) -> SyncStats:
        """Send the sender's current weights as update `version` (must exceed the last one) to all receivers.

        Crosses ranks once per call (typically once per training iteration): one update to each receiver,
        a patch (header, table, changed elements) or buckets (header and bytes per bucket). Blocks until
        every receiver has it; returns what went on the wire.
        """
        self._require_role(sender=True, initialized=True)
        if version <= self.version:
            raise ValueError(f"weight sync: version must increase, last sent {self.version}, got {version}")
        state = self._sender_tensors(state_dict)
        self.stats = self._send(state, version)
        self.version = version
        return self.stats

    def apply(self, model, blocking: bool = True) -> int:
        """Receive the next update and apply it to `model`; returns the version now in place.

        Crosses ranks: receives the one update the sender's matching sync() sends (nothing is sent back).

        blocking=False never waits: the first call starts receiving in a background thread and returns the
        current version; a later call applies the update once it has fully arrived (on the caller's
        thread, under `self.lock`) and returns the new version. The model is written only inside `lock`.
        """
        self._require_role(sender=False, initialized=True)
        tensors = self._receiver_tensors(model)
        if self._inflight is None:
            if blocking:
                return self._receive_and_apply(tensors)
            self._check_async_allowed()
            self._inflight = _in_background(self.recv_update)
            return self.version
        if not blocking and not self._inflight.done():
            return self.version
        future, self._inflight = self._inflight, None
        return self.apply_update(tensors, future.result())

    def apply_update(self, model, update) -> int:
        """Apply an update returned by `recv_update()`; returns the new version. Refuses with
        SyncIntegrityError when the update does not fit this receiver; once an update failed after
        writing, every later one is refused until resync()."""
        tensors = self._receiver_tensors(model)
        if self._broken:
            raise SyncIntegrityError(f"weight sync: receiver needs resync() after: {self._broken}")
        with self.lock:
            try:
                self._write(tensors, update)
            except SyncIntegrityError as error:
                if error.model_written:
                    self._broken = str(error)
                raise
            self.version = update.version
        return self.version

    def _receive_and_apply(self, tensors: dict) -> int:
        return self.apply_update(tensors, self.recv_update())

    def _check_async_allowed(self) -> None:
        pass

    # ----- resync ------------------------------------------------------------------------------------------

    def resync(self, state_dict_or_model, version: Optional[int] = None) -> int:
        """Re-bootstrap every receiver through the bucket path and start again from `version`.

        Sender: resync(state_dict, version); receivers: resync(model). Crosses ranks: the resync keys
        (the synced keys and the init-bootstrap keys) as whole tensors in the receivers' dtypes.
        """
        self._require_role(sender=self.is_sender, initialized=True)
        wanted = set(self.synced) | set(self._bootstrap_keys())
        keys = self._once_per_tie([k for k in self.keys if k in wanted])
        if self.is_sender:
            if version is None:
                raise ValueError("weight sync: the sender's resync needs the version to restart from")
            state = self._sender_tensors(state_dict_or_model)
            wire, payload = send_buckets([(state[k], self.dtypes[k]) for k in keys], self._bootstrap_bucket_size(),
                                         version, self.dsts, self.group, self.device)
            self.stats = SyncStats(wire, payload, sum(state[k].numel() for k in keys))
            self._setup_sender(state, bootstrap=False)
            self.version = version
            return version
        if self._inflight is not None:
            raise RuntimeError("weight sync: a non-blocking apply is still receiving; finish it with "
                               "apply(model) before resync()")
        tensors = self._receiver_tensors(state_dict_or_model)
        with self.lock:
            self.version = recv_buckets([(k, self.shapes[k], self.dtypes[k]) for k in keys],
                                        self._bootstrap_bucket_size(), self.src, self.group, self.device,
                                        on_bucket=lambda pairs: copy_into(tensors, pairs))
            self._setup_receiver(tensors, bootstrap=False)
            self._broken = None
        return self.version

    # ----- strict checks -----------------------------------------------------------------------------------

    def _require_role(self, sender: bool, initialized: bool = False) -> None:
        if sender != self.is_sender:
            role = "sender" if self.is_sender else "receiver"
            raise RuntimeError(f"weight sync: rank {dist.get_rank()} is the {role}; call the {role} methods")
        if initialized and self.version is None:
            raise RuntimeError("weight sync: call init_sender/init_receiver first")

    def _sender_tensors(self, state_dict) -> dict:
        state = _tensors_of(state_dict)
        _check_keys(state.keys(), self._sender_shapes.keys(), "sender state_dict", "init_sender")
        bad = [k for k, t in state.items() if tuple(t.shape) != self._sender_shapes[k]]
        if bad:
            raise ValueError(f"weight sync: shapes changed since init_sender for {bad}")
        return state

    def _receiver_tensors(self, model) -> dict:
        tensors = _tensors_of(model)
        _check_keys(tensors.keys(), self.keys, "receiver model", "init_receiver")
        bad = [k for k, t in tensors.items() if tuple(t.shape) != self.shapes[k] or t.dtype != self.dtypes[k]]
        if bad:
            raise ValueError(f"weight sync: shape or dtype changed since init_receiver for {bad}")
        return tensors

    # ----- strategy hooks -----------------------------------------------------------------------------------

    def _config_problems(self, state: dict) -> list[str]:
        return []

    def _bootstrap_keys(self) -> list[str]:
        return []

    def _bootstrap_bucket_size(self) -> int:
        raise NotImplementedError

    def _setup_sender(self, state: dict, bootstrap: bool = True) -> None:
        pass

    def _setup_receiver(self, tensors: dict, bootstrap: bool = True) -> None:
        pass


def trainable_keys(module: torch.nn.Module) -> list[str]:
    """State-dict keys of parameters with requires_grad and of persistent buffers: what changes in training."""
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return [k for k in module.state_dict() if k not in frozen]


def _tensors_of(model) -> dict:
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
    problems = [f"{what} on the {side}: {receiver[what] if side == 'receiver' else sender[what]}"
                for side, meta in (("sender", sender), ("receiver", receiver))
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
        elif dtype != sender_dtype and not (_is_float(dtype) and _is_float(sender_dtype)):
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


def _is_float(dtype_name: str) -> bool:
    return dtype_from_name(dtype_name).is_floating_point


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
