"""bucket strategy: every sync sends the synced tensors whole, one frame of dense rows per size-capped bucket.

No sender snapshot and no assumption about sparsity; the simplest semantics and the most bytes. A tensor
already in its wire dtype travels from its own memory, and each frame's checksums are computed on both
sides while its values are in flight (see wire.py). Keys that no sync carries (frozen weights) must
start equal on both sides: init checks them, as the patch strategy does.
"""

from dataclasses import dataclass

import torch

from dist.plan import PlanRow
from .config import BUCKET_DTYPES, WeightSyncConfig
from .link import Link, bucket_messages, tensors_of
from .wire import KIND_BUCKET, KIND_RESYNC, SETUP, UPDATE, SyncIntegrityError, SyncStats, recv_buckets, send_buckets


@dataclass
class BucketUpdate:
    version: int
    pairs: list  # (ordinal, flat typed view of the received bytes), all buckets of one update


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

    def _wire_dtypes(self, kind: int = KIND_BUCKET) -> list[torch.dtype]:
        """Per ordinal: bucket_dtype for floating tensors when set, else the receiver's dtype (exact, and half
        the bytes of an fp32 sender when the receiver is bf16). Ints, bools and resyncs keep the receiver's."""
        name = self.cfg.bucket.bucket_dtype
        return [BUCKET_DTYPES[name] if name and kind == KIND_BUCKET and self.dtypes[k].is_floating_point
                else self.dtypes[k] for k in self.keys]

    def _send(self, state_dict, version: int, kind: int, purpose: str) -> SyncStats:
        state = self.sender_tensors(state_dict)
        dtypes = self._wire_dtypes(kind)
        wire, payload = send_buckets([(self.ordinal[k], state[k], dtypes[self.ordinal[k]]) for k in self.synced],
                                     self.cfg.bucket.bucket_size, version, kind, self.dsts, self.group, self.device,
                                     purpose)
        self.version = version
        self.stats = SyncStats(wire, payload, sum(state[k].numel() for k in self.synced), dense_tensors=len(self.synced))
        return self.stats

    def _recv(self, kind: int, purpose: str, on_bucket, first=None, staging=None) -> int:
        return recv_buckets([self.ordinal[k] for k in self.synced], self.numels, self._wire_dtypes(kind),
                            self.cfg.bucket.bucket_size, kind, self.src, self.group, self.device, purpose, on_bucket,
                            first, staging)

    def _write(self, tensors: dict, pairs) -> None:
        with torch.no_grad():
            for ordinal, value in pairs:
                tensors[self.keys[ordinal]].view(-1).copy_(value)

    def plan_rows(self) -> list[PlanRow]:
        """This rank's sync-plan rows (after init): the init traffic, then the buckets of each sync()."""
        dtypes = self._wire_dtypes()
        nbytes = [self.numels[self.ordinal[k]] * dtypes[self.ordinal[k]].itemsize for k in self.synced]
        return self.setup_plan_rows([], 1) + \
            [self.update_plan_row("bucket: synced tensors whole", bucket_messages(nbytes, self.cfg.bucket.bucket_size))]

    def sync(self, state_dict, version: int) -> SyncStats:
        """Send every synced tensor whole as update `version`. Crosses ranks once per call: one frame per
        bucket to each receiver (see wire.send_buckets)."""
        self.require(sender=True)
        if version <= self.version:
            raise ValueError(f"weight sync: version must increase, last sent {self.version}, got {version}")
        return self._send(state_dict, version, KIND_BUCKET, UPDATE)

    def apply(self, model, blocking: bool = True) -> int:
        """Receive the next update and write it; returns the version now in place. With load_instant each
        bucket is written as soon as it arrived and was checked (readers are kept out by the lock until the
        last one lands)."""
        self.require(sender=False)
        tensors = self.receiver_tensors(model)
        if not self.cfg.bucket.load_instant:
            return self.receive(tensors, blocking, self.recv_update, lambda t, update: self._write(t, update.pairs))
        if not blocking:
            raise ValueError("weight sync: bucket.load_instant=true writes buckets as they arrive, which a "
                             "non-blocking apply would expose half-done; set bucket.load_instant=false for "
                             "apply(model, blocking=False)")
        if self._broken:
            raise SyncIntegrityError(f"weight sync: receiver needs resync() after: {self._broken}")
        written = []

        def write(pairs):
            self._write(tensors, pairs)
            written.append(len(pairs))

        with self.lock:
            try:
                self.version = self._recv(KIND_BUCKET, UPDATE, write, staging=self.staging)
            except SyncIntegrityError as error:
                if written:  # earlier buckets of this update are already in the model
                    self._broken = str(error)
                    raise SyncIntegrityError(str(error), model_written=True) from error
                raise
        return self.version

    def recv_update(self) -> BucketUpdate:
        """Receive all buckets of the next update and keep them staged (one buffer each); nothing is written."""
        staged = []
        return BucketUpdate(self._recv(KIND_BUCKET, UPDATE, staged.extend), staged)

    def resync(self, state_dict_or_model, version=None) -> int:
        """Send everything again, in the receivers' dtypes, and restart from `version` (sender
        resync(state_dict, version), receivers resync(model)); queued updates are dropped first.
        Crosses ranks: the synced keys whole, once, under the setup purpose."""
        self.require(sender=self.is_sender)
        if self.is_sender:
            if version is None:
                raise ValueError("weight sync: the sender's resync needs the version to restart from")
            self._send(state_dict_or_model, version, KIND_RESYNC, SETUP)
            return version
        first = self.drain_until_resync(self._wire_dtypes())
        tensors = self.receiver_tensors(state_dict_or_model)
        with self.lock:
            self.version = self._recv(KIND_RESYNC, SETUP, lambda pairs: self._write(tensors, pairs), first, self.staging)
            self._broken = None
        return self.version
