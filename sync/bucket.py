"""bucket strategy: every sync sends the synced tensors whole, packed into size-capped buckets.

No sender snapshot and no assumption about sparsity; the simplest semantics and the most bytes. Each
bucket is one checksummed frame (see wire.py). Keys that no sync carries (frozen weights) must start
equal on both sides: init checks them, as the patch strategy does.
"""

from dataclasses import dataclass

import torch

from .config import BUCKET_DTYPES, WeightSyncConfig
from .link import Link, tensors_of
from .wire import (KIND_BUCKET, KIND_RESYNC, SETUP, UPDATE, SyncIntegrityError, SyncStats, copy_into, recv_buckets,
                   send_buckets)


@dataclass
class BucketUpdate:
    version: int
    pairs: list  # (key, flat typed view of the received bytes), all buckets of one update


class BucketSyncer(Link):
    def __init__(self, cfg: WeightSyncConfig, src: int, dsts, group=None):
        super().__init__(cfg, src, dsts, group, device=cfg.bucket.bucket_device)

    def init_sender(self, state_dict, keys=None, version: int = 0) -> None:
        """Handshake (Link.agree_as_sender), then check that the keys no sync carries start equal
        (Link.verify_same_start). `keys`: what every sync carries (None = all)."""
        self.require(sender=True, initialized=False)
        state = tensors_of(state_dict)
        self.agree_as_sender(state, keys, version, [])
        self._verify_frozen(state)
        self.version = version

    def init_receiver(self, model) -> int:
        self.require(sender=False, initialized=False)
        tensors = tensors_of(model)
        version = self.agree_as_receiver(tensors)
        self._verify_frozen(tensors)
        self.version = version
        return version

    def _verify_frozen(self, tensors: dict) -> None:
        frozen = [k for k in self.once_per_tie(self.keys) if k not in self.synced]
        self.verify_same_start(tensors, frozen, "keys that no sync carries (frozen weights)")

    def _items(self) -> list:
        """(key, shape, wire dtype): bucket_dtype for floating tensors when set, else the receiver's dtype
        (exact, and half the bytes of an fp32 sender when the receiver is bf16). Ints and bools keep theirs."""
        name = self.cfg.bucket.bucket_dtype
        return [(k, self.shapes[k], BUCKET_DTYPES[name] if name and self.dtypes[k].is_floating_point else self.dtypes[k])
                for k in self.synced]

    def sync(self, state_dict, version: int) -> SyncStats:
        """Send every synced tensor whole as update `version`. Crosses ranks once per call: one frame per
        bucket to each receiver (see wire.send_buckets)."""
        self.require(sender=True)
        if version <= self.version:
            raise ValueError(f"weight sync: version must increase, last sent {self.version}, got {version}")
        state = self.sender_tensors(state_dict)
        wire, payload = send_buckets([(state[k], dtype) for k, _, dtype in self._items()], self.cfg.bucket.bucket_size,
                                     version, KIND_BUCKET, self.dsts, self.group, self.device, UPDATE)
        self.version = version
        self.stats = SyncStats(wire, payload, sum(state[k].numel() for k in self.synced), dense_tensors=len(self.synced))
        return self.stats

    def apply(self, model, blocking: bool = True) -> int:
        """Receive the next update and write it; returns the version now in place. With load_instant each
        bucket is written as it arrives (readers are kept out by the lock until the last one lands)."""
        self.require(sender=False)
        tensors = self.receiver_tensors(model)
        if not self.cfg.bucket.load_instant:
            return self.receive(tensors, blocking, self.recv_update, lambda t, update: copy_into(t, update.pairs))
        if not blocking:
            raise ValueError("weight sync: bucket.load_instant=true writes buckets as they arrive, which a "
                             "non-blocking apply would expose half-done; set bucket.load_instant=false for "
                             "apply(model, blocking=False)")
        if self._broken:
            raise SyncIntegrityError(f"weight sync: receiver needs resync() after: {self._broken}")
        written = []

        def write(pairs):
            copy_into(tensors, pairs)
            written.append(len(pairs))

        with self.lock:
            try:
                self.version = recv_buckets(self._items(), self.cfg.bucket.bucket_size, KIND_BUCKET, self.src,
                                            self.group, self.device, UPDATE, write)
            except SyncIntegrityError as error:
                if written:  # earlier buckets of this update are already in the model
                    self._broken = str(error)
                    raise SyncIntegrityError(str(error), model_written=True) from error
                raise
        return self.version

    def recv_update(self) -> BucketUpdate:
        """Receive all buckets of the next update and keep them staged; nothing is written yet."""
        staged = []
        version = recv_buckets(self._items(), self.cfg.bucket.bucket_size, KIND_BUCKET, self.src, self.group,
                               self.device, UPDATE, staged.extend)
        return BucketUpdate(version, staged)

    def resync(self, state_dict_or_model, version=None) -> int:
        """Send everything again and restart from `version` (sender resync(state_dict, version), receivers
        resync(model)); queued updates are dropped first. Crosses ranks: the synced keys whole, once."""
        self.require(sender=self.is_sender)
        items = [(k, self.shapes[k], self.dtypes[k]) for k in self.synced]
        if self.is_sender:
            if version is None:
                raise ValueError("weight sync: the sender's resync needs the version to restart from")
            state = self.sender_tensors(state_dict_or_model)
            wire, payload = send_buckets([(state[k], dtype) for k, _, dtype in items], self.cfg.bucket.bucket_size,
                                         version, KIND_RESYNC, self.dsts, self.group, self.device, SETUP)
            self.stats = SyncStats(wire, payload, sum(state[k].numel() for k in self.synced))
            self.version = version
            return version
        first = self.drain_until_resync(KIND_RESYNC)
        tensors = self.receiver_tensors(state_dict_or_model)
        with self.lock:
            self.version = recv_buckets(items, self.cfg.bucket.bucket_size, KIND_RESYNC, self.src, self.group,
                                        self.device, SETUP, lambda pairs: copy_into(tensors, pairs), first=first)
            self._broken = None
        return self.version
